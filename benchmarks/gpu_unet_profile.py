"""Where a UNet step's GPU time goes in sdjax: a profiler trace of a few steps inside one program, summed by
kernel name (the GPU's own timings).

    python benchmarks/gpu_unet_profile.py --arch sd15 --steps 5 --out DIR
    # DIR/kernels.json (per kernel name), DIR/*.trace.json.gz (the trace), DIR/unet_loop.hlo.txt (optimized HLO)
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sd15")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdjax.models.presets import ARCHITECTURES, random_params
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel

    a = ARCHITECTURES[args.arch]
    config = UNet2DConditionConfig(**a.unet)
    unet = UNet2DConditionModel(config=config, dtype=jnp.bfloat16)
    shapes = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), UNet2DConditionModel.init_params_shape(config)
    )
    params = random_params(shapes, 0, jnp.bfloat16)
    rng = np.random.default_rng(0)
    lat = a.size // 8
    x = jnp.asarray(rng.standard_normal((2, a.unet["in_channels"], lat, lat), np.float32), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((2, 77, a.unet["cross_attention_dim"]), np.float32), jnp.bfloat16)
    t = jnp.full((2,), 500.0, jnp.float32)

    @jax.jit
    def loop(p, x):
        return jax.lax.fori_loop(0, args.steps, lambda i, x: x - 0.001 * unet.apply({"params": p}, x, t, c), x)

    jax.block_until_ready(loop(params, x))
    jax.block_until_ready(loop(params, x))
    args.out.mkdir(parents=True, exist_ok=True)
    # The optimized program, to attribute the profile's fusions (transposes, reductions) to the model's ops: each
    # instruction's metadata names the flax module path it came from.
    (args.out / "unet_loop.hlo.txt").write_text(loop.lower(params, x).compile().as_text())
    trace_dir = Path("/tmp/jaxtrace")
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        jax.block_until_ready(loop(params, x))
    found = sorted(trace_dir.rglob("*.trace.json.gz"))
    with gzip.open(found[-1]) as f:
        events = json.loads(f.read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    pids, tids = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pids[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tids[(e["pid"], e["tid"])] = e["args"]["name"]
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and "gpu" in pids.get(e.get("pid"), "").lower() and "dur" in e:
            key = (tids.get((e["pid"], e.get("tid")), str(e.get("tid"))), e["name"])
            per[key][0] += e["dur"]
            per[key][1] += 1
    threads = collections.defaultdict(float)
    for (thread, _), v in per.items():
        threads[thread] += v[0]
    print("processes:", sorted(set(pids.values())))
    for thread, us in threads.items():
        print(f"thread {thread}: {us / args.steps / 1e3:.3f} ms per step")
    rows = sorted(((v[0] / args.steps, v[1] / args.steps, k[0], k[1]) for k, v in per.items()), reverse=True)
    for us, n, thread, name in rows[:60]:
        print(f"{us / 1e3:8.3f} ms {n:6.1f}x  {thread[:20]:20s} {name[:100]}")
    (args.out / "kernels.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
    shutil.copy(found[-1], args.out)


if __name__ == "__main__":
    main()
