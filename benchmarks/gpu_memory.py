"""Device memory of one generation, the decode split off (`Generator.split_decode`, the default) against one program.

`sdjax bench` reports the device allocator's peak of a process that also compiled and ran every piece alone (text
encoders, one UNet step, the decode), so its figure mixes those buffers in. This script measures a generation and
nothing else: each mode runs in a fresh process (random full-size weights built on the device, one warm-up
generation, one measured generation) and reports the allocator's peak and what XLA planned for each executable
(arguments, outputs, temporaries, generated code). On CPU the allocator reports nothing; run it on a GPU or TPU.

    python benchmarks/gpu_memory.py --arch sd15 --dtype bfloat16 --size 512 --steps 4 --json out.json
    python benchmarks/gpu_memory.py --arch sd15 --batch 8 --modes split,sliced   # VAE slicing's memory and time

Each mode's row also has the median of three timed generations (`run s`, after the warm-up one).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

GIB = 2**30


def _analysis(executable) -> dict[str, int] | None:
    try:
        a = executable.memory_analysis()
    except Exception:  # not every backend reports it
        return None
    if a is None:
        return None
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {n: int(getattr(a, n, 0) or 0) for n in names}


def measure(arch: str, dtype: str, size: int, steps: int, batch: int, mode: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdjax.pipelines.presets import build_pipeline

    def in_use() -> dict[str, int]:
        stats = jax.devices()[0].memory_stats() or {}
        return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}

    pipe, params = build_pipeline(arch, jnp.dtype(dtype))
    pipe.devices = jax.devices()[:1]
    gen = pipe.generator
    gen.split_decode = mode != "one"
    gen.vae_slicing = mode == "sliced"
    jax.block_until_ready(params)
    after_params = in_use()
    kwargs = dict(
        prompts=["a photograph of an astronaut riding a horse"] * batch,
        negative_prompts=[""] * batch,
        keys=np.arange(2 * batch, dtype=np.uint32).reshape(batch, 2),
        guidance_scales=[7.5] * batch,
        steps=steps,
        height=size,
        width=size,
        params=params,
    )
    gen.run(**kwargs)  # compiles, places, runs once
    after_first = in_use()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        images = gen.run(**kwargs)
        times.append(time.perf_counter() - t0)
    spec = gen.spec(batch=batch, height=size, width=size, steps=steps)
    main, decode = gen.executables(spec, params=params)
    return {
        "mode": {"split": "split", "one": "one program", "sliced": "split, VAE sliced"}[mode],
        "batch": batch,
        "run_s": times,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "after_params": after_params,
        "after_first_run": after_first,
        "after_second_run": in_use(),
        "main": _analysis(main),
        "decode": _analysis(decode) if decode is not None else None,
        "image_mean": float(np.asarray(images).mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sd15")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", default="split,one", help="split, one (one program) and/or sliced (split + VAE slicing)")
    ap.add_argument("--json")
    ap.add_argument("--mode", choices=("split", "one", "sliced"), help=argparse.SUPPRESS)  # the worker process
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(measure(args.arch, args.dtype, args.size, args.steps, args.batch, args.mode)))
        return
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--arch", args.arch, "--dtype", args.dtype, "--size", str(args.size)]
        cmd += ["--steps", str(args.steps), "--batch", str(args.batch), "--mode", mode]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"the {mode} worker failed with status {done.returncode}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    out = {"arch": args.arch, "dtype": args.dtype, "size": args.size, "steps": args.steps, "batch": args.batch}
    out["rows"] = rows
    print(json.dumps(out, indent=2))
    print(f"{'mode':<18} {'params GiB':>10} {'peak GiB':>9} {'main temp':>9} {'decode temp':>11} {'run s':>7}")
    for r in rows:
        peak = r["after_second_run"].get("peak_bytes_in_use", 0) / GIB
        par = r["after_params"].get("bytes_in_use", 0) / GIB
        mt = (r["main"] or {}).get("temp_size_in_bytes", 0) / GIB
        dt = (r["decode"] or {}).get("temp_size_in_bytes", 0) / GIB
        run = sorted(r["run_s"])[1]
        print(f"{r['mode']:<18} {par:>10.2f} {peak:>9.2f} {mt:>9.2f} {dt:>11.2f} {run:>7.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
