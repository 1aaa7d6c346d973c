"""LoRA files (kohya / A1111 and diffusers / PEFT formats) -> low-rank weight deltas on sdjax's param trees.

A LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") stores, per adapted Linear or Conv
layer, a `down` matrix `(r, in[, kh, kw])` and an `up` matrix `(out, r[, 1, 1])`; the layer's weight becomes
`W + scale * alpha / r * up @ down` (for convolutions `down` is the conv of the original kernel size and `up` a 1x1
conv, so the product reshapes to `(out, in, kh, kw)`: kohya's "LoCon"). The formats read here:

- kohya / A1111 (`sd-scripts`, LyCORIS LoCon): `lora_unet_<module>.lora_down.weight` / `.lora_up.weight`, text
  encoders `lora_te_` (SDXL `lora_te1_`, `lora_te2_`); alpha in `<name>.alpha` (default r).
- PEFT, as diffusers saves it: `unet.<module>.lora_A.weight` / `.lora_B.weight`, `text_encoder.`,
  `text_encoder_2.`; alpha from the `lora_adapter_metadata` JSON in the file's metadata (`unet.lora_alpha`,
  `unet.alpha_pattern`, `unet.use_rslora`), else r (scale 1).
- older diffusers: `<module>.lora.down.weight` / `.lora.up.weight`, text encoders `.lora_linear_layer.down/up`,
  attention processors `attn1.processor.to_q_lora.down.weight` (the first files: UNet keys without `unet.`);
  alpha as PEFT.

Module names are matched against the params tree, not guessed from the file: sdjax names its Flax modules after
the PyTorch attributes (`models.convert`), so every kernel path has a dotted diffusers name
(`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q`) and kohya's underscore spelling of it
(`down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q`); the UNet also answers to the original LDM/SGM
names kohya uses for SDXL (`input_blocks_4_1_transformer_blocks_0_attn1_to_q`, from `loading.ldm_keys`), and a
text encoder to names with or without transformers' `text_model.` prefix.

LyCORIS LoHa (`hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`, optionally Tucker `hada_t1` / `hada_t2`) and
LoKr (`lokr_w1` or `lokr_w1_a` / `lokr_w1_b`, `lokr_w2` or `lokr_w2_a` / `lokr_w2_b`, optionally Tucker `lokr_t2`)
layers under kohya's names are read too (`loading.lycoris`: delta `(w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r` and
`kron(w1, w2) * alpha / r`, as A1111 and ComfyUI apply them): the file's factors are kept (`LycorisFactor`) and,
when applied, each layer's delta is built as an exact low-rank pair for its kernel alone, so LoHa / LoKr files are
fused, weighted and switched as LoRAs are; a file may mix LoRA, LoHa and LoKr layers.

Keys that match no layer are reported (count and examples) by a warning, or by an error when nothing matches; a
LoRA made for another base model fails by name: text-encoder-2 keys on a model with one text encoder, or a layer
whose shape differs. DoRA (`dora_scale`, `lora_magnitude_vector`, also on LoHa / LoKr layers), LoCon with a Tucker
core (`lora_mid`), LoHa / LoKr keys under diffusers / PEFT names or of other roles (`lokr_t1`), OFT, biases and
full-weight diffs are refused by name.

`apply_loras(params, [(lora, scale), ...])` returns params whose touched kernels are `base + sum of deltas` (float32
arithmetic, stored in the kernel's dtype) and whose other leaves are the base leaves themselves; nothing about the
params' structure, shapes or dtypes changes, so a compiled generation program runs them without recompiling.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from sdjax.loading import files, ldm_keys, lycoris
from sdjax.models.convert import path_to_torch_key
from sdjax.quant import params as quant_params

Path_ = tuple[str, ...]
Target = tuple[str, Path_]  # (component, path of a `kernel` leaf)

METADATA_KEY = "lora_adapter_metadata"  # diffusers' key in the safetensors `__metadata__`

# Key suffix -> which tensor of a layer it is. Longest first (".lora.down.weight" before ".down.weight").
_SUFFIXES = (
    (".lora_linear_layer.down.weight", "down"),
    (".lora_linear_layer.up.weight", "up"),
    (".lora.down.weight", "down"),
    (".lora.up.weight", "up"),
    (".lora_down.weight", "down"),
    (".lora_up.weight", "up"),
    (".lora_A.weight", "down"),
    (".lora_B.weight", "up"),
    (".alpha", "alpha"),
    (".down.weight", "down"),  # diffusers' attention-processor names: `attn1.processor.to_q_lora.down.weight`
    (".up.weight", "up"),
)
# LyCORIS kinds that `group_layers(..., lycoris_layers=False)` refuses (Flux's reader has no LoHa / LoKr).
_LYCORIS = tuple((re.compile(p), kind) for p, kind in ((r"\.hada_", "LoHa (hada_*)"), (r"\.lokr_", "LoKr (lokr_*)")))
# Adapter kinds sdjax does not apply: marker in the key -> what it is.
_UNSUPPORTED = tuple(
    (re.compile(pattern), kind)
    for pattern, kind in (
        (r"\.lora_mid\.", "LoCon with a Tucker core (lora_mid)"),
        (r"\.dora_scale$", "DoRA (dora_scale)"),
        (r"\.lora_magnitude_vector", "DoRA (lora_magnitude_vector)"),
        (r"\.lora_B\.bias$", "LoRA with a bias (lora_B.bias)"),
        (r"\.diff(_b)?$", "a full weight difference (.diff)"),
        (r"\.(oft_|bias_indices)", "OFT/BOFT"),
    )
)
# kohya module-name prefix / diffusers key prefix -> component.
_KOHYA_PREFIXES = (("lora_unet_", "unet"), ("lora_te1_", "text_encoder"), ("lora_te2_", "text_encoder_2"))
_KOHYA_TE = "lora_te_"
_DOTTED_PREFIXES = (("unet.", "unet"), ("text_encoder_2.", "text_encoder_2"), ("text_encoder.", "text_encoder"))
_UNET_TOP = frozenset({"down_blocks", "mid_block", "up_blocks", "conv_in", "conv_out", "time_embedding"})
# diffusers' attention-processor LoRA names (before PEFT) -> module names.
_OLD_UNET = {"to_q_lora": "to_q", "to_k_lora": "to_k", "to_v_lora": "to_v", "to_out_lora": "to_out.0"}
_OLD_TE = {"to_q_lora": "q_proj", "to_k_lora": "k_proj", "to_v_lora": "v_proj", "to_out_lora": "out_proj"}


class LoraError(ValueError):
    """A LoRA file that cannot be applied to this model (names the file and the offending keys)."""


class UnmatchedLoraKeysWarning(UserWarning):
    """Some layers of a LoRA file match no layer of the model; they are skipped."""


@dataclasses.dataclass(frozen=True)
class LoraFactor:
    """One adapted layer: `up (out, r)`, `down (r, in * kh * kw)` float32, `alpha_over_rank`, the PyTorch weight
    shape `(out, in[, kh, kw])` the product has, and the file's name of the layer (for messages)."""

    up: np.ndarray
    down: np.ndarray
    alpha_over_rank: float
    torch_shape: tuple[int, ...]
    name: str

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def pair(self) -> tuple[np.ndarray, np.ndarray]:
        """`(up, down)`: the delta before `alpha / r`."""
        return self.up, self.down

    def delta(self, kernel_shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        """`scale * alpha / r * up @ down` in the Flax layout of a kernel of `kernel_shape` (Dense `(in, out)`,
        Conv `(kh, kw, in, out)`), float32."""
        return _flax_delta(self, kernel_shape, scale)


@dataclasses.dataclass(frozen=True)
class LycorisFactor:
    """One LoHa / LoKr layer (`lycoris.Layer`: the file's factors, checked against the weight) and the file's name
    of the layer. Applied as a `LoraFactor` is: `pair()` builds the delta's exact low-rank pair (`up (out, R)`,
    `down (R, in * kh * kw)`) when the delta is applied, and it is not kept."""

    layer: lycoris.Layer
    name: str

    @property
    def alpha_over_rank(self) -> float:
        return self.layer.alpha_over_rank

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return self.layer.weight_shape

    def pair(self) -> tuple[np.ndarray, np.ndarray]:
        return self.layer.pair()

    def delta(self, kernel_shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        """As `LoraFactor.delta`."""
        return _flax_delta(self, kernel_shape, scale)


def _flax_delta(factor: LoraFactor | LycorisFactor, kernel_shape: tuple[int, ...], scale: float) -> np.ndarray:
    up, down = factor.pair()
    w = (np.float32(scale * factor.alpha_over_rank) * (up @ down)).reshape(factor.torch_shape)
    return to_flax_kernel(w, kernel_shape)


@dataclasses.dataclass(frozen=True)
class Lora:
    """A LoRA file resolved against one model: `factors` by (component, kernel path) (`LoraFactor`, or
    `LycorisFactor` for LoHa / LoKr layers)."""

    name: str
    source: str
    factors: Mapping[Target, LoraFactor | LycorisFactor]
    unmatched: tuple[str, ...] = ()

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(sorted({c for c, _ in self.factors}))


def to_flax_kernel(w: np.ndarray, kernel_shape: tuple[int, ...]) -> np.ndarray:
    """A PyTorch-layout weight `(out, in)` or `(out, in, kh, kw)` as a Flax kernel of `kernel_shape`; a 1x1 conv and
    a Linear take each other's weights. Raises ValueError when the sizes do not fit."""
    kernel_shape = tuple(kernel_shape)
    out, inn = w.shape[:2]
    spatial = tuple(w.shape[2:])
    if len(kernel_shape) == 2 and spatial in ((), (1, 1)) and kernel_shape == (inn, out):
        return w.reshape(out, inn).T
    fits_conv = spatial == kernel_shape[:2] or (spatial == () and kernel_shape[:2] == (1, 1))
    if len(kernel_shape) == 4 and kernel_shape[2:] == (inn, out) and fits_conv:
        return w.reshape(out, inn, *kernel_shape[:2]).transpose(2, 3, 1, 0)
    raise ValueError(f"a weight of PyTorch shape {tuple(w.shape)} does not fit a Flax kernel of shape {kernel_shape}")


# ------------------------------------------------------------------------------------------------ reading files
def read_lora_file(path: str | Path) -> tuple[Mapping[str, np.ndarray], dict[str, str]]:
    """`(tensors, __metadata__)` of a LoRA `.safetensors` file (read lazily, any dtype)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise LoraError(f"{path}: LoRA files are read from .safetensors only (got {path.suffix or 'no suffix'})")
    reader = files.read_safetensors(path)
    return reader, dict(reader.metadata.get(path.name, {}))


def resolve_lora_path(path_or_name: str | Path, search_dirs: Sequence[str | Path] = ()) -> Path:
    """A LoRA file from a path, a folder holding one (diffusers' `pytorch_lora_weights.safetensors`, or the only
    `.safetensors` in it), or a bare name looked up as `<dir>/<name>.safetensors` in `search_dirs`."""
    p = Path(path_or_name).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        preferred = p / "pytorch_lora_weights.safetensors"
        if preferred.is_file():
            return preferred
        found = sorted(p.glob("*.safetensors"))
        if len(found) == 1:
            return found[0]
        raise LoraError(
            f"{p}: a LoRA folder must hold pytorch_lora_weights.safetensors or exactly one .safetensors file "
            f"(found {[f.name for f in found] or 'none'})"
        )
    for d in search_dirs:
        for candidate in (Path(d) / f"{path_or_name}.safetensors", Path(d) / str(path_or_name)):
            if candidate.is_file():
                return candidate
    where = f" or in {[str(d) for d in search_dirs]}" if search_dirs else ""
    raise LoraError(f"LoRA {str(path_or_name)!r} not found (no such file or folder{where})")


# ------------------------------------------------------------------------------------------------ key grouping
@dataclasses.dataclass
class _Layer:
    component: str
    style: str  # "kohya" (underscore names) or "dotted" (diffusers / PEFT module names)
    module: str  # the name relative to the component
    keys: dict[str, str] = dataclasses.field(default_factory=dict)  # role ("down", "up", "alpha") -> file key


def _split_key(key: str, lycoris_roles: bool = False) -> tuple[str, str] | None:
    for suffix, role in _SUFFIXES + (lycoris.SUFFIXES if lycoris_roles else ()):
        if key.endswith(suffix):
            module = key[: -len(suffix)]
            if suffix in (".down.weight", ".up.weight") and not module.endswith("_lora"):
                return None
            return module, role
    return None


def _classify(module_key: str) -> tuple[str, str, str] | None:
    """`(component, style, module name)` of a layer's key without its suffix, or None."""
    if module_key.startswith(_KOHYA_TE):
        return "text_encoder", "kohya", module_key[len(_KOHYA_TE) :]
    for prefix, component in _KOHYA_PREFIXES:
        if module_key.startswith(prefix):
            return component, "kohya", module_key[len(prefix) :]
    for prefix, component in _DOTTED_PREFIXES:
        if module_key.startswith(prefix):
            return component, "dotted", _normalize_dotted(module_key[len(prefix) :], component)
    if module_key.split(".", 1)[0] in _UNET_TOP:  # the first diffusers LoRA files: UNet keys without a prefix
        return "unet", "dotted", _normalize_dotted(module_key, "unet")
    return None


def _normalize_dotted(name: str, component: str) -> str:
    """diffusers' attention-processor spellings (`attn1.processor.to_q_lora`) -> module names (`attn1.to_q`)."""
    parts = [p for p in name.split(".") if p != "processor"]
    table = _OLD_UNET if component == "unet" else _OLD_TE
    if parts and parts[-1] in table:
        parts[-1] = table[parts[-1]]
    return ".".join(parts)


def group_layers(
    keys: Sequence[str], *, source: str, lycoris_layers: bool = False
) -> tuple[dict[tuple[str, str, str], _Layer], list[str]]:
    """Group a file's keys into layers `(component, style, module)` -> `_Layer`; returns the keys that fit no
    known layout. Refuses adapter kinds sdjax does not apply; LyCORIS LoHa / LoKr layers (kohya names only) are
    grouped with `lycoris_layers` (their roles: `lycoris.LOHA_ROLES`, `LOKR_ROLES`), refused without it."""
    layers: dict[tuple[str, str, str], _Layer] = {}
    unknown: list[str] = []
    only = "only LoRA / LoCon, LoHa, LoKr" if lycoris_layers else "only LoRA / LoCon"
    for key in keys:
        for marker, kind in _UNSUPPORTED + (() if lycoris_layers else _LYCORIS):
            if marker.search(key):
                raise LoraError(f"{source}: {kind} adapters are not supported (key {key!r}); {only}")
        split = _split_key(key, lycoris_layers)
        where = _classify(split[0]) if split else None
        if lycoris_layers and lycoris.MARKER.search(key):
            if split is None:
                raise LoraError(f"{source}: a LoHa / LoKr key of a kind sdjax does not apply (key {key!r}); {only}")
            if where is None or where[1] != "kohya":
                raise LoraError(
                    f"{source}: LoHa / LoKr layers are read under kohya / LyCORIS names (lora_unet_*, lora_te_*), "
                    f"not under diffusers / PEFT names (key {key!r})"
                )
        if where is None:
            unknown.append(key)
            continue
        layer = layers.setdefault(where, _Layer(*where))
        layer.keys[split[1]] = key
    return layers, unknown


# ------------------------------------------------------------------------------------------------ the name index
def _unet_ldm_name(path: Path_, unet_config: Any) -> str | None:
    try:
        src = ldm_keys.unet_source(path_to_torch_key(path), unet_config)
    except (KeyError, ValueError):
        return None
    return src.key.removesuffix(".weight")


def name_index(component: str, params: Mapping[str, Any], unet_config: Any = None) -> dict[tuple[str, str], Path_]:
    """`(style, module name)` -> kernel path, for every `kernel` leaf of one component's params."""
    index: dict[tuple[str, str], Path_] = {}
    for path in flatten_dict(dict(params)):
        if path[-1] != "kernel":
            continue
        dotted = path_to_torch_key(path).removesuffix(".weight")
        names = {("dotted", dotted), ("kohya", "_".join(path[:-1]))}
        if component == "unet" and unet_config is not None:
            ldm = _unet_ldm_name(path, unet_config)
            if ldm is not None:
                names.add(("kohya", ldm.replace(".", "_")))
        if path[0] == "text_model":  # transformers 5 saves CLIPTextModel without its `text_model.` prefix
            names.add(("dotted", dotted.removeprefix("text_model.")))
        for name in names:
            index[name] = path
    return index


def _peft_alpha(metadata: Mapping[str, Any], component: str, module: str, rank: int) -> float | None:
    """alpha / r (or alpha / sqrt(r) under rsLoRA) from diffusers' LoRA metadata, None without it."""
    config = {k[len(component) + 1 :]: v for k, v in metadata.items() if k.startswith(component + ".")}
    if "lora_alpha" not in config:
        return None
    alpha = float(config["lora_alpha"])
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = float(value)
            break
    return alpha / (np.sqrt(rank) if config.get("use_rslora") else rank)


# ------------------------------------------------------------------------------------------------ resolving
def resolve_lora(
    tensors: Mapping[str, np.ndarray],
    params: Mapping[str, Any],
    *,
    source: str,
    name: str | None = None,
    metadata: Mapping[str, str] | None = None,
    unet_config: Any = None,
) -> Lora:
    """Match a LoRA state dict against `params` (`{component: params tree}`; arrays or ShapeDtypeStructs) ->
    `Lora`. Raises `LoraError` naming `source` when the file does not fit the model; warns
    (`UnmatchedLoraKeysWarning`) about keys that match no layer when others do."""
    adapter_meta: dict[str, Any] = {}
    if metadata and METADATA_KEY in metadata:
        try:
            adapter_meta = json.loads(metadata[METADATA_KEY])
        except ValueError as e:
            raise LoraError(f"{source}: unreadable {METADATA_KEY} metadata ({e})") from e
    layers, unknown = group_layers(list(tensors), source=source, lycoris_layers=True)
    if not layers:
        shown = ", ".join(unknown[:5])
        raise LoraError(
            f"{source}: not a LoRA file sdjax can read: no key has a LoRA layout (kohya `lora_unet_*.lora_down.weight`"
            f", LyCORIS `lora_unet_*.hada_w1_a` / `.lokr_w1`, diffusers/PEFT `unet.*.lora_A.weight`); {len(unknown)} "
            f"keys such as {shown}"
        )
    absent = sorted({c for c, _, _ in layers if c not in params})
    if absent:
        examples = [next(iter(layer.keys.values())) for layer in layers.values() if layer.component in absent][:3]
        raise LoraError(
            f"{source}: the LoRA adapts {', '.join(absent)}, which this model does not have (components: "
            f"{', '.join(sorted(params))}); it was made for another base model (e.g. an SDXL LoRA on SD 1.x/2.x). "
            f"Keys such as {', '.join(examples)}"
        )
    indexes = {
        c: name_index(c, params[c], unet_config if c == "unet" else None) for c in sorted({c for c, _, _ in layers})
    }
    shapes = {c: {p: tuple(v.shape) for p, v in flatten_dict(dict(params[c])).items()} for c in indexes}
    factors: dict[Target, LoraFactor] = {}
    unmatched = list(unknown)
    misfit: list[str] = []
    for (component, style, module), layer in layers.items():
        kind = _layer_kind(layer, source)
        path = indexes[component].get((style, module))
        if path is None:
            unmatched.extend(sorted(layer.keys.values()))
            continue
        kernel_shape = shapes[component][path]
        try:
            if kind is None:
                factor = _lora_factor(tensors, layer, kernel_shape, adapter_meta, source)
            else:
                factor = _lycoris_factor(tensors, layer, kind, kernel_shape, source)
        except _Misfit as e:
            misfit.append(f"{e} vs model {'/'.join((component,) + path)} {kernel_shape}")
            continue
        if (component, path) in factors:
            raise LoraError(
                f"{source}: two LoRA layers adapt {component} {'/'.join(path)}: {factors[(component, path)].name} "
                f"and {factor.name}"
            )
        factors[(component, path)] = factor
    if misfit:
        shown = "; ".join(misfit[:5]) + (f"; ... and {len(misfit) - 5} more" if len(misfit) > 5 else "")
        raise LoraError(
            f"{source}: {len(misfit)} LoRA layer(s) do not fit this model's shapes -- the LoRA was made for "
            f"another base model: {shown}"
        )
    if not factors:
        raise LoraError(
            f"{source}: none of the {len(layers)} LoRA layers matches a layer of this model; "
            f"{len(unmatched)} keys such as {', '.join(unmatched[:5])}"
        )
    if unmatched:
        warnings.warn(
            f"{source}: {len(unmatched)} LoRA key(s) match no layer of this model and are skipped, such as "
            f"{', '.join(unmatched[:5])}",
            UnmatchedLoraKeysWarning,
            stacklevel=2,
        )
    return Lora(name=name or Path(source).stem, source=str(source), factors=factors, unmatched=tuple(sorted(unmatched)))


class _Misfit(Exception):
    """A layer whose weight shape differs from the model's (the message names the layer and its shape)."""


def _layer_kind(layer: _Layer, source: str) -> str | None:
    """None for a LoRA layer, "LoHa" / "LoKr" for a LyCORIS one; LoraError for a layer of no one kind or a LoRA
    layer without its down or up weight."""
    where = f"layer {layer.module!r} of {layer.component}"
    try:
        kind = lycoris.kind(layer.keys)
    except lycoris.LayerError as e:
        raise LoraError(f"{source}: {where} {e}") from None
    if kind is not None and ("down" in layer.keys or "up" in layer.keys):
        have = ", ".join(sorted(layer.keys.values()))
        raise LoraError(f"{source}: {where} has both LoRA (down / up) and {kind} tensors ({have})")
    if kind is None and ("down" not in layer.keys or "up" not in layer.keys):
        have = ", ".join(sorted(layer.keys.values()))
        raise LoraError(f"{source}: {where} lacks its down or up weight (has {have})")
    return kind


def _lora_factor(tensors, layer: _Layer, kernel_shape, adapter_meta: Mapping[str, Any], source: str) -> LoraFactor:
    """A LoRA layer's `LoraFactor`; `_Misfit` when its weight shape does not fit `kernel_shape`."""
    down = np.asarray(tensors[layer.keys["down"]], np.float32)
    up = np.asarray(tensors[layer.keys["up"]], np.float32)
    rank = down.shape[0]
    if down.ndim not in (2, 4) or up.ndim not in (2, 4) or up.shape[1] != rank or up.shape[2:] not in ((), (1, 1)):
        raise LoraError(
            f"{source}: {layer.keys['down']} {tuple(down.shape)} and {layer.keys['up']} {tuple(up.shape)} "
            f"are not a LoRA pair (down (r, in[, kh, kw]), up (out, r[, 1, 1]))"
        )
    if "alpha" in layer.keys:
        alpha_over_rank = float(np.asarray(tensors[layer.keys["alpha"]], np.float32).reshape(())) / rank
    else:
        peft = _peft_alpha(adapter_meta, layer.component, layer.module, rank)
        alpha_over_rank = 1.0 if peft is None else peft
    torch_shape = (up.shape[0],) + tuple(down.shape[1:])
    try:
        to_flax_kernel(np.zeros(torch_shape, np.float32), kernel_shape)
    except ValueError:
        raise _Misfit(f"{layer.keys['down']}: LoRA weight {torch_shape}") from None
    return LoraFactor(
        up=up.reshape(up.shape[0], rank),
        down=down.reshape(rank, -1),
        alpha_over_rank=alpha_over_rank,
        torch_shape=torch_shape,
        name=layer.keys["down"],
    )


def _lycoris_factor(tensors, layer: _Layer, kind: str, kernel_shape, source: str) -> LycorisFactor:
    """A LoHa / LoKr layer on a kernel of `kernel_shape` (`lycoris.read_layer`); `_Misfit` when its delta's size
    differs from the kernel's."""
    name = next(layer.keys[r] for r in lycoris.LOHA_ROLES + lycoris.LOKR_ROLES if r in layer.keys)
    try:
        return LycorisFactor(lycoris.read_layer(tensors, layer.keys, lycoris.torch_shape(kernel_shape)), name)
    except lycoris.Misfit as e:
        raise _Misfit(f"{name}: {kind} {e}") from None
    except lycoris.LayerError as e:
        raise LoraError(f"{source}: {kind} layer {layer.module!r} of {layer.component} {e}") from None


def load_lora(path: str | Path, params: Mapping[str, Any], *, name: str | None = None, unet_config: Any = None) -> Lora:
    """Read a LoRA `.safetensors` file and resolve it against `params` (`{component: params tree}`)."""
    tensors, metadata = read_lora_file(path)
    return resolve_lora(tensors, params, source=str(path), name=name, metadata=metadata, unet_config=unet_config)


# ------------------------------------------------------------------------------------------------ applying
def _rank_bucket(rank: int) -> int:
    """Ranks are zero-padded to a power of two (at least 8), so LoRAs of other ranks reuse one compiled fuse."""
    return max(8, 1 << (rank - 1).bit_length())


def _host_delta(w: np.ndarray, kernel_shape: tuple[int, ...]) -> np.ndarray:
    """`w (out, in * kh * kw)` as a Flax kernel of `kernel_shape`."""
    if len(kernel_shape) == 2:
        return w.T
    kh, kw, cin, cout = kernel_shape
    return w.reshape(cout, cin, kh, kw).transpose(2, 3, 1, 0)


@jax.jit
def _fuse(base, up, down):
    """`base + up @ down` in float32, in `base`'s layout and dtype: `up (out, R)`, `down (R, in * kh * kw)` in
    PyTorch order (the scales are folded into `up`)."""
    w = jnp.matmul(up, down, precision=jax.lax.Precision.HIGHEST)
    if base.ndim == 2:
        delta = w.T
    else:
        kh, kw, cin, cout = base.shape
        delta = w.reshape(cout, cin, kh, kw).transpose(2, 3, 1, 0)
    return (base.astype(jnp.float32) + delta).astype(base.dtype)


# A LoRA's scale: one number, or (text encoders, UNet) as AUTOMATIC1111's <lora:name:te:unet>.
Scale = float | tuple[float, float]


def check_scale(name: str, scale: Any) -> Scale:
    """A LoRA scale as applied: one finite number for every component, or a pair `(text encoders, UNet)` (A1111's
    `<lora:name:te:unet>`). Raises TypeError/ValueError naming the LoRA."""
    values = scale if isinstance(scale, tuple) else (scale,)
    if len(values) not in (1, 2) or any(
        isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) for v in values
    ):
        raise TypeError(f"LoRA {name!r}: scale must be a number or a (text encoder, UNet) pair, got {scale!r}")
    if not all(np.isfinite(v) for v in values):
        raise ValueError(f"LoRA {name!r}: scale={scale!r} must be finite")
    return (float(values[0]), float(values[1])) if len(values) == 2 else float(values[0])


def component_scale(scale: Scale, component: str) -> float:
    """The scale a LoRA gets in `component`: a pair's first value for the text encoders, its second for the UNet."""
    if isinstance(scale, tuple):
        return scale[0] if component.startswith("text_encoder") else scale[1]
    return scale


def stacked_factors(loras: Sequence[tuple[Lora, Scale]]) -> Iterator[tuple[Target, tuple[np.ndarray, np.ndarray]]]:
    """Per touched kernel, the weighted LoRAs as one low-rank pair `(up (out, R), down (R, K))` float32 whose product
    is the summed delta in PyTorch layout: the factors side by side, each `up` times `scale * alpha / r`, R padded
    with zeros (`_rank_bucket`). A scale of 0 (in a component) touches nothing (there). Yielded one kernel at a
    time: a LoHa / LoKr layer's pair is built for its kernel only."""
    parts: dict[Target, list[tuple[LoraFactor | LycorisFactor, float]]] = {}
    for lora, scale in loras:
        for target, f in lora.factors.items():
            s = component_scale(scale, target[0])
            if s != 0:
                parts.setdefault(target, []).append((f, s))
    for target, weighted in parts.items():
        pairs = [f.pair() for f, _ in weighted]
        up = np.concatenate([u * np.float32(s * f.alpha_over_rank) for (u, _), (f, s) in zip(pairs, weighted)], axis=1)
        down = np.concatenate([d for _, d in pairs], axis=0)
        del pairs
        pad = _rank_bucket(up.shape[1]) - up.shape[1]
        yield target, (np.pad(up, ((0, 0), (0, pad))), np.pad(down, ((0, pad), (0, 0))))


def apply_loras(params: Mapping[str, Any], loras: Sequence[tuple[Lora, Scale]]) -> dict[str, Any]:
    """`params` with the weighted LoRAs added to the kernels they touch -> a new dict. A scale is a number, or a pair
    `(text encoders, UNet)` (`check_scale`). Untouched leaves (and, when
    `loras` is empty or all scales are 0, every leaf) are `params`' own objects; a touched kernel is computed in
    float32 and stored in its own dtype, on its own device(s). Only the low-rank factors travel to the device; the
    product and the sum run there (`_fuse`, compiled once per kernel shape and rank bucket, never per scale)."""
    loras = [(lora, check_scale(lora.name, scale)) for lora, scale in loras]
    for lora, _ in loras:
        missing = sorted({c for c, _ in lora.factors if c not in params})
        if missing:
            raise LoraError(f"LoRA {lora.name!r} adapts {missing}, which params does not have")
    out = dict(params)
    copied: set[tuple[str, ...]] = set()
    for (component, path), (up, down) in stacked_factors(loras):
        node_path = (component,) + path[:-1]
        parent = out
        for depth in range(len(node_path)):  # copy each dict on the way down once, so `params` is never mutated
            prefix = node_path[: depth + 1]
            if prefix not in copied:
                parent[prefix[-1]] = dict(parent[prefix[-1]])
                copied.add(prefix)
            parent = parent[prefix[-1]]
        base = parent[path[-1]]
        scale = parent.get(path[-1] + quant_params.SCALE_SUFFIX)
        if scale is not None:  # a quantized kernel (sdjax.quant): dequantized, the delta added in float32, requantized
            parent[path[-1]], parent[path[-1] + quant_params.SCALE_SUFFIX] = quant_params.fuse_delta(
                base, scale, _fuse, up, down
            )
        elif isinstance(base, jax.Array):
            parent[path[-1]] = _fuse(base, up, down)
        else:
            host = np.asarray(base)
            parent[path[-1]] = (host.astype(np.float32) + _host_delta(up @ down, host.shape)).astype(host.dtype)
    return out


def _leaf(params: Mapping[str, Any], target: Target):
    component, path = target
    node = params[component]
    for p in path:
        node = node[p]
    return node
