"""One UNet step on a GPU, called alone and inside a loop of steps, in sdjax and in PyTorch diffusers (eager and
torch.compile'd): separates what a call costs around the step (dispatch, launches) from the step itself.

    python benchmarks/gpu_unet_loop.py --arch sd15 --steps 50 [--compile-mode reduce-overhead] [--json out.json]
        [--groupnorm two-pass] [--split-head-dim]     # sdjax's UNet variants (the torch rows do not change)

`sdjax bench` times a UNet step as one call of a compiled step; a generation runs the steps inside one program
(sdjax) or one Python loop (diffusers), where the per-call costs differ. Rows:
- sdjax call: one jitted step per call (what `sdjax bench` reports);
- sdjax loop: `steps` steps in one `lax.fori_loop` program, time / steps;
- sdjax dispatch: a jitted function that takes the UNet's params and returns x + 1 (the cost of a call that
  hands over the params tree, with nothing to compute);
- torch eager / compiled, call and loop: the same step in diffusers (`steps` calls back to back, one sync).
Random weights (the released config), batch 2 (classifier-free guidance), bf16; medians of --reps.
`--groupnorm two-pass` sets `sdjax.models.layers.GROUPNORM_ONE_PASS = False` before anything is traced (GroupNorm's
variance as the mean of (x - mean)^2, the form before the one-pass statistics); `--split-head-dim` builds sdjax's
UNet with `split_head_dim=True` (attention heads on their own axis).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # both frameworks share the GPU in this process


def _median(fn, reps: int, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(a, latent: int):
    import numpy as np

    rng = np.random.default_rng(0)
    cross = a.unet["cross_attention_dim"]
    x = rng.standard_normal((2, a.unet["in_channels"], latent, latent), np.float32)
    context = rng.standard_normal((2, 77, cross), np.float32)
    return x, context


def sdjax_rows(arch: str, steps: int, reps: int, split_head_dim: bool = False) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from sdjax.models.presets import ARCHITECTURES, random_params
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel

    a = ARCHITECTURES[arch]
    if a.text_encoder_2 is not None:
        raise SystemExit("only the SD 1.x/2.x UNets here (no added conditioning)")
    config = UNet2DConditionConfig(**a.unet)
    unet = UNet2DConditionModel(config=config, dtype=jnp.bfloat16, split_head_dim=split_head_dim)
    shapes = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), UNet2DConditionModel.init_params_shape(config)
    )
    params = random_params(shapes, 0, jnp.bfloat16)
    x, context = _inputs(a, a.size // 8)
    x, context = jnp.asarray(x, jnp.bfloat16), jnp.asarray(context, jnp.bfloat16)
    t = jnp.full((2,), 500.0, jnp.float32)

    step = jax.jit(lambda p, x: unet.apply({"params": p}, x, t, context))

    @jax.jit
    def loop(p, x):
        return jax.lax.fori_loop(0, steps, lambda i, x: x - 0.001 * unet.apply({"params": p}, x, t, context), x)

    noop = jax.jit(lambda p, x: x + 1)
    out = {}
    out["sdjax call"] = _median(lambda: jax.block_until_ready(step(params, x)), reps)
    out["sdjax loop"] = _median(lambda: jax.block_until_ready(loop(params, x)), reps, warm=1) / steps
    out["sdjax dispatch"] = _median(lambda: jax.block_until_ready(noop(params, x)), reps * 4)
    return out


def torch_rows(arch: str, steps: int, reps: int, mode: str) -> dict[str, float]:
    import diffusers
    import torch

    from sdjax.models.presets import ARCHITECTURES

    a = ARCHITECTURES[arch]
    with torch.device("cuda"):
        unet = diffusers.UNet2DConditionModel.from_config(a.unet).to(torch.bfloat16).eval()
    x, context = _inputs(a, a.size // 8)
    x = torch.from_numpy(x).to("cuda", torch.bfloat16)
    context = torch.from_numpy(context).to("cuda", torch.bfloat16)
    t = torch.full((2,), 500.0, device="cuda")

    def rows(net, label):
        def call():
            net(x, t, encoder_hidden_states=context)
            torch.cuda.synchronize()

        def loop():
            y = x
            for _ in range(steps):
                y = y - 0.001 * net(y, t, encoder_hidden_states=context).sample
            torch.cuda.synchronize()

        return {f"torch {label} call": _median(call, reps), f"torch {label} loop": _median(loop, reps, 1) / steps}

    out = {}
    with torch.inference_mode():
        out.update(rows(unet, "eager"))
        unet.to(memory_format=torch.channels_last)
        compiled = torch.compile(unet, mode=mode, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        compiled(x, t, encoder_hidden_states=context)
        torch.cuda.synchronize()
        out["torch compile s"] = time.perf_counter() - t0
        out.update(rows(compiled, f"compiled ({mode})"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sd15", choices=["sd15", "sd21", "tiny"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument(
        "--groupnorm", default="one-pass", choices=["one-pass", "two-pass"], help="sdjax GroupNorm statistics"
    )
    ap.add_argument("--split-head-dim", action="store_true", help="sdjax UNet: attention heads on their own axis")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from sdjax.models import layers

    layers.GROUPNORM_ONE_PASS = args.groupnorm == "one-pass"  # read when the UNet is traced, below
    result = {
        "arch": args.arch,
        "steps": args.steps,
        "reps": args.reps,
        "groupnorm": args.groupnorm,
        "split_head_dim": args.split_head_dim,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    rows = sdjax_rows(args.arch, args.steps, args.reps, args.split_head_dim)
    if not args.skip_torch:
        rows.update(torch_rows(args.arch, args.steps, args.reps, args.compile_mode))
    result["rows"] = rows
    for name, s in rows.items():
        print(f"{name:40s} {s * 1e3:10.3f} ms" if not name.endswith(" s") else f"{name:40s} {s:10.1f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
