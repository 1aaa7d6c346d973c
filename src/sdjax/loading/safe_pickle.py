"""Read PyTorch `torch.save` checkpoints (`.ckpt`, `.pt`, `.pth`, `.bin`) without torch and without running code.

A pickle is a small program: unpickling it may import any module and call any function it names, so a
downloaded `.ckpt` can run code on the machine that opens it (the reason civitai and the Hugging Face Hub moved to
safetensors). sdjax refuses pickles unless the caller passes `allow_pickle=True`, and even then reads them with a
restricted unpickler:

- `pickle.Unpickler.find_class` is the only way a pickle reaches a Python object by name (the GLOBAL, STACK_GLOBAL,
  INST, OBJ and EXT opcodes all go through it). Here it returns sdjax's own inert stand-ins for the handful of names
  a weights file needs (`torch._utils._rebuild_tensor_v2` and friends, `torch.FloatStorage`-style storage types,
  `torch` dtypes, `torch.Size`, `collections.OrderedDict`, and numpy scalars as Lightning writes them) and raises
  `UnsafePickleError` for every other name, before anything is imported or called. No real torch function runs.
- Storages are never unpickled: `torch.save` writes each as a raw byte record `<archive>/data/<key>` in a zip file
  and the pickle refers to it by a persistent id `("storage", StorageType, key, location, numel)`;
  `persistent_load` turns that into a lazy handle.

Layout of the zip written by `torch.save` since PyTorch 1.6: `<archive>/data.pkl` (the pickle), `<archive>/data/<key>`
(one record per storage, little-endian), `<archive>/byteorder`, `<archive>/version`. Tensors come back as a mapping
key -> numpy array that reads each tensor's storage when it is looked up (nothing cached), so converting tensor by
tensor holds about one copy of the weights. The pre-1.6 format (one pickle stream with the storages appended) is not
read: re-save such a file with a current PyTorch, or better, convert it to safetensors.
"""

from __future__ import annotations

import codecs
import collections
import io
import math
import pickle
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle that asks for something the restricted unpickler does not allow (it may run code)."""


class PickleFormatError(ValueError):
    """A file that is not a readable `torch.save` zip checkpoint (truncated, corrupt, legacy format)."""


# torch's storage classes as pickled by `torch.save` (`torch.FloatStorage`, ...) -> numpy dtype of the elements.
STORAGE_DTYPES: dict[str, np.dtype] = {
    "DoubleStorage": np.dtype("<f8"),
    "FloatStorage": np.dtype("<f4"),
    "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
    "UntypedStorage": np.dtype("u1"),
}
# torch dtype objects may appear as plain values (e.g. in metadata); they are kept as their name.
TORCH_DTYPE_NAMES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "double",
        "float",
        "half",
        "long",
        "int",
        "short",
    }
)


@dataclass(frozen=True)
class _StorageType:
    name: str
    dtype: np.dtype


@dataclass(frozen=True)
class TorchDtype:
    """A `torch.<name>` dtype met as a value in the pickle."""

    name: str


@dataclass
class _Storage:
    record: str  # zip member name
    dtype: np.dtype
    numel: int


@dataclass
class LazyTensor:
    """One tensor of the checkpoint: a strided view into a storage record, read on demand."""

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise UnsafePickleError(f"tensor {what} must be a tuple of ints, got {value!r}")
    return value


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored):
    """Stand-in for `torch._utils._rebuild_tensor[_v2]`: no torch, only a `LazyTensor` description."""
    if not isinstance(storage, _Storage):
        raise UnsafePickleError(f"tensor rebuilt from {type(storage).__name__}, not from a storage record")
    if not isinstance(storage_offset, int) or storage_offset < 0:
        raise UnsafePickleError(f"bad tensor storage offset {storage_offset!r}")
    shape, stride = _ints(tuple(size), "size"), _ints(tuple(stride), "stride")
    if len(shape) != len(stride) or any(d < 0 for d in shape) or any(s < 0 for s in stride):
        raise UnsafePickleError(f"bad tensor geometry: size {shape}, stride {stride}")
    if math.prod(shape) and storage_offset + sum((d - 1) * s for d, s in zip(shape, stride)) >= storage.numel:
        raise PickleFormatError(
            f"tensor of size {shape}, stride {stride}, offset {storage_offset} reaches past its storage "
            f"{storage.record} of {storage.numel} elements"
        )
    return LazyTensor(storage, storage_offset, shape, stride)


def _rebuild_parameter(data, requires_grad=None, backward_hooks=None, state=None):
    """Stand-in for `torch._utils._rebuild_parameter[_with_state]`: a Parameter is its data."""
    if not isinstance(data, LazyTensor):
        raise UnsafePickleError(f"parameter rebuilt from {type(data).__name__}, not from a tensor")
    return data


def _torch_size(values=()):
    return _ints(tuple(values), "size")


def _numpy_dtype(name, align=False, copy=False):
    if not isinstance(name, str):
        raise UnsafePickleError(f"numpy dtype from {type(name).__name__}")
    dtype = np.dtype(name)
    if dtype.hasobject:
        raise UnsafePickleError(f"numpy dtype {name!r} holds Python objects")
    return dtype


def _numpy_scalar(dtype, data=None):
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise UnsafePickleError("numpy scalar with an object dtype or non-bytes data")
    return np.frombuffer(data, dtype, count=1)[0].item()


def _codecs_encode(text, encoding="utf-8"):
    # How protocol-2 pickles spell `bytes` (numpy scalars written by Lightning): `_codecs.encode(str, "latin1")`.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not a bytes literal")
    return codecs.encode(text, "latin1")


def _allowed(module: str, name: str) -> Any:
    """The stand-in object for a global the pickle names, or None when it is not allowed."""
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
        return _rebuild_tensor
    if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        return _rebuild_parameter
    if module == "torch" and name in STORAGE_DTYPES:
        return _StorageType(name, STORAGE_DTYPES[name])
    if module == "torch" and name in TORCH_DTYPE_NAMES:
        return TorchDtype(name)
    if module == "torch" and name == "Size":
        return _torch_size
    if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "scalar":
        return _numpy_scalar
    if module == "numpy" and name == "dtype":
        return _numpy_dtype
    if module == "_codecs" and name == "encode":
        return _codecs_encode
    return None


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only the allow-listed names above and reads storages lazily from `zf`."""

    def __init__(self, file, *, zf: zipfile.ZipFile, prefix: str, source: str):
        super().__init__(file)
        self._zf, self._prefix, self._source = zf, prefix, source
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise UnsafePickleError(
                f"{self._source}: the pickle asks for {module}.{name}, which sdjax's restricted unpickler does not "
                f"allow: it rebuilds only tensors, dicts and plain values, so this file holds something else and "
                f"may run code when opened with torch.load. Do not load it unless you trust its source; if you do, "
                f"convert it to safetensors in a sandbox"
            )
        return obj

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"{self._source}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not isinstance(numel, int):
            raise UnsafePickleError(f"{self._source}: malformed storage reference {pid!r}")
        if key not in self._storages:
            record = f"{self._prefix}data/{key}"
            try:
                info = self._zf.getinfo(record)
            except KeyError:
                raise PickleFormatError(f"{self._source}: storage record {record} is missing") from None
            if info.file_size != numel * storage_type.dtype.itemsize:
                raise PickleFormatError(
                    f"{self._source}: storage record {record} holds {info.file_size} bytes, expected "
                    f"{numel} x {storage_type.dtype.itemsize} ({storage_type.name})"
                )
            self._storages[key] = _Storage(record, storage_type.dtype, numel)
        return self._storages[key]


class TorchCheckpoint(Mapping[str, np.ndarray]):
    """The tensors of a `torch.save` zip checkpoint as a read-only mapping key -> numpy array.

    Keys are the state-dict keys: a top-level `{"state_dict": ...}` (Lightning checkpoints, nested any number of
    times) is unwrapped. The other top-level entries that are plain values (`global_step`, `epoch`, ...) are in
    `extras`. Each lookup reads that tensor's storage record (bfloat16 as `ml_dtypes.bfloat16`).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._zf, tree = _open(self.path)
        self.extras: dict[str, Any] = {}
        while isinstance(tree, dict) and isinstance(tree.get("state_dict"), dict):
            self.extras.update({k: v for k, v in tree.items() if k != "state_dict" and _is_plain(v)})
            tree = tree["state_dict"]
        if not isinstance(tree, dict):
            raise PickleFormatError(f"{self.path}: holds a {type(tree).__name__}, not a state dict")
        self._tensors = {k: v for k, v in tree.items() if isinstance(k, str) and isinstance(v, LazyTensor)}
        self.extras.update({k: v for k, v in tree.items() if isinstance(k, str) and _is_plain(v)})
        if not self._tensors:
            raise PickleFormatError(f"{self.path}: the checkpoint holds no tensors")

    def __getitem__(self, key: str) -> np.ndarray:
        return _read_tensor(self._zf, self._tensors[key], self.path, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._tensors[key].shape

    def dtype(self, key: str) -> np.dtype:
        return self._tensors[key].dtype

    def close(self) -> None:
        self._zf.close()


def _read_tensor(zf: zipfile.ZipFile, t: LazyTensor, path: Path, key: str) -> np.ndarray:
    """One tensor's values from its storage record (a compact copy when it views part of a storage)."""
    s = t.storage
    itemsize = s.dtype.itemsize
    buf = np.empty(s.numel, s.dtype)
    try:
        with zf.open(s.record) as f:
            got = f.readinto(buf.reshape(-1).view(np.uint8))
    except (OSError, zipfile.BadZipFile, EOFError) as e:  # CRC errors and short reads of damaged files
        raise PickleFormatError(f"{path}: cannot read tensor {key!r} ({type(e).__name__}: {e})") from e
    if got != s.numel * itemsize:
        raise PickleFormatError(f"{path}: truncated storage for tensor {key!r} ({got} bytes read)")
    contiguous = tuple(int(math.prod(t.shape[i + 1 :])) for i in range(len(t.shape)))
    n = math.prod(t.shape)
    if t.offset == 0 and n == s.numel and (t.stride == contiguous or n <= 1):
        return buf.reshape(t.shape)
    view = np.lib.stride_tricks.as_strided(
        buf[t.offset :], shape=t.shape, strides=tuple(x * itemsize for x in t.stride), writeable=False
    )
    return np.array(view)  # a compact copy of the view (the storage may be shared with other tensors)


def read_torch_object(path: str | Path) -> Any:
    """Everything a small `torch.save` file holds (e.g. an A1111 embedding: nested dicts of tensors and plain
    values), read with the restricted unpickler, each tensor as a numpy array."""
    path = Path(path)
    zf, tree = _open(path)

    def load(node: Any, where: str) -> Any:
        if isinstance(node, LazyTensor):
            return _read_tensor(zf, node, path, where)
        if isinstance(node, dict):
            return {k: load(v, f"{where}.{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(load(v, f"{where}[{i}]") for i, v in enumerate(node))
        return node

    try:
        return load(tree, "")
    finally:
        zf.close()


def _is_plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def _open(path: Path) -> tuple[zipfile.ZipFile, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with path.open("rb") as f:
        head = f.read(4)
    if head[:2] == b"\x80\x02" or head[:1] == b"\x80":
        raise PickleFormatError(
            f"{path}: a PyTorch checkpoint in the legacy (pre-1.6) torch.save format, which sdjax does not read. "
            f"Re-save it with a current PyTorch, or better convert it to safetensors"
        )
    if head != b"PK\x03\x04":
        raise PickleFormatError(f"{path}: not a torch.save zip archive (starts with {head!r})")
    try:
        zf = zipfile.ZipFile(path)
        names = zf.namelist()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise PickleFormatError(f"{path}: corrupt or truncated torch.save archive ({e})") from e
    pkl = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        zf.close()
        raise PickleFormatError(f"{path}: not a torch.save archive (no single <name>/data.pkl; entries: {names[:8]})")
    prefix = pkl[0][: -len("data.pkl")]
    if f"{prefix}byteorder" in names and zf.read(f"{prefix}byteorder").strip() not in (b"little", b""):
        zf.close()
        raise PickleFormatError(f"{path}: written on a big-endian machine; sdjax reads little-endian checkpoints")
    try:
        data = zf.read(pkl[0])
        tree = RestrictedUnpickler(io.BytesIO(data), zf=zf, prefix=prefix, source=str(path)).load()
    except UnsafePickleError:
        zf.close()
        raise
    except PickleFormatError:
        zf.close()
        raise
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError, TypeError, IndexError) as e:
        zf.close()
        raise PickleFormatError(f"{path}: corrupt pickle in the checkpoint ({type(e).__name__}: {e})") from e
    return zf, tree


def read_torch_checkpoint(path: str | Path) -> TorchCheckpoint:
    """Open a `torch.save` zip checkpoint with the restricted unpickler (see the module docstring)."""
    return TorchCheckpoint(path)
