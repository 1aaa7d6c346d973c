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
channels, float32 only, and (the module's rule) inputs of at most `WINOGRAD_MAX_PIXELS` pixels per image: its input
and output transforms are passes over the activations, which at the VAE decoder's 256x256 level cost more than the
multiplications they save (a 512 -> 256 channel conv there: 2.0 s against 1.1 s direct).

Upsamplers (nearest 2x, then a 3x3 conv: diffusers' `Upsample2D`) on CPU skip the upsampled tensor. Output pixel
`(2i + a, 2j + b)` of the conv reads only input rows `i - 1 + a .. i + a` and columns `j - 1 + b .. j + b`, each row
(column) tap a sum of the 3x3 kernel's rows (columns): for phase 0 `(k0, k1 + k2)`, for phase 1 `(k0 + k1, k2)`.
So the four output phases are one 2x2 convolution of the input (padded by one) to `4 x Cout` channels, and its
outputs are interleaved: 16 multiplications per input pixel and output channel instead of 36 (2.25x fewer), on a
quarter of the pixels. `subpixel_kernel` makes the `(2, 2, Cin, 4 Cout)` kernel; `prepare` adds it as a `subpixel`
leaf to the convs under an `upsamplers_*` key (the UNet's and the VAE decoder's), so the generator keeps it like
the Winograd leaves. Conv modules built with `upsample2x=True` use it (or compute it, without the leaf).

On GPU and TPU the leaves are ignored and XLA's convolution runs (the choice is made per lowering platform with
`lax.platform_dependent`, so a program lowered for TPU from a CPU host is the TPU one). Measured on a 2-core CPU,
in `docs/benchmarks.md`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

# Winograd F(2x2, 3x3): output transform A^T (2x4); the input transform B^T (4x4: rows (1, 0, -1, 0), (0, 1, 1, 0),
# (0, -1, 1, 0), (0, 1, 0, -1)) and the kernel transform G (4x3) are written out as additions in `_bt_rows` and
# `winograd_kernel`.
_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float32)

# prepare()'s rule: 3x3 kernels with at least this many input channels get Winograd on CPU...
WINOGRAD_MIN_CHANNELS = 512
# ...and the module's: when the input has at most this many pixels per image (larger ones run XLA's convolution).
WINOGRAD_MAX_PIXELS = 128 * 128
WINOGRAD_LEAF = "winograd"
# The upsamplers' sub-pixel kernels: a leaf next to every float32 3x3 kernel under a key with this prefix.
SUBPIXEL_LEAF = "subpixel"
UPSAMPLER_PREFIX = "upsamplers"


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


def _bt_rows(d0, d1, d2, d3):
    """Winograd's `B^T` applied along one axis of the 4-tap tiles `d0..d3` (its rows, above, as additions)."""
    return [d0 - d2, d1 + d2, d2 - d1, d1 - d3]


def winograd_input(x_nhwc: jax.Array) -> jax.Array:
    """`B^T d B` of every 4x4 input tile (stride 2, the input padded by one; odd sizes padded further) ->
    `(16, n * th * tw, c)`, tile positions in row-major order.

    Separable, on the padded input reshaped to even and odd rows and columns (`e[:, i, r, j, s] = xp[:, 2i + r,
    2j + s]`, so tile row `a` of every tile is the contiguous slice `e[:, a // 2 : a // 2 + th, a % 2]`): `B^T` over
    the tiles' rows, then over their columns, one stack per stage. 2-24% faster per convolution on CPU than the 16
    sums of strided slices it replaced (docs/benchmarks.md); the same sums, grouped differently.
    """
    n, h, w, c = x_nhwc.shape
    th, tw = -(-h // 2), -(-w // 2)  # 2x2 output tiles (odd sizes padded, cropped at the end)
    xp = jnp.pad(x_nhwc, ((0, 0), (1, 2 * th + 1 - h), (1, 2 * tw + 1 - w), (0, 0)))
    e = xp.reshape(n, th + 1, 2, tw + 1, 2, c)
    rows = jnp.stack(_bt_rows(*[e[:, a // 2 : a // 2 + th, a % 2] for a in range(4)]))  # (4, n, th, tw + 1, 2, c)
    v = jnp.stack(_bt_rows(*[rows[:, :, :, b // 2 : b // 2 + tw, b % 2] for b in range(4)]), axis=1)
    return v.reshape(16, n * th * tw, c)  # (4 rows, 4 columns, n, th, tw, c) -> tile positions in row-major order


def winograd_output(m_ppntwd: jax.Array) -> jax.Array:
    """`A^T m A` of the `(4, 4, n, th, tw, D)` tile products -> the `(n, 2 th, 2 tw, D)` output pixels."""
    _, _, n, th, tw, _ = m_ppntwd.shape
    rows = [_combine(_AT[o], [m_ppntwd[r] for r in range(4)]) for o in range(2)]  # (4, n, th, tw, D) each
    y = jnp.stack(
        [jnp.stack([_combine(_AT[q], [rows[o][col] for col in range(4)]) for q in range(2)]) for o in range(2)]
    )
    return y.transpose(2, 3, 0, 4, 1, 5).reshape(n, 2 * th, 2 * tw, -1)  # (o, q, n, th, tw, D) -> pixels


def conv3x3_winograd(x_nhwc: jax.Array, u_pcd: jax.Array) -> jax.Array:
    """The 3x3, stride-1, padding-1 convolution of `x_nhwc` with the kernel whose `winograd_kernel` is `u_pcd`."""
    n, h, w, c = x_nhwc.shape
    if u_pcd.shape[:2] != (16, c):
        raise ValueError(f"conv3x3_winograd: transformed kernel {u_pcd.shape} does not fit input {x_nhwc.shape}")
    th, tw = -(-h // 2), -(-w // 2)
    v_ptc = winograd_input(x_nhwc)
    m = jnp.einsum("ptc,pcd->ptd", v_ptc, u_pcd.astype(v_ptc.dtype)).reshape(4, 4, n, th, tw, -1)
    return winograd_output(m)[:, :h, :w]


def upsample2x_nearest(x_nhwc: jax.Array) -> jax.Array:
    """Nearest-neighbour 2x upsampling of NHWC (`F.interpolate(scale_factor=2, mode="nearest")`)."""
    b, h, w, c = x_nhwc.shape
    x = jnp.broadcast_to(x_nhwc[:, :, None, :, None, :], (b, h, 2, w, 2, c))
    return x.reshape(b, 2 * h, 2 * w, c)


def subpixel_kernel(kernel_hwio: jax.Array) -> jax.Array:
    """The `(2, 2, Cin, 4 Cout)` kernel of a 3x3 conv applied after a 2x nearest upsampling (module docstring).

    Output channel `4 o + 2 a + b` is output channel `o` at row phase `a`, column phase `b` (channel-major, so a
    kernel split over its output channels splits its leaf the same way)."""
    if kernel_hwio.shape[:2] != (3, 3):
        raise ValueError(f"subpixel_kernel: expected a (3, 3, Cin, Cout) kernel, got shape {kernel_hwio.shape}")
    k = kernel_hwio.astype(jnp.float32)

    def taps(k, axis):  # [phase 0 taps, phase 1 taps], each stacked on `axis` (2 taps)
        k0, k1, k2 = (jnp.take(k, i, axis=axis) for i in range(3))
        return [jnp.stack([k0, k1 + k2], axis), jnp.stack([k0 + k1, k2], axis)]

    phases = [kb for ka in taps(k, 0) for kb in taps(ka, 1)]  # (a, b) row-major: 4 x (2, 2, Cin, Cout)
    u = jnp.stack(phases, axis=-1)  # (2, 2, Cin, Cout, 4)
    return u.reshape(*u.shape[:3], -1).astype(kernel_hwio.dtype)


def conv3x3_upsampled(x_nhwc: jax.Array, u_hwio: jax.Array) -> jax.Array:
    """The 3x3, padding-1 conv of `upsample2x_nearest(x_nhwc)`, from the conv's `subpixel_kernel` `u_hwio`."""
    n, h, w, c = x_nhwc.shape
    if u_hwio.shape[:3] != (2, 2, c) or u_hwio.shape[3] % 4:
        raise ValueError(f"conv3x3_upsampled: sub-pixel kernel {u_hwio.shape} does not fit input {x_nhwc.shape}")
    y = conv2d(x_nhwc, u_hwio.astype(x_nhwc.dtype))  # (n, h + 1, w + 1, 4 Cout): window (r, s) = rows r-1..r
    y = y.reshape(n, h + 1, w + 1, -1, 2, 2)
    # phase (a, b) of output pixel (i, j) is window (i + a, j + b)
    rows = [jnp.stack([y[:, a : a + h, b : b + w, :, a, b] for b in range(2)], axis=3) for a in range(2)]
    return jnp.stack(rows, axis=2).reshape(n, 2 * h, 2 * w, -1)  # (n, h, a, w, b, D) -> pixels


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


def subpixel_eligible(kernel: Any) -> bool:
    """prepare()'s rule for an upsampler's kernel: 3x3, float32."""
    shape = tuple(getattr(kernel, "shape", ()))
    return len(shape) == 4 and shape[:2] == (3, 3) and jnp.dtype(kernel.dtype) == jnp.float32


TRANSFORMS: dict[str, Callable[[jax.Array], jax.Array]] = {
    WINOGRAD_LEAF: winograd_kernel,
    SUBPIXEL_LEAF: subpixel_kernel,
}


def prepare(params: Any) -> Any:
    """`params` with the CPU paths' kernel leaves where they are missing: a `winograd` leaf (`winograd_kernel`) next
    to every eligible 3x3 kernel, a `subpixel` leaf (`subpixel_kernel`) next to every upsampler's.

    Call it inside the jitted program, once, outside any loop over model calls. A conv module that does not take
    its leaf (stride 2, a large input, any conv on GPU and TPU) ignores it, and XLA drops the unused computation.
    Leaves already there (computed ahead by `PreparedKernels`) are kept, not computed again.
    """
    return _add_leaves(params, lambda kind, kernel: TRANSFORMS[kind](kernel))


def _leaf_kind(kernel: Any, upsampler: bool) -> str | None:
    if upsampler:
        return SUBPIXEL_LEAF if subpixel_eligible(kernel) else None
    return WINOGRAD_LEAF if winograd_eligible(kernel) else None


def _add_leaves(params: Any, make: Callable[[str, Any], Any], upsampler: bool = False) -> Any:
    if not isinstance(params, Mapping):
        return params
    out = {k: _add_leaves(v, make, upsampler or str(k).startswith(UPSAMPLER_PREFIX)) for k, v in params.items()}
    kernel = params.get("kernel")
    if kernel is not None and not isinstance(kernel, Mapping):
        kind = _leaf_kind(kernel, upsampler)
        if kind is not None and kind not in params:
            out[kind] = make(kind, kernel)
    return out


def leaf_nbytes(params: Any) -> int:
    """Bytes of the leaves `prepare` would add to `params` (arrays or abstract): 16 Cin Cout values per kernel in its
    dtype, for a Winograd leaf `(16, Cin, Cout)` as for a sub-pixel one `(2, 2, Cin, 4 Cout)`."""
    total = 0

    def count(kind, kernel):
        nonlocal total
        _, _, cin, cout = kernel.shape
        total += 16 * int(cin) * int(cout) * jnp.dtype(kernel.dtype).itemsize

    _add_leaves(params, count)
    return total


def available_host_bytes() -> int:
    """The host memory a process may still take: Linux's MemAvailable (free memory plus what the kernel can
    reclaim), else the free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PreparedKernels:
    """The `winograd` and `subpixel` leaves computed outside the generation's program and kept between programs
    (CPU only).

    `prepare` inside a program computes every transformed kernel on every run: for SD 1.5 in float32 that is 945 M
    weights, 3.8 GB written, about 2 s of a CPU generation (docs/benchmarks.md). `add(params)` returns placed params
    with the leaves already there, each computed once per kernel *array* and reused while that same array object
    is passed again (the generator's placement cache keeps placed arrays alive, so an id is never reused while its
    entry lives); an edited or new kernel (a LoRA fused in, other params) gets a new leaf, and the entries of
    kernels no longer passed are dropped. The cost is memory held between runs: the leaves are 16/9 of the eligible
    kernels (3.8 GB for SD 1.5 float32). A program that computes them holds them for its whole loop anyway, so the
    loop's peak is unchanged; what rises is the peak of the VAE decode, which now runs with the UNet's leaves still
    allocated (by up to the size of the leaves; docs/benchmarks.md has the measured process peaks). Abstract params
    (`jax.ShapeDtypeStruct`, for lowering without weights) get abstract leaves. `budget` (bytes; `fits`) bounds
    what is kept: leaves beyond it are left to each program (the generator asks before adding).
    Each leaf is laid out like its kernel: split over the mesh the way the kernel's input and output channels are.
    """

    def __init__(self, budget: int | None = None):
        self._entries: dict[tuple[int, str], tuple[Any, Any]] = {}
        self._lock = threading.Lock()
        # The most bytes the kept leaves may take; None: half the host memory available when a size is decided.
        self.budget = budget
        self._decided: dict[tuple[int, int | None], bool] = {}

    def fits(self, params: Any) -> bool:
        """Whether the leaves of `params` may be kept: their bytes (`leaf_nbytes`) within `budget`. Decided once per
        size and budget (the automatic one reads the host's available memory then), so that a compiled program's
        layout does not change from one run to the next as memory comes and goes."""
        need = leaf_nbytes(params)
        key = (need, self.budget)
        with self._lock:
            decided = self._decided.get(key)
            if decided is None:
                budget = self.budget if self.budget is not None else available_host_bytes() // 2
                decided = self._decided[key] = need <= budget
                if not decided:
                    logger.info(
                        "not keeping %.2f GiB of prepared convolution kernels between runs (budget %.2f GiB): each "
                        "program computes them",
                        need / 2**30,
                        budget / 2**30,
                    )
        return decided

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(int(u.nbytes) for _, u in self._entries.values())

    def add(self, params: Any) -> Any:
        with self._lock:
            new: dict[tuple[int, str], tuple[Any, Any]] = {}

            def make(kind, kernel):
                sharding = _leaf_sharding(kind, getattr(kernel, "sharding", None))
                if isinstance(kernel, jax.ShapeDtypeStruct):
                    shape = jax.eval_shape(TRANSFORMS[kind], kernel).shape
                    return jax.ShapeDtypeStruct(shape, kernel.dtype, sharding=sharding)
                hit = self._entries.get((id(kernel), kind))
                if hit is not None and hit[0] is kernel:
                    u = hit[1]
                else:
                    u = _transform(kind, sharding)(kernel)
                new[(id(kernel), kind)] = (kernel, u)
                return u

            out = _add_leaves(params, make)
            if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(params)):
                self._entries = new  # only the kernels passed now: the others' leaves are freed
            return out

    def clear(self) -> None:
        with self._lock:
            self._entries = {}


def _leaf_sharding(kind, kernel_sharding):
    """The layout of a kernel's leaf: the kernel's `(h, w, Cin, Cout)` split over Cin and Cout (a Winograd leaf
    `(16, Cin, Cout)` drops h and w; a sub-pixel leaf `(2, 2, Cin, 4 Cout)` keeps its output channels
    channel-major, so a split over Cout is a split over 4 Cout)."""
    if isinstance(kernel_sharding, NamedSharding):
        spec = (*kernel_sharding.spec, None, None, None, None)[:4]
        leaf = (None, spec[2], spec[3]) if kind == WINOGRAD_LEAF else (None, None, spec[2], spec[3])
        return NamedSharding(kernel_sharding.mesh, PartitionSpec(*leaf))
    return kernel_sharding


@functools.lru_cache(maxsize=64)
def _transform(kind, sharding):
    fn = TRANSFORMS[kind]
    return jax.jit(fn, out_shardings=sharding) if sharding is not None else jax.jit(fn)


# --------------------------------------------------------------------------------------------- the module
class Conv(nn.Module):
    """`flax.linen.Conv` for NHWC inputs (the subset sdjax uses), which takes Winograd's path when prepared.

    `upsample2x=True`: the conv of the input upsampled 2x (nearest), computed on CPU from the sub-pixel kernel
    (the `subpixel` leaf, or made in the call without it) for a float32 3x3 stride-1 padding-1 conv."""

    features: int
    kernel_size: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: Any = ((0, 0), (0, 0))
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    upsample2x: bool = False

    @nn.compact
    def __call__(self, x_nhwc: jax.Array) -> jax.Array:
        kh, kw = self.kernel_size
        cin = x_nhwc.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (kh, kw, cin, self.features), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) if self.use_bias else None
        x, kernel = x_nhwc.astype(self.dtype), kernel.astype(self.dtype)
        padding = tuple(tuple(p) for p in self.padding)

        def direct(x, kernel, *_):
            if self.upsample2x:
                x = upsample2x_nearest(x)
            return conv2d(x, kernel, stride=self.strides[0], padding=padding)

        same_3x3 = self.kernel_size == (3, 3) and tuple(self.strides) == (1, 1) and padding == ((1, 1), (1, 1))
        winograd_ok = (
            same_3x3
            and not self.upsample2x
            and x.shape[1] * x.shape[2] <= WINOGRAD_MAX_PIXELS
            and self.has_variable("params", WINOGRAD_LEAF)
        )
        if self.upsample2x and same_3x3 and x.dtype == jnp.float32:
            u = self.get_variable("params", SUBPIXEL_LEAF) if self.has_variable("params", SUBPIXEL_LEAF) else None

            def subpixel(x, kernel, *leaf):
                return conv3x3_upsampled(x, leaf[0] if leaf else subpixel_kernel(kernel))

            y = lax.platform_dependent(x, kernel, *(() if u is None else (u,)), cpu=subpixel, default=direct)
        elif winograd_ok:
            u = self.get_variable("params", WINOGRAD_LEAF)

            def winograd(x, kernel, u):
                return conv3x3_winograd(x, u).astype(x.dtype)

            y = lax.platform_dependent(x, kernel, u, cpu=winograd, default=direct)
        else:
            y = direct(x, kernel)
        if bias is not None:
            y = y + bias.astype(self.dtype)
        return y
