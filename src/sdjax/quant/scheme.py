"""Weight-only quantization of one kernel: per-output-channel symmetric int8, or float8 e4m3 with a per-channel scale.

The arithmetic is qwix's (`qwix.quantize(w, qtype, channelwise_axes=[-1])`, absmax calibration; Google's JAX
quantization library, the `quant` extra): one scale per output channel (the kernel's last axis: Dense `(in, out)`,
Conv `(h, w, in, out)`), computed over every other axis.
- `int8`: `scale = max|w| / 127.5`, `q = round(w / scale)` saturated to [-128, 127] (qwix extends the top bucket
  by half a step: `max|w|` maps to 127.5, which rounds to 128 and saturates to 127). Per element,
  `|q * scale - w| <= scale / 2`.
- `fp8` (`float8_e4m3fn`): `scale = max|w| / 448` (e4m3's largest finite value), `q = float8(w / scale)` (round to
  nearest even, 3 mantissa bits): a relative error of at most 2^-4 per element above e4m3's normal range
  (`|w| >= 2^-6 * scale`), an absolute one of at most 2^-10 * scale below it.

Dequantizing is `q * scale` in float32, rounded to the compute dtype (`dequantize_kernel`); it runs inside the
jitted program, where the parameters stay one byte per weight (`sdjax.quant.modules`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# A quantized kernel's params node: `{kernel: q, kernel_scale: s}` (per-output-channel float32 scales).
SCALE_SUFFIX = "_scale"
KERNEL = "kernel"
SCALE = KERNEL + SCALE_SUFFIX

# scheme name -> the stored dtype of the quantized kernel
SCHEMES: dict[str, Any] = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def check_scheme(scheme: Any, name: str = "quantize") -> str:
    """One of `SCHEMES`; anything else raises a ValueError naming the argument and the allowed values."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"{name}={scheme!r}: expected one of {sorted(SCHEMES)}")
    return scheme


def scheme_of(dtype: Any) -> str:
    """The scheme whose stored dtype is `dtype` (int8 -> "int8", float8_e4m3fn -> "fp8")."""
    for name, qtype in SCHEMES.items():
        if jnp.dtype(dtype) == jnp.dtype(qtype):
            return name
    raise ValueError(f"{jnp.dtype(dtype)} is not a quantized kernel dtype ({sorted(SCHEMES)})")


def _qwix():
    try:
        import qwix
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("quantize= needs the qwix package: pip install 'sdjax[quant]' (or pip install qwix)") from e
    return qwix


@functools.cache
def _quantizer(scheme: str, ndim: int):
    qwix = _qwix()
    qtype = SCHEMES[scheme]

    def run(w):
        qa = qwix.quantize(w.astype(jnp.float32), qtype, channelwise_axes=[ndim - 1])
        return qa.qvalue, qa.scale.reshape(qa.scale.shape[-1]).astype(jnp.float32)

    return jax.jit(run)


def quantize_kernel(kernel: Any, scheme: str) -> tuple[jax.Array, jax.Array]:
    """A float kernel (last axis: output channels) -> `(q, scale)`: `q` int8 or float8_e4m3fn of the kernel's shape,
    `scale` float32 `(out,)`. Any float input dtype (float8 kernels kept by the Flux loader included)."""
    check_scheme(scheme, "scheme")
    kernel = jnp.asarray(kernel)
    if kernel.ndim < 2:
        raise ValueError(f"a kernel to quantize needs an input and an output axis, got shape {kernel.shape}")
    return _quantizer(scheme, kernel.ndim)(kernel)


def dequantize_kernel(q: Any, scale: Any, dtype: Any = jnp.float32) -> jax.Array:
    """`q * scale` (scale broadcast over the last axis) computed in float32, rounded to `dtype`."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def error_stats(kernel: np.ndarray, q: Any, scale: Any) -> dict[str, float]:
    """Quantization error of one kernel against its range: max and mean |error| relative to max|w|, the worst
    per-channel error in units of that channel's scale, and the signal-to-quantization-noise ratio in dB."""
    w = np.asarray(kernel, np.float32)
    deq = np.asarray(dequantize_kernel(jnp.asarray(q), jnp.asarray(scale)), np.float32)
    err = np.abs(deq - w)
    s = np.asarray(scale, np.float32)
    rng = float(np.abs(w).max()) or 1.0
    sqnr = 10 * np.log10(float(np.mean(w**2)) / max(float(np.mean(err**2)), 1e-30))
    return {
        "max_err_over_range": float(err.max()) / rng,
        "mean_err_over_range": float(err.mean()) / rng,
        "max_err_in_scales": float((err / np.where(s > 0, s, 1.0)).max()),
        "sqnr_db": float(sqnr),
    }


def is_quantized_node(node: Any) -> bool:
    return isinstance(node, Mapping) and SCALE in node and KERNEL in node


def quantized_kernels(tree: Any, path: str = "") -> dict[str, tuple[Any, Any]]:
    """`path -> (q, scale)` of every quantized kernel in `tree`."""
    if not isinstance(tree, Mapping):
        return {}
    out = {}
    if is_quantized_node(tree):
        out[f"{path}/{KERNEL}" if path else KERNEL] = (tree[KERNEL], tree[SCALE])
    for k, v in tree.items():
        out.update(quantized_kernels(v, f"{path}/{k}" if path else str(k)))
    return out
