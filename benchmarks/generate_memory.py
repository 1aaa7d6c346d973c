"""Host memory of a whole generation, phase by phase: what the process holds after loading, and its peak while
loading, in the first generation (compile + run) and in later ones.

    python benchmarks/generate_memory.py --model /tmp/sdxl-random --steps 2 [--dtype float32] [--runs 2]
        [--size 1024] [--json out.json]

`--model`: any folder or file `sdjax.load_pipeline` takes (default: the embedded tiny model; a random full-size
SDXL: `benchmarks/make_random_model.py sdxl /tmp/sdxl-random`). A thread reads this process's resident memory
(`VmRSS`) every 0.1 s; a phase's peak is its highest sample (`VmHWM`, the kernel's own peak, is printed at the end
as a check: samples can miss a short spike).
Beside the phases: the bytes of the params as loaded, and of the prepared convolution kernels the generator keeps
between runs on CPU (`pipe.generator.kernels`, within its budget). Times are wall seconds of each phase on whatever
else the machine runs: for memory, not speed.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

GIB = 2**30


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class Sampler:
    """Resident memory sampled on a thread; `phase(name)` starts a phase, `peaks` gives each one's highest sample."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self._phase = "imports"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def _sample(self):
        rss = _status_kib("VmRSS") * 1024
        self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), rss)

    def phase(self, name: str) -> None:
        self._sample()  # the previous phase's last sample
        self._phase = name
        self._sample()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def _tree_nbytes(tree) -> int:
    import jax

    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree_util.tree_leaves(tree))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="folder, file or Hub id (default: the embedded tiny model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--size", type=int, default=None, help="width = height in pixels (default: the model's)")
    ap.add_argument("--runs", type=int, default=2, help="generations (the first compiles)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    rows: list[dict] = []
    with Sampler() as sampler:
        import sdjax

        sampler.phase("load")
        t0 = time.perf_counter()
        pipe, params = sdjax.load_pipeline(args.model, dtype=args.dtype)
        rows.append({"phase": "load", "seconds": time.perf_counter() - t0})
        sampler.phase("after load")
        time.sleep(0.3)
        loaded_rss = _status_kib("VmRSS") * 1024
        size = {} if args.size is None else {"width": args.size, "height": args.size}
        for run in range(args.runs):
            name = "generation 1 (compile + run)" if run == 0 else f"generation {run + 1}"
            sampler.phase(name)
            t0 = time.perf_counter()
            pipe.generate("a red cube on a wooden table", steps=args.steps, seed=run, **size)
            rows.append({"phase": name, "seconds": time.perf_counter() - t0})
        sampler.phase("end")
    hwm = _status_kib("VmHWM") * 1024
    for row in rows:
        row["peak_rss_gib"] = sampler.peaks.get(row["phase"], 0) / GIB
    kernels = getattr(getattr(pipe, "generator", None), "kernels", None)
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "steps": args.steps,
        "size": args.size,
        "rss_after_imports_gib": sampler.peaks.get("imports", 0) / GIB,
        "rss_after_load_gib": loaded_rss / GIB,
        "params_gib": _tree_nbytes(params) / GIB,
        "kept_kernels_gib": (kernels.nbytes / GIB) if kernels is not None else None,
        "vmhwm_gib": hwm / GIB,
        "phases": rows,
    }
    print(f"{args.model}, {args.dtype}, {args.steps} steps; params {summary['params_gib']:.2f} GiB, "
          f"resident after imports {summary['rss_after_imports_gib']:.2f} / after load "
          f"{summary['rss_after_load_gib']:.2f} GiB")  # fmt: skip
    print("| phase | seconds | peak RSS GiB |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['phase']} | {row['seconds']:.1f} | {row['peak_rss_gib']:.2f} |")
    if summary["kept_kernels_gib"] is not None:
        print(f"prepared kernels kept between runs: {summary['kept_kernels_gib']:.2f} GiB")
    print(f"VmHWM (the process's peak): {summary['vmhwm_gib']:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
