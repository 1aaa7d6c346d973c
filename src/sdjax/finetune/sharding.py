"""Where a training run's arrays live on a `Mesh`: data parallel with every weight on every device, or FSDP.

The step functions (`step.jit_step`: the LoRA steps of SD 1.x / 2.x / XL, `flow`'s Flux / SD 3 LoRA steps,
`full`'s full UNet fine-tune) are plain `jit`s of `step(state, frozen, batch, key)`; XLA's SPMD partitioner
splits their work by the shardings of their inputs. This module chooses those shardings:

- Replicated (`fsdp=False`; `loop.run_loop`'s default): the frozen params, the trained values and the optimiser
  state whole on every device; the batch split over the mesh's `data` axis; the compiler all-reduces the gradients.
- FSDP (`fsdp=True`; ZeRO-3, Rajbhandari et al. 2020; `TrainConfig.fsdp`, `--fsdp`): every frozen param of at least
  `min_size` elements is split over `data` as well, by the inference rules table (`sdjax.parallel.sharding`: the
  `model`-axis split of a rule, then the largest dimension left whole that divides by `data`; the VAE and the
  scheduler never). The trained values get the same treatment under the state's key (`state["unet"]` of a full
  fine-tune is named `unet/...`, so the UNet rules match), and every optimiser-state leaf that mirrors a trained value
  (same path below the optimiser's wrappers, same shape: AdamW's `mu`, `nu`, `MultiSteps`' accumulated gradients,
  Prodigy's `exp_avg`, `exp_avg_sq`, `grad_sum` and initial values `params0`, Adafactor's unfactored `v`) takes that
  value's sharding. The rest stays whole on every device: the counters, Prodigy's scalar step-size estimate
  (`estim_lr`, `numerator_weighted`) and Adafactor's factored second moments (`v_row`, `v_col`: the mean squared
  gradient over one of the value's two largest dimensions, one rank below the value; a full-size SD 1.5 UNet's whole
  Adafactor state is 7.2 MiB against 3.3 GB of weights, so splitting it would save nothing). A LoRA's leaves are far
  below the threshold, so a LoRA or DreamBooth run shards its frozen model and keeps the LoRA and its moments whole,
  as a textual inversion run keeps its few trained token rows. The partitioner all-gathers a weight where a layer uses
  it and reduce-scatters its gradient: a device stores `1 / data` of the large weights, master copy and moments, at
  the price of those collectives.

`Layout` holds the shardings of one run (`layout(...)`) and places host or abstract trees with them; its `step`
re-jits a step function with those shardings pinned on both sides (inputs and outputs; the state donated), so an
update returns the state in the layout it came in and the next call reuses the same executable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sdjax.parallel import sharding as sharding_lib


def _layout_context(fsdp: bool, min_size: int):
    return sharding_lib.fsdp(min_size) if fsdp else contextlib.nullcontext()


def _names(path) -> tuple[str, ...]:
    """A tree path as strings (dict keys, attribute names of optax's named tuples, sequence indices)."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return tuple(out)


def frozen_specs(frozen: Any, mesh: Mesh, *, fsdp: bool = False, min_size: int = sharding_lib.FSDP_MIN_SIZE) -> Any:
    """PartitionSpecs of the frozen params `{component: tree}` by the rules table (with `fsdp`, large params also
    split over `data`)."""
    with _layout_context(fsdp, min_size):
        return sharding_lib.param_specs(frozen, mesh)


def state_specs(
    state: dict,
    mesh: Mesh,
    *,
    trained: str = "lora",
    fsdp: bool = False,
    min_size: int = sharding_lib.FSDP_MIN_SIZE,
) -> dict:
    """PartitionSpecs of a train state `{trained: values, "opt_state": ..., "step": ...}`: the values by the rules
    table under the name `trained` (with `fsdp`), the optimiser-state leaves that mirror a value (same path below
    the optimiser's own wrappers, same shape) as that value, everything else replicated."""
    with _layout_context(fsdp, min_size):
        value_specs = sharding_lib.param_specs({trained: state[trained]}, mesh)[trained]
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], PartitionSpec]] = {}
    for (path, spec), leaf in zip(
        jax.tree_util.tree_flatten_with_path(value_specs, is_leaf=_is_spec)[0],
        jax.tree_util.tree_leaves(state[trained]),
        strict=True,
    ):
        by_path[_names(path)] = (tuple(np.shape(leaf)), spec)

    def mirror(path, leaf) -> PartitionSpec:
        names, shape = _names(path), tuple(np.shape(leaf))
        for start in range(len(names)):
            hit = by_path.get(names[start:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        return PartitionSpec()

    out = {k: jax.tree_util.tree_map_with_path(mirror, v) for k, v in state.items() if k != trained}
    out[trained] = value_specs
    return out


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The shardings of one run's step arguments on `mesh` (trees of `NamedSharding` shaped like the state and
    the frozen params)."""

    mesh: Mesh
    state: Any
    frozen: Any
    trained: str = "lora"
    fsdp: bool = False

    @property
    def batch(self) -> NamedSharding:
        """Every batch array: split over `data` on its first (batch) dimension."""
        return sharding_lib.batch_sharding(self.mesh)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def place(self, state: dict, frozen: Any, put: Callable | None = None) -> tuple[dict, Any]:
        """`state` and `frozen` (host or device arrays) put on the mesh in this layout, leaf by leaf with
        `put(array, sharding)` (default `jax.device_put`; a multi-process run passes its own, e.g.
        `finetune.distributed.place`)."""
        return _put(state, self.state, put), _put(frozen, self.frozen, put)

    def place_values(self, values: Any, put: Callable | None = None) -> Any:
        """A tree shaped like `state[trained]` (an EMA of the values) in the values' layout; None stays None."""
        return None if values is None else _put(values, self.state[self.trained], put)

    def abstract(self, state: dict, frozen: Any) -> tuple[dict, Any]:
        """`jax.ShapeDtypeStruct`s of `state` and `frozen` (arrays or shape structs) carrying this layout's
        shardings: what `step(...).lower` takes to compile without any array allocated."""

        def shaped(x, s):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)

        return jax.tree_util.tree_map(shaped, state, self.state), jax.tree_util.tree_map(shaped, frozen, self.frozen)

    def abstract_batch(self, batch: dict) -> dict:
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self.batch), batch)

    def step(self, train_step: Callable) -> Callable:
        """`train_step(state, frozen, batch, key) -> (state, loss)` jitted with this layout: the inputs' shardings
        (batch over `data`, the key replicated), the new state in the state's layout, the loss replicated, the
        state donated. (`train_step` may be a `jit` already; it is inlined.)"""
        return jax.jit(
            train_step,
            in_shardings=(self.state, self.frozen, self.batch, self.replicated),
            out_shardings=(self.state, self.replicated),
            donate_argnums=(0,),
        )


def _put(tree: Any, shardings: Any, put: Callable | None) -> Any:
    put = put or jax.device_put
    return jax.tree_util.tree_map(lambda x, s: put(x, s), tree, shardings)


def layout(
    mesh: Mesh,
    state: dict,
    frozen: Any,
    *,
    trained: str = "lora",
    fsdp: bool = False,
    min_size: int = sharding_lib.FSDP_MIN_SIZE,
) -> Layout:
    """The `Layout` of a run with this `state` (`{trained, "opt_state", "step"}`) and `frozen` params on `mesh`
    (arrays or `jax.ShapeDtypeStruct`s; only shapes are read). `fsdp=False`: everything replicated but the batch
    (what `loop.run_loop` does); `fsdp=True`: the module docstring's FSDP, for params of at least `min_size`
    elements."""
    if trained not in state:
        raise ValueError(f"trained={trained!r}: the state has no such entry (it has {sorted(state)})")
    if sharding_lib.DATA not in mesh.shape:
        raise ValueError(
            f"the mesh needs a {sharding_lib.DATA!r} axis (sdjax.parallel.sharding.make_mesh); it has {mesh.shape}"
        )
    s_specs = state_specs(state, mesh, trained=trained, fsdp=fsdp, min_size=min_size)
    f_specs = frozen_specs(frozen, mesh, fsdp=fsdp, min_size=min_size)
    return Layout(mesh, _named(mesh, s_specs), _named(mesh, f_specs), trained, fsdp)


def bytes_per_device(tree: Any, shardings: Any) -> int:
    """The bytes one device holds of `tree` (arrays or shape structs) laid out by `shardings` (a tree of
    `NamedSharding`; the largest shard of each leaf)."""
    total = 0
    for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings), strict=True):
        shard = s.shard_shape(tuple(np.shape(x)))
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total
