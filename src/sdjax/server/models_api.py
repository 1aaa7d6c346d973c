"""AUTOMATIC1111's model endpoints over a models directory (`sdjax.models_dir`), and the model settings a request
may override.

Listings (A1111's response shapes): `GET /sdapi/v1/sd-models` (`title` "name [shorthash]" once the file's hash is
known, else the name; `model_name`, `hash`, `sha256`, `filename`, `config`), `GET /sdapi/v1/loras` (`name`,
`alias`, `path`, `metadata`: the file's safetensors metadata), `GET /sdapi/v1/embeddings` (`loaded` / `skipped`,
each name -> `step`, `sd_checkpoint`, `sd_checkpoint_name`, `shape`, `vectors`), `GET /sdapi/v1/sd-vae`
(`model_name`, `filename`). File names are given relative to the models directory (A1111 gives absolute paths;
the server's own layout is not disclosed). The embeddings of `embeddings/` are loaded into the served pipeline at
start-up and after a model switch; their file names then trigger them in any prompt, as in A1111.

Model switching (`ServerState.switch_model`, `load_like`) loads the new model quantized as the start-up model was
(`--quantize`, `--quant-compute`; a `--calibration` only where it was recorded for that model): a loader that takes
`quantize=` (`sdjax serve`'s) gets the start-up policy read for the new model (`load_policy`), so its kernels are
quantized as they are converted (or read from its saved quantized files) and it never exists in full precision;
`quantize_like` then completes what the load could not know (components found only once loaded, the calibration).

Settings: `CLIP_stop_at_last_layers` (A1111's Clip skip) is a per-image input of the program, honoured per request
and as the server's default (POST /sdapi/v1/options) without splitting batches or compiling; `sd_vae` "Automatic"
and "None" are the served model's own VAE, a name in `VAE/` is applied per batch as params (`server.networks`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdjax import quant
from sdjax.models_dir import Entry, ModelsDir
from sdjax.server.schemas import FieldError

log = logging.getLogger("sdjax.server")

OWN_VAE = ("automatic", "none")  # A1111's sd_vae values that mean the checkpoint's own VAE


def open_models_dir(models_dir: str | None) -> ModelsDir | None:
    return ModelsDir(models_dir) if models_dir else None


def _relative(md: ModelsDir, entry: Entry) -> str:
    try:
        return entry.path.relative_to(md.root).as_posix()
    except ValueError:  # embeddings beside models/, or a kind folder that is a link
        return f"{md.folder(entry.kind).name}/{entry.name}"


def sd_models(md: ModelsDir | None, served_name: str) -> list[dict[str, Any]]:
    """`GET /sdapi/v1/sd-models`: the checkpoints of the directory (without one: the served model)."""
    if md is None or not md.list("checkpoint"):
        return [{"title": served_name, "model_name": served_name, "hash": None, "sha256": None,
                 "filename": served_name, "config": None}]  # fmt: skip
    out = []
    for e in md.list("checkpoint"):
        sha = None if e.is_folder else md.hashes.known(e.path)
        out.append(
            {
                "title": md.title(e),
                "model_name": e.model_name,
                "hash": sha[:10] if sha else None,
                "sha256": sha,
                "filename": _relative(md, e),
                "config": None,
            }
        )
    return out


def loras(md: ModelsDir | None) -> list[dict[str, Any]]:
    """`GET /sdapi/v1/loras`: name (file name without extension), alias (the kohya `ss_output_name`, else the
    name), path, metadata (the safetensors header's metadata; {} when the header cannot be read)."""
    if md is None:
        return []
    out = []
    for e in md.list("lora"):
        meta = _safetensors_metadata(e)
        out.append(
            {"name": e.short_name, "alias": meta.get("ss_output_name") or e.short_name,
             "path": _relative(md, e), "metadata": meta}
        )  # fmt: skip
    return out


def _safetensors_metadata(entry: Entry) -> dict[str, str]:
    try:
        from safetensors import safe_open

        with safe_open(str(entry.path), "np") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # a broken file is listed, its metadata empty
        log.warning("%s: cannot read its safetensors header (%s)", entry.path, e)
        return {}


def sd_vae(md: ModelsDir | None) -> list[dict[str, Any]]:
    """`GET /sdapi/v1/sd-vae`: the VAE/ entries (A1111's model_name is the file name, with its extension)."""
    if md is None:
        return []
    return [{"model_name": e.name.rsplit("/", 1)[-1], "filename": _relative(md, e)} for e in md.list("vae")]


def load_embeddings(pipeline: Any, md: ModelsDir | None, *, allow_pickle: bool = False) -> dict[str, dict[str, Any]]:
    """Load every embedding of `embeddings/` into `pipeline` (trigger word: the file name without extension, as
    A1111); those that do not fit the model (or are pickles, unless `allow_pickle`: then sdjax's restricted
    unpickler reads them) are skipped with a log line. Returns A1111's
    `{"loaded": {...}, "skipped": {...}}` body of `GET /sdapi/v1/embeddings` (`step`, `sd_checkpoint` and
    `sd_checkpoint_name` describe the embedding's training in A1111's pickles; .safetensors files carry none)."""
    body: dict[str, dict[str, Any]] = {"loaded": {}, "skipped": {}}
    if md is None or not hasattr(pipeline, "load_textual_inversion"):
        return body
    from sdjax.loading import textual_inversion as ti

    for e in md.list("embedding"):
        name = e.short_name
        info: dict[str, Any] = {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": None, "shape": None,
                                "vectors": None}  # fmt: skip
        try:
            emb = ti.read_embedding(e.path, token=name, allow_pickle=allow_pickle)
            rows = next(iter(emb.vectors.values()))
            info.update(shape=int(rows.shape[-1]), vectors=int(rows.shape[0]))
            pipeline.load_textual_inversion(e.path, token=name, allow_pickle=allow_pickle)
        except Exception as err:  # a file for another model, a pickle, a token the tokenizer has
            log.warning("embedding %s skipped: %s", e.name, err)
            body["skipped"][name] = info
            continue
        body["loaded"][name] = info
    return body


def takes_quantize(loader: Callable[..., Any]) -> bool:
    """Whether the server's `loader` takes a `quantize=` keyword (`sdjax serve`'s does; the plain
    `loader(path) -> pipeline` of `create_app` need not: its model is quantized after it loads)."""
    try:
        params = inspect.signature(loader).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    return any(p.name == "quantize" or p.kind is p.VAR_KEYWORD for p in params)


def _components_of(path: str) -> tuple[str, set[str]]:
    """The denoiser's params key of the model at `path` and the components known before loading it: a diffusers
    folder's `model_index.json` names them and its class the family; of a single file only the denoiser is
    certain (its family's, else the UNet of an original-layout SD checkpoint)."""
    from sdjax.families import family_of_file, family_of_pipeline_class
    from sdjax.loading import files
    from sdjax.loading.ldm_checkpoint import DENOISER

    if Path(path).is_dir():
        index = files.read_model_index(path)
        denoiser = family_of_pipeline_class(index["_class_name"]).denoiser_component
        return denoiser, {n for n, (library, _) in files.component_entries(index).items() if library is not None}
    family = family_of_file(path)
    denoiser = family.denoiser_component if family is not None else DENOISER
    return denoiser, {denoiser}


def _policy_for(policy: Any, served_denoiser: str, denoiser: str) -> tuple[Any, tuple[str, ...]]:
    """The start-up `policy` without its calibration, and the components it names as another model calls them
    (the start-up denoiser, `served_denoiser`, read as that model's `denoiser`)."""
    wanted = tuple(dict.fromkeys(denoiser if c == served_denoiser else c for c in policy.components))
    return dataclasses.replace(policy, calibration=None), wanted


def load_policy(path: str, policy: Any, served_denoiser: str) -> Any:
    """The `quantize=` to load the model at `path` with, so that it is quantized as the start-up model's `policy`
    quantizes (None: None): its scheme, compute mode, size rule and exclusions over the components of its that
    are known before loading (`_components_of`), without a calibration (recorded for the start-up model;
    `quantize_like` decides on it after the load). None when no such component is known. What the load quantizes
    is what `quantize_like` would, so it keeps those kernels and quantizes only the rest."""
    if policy is None:
        return None
    denoiser, have = _components_of(path)
    policy, wanted = _policy_for(policy, served_denoiser, denoiser)
    components = tuple(c for c in wanted if c in have)
    return dataclasses.replace(policy, components=components) if components else None


def load_like(loader: Callable[..., Any], path: str, policy: Any, served_denoiser: str, name: str) -> Any:
    """The model at `path`, loaded with the server's `loader` and quantized as the start-up model's `policy`
    quantizes: by the load itself where the loader takes `quantize=` (`load_policy`: the switched-in model never
    exists in full precision, and a saved quantized file in its folder is read instead of its float weights),
    then `quantize_like`."""
    quantize = load_policy(path, policy, served_denoiser) if policy is not None and takes_quantize(loader) else None
    pipe = loader(path) if quantize is None else loader(path, quantize=quantize)
    return quantize_like(pipe, policy, served_denoiser, name)


def quantize_like(pipe: Any, policy: Any, served_denoiser: str, name: str) -> Any:
    """A switched-in model `pipe` quantized with the start-up model's `QuantPolicy` (`policy`; None: returned as
    it is): the same scheme, compute mode, size rule and exclusions, over the same components, the start-up
    denoiser's (`served_denoiser`) read as this model's denoiser; components this model lacks are dropped. Kernels
    its load already quantized (`load_like`) are kept. A calibration holds input ranges of the start-up model's
    layers: it is applied only where `Calibration.check` accepts it for this model (switching back to the model it
    was recorded for), and otherwise dropped with a warning naming the file and `name`; the model then scales its
    8-bit inputs per call, as without --calibration. Returns the pipeline (quantized in place)."""
    if policy is None:
        return pipe
    calibration = policy.calibration
    policy, wanted = _policy_for(policy, served_denoiser, pipe.denoiser.component)
    components = tuple(c for c in wanted if c in pipe.params)
    if len(components) < len(wanted):
        log.warning("%s has no %s: not quantized", name, ", ".join(c for c in wanted if c not in components))
    policy = dataclasses.replace(policy, components=components)
    quant.quantize_pipeline(pipe, pipe.params, policy)
    if calibration is None:
        return pipe
    try:
        calibration.check(pipe.params, policy)
    except ValueError as e:
        log.warning(
            "%s: not applied to %s (%s); its %s products scale their inputs per call", calibration.name, name, e,
            policy.compute,
        )  # fmt: skip
        return pipe
    return quant.use_calibration(pipe, calibration)


def clip_skip_setting(value: Any, pipeline: Any, field: str) -> int:
    """A `CLIP_stop_at_last_layers` value -> the per-image `clip_skip` (1 .. the text encoder's layers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise FieldError(field, f"{value!r} is not an int (1: the last CLIP layer, 2: the one before, ...)")
    value = int(value)
    encoders = [getattr(pipeline, n, None) for n in ("text_encoder", "text_encoder_2")]
    layers = [enc.config.num_hidden_layers for enc in encoders if enc is not None]
    if value == 1:
        return 1
    if not layers:
        raise FieldError(field, f"{value} cannot be honoured: this pipeline has no CLIP text encoder")
    if not 1 <= value <= min(layers):
        raise FieldError(field, f"{value} is outside 1..{min(layers)} (this text encoder's number of layers)")
    return value
