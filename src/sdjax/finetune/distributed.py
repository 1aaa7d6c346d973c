"""Training on several hosts (processes) with `jax.distributed`: one program over every process's devices.

    # on each of N hosts (or N processes of one machine, for a test):
    sdjax train lora --data DIR --out star.safetensors --coordinator 10.0.0.1:1234 --num-processes N --process-id I
    sdjax train lora --data DIR --out star.safetensors --distributed      # TPU pods, SLURM: JAX finds the rest

Every process runs the same loop on the same data order (the samplers are seeded), so each one knows the whole
global batch without reading it: it opens only the rows its own devices hold (`local_rows`, from the batch's
sharding) and `place_rows` joins every process's rows into the global array (`make_array_from_process_local_data`);
the compiled step sums the gradients over all devices as it does on one host. The SD / SDXL trainers (LoRA,
DreamBooth with its [instance; class] rows, textual inversion, full fine-tune) build their batches by rows
(`run.RowBatches`). (A trainer whose batches are not built by rows gives every process the whole batch, and `place`
hands each device its part.) The state and the frozen params are replicated on every device (with `--fsdp`, split as
`finetune.sharding` lays them out). Only process 0 writes the run directory's logs, config, plots and the output
files (and a textual inversion's initial embedding); orbax's checkpoints are written by all processes together (they
must see the same run directory: a shared file system). Not with several processes: validation images and
DreamBooth's class-image generation (each is a generation on one process's devices), which are refused before
anything compiles.

On CPU the cross-process sums need a collectives backend: `initialize` turns on gloo
(`jax_cpu_collectives_implementation`), which is how the tests run two processes on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> None:
    """`jax.distributed.initialize` with the given coordinator `host:port`, process count and this process's id
    (all three, or none of them: JAX then reads them from the TPU pod / SLURM / MPI environment). Must run before
    anything touches a device."""
    import jax

    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise ValueError(
            "--coordinator, --num-processes and --process-id go together (or none of them, where JAX finds them "
            "in the cluster's environment)"
        )
    if num_processes is not None and (num_processes < 1 or not 0 <= process_id < num_processes):
        raise ValueError(f"process id {process_id} must lie in [0, {num_processes}) and num_processes be >= 1")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; accelerators have theirs
    jax.distributed.initialize(coordinator, num_processes, process_id)


def process_count() -> int:
    import jax

    return jax.process_count()


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0; always with one process)."""
    import jax

    return jax.process_index() == 0


def check_supported(*, validation: bool, what: str = "training") -> None:
    """Refuse, with several processes, what runs a generation on one process's devices."""
    if process_count() > 1 and validation:
        raise ValueError(
            f"validation images are not supported in {what} over {process_count()} processes (each would be a "
            "generation on one host's devices); leave out --validation-prompt"
        )


def place(tree: Any, sharding: Any) -> Any:
    """`tree`'s arrays (host arrays, or arrays on this process's devices, equal on every process) as global arrays
    of `sharding`: `jax.device_put` with one process; with several, each process gives its own devices their
    parts (`jax.make_array_from_callback`)."""
    import jax

    if jax.process_count() == 1:
        return jax.tree_util.tree_map(lambda x: jax.device_put(_from_host_on_cpu(x, sharding), sharding), tree)

    def one(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(one, tree)


def _from_host_on_cpu(x: Any, sharding: Any) -> Any:
    """`x` as a host array where that is free and saves a compile: a CPU device array (its memory is the host's)
    not yet in `sharding`'s layout. JAX splits a device array by compiling a slicing program per leaf shape (0.1-0.2 s
    of CPU each: ~130 for the tiny SD 1.x fine-tune's FSDP layout); from host memory it copies the parts. Accelerator
    arrays stay on their devices (a host round trip would cost a transfer there); typed PRNG keys stay as they are."""
    import jax

    if (
        not isinstance(x, jax.Array)
        or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        or not x.is_fully_addressable
        or any(d.platform != "cpu" for d in x.devices())
        or x.sharding.is_equivalent_to(sharding, x.ndim)
    ):
        return x
    return np.asarray(x)


def local_rows(sharding: Any, size: int) -> list[int] | None:
    """The rows of a global batch of `size` rows, split on its first dimension by `sharding`, that this process's
    devices hold, in order; None with one process (it holds every row)."""
    import jax

    if jax.process_count() == 1:
        return None
    held = sharding.addressable_devices_indices_map((size,)).values()
    return sorted({row for index in held for row in range(*index[0].indices(size))})


def place_rows(tree: Any, sharding: Any, size: int, rows: Sequence[int] | None) -> Any:
    """`tree`'s host arrays, which hold the rows `rows` (`local_rows`) of a global batch of `size` rows, as global
    arrays of `sharding`: `jax.device_put` with one process (`rows` None: the whole batch); with several, every
    process gives its own rows (`jax.make_array_from_process_local_data`)."""
    import jax

    if rows is None:
        return jax.device_put(tree, sharding)

    def one(x):
        host = np.asarray(x)
        if host.shape[0] != len(rows):
            raise ValueError(f"a batch array of {host.shape[0]} rows where this process builds {len(rows)}")
        return jax.make_array_from_process_local_data(sharding, host, (size, *host.shape[1:]))

    return jax.tree_util.tree_map(one, tree)
