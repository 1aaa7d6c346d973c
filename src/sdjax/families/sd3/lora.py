"""LoRA files for Stable Diffusion 3 / 3.5 -> low-rank deltas on the MMDiT's and the two CLIP text encoders' params
(diffusers `StableDiffusion3Pipeline.load_lora_weights` + `fuse_lora`, and ComfyUI's SD 3 LoRA loading, without
torch).

The layouts read (a file may mix them; alpha defaults to the rank, i.e. a factor of 1):

- diffusers / PEFT (`train_dreambooth_lora_sd3.py`, `StableDiffusion3Pipeline.save_lora_weights`):
  `transformer.<diffusers module>.lora_A.weight` / `.lora_B.weight` (`transformer.transformer_blocks.0.attn.to_q`),
  alpha from the file's `lora_adapter_metadata` (`transformer.lora_alpha`, `alpha_pattern`, `use_rslora`:
  `loading.lora`'s rules) or a `.alpha` tensor; the same diffusers names under `base_model.model.` or no prefix,
  and with underscores under `lora_transformer_` (OneTrainer) or `lycoris_` (SimpleTuner), as ComfyUI maps them.
- kohya / sd-scripts (`networks/lora_sd3.py`) and ComfyUI, in the reference MMDiT names of the single-file layout
  (`families.sd3.weights`): `lora_unet_<module, dots as underscores>.lora_down.weight` / `.lora_up.weight` /
  `.alpha` (`lora_unet_joint_blocks_0_x_block_attn_qkv`), and the dotted names under `diffusion_model.` /
  `model.diffusion_model.` or none, with `lora_down` / `lora_up` or `lora_A` / `lora_B`.
- text encoders: `text_encoder.` / `text_encoder_2.` (diffusers / PEFT, CLIP-L / CLIP-G), kohya's `lora_te1_` /
  `lora_te2_` (`lora_te_`: CLIP-L), ComfyUI's `text_encoders.clip_l.transformer.` / `clip_g`: resolved by
  `loading.lora` (the SD / SDXL reader) against `text_encoder` and `text_encoder_2`.

A reference module maps to diffusers' as the checkpoint loader maps the weight (`reference_modules`, the table of
`weights.sd3_transformer_state_dict`): a fused `attn.qkv` (image stream -> `to_q/k/v`, text stream -> `add_q/k/v_proj`,
`attn2.qkv` -> `attn2.to_q/k/v`) adapts each part with the same `down` and the third of `up`'s rows that belongs to it
(the product's rows are the fused weight's rows); where the weight's two row halves are exchanged (the last block's
context `adaLN_modulation.1`, `final_layer.adaLN_modulation.1`), `up`'s are too. Each target's delta is
`alpha / r * up @ down` (`loading.lora.LoraFactor`; `x_embedder.proj` is a LoCon convolution pair); the pipeline
adds the scaled sum of the active LoRAs to the kernels (`loading.lora.apply_loras`).

Refused, naming the keys: every key that adapts no layer of this model (an unknown layout, a block or a dual
attention `attn2` the model lacks, a `context_block` part the last, pre-only block has not, T5 layers `lora_te3_` /
`text_encoder_3.` / `text_encoders.t5xxl.`, which diffusers does not load either), so a LoRA is applied whole or not
at all; a LoRA of another family (SD 1.x/2.x/XL UNet layers, Flux.1 blocks) by its family; layers whose shapes differ
(a LoRA for another width: SD 3 / 3.5 medium 1536, 3.5 large 2432); LoHa, LoKr, DoRA, full-weight diffs
(`loading.lora`'s rules); a LoRA on float8 kernels (`keep_fp8`), whose sum would be rounded to float8.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax.traverse_util import flatten_dict

from sdjax.loading import lora as sd_lora
from sdjax.loading.lora import Lora, LoraError, LoraFactor, UnmatchedLoraKeysWarning
from sdjax.models.convert import torch_key_to_path
from sdjax.quant import params as quant_params

COMPONENT = "transformer"
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # CLIP-L, CLIP-G; T5 (text_encoder_3) takes no LoRA

_SUFFIXES = (
    (".lora_down.weight", "down"),
    (".lora_up.weight", "up"),
    (".lora_A.weight", "down"),
    (".lora_B.weight", "up"),
    (".alpha", "alpha"),
)
# Text-encoder key prefixes: ComfyUI's spellings renamed to those `loading.lora` reads; the rest read as they are.
_TE_RENAMES = (
    ("text_encoders.clip_l.transformer.", "text_encoder."),
    ("text_encoders.clip_g.transformer.", "text_encoder_2."),
)
_TE_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "text_encoder.", "text_encoder_2.")
_T5_PREFIXES = ("lora_te3_", "text_encoder_3.", "text_encoders.t5xxl.")
# Transformer key prefixes: underscored module names, dotted ones (reference or diffusers names alike: they differ).
_UNDERSCORED = ("lora_unet_", "lora_transformer_", "lycoris_")
_DOTTED = ("model.diffusion_model.", "diffusion_model.", "transformer.", "base_model.model.")
_TOPS = frozenset(
    {"joint_blocks", "x_embedder", "t_embedder", "y_embedder", "context_embedder", "final_layer"}
    | {"transformer_blocks", "pos_embed", "time_text_embed", "norm_out", "proj_out"}
)
_SD_UNET = re.compile(r"(^|[._])(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)[._]")
_FLUX = re.compile(r"(^|[._])(double_blocks|single_blocks|single_transformer_blocks)[._]")
_SHOWN = 5


# ---------------------------------------------------------------------------------------------- the module table
def reference_modules(blocks: int) -> dict[str, list[tuple[str, str]]]:
    """Reference MMDiT module (dotted, without `model.diffusion_model.`) -> `[(diffusers module, rows)]` for a
    transformer of `blocks` joint blocks (the last one context pre-only), every module the reference model can
    have; `rows` is "all", "q" / "k" / "v" (that third of a fused qkv's rows) or "swap" (the two row halves
    exchanged). The same facts as `weights.sd3_transformer_state_dict`."""
    table: dict[str, list[tuple[str, str]]] = {
        "x_embedder.proj": [("pos_embed.proj", "all")],
        "t_embedder.mlp.0": [("time_text_embed.timestep_embedder.linear_1", "all")],
        "t_embedder.mlp.2": [("time_text_embed.timestep_embedder.linear_2", "all")],
        "y_embedder.mlp.0": [("time_text_embed.text_embedder.linear_1", "all")],
        "y_embedder.mlp.2": [("time_text_embed.text_embedder.linear_2", "all")],
        "context_embedder": [("context_embedder", "all")],
        "final_layer.linear": [("proj_out", "all")],
        "final_layer.adaLN_modulation.1": [("norm_out.linear", "swap")],
    }
    for i in range(blocks):
        s, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        table[f"{s}.x_block.attn.qkv"] = [(f"{d}.attn.to_{p}", p) for p in "qkv"]
        table[f"{s}.x_block.attn2.qkv"] = [(f"{d}.attn2.to_{p}", p) for p in "qkv"]
        table[f"{s}.context_block.attn.qkv"] = [(f"{d}.attn.add_{p}_proj", p) for p in "qkv"]
        for src, dst, rows in (
            ("x_block.attn.proj", "attn.to_out.0", "all"),
            ("x_block.attn2.proj", "attn2.to_out.0", "all"),
            ("context_block.attn.proj", "attn.to_add_out", "all"),
            ("x_block.mlp.fc1", "ff.net.0.proj", "all"),
            ("x_block.mlp.fc2", "ff.net.2", "all"),
            ("context_block.mlp.fc1", "ff_context.net.0.proj", "all"),
            ("context_block.mlp.fc2", "ff_context.net.2", "all"),
            ("x_block.adaLN_modulation.1", "norm1.linear", "all"),
            # pre-only: AdaLayerNormContinuous's (shift, scale) halves, diffusers' (scale, shift)
            ("context_block.adaLN_modulation.1", "norm1_context.linear", "swap" if i == blocks - 1 else "all"),
        ):
            table[f"{s}.{src}"] = [(f"{d}.{dst}", rows)]
    return table


def take_rows(up: np.ndarray, rows: str) -> np.ndarray:
    """The rows of a LoRA `up (out, r)` that adapt one target (`reference_modules`' `rows`); ValueError when `up`
    cannot be cut so."""
    n = up.shape[0]
    if rows == "all":
        return up
    if rows == "swap":
        if n % 2:
            raise ValueError(f"{n} rows cannot be halved")
        return np.concatenate([up[n // 2 :], up[: n // 2]], axis=0)
    if n % 3:
        raise ValueError(f"{n} rows cannot be split into q, k, v thirds")
    j = "qkv".index(rows)
    return up[j * n // 3 : (j + 1) * n // 3]


class _Model:
    """What a file's transformer layer names are matched against: the kernel paths and shapes, by diffusers name,
    its underscore spelling, and the reference names (dotted and underscored) of this depth."""

    def __init__(self, params: Mapping[str, Any]):
        flat = flatten_dict(dict(params))
        self.kernels = {p: v for p, v in flat.items() if p[-1] == "kernel"}
        if ("pos_embed", "proj", "kernel") not in self.kernels or ("context_embedder", "kernel") not in self.kernels:
            raise LoraError("the params given are not an SD 3 transformer's (no pos_embed/proj or context_embedder)")
        self.quantized = {p for p in self.kernels if (*p[:-1], p[-1] + quant_params.SCALE_SUFFIX) in flat}
        self.underscored = {"_".join(p[:-1]): p for p in self.kernels}
        blocks = len({p[0] for p in self.kernels if p[0].startswith("transformer_blocks_")})
        self.reference = {
            name: targets
            for name, targets in reference_modules(blocks).items()
            if all(self.path(module) is not None for module, _ in targets)
        }
        self.reference_underscored = {name.replace(".", "_"): name for name in self.reference}

    def path(self, diffusers_module: str) -> tuple[str, ...] | None:
        path = torch_key_to_path(diffusers_module + ".weight")[:-1] + ("kernel",)
        return path if path in self.kernels else None

    def targets(self, name: str, dotted: bool) -> tuple[list[tuple[tuple[str, ...], str]], bool] | None:
        """`([(kernel path, rows of up)], is a diffusers name)` for one layer name, None when this model has no
        such layer."""
        if not dotted:
            if name in self.reference_underscored:
                name = self.reference_underscored[name]
            else:
                path = self.underscored.get(name)
                return None if path is None else ([(path, "all")], False)
        path = self.path(name)  # first: `context_embedder` is both names
        if path is not None:
            return [(path, "all")], True
        if name in self.reference:
            return [(self.path(module), rows) for module, rows in self.reference[name]], False
        return None


# ---------------------------------------------------------------------------------------------- file keys
def _split_key(key: str) -> tuple[str, str] | None:
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def _classify(module: str) -> tuple[bool, str] | None:
    """`(dotted, name)` of a transformer layer key without its suffix, None for an unknown layout."""
    for prefix in _UNDERSCORED:
        if module.startswith(prefix):
            return False, module[len(prefix) :]
    for prefix in _DOTTED:
        if module.startswith(prefix):
            return True, module[len(prefix) :]
    if module.split(".", 1)[0] in _TOPS:
        return True, module
    return None


def _text_encoder_key(key: str) -> str | None:
    """The key as `loading.lora` reads it when it belongs to a CLIP text encoder, else None."""
    for prefix, renamed in _TE_RENAMES:
        if key.startswith(prefix):
            return renamed + key[len(prefix) :]
    return key if key.startswith(_TE_PREFIXES) else None


def _other_family(keys: Sequence[str]) -> str | None:
    """What a file made for another family looks like, by one of its keys; None if nothing says so."""
    for key in keys:
        if _SD_UNET.search(key) or key.startswith("unet."):
            return f"an SD 1.x/2.x or SDXL LoRA (UNet layers, such as {key})"
    for key in keys:
        if _FLUX.search(key):
            return f"a Flux.1 LoRA (such as {key})"
    return None


def _shown(keys: Sequence[str]) -> str:
    more = f", ... and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def _adapter_metadata(metadata: Mapping[str, str] | None, source: str) -> dict[str, Any]:
    if not metadata or sd_lora.METADATA_KEY not in metadata:
        return {}
    try:
        return json.loads(metadata[sd_lora.METADATA_KEY])
    except ValueError as e:
        raise LoraError(f"{source}: unreadable {sd_lora.METADATA_KEY} metadata ({e})") from e


# ---------------------------------------------------------------------------------------------- resolving
def _pair(tensors, roles: Mapping[str, str], module: str, source: str) -> tuple[np.ndarray, np.ndarray]:
    """`(down (r, in[, kh, kw]), up (out, r))` float32 of one layer; LoraError when they are no LoRA pair."""
    if "down" not in roles or "up" not in roles:
        raise LoraError(f"{source}: layer {module!r} lacks its down or up weight (has {sorted(roles.values())})")
    down = np.asarray(tensors[roles["down"]], np.float32)
    up = np.asarray(tensors[roles["up"]], np.float32)
    rank = down.shape[0] if down.ndim else 0
    if down.ndim not in (2, 4) or up.ndim not in (2, 4) or up.shape[1] != rank or up.shape[2:] not in ((), (1, 1)):
        raise LoraError(
            f"{source}: {roles['down']} {down.shape} and {roles['up']} {up.shape} are not a LoRA pair "
            f"(down (r, in[, kh, kw]), up (out, r[, 1, 1]))"
        )
    return down, up.reshape(up.shape[0], rank)


def _alpha_over_rank(tensors, roles, module: str, rank: int, diffusers_name: bool, adapter_meta) -> float:
    if "alpha" in roles:
        return float(np.asarray(tensors[roles["alpha"]], np.float32).reshape(())) / rank
    if diffusers_name:
        peft = sd_lora._peft_alpha(adapter_meta, COMPONENT, module, rank)
        if peft is not None:
            return peft
    return 1.0


def _transformer_factors(tensors, layers, model: _Model, adapter_meta, source: str):
    """`(factors, unmatched keys, misfits)` of the transformer's layers (`{(dotted, name): {role: key}}`)."""
    factors: dict[tuple[str, tuple[str, ...]], LoraFactor] = {}
    unmatched: list[str] = []
    misfit: list[str] = []
    for (dotted, module), roles in layers.items():
        found = model.targets(module, dotted)
        if found is None:
            unmatched.extend(sorted(roles.values()))
            continue
        targets, diffusers_name = found
        down, up = _pair(tensors, roles, module, source)
        rank = down.shape[0]
        alpha_over_rank = _alpha_over_rank(tensors, roles, module, rank, diffusers_name, adapter_meta)
        for path, rows in targets:
            kernel = model.kernels[path]
            where = "/".join(path)
            try:
                part = take_rows(up, rows)
                torch_shape = (part.shape[0], *down.shape[1:])
                sd_lora.to_flax_kernel(np.zeros(torch_shape, np.float32), tuple(kernel.shape))
            except ValueError:
                shape = (up.shape[0], *down.shape[1:])
                misfit.append(f"{roles['down']}: LoRA weight {shape} vs {where} {tuple(kernel.shape)}")
                continue
            if np.dtype(kernel.dtype).itemsize == 1 and path not in model.quantized:
                raise LoraError(
                    f"{source}: {where} is {np.dtype(kernel.dtype)} (keep_fp8): adding the LoRA would round it to "
                    f"float8; load the transformer with keep_fp8=False"
                )
            if (COMPONENT, path) in factors:
                first = factors[(COMPONENT, path)].name
                raise LoraError(f"{source}: two LoRA layers adapt {where}: {first} and {roles['down']}")
            factors[(COMPONENT, path)] = LoraFactor(
                part, down.reshape(rank, -1), alpha_over_rank, torch_shape, roles["down"]
            )
    return factors, unmatched, misfit


def _text_encoder_factors(tensors, te_keys: Mapping[str, str], params, source: str, metadata):
    """`(factors, unmatched file keys)` of the CLIP text encoders' layers (`{key as loading.lora reads it: file
    key}`), resolved by `loading.lora.resolve_lora`."""
    if not te_keys:
        return {}, []
    present = {c: params[c] for c in TEXT_ENCODERS if params.get(c) is not None}
    if not present:
        return {}, sorted(te_keys.values())
    view = {k: tensors[original] for k, original in te_keys.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnmatchedLoraKeysWarning)  # refused below, by name
        lora = sd_lora.resolve_lora(view, present, source=source, metadata=metadata)
    return dict(lora.factors), sorted(te_keys.get(k, k) for k in lora.unmatched)


def resolve_sd3_lora(
    tensors: Mapping[str, Any],
    params: Mapping[str, Any],
    *,
    source: str,
    name: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Lora:
    """Match a LoRA state dict against an SD 3 pipeline's params (`{component: params tree}`, arrays or
    ShapeDtypeStructs; `transformer` required, `text_encoder` / `text_encoder_2` for text-encoder layers) -> `Lora`
    whose factors are keyed `(component, kernel path)`. Raises `LoraError` naming `source` and the keys for a file
    that does not fit as a whole (module docstring)."""
    keys = list(tensors)
    sd_lora.group_layers(keys, source=source)  # refuses LoHa, LoKr, DoRA, full diffs by loading.lora's rules
    other = _other_family(keys)
    if other is not None:
        raise LoraError(f"{source}: this is {other}, not a Stable Diffusion 3 / 3.5 LoRA")
    if params.get(COMPONENT) is None:
        raise LoraError(f"{source}: no transformer params to apply an SD 3 LoRA to")
    model = _Model(params[COMPONENT])
    adapter_meta = _adapter_metadata(metadata, source)
    layers: dict[tuple[bool, str], dict[str, str]] = {}
    te_keys: dict[str, str] = {}
    t5: list[str] = []
    unknown: list[str] = []
    for key in keys:
        te_key = _text_encoder_key(key)
        split = _split_key(key)
        where = _classify(split[0]) if split else None
        if te_key is not None:
            te_keys[te_key] = key
        elif key.startswith(_T5_PREFIXES):
            t5.append(key)
        elif where is None:
            unknown.append(key)
        else:
            layers.setdefault(where, {})[split[1]] = key
    factors, unmatched, misfit = _transformer_factors(tensors, layers, model, adapter_meta, source)
    if misfit:
        raise LoraError(
            f"{source}: {len(misfit)} LoRA layer(s) do not fit this SD 3 transformer's shapes -- the LoRA was made "
            f"for another model (SD 3 / 3.5 medium are 1536 wide, SD 3.5 large 2432): {_shown(misfit)}"
        )
    te_factors, te_unmatched = _text_encoder_factors(tensors, te_keys, params, source, metadata)
    refused = []
    if unknown:
        refused.append(f"{len(unknown)} key(s) of no SD 3 LoRA layout: {_shown(unknown)}")
    if unmatched or te_unmatched:
        missing = unmatched + te_unmatched
        refused.append(f"{len(missing)} key(s) adapt no layer of this model: {_shown(missing)}")
    if t5:
        refused.append(f"{len(t5)} T5 (text_encoder_3) key(s), which sdjax does not adapt: {_shown(t5)}")
    if refused:
        raise LoraError(f"{source}: not applied (a LoRA is applied whole or not at all): {'; '.join(refused)}")
    if not factors and not te_factors:
        raise LoraError(f"{source}: no LoRA layer in this file ({len(keys)} keys such as {_shown(keys)})")
    return Lora(name=name or Path(source).stem, source=str(source), factors={**factors, **te_factors})


def load_sd3_lora(path: str | Path, params: Mapping[str, Any], *, name: str | None = None) -> Lora:
    """Read a LoRA `.safetensors` file (any layout in the module docstring) for an SD 3 pipeline's `params`
    (`{component: params tree}`)."""
    tensors, metadata = sd_lora.read_lora_file(path)
    return resolve_sd3_lora(tensors, params, source=str(path), name=name, metadata=metadata)
