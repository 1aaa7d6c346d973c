"""LoRA files for Flux.1 -> low-rank deltas on the transformer's params (diffusers `FluxLoraLoaderMixin.
load_lora_weights` + `fuse_lora`, without torch).

The layouts read (a file may mix them; alpha defaults to the rank, i.e. a factor of 1):

- kohya / sd-scripts, ComfyUI, ai-toolkit in BFL naming: `lora_unet_<BFL module, dots as underscores>.lora_down.
  weight` / `.lora_up.weight` / `.alpha` (`lora_unet_double_blocks_0_img_attn_qkv`), and the same with dotted BFL
  names under `diffusion_model.` (ComfyUI) or none, with `lora_down`/`lora_up` or PEFT's `lora_A`/`lora_B`;
- diffusers / PEFT: `transformer.<diffusers module>.lora_A.weight` / `.lora_B.weight`
  (`transformer.single_transformer_blocks.0.attn.to_q`), alpha from the file's `lora_adapter_metadata`
  (`transformer.lora_alpha`, `alpha_pattern`, `use_rslora`: `loading.lora`'s rules) or a `.alpha` tensor; and
  kohya's spelling of the diffusers names, `lora_transformer_<...>`.

BFL modules map to diffusers' through `weights.bfl_module_targets`, the table the checkpoint loader uses: a LoRA
on a fused module (`img_attn.qkv`, `txt_attn.qkv`, a single block's `linear1`) adapts each part with the same
`down` and the rows of `up` that belong to it (the product's rows are the fused weight's rows); diffusers splits
the same way (when `up` is block-diagonal it also chunks `down`: the same product). `final_layer.adaLN_modulation.1`
gets `up`'s halves swapped, as the weight itself. Each target's delta is `alpha / r * up @ down` (`loading.lora.
LoraFactor`); `apply_loras` adds the scaled sum of several LoRAs to the touched kernels (`loading.lora.apply_loras`:
float32 arithmetic on the device, stored in the kernel's dtype; every other leaf is the input's own object).

Where sdjax and diffusers 0.42.1 differ: diffusers' kohya converter hard-codes Flux.1's width (a `linear1` LoRA of
another width fails there), and the layers it converts without the `transformer.` prefix (`img_in`, `txt_in`,
`time_in`, `vector_in`, `guidance_in`, `final_layer`) are not loaded by `load_lora_weights`; sdjax applies them,
with their alpha, as kohya and ComfyUI do.

Text encoders: given CLIP-L's params (`text_encoder=`, as the pipeline's `load_lora` does), its layers
(`text_encoder.<module>` as diffusers' `FluxPipeline.save_lora_weights` writes them, kohya's `lora_te_` / `lora_te1_`)
are resolved by `loading.lora` (the SD reader) and applied to `text_encoder`. Not applied: T5's layers
(`text_encoder_2.`, `lora_te2_`, `text_encoders.t5xxl`), and CLIP-L's without `text_encoder=`, are skipped with a
warning naming them; LoHa, LoKr, DoRA, full-weight diffs are refused (`loading.lora`'s rules); a LoRA for another
model (SD / SDXL UNet layers, or layers whose shapes differ) fails naming what it looks like; a LoRA on float8
kernels (`keep_fp8`) is refused, since the sum would be rounded to float8.
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

from sdjax.families.flux.weights import bfl_module_names, bfl_module_targets, row_ranges, take_rows
from sdjax.loading import lora as sd_lora
from sdjax.loading.lora import Lora, LoraError, LoraFactor, UnmatchedLoraKeysWarning
from sdjax.models.convert import torch_key_to_path

COMPONENT = "transformer"
_SUFFIXES = (
    (".lora_down.weight", "down"),
    (".lora_up.weight", "up"),
    (".lora_A.weight", "down"),
    (".lora_B.weight", "up"),
    (".alpha", "alpha"),
)
_TEXT_ENCODER = ("lora_te", "text_encoder.", "text_encoder_2.", "text_encoders.")
_CLIP_L = ("text_encoder.", "lora_te_", "lora_te1_")  # CLIP-L's keys (`text_encoder_2.`, `lora_te2_`: T5's)
_DIFFUSERS_TOP = frozenset(
    {"transformer_blocks", "single_transformer_blocks", "x_embedder", "context_embedder", "time_text_embed"}
    | {"norm_out", "proj_out"}
)
_BFL_TOP = frozenset({"double_blocks", "single_blocks", "img_in", "txt_in", "time_in", "vector_in", "guidance_in"})
_BFL_TOP |= {"final_layer"}
_SD_UNET = re.compile(r"(^|[._])(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)[._]")


def _split_key(key: str) -> tuple[str, str] | None:
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def _classify(module: str) -> tuple[str, str] | None:
    """`(style, name)` of a layer key without its suffix: style "bfl" (dotted BFL name), "bfl_" (kohya's
    underscores), "diffusers" (dotted), "diffusers_" (underscores), "te" (a text encoder's); None if unknown."""
    if module.startswith(_TEXT_ENCODER):
        return "te", module
    for prefix, style in (("lora_unet_", "bfl_"), ("lora_transformer_", "diffusers_")):
        if module.startswith(prefix):
            return style, module[len(prefix) :]
    for prefix, style in (
        ("model.diffusion_model.", "bfl"),
        ("diffusion_model.", "bfl"),
        ("transformer.", "diffusers"),
    ):
        if module.startswith(prefix):
            return style, module[len(prefix) :]
    top = module.split(".", 1)[0]
    if top in _BFL_TOP:
        return "bfl", module
    if top in _DIFFUSERS_TOP:
        return "diffusers", module
    return None


def _looks_like(keys: Sequence[str]) -> str:
    if any(_SD_UNET.search(k) for k in keys) or any(k.startswith("unet.") for k in keys):
        kind = "SDXL" if any(k.startswith(("lora_te2_", "text_encoder_2.")) for k in keys) else "SD 1.x/2.x or SDXL"
        return f"a {kind} LoRA (UNet layers)"
    if any("joint_blocks" in k or "context_block" in k for k in keys):
        return "an SD 3 LoRA"
    return "no Flux.1 LoRA"


class _Model:
    """What a file's layer names are matched against: the transformer's kernel paths and shapes, by diffusers
    name, kohya's underscore spelling of it, and the BFL names of this depth."""

    def __init__(self, params: Mapping[str, Any]):
        self.shapes = {p: tuple(v.shape) for p, v in flatten_dict(dict(params)).items() if p[-1] == "kernel"}
        self.underscored = {"_".join(p[:-1]): p for p in self.shapes}
        if ("x_embedder", "kernel") not in self.shapes:
            raise LoraError("the params given are not a Flux transformer's (no x_embedder/kernel)")
        self.inner = self.shapes[("x_embedder", "kernel")][1]
        count = {
            prefix: len({p[0] for p in self.shapes if p[0].startswith(prefix + "_")})
            for prefix in ("transformer_blocks", "single_transformer_blocks")
        }
        names = bfl_module_names(count["transformer_blocks"], count["single_transformer_blocks"])
        self.bfl_underscored = {n.replace(".", "_"): n for n in names}

    def path(self, diffusers_module: str) -> tuple[str, ...] | None:
        path = torch_key_to_path(diffusers_module + ".weight")[:-1] + ("kernel",)
        return path if path in self.shapes else None

    def targets(self, style: str, name: str) -> list[tuple[tuple[str, ...], Any]] | None:
        """`[(kernel path, rows of up)]` for one layer name, None when this model has no such layer."""
        if style == "bfl_":
            name, style = self.bfl_underscored.get(name), "bfl"
            if name is None:
                return None
        if style == "bfl":
            targets = bfl_module_targets(name)
            paths = [(self.path(t), rows) for t, rows in targets or ()]
            return paths if paths and all(p is not None for p, _ in paths) else None
        if style == "diffusers_":
            path = self.underscored.get(name)
        else:
            path = self.path(name)
        return None if path is None else [(path, "all")]


def _alpha_over_rank(tensors, keys: Mapping[str, str], style: str, name: str, rank: int, metadata) -> float:
    if "alpha" in keys:
        return float(np.asarray(tensors[keys["alpha"]], np.float32).reshape(())) / rank
    if style == "diffusers":
        peft = sd_lora._peft_alpha(metadata, COMPONENT, name, rank)
        if peft is not None:
            return peft
    return 1.0


def _clip_factors(tensors, keys: list[str], text_encoder, source: str, metadata) -> tuple[dict, list[str]]:
    """`(factors, keys left)`: CLIP-L's LoRA layers among the text-encoder `keys`, resolved by `loading.lora`
    against `text_encoder`'s params (None: none resolved)."""
    clip = [k for k in keys if k.startswith(_CLIP_L)]
    if text_encoder is None or not clip:
        return {}, keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnmatchedLoraKeysWarning)  # warned below with the other skipped keys
        lora = sd_lora.resolve_lora(
            {k: tensors[k] for k in clip}, {"text_encoder": text_encoder}, source=source, metadata=metadata
        )
    return dict(lora.factors), [k for k in keys if k not in clip] + list(lora.unmatched)


def resolve_flux_lora(
    tensors: Mapping[str, Any],
    params: Mapping[str, Any],
    *,
    source: str,
    name: str | None = None,
    metadata: Mapping[str, str] | None = None,
    text_encoder: Mapping[str, Any] | None = None,
) -> Lora:
    """Match a LoRA state dict against a Flux transformer's params (arrays or ShapeDtypeStructs) -> `Lora` whose
    factors are keyed `("transformer", kernel path)` (and `("text_encoder", kernel path)` for CLIP-L's layers when
    its params `text_encoder` are given). Raises `LoraError` naming `source` for a file that does not fit; warns
    (`UnmatchedLoraKeysWarning`) about skipped text-encoder layers and unknown keys when others match."""
    keys = list(tensors)
    sd_lora.group_layers(keys, source=source)  # refuses LoHa, LoKr, DoRA, full diffs by loading.lora's rules
    adapter_meta: dict[str, Any] = {}
    if metadata and sd_lora.METADATA_KEY in metadata:
        try:
            adapter_meta = json.loads(metadata[sd_lora.METADATA_KEY])
        except ValueError as e:
            raise LoraError(f"{source}: unreadable {sd_lora.METADATA_KEY} metadata ({e})") from e
    model = _Model(params)
    layers: dict[tuple[str, str], dict[str, str]] = {}
    unknown: list[str] = []
    text_encoder_keys: list[str] = []
    for key in keys:
        split = _split_key(key)
        where = _classify(split[0]) if split else None
        if where is None:
            unknown.append(key)
        elif where[0] == "te":
            text_encoder_keys.append(key)
        else:
            layers.setdefault(where, {})[split[1]] = key
    factors: dict[tuple[str, tuple[str, ...]], LoraFactor] = {}
    unmatched = list(unknown)
    misfit: list[str] = []
    for (style, module), roles in layers.items():
        if "down" not in roles or "up" not in roles:
            raise LoraError(f"{source}: layer {module!r} lacks its down or up weight (has {sorted(roles.values())})")
        targets = model.targets(style, module)
        if targets is None:
            unmatched.extend(sorted(roles.values()))
            continue
        down = np.asarray(tensors[roles["down"]], np.float32)
        up = np.asarray(tensors[roles["up"]], np.float32)
        if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
            raise LoraError(
                f"{source}: {roles['down']} {down.shape} and {roles['up']} {up.shape} are not a LoRA pair of a "
                f"Linear (down (r, in), up (out, r))"
            )
        rank = down.shape[0]
        alpha_over_rank = _alpha_over_rank(tensors, roles, style, module, rank, adapter_meta)
        for path, rows in targets:
            kernel = model.shapes[path]
            try:
                part = take_rows(up, row_ranges(rows, up.shape[0], model.inner))
            except ValueError as e:
                misfit.append(f"{roles['up']}: {e}")
                continue
            if (down.shape[1], part.shape[0]) != kernel:
                misfit.append(
                    f"{roles['down']}: LoRA weight {(part.shape[0], down.shape[1])} vs {'/'.join(path)} {kernel}"
                )
                continue
            if (COMPONENT, path) in factors:
                first = factors[(COMPONENT, path)].name
                raise LoraError(f"{source}: two LoRA layers adapt {'/'.join(path)}: {first} and {roles['down']}")
            factors[(COMPONENT, path)] = LoraFactor(
                part, down, alpha_over_rank, (part.shape[0], down.shape[1]), roles["down"]
            )
    if misfit:
        shown = "; ".join(misfit[:5]) + (f"; ... and {len(misfit) - 5} more" if len(misfit) > 5 else "")
        raise LoraError(f"{source}: {len(misfit)} LoRA layer(s) do not fit this Flux transformer's shapes: {shown}")
    clip_factors, text_encoder = _clip_factors(tensors, text_encoder_keys, text_encoder, source, metadata)
    factors |= clip_factors
    if not factors:
        raise LoraError(
            f"{source}: no layer of this LoRA adapts the Flux transformer: it looks like {_looks_like(keys)}; "
            f"{len(keys)} keys such as {', '.join(keys[:4])}"
        )
    if text_encoder:
        warnings.warn(
            f"{source}: {len(text_encoder)} text-encoder LoRA key(s) are not applied (sdjax applies Flux LoRAs to "
            f"the transformer and CLIP-L), such as {', '.join(text_encoder[:3])}",
            UnmatchedLoraKeysWarning,
            stacklevel=2,
        )
    if unmatched:
        warnings.warn(
            f"{source}: {len(unmatched)} LoRA key(s) match no layer of this transformer and are skipped, such as "
            f"{', '.join(unmatched[:5])}",
            UnmatchedLoraKeysWarning,
            stacklevel=2,
        )
    skipped = tuple(sorted(unmatched + text_encoder))
    return Lora(name=name or Path(source).stem, source=str(source), factors=factors, unmatched=skipped)


def load_flux_lora(
    path: str | Path,
    params: Mapping[str, Any],
    *,
    name: str | None = None,
    text_encoder: Mapping[str, Any] | None = None,
) -> Lora:
    """Read a LoRA `.safetensors` file (any layout in the module docstring) for a Flux transformer's `params` (and
    CLIP-L's `text_encoder` params, for its layers)."""
    tensors, metadata = sd_lora.read_lora_file(path)
    return resolve_flux_lora(tensors, params, source=str(path), name=name, metadata=metadata, text_encoder=text_encoder)


def apply_loras(params: Mapping[str, Any], loras: Sequence[Lora], scales: Sequence[float]) -> dict[str, Any]:
    """The transformer's `params` with `sum_i scales[i] * delta_i` added to each kernel a LoRA touches -> new
    params (touched kernels in their own dtype and devices; every other leaf is `params`' own object). A scale may
    also be `(text encoder, transformer)` as elsewhere in sdjax; the transformer's value is used."""
    loras, scales = list(loras), list(scales)
    if len(loras) != len(scales):
        raise ValueError(f"apply_loras: {len(loras)} LoRAs but {len(scales)} scales")
    flat = flatten_dict(dict(params))
    for lora in loras:
        for component, path in lora.factors:
            if component != COMPONENT or path not in flat:
                raise LoraError(f"LoRA {lora.name!r} adapts {component} {'/'.join(path)}, which these params lack")
            dtype = np.dtype(flat[path].dtype)
            quantized = (*path[:-1], path[-1] + "_scale") in flat  # sdjax.quant: requantized after the sum
            if dtype.itemsize == 1 and not quantized:
                raise LoraError(
                    f"LoRA {lora.name!r}: {'/'.join(path)} is {dtype} (keep_fp8): adding the LoRA would round it to "
                    f"float8; load the transformer with keep_fp8=False"
                )
    fused = sd_lora.apply_loras({COMPONENT: params}, list(zip(loras, scales)))
    return fused[COMPONENT]
