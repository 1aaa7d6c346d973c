"""Quantized params on disk: `save_quantized` writes the quantized components of a pipeline's params (int8 /
float8_e4m3fn kernels, their float32 `kernel_scale`, and the component's other leaves as they are) to one
safetensors file whose metadata names the scheme and the policy; `load_quantized` reads it back bit for bit and
checks it against the model it is meant for.

Keys are the params paths, `component/.../kernel` (the Flax layout, not diffusers' state-dict keys: the file is
sdjax's own cache of a quantized model, not a checkpoint for other tools). Metadata (safetensors' `__metadata__`,
strings): `format` ("sdjax.quant.params"), `version`, `scheme`, `components` and `policy` (JSON: the
`QuantPolicy` fields `scheme`, `components`, `min_size`, `exclude`, `compute`; a calibration stays in its own file,
`sdjax.quant.calibration`).

The safetensors layout is written and read here (8-byte little-endian header size, JSON header, raw little-endian
tensor bytes; this writer assumes a little-endian host, as every platform jax runs on is), because the `safetensors`
package's numpy and flax front ends do not take float8 arrays here; tensors are written one at a time and read
through a memory map, one host copy at a time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.quant import params as params_lib
from sdjax.quant import scheme as scheme_lib

FORMAT = "sdjax.quant.params"
VERSION = "1"

# safetensors dtype name <-> numpy dtype (bfloat16 and float8 through jax's ml_dtypes types)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        if not isinstance(k, str) or "/" in k:
            raise ValueError(f"params key {k!r} under {prefix}: expected a string without '/'")
        out.update(_flatten(v, f"{prefix}/{k}"))
    return out


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _policy_of(params: Mapping[str, Any], policy: params_lib.QuantPolicy | None) -> params_lib.QuantPolicy:
    """The policy to record: `policy` checked against `params`, or one inferred from the quantized kernels."""
    held = {c: params_lib.quantized_kernels(params[c]) for c in params if isinstance(params[c], Mapping)}
    held = {c: k for c, k in held.items() if k}
    components = tuple(policy.components) if policy is not None else tuple(sorted(held))
    if not components:
        raise ValueError("save_quantized(params): no component of params holds quantized kernels (quantize first)")
    for c in components:
        if c not in held:
            raise ValueError(f"save_quantized: params[{c!r}] holds no quantized kernels (or is missing)")
    schemes = {scheme_lib.scheme_of(q.dtype) for c in components for q, _ in held[c].values()}
    if len(schemes) != 1 or (policy is not None and schemes != {policy.scheme}):
        want = f" (the policy says {policy.scheme!r})" if policy is not None else ""
        raise ValueError(f"save_quantized: the kernels are quantized as {sorted(schemes)}{want}; one scheme per file")
    return policy if policy is not None else params_lib.QuantPolicy(schemes.pop(), components=components)


def save_quantized(
    params: Mapping[str, Any],
    path: str | os.PathLike,
    policy: params_lib.QuantPolicy | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write the quantized components of `params` (a pipeline's params after `quantize_pipeline`; `policy`: the
    `QuantPolicy` they were quantized with, or None to take the components holding quantized kernels and their
    scheme) to the safetensors file `path`: every leaf of those components, bit for bit. `metadata`: more string
    fields for the header (a loader's record of what the file was made from; `read_metadata` returns them)."""
    policy = _policy_of(params, policy)
    extra = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise TypeError(f"save_quantized(metadata={metadata!r}): expected string keys and values")
    flat = {}
    for c in policy.components:
        flat.update(_flatten(params[c], c))
    header: dict[str, Any] = {}
    offset = 0
    for key, leaf in flat.items():
        dtype = np.dtype(leaf.dtype)
        if dtype not in _NAMES:
            raise ValueError(f"save_quantized: {key} has dtype {dtype}, which this writer does not store")
        n = int(np.prod(leaf.shape)) * dtype.itemsize
        header[key] = {
            "dtype": _NAMES[dtype],
            "shape": [int(d) for d in leaf.shape],
            "data_offsets": [offset, offset + n],
        }
        offset += n
    fields = {"scheme": policy.scheme, "components": list(policy.components), "min_size": policy.min_size}
    fields.update(exclude=list(policy.exclude), compute=policy.compute)
    header["__metadata__"] = {
        "format": FORMAT,
        "version": VERSION,
        "scheme": policy.scheme,
        "components": json.dumps(list(policy.components)),
        "policy": json.dumps(fields),
    }
    clash = sorted(set(extra) & set(header["__metadata__"]))
    if clash:
        raise ValueError(f"save_quantized(metadata=...): {clash} are the file's own fields")
    header["__metadata__"].update(extra)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for leaf in flat.values():  # one tensor on the host at a time
            f.write(np.ascontiguousarray(np.asarray(leaf)).tobytes())


def _read_header(path: str) -> tuple[dict[str, Any], dict[str, str], int]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"quantized params file {path} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"quantized params file {path} is not a safetensors file (header size {n} > file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"quantized params file {path}: its safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"quantized params file {path}: its safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    return header, meta, 8 + n


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The safetensors metadata of a file written by `save_quantized` (its own fields and the caller's
    `metadata=`), read from the header alone; a file that is not one is refused naming it."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"quantized params file {path} does not exist")
    _, meta, _ = _read_header(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not an sdjax quantized params file (its metadata 'format' is not {FORMAT!r})")
    return dict(meta)


def _check_like(path: str, flat: Mapping[str, tuple[Any, tuple[int, ...]]], like: Mapping[str, Any], components):
    """The file's leaves (less the scales) against the model's (`like`: params or abstract params of the
    components): the same paths and shapes, or a ValueError naming the file and the first difference."""
    missing = [c for c in components if c not in like]
    if missing:
        raise ValueError(
            f"quantized params file {path} holds {missing}, which this model's params lack ({sorted(like)})"
        )
    model = {}
    for c in components:
        for key, leaf in _flatten(like[c], c).items():
            if not key.endswith("/" + params_lib.SCALE):
                model[key] = tuple(int(d) for d in np.shape(leaf))
    mine = {k: shape for k, (_, shape) in flat.items() if not k.endswith("/" + params_lib.SCALE)}
    for key in sorted(set(model) | set(mine)):
        if key not in mine:
            raise ValueError(f"quantized params file {path} is for another model: it lacks {key} {model[key]}")
        if key not in model:
            raise ValueError(f"quantized params file {path} is for another model: this model has no {key}")
        if mine[key] != model[key]:
            raise ValueError(
                f"quantized params file {path} is for another model: {key} has shape {mine[key]} there and "
                f"{model[key]} here"
            )


def load_quantized(
    path: str | os.PathLike, like: Mapping[str, Any] | None = None, scheme: str | None = None
) -> tuple[dict[str, Any], params_lib.QuantPolicy]:
    """Read a file written by `save_quantized` -> `(params, policy)`: `params` maps each component it holds to its
    params tree (jax arrays, the quantized kernels and scales as saved), `policy` is the `QuantPolicy` recorded
    with them. `scheme` ("int8" / "fp8"): the scheme expected (another is refused). `like`: the model's params, or
    abstract params (`jax.ShapeDtypeStruct`s, shapes only), of those components: the file must hold exactly their
    leaves (plus the scales) with the same shapes. Errors name the file and the first differing leaf; all checks
    run before any tensor is read. Pass the result to `quantize_pipeline(pipe, {**params, **loaded}, policy)`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"quantized params file {path} does not exist")
    if scheme is not None:
        scheme_lib.check_scheme(scheme, "scheme")
    header, meta, start = _read_header(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not an sdjax quantized params file (its metadata 'format' is not {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise ValueError(f"quantized params file {path}: version {meta.get('version')!r}, this sdjax reads {VERSION}")
    try:
        fields = json.loads(meta["policy"])
        policy = params_lib.QuantPolicy(
            fields["scheme"],
            components=tuple(fields["components"]),
            min_size=int(fields["min_size"]),
            exclude=tuple(fields["exclude"]),
            compute=fields["compute"],
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"quantized params file {path}: its metadata 'policy' is not a QuantPolicy ({e})") from None
    if scheme is not None and policy.scheme != scheme:
        raise ValueError(f"quantized params file {path} holds {policy.scheme} kernels, not {scheme}")
    flat = {}
    for key, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"quantized params file {path}: tensor {key} has a malformed header entry") from None
        if end - begin != int(np.prod(shape)) * dtype.itemsize or end + start > os.path.getsize(path):
            raise ValueError(f"quantized params file {path}: tensor {key}'s byte range does not match its shape")
        if key.split("/")[0] not in policy.components:
            raise ValueError(f"quantized params file {path}: tensor {key} is outside its components")
        flat[key] = (dtype, shape, begin)
    qtype = np.dtype(scheme_lib.SCHEMES[policy.scheme])
    for key, (dtype, shape, _) in flat.items():
        if key.endswith("/" + params_lib.SCALE):
            kernel = flat.get(key[: -len(params_lib.SCALE)] + params_lib.KERNEL)
            if kernel is None or kernel[0] != qtype or shape != kernel[1][-1:] or dtype != np.float32:
                raise ValueError(f"quantized params file {path}: {key} is not the float32 scale of a {qtype} kernel")
    if like is not None:
        _check_like(path, {k: (d, s) for k, (d, s, _) in flat.items()}, like, policy.components)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start)
    arrays = {}
    for key, (dtype, shape, begin) in flat.items():
        raw = data[begin : begin + int(np.prod(shape)) * dtype.itemsize]
        arrays[key] = jax.device_put(np.frombuffer(raw, dtype=dtype).reshape(shape).copy())
    del data
    return _unflatten(arrays), policy
