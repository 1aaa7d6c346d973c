"""The first generation of a second pipeline of the same model in one process (the server beside the Python API, a
CLI run beside it): with `core.cache.compile_shared` it runs the first pipeline's executables. With a progress
callback too since programs report steps through one process-wide dispatcher (before, such programs were compiled
per pipeline: a shared executable would have called the first pipeline's callback).

Per mode (a progress callback or none), in one process each: pipeline A's first generation (compiles), a second
pipeline B's first generation of the same request, and B's next one (warm). The embedded model, `--steps` steps.
Run: `python benchmarks/second_pipeline.py [--steps 4] [--json out.json]`; the code before the dispatcher: check out
6c53cec and run it with `PYTHONPATH=<that checkout>/src`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(progress: bool, steps: int) -> dict:
    from sdjax.pipelines import load_pipeline

    seen: list[int] = []
    kwargs = {"progress": lambda stage, step, total: seen.append(step)} if progress else {}

    def timed(pipe, seed: int) -> float:
        t0 = time.perf_counter()
        pipe.generate("a red square", steps=steps, seed=seed, **kwargs)
        return time.perf_counter() - t0

    a, _ = load_pipeline(None)
    first = timed(a, 0)
    b, _ = load_pipeline(None)
    second = timed(b, 0)
    warm = timed(b, 1)
    if progress and not seen:
        raise RuntimeError("the progress callback was never called")
    return {"progress": progress, "first_s": first, "second_pipeline_s": second, "warm_s": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--child", choices=["progress", "none"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "progress", args.steps)))
        return
    rows = []
    for mode in ("progress", "none"):  # each in a fresh process: nothing compiled before pipeline A
        cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'progress callback':>18} {'A first (s)':>12} {'B first (s)':>12} {'B warm (s)':>11}")
    for r in rows:
        name = "yes" if r["progress"] else "no"
        print(f"{name:>18} {r['first_s']:12.2f} {r['second_pipeline_s']:12.2f} {r['warm_s']:11.2f}")
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
