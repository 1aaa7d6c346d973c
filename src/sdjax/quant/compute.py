"""fp8 compute for Dense layers (`QuantPolicy(compute="fp8")`): both operands of a Dense layer's product in
float8_e4m3fn, accumulated in float32.

Weight-only quantization (`sdjax.quant.modules`) turns each kernel back into the compute dtype before the layer
runs: it saves memory and bandwidth, and the product runs at the bf16 rate. Hopper-class GPUs (and TPU v7) multiply
fp8 at twice that rate. Here a Dense layer whose kernel is stored as fp8 keeps it fp8 and quantizes its input to
fp8 on the fly:

- input scale: one per call and tensor, `s_x = max|x| / 448` (dynamic: no calibration pass, and exact for every
  input range; the reduction is one more pass over the activation);
- `y = (q_x @ q_w) * s_x * s_w + b`, `q_x = fp8(x / s_x)`, `q_w` the stored fp8 kernel and `s_w` its per-output-
  channel scale; the product is asked for with float32 accumulation (`preferred_element_type`).

Convolutions keep the weight-only path (dequantized to the compute dtype), as do int8 kernels; attention, norms
and everything that is not a Dense layer run in the compute dtype. Only `flax.linen.Dense` layers are replaced
(through `nn.intercept_methods`, so the model code is unchanged); every 2-D kernel in sdjax's models belongs to one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sdjax.quant import params as params_lib
from sdjax.quant import scheme as scheme_lib

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def _fp8_dense_node(node: Any) -> bool:
    return (
        params_lib.is_quantized_node(node)
        and node[params_lib.KERNEL].ndim == 2
        and node[params_lib.KERNEL].dtype == FP8
    )


def dequantize_except_dense(tree: Any, dtype: Any) -> Any:
    """`params.dequantize_tree`, except that 2-D fp8 kernels (Dense layers) keep their fp8 values and scale."""
    if not isinstance(tree, Mapping):
        return tree
    if _fp8_dense_node(tree):
        return dict(tree)
    out = {k: dequantize_except_dense(v, dtype) for k, v in tree.items() if k != params_lib.SCALE}
    if params_lib.is_quantized_node(tree):
        out[params_lib.KERNEL] = scheme_lib.dequantize_kernel(tree[params_lib.KERNEL], tree[params_lib.SCALE], dtype)
    return out


def quantize_input(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(fp8(x / s), s)` with `s = max|x| / 448` (float32; a tensor of zeros gets s = 1)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    s = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(x.astype(jnp.float32) / s, -FP8_MAX, FP8_MAX).astype(FP8), s


def dense_fp8(x: jax.Array, q: jax.Array, scale: jax.Array, bias: jax.Array | None, dtype: Any) -> jax.Array:
    """A Dense layer `x @ (q * scale) + bias` with its input quantized to fp8 and an fp8 x fp8 product."""
    qx, sx = quantize_input(x)
    y = jax.lax.dot_general(qx, q, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    y = (y * (sx * scale.astype(jnp.float32))).astype(dtype)
    return y if bias is None else y + bias.astype(dtype)


def fp8_dense_interceptor(next_fun, args, kwargs, context):
    """An `nn.intercept_methods` interceptor: a Dense layer's `__call__` whose params hold an fp8 kernel and its
    scale runs as `dense_fp8`; every other method call runs unchanged."""
    module = context.module
    if context.method_name != "__call__" or not isinstance(module, nn.Dense):
        return next_fun(*args, **kwargs)
    params = module.variables.get("params", {})
    if not _fp8_dense_node(params):
        return next_fun(*args, **kwargs)
    (x,) = args
    dtype = module.dtype or x.dtype
    bias = params.get("bias") if module.use_bias else None
    return dense_fp8(x, params[params_lib.KERNEL], params[params_lib.SCALE], bias, dtype)
