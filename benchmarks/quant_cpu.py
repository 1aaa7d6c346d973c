"""CPU speed and memory of weight-only int8 / fp8 against float32 on the embedded model (docs/quantization.md,
table (c)).

1. The UNet step (batch 2: one image with classifier-free guidance, the model's default size), each variant
   compiled once in the same process, then timed in interleaved rounds (the median per variant): float32 as the
   pipeline runs it (Winograd kernels prepared once, outside the timed call), int8 and fp8 weights dequantized in
   the program (float32 compute), bfloat16.
2. A whole generation (`--images` prompts, `--steps` steps) per variant, each in its own process: the median of 5
   warm runs and the process's peak RSS.
Run: `python benchmarks/quant_cpu.py [--rounds 20] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = {
    "float32": ("float32", None),
    "int8": ("float32", "int8"),
    "fp8": ("float32", "fp8"),
    "bf16": ("bfloat16", None),
}


def unet_steps(rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdjax.ops import conv as ops_conv
    from sdjax.pipelines.auto import load_pipeline

    fns = {}
    for name, (dtype, quantize) in VARIANTS.items():
        pipe, params = load_pipeline(None, dtype=dtype, **({"quantize": quantize} if quantize else {}))
        unet, p = pipe.unet, params["unet"]
        if quantize is None:
            p = jax.jit(ops_conv.prepare)(p)  # as the generator keeps them (float32: Winograd leaves)
        h, w = pipe.denoiser.sample_size
        cfg = unet.config
        x = jnp.asarray(np.random.default_rng(0).standard_normal((2, cfg.in_channels, h, w)), pipe.dtype)
        ctx = jnp.zeros((2, 77, cfg.cross_attention_dim), pipe.dtype)
        f = jax.jit(lambda p, x, unet=unet, ctx=ctx: unet.apply({"params": p}, x, jnp.float32(500.0), ctx))
        f(p, x).block_until_ready()
        fns[name] = (f, p, x)
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, (f, p, x) in fns.items():
            t = time.perf_counter()
            f(p, x).block_until_ready()
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def generation(variant: str, images: int, steps: int) -> dict:
    from sdjax.pipelines.auto import load_pipeline

    dtype, quantize = VARIANTS[variant]
    pipe, _ = load_pipeline(None, dtype=dtype, **({"quantize": quantize} if quantize else {}))
    prompts = ["a red circle on a blue background"] * images
    pipe.generate(prompts, steps=steps, output_type="np")
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        pipe.generate(prompts, steps=steps, output_type="np")
        runs.append(time.perf_counter() - t)
    seconds = sorted(runs)[len(runs) // 2]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "seconds": seconds, "peak_rss_mib": rss}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one generation, in a subprocess
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(generation(args.variant, args.images, args.steps)))
        return
    steps_ms = unet_steps(args.rounds)
    for k, v in steps_ms.items():
        print(f"UNet step {k:8s} {v:8.2f} ms  ({v / steps_ms['float32']:.2f}x float32)", flush=True)
    gens = []
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant, "--images", str(args.images), "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        row = json.loads(out)
        gens.append(row)
        print(
            f"generate {args.images} x {args.steps} steps {variant:8s} {row['seconds']:.2f} s  "
            f"peak RSS {row['peak_rss_mib']:.0f} MiB",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unet_step_ms": steps_ms, "generation": gens}, f, indent=1)


if __name__ == "__main__":
    main()
