"""Diffusers-folder loading: time and peak host memory of `sdjax.load_pipeline(folder)` vs diffusers
`StableDiffusionPipeline.from_pretrained(folder)`, both into float32.

    python benchmarks/make_random_model.py sd15 /tmp/sd15-random      # once: a full-size SD 1.5, 4 GB fp32
    python benchmarks/bench_folder_load.py /tmp/sd15-random [--reps 3] [--baseline /tmp/base/src] [--json out.json]

Each load runs in a fresh Python process, the loaders in turn (`--reps` rounds, median reported): the time of the
load call alone (imports apart) and the peak resident memory it adds (`VmHWM` after the load minus after the
imports; file pages a loader maps count while they are mapped and touched). `--baseline SRC` adds `sdjax@baseline`,
sdjax imported from another checkout's `src` (e.g. `git archive HEAD src | tar -x -C /tmp/base`). One untimed load
per sdjax row first fills the shape cache (a folder of the bench's own, shared by the rows) and the page cache, so
the rows time warm loads. The load average at the start and end is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (`VmHWM`, reset by exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def child_sdjax(folder: str) -> dict:
    t0 = time.perf_counter()
    import jax

    import sdjax

    import_s, base = time.perf_counter() - t0, _rss_mb()
    t0 = time.perf_counter()
    _, params = sdjax.load_pipeline(folder, dtype="float32")
    jax.block_until_ready(params)
    return {"import_s": import_s, "load_s": time.perf_counter() - t0, "base_mb": base, "peak_mb": _rss_mb()}


def child_diffusers(folder: str) -> dict:
    t0 = time.perf_counter()
    import torch
    from diffusers import StableDiffusionPipeline

    import_s, base = time.perf_counter() - t0, _rss_mb()
    t0 = time.perf_counter()
    StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32, local_files_only=True)
    return {"import_s": import_s, "load_s": time.perf_counter() - t0, "base_mb": base, "peak_mb": _rss_mb()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a diffusers StableDiffusionPipeline folder")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--baseline", metavar="SRC", help="also time sdjax imported from this src folder (before/after)")
    p.add_argument("--json")
    p.add_argument("--child", choices=("sdjax", "diffusers"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        fn = child_sdjax if args.child == "sdjax" else child_diffusers
        print(json.dumps(fn(args.folder)))
        return
    folder = str(Path(args.folder).resolve())
    with tempfile.TemporaryDirectory(prefix="sdjax-folder-load-") as tmp:
        base = {**os.environ, "HF_HUB_OFFLINE": "1", "SDJAX_SHAPE_CACHE": str(Path(tmp) / "shape-cache")}
        envs = {"sdjax": {**base, "PYTHONPATH": str(ROOT / "src")}}
        if args.baseline:
            envs["sdjax@baseline"] = {**base, "PYTHONPATH": str(Path(args.baseline).resolve())}
        envs["diffusers"] = {**base, "PYTHONPATH": str(ROOT / "src")}

        def child(name: str) -> dict:
            kind = "diffusers" if name == "diffusers" else "sdjax"
            cmd = [sys.executable, __file__, folder, "--child", kind]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=envs[name]).stdout
            return json.loads(out.strip().splitlines()[-1])

        for name in envs:
            if name != "diffusers":
                child(name)  # the shape cache and the page cache filled, untimed
        load_before = os.getloadavg()
        runs: dict[str, list[dict]] = {name: [] for name in envs}
        for _ in range(args.reps):
            for name in runs:
                runs[name].append(child(name))
        load_after = os.getloadavg()
    summary = {
        name: {
            "load_s": statistics.median(r["load_s"] for r in rs),
            "import_s": statistics.median(r["import_s"] for r in rs),
            "load_peak_mb": statistics.median(r["peak_mb"] - r["base_mb"] for r in rs),
            "process_peak_mb": statistics.median(r["peak_mb"] for r in rs),
        }
        for name, rs in runs.items()
    }
    size_mb = sum(f.stat().st_size for f in Path(folder).rglob("*.safetensors")) / 2**20
    print(f"{folder}: {size_mb:.0f} MiB of safetensors; loaded into float32; median of {args.reps} fresh processes")
    print(f"load average {load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end")
    print(f"{'':15s} {'load s':>8s} {'runs':>20s} {'+peak RSS MiB':>14s} {'process peak MiB':>17s} {'imports s':>10s}")
    for name, s in summary.items():
        each = ", ".join(f"{r['load_s']:.2f}" for r in runs[name])
        peaks = f"{s['load_peak_mb']:14.0f} {s['process_peak_mb']:17.0f}"
        print(f"{name:15s} {s['load_s']:8.2f} {each:>20s} {peaks} {s['import_s']:10.2f}")
    if args.json:
        record = {
            "folder": folder,
            "load_average": {"start": load_before, "end": load_after},
            "baseline": args.baseline,
        }
        Path(args.json).write_text(json.dumps({**record, "summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
