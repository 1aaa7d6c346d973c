"""Quantized compute for Dense layers (`QuantPolicy(compute="int8" | "fp8")`): both operands of a Dense layer's
product in 8 bits, int8 x int8 accumulated in int32, or float8_e4m3fn x float8_e4m3fn accumulated in float32.

Weight-only quantization (`sdjax.quant.modules`) turns each kernel back into the compute dtype before the layer
runs: it saves memory and bandwidth, and the product runs at the bf16 rate. TPU v5e / v6e multiply int8 at twice
their bf16 rate, Hopper-class GPUs (and TPU v7) fp8. Here a Dense layer whose kernel is stored in the compute mode's
8-bit type keeps it that way and quantizes its input too:

- input scale, one per call and tensor: `s_x = amax / qmax` (`qmax` 127 for int8: symmetric, -128 unused; 448 for
  e4m3). `amax` is the input's own `max|x|` (dynamic: exact for every input range, one more reduction over the
  activation) or, with a calibration (`sdjax.quant.calibration`), the largest `max|x|` the layer saw on a few
  calibration prompts (static: a constant of the program; inputs beyond it saturate at +-qmax).
- `y = (q_x @ q_w) * s_x * s_w + b` with `q_x = round(x / s_x)` clipped to [-qmax, qmax] (int8) or
  `float8(x / s_x)` (fp8), `q_w` the stored kernel and `s_w` its per-output-channel scale. int8 products go
  through `lax.dot_general(..., preferred_element_type=int32)`: exact integer sums (|q_x q_w| <= 127 * 128, so
  up to 2^31 / 16256 = 132,104 terms fit), converted to float32 once and scaled.

Per tensor rather than per token: one number per layer is what a calibration file can hold, and the same rule
serves both the dynamic and the static scales. Convolutions keep the weight-only path (dequantized to the compute
dtype); so do kernels of the other 8-bit type. Attention, norms and everything that is not a Dense layer run in the
compute dtype. Only `flax.linen.Dense` layers are replaced (through `nn.intercept_methods`, so the model code is
unchanged); every 2-D kernel in sdjax's models belongs to one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sdjax.quant import scheme as scheme_lib

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
INT8_MAX = 127.0  # activations: symmetric [-127, 127]

# compute mode -> (operand dtype, largest quantized magnitude of an input, accumulation dtype)
MODES: dict[str, tuple[Any, float, Any]] = {
    "int8": (jnp.int8, INT8_MAX, jnp.int32),
    "fp8": (FP8, FP8_MAX, jnp.float32),
}


def is_compute_node(node: Any, mode: str) -> bool:
    """A Dense layer's `{kernel, kernel_scale}` whose 2-D kernel is stored in `mode`'s type."""
    return (
        scheme_lib.is_quantized_node(node)
        and node[scheme_lib.KERNEL].ndim == 2
        and node[scheme_lib.KERNEL].dtype == MODES[mode][0]
    )


def compute_kernels(tree: Any, mode: str, path: str = "") -> dict[str, tuple[Any, Any]]:
    """`path -> (q, scale)` of the kernels that `mode` multiplies quantized (paths as `params.quantized_kernels`)."""
    return {
        p: (q, s)
        for p, (q, s) in scheme_lib.quantized_kernels(tree, path).items()
        if q.ndim == 2 and q.dtype == MODES[mode][0]
    }


def dequantize_except_dense(tree: Any, dtype: Any, mode: str = "fp8") -> Any:
    """`params.dequantize_tree`, except that `mode`'s 2-D kernels (Dense layers) keep their 8-bit values and scale."""
    if not isinstance(tree, Mapping):
        return tree
    if is_compute_node(tree, mode):
        return dict(tree)
    out = {k: dequantize_except_dense(v, dtype, mode) for k, v in tree.items() if k != scheme_lib.SCALE}
    if scheme_lib.is_quantized_node(tree):
        out[scheme_lib.KERNEL] = scheme_lib.dequantize_kernel(tree[scheme_lib.KERNEL], tree[scheme_lib.SCALE], dtype)
    return out


def quantize_input(x: jax.Array, mode: str = "fp8", amax: Any = None) -> tuple[jax.Array, jax.Array]:
    """`(q_x, s)`: `x / s` in `mode`'s type (int8: rounded to nearest, clipped to [-127, 127]; fp8: clipped to
    +-448, rounded to e4m3) with `s = amax / qmax` (float32). `amax` None: the input's own `max|x|`; a number:
    a static (calibrated) range. A range of 0 (a tensor of zeros) gets s = 1."""
    qtype, qmax, _ = MODES[mode]
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32) if amax is None else jnp.asarray(amax, jnp.float32)
    s = jnp.where(amax > 0, amax / qmax, 1.0)
    y = x.astype(jnp.float32) / s
    if mode == "int8":
        y = jnp.round(y)
    return jnp.clip(y, -qmax, qmax).astype(qtype), s


def dense_quantized(
    x: jax.Array, q: jax.Array, scale: jax.Array, bias: jax.Array | None, dtype: Any, amax: Any = None
) -> jax.Array:
    """A Dense layer `x @ (q * scale) + bias` as an 8-bit x 8-bit product: the input quantized to `q`'s type
    (`quantize_input`, dynamic or with the static range `amax`), accumulated in int32 (int8) or float32 (fp8),
    then scaled by `s_x * scale` in float32 and rounded to `dtype` before the bias."""
    mode = scheme_lib.scheme_of(q.dtype)
    qx, sx = quantize_input(x, mode, amax)
    acc = jax.lax.dot_general(qx, q, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=MODES[mode][2])
    y = (acc.astype(jnp.float32) * (sx * scale.astype(jnp.float32))).astype(dtype)
    return y if bias is None else y + bias.astype(dtype)


class QuantizedDense:
    """An `nn.intercept_methods` interceptor: a Dense layer's `__call__` whose params hold a `mode` kernel and its
    scale runs as `dense_quantized`; every other method call runs unchanged.

    `amax`: static input ranges by the layer's module path inside the wrapped model (`"a/b/proj"`); a layer not in
    it (or `amax` None) scales its input dynamically. `observe(path, amax)`: called from the program (a
    `jax.debug.callback`) with each call's input `max|x|` (the calibration pass, `sdjax.quant.calibration`)."""

    def __init__(
        self,
        mode: str,
        amax: Mapping[str, float] | None = None,
        observe: Callable[[str, Any], None] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"compute={mode!r}: expected one of {sorted(MODES)}")
        self.mode = mode
        self.amax = amax or {}
        self.observe = observe

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, nn.Dense):
            return next_fun(*args, **kwargs)
        params = module.variables.get("params", {})
        if not is_compute_node(params, self.mode):
            return next_fun(*args, **kwargs)
        (x,) = args
        path = "/".join(module.path)
        if self.observe is not None:
            jax.debug.callback(functools.partial(self.observe, path), jnp.max(jnp.abs(x)).astype(jnp.float32))
        dtype = module.dtype or x.dtype
        bias = params.get("bias") if module.use_bias else None
        return dense_quantized(x, params[scheme_lib.KERNEL], params[scheme_lib.SCALE], bias, dtype, self.amax.get(path))


def quantized_dot_flops(jaxpr: Any) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of the 8-bit x 8-bit products in a jaxpr (`jax.make_jaxpr(f)(...)`), per compute
    mode: `{"int8": ..., "fp8": ...}`. Nested jaxprs (jit, cond branches, loop bodies) are walked; a loop's body is
    counted once, as XLA's cost analysis counts it. For a roofline that takes each product at its own rate:
    `(total - int8) / bf16_rate + int8 / int8_rate`."""
    from jax.extend import core as jcore

    out = {mode: 0.0 for mode in MODES}
    todo = [jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            todo.extend(jcore.jaxprs_in_params(eqn.params))
            if eqn.primitive.name != "dot_general":
                continue
            lhs, rhs = (v.aval for v in eqn.invars)
            for mode, (qtype, _, _) in MODES.items():
                if lhs.dtype == qtype and rhs.dtype == qtype:
                    (contract, _), _ = eqn.params["dimension_numbers"]
                    k = 1
                    for d in contract:
                        k *= int(lhs.shape[d])
                    n = 1
                    for d in eqn.outvars[0].aval.shape:
                        n *= int(d)
                    out[mode] += 2.0 * n * k
    return out
