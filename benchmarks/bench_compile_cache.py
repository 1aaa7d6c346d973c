"""Memory held by compiled programs, with the generator's cache bounded to 1 entry vs 16.

Each iteration compiles a new program (a new step count) on the embedded model and prints the process RSS growth
since the second compile. With one entry, evicted executables are dropped and XLA frees them; with 16, they are
all kept.

    python benchmarks/bench_compile_cache.py --programs 12
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(cap: int, programs: int) -> list[float]:
    sys.path.insert(0, str(ROOT / "src"))
    from sdjax import load_pipeline

    pipe, _ = load_pipeline(None)
    pipe.generator.cache.max_entries = cap
    growth, base = [], None
    for steps in range(2, 2 + programs):
        pipe.generate("a", steps=steps, output_type="np")
        gc.collect()
        if base is None and steps == 3:
            base = _rss_mib()
        if base is not None:
            growth.append(round(_rss_mib() - base, 1))
    return growth


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=12)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.programs)))
        return {}
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    result = {}
    for cap in (1, 16):
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", str(cap), "--programs", str(args.programs)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        result[cap] = json.loads(proc.stdout.strip().splitlines()[-1])
    n = len(result[1]) - 1
    print("| cache entries | RSS growth after the 2nd program, MiB, per later compile | total |")
    print("|---|---|---|")
    for cap, g in result.items():
        print(f"| {cap} | {(g[-1] - g[0]) / n:.1f} | {g[-1]:.1f} over {n} compiles |")
    if args.json:
        args.json.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
