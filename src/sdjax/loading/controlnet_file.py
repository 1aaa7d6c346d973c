"""ControlNet single files, as AUTOMATIC1111's sd-webui-controlnet users keep them (`control_v11p_sd15_canny`,
`control_sd15_*`, SDXL ControlNets in the original `cldm` layout, or diffusers-layout single files).

- Original layout: the UNet's encoder half under the UNet's original names, `input_hint_block.*`, `zero_convs.*`,
  `middle_block_out.*`; with the `control_model.` prefix (ControlNet 1.0 files, which may also hold a whole SD
  model: those other keys are not read) or without (1.1 files). The architecture comes from the shapes (blocks,
  channels, layers per block, transformer depth per block, cross-attention width, linear projections, SDXL's
  added time embedding), the attention heads from the family (SD 1.x: 8 heads; SD 2.x / SDXL: 64 channels a head),
  as diffusers' `create_controlnet_diffusers_config_from_ldm` does from the original YAML. A `config` (a
  diffusers `config.json`, its folder, or a dict) replaces the inference, e.g. for shuffle nets
  (`global_pool_conditions`) or an SD 2.1 768 net's `upcast_attention`, which no shape tells.
- Diffusers layout in one file (`controlnet_cond_embedding.*`, `down_blocks.*`): needs `config`.
- Stable Diffusion 3.5 ControlNets as Stability AI released them (`sd3.5_large_controlnet_canny.safetensors`,
  `_depth`, `_blur`: `transformer_blocks.N.attn.qkv.*`, `controlnet_blocks.N.*`, `pos_embed_input.*`): an
  `SD3ControlNetModel` with the config inferred from the shapes (`sd3_controlnet_file`); a `config` replaces it.
- An SD 3 ControlNet in the diffusers layout in one file (`transformer_blocks.N.attn.to_q.*`,
  `pos_embed_input.*`): needs `config` (its `config.json`: no tensor tells e.g. `force_zeros_for_pooled_projection`).
- A Flux.1 ControlNet in the diffusers layout in one file (`controlnet_x_embedder.*`, `transformer_blocks.N.*`;
  InstantX's and Shakker-Labs' `diffusion_pytorch_model.safetensors` on its own): needs `config` (its
  `config.json`: the head count and rotary axes are in no tensor); without one it fails as a file of another kind.
A file of another kind (an XLabs Flux ControlNet in Black Forest Labs' layout, a whole model, a LoRA) fails naming
the file and what it looks like.

`.safetensors` only, unless `allow_pickle` (the restricted unpickler of `single_file.open_checkpoint`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from sdjax.config import read_json
from sdjax.loading import components as comp
from sdjax.loading import ldm_keys
from sdjax.loading import sd3_controlnet_file as sai
from sdjax.loading.ldm_checkpoint import (
    Checkpoint,
    UnknownArchitectureError,
    _has_prefix,
    _PrefixView,
    key_families,
    open_checkpoint,
)
from sdjax.loading.single_file import load_component

_INPUT = re.compile(r"input_blocks\.(\d+)\.(\d+)\.")
_HINT = re.compile(r"input_hint_block\.(\d+)\.weight")
_TRANSFORMER = re.compile(r"input_blocks\.(\d+)\.1\.transformer_blocks\.(\d+)\.")


def infer_config(shapes: Mapping[str, tuple[int, ...]], *, source: str = "checkpoint") -> dict[str, Any]:
    """A diffusers `ControlNetModel` config dict from the `{key: shape}` of an original-layout ControlNet (keys
    without prefix). Raises `UnknownArchitectureError` naming `source` when the shapes do not describe one."""

    def shape(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise UnknownArchitectureError(f"{source}: not an original-layout ControlNet (no {key})")
        return tuple(shapes[key])

    hint = sorted(int(m.group(1)) for k in shapes if (m := _HINT.fullmatch(k)))
    if not hint or hint[0] != 0 or hint != list(range(0, 2 * len(hint), 2)) or len(hint) % 2:
        raise UnknownArchitectureError(f"{source}: input_hint_block convolutions {hint} are not a ControlNet's")
    hint_out = [shape(f"input_hint_block.{i}.weight")[0] for i in hint]
    # conv_in, then per channel step a (same, stride-2) pair, then the zero conv into the UNet's width
    embedding_out = (hint_out[0], *hint_out[2:-1:2])
    blocks = sorted({int(m.group(1)) for k in shapes if (m := _INPUT.match(k))})
    ops = sorted({int(m.group(1)) for k in shapes if (m := _INPUT.match(k)) and ".op." in k})
    if not ops or blocks[0] != 0:
        raise UnknownArchitectureError(
            f"{source}: no downsampling input_blocks.N.0.op (key families: {key_families(shapes)})"
        )
    per = ops[0] - 1
    n_blocks = len(ops) + 1
    if blocks[-1] != n_blocks * (per + 1) - 1:
        raise UnknownArchitectureError(
            f"{source}: input_blocks {blocks[0]}..{blocks[-1]} do not fit {n_blocks} blocks of {per} layers"
        )
    channels, types, depth = [], [], []
    for b in range(n_blocks):
        first = 1 + b * (per + 1)
        channels.append(shape(f"input_blocks.{first}.0.out_layers.3.weight")[0])
        layers = {int(m.group(2)) for k in shapes if (m := _TRANSFORMER.match(k)) and int(m.group(1)) == first}
        types.append("CrossAttnDownBlock2D" if layers else "DownBlock2D")
        depth.append(len(layers) or 1)
    attn = next((k for k in shapes if k.endswith("attn2.to_k.weight")), None)
    if attn is None:
        raise UnknownArchitectureError(f"{source}: a ControlNet without cross-attention is not supported")
    cross = shape(attn)[1]
    proj = next(k for k in shapes if k.endswith(".proj_in.weight"))
    linear = len(shape(proj)) == 2
    sd1 = cross == 768 and not linear
    if not sd1 and any(c % 64 for c in channels):
        raise UnknownArchitectureError(
            f"{source}: block widths {channels} are not whole numbers of 64-channel heads (SD 2.x / SDXL nets' "
            "heads; the file does not store their count): pass config= (the net's config.json)"
        )
    config: dict[str, Any] = {
        "_class_name": "ControlNetModel",
        "conditioning_channels": shape("input_hint_block.0.weight")[1],
        "conditioning_embedding_out_channels": list(embedding_out),
        "block_out_channels": channels,
        "down_block_types": types,
        "layers_per_block": per,
        "transformer_layers_per_block": depth,
        "cross_attention_dim": cross,
        "use_linear_projection": linear,
        "attention_head_dim": 8 if sd1 else [c // 64 for c in channels],
        "in_channels": shape("input_blocks.0.0.weight")[1],
    }
    if "label_emb.0.0.weight" in shapes:  # SDXL: pooled text embedding + 6 micro-conditioning sizes
        config.update(
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=shape("label_emb.0.0.weight")[1],
        )
    return config


def _config_dict(config: Any) -> tuple[dict[str, Any], str]:
    if isinstance(config, Mapping):
        return dict(config), "config"
    path = Path(os.fspath(config)).expanduser()
    path = path / "config.json" if path.is_dir() else path
    return read_json(path), str(path)


def load_controlnet_file(
    path: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    config: Any = None,
    allow_pickle: bool = False,
    quantize: Any = None,
) -> tuple[Any, dict]:
    """One ControlNet file -> `(module, params)` (see the module docstring for the layouts). `quantize`: a
    `sdjax.quant.QuantPolicy` over the "controlnet" params (`loading.controlnet.load_controlnet` resolves
    "int8" / "fp8"), its kernels quantized as they are converted."""
    with open_checkpoint(path, allow_pickle=allow_pickle) as ckpt:
        return _from_checkpoint(ckpt, jnp.dtype(dtype), config, quantize)


def _from_checkpoint(ckpt: Checkpoint, dtype: Any, config: Any, quantize: Any = None) -> tuple[Any, dict]:
    hook = {"quantize": quantize, "params_key": "controlnet"}  # model_from_state_dict's per-tensor quantization
    keys = list(ckpt)
    where = str(ckpt.path)
    prefix = ldm_keys.CONTROLNET_PREFIX if _has_prefix(keys, ldm_keys.CONTROLNET_PREFIX + "input_hint_block.") else ""
    if _has_prefix(keys, prefix + "input_hint_block."):
        if config is None:
            shapes = {k[len(prefix) :]: s for k, s in ckpt.shapes().items() if k.startswith(prefix)}
            raw, source = infer_config(shapes, source=where), f"{where} (inferred)"
        else:
            raw, source = _config_dict(config)
        cfg = comp.model_config(comp.CONTROLNET, raw, source=source)
        return load_component(
            ckpt, "controlnet", comp.CONTROLNET, cfg, "controlnet", prefix, dtype=dtype, quantize=quantize
        )
    if sai.is_sai_layout(keys):
        return _sd3_sai(ckpt, dtype, config, hook)
    if _has_prefix(keys, "controlnet_cond_embedding."):
        if config is None:
            raise ValueError(
                f"{where}: a ControlNet in the diffusers layout in one file needs config= (its config.json or "
                "folder): its architecture is not inferred from diffusers key names"
            )
        raw, source = _config_dict(config)
        _check_class(raw, "ControlNetModel", source, where)
        cfg = comp.model_config(comp.CONTROLNET, raw, source=source)
        return comp.model_from_state_dict(
            comp.CONTROLNET, cfg, _PrefixView(ckpt, ""), dtype=dtype, component=f"controlnet ({where})", **hook
        )
    if config is not None and "controlnet_x_embedder.weight" in ckpt and _has_prefix(keys, "transformer_blocks."):
        # without config= it falls through to the error below, which names it and asks for the config
        raw, source = _config_dict(config)
        _check_class(raw, "FluxControlNetModel", source, where)
        cfg = comp.model_config(comp.FLUX_CONTROLNET, raw, source=source)
        return comp.model_from_state_dict(
            comp.FLUX_CONTROLNET, cfg, _PrefixView(ckpt, ""), dtype=dtype, component=f"controlnet ({where})", **hook
        )
    if "pos_embed_input.proj.weight" in ckpt and _has_prefix(keys, "controlnet_blocks."):
        if config is None:
            raise ValueError(
                f"{where}: an SD 3 ControlNet in the diffusers layout in one file needs config= (its config.json or "
                "folder; e.g. force_zeros_for_pooled_projection is in no tensor), or keep it as a diffusers folder "
                "with its config.json"
            )
        raw, source = _config_dict(config)
        _check_class(raw, "SD3ControlNetModel", source, where)
        cfg = comp.model_config(comp.SD3_CONTROLNET, raw, source=source)
        return comp.model_from_state_dict(
            comp.SD3_CONTROLNET, cfg, _PrefixView(ckpt, ""), dtype=dtype, component=f"controlnet ({where})", **hook
        )
    raise UnknownArchitectureError(
        f"{where}: not a ControlNet sdjax loads (SD 1.x/2.x and SDXL: input_hint_block.* with or without "
        f"{ldm_keys.CONTROLNET_PREFIX}, or controlnet_cond_embedding.*; SD 3 / 3.5: transformer_blocks.* with "
        f"controlnet_blocks.* and pos_embed_input.*; Flux.1: transformer_blocks.* with controlnet_x_embedder.*); "
        f"it looks like {_looks_like(keys)}"
    )


# (a key that starts so, what a file holding it is), first match wins: for the error naming what a file is.
_LOOKS_LIKE = (
    (
        "controlnet_x_embedder.",
        "a Flux.1 ControlNet (InstantX / diffusers FluxControlNetModel layout: load it with config=, its "
        "config.json or folder, or as a diffusers folder)",
    ),
    ("controlnet_single_blocks.", "a Flux.1 ControlNet (diffusers FluxControlNetModel layout)"),
    ("double_blocks.", "a Flux.1 model or XLabs Flux ControlNet (Black Forest Labs layout)"),
    ("single_transformer_blocks.", "a Flux.1 transformer (diffusers layout)"),
    ("model.diffusion_model.joint_blocks.", "a Stable Diffusion 3 / 3.5 model (its MMDiT), not a ControlNet"),
    ("joint_blocks.", "a Stable Diffusion 3 / 3.5 MMDiT, not a ControlNet"),
    ("model.diffusion_model.input_blocks.", "a Stable Diffusion 1.x/2.x/XL model checkpoint, not a ControlNet"),
    ("lora_unet_", "a LoRA (kohya layout)"),
    ("lora_te", "a LoRA (kohya layout)"),
    ("adapter.", "a T2I-Adapter"),
)


def _looks_like(keys: list[str]) -> str:
    for marker, what in _LOOKS_LIKE:
        if any(k.startswith(marker) for k in keys):
            return f"{what}; key families: {key_families(keys)}"
    if any(".lora_A." in k or ".lora_down." in k for k in keys):
        return f"a LoRA; key families: {key_families(keys)}"
    return f"nothing sdjax knows; key families: {key_families(keys)}"


def _check_class(raw: Mapping[str, Any], want: str, source: str, where: str) -> None:
    """Refuse a config.json written for another model class than the file holds."""
    name = str(raw.get("_class_name") or want).removeprefix("Flax")
    if name != want:
        raise ValueError(f"{source}: config for a {name}, but {where} holds {want} weights")


def _sd3_sai(ckpt: Checkpoint, dtype: Any, config: Any, hook: dict) -> tuple[Any, dict]:
    """A Stability AI SD 3.5 ControlNet file -> `(SD3ControlNetModel, params)` (`sd3_controlnet_file`)."""
    where = str(ckpt.path)
    component = f"controlnet ({where}, Stability AI SD 3.5 layout)"
    shapes = ckpt.shapes()
    if config is None:
        raw, source = sai.infer_config(shapes, component=component), f"{where} (inferred)"
    else:
        raw, source = _config_dict(config)
        _check_class(raw, "SD3ControlNetModel", source, where)
    cfg = comp.model_config(comp.SD3_CONTROLNET, raw, source=source)
    if cfg.joint or cfg.use_pos_embed:
        raise ValueError(
            f"{source}: joint_attention_dim must be null and use_pos_embed false for {where} (Stability's layout "
            f"holds nets of single blocks without text that run the transformer's patch embedding)"
        )
    sai.check_keys(shapes, cfg, component=component)
    return comp.model_from_state_dict(
        comp.SD3_CONTROLNET, cfg, sai.diffusers_state_dict(ckpt), dtype=dtype, component=component, **hook
    )
