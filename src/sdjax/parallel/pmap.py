"""The guides' pmap helpers (`replicate`, `shard`, `unreplicate`), on current JAX.

`flax.jax_utils.replicate` relied on `jax.device_put_replicated`, deprecated in JAX 0.8.1. These build the same
arrays (a leading axis of one slice per local device) with `jax.make_array_from_single_device_arrays`, which
`jax.pmap` consumes without another copy.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _pmap_sharding(devices) -> NamedSharding:
    return NamedSharding(Mesh(np.asarray(devices), ("devices",)), PartitionSpec("devices"))


def replicate(tree: Any, devices=None) -> Any:
    """Copy every leaf of `tree` onto each local device, stacked on a new leading axis of length `len(devices)`."""
    devices = list(devices) if devices is not None else jax.local_devices()
    sharding = _pmap_sharding(devices)

    def one(x):
        x = jax.numpy.asarray(x) if not isinstance(x, (np.ndarray, jax.Array)) else x
        pieces = [jax.device_put(x[None], d) for d in devices]
        return jax.make_array_from_single_device_arrays((len(devices),) + tuple(x.shape), sharding, pieces)

    return jax.tree_util.tree_map(one, tree)


def unreplicate(tree: Any) -> Any:
    """Take the first device's copy of every leaf (the inverse of `replicate`)."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def shard(tree: Any, num_devices: int | None = None) -> Any:
    """Reshape every leaf `(N, ...)` -> `(num_devices, N // num_devices, ...)`, as `flax.training.common_utils.shard`.

    Raises if `N` does not divide: with `pmap` every device needs the same batch.
    """
    n = num_devices or jax.local_device_count()

    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(
                f"shard: leading dimension of an array of shape {tuple(x.shape)} is not divisible by "
                f"the {n} devices; pass a batch whose size is a multiple of {n}"
            )
        return x.reshape((n, x.shape[0] // n) + tuple(x.shape[1:]))

    return jax.tree_util.tree_map(one, tree)
