"""Image helpers of the guides: `numpy_to_pil`, `make_image_grid`, and float <-> uint8 conversion."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Floats in [0, 1] -> uint8, rounding to nearest (values outside [0, 1] are clipped)."""
    images = np.asarray(images, dtype=np.float32)
    return np.clip(np.round(images * 255.0), 0, 255).astype(np.uint8)


def numpy_to_pil(images: np.ndarray) -> list[Image.Image]:
    """`(N, H, W, C)` or `(H, W, C)` floats in [0, 1] (or uint8) -> list of PIL images.

    Always copies into a fresh writable array (JAX hands out read-only buffers; upstream issue #5450).
    """
    images = np.array(images)
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"numpy_to_pil: expected images of shape (N, H, W, C) or (H, W, C) with C in 1/3/4, "
            f"got {images.shape}; reshape pmap outputs (ndev, bs, H, W, C) to (ndev * bs, H, W, C) first"
        )
    if images.dtype != np.uint8:
        images = to_uint8(images)
    if images.shape[-1] == 1:
        return [Image.fromarray(im[..., 0], mode="L") for im in images]
    return [Image.fromarray(im) for im in images]


def make_image_grid(images: Sequence[Image.Image], rows: int, cols: int, resize: int | None = None) -> Image.Image:
    """Paste `rows * cols` images (row-major) into one grid image; `resize` makes each tile `resize` pixels square."""
    if len(images) != rows * cols:
        raise ValueError(f"make_image_grid: got {len(images)} images for a {rows}x{cols} grid ({rows * cols} needed)")
    if resize is not None:
        images = [im.resize((resize, resize)) for im in images]
    w, h = images[0].size
    grid = Image.new("RGB", size=(cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im, box=((i % cols) * w, (i // cols) * h))
    return grid
