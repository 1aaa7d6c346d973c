"""PyTorch state dict -> Flax params, by one rule and a small table of exceptions.

sdjax names every Flax submodule after the PyTorch attribute it mirrors, so a state-dict key maps to a Flax
param path mechanically: split at dots, fuse list indices into the name before them
(`down_blocks.0.resnets.1.conv1.weight` -> `down_blocks_0/resnets_1/conv1/weight`). The leaf `weight`
becomes whatever the Flax module calls it, with PyTorch's layout changed to Flax's:

- Linear `weight (out, in)` -> `kernel (in, out)`
- Conv `weight (O, I, H, W)` -> `kernel (H, W, I, O)`
- LayerNorm / GroupNorm `weight` -> `scale`; Embedding `weight` -> `embedding`

Each model passes `renames` (regex, replacement) for keys whose names differ between checkpoint generations
and `ignore` for buffers that are not parameters. Every missing, unexpected or mis-shaped key fails the load
and is reported by name.

Reading and casting overlap: the state dict is read in the calling thread, key by key (so any Mapping works, thread
safe or not), while up to `CAST_WORKERS` threads cast the tensors already read (the layout copy, the rounding, the
transfer to the device: numpy and XLA release the GIL for these), with at most `2 * CAST_WORKERS` casts waiting,
so that host memory stays near one copy of the weights.

`contiguous` is the copy a cast makes of the transposed view: numpy copies a transposed array element by element in
the output's order, reading the input a cache line per element, so it goes block by block instead (SD 1.5's
kernels about 2x faster); and it allocates 64-byte aligned, which lets `jax.device_put` on CPU adopt the buffer
instead of copying it once more.
"""

from __future__ import annotations

import math
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

Path_ = tuple[str, ...]
CAST_WORKERS = min(4, os.cpu_count() or 1)  # threads casting converted tensors while the next ones are read
ALIGN = 64  # bytes; XLA's CPU client adopts a host buffer aligned so without copying it
# (rows, columns) of the last two axes per block of a transposing copy, by rank: a conv kernel's HWIO view goes 16
# input channels at a time (its source rows then stay in L2 across the 3x3 taps), a linear kernel's in 256 x 256
# tiles. On SD 1.5's kernels, 1.1-1.8x faster than 128 x 128 blocks for both (three alternating runs).
BLOCKS = {2: (256, 256), 4: (16, 1024)}


class WeightLoadError(ValueError):
    """The weights do not fit the model built from the config; lists every offending key."""

    def __init__(self, component: str, missing: list[str], unexpected: list[str], misshaped: list[str]):
        self.missing, self.unexpected, self.misshaped = missing, unexpected, misshaped
        lines = [f"{component}: the weights do not match the model built from its config"]
        for title, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if keys:
                shown = keys[:20] + ([f"... and {len(keys) - 20} more"] if len(keys) > 20 else [])
                lines.append(f"  {title} ({len(keys)}): " + ", ".join(shown))
        super().__init__("\n".join(lines))


def torch_key_to_path(key: str) -> Path_:
    """`a.b.0.c.weight` -> `("a", "b_0", "c", "weight")`."""
    out: list[str] = []
    for part in key.split("."):
        if part.isdigit() and out:
            out[-1] = f"{out[-1]}_{part}"
        else:
            out.append(part)
    return tuple(out)


def _to_flax_layout(leaf: str, value: np.ndarray) -> np.ndarray:
    if leaf == "kernel":
        if value.ndim == 2:
            return value.T
        if value.ndim == 4:
            return value.transpose(2, 3, 1, 0)
    return value


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an `ALIGN`-byte boundary (numpy only aligns to 16)."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + n].view(dtype).reshape(shape)


def contiguous(x: np.ndarray, dtype: Any) -> np.ndarray:
    """A new C-contiguous, `ALIGN`-aligned copy of `x` cast to `dtype`, element for element what
    `np.ascontiguousarray(x, dtype)` gives (the same numpy cast; only the order of the copy differs).

    The views `_to_flax_layout` makes (a linear kernel's `.T`, a conv kernel's OIHW -> HWIO) are copied in blocks
    of their last two axes (`BLOCKS`), so that the strided reads of one block stay in cache."""
    x = np.asarray(x)
    out = aligned_empty(x.shape, dtype)
    transposed = (x.ndim == 2 and x.T.flags.c_contiguous) or (
        x.ndim == 4 and x.transpose(3, 2, 0, 1).flags.c_contiguous
    )
    if not transposed or x.size < 2**16:
        np.copyto(out, x, casting="unsafe")
        return out
    (rows, cols), (r, c) = x.shape[-2:], BLOCKS[x.ndim]
    for i in range(0, rows, r):
        for j in range(0, cols, c):
            np.copyto(out[..., i : i + r, j : j + c], x[..., i : i + r, j : j + c], casting="unsafe")
    return out


def convert_state_dict(
    state_dict: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    component: str,
    renames: Iterable[tuple[str, str]] = (),
    ignore: Iterable[str] = (),
    cast: Callable[[np.ndarray], Any] | None = None,
) -> dict[str, Any]:
    """Convert `state_dict` (name -> array, read lazily key by key) into a nested Flax params dict.

    `expected` is the params tree the Flax model wants (arrays or `jax.ShapeDtypeStruct`s, e.g. from
    `jax.eval_shape(model.init, ...)["params"]`). `cast` turns each converted numpy array into the stored
    leaf (e.g. a jnp array of the requested dtype); it runs on a few tensors at a time, in threads beside the
    reading (module doc), so that peak host memory stays near one copy of the weights. A `cast` with a true
    `takes_path` attribute is called as `cast(value, path=path)` with the leaf's params path (a tuple of names),
    e.g. to quantize selected kernels as they are converted (`sdjax.quant.loading`); a cast must be safe to call
    from several threads at once. Raises `WeightLoadError` listing every missing, unexpected and mis-shaped key.
    """
    renames = [(re.compile(p), r) for p, r in renames]
    ignore = [re.compile(p) for p in ignore]
    want: dict[Path_, tuple[int, ...]] = {k: tuple(v.shape) for k, v in flatten_dict(dict(expected)).items()}
    out: dict[Path_, Any] = {}
    unexpected: list[str] = []
    misshaped: list[str] = []
    seen: set[Path_] = set()
    takes_path = getattr(cast, "takes_path", False)
    in_flight: deque[tuple[Path_, Future]] = deque()  # casts submitted, in reading order
    with ThreadPoolExecutor(CAST_WORKERS, thread_name_prefix="sdjax-cast") as pool:

        def settle(limit: int) -> None:
            while len(in_flight) > limit:
                path, future = in_flight.popleft()
                out[path] = future.result()

        try:
            for key in state_dict:
                if any(p.fullmatch(key) for p in ignore):
                    continue
                name = key
                for pattern, repl in renames:
                    name = pattern.sub(repl, name)
                path = torch_key_to_path(name)
                if path[-1] == "weight":
                    options = [path[:-1] + (leaf,) for leaf in ("kernel", "scale", "embedding", "weight")]
                    path = next((p for p in options if p in want), path)
                if path not in want:
                    unexpected.append(key)
                    continue
                if path in seen:
                    raise WeightLoadError(component, [], [f"{key} (a second key for {'/'.join(path)})"], [])
                seen.add(path)
                raw = np.asarray(state_dict[key])
                value = _to_flax_layout(path[-1], raw)
                if tuple(value.shape) != want[path]:
                    misshaped.append(
                        f"{key}: checkpoint {tuple(raw.shape)} (as Flax {tuple(value.shape)}) vs model "
                        f"{want[path]} at {'/'.join(path)}"
                    )
                    continue
                if cast is None:
                    out[path] = value
                else:
                    args = {"path": path} if takes_path else {}
                    in_flight.append((path, pool.submit(cast, value, **args)))
                    settle(2 * CAST_WORKERS)
                del raw, value  # the cast holds this tensor's host copy until it is done
            settle(0)
        finally:
            for _, future in in_flight:  # an error: the casts not started are dropped
                future.cancel()
    missing = ["/".join(p) for p in want if p not in seen]
    if missing or unexpected or misshaped:
        raise WeightLoadError(component, sorted(missing), sorted(unexpected), misshaped)
    return unflatten_dict(out)


# ------------------------------------------------------------------------------ the inverse: params -> state dict
# PyTorch `nn.ModuleList` / `nn.Sequential` attributes in diffusers' UNet2DConditionModel and AutoencoderKL and in
# transformers' CLIPTextModel: their index is a key segment of its own (`resnets.0`), not part of the name.
LIST_ATTRIBUTES = frozenset(
    {
        "down_blocks",
        "up_blocks",
        "resnets",
        "attentions",
        "downsamplers",
        "upsamplers",
        "transformer_blocks",
        "to_out",
        "net",
        "layers",
    }
)
_INDEXED = re.compile(r"^(.*)_(\d+)$")


class ExportError(ValueError):
    """Params that cannot be written as a PyTorch state dict (a leaf or name sdjax does not know)."""


def path_to_torch_key(path: tuple[str, ...]) -> str:
    """`("down_blocks_0", "resnets_1", "conv1", "kernel")` -> `"down_blocks.0.resnets.1.conv1.weight"`."""
    parts = []
    for segment in path[:-1]:
        m = _INDEXED.match(segment)
        if m and m.group(1) in LIST_ATTRIBUTES:
            parts += [m.group(1), m.group(2)]
        else:
            parts.append(segment)
    leaf = path[-1]
    if leaf in ("kernel", "scale", "embedding", "weight"):
        parts.append("weight")
    elif leaf == "bias":
        parts.append("bias")
    else:
        raise ExportError(f"cannot name param {'/'.join(path)} in PyTorch: unknown leaf {leaf!r}")
    return ".".join(parts)


def _to_torch_layout(leaf: str, value: np.ndarray) -> np.ndarray:
    if leaf == "kernel":
        if value.ndim == 2:
            return value.T
        if value.ndim == 4:
            return value.transpose(3, 2, 0, 1)
        raise ExportError(f"kernel of rank {value.ndim} has no PyTorch layout rule")
    return value


def params_to_state_dict(params: Mapping[str, Any], *, dtype=np.float32) -> dict[str, np.ndarray]:
    """Flax params -> PyTorch state dict (contiguous numpy arrays of `dtype`), the inverse of
    `convert_state_dict`. Raises `ExportError` if two params map to one key."""
    out: dict[str, np.ndarray] = {}
    for path, value in flatten_dict(dict(params)).items():
        key = path_to_torch_key(path)
        if key in out:
            raise ExportError(f"two params map to the PyTorch key {key!r} (the second is {'/'.join(path)})")
        arr = _to_torch_layout(path[-1], np.asarray(value))
        out[key] = np.ascontiguousarray(arr.astype(dtype))
    return out
