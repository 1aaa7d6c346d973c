"""Weight-file readers: safetensors, Flax msgpack and PyTorch `.bin` files, and the shard indexes of sharded weights.

`read_safetensors` parses the safetensors format itself (8-byte little-endian header size, JSON header, raw
little-endian data) so every dtype, bfloat16 included, reads without torch, and it reads one tensor per lookup:
peak memory stays near one copy of the weights. Truncated files, corrupt headers, duplicate keys across shards
and index files that name missing shards fail with the file named. `read_flax_msgpack` reads the old
diffusers/transformers Flax checkpoints and `flax_params_to_sdjax` renames them; `read_torch_bin` is the one place
sdjax imports torch. Which files of a folder to read is `files.select_weight_files`'s choice.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A weight file that cannot be read as what it claims to be (truncated, corrupt, inconsistent shards)."""


class MissingWeightsError(FileNotFoundError):
    """A component folder without weight files sdjax can use (or without the requested variant)."""


def _describe(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "(no files)"


# ---------------------------------------------------------------------------------------------------- shard indexes


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
