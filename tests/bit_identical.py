"""Bit-for-bit comparison of params trees: the quantized-load tests promise that every path to a quantized model
(quantizing on load, a saved file, a Hub download, a server's model switch) gives the same bytes, dtypes and shapes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def leaves(params: Any, skip: tuple[str, ...] = ("scheduler",)) -> dict[str, np.ndarray]:
    """`{path: host array}` of every leaf but those under the top-level keys `skip` (by default a pipeline's
    "scheduler" entry: sampler tables, not weights)."""
    if isinstance(params, Mapping):
        params = {k: v for k, v in params.items() if k not in skip}
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def assert_bit_identical(a: Any, b: Any, skip: tuple[str, ...] = ("scheduler",)) -> None:
    """The same leaves (`leaves`), each of the same dtype, shape and bytes."""
    a, b = leaves(a, skip), leaves(b, skip)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert a[key].tobytes() == b[key].tobytes(), key
