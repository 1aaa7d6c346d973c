"""Quantized compute for Dense layers and 2-D convolutions (`QuantPolicy(compute="int8" | "fp8")`): both operands of
a layer's product in 8 bits, int8 x int8 accumulated in int32, or float8_e4m3fn x float8_e4m3fn accumulated in
float32.

Weight-only quantization (`sdjax.quant.modules`) turns each kernel back into the compute dtype before the layer
runs: it saves memory and bandwidth, and the product runs at the bf16 rate. TPU v5e / v6e multiply int8 at twice
their bf16 rate, Hopper-class GPUs (and TPU v7) fp8. Here a layer whose kernel is stored in the compute mode's
8-bit type keeps it that way and quantizes its input too:

- input scale, one per call and tensor: `s_x = amax / qmax` (`qmax` 127 for int8: symmetric, -128 unused; 448 for
  e4m3). `amax` is the input's own `max|x|` (dynamic: exact for every input range, one more reduction over the
  activation) or, with a calibration (`sdjax.quant.calibration`), the largest `max|x|` the layer saw on a few
  calibration prompts (static: a constant of the program; inputs beyond it saturate at +-qmax).
- `y = (q_x * q_w) * s_x * s_w + b` with `*` the layer's product (a Dense layer's matmul, a convolution), `q_x =
  round(x / s_x)` clipped to [-qmax, qmax] (int8) or `float8(x / s_x)` (fp8), `q_w` the stored kernel and `s_w` its
  per-output-channel scale (the kernel's last axis: Dense `(in, out)`, Conv `(kh, kw, in, out)`). The product is
  one `lax.dot_general` or `lax.conv_general_dilated` with `preferred_element_type=int32` (int8: exact integer
  sums, |q_x q_w| <= 127 * 128, so up to 2^31 / 16256 = 132,104 terms fit; a 3x3 conv over 1,280 channels has
  11,520) or float32 (fp8), converted to float32 once and scaled.

Layers: `flax.linen.Dense` (2-D kernels), and 2-D convolutions (4-D kernels): `sdjax.ops.conv.Conv` (the UNet's,
the VAE's and the ControlNets' convs; an upsampler's conv quantizes its input before the 2x nearest upsampling,
which gives the same values) and `flax.linen.Conv` (SD 3's patch embedding). They are replaced through
`nn.intercept_methods`, so the model code is unchanged; every 2-D and 4-D kernel in sdjax's models belongs to one.
Which of them are quantized at all is `QuantPolicy`'s rule (size, components, `exclude`); `compute_convs=False`
keeps convolutions on the weight-only path. Kernels of the other 8-bit type, 1-D convs, attention, norms and
everything else run in the compute dtype.

Per tensor rather than per token or pixel: one number per layer is what a calibration file can hold, and the same
rule serves both the dynamic and the static scales.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import linear as flax_linear

from sdjax.ops import conv as ops_conv
from sdjax.quant import scheme as scheme_lib

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
INT8_MAX = 127.0  # activations: symmetric [-127, 127]

# compute mode -> (operand dtype, largest quantized magnitude of an input, accumulation dtype)
MODES: dict[str, tuple[Any, float, Any]] = {
    "int8": (jnp.int8, INT8_MAX, jnp.int32),
    "fp8": (FP8, FP8_MAX, jnp.float32),
}
DENSE_NDIM, CONV_NDIM = 2, 4  # kernel ranks of the layers that compute in 8 bits: Dense (in, out), Conv (h, w, in, out)
NHWC = ("NHWC", "HWIO", "NHWC")


def _ndims(convs: bool) -> tuple[int, ...]:
    return (DENSE_NDIM, CONV_NDIM) if convs else (DENSE_NDIM,)


def is_compute_node(node: Any, mode: str, convs: bool = True) -> bool:
    """A Dense layer's (or, with `convs`, a 2-D conv's) `{kernel, kernel_scale}` whose kernel is stored in `mode`'s
    type."""
    if not scheme_lib.is_quantized_node(node):
        return False
    q = node[scheme_lib.KERNEL]
    return q.ndim in _ndims(convs) and q.dtype == MODES[mode][0]


def compute_kernels(tree: Any, mode: str, path: str = "", convs: bool = True) -> dict[str, tuple[Any, Any]]:
    """`path -> (q, scale)` of the kernels that `mode` multiplies quantized (paths as `params.quantized_kernels`)."""
    return {
        p: (q, s)
        for p, (q, s) in scheme_lib.quantized_kernels(tree, path).items()
        if q.ndim in _ndims(convs) and q.dtype == MODES[mode][0]
    }


def dequantize_except_compute(tree: Any, dtype: Any, mode: str = "fp8", convs: bool = True) -> Any:
    """`params.dequantize_tree`, except that `mode`'s compute kernels (`is_compute_node`) keep their 8-bit values and
    scale."""
    if not isinstance(tree, Mapping):
        return tree
    if is_compute_node(tree, mode, convs):
        return dict(tree)
    out = {k: dequantize_except_compute(v, dtype, mode, convs) for k, v in tree.items() if k != scheme_lib.SCALE}
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


def _scaled(acc: jax.Array, sx: jax.Array, scale: jax.Array, bias: jax.Array | None, dtype: Any) -> jax.Array:
    """The accumulator times `s_x * s_w` in float32, rounded to `dtype`, plus the bias."""
    y = (acc.astype(jnp.float32) * (sx * scale.astype(jnp.float32))).astype(dtype)
    return y if bias is None else y + bias.astype(dtype)


def dense_quantized(
    x: jax.Array, q: jax.Array, scale: jax.Array, bias: jax.Array | None, dtype: Any, amax: Any = None
) -> jax.Array:
    """A Dense layer `x @ (q * scale) + bias` as an 8-bit x 8-bit product: the input quantized to `q`'s type
    (`quantize_input`, dynamic or with the static range `amax`), accumulated in int32 (int8) or float32 (fp8),
    then scaled by `s_x * scale` in float32 and rounded to `dtype` before the bias."""
    mode = scheme_lib.scheme_of(q.dtype)
    qx, sx = quantize_input(x, mode, amax)
    acc = jax.lax.dot_general(qx, q, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=MODES[mode][2])
    return _scaled(acc, sx, scale, bias, dtype)


def conv_quantized(
    x_nhwc: jax.Array,
    q_hwio: jax.Array,
    scale: jax.Array,
    bias: jax.Array | None,
    dtype: Any,
    amax: Any = None,
    *,
    strides: tuple[int, int] = (1, 1),
    padding: Any = ((0, 0), (0, 0)),
    lhs_dilation: tuple[int, int] = (1, 1),
    rhs_dilation: tuple[int, int] = (1, 1),
    feature_group_count: int = 1,
    upsample2x: bool = False,
) -> jax.Array:
    """A 2-D convolution (cross-correlation, NHWC x HWIO, `lax.conv_general_dilated`'s window options) of `x_nhwc`
    with the kernel `q_hwio * scale`, as an 8-bit x 8-bit product: the input quantized per tensor (`quantize_input`,
    dynamic or the static range `amax`), accumulated in int32 (int8) or float32 (fp8), scaled by `s_x * scale` in
    float32, rounded to `dtype`, plus the bias. `upsample2x`: the conv of the input upsampled 2x (nearest), which is
    applied to the quantized input (the same values, a quarter of the quantizing)."""
    mode = scheme_lib.scheme_of(q_hwio.dtype)
    qx, sx = quantize_input(x_nhwc, mode, amax)
    if upsample2x:
        qx = ops_conv.upsample2x_nearest(qx)
    acc = jax.lax.conv_general_dilated(
        qx,
        q_hwio,
        tuple(strides),
        padding,
        lhs_dilation=tuple(lhs_dilation),
        rhs_dilation=tuple(rhs_dilation),
        dimension_numbers=NHWC,
        feature_group_count=feature_group_count,
        preferred_element_type=MODES[mode][2],
    )
    return _scaled(acc, sx, scale, bias, dtype)


def _pair(value: Any) -> tuple[int, int]:
    if value is None:
        return (1, 1)
    return (int(value), int(value)) if isinstance(value, int) else tuple(int(v) for v in value)


def conv_options(module: nn.Module) -> dict[str, Any]:
    """`conv_quantized`'s window options of a conv module: `sdjax.ops.conv.Conv` (strides, padding pairs,
    `upsample2x`) or `flax.linen.Conv` (its strides, padding as `lax` takes it, dilations, feature groups)."""
    if isinstance(module, ops_conv.Conv):
        padding = tuple(tuple(p) for p in module.padding)
        return {"strides": _pair(module.strides), "padding": padding, "upsample2x": module.upsample2x}
    padding = flax_linear.canonicalize_padding(module.padding, 2)
    if (isinstance(padding, str) and padding not in ("SAME", "VALID")) or module.mask is not None:
        raise NotImplementedError(
            f"{'/'.join(module.path)}: 8-bit compute of a flax Conv with padding={module.padding!r} "
            f"(mask={'set' if module.mask is not None else None}) is not implemented; exclude the layer from the "
            "QuantPolicy or set compute_convs=False"
        )
    return {
        "strides": _pair(module.strides),
        "padding": padding if isinstance(padding, str) else tuple(tuple(p) for p in padding),
        "lhs_dilation": _pair(module.input_dilation),
        "rhs_dilation": _pair(module.kernel_dilation),
        "feature_group_count": int(module.feature_group_count),
    }


class QuantizedLayers:
    """An `nn.intercept_methods` interceptor: a Dense layer's or (with `convs`) a 2-D conv's `__call__` whose params
    hold a `mode` kernel and its scale runs as `dense_quantized` / `conv_quantized`; every other method call runs
    unchanged.

    `amax`: static input ranges by the layer's module path inside the wrapped model (`"a/b/proj"`); a layer not in
    it (or `amax` None) scales its input dynamically. `observe(path, amax)`: called from the program (a
    `jax.debug.callback`) with each call's input `max|x|` (the calibration pass, `sdjax.quant.calibration`)."""

    def __init__(
        self,
        mode: str,
        amax: Mapping[str, float] | None = None,
        observe: Callable[[str, Any], None] | None = None,
        convs: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"compute={mode!r}: expected one of {sorted(MODES)}")
        self.mode = mode
        self.amax = amax or {}
        self.observe = observe
        self.convs = convs

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.Conv, ops_conv.Conv)):
            return next_fun(*args, **kwargs)
        params = module.variables.get("params", {})
        if not is_compute_node(params, self.mode, self.convs):
            return next_fun(*args, **kwargs)
        (x,) = args
        path = "/".join(module.path)
        if self.observe is not None:
            jax.debug.callback(functools.partial(self.observe, path), jnp.max(jnp.abs(x)).astype(jnp.float32))
        dtype = module.dtype or x.dtype
        bias = params.get("bias") if module.use_bias else None
        q, scale, amax = params[scheme_lib.KERNEL], params[scheme_lib.SCALE], self.amax.get(path)
        if isinstance(module, nn.Dense):
            return dense_quantized(x, q, scale, bias, dtype, amax)
        return conv_quantized(x, q, scale, bias, dtype, amax, **conv_options(module))


# ------------------------------------------------------------------------------------------------ FLOP counts
def _dot_flops(eqn) -> float:
    lhs = eqn.invars[0].aval
    (contract, _), _ = eqn.params["dimension_numbers"]
    k = int(np.prod([lhs.shape[d] for d in contract]))
    return 2.0 * int(np.prod(eqn.outvars[0].aval.shape)) * k


def _valid_taps(size: int, out: int, kernel: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """(output position, kernel tap) pairs along one spatial axis that read an input element rather than padding
    (or a hole of the input's dilation): XLA's cost analysis counts a convolution's multiply-adds this way."""
    pos = np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] * rhs_dil - pad_lo
    valid = (pos >= 0) & (pos <= (size - 1) * lhs_dil) & (pos % lhs_dil == 0)
    return int(valid.sum())


def _conv_flops(eqn) -> float:
    """2 x batch x output channels x input channels per group x the valid taps of every spatial axis."""
    lhs, rhs = (v.aval for v in eqn.invars)
    out, p = eqn.outvars[0].aval, eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]  # (batch, feature, spatial...), (out, in, spatial...)
    taps = 1
    for i, (lhs_d, rhs_d, out_d) in enumerate(zip(lhs_spec[2:], rhs_spec[2:], out_spec[2:], strict=True)):
        window = (p["window_strides"][i], p["padding"][i][0], p["lhs_dilation"][i], p["rhs_dilation"][i])
        taps *= _valid_taps(lhs.shape[lhs_d], out.shape[out_d], rhs.shape[rhs_d], *window)
    return 2.0 * out.shape[out_spec[0]] * out.shape[out_spec[1]] * rhs.shape[rhs_spec[1]] * taps


FLOPS: dict[str, Callable[[Any], float]] = {"dot_general": _dot_flops, "conv_general_dilated": _conv_flops}


def quantized_flops(jaxpr: Any) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of the 8-bit x 8-bit products (matmuls and convolutions) in a jaxpr
    (`jax.make_jaxpr(f)(...)`), per compute mode: `{"int8": ..., "fp8": ...}`. A convolution counts the
    multiply-adds that read input rather than padding, as XLA's cost analysis does. Nested jaxprs (jit, cond
    branches, loop bodies) are walked; a loop's body is counted once, as XLA's cost analysis counts it. For a
    roofline that takes each product at its own rate: `(total - int8) / bf16_rate + int8 / int8_rate`."""
    from jax.extend import core as jcore

    out = {mode: 0.0 for mode in MODES}
    todo = [jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            todo.extend(jcore.jaxprs_in_params(eqn.params))
            count = FLOPS.get(eqn.primitive.name)
            if count is None:
                continue
            lhs, rhs = (v.aval for v in eqn.invars[:2])
            for mode, (qtype, _, _) in MODES.items():
                if lhs.dtype == qtype and rhs.dtype == qtype:
                    out[mode] += count(eqn)
    return out
