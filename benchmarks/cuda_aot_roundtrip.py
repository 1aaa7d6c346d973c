"""Compile sdjax's generation for a GPU in a process that sees no GPU, then load and run it on the GPU.

Answers, on a machine that has a GPU, the question `benchmarks/cuda_aot_probe.py` leaves open: does an
executable compiled from a `GpuTargetConfigProto` alone (no device, nothing autotuned) run on the real card, and
give the image and the speed of the program compiled there? Same JAX version on both sides (one machine).

    CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
        python benchmarks/cuda_aot_roundtrip.py compile --target-config h100.txtpb --dir /tmp/exe
    python benchmarks/cuda_aot_roundtrip.py run --dir /tmp/exe          # on the GPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _spec(gen, args):
    return gen.spec(batch=1, height=args.size, width=args.size, steps=args.steps)


def compile_without_gpu(args) -> None:
    import jax.numpy as jnp
    from jax.experimental import topologies

    from sdjax import aot
    from sdjax.parallel import sharding
    from sdjax.pipelines.presets import build_pipeline

    devices = topologies.get_topology_desc(
        "", "cuda", target_config=Path(args.target_config).read_text(), topology="1x1x1"
    ).devices
    pipe, params = build_pipeline(args.arch, jnp.dtype(args.dtype), abstract=True)
    t0 = time.perf_counter()
    compiled = pipe.generator.lower(
        _spec(pipe.generator, args), params=params, mesh=sharding.make_mesh(1, 1, devices[:1])
    ).compile()
    compile_s = time.perf_counter() - t0
    path = aot.save_executable(compiled, args.dir, "generation")
    m = compiled.memory_analysis()
    print(
        json.dumps(
            {
                "device": devices[0].device_kind,
                "compile_s": compile_s,
                "file": str(path),
                "temp_bytes": int(m.temp_size_in_bytes),
                "argument_bytes": int(m.argument_size_in_bytes),
            }
        )
    )


def run_on_gpu(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdjax import aot
    from sdjax.pipelines.presets import build_pipeline

    pipe, params = build_pipeline(args.arch, jnp.dtype(args.dtype))
    gen = pipe.generator
    pipe.devices = jax.devices()[:1]
    kwargs = dict(
        prompts=["a photograph of an astronaut riding a horse"],
        negative_prompts=[""],
        keys=np.array([[0, 7]], np.uint32),
        guidance_scales=[7.5],
        steps=args.steps,
        height=args.size,
        width=args.size,
        params=params,
    )

    def timed(label):
        t0 = time.perf_counter()
        image = gen.run(**kwargs)
        first = time.perf_counter() - t0
        later = []
        for _ in range(3):
            t0 = time.perf_counter()
            gen.run(**kwargs)
            later.append(time.perf_counter() - t0)
        return image, {f"{label}_first_call_s": first, f"{label}_median_s": sorted(later)[1]}

    own, report = timed("compiled_here")
    t0 = time.perf_counter()
    loaded = aot.load_executable(Path(args.dir) / "generation.jaxexec", backend="cuda")
    report["load_executable_s"] = time.perf_counter() - t0
    gen.compile = lambda spec, params=None, inputs=None: loaded  # every call now runs the loaded executable
    theirs, more = timed("loaded")
    report.update(more)
    report["max_abs_difference"] = float(np.max(np.abs(np.asarray(own) - np.asarray(theirs))))
    report["image_mean"] = float(np.mean(own))
    print(json.dumps(report, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["compile", "run"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--target-config", help="GpuTargetConfigProto text file (compile)")
    ap.add_argument("--arch", default="sd15")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    compile_without_gpu(args) if args.mode == "compile" else run_on_gpu(args)


if __name__ == "__main__":
    main()
