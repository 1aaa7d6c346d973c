"""Full-size parity check: the SD 1.5 UNet (and text encoder, when `sdjax.models.clip` exists) in PyTorch and sdjax.

Random weights (nothing can be downloaded here) in the released diffusers/transformers configs, float32, one
forward: UNet at 64x64 latents (512x512 images), batch 2, 77x768 encoder states; text encoder on batch 2 of
77 random token ids ending in EOS. Prints max abs and relative errors. Takes minutes on CPU and a few GB of memory.

    python scripts/check_full_size.py [--attention xla|dot_product|chunked] [--split-head-dim] [--skip-text]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # full_size.py: the released configs and torch builders

import full_size  # noqa: E402


def report(name: str, got, want) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = np.abs(got - want)
    big = np.abs(want) > 1e-2 * np.abs(want).max()
    print(
        f"{name}: shape {want.shape}, max |ref| {np.abs(want).max():.4g}, max abs err {diff.max():.3e}, "
        f"max abs err / max |ref| {diff.max() / np.abs(want).max():.3e}, "
        f"max rel err where |ref| > 1% of max {(diff[big] / np.abs(want[big])).max():.3e}, "
        f"mean abs err {diff.mean():.3e}",
        flush=True,
    )


def check_unet(attention: str, split_head_dim: bool) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    from sdjax.config import config_from_dict
    from sdjax.models import unet as U

    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 64, 64)).astype(np.float32)
    timesteps = np.array([981, 37])
    context = rng.standard_normal((2, 77, 768)).astype(np.float32)

    t0 = time.time()
    tm = full_size.torch_unet(full_size.SD15_UNET)
    with torch.no_grad():
        want = tm(torch.from_numpy(sample), torch.from_numpy(timesteps), torch.from_numpy(context)).sample.numpy()
    print(f"torch UNet forward: {time.time() - t0:.1f} s (incl. init)", flush=True)
    state = full_size.numpy_state(tm)
    del tm
    gc.collect()

    config = config_from_dict(U.UNet2DConditionConfig, dict(full_size.SD15_UNET), source="SD15_UNET")
    params = U.convert_unet(state, config, cast=jnp.asarray)
    del state
    gc.collect()
    model = U.UNet2DConditionModel(config, attention=attention, split_head_dim=split_head_dim)
    fn = jax.jit(lambda p, x, t, c: model.apply({"params": p}, x, t, c))
    t0 = time.time()
    compiled = fn.lower(params, sample, timesteps, context).compile()
    print(f"sdjax UNet compile: {time.time() - t0:.1f} s", flush=True)
    t0 = time.time()
    got = np.asarray(compiled(params, sample, timesteps, context))
    print(f"sdjax UNet forward: {time.time() - t0:.1f} s", flush=True)
    report(f"SD1.5 UNet (attention={attention}, split_head_dim={split_head_dim})", got, want)


def check_text() -> None:
    try:
        from sdjax.models import clip
    except ImportError:
        print("sdjax.models.clip not available: text encoder check skipped")
        return
    import jax
    import jax.numpy as jnp
    import torch

    cfg_raw = dict(full_size.SD15_TEXT)
    tm = full_size.torch_text(cfg_raw)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 49406, size=(2, 77))
    ids[:, 0], ids[0, 20], ids[0, 21:], ids[1, -1] = 49406, 49407, 49407, 49407  # BOS, EOS (+ padding), EOS
    with torch.no_grad():
        out = tm(torch.from_numpy(ids))
    config = clip.CLIPTextConfig.from_dict(cfg_raw, source="SD15_TEXT")
    params = clip.convert_clip_text(full_size.numpy_state(tm), config, with_projection=False, cast=jnp.asarray)
    model = clip.CLIPTextModel(config)
    got = jax.jit(lambda p, i: model.apply({"params": p}, i))(params, jnp.asarray(ids, jnp.int32))
    report("SD1.5 text encoder last_hidden_state", got.last_hidden_state, out.last_hidden_state.numpy())
    report("SD1.5 text encoder pooler_output", got.pooler_output, out.pooler_output.numpy())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", default="xla", choices=["xla", "dot_product", "chunked"])
    ap.add_argument("--split-head-dim", action="store_true")
    ap.add_argument("--skip-text", action="store_true")
    args = ap.parse_args()
    if not args.skip_text:
        check_text()
    check_unet(args.attention, args.split_head_dim)


if __name__ == "__main__":
    main()
