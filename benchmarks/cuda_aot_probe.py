"""Can JAX compile sdjax's whole generation for an NVIDIA GPU on a machine without one? (docs/benchmarks.md)

    pip install "jax-cuda12-plugin==$JAXLIB_VERSION" "jax-cuda12-pjrt==$JAXLIB_VERSION"   # no NVIDIA libraries
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false JAX_PLATFORMS=cpu \
        python benchmarks/cuda_aot_probe.py --target-config h100_sxm.txtpb --arch sd15 --size 512

The CUDA plugin builds a compile-only device from a `GpuTargetConfigProto` in text form (`--target-config`: XLA
keeps one per GPU under `xla/backends/gpu/target_config/specs/`, e.g. `h100_sxm.txtpb`; fields that the installed
jaxlib's proto does not know must be removed) and a topology string (`1x1x1`: one slice, one host, one GPU). The
whole generation is lowered for it from abstract params and compiled; XLA's memory analysis is printed. Without
a GPU nothing is autotuned, and Triton GEMM tiling failed for small matrices with jaxlib 0.10.2, hence the flag.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-config", required=True, help="GpuTargetConfigProto text file")
    ap.add_argument("--arch", default="sd15")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    import jax.numpy as jnp
    from jax.experimental import topologies

    from sdjax.parallel import sharding
    from sdjax.pipelines.presets import build_pipeline

    config = Path(args.target_config).read_text()
    devices = topologies.get_topology_desc("", "cuda", target_config=config, topology="1x1x1").devices
    pipe, params = build_pipeline(args.arch, jnp.dtype(args.dtype), abstract=True)
    gen = pipe.generator
    spec = gen.spec(batch=args.batch, height=args.size, width=args.size, steps=args.steps)
    t0 = time.perf_counter()
    compiled = gen.lower(spec, params=params, mesh=sharding.make_mesh(1, 1, devices[:1])).compile()
    m = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    out = {
        "device": devices[0].device_kind,
        "arch": args.arch,
        "size": args.size,
        "batch": args.batch,
        "dtype": args.dtype,
        "compile_s": time.perf_counter() - t0,
        **{f: int(getattr(m, f)) for f in fields},
    }
    out["total_gib"] = (sum(out[f] for f in fields[:3]) - out[fields[3]]) / 2**30
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
