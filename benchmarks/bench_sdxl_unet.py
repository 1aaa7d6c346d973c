"""Full-size SDXL UNet, one denoising step (batch 2, 128x128 latents = 1024x1024 images), sdjax vs PyTorch diffusers.

    python benchmarks/bench_sdxl_unet.py [--dir /tmp/sdxl-unet-random] [--reps 3] [--json out.json]

Both models in float32 hold 10.3 GB of weights each, more than fits twice next to the activations on a 24 GB
machine, so the two frameworks run in turn in subprocesses of this one run, in the order torch, sdjax, torch
(the second torch run brackets the sdjax one, so a machine that got slower or faster shows as a gap between the
two torch medians). Each loads the same random-weight diffusers folder (written once by this script from
diffusers' `UNet2DConditionModel` with the released SDXL config and a fixed seed): PyTorch with
`from_pretrained`, sdjax with its own loader. The sdjax process checks its output against the first torch run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))


def _inputs():
    import numpy as np

    rng = np.random.default_rng(0)
    return dict(
        sample=rng.standard_normal((2, 4, 128, 128), dtype=np.float32),
        t=np.array([999.0, 999.0], np.float32),
        context=rng.standard_normal((2, 77, 2048), dtype=np.float32),
        text_embeds=rng.standard_normal((2, 1280), dtype=np.float32),
        time_ids=np.tile(np.array([[1024, 1024, 0, 0, 1024, 1024]], np.float32), (2, 1)),
    )


def prepare(folder: Path) -> None:
    if (folder / "config.json").is_file():
        return
    import full_size

    print(f"writing a random-weight SDXL UNet to {folder} ...", flush=True)
    full_size.torch_unet(full_size.SDXL_UNET).save_pretrained(folder)


def run_torch(folder: Path, reps: int, out: Path) -> dict:
    import numpy as np
    import torch
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel.from_pretrained(folder).eval()
    x = {k: torch.from_numpy(v) for k, v in _inputs().items()}

    def call():
        return model(
            x["sample"],
            x["t"],
            encoder_hidden_states=x["context"],
            added_cond_kwargs={"text_embeds": x["text_embeds"], "time_ids": x["time_ids"]},
        ).sample

    with torch.inference_mode():
        t0 = time.perf_counter()
        y = call()
        first = time.perf_counter() - t0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    np.save(out, y.numpy())
    return {"framework": "torch", "first_call_s": first, "times_s": times, "threads": torch.get_num_threads()}


def run_jax(folder: Path, reps: int, ref: Path) -> dict:
    from sdjax import runtime

    runtime.configure_cpu()
    import jax
    import numpy as np

    from sdjax.loading.components import UNET, LoadRequest, load_model

    t0 = time.perf_counter()
    model, params = load_model(UNET, LoadRequest("unet", folder, None, "float32"))
    load_s = time.perf_counter() - t0
    x = {k: jax.numpy.asarray(v) for k, v in _inputs().items()}

    def f(p, x):
        return model.apply(
            {"params": p}, x["sample"], x["t"], x["context"], text_embeds=x["text_embeds"], time_ids=x["time_ids"]
        )

    t0 = time.perf_counter()
    compiled = jax.jit(f).lower(params, x).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    y = np.asarray(compiled(params, x))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        compiled(params, x).block_until_ready()
        times.append(time.perf_counter() - t0)
    want = np.load(ref)
    return {
        "framework": "sdjax",
        "load_s": load_s,
        "compile_s": compile_s,
        "first_call_s": first,
        "times_s": times,
        "max_abs_diff": float(np.abs(y - want).max()),
        "max_abs_ref": float(np.abs(want).max()),
        "flops": float((compiled.cost_analysis() or {}).get("flops", 0.0)),
    }


def _child(mode: str, folder: Path, reps: int, ref: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--dir", str(folder), "--reps", str(reps), "--ref", str(ref)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/sdxl-unet-random")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--child", choices=["torch", "jax"])
    p.add_argument("--ref", default=None)
    args = p.parse_args()
    folder = Path(args.dir)
    ref = Path(args.ref or folder / "torch_out.npy")
    if args.child == "torch":
        print(json.dumps(run_torch(folder, args.reps, ref)))
        return
    if args.child == "jax":
        print(json.dumps(run_jax(folder, args.reps, ref)))
        return
    prepare(folder)
    runs = []
    for mode, r in (("torch", ref), ("jax", ref), ("torch", folder / "torch_out2.npy")):
        runs.append(_child(mode, folder, args.reps, r))
        print(f"  {runs[-1]['framework']}: " + ", ".join(f"{t:.1f}s" for t in runs[-1]["times_s"]), flush=True)
    t1, jx, t2 = runs
    torch_med = statistics.median(t1["times_s"] + t2["times_s"])
    jax_med = statistics.median(jx["times_s"])
    result = {
        "workload": "SDXL UNet fp32, batch 2, 128x128 latents, 77x2048 context",
        "runs": runs,
        "torch_median_s": torch_med,
        "sdjax_median_s": jax_med,
        "ratio_sdjax_over_torch": jax_med / torch_med,
    }
    print(
        f"\nSDXL UNet step (fp32, batch 2, 128x128): torch median {torch_med:.1f} s "
        f"(runs {statistics.median(t1['times_s']):.1f} / {statistics.median(t2['times_s']):.1f}), "
        f"sdjax median {jax_med:.1f} s -> ratio {jax_med / torch_med:.2f} (< 1: sdjax faster); "
        f"sdjax compile {jx['compile_s']:.0f} s; max|sdjax - torch| {jx['max_abs_diff']:.1e} "
        f"(max|torch| {jx['max_abs_ref']:.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
