"""VAE slicing: the VAE run over a batch a few images at a time, as diffusers' `enable_vae_slicing()` does.

The VAE's activations at full resolution dominate a large batch's memory (SDXL's decoder at 1024x1024 plans about
2 GiB of temporaries per image on an H100, docs/benchmarks.md), and they grow with the batch while the UNet's
grow far less. Sliced, the encoder or decoder runs under one `lax.map` over slices, so XLA keeps one slice's
activations alive at a time. Each image is computed by the same function on the same inputs, so results equal the
unsliced run (the VAE has no cross-image operation) up to the float rounding of a different batch size.

A slice holds `size` images taken with a stride: slice `j` of a batch of `n` holds images `j, j + n/size, ...`.
With `size` equal to the mesh's `data` axis and the batch split over that axis in contiguous blocks (as the
generator places it), every slice holds one image of each device's block: each device decodes its own images one
at a time, with no data moved between devices. diffusers' slicing decodes one image at a time (`size=1`, what a
single device gets).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax import lax


def slice_count(n: int, size: int) -> int:
    """How many slices a batch of `n` takes at `size` images per slice (`size` is cut to a divisor of `n`)."""
    if size < 1:
        raise ValueError(f"VAE slice size must be at least 1, got {size}")
    return n // math.gcd(n, size)


def sliced(fn: Callable[[jax.Array], Any], x: jax.Array, size: int) -> Any:
    """`fn(x)` computed over `x`'s leading (batch) axis `size` images at a time (the module docstring's order);
    `fn` maps a batch to arrays (or a tuple of arrays) with the same leading batch axis."""
    n = x.shape[0]
    slices = slice_count(n, size)
    if slices == 1:
        return fn(x)
    per = n // slices
    xs = x.reshape(per, slices, *x.shape[1:]).swapaxes(0, 1)  # [j, k] = image k * slices + j
    ys = lax.map(fn, xs)
    return jax.tree_util.tree_map(lambda y: y.swapaxes(0, 1).reshape(n, *y.shape[2:]), ys)
