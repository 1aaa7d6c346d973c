"""Host-side image inputs: reading, resizing (AUTOMATIC1111 / diffusers resize modes), masks, crop regions and
pasting results back. Everything here is numpy + Pillow and mirrors diffusers' `VaeImageProcessor` (Lanczos
resampling, [-1, 1] images, binarized masks), so images reach the model exactly as they reach PyTorch's.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFilter, ImageOps

RESIZE_MODES = ("resize", "crop", "fill")  # A1111 "Just resize", "Crop and resize", "Resize and fill"
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024  # refuse decoding anything larger (decompression bombs)


class ImageInputError(ValueError):
    """An image argument that cannot be used; the message names the argument."""


def load_image(value: Any, name: str = "image", *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """A PIL image from a PIL image, a numpy array (HWC or HW; uint8, or float in [0, 1]), a path, or encoded
    bytes. Images with more than `max_pixels` pixels are refused before they are decoded."""
    if isinstance(value, Image.Image):
        _check_pixels(value.size, name, max_pixels)
        return value
    if isinstance(value, np.ndarray):
        return _from_array(value, name, max_pixels)
    if isinstance(value, (bytes, bytearray)):
        return _open(io.BytesIO(bytes(value)), name, max_pixels, "the given bytes")
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if not path.is_file():
            raise ImageInputError(f"{name}: no such file {str(path)!r}")
        return _open(path, name, max_pixels, str(path))
    raise ImageInputError(
        f"{name} must be a PIL image, a numpy array, a path or image bytes, got {type(value).__name__}"
    )


def _check_pixels(size: tuple[int, int], name: str, max_pixels: int) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ImageInputError(f"{name} is empty ({w}x{h})")
    if w * h > max_pixels:
        raise ImageInputError(f"{name} is {w}x{h} = {w * h} pixels, above the limit of {max_pixels}")


def _open(source, name: str, max_pixels: int, label: str) -> Image.Image:
    try:
        with Image.open(source) as im:
            _check_pixels(im.size, name, max_pixels)  # the header only: nothing decoded yet
            im.load()
            return im.copy()
    except ImageInputError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"{name}: {label} is too large to decode safely ({e})") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageInputError(f"{name}: {label} is not a readable image ({e})") from None


def _from_array(a: np.ndarray, name: str, max_pixels: int) -> Image.Image:
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[-1] not in (3, 4)):
        raise ImageInputError(f"{name}: a numpy image must be HWC with 1, 3 or 4 channels, or HW; got shape {a.shape}")
    _check_pixels((a.shape[1], a.shape[0]), name, max_pixels)
    if a.dtype == np.uint8:
        pixels = a
    elif np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
            raise ImageInputError(
                f"{name}: a float image must hold finite values in [0, 1], got [{np.nanmin(a):.3g}, {np.nanmax(a):.3g}]"
            )
        pixels = np.round(a * 255).astype(np.uint8)
    else:
        raise ImageInputError(f"{name}: a numpy image must be uint8 or float in [0, 1], got {a.dtype}")
    return Image.fromarray(pixels)


# ----------------------------------------------------------------------------------------------- resizing
def resize(image: Image.Image, width: int, height: int, mode: str = "resize") -> Image.Image:
    """Resize to `width` x `height` with Lanczos: "resize" stretches; "crop" scales to cover and crops the
    centre; "fill" scales to fit and fills the borders with the stretched edge rows or columns (A1111's resize
    modes 0, 1, 2 and diffusers' "default", "crop", "fill")."""
    if mode not in RESIZE_MODES:
        raise ValueError(f"resize_mode={mode!r} must be one of {list(RESIZE_MODES)}")
    if mode == "resize":
        return image.resize((width, height), resample=Image.LANCZOS)
    ratio, src_ratio = width / height, image.width / image.height
    if mode == "crop":
        src_w = width if ratio > src_ratio else image.width * height // image.height
        src_h = height if ratio <= src_ratio else image.height * width // image.width
        resized = image.resize((src_w, src_h), resample=Image.LANCZOS)
        out = Image.new("RGB", (width, height))
        out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
        return out
    src_w = width if ratio < src_ratio else image.width * height // image.height
    src_h = height if ratio >= src_ratio else image.height * width // image.width
    resized = image.resize((src_w, src_h), resample=Image.LANCZOS)
    out = Image.new("RGB", (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if ratio < src_ratio:
        fill = height // 2 - src_h // 2
        if fill > 0:
            out.paste(resized.resize((width, fill), box=(0, 0, width, 0)), box=(0, 0))
            out.paste(
                resized.resize((width, fill), box=(0, resized.height, width, resized.height)), box=(0, fill + src_h)
            )
    elif ratio > src_ratio:
        fill = width // 2 - src_w // 2
        if fill > 0:
            out.paste(resized.resize((fill, height), box=(0, 0, 0, height)), box=(0, 0))
            out.paste(
                resized.resize((fill, height), box=(resized.width, 0, resized.width, height)), box=(fill + src_w, 0)
            )
    return out


def image_array(image: Image.Image) -> np.ndarray:
    """RGB image -> float32 `(3, H, W)` in [-1, 1] (diffusers' `pil_to_numpy` then `normalize`)."""
    a = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return (2.0 * a - 1.0).transpose(2, 0, 1)


def mask_array(mask: Image.Image) -> np.ndarray:
    """Mask image -> float32 `(1, H, W)` in {0, 1}: luminance >= 0.5 repaints (diffusers' mask processor)."""
    a = np.asarray(mask.convert("L"), dtype=np.float32) / 255.0
    return (a >= 0.5).astype(np.float32)[None]


def blur_mask(mask: Image.Image, radius: float) -> Image.Image:
    """Gaussian blur of a mask (A1111's `mask_blur`, diffusers' `mask_processor.blur`)."""
    if radius < 0:
        raise ValueError(f"mask_blur={radius} must be >= 0")
    mask = mask.convert("L")
    return mask.filter(ImageFilter.GaussianBlur(radius)) if radius > 0 else mask


def crop_region(mask: Image.Image, width: int, height: int, pad: int) -> tuple[int, int, int, int]:
    """The box `(x1, y1, x2, y2)` around the mask's nonzero pixels, padded by `pad` and widened to the aspect ratio
    of `width` x `height` within the image (diffusers' `get_crop_region`, A1111's "inpaint only masked")."""
    m = np.asarray(mask.convert("L"))
    h, w = m.shape
    cols, rows = np.flatnonzero(m.any(axis=0)), np.flatnonzero(m.any(axis=1))
    if len(cols) == 0:
        left, right, top, bottom = w, w, h, h
    else:
        left, right, top, bottom = cols[0], w - 1 - cols[-1], rows[0], h - 1 - rows[-1]
    x1, y1 = int(max(left - pad, 0)), int(max(top - pad, 0))
    x2, y2 = int(min(w - right + pad, w)), int(min(h - bottom + pad, h))
    if x2 <= x1 or y2 <= y1:
        raise ValueError("mask_image: the mask is empty, there is nothing to repaint")
    if (x2 - x1) / (y2 - y1) > width / height:
        diff = int((x2 - x1) / (width / height) - (y2 - y1))
        y1, y2 = _widen(y1 - diff // 2, y2 + diff - diff // 2, h)
    else:
        diff = int((y2 - y1) * (width / height) - (x2 - x1))
        x1, x2 = _widen(x1 - diff // 2, x2 + diff - diff // 2, w)
    return x1, y1, x2, y2


def _widen(a: int, b: int, limit: int) -> tuple[int, int]:
    if b >= limit:
        a, b = a - (b - limit), limit
    if a < 0:
        a, b = 0, b - a
    return a, min(b, limit)


def paste_back(
    original: Image.Image, mask: Image.Image, generated: Image.Image, box: tuple[int, int, int, int] | None = None
) -> Image.Image:
    """Composite the original image over the result where the mask is black (soft where it is grey), after
    putting a generated crop back into its `box` (diffusers' `apply_overlay`, A1111's inpainting overlay)."""
    width, height = original.size
    if box is not None:
        x1, y1, x2, y2 = box
        base = Image.new("RGBA", (width, height))
        base.paste(resize(generated, x2 - x1, y2 - y1, "crop"), (x1, y1))
        generated = base.convert("RGB")
    keep = Image.new("RGBa", (width, height))
    keep.paste(original.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    out = generated.convert("RGBA")
    out.alpha_composite(keep.convert("RGBA"))
    return out.convert("RGB")


def as_list(value: Any, n: int, name: str) -> list[Any]:
    """One value or a sequence of `n` values (one per image) -> a list of `n`."""
    if isinstance(value, (list, tuple)):
        if len(value) not in (1, n):
            raise ValueError(f"{name}: got {len(value)} for {n} images; pass one, or one per image")
        return list(value) * (n if len(value) == 1 else 1)
    return [value] * n


def check_same_size(images: Sequence[Image.Image], masks: Sequence[Image.Image]) -> None:
    for i, (im, m) in enumerate(zip(images, masks)):
        if im.size != m.size:
            raise ImageInputError(
                f"mask_image {i} is {m.size[0]}x{m.size[1]} but image {i} is "
                f"{im.size[0]}x{im.size[1]}: they must have the same size"
            )


def outpaint_canvas(
    image: Image.Image, left: int, top: int, right: int, bottom: int, overlap: int = 8
) -> tuple[Image.Image, Image.Image]:
    """Outpainting as inpainting on a larger canvas: the image padded by the given pixels on each side (the new
    area filled by repeating the edge pixels, so the model starts from plausible colours) and a mask that is white
    on the new area and `overlap` pixels into the image (so the seam is repainted too)."""
    for name, v in (("left", left), ("top", top), ("right", right), ("bottom", bottom)):
        if v < 0:
            raise ValueError(f"outpaint: {name}={v} must be >= 0")
    if left + top + right + bottom == 0:
        raise ValueError("outpaint: give at least one side a positive number of pixels")
    a = np.asarray(image.convert("RGB"))
    canvas = np.pad(a, ((top, bottom), (left, right), (0, 0)), mode="edge")
    mask = np.full(canvas.shape[:2], 255, np.uint8)
    h, w = a.shape[:2]
    y0, x0 = top + (overlap if top else 0), left + (overlap if left else 0)
    y1, x1 = top + h - (overlap if bottom else 0), left + w - (overlap if right else 0)
    if y1 > y0 and x1 > x0:
        mask[y0:y1, x0:x1] = 0
    return Image.fromarray(canvas), Image.fromarray(mask)


def fill_masked(image: Image.Image, mask: Image.Image) -> Image.Image:
    """The masked region replaced by the surrounding colours, spread inwards by Gaussian blurs of decreasing radius
    (what A1111's "fill" masked content does before encoding): unmasked pixels stay as they are."""
    width, height = image.size
    keep = Image.new("RGBa", (width, height))
    keep.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    out = Image.new("RGBA", (width, height))
    for radius, repeats in ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1)):
        blurred = keep.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(repeats):
            out.alpha_composite(blurred)
    return out.convert("RGB")
