"""Sharding by one table: a `Mesh` with a `data` axis (the batch) and an optional `model` axis (the weights).

Every param gets a `PartitionSpec` from the first rule whose regex matches its path (`unet/down_blocks_0/...`).
Rules name the dimension of a param that holds its "features" (Flax layouts: Dense kernel `(in, out)`, Conv kernel
`(h, w, in, out)`); a dimension that does not divide by the `model` axis stays replicated, so every table is valid
for every model. Under `jit`, XLA's SPMD partitioner adds the collectives; the numbers do not change.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"

# (regex on the "/"-joined param path, axes of the param's dims; None = replicated along that dim).
# Projections into attention heads / MLP hidden units split their outputs; projections back split their inputs
# (Megatron-style), convolutions split output channels. Norms, biases of row-split layers, embeddings of small
# tables and the scheduler state stay replicated.
DEFAULT_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"scheduler/.*", ()),
    (r".*/(to_q|to_k|to_v|q_proj|k_proj|v_proj|fc1|proj)/kernel", (None, MODEL)),
    (r".*/(to_q|to_k|to_v|q_proj|k_proj|v_proj|fc1|proj)/bias", (MODEL,)),
    (r".*/(to_out_0|out_proj|fc2|net_2)/kernel", (MODEL, None)),
    (r".*/conv\w*/kernel", (None, None, None, MODEL)),
    (r".*/conv\w*/bias", (MODEL,)),
    (r".*/token_embedding/embedding", (MODEL, None)),
    (r".*", ()),
)


def make_mesh(data: int | None = None, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A `(data, model)` mesh over `devices` (default: all devices of all processes)."""
    devices = list(devices) if devices is not None else jax.devices()
    if model < 1 or len(devices) % model:
        raise ValueError(f"model={model} must divide the {len(devices)} devices")
    data = data or len(devices) // model
    if data * model != len(devices):
        raise ValueError(f"data={data} x model={model} != {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL))


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh, rules=DEFAULT_RULES) -> PartitionSpec:
    """The PartitionSpec of one param: the first matching rule, with non-dividing dims replicated."""
    model_size = mesh.shape.get(MODEL, 1)
    for pattern, axes in rules:
        if re.fullmatch(pattern, path):
            if not axes or model_size == 1:
                return PartitionSpec()
            if len(axes) != len(shape):
                return PartitionSpec()
            axes = tuple(a if a is None or shape[i] % mesh.shape[a] == 0 else None for i, a in enumerate(axes))
            return PartitionSpec(*axes) if any(a is not None for a in axes) else PartitionSpec()
    return PartitionSpec()


def _path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def param_specs(params: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """The tree of PartitionSpecs for `params` (same structure; state dataclasses such as the scheduler's
    are walked into, their fields named like dict keys)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: spec_for(_path_str(path), tuple(np.shape(x)), mesh, rules), params
    )


def shard_params(params: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """Place `params` on `mesh` by the rules table (replicated where no rule splits them)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(
            x, NamedSharding(mesh, spec_for(_path_str(path), tuple(np.shape(x)), mesh, rules))
        ),
        params,
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Arrays whose first dimension is the batch: split over `data`, replicated over `model`."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def put_global_batch(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """Make a global batch array from the same host array in every process; each process transfers only the
    rows of its own devices (in multi-host runs this is each process feeding its slice of the batch)."""
    sharding = batch_sharding(mesh)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def gather_to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) array as one numpy array on every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
