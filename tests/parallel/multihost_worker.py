"""One process of a multi-process (multi-host style) run: JAX's distributed runtime, gloo collectives on CPU.

Usage: multihost_worker.py PROCESS_ID NUM_PROCESSES PORT MODEL_DIR OUT_NPY
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + os.environ.get("SDJAX_TEST_COMPILE_FLAGS", "")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np

PROMPTS = ["a cat", "a dog", "a red car", "a tree in winter"]


def main(process_id: int, num_processes: int, port: int, model_dir: str, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=120,
    )
    from sdjax import StableDiffusionPipeline

    assert jax.process_count() == num_processes and jax.device_count() == 2 * num_processes
    pipe, _ = StableDiffusionPipeline.from_pretrained(model_dir)
    images = pipe.generate_arrays(PROMPTS, [""] * 4, [5] * 4, [0, 1, 2, 3], [7.5] * 4, steps=3, height=64, width=64)
    np.save(f"{out}.{process_id}.npy", images)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
