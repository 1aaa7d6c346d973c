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
    path: str | os.PathLike, *, dtype: Any = jnp.float32, config: Any = None, allow_pickle: bool = False
) -> tuple[Any, dict]:
    """One ControlNet file -> `(module, params)` (see the module docstring for the layouts)."""
    with open_checkpoint(path, allow_pickle=allow_pickle) as ckpt:
        return _from_checkpoint(ckpt, jnp.dtype(dtype), config)


def _from_checkpoint(ckpt: Checkpoint, dtype: Any, config: Any) -> tuple[Any, dict]:
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
        return load_component(ckpt, "controlnet", comp.CONTROLNET, cfg, "controlnet", prefix, dtype=dtype)
    if _has_prefix(keys, "controlnet_cond_embedding."):
        if config is None:
            raise ValueError(
                f"{where}: a ControlNet in the diffusers layout in one file needs config= (its config.json or "
                "folder): its architecture is not inferred from diffusers key names"
            )
        raw, source = _config_dict(config)
        cfg = comp.model_config(comp.CONTROLNET, raw, source=source)
        return comp.model_from_state_dict(
            comp.CONTROLNET, cfg, _PrefixView(ckpt, ""), dtype=dtype, component=f"controlnet ({where})"
        )
    raise UnknownArchitectureError(
        f"{where}: not a ControlNet (no input_hint_block.* or controlnet_cond_embedding.* keys, with or without "
        f"{ldm_keys.CONTROLNET_PREFIX}); key families found: {key_families(keys)}"
    )
