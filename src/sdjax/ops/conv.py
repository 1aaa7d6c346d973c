"""2-D convolution for the UNet, the VAE and the ControlNet: XLA's convolution, or Winograd's F(2x2, 3x3) on CPU.

`Conv` is a drop-in `flax.linen.Conv` (NHWC input, params `kernel` `(kh, kw, Cin, Cout)` and `bias` `(Cout,)`,
the same initializers), so param trees and the diffusers key mapping are unchanged. It computes
`torch.nn.Conv2d` (cross-correlation) with `lax.conv_general_dilated`, except where the params tree holds a
`winograd` leaf next to a 3x3 stride-1 kernel: then, on CPU, it computes the same convolution with Winograd's
minimal filtering algorithm F(2x2, 3x3) (Lavin & Gray 2016, "Fast Algorithms for Convolutional Neural
Networks"). Every 2x2 block of outputs comes from a 4x4 block of inputs as
`A^T [(G g G^T) * (B^T d B)] A`: the elementwise product over the 16 positions of the tile becomes 16 matrix
products `(tiles, Cin) @ (Cin, Cout)`, 16 multiplications per 4 outputs instead of 36 (2.25x fewer). The input
and output transforms are additions only, and so are exact up to float rounding; F(2x2, 3x3) keeps float32
results within about 1e-6 relative of the direct convolution (the larger tiles of F(4x4, 3x3) lose a decimal
digit, which is why they are not used).

The transformed kernel `G g G^T` is 16/9 of the kernel's size. Computing it on every call would cost as much
memory traffic as the saving (XLA:CPU does not hoist it out of a `while` loop), so it is done once per program:
`prepare(params)` adds the `winograd` leaves to a params tree (inside the jitted program, before the denoising
loop; `sdjax.core.generator` does this for the UNet and `sdjax.core.autoencoder` for the VAE decoder), and
`Conv` uses a leaf when it finds one. Params without the leaves (a direct `unet.apply`) take XLA's convolution.
Once per program is still once per generation; `PreparedKernels` computes the leaves outside the program and keeps
them between generations (the generator does this on CPU), and `prepare` leaves existing leaves as they are.

Where Winograd is used (`prepare`'s rule, `WINOGRAD_MIN_CHANNELS`): 3x3 kernels with at least that many input
channels, float32 only. On GPU and TPU the leaves are ignored and XLA's convolution runs (the choice is made per
lowering platform with `lax.platform_dependent`, so a program lowered for TPU from a CPU host is the TPU one).
Measured on a 2-core AVX2 CPU, in `docs/benchmarks.md`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

# Winograd F(2x2, 3x3): input transform B^T (4x4) and output transform A^T (2x4); the kernel transform G (4x3) is
# written out as additions in `winograd_kernel`.
_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float32)
_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float32)

# prepare()'s rule: 3x3 kernels with at least this many input channels get Winograd on CPU.
WINOGRAD_MIN_CHANNELS = 512
WINOGRAD_LEAF = "winograd"


# --------------------------------------------------------------------------------------------- the transforms
def winograd_kernel(kernel_hwio: jax.Array) -> jax.Array:
    """`G g G^T` of a `(3, 3, Cin, Cout)` kernel -> `(16, Cin, Cout)`, tile positions in row-major order."""
    if kernel_hwio.shape[:2] != (3, 3):
        raise ValueError(f"winograd_kernel: expected a (3, 3, Cin, Cout) kernel, got shape {kernel_hwio.shape}")

    # G's rows are (1, 0, 0), (1/2, 1/2, 1/2), (1/2, -1/2, 1/2), (0, 0, 1): written as additions, `G g G^T` is one
    # elementwise pass over the kernel (1.6x faster on CPU than the same product as an einsum of dots, 1.21 against
    # 1.95 s for twenty 1280x1280 kernels; bit-identical there). It is memory-bound: SD 1.5's UNet has 945 M
    # transformed weights, computed once per generation (docs/benchmarks.md).
    def rows(k):
        return [k[0], 0.5 * (k[0] + k[1] + k[2]), 0.5 * (k[0] - k[1] + k[2]), k[2]]

    k = kernel_hwio.astype(jnp.float32)
    tiles = [u for r in rows(k) for u in rows(r)]  # r = (G g)[a] (over the kernel's columns); u = (G g G^T)[a, b]
    return jnp.stack(tiles).astype(kernel_hwio.dtype)


def _combine(coefficients, terms):
    """sum(c * t) over the nonzero coefficients (all are +-1 here: additions only)."""
    out = None
    for c, t in zip(coefficients, terms, strict=True):
        if c == 0:
            continue
        t = t if c == 1 else -t
        out = t if out is None else out + t
    return out


def conv3x3_winograd(x_nhwc: jax.Array, u_pcd: jax.Array) -> jax.Array:
    """The 3x3, stride-1, padding-1 convolution of `x_nhwc` with the kernel whose `winograd_kernel` is `u_pcd`."""
    n, h, w, c = x_nhwc.shape
    if u_pcd.shape[:2] != (16, c):
        raise ValueError(f"conv3x3_winograd: transformed kernel {u_pcd.shape} does not fit input {x_nhwc.shape}")
    th, tw = -(-h // 2), -(-w // 2)  # 2x2 output tiles (odd sizes padded, cropped at the end)
    xp = jnp.pad(x_nhwc, ((0, 0), (1, 2 * th + 1 - h), (1, 2 * tw + 1 - w), (0, 0)))
    # d[i][j]: pixel (i, j) of every 4x4 input tile, as a (n, th, tw, c) array of strided slices.
    d = [[xp[:, i : i + 2 * th - 1 : 2, j : j + 2 * tw - 1 : 2] for j in range(4)] for i in range(4)]
    v = []
    for a in range(4):
        for b in range(4):
            coefficients = [_BT[a, i] * _BT[b, j] for i in range(4) for j in range(4)]
            v.append(_combine(coefficients, [d[i][j] for i in range(4) for j in range(4)]))
    v_ptc = jnp.stack(v).reshape(16, n * th * tw, c)
    m = jnp.einsum("ptc,pcd->ptd", v_ptc, u_pcd.astype(v_ptc.dtype)).reshape(4, 4, n, th, tw, -1)
    rows = [_combine(_AT[o], [m[r] for r in range(4)]) for o in range(2)]  # (4, n, th, tw, D) each
    y = jnp.stack(
        [jnp.stack([_combine(_AT[q], [rows[o][col] for col in range(4)]) for q in range(2)]) for o in range(2)]
    )
    y = y.transpose(2, 3, 0, 4, 1, 5).reshape(n, 2 * th, 2 * tw, -1)  # (o, q, n, th, tw, D) -> pixels
    return y[:, :h, :w]


def conv2d(x_nhwc, kernel_hwio, *, stride: int = 1, padding=((1, 1), (1, 1))) -> jax.Array:
    """XLA's convolution, `torch.nn.functional.conv2d` on NHWC activations and HWIO kernels."""
    return lax.conv_general_dilated(
        x_nhwc, kernel_hwio, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


# --------------------------------------------------------------------------------------------- the params rule
def winograd_eligible(kernel: Any) -> bool:
    """prepare()'s rule for one kernel (an array or ShapeDtypeStruct)."""
    shape = tuple(getattr(kernel, "shape", ()))
    return (
        len(shape) == 4
        and shape[:2] == (3, 3)
        and shape[2] >= WINOGRAD_MIN_CHANNELS
        and jnp.dtype(kernel.dtype) == jnp.float32
    )


def prepare(params: Any) -> Any:
    """`params` with a `winograd` leaf (`winograd_kernel(kernel)`) next to every eligible 3x3 kernel that has none.

    Call it inside the jitted program, once, outside any loop over model calls. A conv module that runs with
    stride 2 ignores its leaf (and XLA drops the unused computation); so does every conv on GPU and TPU. Leaves
    already there (computed ahead by `PreparedKernels`) are kept, not computed again.
    """
    return _add_leaves(params, winograd_kernel)


def _add_leaves(params: Any, make: Callable[[Any], Any]) -> Any:
    if not isinstance(params, Mapping):
        return params
    out = {k: _add_leaves(v, make) for k, v in params.items()}
    kernel = params.get("kernel")
    if (
        kernel is not None
        and not isinstance(kernel, Mapping)
        and WINOGRAD_LEAF not in params
        and winograd_eligible(kernel)
    ):
        out[WINOGRAD_LEAF] = make(kernel)
    return out


class PreparedKernels:
    """The `winograd` leaves computed outside the generation's program and kept between programs (CPU only).

    `prepare` inside a program computes every transformed kernel on every run: for SD 1.5 in float32 that is 945 M
    weights, 3.8 GB written, about 2 s of a CPU generation (docs/benchmarks.md). `add(params)` returns placed params
    with the leaves already there, each computed once per kernel *array* and reused while that same array object
    is passed again (the generator's placement cache keeps placed arrays alive, so an id is never reused while its
    entry lives); an edited or new kernel (a LoRA fused in, other params) gets a new leaf, and the entries of
    kernels no longer passed are dropped. The cost is memory held between runs: the leaves are 16/9 of the eligible
    kernels (3.8 GB for SD 1.5 float32). A program that computes them holds them for its whole loop anyway, so the
    loop's peak is unchanged; what rises is the peak of the VAE decode, which now runs with the UNet's leaves still
    allocated (by up to the size of the leaves; docs/benchmarks.md has the measured process peaks). Abstract params
    (`jax.ShapeDtypeStruct`, for lowering without weights) get abstract leaves.
    Each leaf is laid out like its kernel: split over the mesh the way the kernel's input and output channels are.
    """

    def __init__(self):
        self._entries: dict[int, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(int(u.nbytes) for _, u in self._entries.values())

    def add(self, params: Any) -> Any:
        with self._lock:
            new: dict[int, tuple[Any, Any]] = {}

            def make(kernel):
                sharding = _leaf_sharding(getattr(kernel, "sharding", None))
                if isinstance(kernel, jax.ShapeDtypeStruct):
                    return jax.ShapeDtypeStruct((16, *kernel.shape[2:]), kernel.dtype, sharding=sharding)
                hit = self._entries.get(id(kernel))
                if hit is not None and hit[0] is kernel:
                    u = hit[1]
                else:
                    u = _transform(sharding)(kernel)
                new[id(kernel)] = (kernel, u)
                return u

            out = _add_leaves(params, make)
            if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(params)):
                self._entries = new  # only the kernels passed now: the others' leaves are freed
            return out

    def clear(self) -> None:
        with self._lock:
            self._entries = {}


def _leaf_sharding(kernel_sharding):
    """The layout of a kernel's `(16, Cin, Cout)` leaf: the kernel's `(h, w, Cin, Cout)` split, less h and w."""
    if isinstance(kernel_sharding, NamedSharding):
        spec = (*kernel_sharding.spec, None, None, None, None)[:4]
        return NamedSharding(kernel_sharding.mesh, PartitionSpec(None, spec[2], spec[3]))
    return kernel_sharding


@functools.lru_cache(maxsize=64)
def _transform(sharding):
    return jax.jit(winograd_kernel, out_shardings=sharding) if sharding is not None else jax.jit(winograd_kernel)


# --------------------------------------------------------------------------------------------- the module
class Conv(nn.Module):
    """`flax.linen.Conv` for NHWC inputs (the subset sdjax uses), which takes Winograd's path when prepared."""

    features: int
    kernel_size: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: Any = ((0, 0), (0, 0))
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_nhwc: jax.Array) -> jax.Array:
        kh, kw = self.kernel_size
        cin = x_nhwc.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (kh, kw, cin, self.features), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) if self.use_bias else None
        x, kernel = x_nhwc.astype(self.dtype), kernel.astype(self.dtype)
        padding = tuple(tuple(p) for p in self.padding)

        def direct(x, kernel, *_):
            return conv2d(x, kernel, stride=self.strides[0], padding=padding)

        winograd_ok = (
            self.kernel_size == (3, 3)
            and tuple(self.strides) == (1, 1)
            and padding == ((1, 1), (1, 1))
            and self.has_variable("params", WINOGRAD_LEAF)
        )
        if winograd_ok:
            u = self.get_variable("params", WINOGRAD_LEAF)

            def winograd(x, kernel, u):
                return conv3x3_winograd(x, u).astype(x.dtype)

            y = lax.platform_dependent(x, kernel, u, cpu=winograd, default=direct)
        else:
            y = direct(x, kernel)
        if bias is not None:
            y = y + bias.astype(self.dtype)
        return y
