"""Sharding by one table: a `Mesh` with a `data` axis (the batch) and an optional `model` axis (the weights).

Every param gets a `PartitionSpec` from the first rule whose regex matches its path (`unet/down_blocks_0/...`).
Rules name the dimension of a param that holds its "features" (Flax layouts: Dense kernel `(in, out)`, Conv kernel
`(h, w, in, out)`); a dimension that does not divide by the `model` axis stays replicated, so every table is valid
for every model. Under `jit`, XLA's SPMD partitioner adds the collectives; the numbers do not change.

FSDP (ZeRO-3 style weight sharding; Rajbhandari et al. 2020, PyTorch FSDP): inside `with fsdp():` every large param
is also split over the `data` axis, on its largest dimension that the rules leave unsplit, so a chip stores
1 / (data x model) of those weights. The batch stays split over `data`; XLA's SPMD partitioner all-gathers a weight
where a layer uses it. Whether that gather stays per layer (the memory win) or is hoisted and kept is XLA's choice:
`sdjax.aot`'s compile reports measure it per program.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"

# (regex on the "/"-joined param path, axes of the param's dims; None = replicated along that dim).
# Projections into attention heads / MLP hidden units / modulation chunks split their outputs; projections back
# split their inputs (Megatron-style), convolutions split output channels. Norms, biases of row-split layers,
# embeddings of small tables and the scheduler state stay replicated.
# - SD / SDXL: UNet and VAE attention (`to_q`, `to_out_0`, ...), GEGLU (`net_0/proj`, `net_2`), convolutions; CLIP.
# - Flux.1 (`models.flux`): the text stream's projections (`add_q_proj`, ..., `to_add_out`), the single-stream
#   blocks' MLP (`proj_mlp`) and output over [attention, MLP] (`single_transformer_blocks_N/proj_out`), the AdaLN
#   modulations (`norm1`, `norm1_context`, `norm`, `norm_out`: `linear` to 6, 3 or 2 x width: 3.2e9 of dev's 11.9e9
#   parameters), the T5 states' projection (`context_embedder`).
# - SD 3 / 3.5 (`models.sd3`, MMDiT): the same names as Flux's double-stream blocks (joint attention, `attn2` of the
#   dual-attention blocks, `ff` / `ff_context`, AdaLN `norm1` / `norm1_context` / `norm_out`, `context_embedder`),
#   so the same rules; and its position table (`pos_embed/pos_embed`, `(1, max_size^2, width)`: 0.18 GB in SD 3.5
#   large) split by features.
# - T5 (`models.t5`): attention `q`, `k`, `v` / `o`, the gated MLP `wi_0`, `wi_1` / `wo`, the 32128-row token table.
_COLUMN = r"to_q|to_k|to_v|q_proj|k_proj|v_proj|fc1|proj|add_q_proj|add_k_proj|add_v_proj|proj_mlp|context_embedder"
_ADALN = (
    r"transformer/(transformer_blocks_\d+/norm1|transformer_blocks_\d+/norm1_context"
    r"|single_transformer_blocks_\d+/norm|norm_out)/linear"
)
DEFAULT_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"scheduler/.*", ()),
    (rf".*/({_COLUMN})/kernel", (None, MODEL)),
    (rf".*/({_COLUMN})/bias", (MODEL,)),
    (r".*/(to_out_0|out_proj|fc2|net_2|to_add_out)/kernel", (MODEL, None)),
    (r"transformer/single_transformer_blocks_\d+/proj_out/kernel", (MODEL, None)),
    (r"transformer/pos_embed/pos_embed", (None, None, MODEL)),
    (rf"{_ADALN}/kernel", (None, MODEL)),
    (rf"{_ADALN}/bias", (MODEL,)),
    (r".*/SelfAttention/(q|k|v)/kernel", (None, MODEL)),
    (r".*/SelfAttention/o/kernel", (MODEL, None)),
    (r".*/DenseReluDense/(wi|wi_0|wi_1)/kernel", (None, MODEL)),
    (r".*/DenseReluDense/wo/kernel", (MODEL, None)),
    (r".*/conv\w*/kernel", (None, None, None, MODEL)),
    (r".*/conv\w*/bias", (MODEL,)),
    (r".*/(token_embedding|shared)/embedding", (MODEL, None)),
    (r".*", ()),
)

# FSDP: params of at least this many elements are split over `data` too (a 1024 x 1024 kernel: 2 MiB in bf16;
# smaller ones cost more in collectives than they save). Never the scheduler state, nor the VAE: it is 0.2 GB, its
# activations at 1024x1024 are what count, and a convolution whose channels are split over `data` (the batch's
# axis) invites XLA to reshard those activations instead of gathering the kernels.
FSDP_MIN_SIZE = 2**20
FSDP_EXCLUDE = r"(scheduler|vae)/.*"
_FSDP: contextvars.ContextVar[int | None] = contextvars.ContextVar("sdjax_fsdp_min_size", default=None)


@contextlib.contextmanager
def fsdp(min_size: int = FSDP_MIN_SIZE) -> Iterator[None]:
    """Within: `spec_for` / `param_specs` / `shard_params` also split every param of at least `min_size` elements
    over the `data` axis (module docstring), e.g. around `Generator.lower` or `sdjax.aot.compile_for(fsdp=True)`.
    A program compiled inside takes its params in that layout: place them inside the same context. The layout is
    not part of a `Generator`'s cache keys (compiled programs and placed params are kept per mesh), so run a
    pipeline either always inside or always outside (tests/parallel/test_transformer_sharding.py)."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"fsdp(min_size={min_size!r}): expected an int >= 1")
    token = _FSDP.set(min_size)
    try:
        yield
    finally:
        _FSDP.reset(token)


def fsdp_min_size() -> int | None:
    """The FSDP threshold in force (`fsdp()`), or None."""
    return _FSDP.get()


DEVICES_ENV = "SDJAX_DEVICES"


def default_devices() -> list:
    """The devices sdjax runs on when none are given (pipelines, fine-tuning, training): every device of every
    process, or the first N of them with the environment variable `SDJAX_DEVICES=N` (one process only; `all` or
    unset: every device). With simulated CPU devices (`--xla_force_host_platform_device_count`) or a shared
    accelerator host it keeps a run on fewer devices without touching XLA's or the platform's own settings."""
    devices = jax.devices()
    value = os.environ.get(DEVICES_ENV, "").strip()
    if value in ("", "all"):
        return devices
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= len(devices):
        raise ValueError(f"{DEVICES_ENV}={value!r}: expected a number of devices from 1 to {len(devices)}, or 'all'")
    if n < len(devices) and jax.process_count() > 1:
        raise ValueError(
            f"{DEVICES_ENV}={value!r}: a run over {jax.process_count()} processes uses all their {len(devices)} "
            "devices; unset it (or set it to 'all')"
        )
    return devices[:n]


def make_mesh(data: int | None = None, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A `(data, model)` mesh over `devices` (default: `default_devices()`, all devices of all processes)."""
    devices = list(devices) if devices is not None else default_devices()
    if model < 1 or len(devices) % model:
        raise ValueError(f"model={model} must divide the {len(devices)} devices")
    data = data or len(devices) // model
    if data * model != len(devices):
        raise ValueError(f"data={data} x model={model} != {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL))


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh, rules=DEFAULT_RULES) -> PartitionSpec:
    """The PartitionSpec of one param: the first matching rule, with non-dividing dims replicated; inside `fsdp()`,
    a large param's largest remaining dim that divides by `data` is split over it too."""
    axes = _rule_axes(path, shape, mesh, rules)
    min_size = _FSDP.get()
    data_size = mesh.shape.get(DATA, 1)
    if min_size is not None and data_size > 1 and math.prod(shape) >= min_size and not re.fullmatch(FSDP_EXCLUDE, path):
        axes = list(axes or (None,) * len(shape))
        free = [i for i, a in enumerate(axes) if a is None and shape[i] % data_size == 0]
        if free:
            axes[max(free, key=lambda i: (shape[i], -i))] = DATA
        axes = tuple(axes)
    return PartitionSpec(*axes) if axes and any(a is not None for a in axes) else PartitionSpec()


def _rule_axes(path: str, shape: tuple[int, ...], mesh: Mesh, rules) -> tuple[str | None, ...]:
    """The model-axis split the first matching rule gives (empty: replicated)."""
    model_size = mesh.shape.get(MODEL, 1)
    for pattern, axes in rules:
        if re.fullmatch(pattern, path):
            if not axes or model_size == 1 or len(axes) != len(shape):
                return ()
            return tuple(a if a is None or shape[i] % mesh.shape[a] == 0 else None for i, a in enumerate(axes))
    return ()


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
