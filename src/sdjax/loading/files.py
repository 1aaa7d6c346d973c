"""Checkpoint files: diffusers folders, Hub repo ids and weight-file choice (the readers: `weight_readers`).

Nothing here imports torch. A diffusers folder is `model_index.json` plus one subfolder per component; a model
component holds `config.json` and its weights. `select_weight_files` picks the weights of a folder by these rules,
first match wins (`V` = the requested variant, e.g. `fp16`):

1. one safetensors file: `diffusion_pytorch_model[.V].safetensors`, `model[.V].safetensors`;
2. sharded safetensors, through their index: `{stem}.safetensors.index.json`; with a variant the current name
   `{stem}.safetensors.index.V.json` and the two older spellings `{stem}.safetensors.V.index.json` (diffusers
   before 0.30) and `{stem}.V.safetensors.index.json`; the shard names come from the index's `weight_map`;
3. Flax msgpack: `diffusion_flax_model[.V].msgpack`, `flax_model[.V].msgpack` (old diffusers/transformers Flax
   naming: see `flax_params_to_sdjax`);
4. PyTorch pickles `diffusion_pytorch_model[.V].bin`, `pytorch_model[.V].bin` (or their `.bin.index.json`), only
   when torch is installed; otherwise the error says to convert them to safetensors.

A requested variant that a folder does not have is an error naming the folder and the files in it (the old Flax
loader silently ignored `variant`). One documented exception: `variant="bf16"`, which the old Flax guides passed
while the repos they loaded hold bf16 weights on a `bf16`/`flax` *branch* (`revision=`) rather than as variant
files. A bf16 variant is by definition the full weights rounded to bfloat16, and sdjax rounds to `dtype` while
loading, so when no `*.bf16.*` file exists the plain weights are used and a warning says so.

The readers of the chosen files (`read_safetensors`, `read_flax_msgpack` with `flax_params_to_sdjax`,
`read_torch_bin`), the shard-index checks and the errors `CheckpointError` / `MissingWeightsError` live in
`sdjax.loading.weight_readers` and are re-exported here; `read_weights` reads a `WeightFiles` choice.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.loading.weight_readers import FLAX_RENAMES as FLAX_RENAMES
from sdjax.loading.weight_readers import CheckpointError as CheckpointError
from sdjax.loading.weight_readers import MissingWeightsError as MissingWeightsError
from sdjax.loading.weight_readers import SafetensorsReader as SafetensorsReader
from sdjax.loading.weight_readers import _describe, _index_shards
from sdjax.loading.weight_readers import flax_params_to_sdjax as flax_params_to_sdjax
from sdjax.loading.weight_readers import read_flax_msgpack as read_flax_msgpack
from sdjax.loading.weight_readers import read_safetensors as read_safetensors
from sdjax.loading.weight_readers import read_safetensors_header as read_safetensors_header
from sdjax.loading.weight_readers import read_torch_bin as read_torch_bin

logger = logging.getLogger(__name__)

MODEL_INDEX = "model_index.json"
SAFETENSORS_STEMS = ("diffusion_pytorch_model", "model")
FLAX_STEMS = ("diffusion_flax_model", "flax_model")
TORCH_STEMS = ("diffusion_pytorch_model", "pytorch_model")
# Variants that are only a rounding of the full weights; see the module docstring for why bf16 may fall back.
ROUNDING_FALLBACK_VARIANTS = frozenset({"bf16"})

_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".msgpack",
    ".ckpt",
    ".pt",
    ".pth",
    ".onnx",
    ".onnx_data",
    ".pb",
    ".h5",
    ".gguf",
)
_SMALL_SUFFIXES = (".json", ".txt", ".model")  # configs, tokenizer vocabularies, sentencepiece models
_INDEX_RE = re.compile(r".*\.(safetensors|bin|msgpack)(\.[^.]+)?\.index(\.[^.]+)?\.json$")


# ---------------------------------------------------------------------------------------------------- choosing


@dataclass(frozen=True)
class WeightFiles:
    """The weights chosen for one component folder.

    `format` is "safetensors", "flax" or "torch"; `files` are the files to read (shards in index order);
    `index` is the shard index when the weights are sharded; `variant` is the variant actually used (None when the
    plain weights were chosen, including the bf16 fallback).
    """

    format: str
    files: tuple[Path, ...]
    index: Path | None = None
    variant: str | None = None


def torch_available() -> bool:
    """Whether torch could be imported (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None


def _candidates(variant: str | None) -> list[tuple[str, str, bool]]:
    """(format, file name, is_index) in order of preference, for one variant (None = the plain weights)."""
    v = variant
    out: list[tuple[str, str, bool]] = []
    out += [("safetensors", f"{s}.{v}.safetensors" if v else f"{s}.safetensors", False) for s in SAFETENSORS_STEMS]
    for s in SAFETENSORS_STEMS:
        names = (
            [f"{s}.safetensors.index.{v}.json", f"{s}.safetensors.{v}.index.json", f"{s}.{v}.safetensors.index.json"]
            if v
            else [f"{s}.safetensors.index.json"]
        )
        out += [("safetensors", n, True) for n in names]
    out += [("flax", f"{s}.{v}.msgpack" if v else f"{s}.msgpack", False) for s in FLAX_STEMS]
    out += [("torch", f"{s}.{v}.bin" if v else f"{s}.bin", False) for s in TORCH_STEMS]
    for s in TORCH_STEMS:
        names = (
            [f"{s}.bin.index.{v}.json", f"{s}.bin.{v}.index.json", f"{s}.{v}.bin.index.json"]
            if v
            else [f"{s}.bin.index.json"]
        )
        out += [("torch", n, True) for n in names]
    return out


def choose_weight_name(
    names: Iterable[str], *, variant: str | None = None, where: str = "", allow_torch: bool | None = None
) -> tuple[str, str, bool, str | None]:
    """Pick the weights among the file `names` of one component folder by the module's rules.

    Returns `(format, file name, is_index, variant used)`. `where` names the folder in errors. Raises
    `MissingWeightsError` naming the folder and the files present when nothing fits.
    """
    names = set(names)
    allow_torch = torch_available() if allow_torch is None else allow_torch
    variants = [variant]
    if variant is not None and variant in ROUNDING_FALLBACK_VARIANTS:
        variants.append(None)
    for v in variants:
        for fmt, name, is_index in _candidates(v):
            if name not in names:
                continue
            if fmt == "torch" and not allow_torch:
                raise MissingWeightsError(
                    f"{where}: the weights to load are PyTorch pickles ({name}) and torch is not installed; sdjax "
                    f"reads them only through torch. Convert them to safetensors (e.g. load and `save_pretrained("
                    f"safe_serialization=True)` with diffusers once) or install torch. Files: {_describe(names)}"
                )
            if v != variant:
                logger.warning(
                    "%s: no %s variant of the weights; using %s and rounding to the requested dtype "
                    "(bf16 variants are plain weights rounded to bfloat16)",
                    where,
                    variant,
                    name,
                )
            return fmt, name, is_index, v
    if variant is not None:
        raise MissingWeightsError(
            f"{where}: no weights of variant {variant!r} (looked for e.g. "
            f"{_candidates(variant)[0][1]}, {_candidates(variant)[2][1]}); files present: "
            f"{_describe(names)}"
        )
    found = sorted(_variants_present(names))
    hint = f"; this folder has weights of variant(s) {found}: pass variant=" if found else ""
    raise MissingWeightsError(
        f"{where}: no weight file found (looked for diffusion_pytorch_model.safetensors, "
        f"model.safetensors, their sharded *.safetensors.index.json, "
        f"diffusion_flax_model.msgpack, flax_model.msgpack, *.bin){hint}; files present: "
        f"{_describe(names)}"
    )


_VARIANT_RE = re.compile(
    r"(?:diffusion_pytorch_model|model|pytorch_model|diffusion_flax_model|flax_model)"
    r"(?:\.(?P<a>[^.\-]+)(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin|msgpack)"
    r"|\.(?:safetensors|bin)\.index\.(?P<b>[^.]+)\.json)"
)


def _variants_present(names: Iterable[str]) -> set[str]:
    """The variant names that weight files in `names` carry (`model.fp16.safetensors` -> fp16)."""
    out = set()
    for n in names:
        m = _VARIANT_RE.fullmatch(n)
        if m:
            out.add(m.group("a") or m.group("b"))
    return out


def select_weight_files(folder: str | Path, *, variant: str | None = None) -> WeightFiles:
    """Choose the weight files of a local component folder (rules in the module docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"component folder not found: {folder}")
    names = {p.name for p in folder.iterdir() if p.is_file()}
    fmt, name, is_index, used = choose_weight_name(names, variant=variant, where=str(folder))
    if not is_index:
        return WeightFiles(fmt, (folder / name,), None, used)
    index = folder / name
    shards = _index_shards(index)
    return WeightFiles(fmt, tuple(folder / s for s in shards), index, used)


def read_weights(weights: WeightFiles) -> Mapping[str, np.ndarray]:
    """A lazy (safetensors) or eager (torch) key -> numpy mapping of PyTorch-named weights."""
    if weights.format == "safetensors":
        return read_safetensors([weights.index] if weights.index is not None else weights.files)
    if weights.format == "torch":
        return read_torch_bin([weights.index] if weights.index is not None else weights.files)
    raise ValueError(f"{weights.files[0]}: {weights.format} weights are not a PyTorch-named state dict")


# ---------------------------------------------------------------------------------------------------- folders, Hub


def read_model_index(folder: str | Path) -> dict[str, Any]:
    """`model_index.json` of a diffusers folder, checked to be a JSON object with a `_class_name`."""
    path = Path(folder) / MODEL_INDEX
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder}: not a diffusers pipeline folder: {MODEL_INDEX} not found "
            f"(files present: {_describe(p.name for p in Path(folder).iterdir())})"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("_class_name"), str):
        raise ValueError(f"{path}: expected a JSON object with a '_class_name'")
    return raw


def component_entries(model_index: Mapping[str, Any]) -> dict[str, tuple[str | None, str | None]]:
    """The components of a model index: name -> (library, class). Keys starting with `_` and plain settings
    (`requires_safety_checker`, `force_zeros_for_empty_prompt`, ...) are not components; `[null, null]` entries are
    returned as `(None, None)`."""
    out = {}
    for name, value in model_index.items():
        if name.startswith("_") or not isinstance(value, (list, tuple)):
            continue
        if len(value) != 2 or not all(v is None or isinstance(v, str) for v in value):
            raise ValueError(f"{MODEL_INDEX}: component {name!r} must be [library, class], got {value!r}")
        out[name] = (value[0], value[1])
    return out


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return env or bool(constants.HF_HUB_OFFLINE)


def _list_repo_files(repo_id: str, revision: str | None, token: str | bool | None) -> list[str]:
    from huggingface_hub import HfApi

    return HfApi(token=token).list_repo_files(repo_id, revision=revision)


def hub_allow_patterns(
    repo_files: Iterable[str],
    model_index: Mapping[str, Any],
    components: Iterable[str],
    *,
    variant: str | None = None,
    where: str = "",
    saved_quantized: Mapping[str, str] | None = None,
) -> list[str]:
    """The exact files of a repo listing that loading `components` needs: `model_index.json`, each component's
    configs and tokenizer files, and the weights `choose_weight_name` picks (plus their shards).

    `saved_quantized` maps a component to the name of its saved quantized params file
    (`components.quantized_file`, for the scheme a `quantize=` load asks for): where the repo's component folder
    has that file, it is fetched instead of the float weights, which that load would not open
    (`components.load_saved_quantized`; whether the file was made as the load quantizes is checked when it is read,
    as in a local folder). Elsewhere the weights are chosen as without it."""
    repo_files = list(repo_files)
    saved_quantized = dict(saved_quantized or {})
    entries = component_entries(model_index)
    patterns = [MODEL_INDEX]
    for name in components:
        if name not in entries:
            raise ValueError(f"{where}: component {name!r} is not in {MODEL_INDEX} (components: {sorted(entries)})")
        prefix = f"{name}/"
        names = {f[len(prefix) :] for f in repo_files if f.startswith(prefix) and "/" not in f[len(prefix) :]}
        if not names:
            raise FileNotFoundError(f"{where}: component folder {name}/ named in {MODEL_INDEX} is not in the repo")
        patterns += sorted(prefix + n for n in names if n.endswith(_SMALL_SUFFIXES) and not _INDEX_RE.match(n))
        if not any(n.endswith(_WEIGHT_SUFFIXES) for n in names):
            continue  # tokenizer, scheduler, feature extractor: configs only
        if saved_quantized.get(name) in names:
            patterns.append(prefix + saved_quantized[name])
            continue
        fmt, chosen, is_index, used = choose_weight_name(names, variant=variant, where=f"{where}/{name}")
        patterns.append(prefix + chosen)
        if is_index:
            patterns += [prefix + s for s in sorted(names) if _is_shard_of(s, chosen, used)]
    return patterns


def _is_shard_of(name: str, index_name: str, variant: str | None) -> bool:
    """Whether `name` is a shard of the index `index_name`, by the shard naming of diffusers/transformers:
    `{stem}-00001-of-00002.{ext}`, with a variant `{stem}.{V}-00001-of-00002.{ext}` or (older)
    `{stem}-00001-of-00002.{V}.{ext}`."""
    stem, ext = index_name.split(".")[0], ("safetensors" if ".safetensors" in index_name else "bin")
    num = r"-\d{5}-of-\d{5}"
    s, v = re.escape(stem), re.escape(variant) if variant else None
    pattern = rf"{s}{num}\.{ext}" if v is None else rf"(?:{s}\.{v}{num}\.{ext}|{s}{num}\.{v}\.{ext})"
    return re.fullmatch(pattern, name) is not None


def resolve_model_dir(
    path_or_repo_id: str | os.PathLike,
    *,
    revision: str | None = None,
    variant: str | None = None,
    local_files_only: bool = False,
    components: Iterable[str] | Callable[[dict[str, Any]], Iterable[str]] | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    saved_quantized: Mapping[str, str] | None = None,
) -> Path:
    """A local diffusers folder, or the local snapshot of a Hub repo id holding just the files needed.

    A local folder is returned as is. A repo id is listed once, then `huggingface_hub.snapshot_download` fetches
    only `model_index.json`, the configs/tokenizer files of `components` (names, or a function of the model index
    returning names; default: every non-null component) and the weight files `choose_weight_name` picks for
    `variant` — never both `.bin` and `.safetensors`, never other variants — or, for a component of
    `saved_quantized` (component -> file name) whose folder in the repo has that file, the file instead of its
    float weights (`hub_allow_patterns`). With `local_files_only=True` or `HF_HUB_OFFLINE=1` the snapshot comes
    from the HF cache without any network access (a saved quantized file there is read when the cache has it).
    """
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        validate_repo_id,
    )

    text = os.fspath(path_or_repo_id)
    local = Path(text).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repo ids; {local} is a local folder")
        return local
    if local.exists():
        raise NotADirectoryError(f"{local} is a file; expected a diffusers folder or a Hub repo id")
    try:
        validate_repo_id(text)
        if text.count("/") > 1 or text.startswith((".", "~")):
            raise HFValidationError("more than one '/'")
    except HFValidationError as e:
        raise FileNotFoundError(f"{text!r} is neither an existing folder nor a valid Hub repo id ({e})") from e

    where = f"{text}@{revision or 'main'}"
    offline = local_files_only or _hub_offline()
    common = dict(revision=revision, cache_dir=cache_dir, token=token)
    try:
        if offline:
            folder = Path(snapshot_download(text, local_files_only=True, **common))
            if not (folder / MODEL_INDEX).is_file():
                raise FileNotFoundError(f"{where}: the cached snapshot {folder} has no {MODEL_INDEX}")
            return folder
        repo_files = _list_repo_files(text, revision, token)
        if MODEL_INDEX not in repo_files:
            raise FileNotFoundError(
                f"{where}: not a diffusers pipeline repo: {MODEL_INDEX} not found (files: {_describe(repo_files[:30])})"
            )
        index_path = hf_hub_download(text, MODEL_INDEX, **common)
        model_index = read_model_index(Path(index_path).parent)
        if components is None:
            names = [n for n, (lib, cls) in component_entries(model_index).items() if lib is not None]
        else:
            names = list(components(model_index) if callable(components) else components)
        patterns = hub_allow_patterns(
            repo_files, model_index, names, variant=variant, where=where, saved_quantized=saved_quantized
        )
        logger.info("%s: downloading %d files", where, len(patterns))
        return Path(snapshot_download(text, allow_patterns=patterns, **common))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"{where}: not in the Hugging Face cache ({cache_dir or 'default cache'}) and "
            f"downloads are off (local_files_only=True or HF_HUB_OFFLINE=1): {e}"
        ) from e
    except GatedRepoError as e:
        raise PermissionError(f"{where}: gated repo; accept its license on the Hub and pass token= ({e})") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"{text!r}: no such local folder and no such Hub repo (or it is private: pass token=) ({e})"
        ) from e
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"{where}: revision {revision!r} not found ({e})") from e
    except EntryNotFoundError as e:
        raise FileNotFoundError(f"{where}: {e}") from e


# ---------------------------------------------------------------------------------------------------- configs only

# What single-file loading with `config=<repo>` needs from a diffusers repo: its configs and tokenizer files, never
# weights (diffusers' `from_single_file(config=...)` downloads the same set).
CONFIG_PATTERNS = (
    MODEL_INDEX,
    "*/config.json",
    "*/scheduler_config.json",
    "tokenizer*/*.json",
    "tokenizer*/*.txt",
)


def _hub_repo_id(text: str) -> str:
    """`text` checked to be a Hub repo id (`owner/name`), else a FileNotFoundError naming it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
        if text.count("/") != 1 or text.startswith((".", "~")):
            raise HFValidationError("expected owner/name")
    except HFValidationError as e:
        raise FileNotFoundError(f"{text!r} is neither an existing local path nor a valid Hub repo id ({e})") from e
    return text


def _snapshot(repo_id: str, patterns: list[str], **kwargs: Any) -> Path:
    """`huggingface_hub.snapshot_download` of `patterns`, its errors turned into ones that name the repo."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, **kwargs))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"{repo_id}: not in the Hugging Face cache and downloads are off ({e})") from e
    except GatedRepoError as e:
        raise PermissionError(f"{repo_id}: gated repo; accept its license on the Hub and pass token= ({e})") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(f"{repo_id!r}: no such Hub repo (or it is private: pass token=) ({e})") from e


def resolve_config_dir(
    path_or_repo_id: str | os.PathLike,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> Path:
    """A local diffusers folder, or a snapshot of a Hub repo with only `CONFIG_PATTERNS` (configs, tokenizer
    files): the architecture description single-file loading takes from `config=`. The folder must have a
    `model_index.json`."""
    text = os.fspath(path_or_repo_id)
    local = Path(text).expanduser()
    if not local.is_dir():
        if local.exists():
            raise NotADirectoryError(f"config={text!r} is a file; expected a diffusers folder or a Hub repo id")
        local = _snapshot(
            _hub_repo_id(text),
            list(CONFIG_PATTERNS),
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            local_files_only=local_files_only or _hub_offline(),
        )
    read_model_index(local)  # a clear error when it is not a pipeline folder
    return local


def resolve_component_dir(
    path_or_repo_id: str | os.PathLike,
    component: str,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> Path:
    """The folder of one model component (`config.json` + weights): a local folder that is the component itself or
    a pipeline folder with a `component/` subfolder, or the same on the Hub (e.g. `madebyollin/sdxl-vae-fp16-fix`,
    whose files are at the root), downloading only `config.json` and the weights `choose_weight_name` picks."""
    text = os.fspath(path_or_repo_id)
    local = Path(text).expanduser()
    if local.is_dir():
        for folder in (local, local / component):
            if (folder / "config.json").is_file():
                return folder
        raise FileNotFoundError(
            f"{local}: neither a {component} folder (config.json + weights) nor a pipeline folder with {component}/ "
            f"(files present: {_describe(p.name for p in local.iterdir())})"
        )
    repo_id = _hub_repo_id(text)
    common: dict[str, Any] = dict(revision=revision, cache_dir=cache_dir, token=token)
    if local_files_only or _hub_offline():
        snap = _snapshot(repo_id, ["config.json", f"{component}/config.json"], local_files_only=True, **common)
        sub = "" if (snap / "config.json").is_file() else f"{component}/"
        names = [p.name for p in (snap / sub).iterdir() if p.is_file()] if (snap / sub).is_dir() else []
    else:
        repo_files = _list_repo_files(repo_id, revision, token)
        sub = "" if "config.json" in repo_files else f"{component}/"
        if f"{sub}config.json" not in repo_files:
            raise FileNotFoundError(
                f"{repo_id}: no config.json at the root nor in {component}/ (files: {_describe(repo_files[:30])})"
            )
        names = [f[len(sub) :] for f in repo_files if f.startswith(sub) and "/" not in f[len(sub) :]]
    _, chosen, is_index, used = choose_weight_name(names, where=f"{repo_id}/{sub}")
    patterns = [f"{sub}config.json", f"{sub}{chosen}"]
    if is_index:
        patterns += [f"{sub}{n}" for n in sorted(names) if _is_shard_of(n, chosen, used)]
    snap = _snapshot(repo_id, patterns, local_files_only=local_files_only or _hub_offline(), **common)
    return snap / sub if sub else snap
