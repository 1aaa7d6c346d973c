"""diffusers state-dict keys -> keys of the original Stability / LDM single-file checkpoints, from a model's config.

The original checkpoints (CompVis `ldm`, Stability `sgm`: `v1-5-pruned-emaonly.safetensors`,
`v2-1_768-ema-pruned.safetensors`, `sd_xl_base_1.0.safetensors`, every civitai fine-tune) hold a whole pipeline in
one state dict. Each component lives under a prefix:

| component | prefix |
|---|---|
| UNet | `model.diffusion_model.` (EMA copy, when kept: `model_ema.` + the key without its dots) |
| VAE | `first_stage_model.` (a few files: `vae.`) |
| SD 1.x text encoder (OpenAI CLIP ViT-L, transformers layout) | `cond_stage_model.transformer.` |
| SD 2.x text encoder (OpenCLIP ViT-H, open_clip layout) | `cond_stage_model.model.` |
| SDXL text encoders | `conditioner.embedders.0.transformer.` (CLIP ViT-L), `conditioner.embedders.1.model.` (bigG) |
| SDXL refiner text encoder | `conditioner.embedders.0.model.` (OpenCLIP bigG) |

Inside a prefix the names follow the original code, not diffusers'. This module maps one diffusers key to its
`Source`: the original key (relative to the prefix) and how the tensor changes on the way (`transform`):

- UNet (`ldm.modules.diffusionmodules.openaimodel.UNetModel`): blocks are numbered flat. `input_blocks.0` is
  `conv_in`; down block `b`'s layer `j` is `input_blocks.{1 + b*(L+1) + j}` (`.0` resnet, `.1` transformer) and
  its downsampler `input_blocks.{(b+1)*(L+1)}.0.op` (L = `layers_per_block`); `middle_block.0/1/2` = resnet,
  transformer, resnet; up block `b`'s layer `j` is `output_blocks.{b*(L+1) + j}` and its upsampler the last layer's
  `.1.conv` (no transformer in the block) or `.2.conv`. Resnets rename `norm1, conv1, norm2, conv2, time_emb_proj,
  conv_shortcut` to `in_layers.0, in_layers.2, out_layers.0, out_layers.3, emb_layers.1, skip_connection`;
  transformer blocks keep diffusers' names. `time_embed.0/2`, `label_emb.0.0/2` (SDXL's `add_embedding`),
  `out.0/2` (`conv_norm_out`, `conv_out`).
- VAE (`ldm.modules.diffusionmodules.model.Encoder/Decoder`): `encoder.down.{i}.block.{j}`, `.downsample.conv`,
  `mid.block_1/2`, `mid.attn_1.{norm,q,k,v,proj_out}` (1x1 convolutions: `squeeze` to Linear weights),
  `norm_out`, resnets' `nin_shortcut`; the decoder's `up.{i}` counts from the lowest resolution, so diffusers'
  `up_blocks.{k}` is `up.{n-1-k}`.
- OpenCLIP (`open_clip.transformer.TextTransformer`): `token_embedding`, `positional_embedding` (a bare tensor),
  `transformer.resblocks.{i}.{ln_1, attn, ln_2, mlp.c_fc, mlp.c_proj}`, `ln_final`, and `text_projection` stored as
  `x @ P` (`transpose` to a Linear weight). Attention keeps q, k and v fused in `attn.in_proj_weight/bias`
  (`chunk`: rows `[0, d)`, `[d, 2d)`, `[2d, 3d)`).
- OpenAI CLIP under `cond_stage_model.transformer.` / `conditioner.embedders.0.transformer.` is already the
  transformers layout: the same key.

The mapping is derived from the config (block counts, which up blocks have transformers), never guessed from the
file, so a file that lacks a key or has a wrong shape is reported by its original name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

UNET_PREFIX = "model.diffusion_model."
EMA_PREFIX = "model_ema."
VAE_PREFIXES = ("first_stage_model.", "vae.")
SD1_CLIP_PREFIX = "cond_stage_model.transformer."
SD2_OPENCLIP_PREFIX = "cond_stage_model.model."
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SDXL_OPENCLIP_PREFIX = "conditioner.embedders.1.model."
REFINER_OPENCLIP_PREFIX = "conditioner.embedders.0.model."

TRANSFORMS = ("same", "squeeze", "transpose", "chunk")


@dataclass(frozen=True)
class Source:
    """Where a diffusers tensor comes from: `key` (relative to the component prefix) and how it changes.

    `transform`: "same"; "squeeze" (a 1x1 convolution `(O, I, 1, 1)` used as a Linear weight `(O, I)`; a file may
    also store it already squeezed); "transpose" (a matrix stored as `x @ P`); "chunk" (third `part` of a fused
    q/k/v tensor along its first axis).
    """

    key: str
    transform: str = "same"
    part: int = 0

    def apply(self, x: np.ndarray) -> np.ndarray:
        if self.transform == "same":
            return x
        if self.transform == "squeeze":
            return x.reshape(x.shape[:2]) if x.ndim > 2 else x
        if self.transform == "transpose":
            return x.T
        n = x.shape[0] // 3
        return x[self.part * n : (self.part + 1) * n]

    def ldm_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shapes the original tensor may have when the diffusers tensor has `shape` (first: the usual one)."""
        shape = tuple(shape)
        if self.transform == "squeeze":
            return (shape + (1, 1), shape)
        if self.transform == "transpose":
            return (shape[::-1],)
        if self.transform == "chunk":
            return ((3 * shape[0],) + shape[1:],)
        return (shape,)


def _split(key: str) -> tuple[str, str]:
    module, _, param = key.rpartition(".")
    return module, param


# --------------------------------------------------------------------------------------------------------- UNet
_UNET_FIXED = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
}
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
_BLOCK = re.compile(r"(down|up)_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)")
_SAMPLER = re.compile(r"(down|up)_blocks\.(\d+)\.(downsamplers|upsamplers)\.0\.conv\.(weight|bias)")
_MID = re.compile(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)")


def _unet_resnet(rest: str) -> str:
    head, _, tail = rest.partition(".")
    if head not in _UNET_RESNET:
        raise KeyError(head)
    return f"{_UNET_RESNET[head]}.{tail}"


def unet_source(key: str, config: Any) -> Source:
    """The original key of diffusers UNet key `key` for a `UNet2DConditionConfig` (int `layers_per_block`)."""
    per = config.layers_per_block
    if not isinstance(per, int):
        raise ValueError(f"layers_per_block={per!r}: the original UNet layout needs one int for every block")
    module, param = _split(key)
    if module in _UNET_FIXED:
        return Source(f"{_UNET_FIXED[module]}.{param}")
    if m := _BLOCK.fullmatch(key):
        side, b, kind, j, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        index = 1 + b * (per + 1) + j if side == "down" else b * (per + 1) + j
        blocks = "input_blocks" if side == "down" else "output_blocks"
        inner = _unet_resnet(rest) if kind == "resnets" else rest
        return Source(f"{blocks}.{index}.{0 if kind == 'resnets' else 1}.{inner}")
    if m := _SAMPLER.fullmatch(key):
        side, b, param = m.group(1), int(m.group(2)), m.group(4)
        if side == "down":
            return Source(f"input_blocks.{(b + 1) * (per + 1)}.0.op.{param}")
        has_transformer = "CrossAttn" in config.up_block_types[b]
        return Source(f"output_blocks.{b * (per + 1) + per}.{2 if has_transformer else 1}.conv.{param}")
    if m := _MID.fullmatch(key):
        kind, j, rest = m.group(1), int(m.group(2)), m.group(3)
        if kind == "attentions":
            return Source(f"middle_block.1.{rest}")
        return Source(f"middle_block.{0 if j == 0 else 2}.{_unet_resnet(rest)}")
    raise KeyError(key)


def ema_key(unet_key: str) -> str:
    """LDM's `LitEma` buffer name of UNet key `unet_key` (relative to `model.diffusion_model.`): the full key
    `model.diffusion_model.X` without its first segment and without dots, under `model_ema.`."""
    return EMA_PREFIX + ("diffusion_model." + unet_key).replace(".", "")


# --------------------------------------------------------------------------------------------------------- VAE
_VAE_FIXED = {
    "encoder.conv_in": "encoder.conv_in",
    "encoder.conv_out": "encoder.conv_out",
    "encoder.conv_norm_out": "encoder.norm_out",
    "decoder.conv_in": "decoder.conv_in",
    "decoder.conv_out": "decoder.conv_out",
    "decoder.conv_norm_out": "decoder.norm_out",
    "quant_conv": "quant_conv",
    "post_quant_conv": "post_quant_conv",
}
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_RESNET = re.compile(r"(encoder|decoder)\.(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(.+)")
_VAE_SAMPLER = re.compile(r"(encoder|decoder)\.(down|up)_blocks\.(\d+)\.(downsamplers|upsamplers)\.0\.conv\.(.+)")
_VAE_MID_RESNET = re.compile(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)")
_VAE_MID_ATTN = re.compile(r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(.+)")


def _vae_resnet(rest: str) -> str:
    return rest.replace("conv_shortcut.", "nin_shortcut.", 1) if rest.startswith("conv_shortcut.") else rest


def vae_source(key: str, config: Any) -> Source:
    """The original key of diffusers AutoencoderKL key `key` for an `AutoencoderKLConfig`."""
    n = len(config.block_out_channels)
    module, param = _split(key)
    if module in _VAE_FIXED:
        return Source(f"{_VAE_FIXED[module]}.{param}")
    if m := _VAE_RESNET.fullmatch(key):
        part, side, i, j, rest = m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), m.group(5)
        level = i if side == "down" else n - 1 - i
        return Source(f"{part}.{side}.{level}.block.{j}.{_vae_resnet(rest)}")
    if m := _VAE_SAMPLER.fullmatch(key):
        part, side, i, rest = m.group(1), m.group(2), int(m.group(3)), m.group(5)
        level = i if side == "down" else n - 1 - i
        return Source(f"{part}.{side}.{level}.{'downsample' if side == 'down' else 'upsample'}.conv.{rest}")
    if m := _VAE_MID_RESNET.fullmatch(key):
        return Source(f"{m.group(1)}.mid.block_{int(m.group(2)) + 1}.{_vae_resnet(m.group(3))}")
    if m := _VAE_MID_ATTN.fullmatch(key):
        part, name, param = m.groups()
        squeeze = name != "group_norm" and param == "weight"
        return Source(f"{part}.mid.attn_1.{_VAE_ATTN[name]}.{param}", "squeeze" if squeeze else "same")
    raise KeyError(key)


# --------------------------------------------------------------------------------------------------------- CLIP
def clip_source(key: str, config: Any = None) -> Source:
    """OpenAI CLIP in the original files is already in the transformers layout (`text_model.*`)."""
    return Source(key)


_OPENCLIP_FIXED = {
    "text_model.embeddings.token_embedding.weight": Source("token_embedding.weight"),
    "text_model.embeddings.position_embedding.weight": Source("positional_embedding"),
    "text_model.final_layer_norm.weight": Source("ln_final.weight"),
    "text_model.final_layer_norm.bias": Source("ln_final.bias"),
    "text_projection.weight": Source("text_projection", "transpose"),
}
_OPENCLIP_LAYER = re.compile(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)")
_OPENCLIP_LAYER_MODULES = {
    "self_attn.out_proj": "attn.out_proj",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_QKV = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}


def openclip_source(key: str, config: Any = None) -> Source:
    """The open_clip name of transformers CLIP text key `key` (q/k/v come out of the fused `in_proj`)."""
    if key in _OPENCLIP_FIXED:
        return _OPENCLIP_FIXED[key]
    m = _OPENCLIP_LAYER.fullmatch(key)
    if m is None:
        raise KeyError(key)
    i, module, param = m.groups()
    block = f"transformer.resblocks.{i}"
    if module in _QKV:
        return Source(f"{block}.attn.in_proj_{param}", "chunk", _QKV[module])
    if module in _OPENCLIP_LAYER_MODULES:
        return Source(f"{block}.{_OPENCLIP_LAYER_MODULES[module]}.{param}")
    raise KeyError(key)


# ---------------------------------------------------------------------------------------------------- ControlNet
CONTROLNET_PREFIX = "control_model."  # ControlNet 1.0 files (beside the whole SD model); 1.1 files have no prefix
_HINT = re.compile(r"controlnet_cond_embedding\.blocks[._](\d+)\.(weight|bias)")
_ZERO = re.compile(r"controlnet_down_blocks[._](\d+)\.(weight|bias)")


def controlnet_source(key: str, config: Any) -> Source:
    """The original (`cldm`) key of diffusers ControlNet key `key`: the UNet's encoder half under the UNet's names,
    `input_hint_block.{0,2,...}` (the conditioning embedding's convolutions, SiLUs between them), `zero_convs.i.0`
    and `middle_block_out.0`."""
    module, param = _split(key)
    if module == "controlnet_cond_embedding.conv_in":
        return Source(f"input_hint_block.0.{param}")
    if m := _HINT.fullmatch(key):
        return Source(f"input_hint_block.{2 * (int(m.group(1)) + 1)}.{param}")
    if module == "controlnet_cond_embedding.conv_out":
        n = 2 * (len(config.conditioning_embedding_out_channels) - 1)
        return Source(f"input_hint_block.{2 * (n + 1)}.{param}")
    if m := _ZERO.fullmatch(key):
        return Source(f"zero_convs.{m.group(1)}.0.{param}")
    if module == "controlnet_mid_block":
        return Source(f"middle_block_out.0.{param}")
    if module in ("conv_norm_out", "conv_out"):
        raise KeyError(key)
    return unet_source(key, config)


# Per layout kind: the source function and the keys (relative to the prefix) an original file may hold that the
# diffusers model does not use: buffers (`position_ids`, OpenCLIP's causal `attn_mask`), CLIP's `logit_scale`, the
# VAE's training loss (`loss.*`, kept by some un-pruned files).
SOURCES: dict[str, Callable[[str, Any], Source]] = {
    "unet": unet_source,
    "vae": vae_source,
    "clip": clip_source,
    "openclip": openclip_source,
    "controlnet": controlnet_source,
}
IGNORED: dict[str, tuple[re.Pattern, ...]] = {
    "unet": (),
    "vae": (re.compile(r"loss\..*"),),
    "clip": (re.compile(r"(text_model\.)?embeddings\.position_ids"), re.compile(r"logit_scale")),
    "openclip": (re.compile(r"logit_scale"), re.compile(r"attn_mask")),
    "controlnet": (),
}
