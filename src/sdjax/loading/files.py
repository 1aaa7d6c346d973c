"""Checkpoint files: diffusers folders, Hub repo ids, weight-file choice, safetensors and Flax msgpack readers.

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

`read_safetensors` parses the safetensors format itself (8-byte little-endian header size, JSON header, raw
little-endian data) so every dtype, bfloat16 included, reads without torch, and it reads one tensor per lookup:
peak memory stays near one copy of the weights. Truncated files, corrupt headers, duplicate keys across shards
and index files that name missing shards fail with the file named.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

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


class CheckpointError(ValueError):
    """A weight file that cannot be read as what it claims to be (truncated, corrupt, inconsistent shards)."""


class MissingWeightsError(FileNotFoundError):
    """A component folder without weight files sdjax can use (or without the requested variant)."""


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


def _describe(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "(no files)"


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


def _read_index(index: Path) -> dict[str, str]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: shard index is not readable JSON ({e})") from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: shard index has no 'weight_map' of key -> shard file")
    for shard in set(weight_map.values()):
        if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index}: shard name {shard!r} is not a file name in the same folder")
    return weight_map


def _index_shards(index: Path) -> list[str]:
    """The shard file names of an index, in first-use order; each must exist next to the index."""
    weight_map = _read_index(index)
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise MissingWeightsError(
            f"{index}: names shard file(s) that do not exist: {', '.join(missing)} "
            f"(files present: {_describe(p.name for p in index.parent.iterdir())})"
        )
    return shards


# ---------------------------------------------------------------------------------------------------- safetensors

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class _TensorInfo:
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def read_safetensors_header(path: str | Path) -> tuple[dict[str, _TensorInfo], dict[str, str]]:
    """Parse and check one safetensors file's header: `(tensor infos, __metadata__)`; reads no tensor data.

    Every tensor's byte range must lie inside the file and match its dtype and shape, so a truncated file fails
    here, naming the file, before anything is converted.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingWeightsError(f"weight file not found: {path}")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n <= 0 or n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{path}: corrupt or truncated safetensors header (header size {n}, file size {size} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    infos: dict[str, _TensorInfo] = {}
    for key, entry in header.items():
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except KeyError as e:
            if isinstance(entry, dict) and "dtype" in entry and entry["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {entry['dtype']}") from e
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {key!r}: {entry!r}") from e
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {key!r}: {entry!r}") from e
        nbytes = math.prod(shape) * dtype.itemsize
        if any(d < 0 for d in shape) or begin < 0 or end - begin != nbytes:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensor {key!r} {entry['dtype']}{list(shape)} "
                f"needs {nbytes} bytes but spans [{begin}, {end})"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {key!r} ends at byte "
                f"{data_start + end} but the file has {size} bytes"
            )
        infos[key] = _TensorInfo(path, dtype, shape, data_start + begin, nbytes)
    return infos, metadata


class SafetensorsReader(Mapping[str, np.ndarray]):
    """A read-only mapping key -> numpy array over one or more safetensors files.

    Headers are checked when the reader is made; each lookup reads that one tensor from disk into a fresh array
    (nothing is cached), so a caller converting tensor by tensor holds about one copy of the weights.
    bfloat16/float8 tensors come back with the `ml_dtypes` numpy dtypes.
    """

    def __init__(self, infos: dict[str, _TensorInfo], metadata: dict[str, dict[str, str]]):
        self._infos = infos
        self.metadata = metadata  # per file name

    def __getitem__(self, key: str) -> np.ndarray:
        info = self._infos[key]
        out = np.empty(info.shape, info.dtype)
        buf = out.reshape(-1).view(np.uint8)
        try:
            with info.path.open("rb") as f:
                f.seek(info.start)
                got = f.readinto(buf)
        except OSError as e:
            raise CheckpointError(f"{info.path}: cannot read tensor {key!r} ({e})") from e
        if got != info.nbytes:
            raise CheckpointError(
                f"{info.path}: truncated while reading tensor {key!r} ({got} of {info.nbytes} "
                f"bytes); the file changed since its header was checked"
            )
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._infos[key].shape

    def dtype(self, key: str) -> np.dtype:
        return self._infos[key].dtype

    def file_of(self, key: str) -> Path:
        return self._infos[key].path

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())


def read_safetensors(paths: str | Path | Iterable[str | Path]) -> SafetensorsReader:
    """Open safetensors weights lazily: one file, several shards, or a `*.safetensors.index*.json` index.

    With an index every shard it names must exist and hold exactly the keys the index maps to it. A key found in
    two files is an error naming both.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    expected: dict[str, str] | None = None
    if len(paths) == 1 and paths[0].name.endswith(".json"):
        index = paths[0]
        if not index.is_file():
            raise MissingWeightsError(f"shard index not found: {index}")
        expected = _read_index(index)
        paths = [index.parent / s for s in _index_shards(index)]
    infos: dict[str, _TensorInfo] = {}
    metadata: dict[str, dict[str, str]] = {}
    for path in paths:
        file_infos, metadata[path.name] = read_safetensors_header(path)
        for key, info in file_infos.items():
            if key in infos:
                raise CheckpointError(f"tensor {key!r} is stored twice: in {infos[key].path} and in {path}")
            infos[key] = info
    if expected is not None:
        wrong = [
            f"{k} (index: {s}, found in: {infos[k].path.name if k in infos else 'no shard'})"
            for k, s in expected.items()
            if k not in infos or infos[k].path.name != s
        ]
        extra = [f"{k} (in {infos[k].path.name})" for k in infos if k not in expected]
        if wrong or extra:
            raise CheckpointError(
                f"{index}: the shards do not match the index: "
                + "; ".join(wrong[:10] + [f"not in the index: {e}" for e in extra[:10]])
            )
    return SafetensorsReader(infos, metadata)


# ---------------------------------------------------------------------------------------------------- flax msgpack


def read_flax_msgpack(path: str | Path) -> dict[str, Any]:
    """Read a Flax `msgpack` checkpoint (`flax.serialization.to_bytes` of a params dict) -> nested dict of numpy.

    The whole file is read at once (msgpack has no index), so peak memory is about twice the file. A top-level
    `{"params": ...}` wrapper is removed. The names inside are the old diffusers/transformers Flax names: convert
    them with `flax_params_to_sdjax`.
    """
    from flax import serialization

    path = Path(path)
    if not path.is_file():
        raise MissingWeightsError(f"weight file not found: {path}")
    try:
        tree = serialization.msgpack_restore(path.read_bytes())
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise CheckpointError(f"{path}: not a readable Flax msgpack checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(tree, dict) or not tree:
        raise CheckpointError(f"{path}: Flax msgpack checkpoint does not hold a params dict")
    if set(tree) == {"params"} and isinstance(tree["params"], dict):
        tree = tree["params"]
    return tree


# Old Flax param names -> sdjax names, per model family: (regex on the '/'-joined path, replacement). sdjax paths
# mirror the current PyTorch state-dict keys (`models.convert.torch_key_to_path`); the old Flax modules differed
# from them only here (checked against diffusers 0.35 / transformers 4.57 Flax modules built from the tiny test
# configs: every other path of the UNet, VAE and CLIP text models is identical).
FLAX_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    # transformers FlaxCLIPTextModel[WithProjection]: encoder layers were a collection named "0", "1", ...
    "clip": ((r"^text_model/encoder/layers/(\d+)/", r"text_model/encoder/layers_\1/"),),
    # diffusers FlaxUNet2DConditionModel: the attention Dense layers were already named to_q/to_k/to_v/to_out_0.
    "unet": (),
    # diffusers FlaxAutoencoderKL: the mid-block attention kept the pre-0.14 names query/key/value/proj_attn.
    "vae": (
        (r"/attentions_(\d+)/query/", r"/attentions_\1/to_q/"),
        (r"/attentions_(\d+)/key/", r"/attentions_\1/to_k/"),
        (r"/attentions_(\d+)/value/", r"/attentions_\1/to_v/"),
        (r"/attentions_(\d+)/proj_attn/", r"/attentions_\1/to_out_0/"),
    ),
    # diffusers FlaxStableDiffusionSafetyChecker: a transformers CLIP vision tower, layers named "0", "1", ...
    "safety_checker": (
        (r"^vision_model/vision_model/encoder/layers/(\d+)/", r"vision_model/vision_model/encoder/layers_\1/"),
    ),
}


def flax_params_to_sdjax(
    tree: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    family: str,
    component: str,
    cast: Callable[[np.ndarray], Any] | None = None,
) -> dict[str, Any]:
    """Rename an old-Flax params tree (`read_flax_msgpack`) into the sdjax layout; no transposes (both are Flax).

    `family` picks the rename table in `FLAX_RENAMES` ("clip", "unet", "vae"); `expected` is the params shape
    tree of the sdjax model. If the sdjax model has no top-level `text_model` scope the CLIP prefix is dropped.
    Every missing, unexpected or mis-shaped key raises `WeightLoadError`, as for PyTorch weights.
    """
    from flax.traverse_util import flatten_dict, unflatten_dict

    from sdjax.models.convert import WeightLoadError

    if family not in FLAX_RENAMES:
        raise ValueError(
            f"{component}: no old-Flax naming table for model family {family!r} "
            f"(known: {sorted(FLAX_RENAMES)}); convert this checkpoint to safetensors"
        )
    renames = [(re.compile(p), r) for p, r in FLAX_RENAMES[family]]
    want = {"/".join(k): tuple(v.shape) for k, v in flatten_dict(dict(expected)).items()}
    strip_text_model = family == "clip" and not any(k.startswith("text_model/") for k in want)
    out: dict[tuple[str, ...], Any] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    misshaped: list[str] = []
    for old_path, value in flatten_dict(dict(tree)).items():
        old = "/".join(str(p) for p in old_path)
        new = old
        for pattern, repl in renames:
            new = pattern.sub(repl, new)
        if strip_text_model and new.startswith("text_model/"):
            new = new[len("text_model/") :]
        if new not in want or new in seen:
            unexpected.append(old if new not in seen else f"{old} (a second key for {new})")
            continue
        seen.add(new)
        value = np.asarray(value)
        if tuple(value.shape) != want[new]:
            misshaped.append(f"{old}: checkpoint {tuple(value.shape)} vs model {want[new]} at {new}")
            continue
        out[tuple(new.split("/"))] = cast(value) if cast is not None else value
    missing = sorted(k for k in want if k not in seen)
    if missing or unexpected or misshaped:
        raise WeightLoadError(component, missing, sorted(unexpected), misshaped)
    return unflatten_dict(out)


# ---------------------------------------------------------------------------------------------------- torch .bin


def read_torch_bin(paths: Iterable[str | Path]) -> Mapping[str, np.ndarray]:
    """Read PyTorch pickle weights (`*.bin`) as numpy arrays. The one place sdjax imports torch, and only when a
    folder holds nothing else; `torch.load(weights_only=True, mmap=True)` keeps arbitrary pickles out."""
    import torch

    out: dict[str, np.ndarray] = {}
    for path in paths:
        path = Path(path)
        if path.name.endswith(".json"):
            paths_ = [path.parent / s for s in _index_shards(path)]
            out.update(read_torch_bin(paths_))
            continue
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from e
        for key, t in sd.items():
            if key in out:
                raise CheckpointError(f"tensor {key!r} is stored twice (second time in {path})")
            t = t.detach().cpu()
            if t.dtype == torch.bfloat16:
                out[key] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            else:
                out[key] = t.numpy()
    return out


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
) -> list[str]:
    """The exact files of a repo listing that loading `components` needs: `model_index.json`, each component's
    configs and tokenizer files, and the weights `choose_weight_name` picks (plus their shards)."""
    repo_files = list(repo_files)
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
) -> Path:
    """A local diffusers folder, or the local snapshot of a Hub repo id holding just the files needed.

    A local folder is returned as is. A repo id is listed once, then `huggingface_hub.snapshot_download` fetches
    only `model_index.json`, the configs/tokenizer files of `components` (names, or a function of the model index
    returning names; default: every non-null component) and the weight files `choose_weight_name` picks for
    `variant` — never both `.bin` and `.safetensors`, never other variants. With `local_files_only=True` or
    `HF_HUB_OFFLINE=1` the snapshot comes from the HF cache without any network access.
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
        patterns = hub_allow_patterns(repo_files, model_index, names, variant=variant, where=where)
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
