"""Single-file checkpoints ("bring your own weights"): one original Stability/LDM-layout file -> pipeline components.

The files users download from civitai or Stability (`v1-5-pruned-emaonly.safetensors`, `sd_xl_base_1.0.safetensors`,
fine-tunes and merges of them) hold a whole pipeline in the layout of the original training code, not diffusers'.
`load_single_file` turns one into exactly what `components.load_pipeline_components` returns for a diffusers
folder, `(components, params, model_index)`, so the same pipeline classes run either; it mirrors diffusers'
`StableDiffusionPipeline.from_single_file` / `StableDiffusionXLPipeline.from_single_file` without torch:

1. Read (`ldm_checkpoint.open_checkpoint`). safetensors through `files.read_safetensors` (header checked against
   the file size first, then one tensor per lookup, so peak memory stays near one copy of the weights plus the
   params). PyTorch pickles (`.ckpt`, `.pt`, `.pth`, `.bin`) are refused unless `allow_pickle=True`, and then read
   by `safe_pickle.read_torch_checkpoint`, which can execute no code.
2. Infer the architecture from the keys and shapes alone (`ldm_checkpoint.infer_architecture`, the rules of
   diffusers' `infer_diffusers_model_type` restated on the text encoders the file holds): SD 1.x, SD 2.x, SDXL
   base, SDXL refiner, and the 9-channel inpainting variants of SD 1.x, SD 2.x and SDXL.
3. Configs. `model_index.json`, each model's `config.json`, the scheduler and tokenizer settings come from the
   embedded config sets (`assets/configs/<set>/`, copies of the released repositories' files, see the README
   there), or from `config=` (a diffusers folder or Hub repo, as diffusers' `from_single_file(config=...)`; the
   way to load a model whose shapes are not the released ones). SD 2.x has two released configs with identical
   weights shapes: 768-px v-prediction (`sd21`, diffusers' default) and 512-px epsilon (`sd21-base`). The choice:
   `prediction_type=` if given, else the file's `modelspec.prediction_type` / `modelspec.architecture` metadata,
   a `v_pred` marker tensor, the training step 875000 of Stability's `512-base-ema.ckpt` (diffusers' rule), and
   last the default (v-prediction for SD 2.x, epsilon for the others). `prediction_type=` also overrides the
   scheduler of any other family.
4. Convert each model through `ldm_keys` (original key of every diffusers key, derived from the config) and the
   model's own converter (`convert_unet`, `convert_vae`, `convert_clip_text`), casting each tensor to `dtype` as
   it is converted. Every missing, mis-shaped or unexpected tensor under a component's prefix is reported by its
   original name; tensors outside the components (the DDPM schedule buffers `betas`, `alphas_cumprod`, ..., EMA
   copies that are not used) are ignored.

EMA weights: files that keep both (`model_ema.*` beside `model.diffusion_model.*`, e.g. `v1-5-pruned.ckpt`) load
the non-EMA UNet by default, as diffusers does (`extract_ema=False` is its default too); `extract_ema=True` takes the
EMA copy. Most distributed files (`*-emaonly`, `*-ema-pruned`, civitai) hold only one set. The safety checker is
not part of a single file and is left out, as diffusers' `from_single_file` does.

`load_vae` loads a replacement VAE (a diffusers VAE folder or repo, or one file in the original or the diffusers
layout), `convert_to_diffusers` writes a single file out as a diffusers folder that sdjax and diffusers both load.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from sdjax.config import read_json
from sdjax.loading import components as comp
from sdjax.loading import files, ldm_keys
from sdjax.loading.files import CheckpointError as CheckpointError
from sdjax.loading.files import MissingWeightsError
from sdjax.loading.ldm_checkpoint import (
    ARCHITECTURES,
    DENOISER,
    Checkpoint,
    UnknownArchitectureError,
    _has_prefix,
    _PrefixView,
    component_layout,
    config_set_for,
    infer_architecture,
    key_families,
    open_checkpoint,
    prediction_hint,
)
from sdjax.loading.ldm_checkpoint import PICKLE_SUFFIXES as PICKLE_SUFFIXES
from sdjax.loading.ldm_checkpoint import SD2_BASE_GLOBAL_STEP as SD2_BASE_GLOBAL_STEP
from sdjax.loading.ldm_checkpoint import PickleRefusedError as PickleRefusedError
from sdjax.models.convert import WeightLoadError

logger = logging.getLogger(__name__)

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "assets" / "configs"
CLIP_VOCAB_DIR = Path(__file__).resolve().parents[1] / "assets" / "clip_tokenizer"
# Embedded config sets (folder names under `assets/configs`).
CONFIG_SETS = (
    "sd15",
    "sd15-inpainting",
    "sd21",
    "sd21-base",
    "sd2-inpainting",
    "sdxl-base",
    "sdxl-refiner",
    "sdxl-inpainting",
)
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
# Components a single file never holds; diffusers' `from_single_file` leaves them out too.
NOT_IN_FILE = frozenset({"safety_checker", "feature_extractor", "image_encoder"})


# ---------------------------------------------------------------------------------------------------- conversion


def _torch_shapes(model_cls: Any, config: Any) -> dict[str, tuple[int, ...]]:
    """diffusers/transformers state-dict key -> PyTorch shape, for the sdjax model built from `config`."""
    from flax.traverse_util import flatten_dict

    from sdjax.models.convert import path_to_torch_key

    out = {}
    for path, leaf in flatten_dict(dict(model_cls.init_params_shape(config))).items():
        shape = tuple(leaf.shape)
        if path[-1] == "kernel":
            shape = shape[::-1] if len(shape) == 2 else (shape[3], shape[2], shape[0], shape[1])
        out[path_to_torch_key(path)] = shape
    return out


@dataclasses.dataclass(frozen=True)
class ComponentTable:
    """How one model component is read from an original-layout file: diffusers key -> (file key, `Source`), the
    diffusers shapes, and which other keys under `prefix` the file may hold unused."""

    name: str
    prefix: str
    sources: dict[str, tuple[str, ldm_keys.Source]]
    shapes: dict[str, tuple[int, ...]]
    ignored: tuple[re.Pattern, ...]
    region: tuple[str, ...]  # prefixes whose keys must all be used or ignored


def component_table(
    name: str, kind: str, prefix: str, model_cls: Any, config: Any, *, extract_ema: bool = False
) -> ComponentTable:
    """The `ComponentTable` of component `name` (`kind` and `prefix` from `component_layout`)."""
    shapes = _torch_shapes(model_cls, config)
    source_of = ldm_keys.SOURCES[kind]
    sources = {}
    for key in shapes:
        try:
            src = source_of(key, config)
        except KeyError:
            raise WeightLoadError(name, [], [f"{key} (sdjax has no original-layout name for it)"], []) from None
        full = ldm_keys.ema_key(src.key) if extract_ema else prefix + src.key
        sources[key] = (full, src)
    ignored = list(ldm_keys.IGNORED[kind])
    region: tuple[str, ...] = (prefix,)
    if kind == "openclip":
        if "text_projection.weight" not in shapes:  # SD 2's CLIPTextModel has no projection; the file keeps it
            ignored.append(re.compile(r"text_projection"))
        if prefix == ldm_keys.SD2_OPENCLIP_PREFIX:  # SD 2 conditions on the penultimate layer: the last one is unused
            ignored.append(re.compile(rf"transformer\.resblocks\.{config.num_hidden_layers}\..*"))
    if extract_ema:
        region = (ldm_keys.EMA_PREFIX,)
        ignored += [re.compile(r"decay"), re.compile(r"num_updates")]
    return ComponentTable(name, prefix, sources, shapes, tuple(ignored), region)


def check_component(table: ComponentTable, shapes: Mapping[str, Any], *, source: str) -> None:
    """Every tensor the component needs is in `shapes` with a fitting shape, and every key in its region is used
    or known to be unused; else `WeightLoadError` naming the original keys."""
    missing, misshaped, used = [], [], set()
    for key, (full, src) in table.sources.items():
        used.add(full)
        if full not in shapes:
            missing.append(f"{full} (diffusers {key})")
            continue
        allowed = src.ldm_shapes(table.shapes[key])
        if tuple(shapes[full]) not in allowed:
            misshaped.append(
                f"{full}: file {tuple(shapes[full])} vs model {allowed[0]} (diffusers {key} {table.shapes[key]})"
            )
    unexpected = []
    for k in shapes:
        region = next((p for p in table.region if k.startswith(p)), None)
        if region is None or k in used:
            continue
        if not any(p.fullmatch(k[len(region) :]) for p in table.ignored):
            unexpected.append(k)
    if missing or misshaped or unexpected:
        raise WeightLoadError(f"{table.name} ({source})", sorted(set(missing)), sorted(unexpected), misshaped)


class _TableView(Mapping[str, np.ndarray]):
    """diffusers key -> tensor, read from the checkpoint through a `ComponentTable` (in file-key order, so the
    three q/k/v slices of one fused OpenCLIP tensor read it once: a one-entry cache)."""

    def __init__(self, ckpt: Mapping[str, np.ndarray], table: ComponentTable):
        self._ckpt, self._table = ckpt, table
        self._order = sorted(table.sources, key=lambda k: (table.sources[k][0], k))
        self._cached: tuple[str, np.ndarray] | None = None

    def __getitem__(self, key: str) -> np.ndarray:
        full, src = self._table.sources[key]
        if self._cached is None or self._cached[0] != full:
            self._cached = (full, np.asarray(self._ckpt[full]))
        return src.apply(self._cached[1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


def load_component(
    ckpt: Checkpoint,
    name: str,
    spec: comp.ModelSpec,
    config: Any,
    kind: str,
    prefix: str,
    *,
    dtype: Any,
    extract_ema: bool = False,
    quantize: Any = None,
) -> tuple[Any, dict]:
    """One model of an original-layout checkpoint -> `(module, params)` (tensors cast to `dtype` one by one).
    `quantize` (a `sdjax.quant.QuantPolicy` or None): the kernels it selects in the params of `name` are quantized
    as they are converted, as for a folder (`components.model_from_state_dict`)."""
    import importlib

    model_cls = getattr(importlib.import_module(spec.module), spec.model)
    table = component_table(name, kind, prefix, model_cls, config, extract_ema=extract_ema)
    check_component(table, ckpt.shapes(), source=str(ckpt.path))
    return comp.model_from_state_dict(
        spec,
        config,
        _TableView(ckpt, table),
        dtype=dtype,
        component=f"{name} ({ckpt.path})",
        quantize=quantize,
        params_key=name,
    )


# ---------------------------------------------------------------------------------------------------- tokenizers


_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer_folder(folder: Path):
    """A tokenizer folder; an embedded JSON-only one (no `vocab.json`) takes sdjax's shared CLIP vocabulary and
    merges with its own special tokens and length (`special_tokens_map.json` over `tokenizer_config.json`, the
    precedence transformers applies)."""
    from sdjax.text.tokenizer import CLIPTokenizer

    if (folder / "vocab.json").is_file() or (folder / "tokenizer.json").is_file():
        return CLIPTokenizer.from_folder(folder)
    config = read_json(folder / "tokenizer_config.json")
    specials = {k: config[k] for k in _SPECIAL_NAMES if config.get(k) is not None}
    if (folder / "special_tokens_map.json").is_file():
        stm = read_json(folder / "special_tokens_map.json")
        specials.update({k: stm[k] for k in _SPECIAL_NAMES if stm.get(k) is not None})
    return CLIPTokenizer.from_files(
        CLIP_VOCAB_DIR / "vocab.json",
        CLIP_VOCAB_DIR / "merges.txt",
        special_tokens=specials,
        model_max_length=int(config.get("model_max_length", 77)),
    )


# ---------------------------------------------------------------------------------------------------- loading


@dataclasses.dataclass
class SingleFileLoad:
    """Everything `load_single_file` learned: the returned triple plus where each part came from."""

    components: dict[str, Any]
    params: dict[str, Any]
    model_index: dict[str, Any]
    architecture: str
    config_dir: Path
    prediction_type: str
    configs: dict[str, dict[str, Any]]  # component -> the raw config.json / scheduler_config.json used


def _config_dir(config: Any, architecture: str, prediction: str | None, **hub: Any) -> Path:
    if config is None:
        return CONFIGS_DIR / config_set_for(architecture, prediction)
    if isinstance(config, str) and config in CONFIG_SETS and not Path(config).is_dir():
        return CONFIGS_DIR / config
    return files.resolve_config_dir(config, **hub)


def _load(
    path: str | os.PathLike,
    *,
    dtype: Any,
    prediction_type: str | None,
    config: Any,
    vae: Any,
    extract_ema: bool,
    allow_pickle: bool,
    overrides: Mapping[str, Any] | None,
    quantize: Any = None,
    **hub: Any,
) -> SingleFileLoad:
    from sdjax.quant import check_quantize

    check_quantize(quantize)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if prediction_type is not None and prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type={prediction_type!r}: expected one of {PREDICTION_TYPES} or None")
    overrides = dict(overrides or {})
    if vae is not None:
        if "vae" in overrides:
            raise ValueError("pass the replacement VAE either as vae= or as overrides['vae'], not both")
        overrides["vae"] = None  # not read from the file; loaded below
    with open_checkpoint(path, allow_pickle=allow_pickle) as ckpt:
        return _load_checkpoint(ckpt, dtype, prediction_type, config, vae, extract_ema, overrides, hub, quantize)


def _load_time_policy(quantize: Any, loads: list[str], source: str):
    """`quantize=` as the `QuantPolicy` applied while converting: `"int8"` / `"fp8"` over the denoiser's params
    (`DENOISER`, the UNet of every original-layout file), a policy as it is. A policy naming a component that the
    pipeline will not have (`loads`: its model components, less those left out) is refused before any weight is read.
    A component replaced by an object (`vae=`) is not converted here; `quantize_pipeline` quantizes it afterwards."""
    from sdjax.quant import resolve_policy

    policy = resolve_policy(quantize, DENOISER)
    absent = [] if policy is None else [c for c in policy.components if c not in loads]
    if absent:
        raise ValueError(
            f"quantize: the QuantPolicy names components {absent}, which the pipeline of {source} does not have "
            f"(its model components: {sorted(loads)})"
        )
    return policy


def _load_checkpoint(
    ckpt: Checkpoint,
    dtype: Any,
    prediction_type: str | None,
    config: Any,
    vae: Any,
    extract_ema: bool,
    overrides: dict[str, Any],
    hub: dict[str, Any],
    quantize: Any = None,
) -> SingleFileLoad:
    from sdjax import samplers

    shapes = ckpt.shapes()
    architecture = infer_architecture(shapes, source=str(ckpt.path))
    hint, hint_source = (prediction_type, "argument") if prediction_type else prediction_hint(ckpt, architecture)
    config_dir = _config_dir(config, architecture, hint, **hub)
    model_index = files.read_model_index(config_dir)
    entries = files.component_entries(model_index)
    stray = sorted(n for n in overrides if n not in entries and n not in NOT_IN_FILE)
    if stray:
        raise ValueError(f"override(s) {stray} name no component of this pipeline (components: {sorted(entries)})")
    loads = [  # the model components the params will hold
        n
        for n, (library, cls) in entries.items()
        if (library, (cls or "").removeprefix("Flax")) in comp.PIPELINE_MODELS
        and n not in NOT_IN_FILE
        and (overrides.get(n, 0) is not None or (n == "vae" and vae is not None))
    ]
    policy = _load_time_policy(quantize, loads, str(ckpt.path))
    layout = component_layout(architecture, shapes)
    if extract_ema and sum(k.startswith(ldm_keys.EMA_PREFIX) for k in shapes) <= 100:
        raise MissingWeightsError(f"{ckpt.path}: extract_ema=True but the file holds no EMA weights (model_ema.*)")
    if not extract_ema and sum(k.startswith(ldm_keys.EMA_PREFIX) for k in shapes) > 100:
        logger.info("%s: holds EMA weights too; loading the non-EMA UNet (pass extract_ema=True for EMA)", ckpt.path)
    logger.info("%s: %s checkpoint, configs from %s", ckpt.path, architecture, config_dir)

    components: dict[str, Any] = {}
    params: dict[str, Any] = {}
    raw_configs: dict[str, dict[str, Any]] = {}
    final_prediction = None
    model_index = dict(model_index)
    for name, (library, cls) in entries.items():
        if library is None or cls is None or name in overrides:
            continue
        if name in NOT_IN_FILE:
            model_index[name] = [None, None]
            continue
        cls = cls[4:] if cls.startswith("Flax") else cls
        folder = config_dir / name
        if (library, cls) in comp.PIPELINE_MODELS:
            spec = comp.PIPELINE_MODELS[(library, cls)]
            if name not in layout:
                raise UnknownArchitectureError(
                    f"{config_dir}/{files.MODEL_INDEX} names component {name!r}, which a {architecture} checkpoint "
                    f"does not hold (it holds {sorted(layout)}); pass a config= that matches the file"
                )
            kind, prefix = layout[name]
            if not _has_prefix(shapes, prefix):
                hint_arg = " or vae=" if name == "vae" else ""
                raise MissingWeightsError(
                    f"{ckpt.path}: no {name} weights (no key starts with {prefix!r}); pass overrides[{name!r}]"
                    f"{hint_arg} to supply them. Key families found: {key_families(shapes)}"
                )
            raw = read_json(folder / "config.json")
            model_config = comp.model_config(spec, raw, source=str(folder / "config.json"))
            components[name], params[name] = load_component(
                ckpt,
                name,
                spec,
                model_config,
                kind,
                prefix,
                dtype=dtype,
                extract_ema=extract_ema and name == DENOISER,
                quantize=policy,
            )
            raw_configs[name] = raw
        elif library == "transformers" and cls in ("CLIPTokenizer", "CLIPTokenizerFast"):
            components[name] = load_tokenizer_folder(folder)
        elif library == "diffusers" and cls in samplers.CLASSES:
            raw = read_json(folder / "scheduler_config.json")
            raw["_class_name"] = cls
            if prediction_type is not None or (config is None and hint is not None):
                raw["prediction_type"] = prediction_type or hint
            final_prediction = raw.get("prediction_type", "epsilon")
            components[name] = samplers.get_sampler(raw)
            params[name] = components[name].create_state()
            raw_configs[name] = raw
        else:
            raise ValueError(f"{config_dir}/{files.MODEL_INDEX}: sdjax cannot load {name}: [{library}, {cls}]")
    if vae is not None:
        vae_config = config_dir / "vae" if (config_dir / "vae" / "config.json").is_file() else None
        overrides["vae"] = comp.resolve_vae(vae, dtype=dtype, config=vae_config, loader=load_vae)
    for name, obj in overrides.items():
        if obj is None:
            continue
        if name == "vae" and vae is not None:
            components["vae"], params["vae"] = obj
            continue
        components[name] = obj
        if hasattr(obj, "create_state"):
            params[name] = obj.create_state()
    final_prediction = final_prediction or hint or "epsilon"
    if prediction_type is not None:
        prediction_from = "argument"
    elif config is not None:
        prediction_from = "config"
    else:
        prediction_from = hint_source if hint is not None else "default config"
    model_index["_single_file"] = {
        "file": str(ckpt.path),
        "architecture": architecture,
        "config": str(config_dir),
        "prediction_type": final_prediction,
        "prediction_type_from": prediction_from,
    }
    return SingleFileLoad(components, params, model_index, architecture, config_dir, final_prediction, raw_configs)


def load_single_file(
    path: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    prediction_type: str | None = None,
    config: str | os.PathLike | None = None,
    vae: Any = None,
    extract_ema: bool = False,
    allow_pickle: bool = False,
    overrides: Mapping[str, Any] | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    quantize: Any = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Load an original-layout single-file checkpoint -> `(components, params, model_index)`, the triple
    `load_pipeline_components` returns for a diffusers folder (see the module docstring for each step).

    - `dtype`: dtype of the stored params and compute dtype of the modules (the scheduler state stays float32).
    - `prediction_type`: "epsilon", "v_prediction" or "sample", overriding the scheduler's (and, for SD 2.x,
      choosing the 512-px epsilon or 768-px v-prediction configs); None: what the file says, else the default.
    - `config`: a diffusers folder or Hub repo id to take the configs from (only configs and tokenizer files are
      downloaded), or the name of an embedded set (`CONFIG_SETS`); None: the embedded set for the architecture.
    - `vae`: a replacement VAE (see `load_vae`), or a `(module, params)` pair.
    - `extract_ema`: load the UNet's EMA copy (`model_ema.*`) instead of its plain weights.
    - `allow_pickle`: read `.ckpt`/`.pt`/`.bin` pickles with the restricted unpickler (refused otherwise).
    - `overrides`: component name -> object replacing it, or None to leave it out (as in
      `load_pipeline_components`).
    - `quantize`: None, `"int8"` / `"fp8"` (the UNet's kernels) or a `sdjax.quant.QuantPolicy`: the kernels it
      selects in the components read from the file are quantized as each is converted (`sdjax.quant.loading`),
      the same values as quantizing after a full-precision load; a replacement `vae=` is loaded as it is. The
      modules are not wrapped here (`sdjax.quant.quantize_pipeline` does that, keeping these kernels).

    `model_index` is the config's `model_index.json` with the components a single file does not hold set to
    `[null, null]` and a `_single_file` entry recording the file, the inferred architecture, the config folder and
    the prediction type used (and where it came from).
    """
    loaded = _load(
        path,
        dtype=dtype,
        prediction_type=prediction_type,
        config=config,
        vae=vae,
        extract_ema=extract_ema,
        allow_pickle=allow_pickle,
        overrides=overrides,
        revision=revision,
        local_files_only=local_files_only,
        cache_dir=cache_dir,
        token=token,
        quantize=quantize,
    )
    return loaded.components, loaded.params, loaded.model_index


def checkpoint_shapes(config: str | os.PathLike, architecture: str | None = None) -> dict[str, tuple[int, ...]]:
    """The `{key: shape}` set of an original-layout checkpoint of the pipeline that a config set (name in
    `CONFIG_SETS` or a diffusers folder) describes: every tensor `load_single_file` reads, nothing else. Built from
    sdjax's abstract params (`init_params_shape`, nothing allocated) through `ldm_keys`; `architecture` (default:
    inferred from the set's name) picks the text-encoder prefixes."""
    import importlib

    folder = CONFIGS_DIR / config if isinstance(config, str) and config in CONFIG_SETS else Path(config)
    if architecture is None:
        by_set = {config_set_for(a, p): a for a in ARCHITECTURES for p in ("epsilon", "v_prediction")}
        architecture = by_set[folder.name]
    layout = component_layout(architecture, ())
    out: dict[str, tuple[int, ...]] = {}
    for name, (library, cls) in files.component_entries(files.read_model_index(folder)).items():
        if (library, cls) not in comp.PIPELINE_MODELS or name not in layout:
            continue
        spec = comp.PIPELINE_MODELS[(library, cls)]
        model_cls = getattr(importlib.import_module(spec.module), spec.model)
        raw = read_json(folder / name / "config.json")
        kind, prefix = layout[name]
        table = component_table(name, kind, prefix, model_cls, comp.model_config(spec, raw, source=name))
        for key, (full, src) in table.sources.items():
            out[full] = src.ldm_shapes(table.shapes[key])[0]
    return out


# ---------------------------------------------------------------------------------------------------- VAE


def _vae_config(config: Any) -> tuple[dict[str, Any], str]:
    """`load_vae`'s `config=` -> (raw VAE config dict, where it came from)."""
    if config is None:
        path = CONFIGS_DIR / "sd15" / "vae" / "config.json"
        logger.warning(
            "no VAE config given: using SD 1.5's (scaling_factor 0.18215); pass config='sdxl-base' (or a folder) "
            "for an SDXL VAE"
        )
        return read_json(path), str(path)
    if isinstance(config, Mapping):
        return dict(config), "config dict"
    if isinstance(config, str) and config in CONFIG_SETS:
        path = CONFIGS_DIR / config / "vae" / "config.json"
        return read_json(path), str(path)
    path = Path(os.fspath(config)).expanduser()
    for candidate in (path, path / "config.json", path / "vae" / "config.json"):
        if candidate.is_file():
            return read_json(candidate), str(candidate)
    raise FileNotFoundError(f"VAE config {path}: not a config.json, a VAE folder or a pipeline folder with vae/")


def load_vae(
    path_or_folder: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    config: Any = None,
    allow_pickle: bool = False,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> tuple[Any, dict]:
    """A VAE (diffusers `AutoencoderKL`) -> `(module, params)`, e.g. an fp16-safe SDXL VAE to replace a pipeline's.

    - a diffusers VAE folder (`config.json` + weights), a pipeline folder (its `vae/`), or a Hub repo of either
      (only the config and the chosen weights are downloaded);
    - one file holding a VAE in the original layout (`encoder.down.*`, `decoder.up.*`, `quant_conv`, optionally
      under `first_stage_model.` or `vae.`, so a whole SD checkpoint gives its VAE too) or in the diffusers layout
      (`encoder.down_blocks.*`). Its architecture and `scaling_factor` come from `config`: a diffusers `config.json`,
      a VAE or pipeline folder, a dict, or an embedded set name ("sd15", "sdxl-base", ...); None: SD 1.5's, with a
      warning. The weights cannot tell an SD 1.x VAE from an SDXL one: only the scaling factor differs.
    """
    dtype = jnp.dtype(dtype)
    local = Path(os.fspath(path_or_folder)).expanduser()
    if not local.is_file():
        folder = files.resolve_component_dir(
            path_or_folder,
            "vae",
            revision=revision,
            local_files_only=local_files_only,
            cache_dir=cache_dir,
            token=token,
        )
        declared = read_json(folder / "config.json").get("_class_name", "AutoencoderKL")
        if declared.removeprefix("Flax") != "AutoencoderKL":
            raise ValueError(f"{folder / 'config.json'} describes a {declared}, not an AutoencoderKL")
        return comp.load_model(comp.VAE, comp.LoadRequest("vae", folder, None, dtype))
    with open_checkpoint(local, allow_pickle=allow_pickle) as ckpt:
        return _vae_from_checkpoint(ckpt, config, dtype)


def _vae_from_checkpoint(ckpt: Checkpoint, config: Any, dtype: Any) -> tuple[Any, dict]:
    local = ckpt.path
    raw, where = _vae_config(config)
    vae_config = comp.model_config(comp.VAE, raw, source=where)
    keys = list(ckpt)
    prefix = next(
        (p for p in ldm_keys.VAE_PREFIXES if _has_prefix(keys, p + "encoder.") or _has_prefix(keys, p + "decoder.")),
        "",
    )
    if _has_prefix(keys, prefix + "encoder.down_blocks.") or _has_prefix(keys, prefix + "decoder.up_blocks."):
        return comp.model_from_state_dict(
            comp.VAE, vae_config, _PrefixView(ckpt, prefix), dtype=dtype, component=f"vae ({local})"
        )
    if _has_prefix(keys, prefix + "encoder.down.") or _has_prefix(keys, prefix + "decoder.up."):
        return load_component(ckpt, "vae", comp.VAE, vae_config, "vae", prefix, dtype=dtype)
    raise UnknownArchitectureError(
        f"{local}: not a VAE checkpoint (no encoder.down.* / encoder.down_blocks.* keys, with or without "
        f"{' or '.join(ldm_keys.VAE_PREFIXES)}); key families found: {key_families(keys)}"
    )


# ---------------------------------------------------------------------------------------------------- conversion out


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def convert_to_diffusers(
    path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False, **load_kwargs: Any
) -> Path:
    """Write an original-layout single file as a diffusers folder at `out_dir` that sdjax and diffusers both load.

    `load_kwargs` are `load_single_file`'s (`dtype` sets the dtype the weights are written in: float32 by default,
    float16 or bfloat16 to halve the folder). The folder holds `model_index.json`, each model's `config.json` (the
    config used, as read) and weights in the PyTorch layout (`diffusion_pytorch_model.safetensors`,
    `model.safetensors` for the text encoders; inverse layout rules of `sdjax.models.convert`), the tokenizers
    (`vocab.json`, `merges.txt`, their special-token files) and `scheduler/scheduler_config.json`. An existing
    non-empty `out_dir` is an error unless `overwrite=True`.
    """
    out = Path(os.fspath(out_dir)).expanduser()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True to write into it")
    if load_kwargs.get("overrides") or load_kwargs.get("vae") is not None:
        raise ValueError("convert_to_diffusers writes what the file holds: overrides and vae= are not accepted")
    if load_kwargs.get("quantize") is not None:
        raise ValueError("convert_to_diffusers writes float weights: quantize= is not accepted (quantize on loading)")
    loaded = _load(
        path,
        dtype=load_kwargs.pop("dtype", jnp.float32),
        prediction_type=load_kwargs.pop("prediction_type", None),
        config=load_kwargs.pop("config", None),
        vae=None,
        extract_ema=load_kwargs.pop("extract_ema", False),
        allow_pickle=load_kwargs.pop("allow_pickle", False),
        overrides=None,
        **load_kwargs,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:  # written next to `out` and moved in only when complete: a failure leaves nothing half-written
        _write_diffusers_folder(loaded, partial)
        if not out.exists():
            partial.rename(out)
        else:
            for entry in partial.iterdir():
                target = out / entry.name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
                entry.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def _write_diffusers_folder(loaded: SingleFileLoad, out: Path) -> None:
    from safetensors.numpy import save_file

    from sdjax.models.convert import params_to_state_dict

    index = {k: v for k, v in loaded.model_index.items() if k != "_single_file"}
    for name, (library, _) in files.component_entries(index).items():
        if library is None:
            continue
        folder, source = out / name, loaded.config_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        if name in loaded.params and name != "scheduler" and name in loaded.configs:
            weights = "model.safetensors" if library == "transformers" else "diffusion_pytorch_model.safetensors"
            _write_json(folder / "config.json", loaded.configs[name])
            dtype = np.dtype(jnp.dtype(next(iter(_leaves(loaded.params[name]))).dtype))
            save_file(params_to_state_dict(loaded.params[name], dtype=dtype), str(folder / weights), {"format": "pt"})
        elif name in loaded.configs:  # the scheduler
            _write_json(folder / "scheduler_config.json", loaded.configs[name])
        else:  # a tokenizer: its files, and the shared CLIP vocabulary when the source is an embedded JSON-only set
            for f in source.iterdir():
                if f.is_file():
                    shutil.copyfile(f, folder / f.name)
            if not (folder / "vocab.json").is_file() and not (folder / "tokenizer.json").is_file():
                for f in ("vocab.json", "merges.txt"):
                    shutil.copyfile(CLIP_VOCAB_DIR / f, folder / f)
    _write_json(out / files.MODEL_INDEX, index)


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, Mapping):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree
