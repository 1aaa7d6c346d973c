"""ComfyUI's loaders of a model's parts (`UNETLoader`, `CLIPLoader`, `DualCLIPLoader`, `TripleCLIPLoader`) on the one
model sdjax serves, which it loads with all its parts together: each loader is accepted when it names the served
model's parts and returns them, or is refused naming what is served (docs/comfyui.md, "Flux.1 and SD 3.5 workflows").

- `UNETLoader`: `unet_name` names the served model (as `CheckpointLoaderSimple`'s `ckpt_name`); `weight_dtype`
  "default" is the served weights, an fp8 value is accepted only when the served diffusion model's weights are stored
  in that float8 format (`--quantize fp8`, or a float8 file kept float8), since sdjax does not reload a model per
  prompt; `fp8_e4m3fn_fast` (ComfyUI: float8 matmuls) is accepted on float8 e4m3 weights and logged, as sdjax
  dequantizes them inside its program.
- The CLIP loaders: `type` must be the served family's (`stable_diffusion` SD 1.x/2.x, `sdxl`, `flux`, `sd3`), and
  the `clip_name`s together must name each of the served model's text encoders once, in any order (ComfyUI tells
  encoders apart by their weights): sdjax cannot run a model with fewer encoders than it has (ComfyUI runs SD 3 with
  the missing ones zeroed). The names are the encoders' conventional file names (`ENCODER_FILES`): `clip_l`,
  `clip_g` and the T5 XXL names people's workflows use; every T5 name means the served T5 encoder, whatever precision
  its file name says (logged once per name when it says float8 and the served T5 is not).
- `served_vae_names`: the names `VAELoader` accepts for the served model's own VAE (Flux: BFL's `ae.safetensors`).
"""

from __future__ import annotations

import logging
from typing import Any

from sdjax.server.comfy.graph import Node, NodeError
from sdjax.server.comfy.values import Clip, Model

log = logging.getLogger("sdjax.server")

# family -> its text encoders as (pipeline attribute, ComfyUI's name of the encoder), in ComfyUI's recipe order
ENCODERS: dict[str, tuple[tuple[str, str], ...]] = {
    "sd": (("text_encoder", "clip_l"),),
    "sdxl": (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")),
    "flux": (("text_encoder", "clip_l"), ("text_encoder_2", "t5xxl")),
    "sd3": (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g"), ("text_encoder_3", "t5xxl")),
}
# encoder -> the file names that mean it (ComfyUI's text_encoders/ as the examples name them)
ENCODER_FILES: dict[str, tuple[str, ...]] = {
    "clip_l": ("clip_l.safetensors",),
    "clip_g": ("clip_g.safetensors",),
    "t5xxl": ("t5xxl_fp16.safetensors", "t5xxl_fp8_e4m3fn.safetensors", "t5xxl_fp8_e4m3fn_scaled.safetensors"),
}
# ComfyUI's CLIP `type` -> the family whose encoders it loads
CLIP_TYPES = {"stable_diffusion": "sd", "sdxl": "sdxl", "sd3": "sd3", "flux": "flux"}
# loader -> (its clip_name inputs, the types it takes; None: no `type` input, the family is fixed)
CLIP_LOADERS: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None]] = {
    "CLIPLoader": (("clip_name",), ("stable_diffusion", "sd3")),
    "DualCLIPLoader": (("clip_name1", "clip_name2"), ("sdxl", "sd3", "flux")),
    "TripleCLIPLoader": (("clip_name1", "clip_name2", "clip_name3"), None),
}
_TRIPLE_FAMILY = "sd3"
# family -> the names of its own VAE file (VAELoader accepts them for the served model's VAE)
VAE_FILES = {"flux": ("ae.safetensors",)}
# UNETLoader's weight_dtype -> the float8 storage it selects
WEIGHT_DTYPES = {"fp8_e4m3fn": "float8_e4m3fn", "fp8_e4m3fn_fast": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_logged: set[str] = set()


def family(pipeline: Any) -> str | None:
    """The served model's family name ("sd", "sdxl", "flux", "sd3"), or None (a pipeline of no known family)."""
    from sdjax.families import family_of_pipeline_class

    classes = getattr(type(pipeline), "model_index_classes", ())
    try:
        return family_of_pipeline_class(classes[0]).name if classes else None
    except ValueError:
        return None


def title(name: str | None) -> str:
    from sdjax.families import FAMILIES

    return FAMILIES[name].title if name in FAMILIES else "a model of no family sdjax knows"


def encoders(pipeline: Any) -> list[str]:
    """ComfyUI's names of the served model's text encoders ("clip_l", "t5xxl", ...), in recipe order."""
    pairs = ENCODERS.get(family(pipeline) or "", ())
    return [name for attr, name in pairs if getattr(pipeline, attr, None) is not None]


def clip_names(pipeline: Any) -> list[str]:
    """The `clip_name` values meaning the served model's text encoders (the /object_info combo)."""
    return [f for e in encoders(pipeline) for f in ENCODER_FILES[e]]


def clip_types(pipeline: Any, loader: str) -> list[str]:
    """The `type` values of `loader` meaning the served model's family (the /object_info combo)."""
    fam = family(pipeline)
    return [t for t in CLIP_LOADERS[loader][1] or () if CLIP_TYPES[t] == fam]


def clip_loader_for(pipeline: Any) -> str:
    """The CLIP loader (and type) that names all of the served model's text encoders, for messages."""
    fam, count = family(pipeline), len(encoders(pipeline))
    for loader, (fields, types) in CLIP_LOADERS.items():
        if len(fields) == count and types is None and fam == _TRIPLE_FAMILY:
            return loader
        for t in types or ():
            if len(fields) == count and CLIP_TYPES[t] == fam:
                return f"{loader} with type {t!r}"
    return "CheckpointLoaderSimple's CLIP output"


def served_vae_names(pipeline: Any) -> list[str]:
    return list(VAE_FILES.get(family(pipeline) or "", ()))


def latent_channels(pipeline: Any) -> int:
    config = getattr(getattr(pipeline, "vae", None), "config", None)
    return int(getattr(config, "latent_channels", 4))


def _weight_dtypes(pipeline: Any, component: str | None = None) -> list[str]:
    """The floating dtypes of a params component's stored weights (default: the diffusion model's), e.g.
    ["float32"] or ["bfloat16", "float8_e4m3fn"]."""
    import jax

    component = component or getattr(getattr(pipeline, "denoiser", None), "component", None)
    params = (getattr(pipeline, "params", None) or {}).get(component) if component else None
    if params is None:
        return []
    kinds = {str(getattr(leaf, "dtype", "")) for leaf in jax.tree_util.tree_leaves(params)}
    return sorted(k for k in kinds if k.startswith(("float", "bfloat")))


def weight_dtypes(pipeline: Any) -> list[str]:
    """UNETLoader's `weight_dtype` values the served model is stored in (the /object_info combo)."""
    stored = set(_weight_dtypes(pipeline))
    return ["default", *(k for k, v in WEIGHT_DTYPES.items() if v in stored)]


def _log_once(key: str, message: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        log.info(message, *args)


class Loaders:
    """The planner's loaders of a model's parts (`self.ctx` and `self._served` come from the planner)."""

    ctx: Any

    def _served(self, node: Node, field: str) -> None:
        raise NotImplementedError

    def n_UNETLoader(self, node: Node, _) -> tuple:
        self._served(node, "unet_name")
        wanted = node.inputs["weight_dtype"]
        served = weight_dtypes(self.ctx.pipeline)
        if wanted not in served:
            stored = " and ".join(_weight_dtypes(self.ctx.pipeline)) or "not float8"
            raise NodeError(
                node.id,
                "value_not_in_list",
                f"weight_dtype: {wanted!r} stores the diffusion model's weights as {WEIGHT_DTYPES.get(wanted, wanted)};"
                f" the served model's are {stored} and sdjax does not reload a model per prompt (serve it with "
                f"--quantize fp8 for float8 e4m3 weights); served: {served}",
                "weight_dtype",
            )
        if wanted == "fp8_e4m3fn_fast":
            _log_once(wanted, "UNETLoader weight_dtype %r: the served float8 e4m3 weights are dequantized inside "
                      "sdjax's program (no float8 matmuls, as fp8_e4m3fn)", wanted)  # fmt: skip
        return (Model(),)

    def n_CLIPLoader(self, node: Node, _) -> tuple:
        return self._clip_loader(node)

    n_DualCLIPLoader = n_TripleCLIPLoader = n_CLIPLoader

    def _clip_loader(self, node: Node) -> tuple:
        pipeline = self.ctx.pipeline
        fam, fields = family(pipeline), CLIP_LOADERS[node.class_type][0]
        model = f"the served model ({self.ctx.model_name!r}) is {title(fam)}"
        use = f"load its text encoders with {clip_loader_for(pipeline)}"
        kind = node.inputs.get("type", _TRIPLE_FAMILY)
        if CLIP_TYPES.get(kind) != fam:
            field = "type" if "type" in node.inputs else fields[0]
            what = repr(kind) if field == "type" else node.class_type
            raise NodeError(node.id, "value_not_in_list", f"{field}: {what} loads {title(CLIP_TYPES.get(kind))}'s "
                            f"text encoders; {model}: {use}", field)  # fmt: skip
        served, names = encoders(pipeline), clip_names(pipeline)
        named: dict[str, str] = {}
        for field in fields:
            value = node.inputs[field].strip().replace("\\", "/").rsplit("/", 1)[-1]
            encoder = next((e for e in served if value in ENCODER_FILES[e]), None)
            if encoder is None:
                raise NodeError(node.id, "value_not_in_list", f"{field}: {node.inputs[field]!r} is not one of the "
                                f"served model's text encoders ({title(fam)}: {served}); served: {names}",
                                field)  # fmt: skip
            if encoder in named:
                raise NodeError(node.id, "value_not_in_list", f"{field}: the {encoder} encoder is already named by "
                                f"{named[encoder]}; name each of the served model's encoders {served} once",
                                field)  # fmt: skip
            named[encoder] = field
            self._log_precision(node, field, value)
        if node.inputs.get("device", "default") != "default":
            _log_once(f"device:{node.inputs['device']}", "%s device %r: sdjax runs the text encoders on the devices "
                      "that run the model", node.class_type, node.inputs["device"])  # fmt: skip
        if len(named) != len(served):
            missing = [e for e in served if e not in named]
            raise NodeError(node.id, "value_not_in_list", f"{fields[0]}: {node.class_type} names {list(named)}; "
                            f"{model}, which sdjax runs with all its text encoders {served} (missing: {missing}): "
                            f"{use}", fields[0])  # fmt: skip
        return (Clip(),)

    def _log_precision(self, node: Node, field: str, value: str) -> None:
        """A float8 T5 file name on a server whose T5 is not float8: said once in the log (the name is accepted)."""
        if "fp8" not in value:
            return
        attr = next(a for a, e in ENCODERS[family(self.ctx.pipeline) or ""] if e == "t5xxl")
        stored = _weight_dtypes(self.ctx.pipeline, attr)
        if not any(k.startswith("float8") for k in stored):
            _log_once(value, "%s %s %r: the served model's own T5 encoder is used (%s weights), not a float8 one",
                      node.class_type, field, value, " and ".join(stored) or "its")  # fmt: skip
