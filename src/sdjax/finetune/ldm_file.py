"""A whole SD 1.x / 2.x / XL pipeline as one original-layout (CompVis / Stability, AUTOMATIC1111) `.safetensors`
file: the inverse of what `loading.single_file` reads.

Every diffusers tensor of a component goes to the original key that `loading.ldm_keys` gives it under the
component's prefix (`loading.ldm_checkpoint.component_layout`: `model.diffusion_model.`, `first_stage_model.`,
`cond_stage_model.transformer.` / `cond_stage_model.model.` / `conditioner.embedders.N.`), with the inverse of
its `Source.transform`: a Linear weight the original stores as a 1x1 convolution gets its `(O, I, 1, 1)` shape
back (the VAE's mid-block attention), OpenCLIP's `text_projection` is transposed back (`x @ P`), and OpenCLIP's q,
k and v projections are fused again into `attn.in_proj_weight` / `in_proj_bias` (q rows first). SD 2.x's text
encoder is written with the layers diffusers keeps (the penultimate-layer model: one block fewer than Stability's
files, whose last block SD 2 never runs). No EMA copy, no DDPM buffers.

Metadata: `modelspec.prediction_type` (`epsilon` / `v`, which sdjax's loader reads) and `modelspec.architecture`
for SDXL / SD 1.x; the file is float32 unless a dtype is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.loading import ldm_keys
from sdjax.loading.ldm_checkpoint import component_layout


def architecture(components: Mapping[str, Any]) -> str:
    """`ldm_checkpoint.ARCHITECTURES` name of a loaded SD pipeline (`{name: module with .config}`): the text
    encoders tell the family (SD 2.x: OpenCLIP's gelu text encoder; SD 1.x: OpenAI CLIP's quick_gelu), 9 UNet input
    channels the inpainting variant."""
    unet = components["unet"].config
    if "text_encoder_2" in components:
        family = "sdxl-base" if "text_encoder" in components else "sdxl-refiner"
    elif "text_encoder" in components:
        family = "sd2" if components["text_encoder"].config.hidden_act == "gelu" else "sd1"
    else:
        raise ValueError(f"no text encoder among {sorted(components)}: not an SD 1.x / 2.x / XL pipeline")
    if unet.in_channels == 4:
        return family
    if unet.in_channels == 9 and family != "sdxl-refiner":
        return {"sd1": "sd1-inpainting", "sd2": "sd2-inpainting", "sdxl-base": "sdxl-inpainting"}[family]
    raise ValueError(f"a {family} UNet with {unet.in_channels} input channels has no original-layout file in sdjax")


def _invert(source: ldm_keys.Source, value: np.ndarray) -> np.ndarray:
    if source.transform == "squeeze":
        return value.reshape(value.shape + (1, 1)) if value.ndim == 2 else value
    if source.transform == "transpose":
        return value.T
    return value


def component_state_dict(kind: str, prefix: str, state_dict: Mapping[str, np.ndarray], config: Any) -> dict:
    """One component's diffusers state dict -> its original keys (with `prefix`) and layouts."""
    source_of = ldm_keys.SOURCES[kind]
    out: dict[str, np.ndarray] = {}
    fused: dict[str, list] = {}
    for key, value in state_dict.items():
        source = source_of(key, config)
        if source.transform == "chunk":
            fused.setdefault(prefix + source.key, [None, None, None])[source.part] = value
            continue
        name = prefix + source.key
        if name in out:
            raise ValueError(f"two tensors map to {name} (the second is {key})")
        out[name] = np.ascontiguousarray(_invert(source, np.asarray(value)))
    for name, parts in fused.items():
        if any(p is None for p in parts):
            raise ValueError(f"{name}: q, k and v projections are not all there to fuse")
        out[name] = np.ascontiguousarray(np.concatenate(parts, axis=0))
    return out


def pipeline_state_dict(
    components: Mapping[str, Any], params: Mapping[str, Any], *, dtype=np.float32
) -> tuple[dict[str, np.ndarray], str]:
    """The original-layout state dict of a loaded SD pipeline's models and its architecture name."""
    from sdjax.models.convert import params_to_state_dict

    arch = architecture(components)
    layout = component_layout(arch, ())
    out: dict[str, np.ndarray] = {}
    for name, (kind, prefix) in layout.items():
        state = params_to_state_dict(params[name], dtype=dtype)
        out.update(component_state_dict(kind, prefix, state, components[name].config))
    return out, arch


def write(
    path: str | Path,
    components: Mapping[str, Any],
    params: Mapping[str, Any],
    prediction_type: str,
    *,
    dtype=np.float32,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write the pipeline as one original-layout `.safetensors` file at `path` (see the module docstring)."""
    from safetensors.numpy import save_file

    tensors, arch = pipeline_state_dict(components, params, dtype=dtype)
    meta = {"format": "pt", "modelspec.prediction_type": "v" if prediction_type == "v_prediction" else "epsilon"}
    spec = {"sd1": "stable-diffusion-v1", "sdxl-base": "stable-diffusion-xl-v1-base"}.get(arch)
    if spec:
        meta["modelspec.architecture"] = spec
    meta.update(metadata or {})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path
