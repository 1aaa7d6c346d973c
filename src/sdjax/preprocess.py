"""ControlNet control maps: preprocessors that need no model weights, and the control image's resize.

A ControlNet reads a control map (edges, a scribble, depth, a pose skeleton, ...) the size of the generated
image. `PREPROCESSORS` holds the preprocessors by the module names of the AUTOMATIC1111 extension
sd-webui-controlnet (its internal names and its UI labels both resolve, e.g. "depth" and "depth_midas"), so that
API clients written for it keep their names:

- computed here (input: an RGB image): "none" (the image is already the map), "canny" (Canny edges, OpenCV),
  "threshold" (binarized), "scribble_xdog" (XDoG scribble), "invert" (white background and black lines ->
  black background and white lines);
- passthrough-only: the extension's preprocessors that run an annotator network (depth, normals, pose, soft
  edges, line art, segmentation, M-LSD): sdjax ships no annotator weights, so these take the finished map from
  the user and return it unchanged; `Preprocessor.computes` is False for them, so a server or CLI can say so.

Every preprocessor takes a PIL image or a uint8 numpy array (HWC RGB/RGBA or HW grayscale) and returns a uint8
HWC RGB numpy array (black background, white features, as the ControlNets were trained). They run on the image at
its own size; `prepare_control_image` then resizes the map to the generation size as diffusers' ControlNet
pipelines do and returns float32 NCHW in [0, 1], what `models.controlnet.ControlNetModel` takes.

OpenCV (`opencv-python-headless`, the `sdjax[controlnet]` extra) is imported only by the preprocessors that use
it; PIL is a core dependency.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import PIL.Image

RESIZE_MODES = ("default", "fill", "crop")


def _cv2():
    try:
        import cv2
    except ImportError as e:
        raise ImportError(
            "this ControlNet preprocessor needs OpenCV: pip install 'sdjax[controlnet]' "
            "(installs opencv-python-headless)"
        ) from e
    return cv2


# --------------------------------------------------------------------------------------------------- images
def as_rgb_uint8(image: Any, *, what: str = "image") -> np.ndarray:
    """A PIL image or uint8 array (HW, HW1, HW3, HW4) -> a C-contiguous uint8 HWC RGB array.

    An alpha channel is dropped (what PIL's `convert("RGB")` does, and so diffusers). Other dtypes raise: a float
    array could be in [0, 1] or [0, 255], and guessing would silently give a black or a white map.
    """
    if isinstance(image, PIL.Image.Image):
        return np.ascontiguousarray(np.asarray(image.convert("RGB")))
    if not isinstance(image, np.ndarray):
        raise TypeError(f"{what}: expected a PIL image or a uint8 numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise ValueError(
            f"{what}: expected uint8 pixels (0..255), got dtype {image.dtype}; convert with "
            f"(np.clip(x, 0, 1) * 255).round().astype(np.uint8) if it holds floats in [0, 1]"
        )
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[2] not in (1, 3, 4) or min(image.shape[:2]) < 1:
        raise ValueError(f"{what}: expected an HWC image with 1, 3 or 4 channels, got shape {image.shape}")
    if image.shape[2] == 1:
        image = np.repeat(image, 3, axis=2)
    return np.ascontiguousarray(image[:, :, :3])


def _gray_to_rgb(mask_hw: np.ndarray) -> np.ndarray:
    return np.repeat(mask_hw[:, :, None], 3, axis=2)


# --------------------------------------------------------------------------------------------------- preprocessors
def none(image: Any) -> np.ndarray:
    """The image is the control map already (any ControlNet, given a finished map)."""
    return as_rgb_uint8(image)


def canny(image: Any, low: int = 100, high: int = 200) -> np.ndarray:
    """Canny edges (Canny 1986) by OpenCV's `cv2.Canny(image, low, high)` on the RGB image (OpenCV takes the
    strongest channel gradient), white edges on black. The defaults are the extension's and diffusers' guides'."""
    if not (0 <= low <= high):
        raise ValueError(f"canny: thresholds must satisfy 0 <= low <= high; got low={low}, high={high}")
    edges = _cv2().Canny(as_rgb_uint8(image), float(low), float(high))
    return _gray_to_rgb(edges)


def threshold(image: Any, level: int = 127) -> np.ndarray:
    """Binarization: white where every channel is above `level`, black elsewhere (the extension's "threshold")."""
    if not 0 <= level <= 255:
        raise ValueError(f"threshold: level must be in [0, 255]; got {level}")
    rgb = as_rgb_uint8(image)
    return _gray_to_rgb(np.where(rgb.min(axis=2) > level, 255, 0).astype(np.uint8))


def scribble_xdog(image: Any, level: int = 32) -> np.ndarray:
    """A scribble map by the difference of Gaussians (XDoG, Winnemöller 2012, as the extension's
    "scribble_xdog"): `d = clip(min over channels of (G_5.0 * I - G_0.5 * I), 0, 255)` is large on dark lines and
    dark edges; pixels with `2 d > level` become white scribble lines on black.

    The extension computes `2 d` in uint8, which wraps around for d >= 128 and drops the strongest lines; here it
    does not wrap, so those stay white.
    """
    if not 0 <= level <= 510:
        raise ValueError(f"scribble_xdog: level must be in [0, 510]; got {level}")
    cv2 = _cv2()
    rgb = as_rgb_uint8(image).astype(np.float32)
    fine = cv2.GaussianBlur(rgb, (0, 0), 0.5)
    coarse = cv2.GaussianBlur(rgb, (0, 0), 5.0)
    d = np.clip(np.min(coarse - fine, axis=2), 0.0, 255.0)
    return _gray_to_rgb(np.where(2.0 * d > level, 255, 0).astype(np.uint8))


def invert(image: Any) -> np.ndarray:
    """255 - image: a drawing with black lines on white becomes the white-on-black map ControlNets expect."""
    return 255 - as_rgb_uint8(image)


# --------------------------------------------------------------------------------------------------- registry
@dataclasses.dataclass(frozen=True)
class Preprocessor:
    """One control-map preprocessor. `name`: the extension's module name; `aliases`: its other names (the UI
    label); `fn`: image -> map, None for passthrough-only (`computes` False: the user supplies the map)."""

    name: str
    description: str
    fn: Callable[..., np.ndarray] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def computes(self) -> bool:
        return self.fn is not None

    def __call__(self, image: Any, **options) -> np.ndarray:
        if self.fn is None:
            if options:
                raise ValueError(
                    f"preprocessor {self.name!r} is passthrough-only (sdjax ships no annotator model for it); "
                    f"it takes no options, got {sorted(options)}"
                )
            return as_rgb_uint8(image, what=f"{self.name} map")
        return self.fn(image, **options)


_COMPUTED = (
    Preprocessor("none", "the image is the control map", none),
    Preprocessor("canny", "Canny edges (OpenCV); options low=100, high=200", canny),
    Preprocessor("threshold", "binarized: white where all channels > level; option level=127", threshold),
    Preprocessor("scribble_xdog", "XDoG scribble lines; option level=32", scribble_xdog),
    Preprocessor("invert", "255 - image (from white background and black lines)", invert),
)

# The extension's preprocessors that run an annotator network: (name, UI label or None, what the map shows).
_PASSTHROUGH = (
    ("depth", "depth_midas", "depth (MiDaS)"),
    ("depth_zoe", None, "depth (ZoeDepth)"),
    ("depth_leres", None, "depth (LeReS)"),
    ("depth_leres++", None, "depth (LeReS, boosted)"),
    ("depth_anything", None, "depth (Depth Anything)"),
    ("depth_hand_refiner", None, "depth of hands (MeshGraphormer)"),
    ("normal_bae", None, "surface normals (BAE)"),
    ("normal_map", "normal_midas", "surface normals (MiDaS)"),
    ("openpose", None, "body pose skeleton"),
    ("openpose_face", None, "body pose and face landmarks"),
    ("openpose_faceonly", None, "face landmarks"),
    ("openpose_hand", None, "body pose and hands"),
    ("openpose_full", None, "body pose, hands and face"),
    ("dw_openpose_full", None, "body pose, hands and face (DWPose)"),
    ("animal_openpose", None, "animal pose"),
    ("hed", "softedge_hed", "soft edges (HED)"),
    ("hed_safe", "softedge_hedsafe", "soft edges (HED, quantized)"),
    ("pidinet", "softedge_pidinet", "soft edges (PiDiNet)"),
    ("pidinet_safe", "softedge_pidisafe", "soft edges (PiDiNet, quantized)"),
    ("te_hed", "softedge_teed", "soft edges (TEED)"),
    ("scribble_hed", None, "scribble lines (HED)"),
    ("pidinet_scribble", "scribble_pidinet", "scribble lines (PiDiNet)"),
    ("pidinet_sketch", "t2ia_sketch_pidi", "sketch lines (PiDiNet)"),
    ("lineart", "lineart_realistic", "line art"),
    ("lineart_coarse", None, "coarse line art"),
    ("lineart_anime", None, "anime line art"),
    ("lineart_anime_denoise", None, "anime line art, denoised"),
    ("lineart_standard", None, "line art from a white-background drawing"),
    ("mlsd", None, "straight lines (M-LSD)"),
    ("segmentation", "seg_ufade20k", "semantic segmentation (UniFormer, ADE20k colours)"),
    ("oneformer_ade20k", "seg_ofade20k", "semantic segmentation (OneFormer, ADE20k colours)"),
    ("oneformer_coco", "seg_ofcoco", "semantic segmentation (OneFormer, COCO colours)"),
    ("anime_face_segment", "seg_anime_face", "anime face segmentation"),
    ("mediapipe_face", None, "face mesh (MediaPipe)"),
    ("densepose", None, "DensePose body parts"),
)


def _registry() -> dict[str, Preprocessor]:
    out: dict[str, Preprocessor] = {}
    entries = list(_COMPUTED) + [
        Preprocessor(name, f"passthrough-only: give the finished {what} map", None, (label,) if label else ())
        for name, label, what in _PASSTHROUGH
    ]
    for p in entries:
        for key in (p.name, *p.aliases):
            if key in out:
                raise RuntimeError(f"preprocessor name {key!r} registered twice")
            out[key] = p
    return out


# name or alias -> Preprocessor (the same object under each of its names).
PREPROCESSORS: dict[str, Preprocessor] = _registry()


def get_preprocessor(name: str) -> Preprocessor:
    """The preprocessor called `name` (a module name or UI label of sd-webui-controlnet)."""
    try:
        return PREPROCESSORS[name]
    except KeyError:
        computed = sorted(p.name for p in _COMPUTED)
        raise ValueError(
            f"unknown ControlNet preprocessor {name!r}; computed by sdjax: {computed}; passthrough-only (give the "
            f"finished map): {sorted(k for k, p in PREPROCESSORS.items() if not p.computes)}"
        ) from None


def run_preprocessor(name: str, image: Any, **options) -> np.ndarray:
    """`get_preprocessor(name)(image, **options)` -> uint8 HWC RGB control map."""
    return get_preprocessor(name)(image, **options)


# --------------------------------------------------------------------------------------------------- resizing
def _resize_fit(image: PIL.Image.Image, width: int, height: int, full_width: bool) -> PIL.Image.Image:
    """Resize keeping the aspect ratio to the full target width (`full_width`) or the full target height; the other
    side is rounded down, as diffusers' `VaeImageProcessor` rounds it."""
    if full_width:
        size = (width, image.height * width // image.width)
    else:
        size = (image.width * height // image.height, height)
    return image.resize(size, resample=PIL.Image.Resampling.LANCZOS)


def _fill(image: PIL.Image.Image, width: int, height: int) -> PIL.Image.Image:
    """diffusers' resize_mode="fill": fit inside (Lanczos), centre, and stretch the first and last rows (or
    columns) of the fitted image over the empty bands (bicubic)."""
    target, source = width / height, image.width / image.height
    fitted = _resize_fit(image, width, height, full_width=target < source)
    w, h = fitted.size
    left, top = width // 2 - w // 2, height // 2 - h // 2
    canvas = PIL.Image.new("RGB", (width, height))
    canvas.paste(fitted, box=(left, top))
    bicubic = PIL.Image.Resampling.BICUBIC  # diffusers resizes the bands with PIL's default filter
    if target < source and top > 0:  # bands above and below, from the zero-height first and last rows
        canvas.paste(fitted.resize((width, top), resample=bicubic, box=(0, 0, width, 0)), box=(0, 0))
        canvas.paste(fitted.resize((width, top), resample=bicubic, box=(0, h, width, h)), box=(0, top + h))
    elif target > source and left > 0:  # bands left and right, from the zero-width first and last columns
        canvas.paste(fitted.resize((left, height), resample=bicubic, box=(0, 0, 0, height)), box=(0, 0))
        canvas.paste(fitted.resize((left, height), resample=bicubic, box=(w, 0, w, height)), box=(left + w, 0))
    return canvas


def _crop(image: PIL.Image.Image, width: int, height: int) -> PIL.Image.Image:
    """diffusers' resize_mode="crop": cover, centre, cut what sticks out."""
    fitted = _resize_fit(image, width, height, full_width=width / height > image.width / image.height)
    canvas = PIL.Image.new("RGB", (width, height))
    canvas.paste(fitted, box=(width // 2 - fitted.width // 2, height // 2 - fitted.height // 2))
    return canvas


def prepare_control_image(image: Any, width: int, height: int, resize_mode: str = "default") -> np.ndarray:
    """A control map (PIL image or uint8 array) -> float32 NCHW `(1, 3, height, width)` in [0, 1].

    As diffusers' ControlNet pipelines prepare it (`VaeImageProcessor(do_normalize=False, do_convert_rgb=True)
    .preprocess(image, height, width, resize_mode)` on a PIL image): resize with Lanczos to `width` x `height`,
    then convert to RGB, then divide by 255; no normalization to [-1, 1]. `resize_mode`: "default" stretches to
    the size; "fill" keeps the aspect ratio, fits inside and fills the bands by stretching the edge rows or
    columns; "crop" keeps the aspect ratio, covers and crops the centre. A uint8 array is read as a PIL image
    first (diffusers resizes float arrays with nearest-neighbour interpolation instead; sdjax takes uint8 only).
    """
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"resize_mode={resize_mode!r}; choose one of {list(RESIZE_MODES)}")
    for key, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"prepare_control_image: {key} must be a positive int, got {value!r}")
    if isinstance(image, PIL.Image.Image):
        pil = image
    else:
        pil = PIL.Image.fromarray(as_rgb_uint8(image, what="control image"))
    if resize_mode == "default":
        pil = pil.resize((int(width), int(height)), resample=PIL.Image.Resampling.LANCZOS)
    elif resize_mode == "fill":
        pil = _fill(pil, int(width), int(height))
    else:
        pil = _crop(pil, int(width), int(height))
    rgb = np.asarray(pil.convert("RGB")).astype(np.float32) / 255.0
    return np.ascontiguousarray(rgb.transpose(2, 0, 1)[None])
