"""Stable Diffusion 3 / 3.5 single files (`sd3.5_large.safetensors`, `sd3.5_medium.safetensors`,
`sd3_medium_incl_clips_t5xxlfp16.safetensors`, fine-tunes in that layout) read into sdjax's models, without torch
(diffusers `SD3Transformer2DModel.from_single_file` / `StableDiffusion3Pipeline.from_single_file`).

**The layout** (Stability AI's reference code, `sd3_impls.py`; ComfyUI writes the same):
- `model.diffusion_model.*`: the MMDiT. `x_embedder.proj` (patch convolution), `pos_embed` (the position table),
  `t_embedder.mlp.{0,2}` / `y_embedder.mlp.{0,2}` (timestep / pooled-text MLPs), `context_embedder`,
  `joint_blocks.N.{x_block,context_block}` with a fused `attn.qkv` (three equal row blocks: q, k, v), `attn.proj`,
  `attn.ln_q` / `attn.ln_k` (SD 3.5's qk RMS norm), `x_block.attn2.*` (SD 3.5 medium's dual attention), `mlp.fc1` /
  `mlp.fc2` and `adaLN_modulation.1`; `final_layer.linear` and `final_layer.adaLN_modulation.1`. The last block's
  context half is "pre-only" (no `attn.proj`, no `mlp`).
- `text_encoders.clip_l.transformer.*`, `text_encoders.clip_g.transformer.*`, `text_encoders.t5xxl.transformer.*`:
  transformers' key names (CLIP-L usually without `text_projection`: diffusers then uses the identity, as here);
  any of them may be missing (then `clip_l=`, `clip_g=`, `t5=` name separate files).
- `first_stage_model.*`: the VAE in the original (LDM) layout, no quant convs.

**The conversion** (the facts of diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`): the fused qkv split
into `to_q/k/v` (image stream), `add_q/k/v_proj` (text stream), `attn2.to_q/k/v`; `ln_q`/`ln_k` -> `norm_q`/`norm_k`
(image) and `norm_added_q`/`norm_added_k` (text); `attn.proj` -> `to_out.0` / `to_add_out`; `mlp.fc1`/`fc2` ->
`ff(_context).net.0.proj` / `net.2`; `adaLN_modulation.1` -> `norm1(_context).linear`; and where the reference
AdaLayerNormContinuous splits its projection into (shift, scale) and diffusers' into (scale, shift) -- the last
block's context modulation and `final_layer` (-> `norm_out`) -- the two row halves are swapped. Each diffusers tensor
is cut from its source when looked up (`flux.weights.TensorView`), so an 8e9-parameter file converts with about one
copy in host memory. The architecture comes from `config` (a diffusers SD 3 folder's `transformer/config.json`);
every mismatch with the file's tensors is reported by key (`models.convert`).

A file of another kind (a Flux.1 transformer, an SDXL checkpoint, ...) fails naming the file and what it looks like.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.families.flux.weights import (
    TensorView,
    _passthrough,
    describe_checkpoint,
    fp8_view,
    prefix_view,
    safetensors_keys,
    tensor_shape,
    weight_cast,
)
from sdjax.loading import files
from sdjax.loading.components import make_cast
from sdjax.models import clip as clip_model
from sdjax.models import sd3 as sd3_model
from sdjax.precision import resolve_dtype
from sdjax.quant.loading import convert_quantized

TRANSFORMER_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
CLIP_L_PREFIX = "text_encoders.clip_l.transformer."
CLIP_G_PREFIX = "text_encoders.clip_g.transformer."
T5_PREFIX = "text_encoders.t5xxl.transformer."
VAE_PREFIX = "first_stage_model."


class SD3WeightsError(ValueError):
    """A weight file that is not what the loader was asked for (names the file and what it looks like)."""


# ---------------------------------------------------------------------------------------------- what a file is
def transformer_part(tensors: Mapping[str, Any]) -> Mapping[str, Any]:
    """The MMDiT's keys of a file: those under `model.diffusion_model.` when present, else all."""
    for prefix in TRANSFORMER_PREFIXES:
        if any(k.startswith(prefix) for k in tensors):
            return prefix_view(tensors, prefix)
    return tensors


def detect_sd3(keys: Iterable[str]) -> bool:
    """Whether the keys (with or without the `model.diffusion_model.` prefix) hold an SD 3 / 3.5 MMDiT in the
    reference layout."""
    keys = set(keys)
    for prefix in TRANSFORMER_PREFIXES:
        if any(k.startswith(prefix) for k in keys):
            keys = {k[len(prefix) :] for k in keys if k.startswith(prefix)}
            break
    return "x_embedder.proj.weight" in keys and "joint_blocks.0.x_block.attn.qkv.weight" in keys


def is_sd3_file(path: str) -> bool:
    """Whether a safetensors file holds an SD 3 / 3.5 MMDiT (`detect_sd3`)."""
    keys = safetensors_keys(path)
    return keys is not None and detect_sd3(keys)


# ---------------------------------------------------------------------------------------------- the MMDiT table
def _rows(tensors: Mapping[str, Any], key: str, part: int, parts: int):
    """The `part`-th of `parts` equal row blocks of `tensors[key]` (a view; read when looked up)."""
    shape = tensor_shape(tensors, key)
    n = shape[0] // parts

    def get():
        return np.asarray(tensors[key])[part * n : (part + 1) * n]

    return get, (n, *shape[1:])


def _swapped(tensors: Mapping[str, Any], key: str):
    """`tensors[key]` with its two row halves exchanged ((shift, scale) -> (scale, shift))."""

    def get():
        x = np.asarray(tensors[key])
        half = x.shape[0] // 2
        return np.concatenate([x[half:], x[:half]], axis=0)

    return get, tensor_shape(tensors, key)


def sd3_transformer_state_dict(reference: Mapping[str, Any]) -> TensorView:
    """The reference layout's MMDiT tensors (prefix removed) -> a lazy diffusers `SD3Transformer2DModel` state dict
    (module docstring). Keys the table does not know are passed on unchanged, so the converter reports them."""
    keys = set(reference)
    used: set[str] = set()
    out: dict[str, tuple[Callable[[], np.ndarray], tuple[int, ...]]] = {}

    def take(src: str, dst: str, how: str = "all", part: int = 0) -> None:
        if src not in keys:
            return  # a missing tensor: the converter names the diffusers key that is then missing
        used.add(src)
        if how == "qkv":
            out[dst] = _rows(reference, src, part, 3)
        elif how == "swap":
            out[dst] = _swapped(reference, src)
        else:
            out[dst] = _passthrough(reference, src)

    for src, dst in (
        ("pos_embed", "pos_embed.pos_embed"),
        ("x_embedder.proj", "pos_embed.proj"),
        ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
        ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
        ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
        ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
        ("context_embedder", "context_embedder"),
        ("final_layer.linear", "proj_out"),
    ):
        for leaf in ("weight", "bias"):
            take(f"{src}.{leaf}" if src != "pos_embed" else src, f"{dst}.{leaf}" if src != "pos_embed" else dst)
    for leaf in ("weight", "bias"):
        take(f"final_layer.adaLN_modulation.1.{leaf}", f"norm_out.linear.{leaf}", "swap")

    blocks = sorted({int(k.split(".")[1]) for k in keys if k.startswith("joint_blocks.")})
    last = blocks[-1] if blocks else -1
    for i in blocks:
        s, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        for leaf in ("weight", "bias"):
            for j, name in enumerate(("to_q", "to_k", "to_v")):
                take(f"{s}.x_block.attn.qkv.{leaf}", f"{d}.attn.{name}.{leaf}", "qkv", j)
                take(f"{s}.x_block.attn2.qkv.{leaf}", f"{d}.attn2.{name}.{leaf}", "qkv", j)
            for j, name in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):
                take(f"{s}.context_block.attn.qkv.{leaf}", f"{d}.attn.{name}.{leaf}", "qkv", j)
            take(f"{s}.x_block.attn.proj.{leaf}", f"{d}.attn.to_out.0.{leaf}")
            take(f"{s}.x_block.attn2.proj.{leaf}", f"{d}.attn2.to_out.0.{leaf}")
            take(f"{s}.context_block.attn.proj.{leaf}", f"{d}.attn.to_add_out.{leaf}")
            take(f"{s}.x_block.adaLN_modulation.1.{leaf}", f"{d}.norm1.linear.{leaf}")
            take(
                f"{s}.context_block.adaLN_modulation.1.{leaf}",
                f"{d}.norm1_context.linear.{leaf}",
                "swap" if i == last else "all",  # pre-only: AdaLayerNormContinuous's (shift, scale)
            )
            for block, ff in (("x_block", "ff"), ("context_block", "ff_context")):
                take(f"{s}.{block}.mlp.fc1.{leaf}", f"{d}.{ff}.net.0.proj.{leaf}")
                take(f"{s}.{block}.mlp.fc2.{leaf}", f"{d}.{ff}.net.2.{leaf}")
        for src, dst in (
            ("x_block.attn.ln_q", "attn.norm_q"),
            ("x_block.attn.ln_k", "attn.norm_k"),
            ("context_block.attn.ln_q", "attn.norm_added_q"),
            ("context_block.attn.ln_k", "attn.norm_added_k"),
            ("x_block.attn2.ln_q", "attn2.norm_q"),
            ("x_block.attn2.ln_k", "attn2.norm_k"),
        ):
            take(f"{s}.{src}.weight", f"{d}.{dst}.weight")
    for k in sorted(keys - used):  # unknown tensors: reported by the converter under their own names
        out[k] = _passthrough(reference, k)
    return TensorView(out)


# ---------------------------------------------------------------------------------------------- loaders
def _config(config: Any, cls: Any, default: Any = None, *, source: str):
    if config is None:
        config = default
    if config is None:
        raise ValueError(f"{source}: no config for it (pass config=, a diffusers SD 3 folder)")
    return cls.from_dict(config, source=source) if isinstance(config, Mapping) else config


def load_sd3_transformer(
    tensors: Mapping[str, Any], *, source: str, dtype: Any, config: Any, keep_fp8: bool = False, quantize: Any = None
) -> tuple[sd3_model.SD3Transformer2DModel, dict]:
    """The MMDiT of a file's tensors (reference layout, with or without `model.diffusion_model.`; or diffusers
    names) -> `(module, params)`. `config`: an `SD3TransformerConfig` or `transformer/config.json` dict.
    `quantize` (a `sdjax.quant.QuantPolicy`): the kernels it selects under `transformer` are quantized as they are
    converted (`sdjax.quant.loading`). Raises `SD3WeightsError` for tensors that are no SD 3 MMDiT."""
    part = transformer_part(tensors)
    if detect_sd3(part):
        sd = sd3_transformer_state_dict(part)
    elif "pos_embed.proj.weight" in part and "transformer_blocks.0.attn.to_q.weight" in part:
        sd = part  # diffusers names
    else:
        raise SD3WeightsError(
            f"{source}: not a Stable Diffusion 3 / 3.5 transformer; it looks like {describe_checkpoint(tensors)}"
        )
    cfg = _config(config, sd3_model.SD3TransformerConfig, source=f"transformer config for {source}")
    params = convert_quantized(
        lambda c: sd3_model.convert_sd3_transformer(sd, cfg, cast=c, component=f"transformer ({source})"),
        weight_cast(dtype, keep_fp8=keep_fp8),
        quantize,
        "transformer",
    )
    return sd3_model.SD3Transformer2DModel(cfg, dtype=dtype), params


# CLIP files may carry these beside the text model: the contrastive temperature, the position-id buffer.
_CLIP_EXTRAS = frozenset({"logit_scale", "text_model.embeddings.position_ids"})


def load_sd3_clip(
    tensors: Mapping[str, Any],
    *,
    source: str,
    dtype: Any,
    config: Any,
    quantize: Any = None,
    params_key: str = "text_encoder",
) -> tuple[clip_model.CLIPTextModelWithProjection, dict]:
    """A CLIP text encoder with projection (SD 3's `text_encoder` / `text_encoder_2`) from transformers-named
    tensors (prefix removed). A CLIP-L without `text_projection` (as SD 3 files store it) gets the identity, as
    diffusers does. `quantize` (a `sdjax.quant.QuantPolicy`): the kernels it selects under `params_key` are
    quantized as they are converted. Raises `SD3WeightsError` for tensors that are no CLIP text encoder."""
    entries = {k: _passthrough(tensors, k) for k in tensors if k not in _CLIP_EXTRAS}
    if not any(k.endswith("encoder.layers.0.self_attn.q_proj.weight") for k in entries):
        raise SD3WeightsError(f"{source}: not a CLIP text encoder; it looks like {describe_checkpoint(tensors)}")
    if "text_projection.weight" not in entries:
        width = int(config.hidden_size)
        if int(config.projection_dim) != width:
            raise SD3WeightsError(
                f"{source}: no text_projection.weight, and the config's projection_dim {config.projection_dim} is "
                f"not the hidden size {width} (only then is the identity used)"
            )
        entries["text_projection.weight"] = (lambda: np.eye(width, dtype=np.float32)), (width, width)
    params = convert_quantized(
        lambda c: clip_model.convert_clip_text(
            TensorView(entries), config, with_projection=True, cast=c, component=source
        ),
        make_cast(dtype),
        quantize,
        params_key,
    )
    return clip_model.CLIPTextModelWithProjection(config, dtype=dtype), params


def read_file(path: str | Path, *, keep_fp8: bool = False) -> Mapping[str, Any]:
    """A `.safetensors` file's tensors (memory-mapped; ComfyUI's scaled float8 resolved, `flux.weights.fp8_view`)."""
    return fp8_view(files.read_safetensors(path), source=str(path), keep_fp8=keep_fp8)


def part_of(tensors: Mapping[str, Any], prefix: str) -> Mapping[str, Any] | None:
    """The keys under `prefix` (without it), or None when the file has none."""
    return prefix_view(tensors, prefix) if any(k.startswith(prefix) for k in tensors) else None


def _folder_config(config: Any, component: str) -> dict | None:
    from sdjax.config import read_json

    local = Path(str(config)) / component / "config.json"
    return read_json(local) if config is not None and local.is_file() else None


def load_single_file_components(
    path: str | Path,
    *,
    config: Any,
    dtype: Any,
    clip_l: str | Path | None = None,
    clip_g: str | Path | None = None,
    t5: str | Path | None = None,
    keep_fp8: bool = False,
    quantize: Any = None,
) -> dict[str, tuple[Any, dict]]:
    """What an SD 3 single file (and the separate `clip_l` / `clip_g` / `t5` files) holds -> `{component: (module,
    params)}`: always the transformer; `text_encoder` (CLIP-L), `text_encoder_2` (CLIP-G), `text_encoder_3` (T5) and
    the `vae` where the file bundles them or a separate file is given (a separate file wins). `config` is a diffusers
    SD 3 folder: its components' `config.json`s are the architectures (the released SD 3.5 files say nothing of
    theirs). Components found nowhere are left to the caller (the folder's own weights). `quantize` (a
    `sdjax.quant.QuantPolicy`): the kernels it selects in the transformer and the text encoders read here are
    quantized as they are converted (the VAE is read as it is)."""
    from sdjax.families.flux.weights import load_t5_file
    from sdjax.loading.single_file import load_vae
    from sdjax.models.t5 import T5Config

    dtype = resolve_dtype(dtype)
    source = str(path)
    tensors = read_file(path, keep_fp8=keep_fp8)
    out = {
        "transformer": load_sd3_transformer(
            tensors,
            source=source,
            dtype=dtype,
            config=_folder_config(config, "transformer"),
            keep_fp8=keep_fp8,
            quantize=quantize,
        )
    }
    for name, prefix, file in (("text_encoder", CLIP_L_PREFIX, clip_l), ("text_encoder_2", CLIP_G_PREFIX, clip_g)):
        where = str(file) if file is not None else f"{source} ({prefix}*)"
        found = read_file(file) if file is not None else part_of(tensors, prefix)
        if found is None:
            continue
        if file is not None:
            found = part_of(found, prefix) or found  # a separate file may keep the bundled prefix
        cfg = _config(_folder_config(config, name), clip_model.CLIPTextConfig, source=f"{name} config for {where}")
        out[name] = load_sd3_clip(
            found, source=f"{name} ({where})", dtype=dtype, config=cfg, quantize=quantize, params_key=name
        )
    t5_source = t5 if t5 is not None else (path if part_of(tensors, T5_PREFIX) is not None else None)
    if t5_source is not None:
        t5_config = _folder_config(config, "text_encoder_3")
        t5_config = None if t5_config is None else T5Config.from_dict(t5_config, source=f"{config}/text_encoder_3")
        out["text_encoder_3"] = load_t5_file(
            t5_source, dtype=dtype, config=t5_config, keep_fp8=keep_fp8, quantize=quantize, params_key="text_encoder_3"
        )
    if part_of(tensors, VAE_PREFIX) is not None:
        out["vae"] = load_vae(path, dtype, config=config)
    return out
