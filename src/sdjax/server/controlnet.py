"""The sd-webui-controlnet extension's API on the A1111 endpoints: `alwayson_scripts.controlnet.args` units in
txt2img/img2img requests, `GET /controlnet/model_list`, `GET /controlnet/module_list`.

ControlNets are served from `--controlnet-dir` (one diffusers ControlNet folder per name; a request names a net by
its folder name, optionally followed by the extension's " [hash]" suffix, so no name reaches outside the folder).
Each unit: `image` (base64; `input_image` is the older key), `module` (the preprocessor, "none" by default),
`model`, `weight`, `guidance_start`, `guidance_end`, `enabled`; `control_mode` only "Balanced" (0) and
`resize_mode` only "Just Resize" (0) or "Crop and Resize" (1, the extension's default; the map is resized to the
output size as diffusers does), anything else, and any other script, is refused with 422.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.metadata import ControlUnit, GenerationRequest
from sdjax.server.schemas import FieldError, Limits, decode_image

_CONTROL_MODES = {0, "0", "Balanced"}
_RESIZE_MODES = {0, 1, "0", "1", "Just Resize", "Crop and Resize"}
_UNIT_KEYS = {
    "enabled", "image", "input_image", "module", "model", "weight", "guidance_start", "guidance_end",
    "control_mode", "resize_mode", "pixel_perfect", "processor_res", "threshold_a", "threshold_b", "low_vram",
    "mask", "guessmode", "lowvram",
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


def _unit(raw: Any, i: int, nets: dict[str, Path], limits: Limits) -> ControlUnit | None:
    from sdjax import preprocess

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
    if raw.get("control_mode", 0) not in _CONTROL_MODES:
        raise FieldError(f"{where}.control_mode", "only 'Balanced' is supported")
    if raw.get("resize_mode", 1) not in _RESIZE_MODES:
        raise FieldError(f"{where}.resize_mode", "only 'Just Resize' and 'Crop and Resize' are supported")
    module = raw.get("module") or "none"
    try:
        pre = preprocess.get_preprocessor(module)
    except (KeyError, ValueError) as e:
        raise FieldError(f"{where}.module", str(e.args[0] if e.args else e)) from None
    data = raw.get("image", raw.get("input_image"))
    if isinstance(data, dict):  # the extension's {"image": b64, "mask": b64} form
        data = data.get("image")
    image = decode_image(data, field=f"{where}.image", limits=limits)
    try:
        control_map = pre(np.asarray(image.convert("RGB")))
    except (ValueError, ImportError) as e:
        raise FieldError(f"{where}.module", str(e)) from None
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
    return ControlUnit(str(nets[name]), pre.name, values["weight"], values["guidance_start"], values["guidance_end"],
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
    units = tuple(u for u in (_unit(raw, i, nets, limits) for i, raw in enumerate(args)) if u is not None)
    if units and (request.hires is not None or request.refiner_switch is not None):
        raise FieldError("alwayson_scripts.controlnet", "ControlNet does not run with the hires fix")
    if not units:
        return request
    from sdjax.pipelines.controlnet import control_spec

    try:
        control_spec(pipeline, [u.model for u in units], None)  # loads (cached on the pipeline) and checks the family
    except (ValueError, KeyError, OSError) as e:
        raise FieldError("alwayson_scripts.controlnet.args", str(e.args[0] if e.args else e)) from None
    return dataclasses.replace(request, control=units)
