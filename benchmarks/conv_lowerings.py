"""(Benchmark-only: compared by benchmarks/cpu_ops.py; sdjax's models use flax `nn.Conv`.)

2-D convolution on NHWC activations with HWIO kernels: one function, several lowerings of the same math.

`conv2d(x_nhwc, kernel_hwio, bias, stride=, padding=)` is `torch.nn.functional.conv2d` (cross-correlation, no
dilation, no groups) in channels-last layout, i.e. `lax.conv_general_dilated` with
`dimension_numbers=("NHWC", "HWIO", "NHWC")`. The implementations differ only in how XLA is asked to compute
it, so results agree to float rounding (the order of the K-sums differs):

- "xla": one `lax.conv_general_dilated`. XLA:CPU (jaxlib >= 0.8) sends it to YNNPACK; older XLA:CPU and
  `--xla_cpu_experimental_ynn_fusion_type=` send it to Eigen's spatial convolution; GPU/TPU use their own.
- "shifted": the sum over the kh*kw taps of a (B*Ho*Wo, Cin) x (Cin, Cout) matmul on a strided slice of
  the padded input ("shifted-matmul" convolution). No im2col buffer; kh*kw accumulating matmuls.
- "im2col": the kh*kw strided slices concatenated along channels, then one (B*Ho*Wo, kh*kw*Cin) x
  (kh*kw*Cin, Cout) matmul. Allocates a patch buffer kh*kw times the input.
- "auto": "xla". Measured on a 2-core AVX2 CPU (docs/cpu-performance.md) the native convolution is as fast
  as PyTorch's oneDNN convolution at every SD shape, and the matmul rewrites are never faster; on GPU/TPU
  the native convolution is the right call anyway.

A 1x1 stride-1 convolution is always a plain matmul over the channel axis (XLA rewrites it so as well).

Padding: an int `p` (symmetric on both spatial axes, as `torch.nn.Conv2d(padding=p)`), a pair `(ph, pw)`,
the per-side form `((top, bottom), (left, right))`, or "VALID"/"SAME" as in `lax`. diffusers' VAE encoder
downsampler (`Downsample2D(padding=0)`) pads `(0, 1, 0, 1)` (bottom/right) then convolves with stride 2:
`padding=((0, 1), (0, 1)), stride=2`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("auto", "xla", "shifted", "im2col")

Padding = int | str | tuple[int, int] | Sequence[tuple[int, int]]


def _pair(value: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    value = tuple(value)
    if len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"conv2d: {what} must be an int or a pair of ints; got {value!r}")
    return value


def normalize_padding(
    padding: Padding, kernel_hw: tuple[int, int], stride: tuple[int, int], in_hw: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Any accepted `padding` -> `((top, bottom), (left, right))`."""
    if isinstance(padding, str):
        mode = padding.upper()
        if mode not in ("VALID", "SAME"):
            raise ValueError(f"conv2d: padding string must be 'VALID' or 'SAME'; got {padding!r}")
        pads = lax.padtype_to_pads(in_hw, kernel_hw, stride, mode)
        return (tuple(pads[0]), tuple(pads[1]))
    if isinstance(padding, int):
        return (padding, padding), (padding, padding)
    padding = tuple(padding)
    if len(padding) == 2 and all(isinstance(p, int) for p in padding):
        return (padding[0], padding[0]), (padding[1], padding[1])
    if len(padding) == 2 and all(isinstance(p, Sequence) and len(p) == 2 for p in padding):
        (top, bottom), (left, right) = padding
        return (int(top), int(bottom)), (int(left), int(right))
    raise ValueError(
        f"conv2d: padding must be an int, (ph, pw), ((top, bottom), (left, right)), 'SAME' or 'VALID'; got {padding!r}"
    )


def _conv_xla(x, k, stride, pads, precision):
    return lax.conv_general_dilated(x, k, stride, pads, dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=precision)


def _taps(x_nhwc, kernel_hw, stride, pads):
    """The kh*kw strided slices of the padded input, each (B, Ho, Wo, Cin), in (i, j) row-major order."""
    (top, bottom), (left, right) = pads
    if min(top, bottom, left, right) < 0:
        raise ValueError(f"conv2d: negative padding {pads} is not supported by the matmul implementations")
    x = x_nhwc
    if (top, bottom, left, right) != (0, 0, 0, 0):
        x = jnp.pad(x_nhwc, ((0, 0), (top, bottom), (left, right), (0, 0)))
    kh, kw = kernel_hw
    sh, sw = stride
    n, hp, wp, c = x.shape
    ho, wo = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"conv2d: kernel {kernel_hw} does not fit the padded input {(hp, wp)}")
    return [
        lax.slice(x, (0, i, j, 0), (n, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, c), (1, sh, sw, 1))
        for i in range(kh)
        for j in range(kw)
    ]


def _conv_shifted(x, k, stride, pads, precision):
    kh, kw, _, _ = k.shape
    out = None
    for idx, tap in enumerate(_taps(x, (kh, kw), stride, pads)):
        y = jnp.einsum(
            "bhwc,co->bhwo",
            tap,
            k[idx // kw, idx % kw],
            precision=precision,
            preferred_element_type=jnp.result_type(x, k),
        )
        out = y if out is None else out + y
    return out


def _conv_im2col(x, k, stride, pads, precision):
    kh, kw, cin, cout = k.shape
    taps = _taps(x, (kh, kw), stride, pads)
    patches = taps[0] if len(taps) == 1 else jnp.concatenate(taps, axis=-1)  # (B, Ho, Wo, kh*kw*Cin), (i,j,c)
    return jnp.einsum(
        "bhwk,ko->bhwo",
        patches,
        k.reshape(kh * kw * cin, cout),
        precision=precision,
        preferred_element_type=jnp.result_type(x, k),
    )


_IMPLS = {"xla": _conv_xla, "shifted": _conv_shifted, "im2col": _conv_im2col}


def conv2d(
    x_nhwc: jax.Array,
    kernel_hwio: jax.Array,
    bias: jax.Array | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: Padding = 0,
    impl: str = "auto",
    precision: Any = None,
) -> jax.Array:
    """`torch.nn.functional.conv2d` on NHWC input, HWIO kernel: `(B, H, W, Cin) -> (B, Ho, Wo, Cout)`.

    `bias` `(Cout,)` or None. `stride` int or `(sh, sw)`; `padding` as described in the module docstring.
    `impl` picks the lowering ("auto", "xla", "shifted", "im2col"); all compute the same function.
    `precision` is passed to the underlying convolution/matmuls (None: XLA's default for the dtype, which on
    CPU is full float32).
    """
    if x_nhwc.ndim != 4 or kernel_hwio.ndim != 4:
        raise ValueError(
            f"conv2d: expected x (B, H, W, Cin) and kernel (kh, kw, Cin, Cout); got shapes "
            f"{x_nhwc.shape} and {kernel_hwio.shape}"
        )
    kh, kw, cin, cout = kernel_hwio.shape
    if x_nhwc.shape[-1] != cin:
        raise ValueError(f"conv2d: input has {x_nhwc.shape[-1]} channels, kernel {kernel_hwio.shape} expects {cin}")
    if bias is not None and bias.shape != (cout,):
        raise ValueError(f"conv2d: bias must have shape ({cout},); got {bias.shape}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"conv2d: unknown impl {impl!r}; choose one of {IMPLEMENTATIONS}")
    stride = _pair(stride, "stride")
    if min(stride) < 1:
        raise ValueError(f"conv2d: stride must be >= 1; got {stride}")
    pads = normalize_padding(padding, (kh, kw), stride, x_nhwc.shape[1:3])
    dtype = jnp.result_type(x_nhwc, kernel_hwio)
    x_nhwc, kernel_hwio = x_nhwc.astype(dtype), kernel_hwio.astype(dtype)
    if impl == "auto":
        impl = "xla"
    if (kh, kw) == (1, 1) and stride == (1, 1) and pads == ((0, 0), (0, 0)):
        y = jnp.einsum(
            "bhwc,co->bhwo",
            x_nhwc,
            kernel_hwio[0, 0],
            precision=precision,
            preferred_element_type=jnp.result_type(x_nhwc, kernel_hwio),
        )
    else:
        y = _IMPLS[impl](x_nhwc, kernel_hwio, stride, pads, precision)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


class Conv2d(nn.Module):
    """`torch.nn.Conv2d` as a Flax module over `conv2d`: a drop-in for `flax.linen.Conv` in the SD models.

    Params are those of `nn.Conv`: `kernel (kh, kw, in, out)` (lecun-normal init) and `bias (out,)` (zeros),
    so checkpoints converted for `nn.Conv` (diffusers `weight (O, I, kh, kw)` -> `kernel (kh, kw, I, O)`)
    load unchanged. `kernel_size` and `stride` are ints or pairs; `padding` as in `conv2d` (torch's
    `padding=p` is `p`). `dtype` is the compute dtype (input and params are cast to it); `param_dtype` the
    stored one. `impl` picks the lowering (see the module docstring).
    """

    features: int
    kernel_size: int | Sequence[int] = 3
    stride: int | Sequence[int] = 1
    padding: Padding = 0
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    impl: str = "auto"
    precision: Any = None
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x_nhwc: jax.Array) -> jax.Array:
        kh, kw = _pair(self.kernel_size, "kernel_size")
        kernel = self.param("kernel", self.kernel_init, (kh, kw, x_nhwc.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        dtype = self.dtype or jnp.result_type(x_nhwc, kernel)
        x_nhwc, kernel = x_nhwc.astype(dtype), kernel.astype(dtype)
        bias = None if bias is None else bias.astype(dtype)
        return conv2d(
            x_nhwc, kernel, bias, stride=self.stride, padding=self.padding, impl=self.impl, precision=self.precision
        )
