"""Tiled VAE encode and decode: diffusers `AutoencoderKL.enable_tiling()` (`tiled_decode`, `_tiled_encode`,
`blend_v`, `blend_h`) as pure functions over `(AutoencoderKL module, params, array)`.

The input is cut into square tiles of `tile` pixels (encode: `VaeTiling.sample_size`, decode:
`VaeTiling.latent_size` latents) starting every `stride = int(tile * (1 - overlap_factor))`; tiles at the bottom and
right edges are cut short by the input's border, as diffusers' slicing does (so each tile, full or short, sees only
its own pixels: GroupNorm statistics and the mid-block attention are per tile). Each output tile is then blended
into its upper and left neighbours over `blend = int(output tile * overlap_factor)` rows / columns with linear
weights, in diffusers' row-major order and with its in-place semantics (a tile blends with its neighbours *after*
their own blending), cropped to `output tile - blend`, and the crops are concatenated. Tiling applies only when the
input is larger than one tile in height or width, as in diffusers; otherwise the plain encode/decode runs.

Memory: the tile grid is static (from static shapes); the tiles of one shape (at most 3 x 3 shapes: full and up to
two short sizes per axis) run under one `lax.map`, so XLA keeps one tile's activations alive at a time instead of
the whole image's. The blend is elementwise work on the decoded tiles.

Layout: NCHW at the boundary, as `AutoencoderKL.encode` / `decode`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.models.vae import AutoencoderKL, AutoencoderKLConfig, DiagonalGaussian

DEFAULT_OVERLAP = 0.25  # diffusers' `tile_overlap_factor`


@dataclasses.dataclass(frozen=True)
class VaeTiling:
    """diffusers' tiling settings (hashable: part of a program's compile key).

    `sample_size`: `tile_sample_min_size`, the tile edge in pixels; `latent_size`: `tile_latent_min_size`, in
    latents; `overlap_factor`: `tile_overlap_factor`.
    """

    sample_size: int
    latent_size: int
    overlap_factor: float = DEFAULT_OVERLAP

    def __post_init__(self):
        for name in ("sample_size", "latent_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"VaeTiling: {name}={v!r} must be a positive int")
        if not 0.0 <= float(self.overlap_factor) < 1.0:
            raise ValueError(f"VaeTiling: overlap_factor={self.overlap_factor!r} must be in [0, 1)")
        for name, tile in (("sample_size", self.sample_size), ("latent_size", self.latent_size)):
            if int(tile * (1 - self.overlap_factor)) < 1:
                raise ValueError(
                    f"VaeTiling: {name}={tile} with overlap_factor={self.overlap_factor} leaves no stride between tiles"
                )

    @classmethod
    def for_config(
        cls, config: AutoencoderKLConfig, sample_size: int | None = None, overlap_factor: float = DEFAULT_OVERLAP
    ) -> VaeTiling:
        """diffusers' defaults for a VAE: tiles of `config.sample_size` pixels (the first entry of a (h, w) pair),
        `int(sample_size / 2 ** (len(block_out_channels) - 1))` latents. `sample_size` overrides the tile edge in
        pixels (diffusers: set `vae.tile_sample_min_size` and `vae.tile_latent_min_size` together)."""
        size = config.sample_size if sample_size is None else sample_size
        if isinstance(size, (tuple, list)):
            size = size[0]
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"VaeTiling: sample_size={size!r} must be a positive int (pixels)")
        f = 2 ** (len(config.block_out_channels) - 1)
        tiling = cls(int(size), int(size / f), float(overlap_factor))
        ov = tiling.overlap_factor
        steps_like_crops = tiling.sample_size - int(tiling.sample_size * ov) == int(
            tiling.latent_size * (1 - ov)
        ) * f and (tiling.latent_size - int(tiling.latent_size * ov)) * f == int(tiling.sample_size * (1 - ov))
        if not steps_like_crops:
            raise ValueError(
                f"VaeTiling: sample_size={tiling.sample_size} with overlap_factor={ov} gives tiles whose crops do not "
                f"step like the tiles (the result would be the wrong size); with overlap 0.25 use a multiple of {4 * f}"
            )
        return tiling


# ------------------------------------------------------------------------------------------------- the grid
def _axis(n: int, tile: int, stride: int) -> list[tuple[int, int]]:
    """(start, size) of the tiles along one axis of length `n` (diffusers: `range(0, n, stride)`, sliced)."""
    return [(s, min(tile, n - s)) for s in range(0, n, stride)]


def _blend_v(above: jax.Array, x: jax.Array, blend: int) -> jax.Array:
    """diffusers `blend_v`: the top rows of `x` fade in from the bottom rows of `above` (NCHW)."""
    e = min(above.shape[2], x.shape[2], blend)
    if e == 0:
        return x
    w = jnp.asarray(np.arange(e) / e, x.dtype).reshape(1, 1, e, 1)
    top = above[:, :, above.shape[2] - e :, :] * (1 - w) + x[:, :, :e, :] * w
    return jnp.concatenate([top.astype(x.dtype), x[:, :, e:, :]], axis=2)


def _blend_h(left: jax.Array, x: jax.Array, blend: int) -> jax.Array:
    """diffusers `blend_h`: the left columns of `x` fade in from the right columns of `left` (NCHW)."""
    e = min(left.shape[3], x.shape[3], blend)
    if e == 0:
        return x
    w = jnp.asarray(np.arange(e) / e, x.dtype).reshape(1, 1, 1, e)
    side = left[:, :, :, left.shape[3] - e :] * (1 - w) + x[:, :, :, :e] * w
    return jnp.concatenate([side.astype(x.dtype), x[:, :, :, e:]], axis=3)


def tiled_apply(
    fn: Callable[[jax.Array], jax.Array], x_nchw: jax.Array, *, tile: int, stride: int, blend: int, limit: int
) -> jax.Array:
    """diffusers' tiling loop around any per-tile map `fn` (NCHW -> NCHW): tiles of `tile` every `stride` on the
    input, output tiles blended over `blend` rows/columns and cropped to `limit`, concatenated.

    Tiles of one shape run under one `lax.map` (one tile's intermediates alive at a time)."""
    _, _, h, w = x_nchw.shape
    rows, cols = _axis(h, tile, stride), _axis(w, tile, stride)
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, (_, th) in enumerate(rows):
        for j, (_, tw) in enumerate(cols):
            groups.setdefault((th, tw), []).append((i, j))
    out: dict[tuple[int, int], jax.Array] = {}
    for (th, tw), members in groups.items():
        starts = jnp.asarray([(rows[i][0], cols[j][0]) for i, j in members], jnp.int32)

        def one(start, th=th, tw=tw):
            piece = jax.lax.dynamic_slice(
                x_nchw, (0, 0, start[0], start[1]), (x_nchw.shape[0], x_nchw.shape[1], th, tw)
            )
            return fn(piece)

        stacked = jax.lax.map(one, starts) if len(members) > 1 else one(starts[0])[None]
        for k, ij in enumerate(members):
            out[ij] = stacked[k]
    # Blend in diffusers' order; `out` is updated in place as diffusers mutates its tiles.
    result_rows = []
    for i in range(len(rows)):
        crops = []
        for j in range(len(cols)):
            t = out[i, j]
            if i > 0:
                t = _blend_v(out[i - 1, j], t, blend)
            if j > 0:
                t = _blend_h(out[i, j - 1], t, blend)
            out[i, j] = t
            crops.append(t[:, :, :limit, :limit])
        result_rows.append(jnp.concatenate(crops, axis=3))
    return jnp.concatenate(result_rows, axis=2)


def _out_len(n: int, tile: int, stride: int, scale: Callable[[int], int], limit: int) -> int:
    return sum(min(scale(size), limit) for _, size in _axis(n, tile, stride))


def _check_cover(kind: str, n: int, want: int, got: int, tiling: VaeTiling) -> None:
    if got != want:
        raise ValueError(
            f"VAE tiling: tiles of sample_size={tiling.sample_size} / latent_size={tiling.latent_size} with "
            f"overlap_factor={tiling.overlap_factor} {kind} an axis of {n} to {got}, not {want}; pick a tile size "
            f"whose latent edge is a multiple of 4 (diffusers would return a wrongly sized result)"
        )


# ------------------------------------------------------------------------------------------------- the VAE
def tiled_decode(vae: AutoencoderKL, params: Any, latents_nchw: jax.Array, tiling: VaeTiling) -> jax.Array:
    """`AutoencoderKL.decode` with diffusers' tiling: latents NCHW (unscaled) -> images NCHW. Tiles only when the
    latents are larger than `tiling.latent_size` in height or width."""
    _, _, h, w = latents_nchw.shape

    def decode(z):
        return vae.apply({"params": params}, z, method=AutoencoderKL.decode)

    if h <= tiling.latent_size and w <= tiling.latent_size:
        return decode(latents_nchw)
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    stride = int(tiling.latent_size * (1 - tiling.overlap_factor))
    blend = int(tiling.sample_size * tiling.overlap_factor)
    limit = tiling.sample_size - blend
    for n in (h, w):
        _check_cover("decode", n, n * f, _out_len(n, tiling.latent_size, stride, lambda s: s * f, limit), tiling)
    return tiled_apply(decode, latents_nchw, tile=tiling.latent_size, stride=stride, blend=blend, limit=limit)


def tiled_encode(vae: AutoencoderKL, params: Any, images_nchw: jax.Array, tiling: VaeTiling) -> DiagonalGaussian:
    """`AutoencoderKL.encode` with diffusers' tiling (`_tiled_encode`: the moments are blended, then the posterior
    is formed): images NCHW -> `DiagonalGaussian`. Tiles only when the images are larger than `tiling.sample_size`
    in height or width."""
    _, _, h, w = images_nchw.shape

    def moments(x):
        return vae.apply({"params": params}, x, method=AutoencoderKL.moments)

    if h <= tiling.sample_size and w <= tiling.sample_size:
        return DiagonalGaussian.from_moments(moments(images_nchw))
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    stride = int(tiling.sample_size * (1 - tiling.overlap_factor))
    blend = int(tiling.latent_size * tiling.overlap_factor)
    limit = tiling.latent_size - blend

    def down(s):  # the encoder's output edge for an input edge s (each stride-2 conv pads bottom/right by 1)
        for _ in range(len(vae.config.block_out_channels) - 1):
            s = (s - 2) // 2 + 1
        return s

    for n in (h, w):
        if n % f:
            raise ValueError(f"VAE tiling: image edge {n} must be a multiple of the VAE's scale factor {f}")
        _check_cover("encode", n, n // f, _out_len(n, tiling.sample_size, stride, down, limit), tiling)
    moments_nchw = tiled_apply(moments, images_nchw, tile=tiling.sample_size, stride=stride, blend=blend, limit=limit)
    return DiagonalGaussian.from_moments(moments_nchw)
