"""The sd-webui-controlnet extension's API on the A1111 endpoints: `alwayson_scripts.controlnet.args` units in
txt2img/img2img requests, `GET /controlnet/model_list`, `GET /controlnet/module_list`, and
`POST /controlnet/detect` (run a preprocessor on images: the web page's preview of the control map).

ControlNets are served from `--controlnet-dir` (one diffusers ControlNet folder per name; a request names a net by
its folder name, optionally followed by the extension's " [hash]" suffix, so no name reaches outside the folder).
A net runs on a model of its family: SD 1.x/2.x and SDXL nets (`ControlNetModel` folders or single files) on those
models, SD 3 / 3.5 nets (`SD3ControlNetModel` folders) on SD 3 models, text-to-image only. `check_units` checks a
request's units as the library will run them before it is queued, so a unit the served model cannot run is a 422
naming it (`args[i].model`), not a failed generation; ComfyUI's planner uses it for its sampler nodes.
Each unit: `image` (base64; `input_image` is the older key), `module` (the preprocessor, "none" by default),
`model`, `weight`, `guidance_start`, `guidance_end`, `enabled`; `control_mode` only "Balanced" (0); `resize_mode`
"Just Resize" (0) or "Crop and Resize" (1, the extension's default; both stretch the map to the output size, as
diffusers does), or "Resize and Fill" (2, webuiapi's default: the extension's outer fit, the map scaled to fit inside
the output size, keeping its aspect ratio, and centred on the median colour of its border pixels); anything else,
and any other script, is refused with 422. `hr_option` ("Both", "Low res only", "High res only", or 0-2: which
passes of the hires fix the unit conditions) is accepted and checked; sdjax refuses ControlNet with the hires fix,
and without it the extension runs a unit whatever its `hr_option`, so every value means the one pass there is.

Preprocessor options as the extension names them: `threshold_a` / `threshold_b` are the module's sliders (canny:
low and high thresholds; threshold and scribble_xdog: the level; -1 or absent: the module's default; a module
without sliders ignores them, as the extension does). `processor_res` > 0 resizes the image so that its short side
is that many pixels before the preprocessor (the extension's rule: bicubic up, area down; sdjax does not pad to a
multiple of 64); -1 or absent runs the preprocessor at the image's own size (the extension's default would be 512).
A unit and `/controlnet/detect` read these the same way, so the preview is the map the generation uses.
`/controlnet/detect` takes its images as `controlnet_input_images` or as `controlnet_images` (what webuiapi's
`controlnet_detect()` sends); `GET /controlnet/version` answers `{"version": API_VERSION}` as the extension does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sdjax import planning
from sdjax.metadata import ControlUnit, GenerationRequest
from sdjax.server.schemas import FieldError, ImageB64, Limits, decode_image

API_VERSION = 2  # sd-webui-controlnet's `external_code.get_api_version()`: GET /controlnet/version

_CONTROL_MODES = {0, "0", "Balanced"}
# The extension's `ResizeMode` by name, older name and index (`resize_mode_from_value`; 3, "Just Resize (Latent
# upscale)", reads as 0) -> whether the map is fitted inside the output ("Resize and Fill", outer fit) rather than
# stretched to it.
_RESIZE_MODES = {
    0: False, "0": False, 3: False, "3": False, "Just Resize": False,
    1: False, "1": False, "Crop and Resize": False, "Inner Fit (Scale to Fit)": False,
    "Scale to Fit (Inner Fit)": False,
    2: True, "2": True, "Resize and Fill": True, "Outer Fit (Shrink to Fit)": True, "Envelope (Outer Fit)": True,
}  # fmt: skip
# The extension's `HiResFixOption` by value and by index.
_HR_OPTIONS = {"Both", "Low res only", "High res only", 0, 1, 2, "0", "1", "2"}
_UNIT_KEYS = {
    "enabled", "image", "input_image", "module", "model", "weight", "guidance_start", "guidance_end",
    "control_mode", "resize_mode", "pixel_perfect", "processor_res", "threshold_a", "threshold_b", "low_vram",
    "mask", "guessmode", "lowvram", "hr_option",
}  # fmt: skip


def list_controlnets(controlnet_dir: str | None) -> dict[str, Path]:
    """Name -> path of each ControlNet directly inside `controlnet_dir`: a diffusers folder (with config.json) by
    its name, a `.safetensors` file (`control_v11p_sd15_canny.safetensors`) by its stem."""
    if not controlnet_dir or not Path(controlnet_dir).is_dir():
        return {}
    out = {}
    for p in sorted(Path(controlnet_dir).iterdir()):
        if (p / "config.json").is_file():
            out[p.name] = p
        elif p.is_file() and p.suffix.lower() == ".safetensors":
            out.setdefault(p.stem, p)
    return out


def module_list() -> list[str]:
    from sdjax import preprocess

    return sorted(preprocess.PREPROCESSORS)


# The extension's sliders of the computed preprocessors: module -> the option `threshold_a` and `threshold_b` set.
_SLIDERS = {"canny": ("low", "high"), "threshold": ("level", None), "scribble_xdog": ("level", None)}
# Computed modules the extension runs at the image's own size, whatever `processor_res` says.
_OWN_SIZE = {"none", "invert"}


def _number(value: Any, field: str, *, integer: bool = False) -> float:
    """A finite number from JSON (a number or a numeric string); None (JSON null) is the default, -1."""
    if value is None:
        return -1.0
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FieldError(field, f"expected a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise FieldError(field, f"expected a number, got {value!r}") from None
    if not np.isfinite(number):
        raise FieldError(field, "must be finite")
    if integer and number != int(number):
        raise FieldError(field, f"expected a whole number, got {value!r}")
    return number


def _resize_short_side(rgb: np.ndarray, resolution: int) -> np.ndarray:
    """The extension's `processor_res`: scale so that the short side is `resolution` (rounded sides; bicubic when
    enlarging, area averaging when shrinking, as OpenCV does it there)."""
    try:
        import cv2
    except ImportError as e:
        raise ImportError("processor_res needs OpenCV: pip install 'sdjax[controlnet]'") from e

    h, w = rgb.shape[:2]
    k = resolution / min(h, w)
    size = (max(1, round(w * k)), max(1, round(h * k)))
    if size == (w, h):
        return rgb
    return cv2.resize(rgb, size, interpolation=cv2.INTER_CUBIC if k > 1 else cv2.INTER_AREA)


def run_module(
    module: str,
    image: Any,
    *,
    processor_res: Any = -1,
    threshold_a: Any = -1,
    threshold_b: Any = -1,
    field: Callable[[str], str],
) -> tuple[str, np.ndarray]:
    """(canonical module name, uint8 HWC RGB control map) of the extension's `module` on a PIL image, with its
    `processor_res` and sliders (see the module docstring). `field(key)` is the request's name of "module",
    "processor_res", "threshold_a" or "threshold_b", for the `FieldError` (422) of a bad value."""
    from sdjax import preprocess

    try:
        pre = preprocess.get_preprocessor(module or "none")
    except (KeyError, ValueError) as e:
        raise FieldError(field("module"), str(e.args[0] if e.args else e)) from None
    res = _number(processor_res, field("processor_res"), integer=True)
    if res != -1 and not 1 <= res <= 4096:
        raise FieldError(field("processor_res"), f"must be -1 (the image's own size) or in [1, 4096], got {res:g}")
    options = {}
    for slider, value, key in zip(
        _SLIDERS.get(pre.name, (None, None)), (threshold_a, threshold_b), ("threshold_a", "threshold_b")
    ):
        number = _number(value, field(key))
        if slider is not None and number != -1:
            if number != int(number):
                raise FieldError(field(key), f"{pre.name}'s {slider} is a whole number, got {value!r}")
            options[slider] = int(number)
    rgb = np.asarray(image.convert("RGB"))
    try:
        if res != -1 and pre.computes and pre.name not in _OWN_SIZE:
            rgb = _resize_short_side(rgb, int(res))
        return pre.name, pre(rgb, **options)
    except (ValueError, ImportError) as e:  # a slider out of range (the first names both), or no OpenCV
        raise FieldError(field("threshold_a" if options and isinstance(e, ValueError) else "module"), str(e)) from None


def _one_of(value: Any, allowed) -> bool:
    """Whether a JSON value is one of `allowed` (a list or an object is none; true is not 1)."""
    return isinstance(value, (str, int)) and not isinstance(value, bool) and value in allowed


def fill_to_size(control_map: np.ndarray, width: int, height: int) -> np.ndarray:
    """sd-webui-controlnet's "Resize and Fill" (`ResizeMode.OUTER_FIT` in its `detectmap_proc`): the uint8 HWC
    map scaled (Lanczos) by `min(width / w, height / h)` to fit inside `width` x `height`, centred on a canvas of
    the median colour of its border pixels. The result has the output size, so the pipeline's resize keeps it."""
    from PIL import Image

    m = np.asarray(control_map, np.uint8)
    h, w = m.shape[:2]
    k = min(width / w, height / h)
    new_w, new_h = max(1, min(width, round(w * k))), max(1, min(height, round(h * k)))
    borders = np.concatenate([m[0], m[-1], m[:, 0], m[:, -1]], axis=0)
    canvas = np.tile(np.median(borders, axis=0).astype(np.uint8), (height, width, 1))
    resized = np.asarray(Image.fromarray(m).resize((new_w, new_h), Image.Resampling.LANCZOS))
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas[top : top + new_h, left : left + new_w] = resized.reshape(new_h, new_w, -1)
    return canvas


def _unit(raw: Any, i: int, nets: dict[str, Path], limits: Limits, size: tuple[int, int]) -> ControlUnit | None:
    where = f"alwayson_scripts.controlnet.args[{i}]"
    if not isinstance(raw, dict):
        raise FieldError(where, "expected an object")
    unknown = sorted(set(raw) - _UNIT_KEYS)
    if unknown:
        raise FieldError(where, f"unknown key(s) {unknown}")
    if raw.get("enabled", True) is False:
        return None
    name = str(raw.get("model") or "").split(" [")[0]
    if name not in nets:
        raise FieldError(f"{where}.model", f"unknown ControlNet {raw.get('model')!r}; served: {sorted(nets)}")
    if not _one_of(raw.get("control_mode", 0), _CONTROL_MODES):
        raise FieldError(f"{where}.control_mode", "only 'Balanced' is supported")
    resize_mode = raw.get("resize_mode", 1)
    if not _one_of(resize_mode, _RESIZE_MODES):
        raise FieldError(
            f"{where}.resize_mode", "only 'Just Resize', 'Crop and Resize' and 'Resize and Fill' (0-2) are supported"
        )
    if not _one_of(raw.get("hr_option", "Both"), _HR_OPTIONS):
        raise FieldError(f"{where}.hr_option", "expected 'Both', 'Low res only' or 'High res only' (or 0-2)")
    module = raw.get("module") or "none"
    from sdjax import preprocess

    try:
        preprocess.get_preprocessor(module)  # an unknown module is named before the image is decoded
    except (KeyError, ValueError) as e:
        raise FieldError(f"{where}.module", str(e.args[0] if e.args else e)) from None
    data = raw.get("image", raw.get("input_image"))
    if isinstance(data, dict):  # the extension's {"image": b64, "mask": b64} form
        data = data.get("image")
    image = decode_image(data, field=f"{where}.image", limits=limits)
    module, control_map = run_module(
        module, image, processor_res=raw.get("processor_res", -1), threshold_a=raw.get("threshold_a", -1),
        threshold_b=raw.get("threshold_b", -1), field=lambda key: f"{where}.{key}",
    )  # fmt: skip
    if _RESIZE_MODES[resize_mode]:
        control_map = fill_to_size(control_map, *size)
    values = {}
    for key, default in (("weight", 1.0), ("guidance_start", 0.0), ("guidance_end", 1.0)):
        try:
            values[key] = float(raw.get(key, default))
        except (TypeError, ValueError):
            raise FieldError(f"{where}.{key}", f"expected a number, got {raw.get(key)!r}") from None
        if not np.isfinite(values[key]):
            raise FieldError(f"{where}.{key}", "must be finite")
    if not 0 <= values["guidance_start"] < values["guidance_end"] <= 1:
        raise FieldError(f"{where}.guidance_start", "need 0 <= guidance_start < guidance_end <= 1")
    return ControlUnit(str(nets[name]), module, values["weight"], values["guidance_start"], values["guidance_end"],
                       control_map)  # fmt: skip


def apply(
    request: GenerationRequest, scripts: Any, controlnet_dir: str | None, limits: Limits, pipeline: Any
) -> GenerationRequest:
    """`request` with the ControlNet units of an A1111 request's `alwayson_scripts` (validated, maps computed,
    nets loaded and checked against the served model)."""
    if not scripts:
        return request
    if not isinstance(scripts, dict):
        raise FieldError("alwayson_scripts", "expected an object")
    other = sorted(k for k in scripts if k.lower() != "controlnet")
    if other:
        raise FieldError("alwayson_scripts", f"script(s) {other} are not supported; sdjax runs 'controlnet'")
    script = next(v for k, v in scripts.items() if k.lower() == "controlnet")
    args = script.get("args") if isinstance(script, dict) else None
    if not isinstance(args, list):
        raise FieldError("alwayson_scripts.controlnet.args", "expected a list of units")
    nets = list_controlnets(controlnet_dir)
    size = (request.width, request.height)
    parsed = [(i, _unit(raw, i, nets, limits, size)) for i, raw in enumerate(args)]
    enabled = [(i, u) for i, u in parsed if u is not None]
    units = tuple(u for _, u in enabled)
    if units and (request.hires is not None or request.refiner_switch is not None):
        raise FieldError("alwayson_scripts.controlnet", "ControlNet does not run with the hires fix")
    if not units:
        return request

    fields = [f"alwayson_scripts.controlnet.args[{i}].model" for i, _ in enabled]

    def field(k: int | None) -> str:
        return "alwayson_scripts.controlnet.args" if k is None else fields[k]

    task = planning.task_name(request.init_image, request.mask_image)
    check_units(pipeline, units, width=request.width, height=request.height, task=task, field=field)
    return dataclasses.replace(request, control=units)


def _reason(e: BaseException) -> str:
    return str(e.args[0] if e.args else e)


def check_units(
    pipeline: Any,
    units: Sequence[ControlUnit],
    *,
    width: int,
    height: int,
    task: str,
    field: Callable[[int | None], str],
) -> None:
    """A generation's ControlNet units checked as the generation will check them, before it is queued, so that what
    cannot run is a `FieldError` (422; a node error in ComfyUI) rather than a failed generation: each unit alone (its
    net loaded, cached on the pipeline, and checked against the served model's family and transformer or UNet; the
    `task` ("txt2img", "img2img", "inpaint"), which SD 3 nets restrict to text-to-image; the `width` x `height`
    output, which an SD 3 net's position table bounds; its weight and window), then the units together (several nets
    must agree to be summed). `field(k)` names unit k in the request, `field(None)` all of them."""
    from sdjax.pipelines.controlnet import control_request, control_spec

    for k, u in enumerate(units):
        try:
            control_request(
                pipeline, control_image=u.image, controlnet=u.model, params=None, count=1, height=height, width=width,
                task=task, controlnet_conditioning_scale=u.weight, control_guidance_start=u.guidance_start,
                control_guidance_end=u.guidance_end,
            )  # fmt: skip
        except (ValueError, KeyError, OSError, TypeError) as e:
            raise FieldError(field(k), f"ControlNet {Path(u.model).name!r}: {_reason(e)}") from None
    if len(units) > 1:
        try:
            control_spec(pipeline, [u.model for u in units], None)
        except (ValueError, KeyError, OSError, TypeError) as e:
            names = [Path(u.model).name for u in units]
            raise FieldError(field(None), f"ControlNets {names}: {_reason(e)}") from None


class DetectRequest(BaseModel):
    """`POST /controlnet/detect` (sd-webui-controlnet's API): run a preprocessor on images."""

    # The images come in one of the two lists (published as such: exactly one of them, not empty).
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={"oneOf": [{"required": ["controlnet_input_images"]}, {"required": ["controlnet_images"]}]},
    )
    controlnet_module: str = Field(
        "none", description="Preprocessor (GET /controlnet/module_list)", json_schema_extra={"enum": module_list()}
    )
    controlnet_input_images: list[ImageB64] = Field(
        default_factory=list, description="base64 images (or data: URLs); these or controlnet_images"
    )
    controlnet_images: list[ImageB64] = Field(
        default_factory=list, description="The same as controlnet_input_images (what webuiapi sends)"
    )
    controlnet_processor_res: int | None = Field(
        -1, ge=-1, le=4096, description="Short side before preprocessing; -1 (or null): the image's size"
    )
    controlnet_threshold_a: float | None = Field(
        -1, allow_inf_nan=False, description="The module's first slider (canny: low); -1 (or null): default"
    )
    controlnet_threshold_b: float | None = Field(
        -1, allow_inf_nan=False, description="The module's second slider (canny: high); -1 (or null): default"
    )
    controlnet_masks: list[ImageB64] = Field(
        default_factory=list, description="Masks: no sdjax preprocessor reads them"
    )
    low_vram: bool = False


def detect(body: DetectRequest, limits: Limits) -> dict[str, Any]:
    """`{"images": [base64 PNG map per input image], "info": "Success"}`, as the extension answers."""
    import base64
    import io

    from PIL import Image

    key, images = "controlnet_input_images", body.controlnet_input_images
    if body.controlnet_images:
        if images:
            raise FieldError("controlnet_images", "give controlnet_input_images or controlnet_images, not both")
        key, images = "controlnet_images", body.controlnet_images
    if not images:
        raise FieldError("controlnet_input_images", "no image: give a list of base64 images")
    if len(images) > limits.max_images:
        raise FieldError(key, f"at most {limits.max_images} images per request")
    out = []
    for i, data in enumerate(images):
        image = decode_image(data, field=f"{key}[{i}]", limits=limits)
        _, control_map = run_module(
            body.controlnet_module, image, processor_res=body.controlnet_processor_res,
            threshold_a=body.controlnet_threshold_a, threshold_b=body.controlnet_threshold_b,
            field=lambda key: f"controlnet_{key}",
        )  # fmt: skip
        buf = io.BytesIO()
        Image.fromarray(control_map).save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return {"images": out, "info": "Success"}
