"""One LoRA training step of the UNet, sdjax against diffusers + peft (the step of diffusers'
`train_text_to_image_lora.py`), the same model, batch, rank and optimiser, side by side in one process.

    python benchmarks/finetune_step.py --arch sd15 --size 512 --batch 4 --dtype bfloat16 [--json out.json]   # GPU
    python benchmarks/finetune_step.py --arch sd15 --size 256 --batch 1 --dtype float32 --steps 3              # CPU

What a step is, in both: latents and the text context given (as with cached latents and embeddings), fresh noise
and timesteps drawn, DDPM noising, the UNet's epsilon prediction with a rank-`--rank` LoRA on the attention
projections (to_q, to_k, to_v, to_out.0), MSE loss, backward, gradient clipping at norm 1, AdamW update of the LoRA.
Frozen weights in `--dtype`, LoRA and optimiser in float32: diffusers' script's mixed precision (the UNet cast to
the weight dtype, the LoRA params to float32, the forward under autocast), sdjax's `finetune.step` as
`sdjax train lora` runs it. Random full-size weights (the released config), each framework its own; times are
medians of `--steps` steps after `--warm` steps.
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
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # both frameworks share the GPU


def _alphas_cumprod(n: int = 1000):
    import numpy as np

    betas = np.linspace(0.00085**0.5, 0.012**0.5, n, dtype=np.float64) ** 2  # "scaled_linear", SD's schedule
    return np.cumprod(1.0 - betas).astype(np.float32)


def _shapes(a, size: int, batch: int):
    return (batch, a.unet["in_channels"], size // 8, size // 8), (batch, 77, a.unet["cross_attention_dim"])


def sdjax_step(arch: str, size: int, batch: int, dtype: str, rank: int, warm: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdjax.finetune import lora as lora_lib
    from sdjax.finetune import step as step_lib
    from sdjax.models.presets import ARCHITECTURES, random_params
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel

    a = ARCHITECTURES[arch]
    dt = jnp.dtype(dtype)
    config = UNet2DConditionConfig(**a.unet)
    unet = UNet2DConditionModel(config=config, dtype=dt)
    shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), unet.init_params_shape(config))
    frozen = random_params(shapes, 0, dt)
    lora = lora_lib.init_lora(jax.random.PRNGKey(0), {"unet": frozen}, {"unet": lora_lib.UNET_TARGETS}, rank)
    models = step_lib.Models(None, unet, None, dtype=dt, unet_scale=1.0)
    objective = step_lib.Objective()
    ac = jnp.asarray(_alphas_cumprod())
    lat_shape, ctx_shape = _shapes(a, size, batch)
    rng = np.random.default_rng(0)
    data = {
        "latents": jnp.asarray(rng.standard_normal(lat_shape), jnp.float32),
        "context": jnp.asarray(rng.standard_normal(ctx_shape), dt),
    }

    def loss_fn(lora, frozen, data, key):
        inputs = {**data, **step_lib.draw(key, data["latents"].shape, objective), "unet_kwargs": {}}
        return step_lib.unet_loss(lora["unet"], frozen, models, objective, ac, inputs)

    optimizer = step_lib.make_optimizer(step_lib.lr_schedule(1e-4, 1000, 0, "constant"))
    train = step_lib.jit_step(loss_fn, optimizer)
    state = step_lib.init_state(lora, optimizer)
    key = jax.random.PRNGKey(1)
    t0 = time.perf_counter()
    state, loss = train(state, frozen, data, key)
    loss.block_until_ready()
    first = time.perf_counter() - t0
    for _ in range(warm - 1):
        state, loss = train(state, frozen, data, key)
    loss.block_until_ready()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, loss = train(state, frozen, data, key)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "best_s": min(times),
        "first_s": first,
        "loss": float(loss.detach()) if hasattr(loss, "detach") else float(loss),
    }


def torch_step(arch: str, size: int, batch: int, dtype: str, rank: int, warm: int, steps: int, device: str) -> dict:
    import diffusers
    import torch
    from peft import LoraConfig

    from sdjax.models.presets import ARCHITECTURES

    a = ARCHITECTURES[arch]
    dt = getattr(torch, dtype)
    with torch.device(device):
        unet = diffusers.UNet2DConditionModel.from_config(a.unet)
    unet.requires_grad_(False)
    unet.to(device, dtype=dt)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=TARGETS))
    trained = [p for p in unet.parameters() if p.requires_grad]
    for p in trained:  # diffusers' cast_training_params: the LoRA in float32
        p.data = p.data.float()
    opt = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    sched = diffusers.DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    lat_shape, ctx_shape = _shapes(a, size, batch)
    g = torch.Generator(device="cpu").manual_seed(0)
    latents = torch.randn(lat_shape, generator=g).to(device)
    context = torch.randn(ctx_shape, generator=g).to(device, dt)
    autocast = torch.autocast(device.split(":")[0], dtype=dt, enabled=dt != torch.float32)

    def step():
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (batch,), device=device).long()
        noisy = sched.add_noise(latents, noise, t)
        with autocast:
            pred = unet(noisy.to(dt), t, context).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(warm - 1):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "best_s": min(times),
        "first_s": first,
        "loss": float(loss.detach()) if hasattr(loss, "detach") else float(loss),
    }


TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sd15", choices=["sd15", "sd21", "tiny"])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--torch-device", default=None, help="default: cuda when torch sees a GPU, else cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.size % 8 or args.batch < 1 or args.rank < 1 or args.warm < 1 or args.steps < 1:
        raise SystemExit("--size must be a multiple of 8; --batch, --rank, --warm and --steps at least 1")
    import jax
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    device = args.torch_device or ("cuda" if torch.cuda.is_available() else "cpu")
    common = (args.arch, args.size, args.batch, args.dtype, args.rank, args.warm, args.steps)
    ours = sdjax_step(*common)
    theirs = torch_step(*common, device)
    result = {
        "device": jax.devices()[0].device_kind,
        "torch_device": device,
        "config": vars(args),
        "sdjax": ours,
        "diffusers_peft": theirs,
        "ratio": ours["median_s"] / theirs["median_s"],
    }
    print(
        f"\n{result['device']} (torch on {device}): {args.arch} {args.size}x{args.size} batch {args.batch} "
        f"{args.dtype}, LoRA rank {args.rank}, medians of {args.steps} steps after {args.warm}"
    )
    print(f"{'':<16}{'step s':>10}{'best s':>10}{'first s':>10}")
    for name, r in (("sdjax", ours), ("diffusers+peft", theirs)):
        print(f"{name:<16}{r['median_s']:>10.4f}{r['best_s']:>10.4f}{r['first_s']:>10.2f}")
    print(f"sdjax / diffusers+peft: {result['ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
