"""Load every component of a diffusers pipeline folder (or Hub repo id) into sdjax objects and params.

`model_index.json` names each component's `[library, class]`; one table, `COMPONENT_LOADERS`, maps that pair to
the sdjax loader (class names of the old Flax pipelines, `FlaxUNet2DConditionModel` etc., are read without their
`Flax` prefix). A model component is built from its `config.json`, its weights are chosen by
`files.select_weight_files` and converted tensor by tensor, each cast to `dtype` as it is converted, so peak host
memory stays near one copy of the checkpoint plus the params. With a `quantize` policy (`sdjax.quant.QuantPolicy`)
the kernels it selects in its components are quantized as they are converted (`sdjax.quant.loading`), so those
components never exist in full precision; a component folder's saved quantized params (`quantized_file`) are read
instead of its float weights, and a Hub download then fetches that file and not the float weights. The scheduler
state is always float32.

Optional components (`safety_checker`, `feature_extractor`, `image_encoder`) whose class sdjax does not implement
are skipped with a logged warning; any other unknown `[library, class]` is an error. The `feature_extractor` is loaded
only with the safety checker it serves.

`load_model_from` loads one model that is not part of a pipeline folder (a ControlNet repo: `config.json` and
weights only) through the same `load_model`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import config_from_dict, read_json
from sdjax.loading import files
from sdjax.models.convert import WeightLoadError, contiguous

logger = logging.getLogger(__name__)

OPTIONAL_COMPONENTS = frozenset({"safety_checker", "feature_extractor", "image_encoder"})


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where the sdjax implementation of one model class lives (imported only when that class is loaded).

    `module` provides `config` (a config dataclass, built with its `from_dict` if it has one, else
    `config_from_dict`), the flax module class `model` (with `init_params_shape(config)`) and the converter
    `convert(state_dict, config, *, cast, **convert_kwargs)`. `flax_family` picks the old-Flax rename table
    (`files.FLAX_RENAMES`) for `*.msgpack` weights.
    """

    module: str
    config: str
    model: str
    convert: str
    flax_family: str
    convert_kwargs: tuple[tuple[str, Any], ...] = ()


CLIP_TEXT = ModelSpec(
    "sdjax.models.clip", "CLIPTextConfig", "CLIPTextModel", "convert_clip_text", "clip", (("with_projection", False),)
)
CLIP_TEXT_PROJ = ModelSpec(
    "sdjax.models.clip",
    "CLIPTextConfig",
    "CLIPTextModelWithProjection",
    "convert_clip_text",
    "clip",
    (("with_projection", True),),
)
UNET = ModelSpec("sdjax.models.unet", "UNet2DConditionConfig", "UNet2DConditionModel", "convert_unet", "unet")
VAE = ModelSpec("sdjax.models.vae", "AutoencoderKLConfig", "AutoencoderKL", "convert_vae", "vae")
CONTROLNET = ModelSpec(
    "sdjax.models.controlnet", "ControlNetConfig", "ControlNetModel", "convert_controlnet", "unet"
)  # the old FlaxControlNetModel named its params as the Flax UNet did: the "unet" msgpack table applies
SD3_CONTROLNET = ModelSpec(
    "sdjax.models.sd3_controlnet", "SD3ControlNetConfig", "SD3ControlNetModel", "convert_sd3_controlnet", "sd3"
)
FLUX_CONTROLNET = ModelSpec(
    "sdjax.models.flux_controlnet", "FluxControlNetConfig", "FluxControlNetModel", "convert_flux_controlnet", "flux"
)
SAFETY_CHECKER = ModelSpec(
    "sdjax.models.safety_checker",
    "SafetyCheckerConfig",
    "StableDiffusionSafetyChecker",
    "convert_safety_checker",
    "safety_checker",
)


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What every component loader gets: its folder and the load-wide options. `quantize`: a
    `sdjax.quant.QuantPolicy` whose selected kernels of this component (when its `components` name `name`) are
    quantized as they are converted, or None."""

    name: str
    folder: Path
    variant: str | None
    dtype: Any
    quantize: Any = None


def model_config(spec: ModelSpec, raw: Mapping[str, Any], *, source: str) -> Any:
    """The config dataclass of `spec` built from a parsed `config.json` dict (`source` names it in errors)."""
    config_cls = getattr(importlib.import_module(spec.module), spec.config)
    if hasattr(config_cls, "from_dict"):
        return config_cls.from_dict(raw, source=source)
    return config_from_dict(config_cls, dict(raw), source=source)


def model_from_state_dict(
    spec: ModelSpec,
    config: Any,
    state_dict: Mapping[str, Any],
    *,
    dtype: Any,
    component: str,
    quantize: Any = None,
    params_key: str | None = None,
) -> tuple[Any, dict]:
    """Build `spec`'s module from its `config` and convert a PyTorch-named `state_dict` (name -> array, read
    lazily key by key, each tensor cast to `dtype` as it is converted) -> `(module, params)`. `component` names
    the source in a `WeightLoadError`. `quantize` (a `QuantPolicy` or None) with `params_key` (the component's
    key in the pipeline's params, e.g. "unet"): the kernels the policy selects there are quantized as they are
    converted (`sdjax.quant.loading.convert_quantized`)."""
    mod = importlib.import_module(spec.module)
    model_cls, convert = getattr(mod, spec.model), getattr(mod, spec.convert)
    kwargs = dict(spec.convert_kwargs)
    try:
        if quantize is None or params_key is None:
            params = convert(state_dict, config, cast=make_cast(dtype), **kwargs)
        else:
            from sdjax.quant.loading import convert_quantized

            params = convert_quantized(
                lambda cast: convert(state_dict, config, cast=cast, **kwargs), make_cast(dtype), quantize, params_key
            )
    except WeightLoadError as e:  # the same report, naming the component
        raise WeightLoadError(component, e.missing, e.unexpected, e.misshaped) from None
    return model_cls(config=config, dtype=dtype), params


def load_model(spec: ModelSpec, req: LoadRequest) -> tuple[Any, dict]:
    """Build one model from `req.folder/config.json` and load its weights -> `(module, params)`."""
    model_cls = getattr(importlib.import_module(spec.module), spec.model)
    config_path = req.folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{req.folder}: component {req.name!r} has no config.json (files present: "
            f"{sorted(p.name for p in req.folder.iterdir())})"
        )
    config = model_config(spec, read_json(config_path), source=str(config_path))
    saved = load_saved_quantized(req, model_cls.init_params_shape(config))
    if saved is not None:  # written by `save_quantized_components`: the float weights are not read
        return model_cls(config=config, dtype=req.dtype), saved
    weights = files.select_weight_files(req.folder, variant=req.variant)
    component = f"{req.name} ({req.folder})"
    if weights.format == "flax":
        tree = files.read_flax_msgpack(weights.files[0])
        params = files.flax_params_to_sdjax(
            tree,
            model_cls.init_params_shape(config),
            family=spec.flax_family,
            component=component,
            cast=make_cast(req.dtype),
        )
        return model_cls(config=config, dtype=req.dtype), params
    return model_from_state_dict(
        spec,
        config,
        files.read_weights(weights),
        dtype=req.dtype,
        component=component,
        quantize=req.quantize,
        params_key=req.name,
    )


# ---------------------------------------------------------------------------------------------- saved quantized params
QUANTIZED_FILE = "sdjax_quantized.{scheme}.safetensors"  # in a component's folder, beside its float weights


def quantized_file(folder: str | os.PathLike, component: str, scheme: str) -> Path:
    """Where a pipeline folder keeps `component`'s params quantized with `scheme`: `folder/component/` +
    `QUANTIZED_FILE` (not a weight-file name: diffusers and `files.select_weight_files` pass it by)."""
    return Path(folder) / component / QUANTIZED_FILE.format(scheme=scheme)


def saved_quantized_names(policy: Any) -> dict[str, str]:
    """Component -> the name of the saved quantized file a load with `policy` reads in its folder, for each
    component the policy names: what a Hub download fetches instead of those components' float weights, where
    the repo has it (`files.resolve_model_dir(saved_quantized=)`)."""
    return {component: QUANTIZED_FILE.format(scheme=policy.scheme) for component in policy.components}


def _made_with(policy: Any, dtype: Any, variant: str | None) -> dict[str, str]:
    """What a saved quantized file must have been made with to equal quantizing on load: the policy's selection
    (`min_size`, `exclude`; the scheme is in the file's name, `compute` changes no stored value), the params dtype
    the kernels were cast to before quantizing, and the weights' variant."""
    return {
        "min_size": str(policy.min_size),
        "exclude": json.dumps(list(policy.exclude)),
        "dtype": jnp.dtype(dtype).name,
        "variant": variant or "",
    }


def load_saved_quantized(req: LoadRequest, shapes: Any) -> dict | None:
    """`req.name`'s params from its folder's saved quantized file, or None when `req.quantize` does not name the
    component or the folder has no file for its scheme (the float weights are then read and quantized). A Hub
    download made for such a load fetches the file instead of the float weights where the repo has it
    (`saved_quantized_names`), so a repo's file is read here as a local folder's is.

    A file made otherwise than this load would quantize (another `min_size` / `exclude`, another dtype or
    variant) is refused with a ValueError naming the file and the difference, rather than read or passed over:
    its kernels would not be the ones asked for, and a stale file left beside the weights is better found. A load
    without `quantize` never looks at it. `shapes`: the model's abstract params (the file must hold exactly
    those leaves, `quant.files.load_quantized(like=)`)."""
    policy = req.quantize
    if policy is None or req.name not in policy.components:
        return None
    path = req.folder / QUANTIZED_FILE.format(scheme=policy.scheme)
    if not path.is_file():
        return None
    from sdjax.quant import files as quant_files

    meta = quant_files.read_metadata(path)
    want = _made_with(policy, req.dtype, req.variant)
    made = {k: meta.get(k) for k in want}
    if made != want:
        diff = ", ".join(f"{k} {made[k]!r} there, {want[k]!r} here" for k in want if made[k] != want[k])
        raise ValueError(
            f"quantized params file {path} was made for another load of {req.name} ({diff}); load with the "
            "settings it was made with, or remove it (or write it again: sdjax convert FOLDER --quantize ...), "
            "or load without quantize= and quantize after (sdjax.quant.quantize_pipeline)"
        )
    loaded, _ = quant_files.load_quantized(path, like={req.name: shapes}, scheme=policy.scheme)
    if set(loaded) != {req.name}:
        raise ValueError(f"quantized params file {path} holds {sorted(loaded)}, expected only {req.name!r}")
    logger.info("%s: quantized params read from %s", req.folder, path.name)
    return loaded[req.name]


def save_quantized_components(
    folder: str | os.PathLike, params: Mapping[str, Any], policy: Any, *, dtype: Any, variant: str | None = None
) -> list[Path]:
    """Write each of `policy.components`' quantized params (a pipeline's `params` after loading with
    `quantize=policy` at `dtype` from `folder`'s weights of `variant`) into `folder` (`quantized_file`), where
    `from_pretrained(folder, dtype=dtype, variant=variant, quantize=...)` with the same selection reads them
    instead of the float weights. Each file is written beside its target and moved in when complete."""
    from sdjax.quant import files as quant_files

    written = []
    for component in policy.components:
        path = quantized_file(folder, component, policy.scheme)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"{folder}: no component folder {component}/ to write {path.name} into")
        one = dataclasses.replace(policy, components=(component,), calibration=None)
        tmp = path.with_name(path.name + ".tmp")
        quant_files.save_quantized({component: params[component]}, tmp, one, metadata=_made_with(one, dtype, variant))
        tmp.replace(path)
        written.append(path)
    return written


def load_model_from(
    spec: ModelSpec,
    path_or_repo_id: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    revision: str | None = None,
    variant: str | None = None,
    local_files_only: bool = False,
    subfolder: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> tuple[Any, dict]:
    """One model on its own (a folder or Hub repo with `config.json` and weights, no `model_index.json`, e.g. a
    ControlNet) -> `(module, params)`, through the same `load_model` as a pipeline's components.

    `subfolder` picks a component folder inside a pipeline folder or repo. From the Hub only `config.json` and the
    weights `files.choose_weight_name` picks for `variant` are downloaded; with `local_files_only=True` or
    `HF_HUB_OFFLINE=1` the files come from the HF cache without network access.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    folder = resolve_model_folder(
        path_or_repo_id,
        revision=revision,
        variant=variant,
        local_files_only=local_files_only,
        subfolder=subfolder,
        cache_dir=cache_dir,
        token=token,
    )
    name = Path(subfolder).name if subfolder else spec.model
    return load_model(spec, LoadRequest(name, folder, variant, dtype))


def resolve_model_folder(
    path_or_repo_id: str | os.PathLike,
    *,
    revision: str | None = None,
    variant: str | None = None,
    local_files_only: bool = False,
    subfolder: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> Path:
    """The local folder of one model: the given folder (`/subfolder`), or the snapshot of a Hub repo holding just
    its `config.json` and chosen weights (see `load_model_from`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        validate_repo_id,
    )

    sub = (subfolder or "").strip("/")
    text = os.fspath(path_or_repo_id)
    local = Path(text).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repo ids; {local} is a local folder")
        folder = local / sub if sub else local
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{local}: no subfolder {sub!r} (present: {sorted(p.name for p in local.iterdir() if p.is_dir())})"
            )
        return folder
    if local.exists():
        raise NotADirectoryError(f"{local} is a file; expected a model folder (config.json + weights) or a Hub repo id")
    try:
        validate_repo_id(text)
        if text.count("/") > 1 or text.startswith((".", "~")):
            raise HFValidationError("more than one '/'")
    except HFValidationError as e:
        raise FileNotFoundError(f"{text!r} is neither an existing folder nor a valid Hub repo id ({e})") from e

    where = f"{text}@{revision or 'main'}" + (f"/{sub}" if sub else "")
    common = dict(revision=revision, cache_dir=cache_dir, token=token)
    try:
        if local_files_only or files._hub_offline():
            folder = Path(snapshot_download(text, local_files_only=True, **common))
            folder = folder / sub if sub else folder
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"{where}: the cached snapshot {folder} has no config.json")
            return folder
        prefix = f"{sub}/" if sub else ""
        names = {
            f[len(prefix) :]
            for f in files._list_repo_files(text, revision, token)
            if f.startswith(prefix) and "/" not in f[len(prefix) :]
        }
        if "config.json" not in names:
            raise FileNotFoundError(
                f"{where}: no config.json, so not a diffusers model repo (files: {sorted(names)[:30]}); "
                f"for a component of a pipeline repo pass subfolder="
            )
        _, chosen, is_index, used = files.choose_weight_name(names, variant=variant, where=where)
        patterns = [prefix + "config.json", prefix + chosen]
        if is_index:
            patterns += [prefix + n for n in sorted(names) if files._is_shard_of(n, chosen, used)]
        logger.info("%s: downloading %d files", where, len(patterns))
        folder = Path(snapshot_download(text, allow_patterns=patterns, **common))
        return folder / sub if sub else folder
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"{where}: not in the Hugging Face cache ({cache_dir or 'default cache'}) and downloads are off "
            f"(local_files_only=True or HF_HUB_OFFLINE=1): {e}"
        ) from e
    except GatedRepoError as e:
        raise PermissionError(f"{where}: gated repo; accept its license on the Hub and pass token= ({e})") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"{text!r}: no such local folder and no such Hub repo (or it is private: pass token=) ({e})"
        ) from e
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"{where}: revision {revision!r} not found ({e})") from e


def make_cast(dtype: Any) -> Callable[[np.ndarray], Any]:
    """Floating tensors -> jnp arrays of `dtype`; other tensors keep their dtype. One tensor a call; safe to call
    from several threads at once (`convert_state_dict` does)."""
    dtype = jnp.dtype(dtype)

    def cast(x: np.ndarray):
        # One host pass does the rounding and the tiled copy of a transposed view into the layout the device takes,
        # into an aligned buffer that the CPU backend adopts without a second copy (`convert.contiguous`).
        target = dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.device_put(contiguous(x, target))

    return cast


def load_tokenizer(req: LoadRequest) -> tuple[Any, None]:
    from sdjax.text.tokenizer import CLIPTokenizer

    return CLIPTokenizer.from_folder(req.folder), None


def load_scheduler(class_name: str, req: LoadRequest) -> tuple[Any, Any]:
    """A diffusers scheduler folder -> `(sampler, float32 state)`. The class comes from `model_index.json`
    (`FlaxPNDMScheduler` reads as `PNDMScheduler`), the settings from `scheduler_config.json`."""
    from sdjax import samplers
    from sdjax.config import ConfigError

    path = req.folder / "scheduler_config.json"
    raw = read_json(path)
    raw["_class_name"] = class_name
    try:
        sampler = samplers.get_sampler(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    return sampler, sampler.create_state()


def load_image_processor(req: LoadRequest) -> tuple[Any, None]:
    return read_json(req.folder / "preprocessor_config.json"), None


def model_loader(spec: ModelSpec) -> Callable[[LoadRequest], tuple[Any, dict]]:
    """The component loader of a model class (`load_model` with `spec`), e.g. for a family's `loaders` table."""
    return lambda req: load_model(spec, req)


_model = model_loader


# The model classes of a pipeline's `model_index.json` that a single-file checkpoint can hold (see
# `single_file.py`): (library, class) -> spec.
PIPELINE_MODELS: dict[tuple[str, str], ModelSpec] = {
    ("transformers", "CLIPTextModel"): CLIP_TEXT,
    ("transformers", "CLIPTextModelWithProjection"): CLIP_TEXT_PROJ,
    ("diffusers", "UNet2DConditionModel"): UNET,
    ("diffusers", "AutoencoderKL"): VAE,
}

# (library, class) -> loader(LoadRequest) -> (object, params or None). Schedulers: `find_loader`.
COMPONENT_LOADERS: dict[tuple[str, str], Callable[[LoadRequest], tuple[Any, Any]]] = {
    **{key: _model(spec) for key, spec in PIPELINE_MODELS.items()},
    ("diffusers", "ControlNetModel"): _model(CONTROLNET),  # FlaxControlNetModel reads as this (see find_loader)
    ("transformers", "CLIPTokenizer"): load_tokenizer,
    ("transformers", "CLIPTokenizerFast"): load_tokenizer,
    ("stable_diffusion", "StableDiffusionSafetyChecker"): _model(SAFETY_CHECKER),
    # The safety checker preprocesses images itself (CLIP's 224 px resize, crop and normalization); the
    # processor's settings are kept for reference only.
    ("transformers", "CLIPImageProcessor"): load_image_processor,
    ("transformers", "CLIPFeatureExtractor"): load_image_processor,
}


def find_loader(library: str, class_name: str) -> Callable[[LoadRequest], tuple[Any, Any]] | None:
    """The loader for a model_index `[library, class]`, or None. `FlaxX` reads as `X`; any diffusers
    scheduler class that `sdjax.samplers.CLASSES` implements goes to `load_scheduler`."""
    name = class_name[4:] if class_name.startswith("Flax") else class_name
    if (library, name) in COMPONENT_LOADERS:
        return COMPONENT_LOADERS[(library, name)]
    if library == "diffusers" and name.endswith("Scheduler"):
        from sdjax import samplers

        if name in samplers.CLASSES:
            return lambda req: load_scheduler(name, req)
    return None


def _normalize_class(name: str | None) -> str | None:
    return name[4:] if name and name.startswith("Flax") else name


Loaders = Mapping[tuple[str, str], Callable[[LoadRequest], tuple[Any, Any]]]


def _finder(loaders: Loaders | None) -> Callable[[str, str], Callable[[LoadRequest], tuple[Any, Any]] | None]:
    """`find_loader` that first consults a model family's own `(library, class) -> loader` table."""
    table = dict(loaders or {})
    return lambda library, cls: table.get((library, _normalize_class(cls))) or find_loader(library, cls)


def _plan(
    model_index: Mapping[str, Any], overrides: Mapping[str, Any], where: str, loaders: Loaders | None = None
) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Which components to load from disk -> ({name: (library, class)}, warnings for skipped optional ones)."""
    find = _finder(loaders)
    entries = files.component_entries(model_index)
    todo: dict[str, tuple[str, str]] = {}
    skipped: list[str] = []
    unknown: list[str] = []
    for name, (library, cls) in entries.items():
        if library is None or cls is None or name in overrides:
            continue
        if find(library, cls) is not None:
            todo[name] = (library, cls)
        elif name in OPTIONAL_COMPONENTS:
            skipped.append(f"{name} [{library}, {cls}]")
        else:
            unknown.append(f"{name}: [{library!r}, {cls!r}]")
    if "safety_checker" not in todo:
        # The image processor only prepares images for the safety checker; without the checker it is not needed
        # (folders saved with `safety_checker=None` often lack it, and the old Flax ones named a class of its own).
        todo.pop("feature_extractor", None)
    if unknown:
        from sdjax import samplers

        known = sorted(f"[{lib!r}, {cls!r}]" for lib, cls in {**COMPONENT_LOADERS, **dict(loaders or {})})
        known += [f"['diffusers', {c!r}]" for c in samplers.CLASSES]
        raise ValueError(
            f"{where}/{files.MODEL_INDEX}: sdjax cannot load component(s) {'; '.join(unknown)} "
            f"(known: {', '.join(known)})"
        )
    return todo, skipped


_PENDING = object()  # the `vae=` override before it is loaded


def resolve_vae(vae: Any, *, dtype: Any, config: Any = None, loader: Any = None) -> tuple[Any, Any]:
    """A `vae=` argument -> `(module, params)`: a `(module, params)` pair is returned as is, a path or repo id is
    loaded by `loader` (`single_file.load_vae`, passed in by the layer above so that this module does not import
    the single-file loader that imports it; `config`: the VAE config for a single file that has none)."""
    if isinstance(vae, tuple):
        if len(vae) != 2 or not hasattr(vae[0], "config"):
            raise TypeError("vae= takes a path, a Hub repo id or a (module, params) pair from load_vae")
        return vae
    if not isinstance(vae, (str, os.PathLike)):
        raise TypeError(f"vae= takes a path, a Hub repo id or a (module, params) pair, got {type(vae).__name__}")
    if loader is None:
        raise TypeError("vae= as a path or repo id needs vae_loader=sdjax.loading.single_file.load_vae")
    return loader(vae, dtype=dtype, config=config)


def load_pipeline_components(
    path_or_repo_id: str | os.PathLike,
    *,
    expected_class: str | tuple[str, ...] | None = None,
    revision: str | None = None,
    variant: str | None = None,
    dtype: Any = jnp.float32,
    local_files_only: bool = False,
    overrides: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    vae: Any = None,
    vae_loader: Any = None,
    loaders: Loaders | None = None,
    quantize: Any = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Load a diffusers pipeline folder or Hub repo id -> `(components, params, model_index)`.

    - `components`: name -> sdjax object (flax module with `.config`, `CLIPTokenizer`, sampler); components that
      are `[null, null]` in `model_index.json`, disabled by an override of `None`, or optional and unknown to sdjax
      are absent.
    - `params`: name -> params pytree for each model component loaded from disk (cast to `dtype`), and
      `params["scheduler"]` = the sampler's `create_state()`, float32 whatever `dtype` is.
    - `model_index`: the parsed `model_index.json` (pipeline settings such as `force_zeros_for_empty_prompt`
      included).

    `overrides` maps a component name to an object that replaces it (a sampler gets its state put in `params`;
    any other object's params are the caller's to supply) or to `None` to leave it out. An override for a name
    that `model_index.json` does not list is an error unless it is an optional component. `expected_class`
    (e.g. "StableDiffusionPipeline", or a tuple of accepted names) must name `_class_name` (a `Flax` prefix is
    ignored); pass None to skip the check. `dtype` is the dtype of the stored params and the compute dtype given
    to the modules.

    `vae` replaces the pipeline's VAE with another one (e.g. an fp16-safe SDXL VAE): a diffusers VAE folder or
    Hub repo, a single VAE file (see `single_file.load_vae`; a file without a config of its own takes the
    pipeline's `vae/config.json`), or an already loaded `(module, params)` pair.

    `loaders` maps `(library, class)` to the loaders of a model family's own components (`sdjax.families`), tried
    before the shared table.

    `quantize`: a `sdjax.quant.QuantPolicy` (or None): the kernels it selects in the components it names are
    quantized as each is converted (`LoadRequest.quantize`), as `quantize_params` would quantize them after a
    full-precision load; the modules are not wrapped here (`sdjax.quant.quantize_pipeline` does that).
    """
    overrides = dict(overrides or {})
    if quantize is not None:
        from sdjax.quant import QuantPolicy

        if not isinstance(quantize, QuantPolicy):
            raise TypeError(
                f"load_pipeline_components(quantize={quantize!r}) takes a sdjax.quant.QuantPolicy "
                "(sdjax.quant.resolve_policy turns 'int8' / 'fp8' into the denoiser's policy)"
            )
    if vae is not None:
        if "vae" in overrides:
            raise ValueError("pass the replacement VAE either as vae= or as overrides['vae'], not both")
        overrides["vae"] = _PENDING
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")

    def check(model_index: dict[str, Any], where: str) -> dict[str, tuple[str, str]]:
        """Everything that can be checked from `model_index.json` alone; on the Hub, before any download."""
        found = _normalize_class(model_index["_class_name"])
        expected = (expected_class,) if isinstance(expected_class, str) else expected_class
        if expected is not None and found not in {_normalize_class(c) for c in expected}:
            raise ValueError(
                f"{where}: {files.MODEL_INDEX} describes a {model_index['_class_name']}, not a "
                f"{' or '.join(expected)}; load it with the matching pipeline class"
            )
        entries = files.component_entries(model_index)
        stray = sorted(n for n in overrides if n not in entries and n not in OPTIONAL_COMPONENTS)
        if stray:
            raise ValueError(
                f"{where}: override(s) {stray} name no component of this pipeline (components: {sorted(entries)})"
            )
        return _plan(model_index, overrides, where, loaders)[0]

    folder = files.resolve_model_dir(
        path_or_repo_id,
        revision=revision,
        variant=variant,
        local_files_only=local_files_only,
        components=lambda index: list(check(index, str(path_or_repo_id))),
        cache_dir=cache_dir,
        token=token,
        saved_quantized=None if quantize is None else saved_quantized_names(quantize),
    )
    model_index = files.read_model_index(folder)
    todo = check(model_index, str(folder))
    for s in _plan(model_index, overrides, str(folder), loaders)[1]:
        logger.warning("%s: skipping optional component %s: sdjax has no implementation of it", folder, s)
    absent = [f"{name}/ ([{lib}, {cls}])" for name, (lib, cls) in todo.items() if not (folder / name).is_dir()]
    if absent:
        hint = " (pass safety_checker=None to load without the safety checker)" if "safety_checker" in todo else ""
        raise FileNotFoundError(
            f"{folder}: component folder(s) {', '.join(absent)} named in {files.MODEL_INDEX} do not exist{hint}"
        )

    components: dict[str, Any] = {}
    params: dict[str, Any] = {}
    if vae is not None:
        overrides["vae"], params["vae"] = resolve_vae(
            vae,
            dtype=dtype,
            config=folder / "vae" if (folder / "vae" / "config.json").is_file() else None,
            loader=vae_loader,
        )
    for name, (library, cls) in todo.items():
        obj, p = _finder(loaders)(library, cls)(LoadRequest(name, folder / name, variant, dtype, quantize))
        components[name] = obj
        if p is not None:
            params[name] = p
    for name, obj in overrides.items():
        if obj is None:
            continue
        components[name] = obj
        if hasattr(obj, "create_state"):
            params[name] = obj.create_state()
    return components, params, model_index
