"""AUTOMATIC1111's model endpoints over a models directory (`sdjax.models_dir`), and the model settings a request
may override.

Listings (A1111's response shapes): `GET /sdapi/v1/sd-models` (`title` "name [shorthash]" once the file's hash is
known, else the name; `model_name`, `hash`, `sha256`, `filename`, `config`), `GET /sdapi/v1/loras` (`name`,
`alias`, `path`, `metadata`: the file's safetensors metadata), `GET /sdapi/v1/embeddings` (`loaded` / `skipped`,
each name -> `step`, `sd_checkpoint`, `sd_checkpoint_name`, `shape`, `vectors`), `GET /sdapi/v1/sd-vae`
(`model_name`, `filename`). File names are given relative to the models directory (A1111 gives absolute paths;
the server's own layout is not disclosed). The embeddings of `embeddings/` are loaded into the served pipeline at
start-up and after a model switch; their file names then trigger them in any prompt, as in A1111.

Model switching (`ServerState.switch_model`) loads the new model with the server's loader, then quantizes it as the
start-up model was (`quantize_like`: `--quantize`, `--quant-compute`; a `--calibration` only where it was recorded for
that model).

Settings: `CLIP_stop_at_last_layers` (A1111's Clip skip) is a per-image input of the program, honoured per request
and as the server's default (POST /sdapi/v1/options) without splitting batches or compiling; `sd_vae` "Automatic"
and "None" are the served model's own VAE, a name in `VAE/` is applied per batch as params (`server.networks`).
"""

from __future__ import annotations

import dataclasses
import logging
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


def quantize_like(pipe: Any, policy: Any, served_denoiser: str, name: str) -> Any:
    """A switched-in model `pipe` (loaded in full precision) quantized with the start-up model's `QuantPolicy`
    (`policy`; None: returned as it is): the same scheme, compute mode, size rule and exclusions, over the same
    components, the start-up denoiser's (`served_denoiser`) read as this model's denoiser; components this model
    lacks are dropped. A calibration holds input ranges of the start-up model's layers: it is applied only where
    `Calibration.check` accepts it for this model (switching back to the model it was recorded for), and otherwise
    dropped with a warning naming the file and `name`; the model then scales its 8-bit inputs per call, as without
    --calibration. Returns the pipeline (quantized in place)."""
    if policy is None:
        return pipe
    denoiser = pipe.denoiser.component
    wanted = dict.fromkeys(denoiser if c == served_denoiser else c for c in policy.components)
    components = tuple(c for c in wanted if c in pipe.params)
    if len(components) < len(wanted):
        log.warning("%s has no %s: not quantized", name, ", ".join(c for c in wanted if c not in components))
    calibration = policy.calibration
    policy = dataclasses.replace(policy, components=components, calibration=None)
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
