"""Compile times: cold, from a warm persistent cache, and the first and later calls of an AOT-compiled pipeline.

    python benchmarks/bench_compile.py [--model FOLDER] [--batch 1] [--steps 20] [--height H --width W] [--json F]

Each measurement is a fresh Python process (the way a user meets compile time: a new job), in this order:
1. cold: an empty persistent cache directory; `pipe.aot_compile(...)` (lower + compile the whole generation),
   then the first call and the median of later calls of the compiled function;
2. warm: the same, with the cache directory that run 1 filled (`sdjax.enable_compilation_cache`): compile
   becomes a cache read.
`--model` is any diffusers folder (SD or SDXL; default: the embedded model). Times are wall-clock seconds on
whatever device JAX has; the loading of weights is reported apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(model: str, cache: str, batch: int, steps: int, height: int | None, width: int | None, calls: int) -> dict:
    from sdjax import runtime

    runtime.configure_cpu()
    t_start = time.perf_counter()
    import jax
    import numpy as np

    from sdjax import enable_compilation_cache
    from sdjax.pipelines import load_pipeline

    enable_compilation_cache(cache)
    t0 = t_load = time.perf_counter()
    pipe, _ = load_pipeline(model)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fn = pipe.aot_compile(batch_size=batch, steps=steps, height=height, width=width)
    compile_s = time.perf_counter() - t0
    ids = pipe.prepare_inputs(["a red circle on a blue background"] * batch)
    neg = pipe.prepare_inputs([""] * batch)
    keys = np.stack([np.asarray(jax.random.fold_in(jax.random.PRNGKey(0), i)) for i in range(batch)])
    g = np.full((batch,), 7.5, np.float32)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(ids, neg, keys, g))
        times.append(time.perf_counter() - t0)
    return {
        "startup_s": t_load - t_start,
        "load_s": load_s,
        "compile_s": compile_s,
        "first_call_s": times[0],
        "later_call_s": statistics.median(times[1:]) if calls > 1 else None,
        "device": str(jax.devices()[0].platform),
        "size": list(pipe.default_size if height is None else (height, width)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="diffusers folder (default: the embedded model)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.batch, args.steps, args.height, args.width, args.calls)))
        return
    if args.model is None:
        from sdjax.pipelines.auto import EMBEDDED_MODEL

        args.model = str(EMBEDDED_MODEL)
    cache = tempfile.mkdtemp(prefix="sdjax-cache-")
    rows = {}
    try:
        for name in ("cold", "warm"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                cache,
                "--model",
                args.model,
                "--batch",
                str(args.batch),
                "--steps",
                str(args.steps),
                "--calls",
                str(args.calls),
            ]
            if args.height:
                cmd += ["--height", str(args.height), "--width", str(args.width)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows[name] = json.loads(out.strip().splitlines()[-1])
        entries = sum(1 for _ in Path(cache).iterdir())
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(
        f"model {args.model}, batch {args.batch}, {args.steps} steps, {rows['cold']['size']}, "
        f"device {rows['cold']['device']}; cache entries written: {entries}"
    )
    print(f"{'':6s} {'load s':>7s} {'compile s':>10s} {'1st call s':>11s} {'later call s':>13s}")
    for name, r in rows.items():
        later = f"{r['later_call_s']:13.3f}" if r["later_call_s"] is not None else f"{'-':>13s}"
        print(f"{name:6s} {r['load_s']:7.2f} {r['compile_s']:10.2f} {r['first_call_s']:11.3f} {later}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"model": args.model, "batch": args.batch, "steps": args.steps, "runs": rows, "cache_entries": entries},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
