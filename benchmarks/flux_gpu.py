"""Flux.1 end to end on one GPU: sdjax against diffusers' FluxPipeline (eager and `torch.compile`d), full size.

Random weights from the released configs (`sdjax.families.flux.presets`: the 11.9e9-parameter transformer, T5 v1.1
XXL, CLIP-L, the 16-channel VAE), bf16 weights and compute, made on the GPU (no files: a 12B model's host-side
random init alone would take minutes). Each framework runs in its own process, one after the other, so neither
holds memory or clocks the other needs:

    python benchmarks/flux_gpu.py sdjax --kind schnell --steps 4 --json out/flux-schnell-sdjax.json
    python benchmarks/flux_gpu.py torch --kind schnell --steps 4 [--compile] --json out/flux-schnell-torch.json

A row is prompt -> `steps` Euler steps -> decoded 1024x1024 image (`output_type="np"`), batch 1, no true CFG
(schnell: no guidance; dev: distilled guidance 3.5, T5 length 512; schnell 256). Medians of --reps calls after
one warm call; the first call's time (sdjax: compile included) is reported apart. The tokenizers are shape-only
(the T5 vocabulary of `shape_t5_tokenizer`, CLIP's real one): the programs are the released models', the prompt
is not read as a real tokenizer would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

PROMPT = "a photo of a red fox in the snow"


def _timed(fn, reps: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, times


def _row(framework: str, args, first: float, times: list[float], **extra) -> dict:
    row = {
        "framework": framework,
        "kind": args.kind,
        "size": args.size,
        "steps": args.steps,
        "first_call_s": first,
        "median_s": statistics.median(times),
        "best_s": min(times),
        "times_s": times,
        **extra,
    }
    print(json.dumps(row), flush=True)
    return row


def device_random(shapes, seed: int = 0):
    """Random params of `shapes` (a tree of ShapeDtypeStruct) made on the default device: kernels N(0, 1/fan_in),
    embeddings N(0, 0.02), norm scales 1, biases 0 (the rule of `sdjax.models.presets.random_params`)."""
    import math
    from functools import partial

    import jax
    import jax.numpy as jnp

    @partial(jax.jit, static_argnums=(1, 2, 3))
    def normal(key, shape, dtype, std):
        return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)

    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys):
        name = str(getattr(path[-1], "key", path[-1]))
        shape, dtype = tuple(leaf.shape), leaf.dtype
        if name == "scale":
            out.append(jnp.ones(shape, dtype))
        elif name == "bias":
            out.append(jnp.zeros(shape, dtype))
        else:
            std = 0.02 if name == "embedding" else 1 / math.sqrt(max(1, math.prod(shape[:-1])))
            out.append(normal(key, shape, dtype, float(std)))
    return jax.tree_util.tree_unflatten(tree, out)


def run_sdjax(args) -> dict:
    import jax

    from sdjax.families.flux.presets import build_flux_pipeline

    t0 = time.perf_counter()
    pipe, abstract = build_flux_pipeline(args.kind, "bfloat16", abstract=True, max_sequence_length=args.seq)
    params = {k: (v if k == "scheduler" else device_random(v, i)) for i, (k, v) in enumerate(abstract.items())}
    jax.block_until_ready(params)
    made = time.perf_counter() - t0
    guidance = 3.5 if pipe.transformer.config.guidance_embeds else None

    def call():
        pipe.generate(
            PROMPT,
            steps=args.steps,
            height=args.size,
            width=args.size,
            guidance_scale=guidance,
            max_sequence_length=args.seq,
            params=params,
            output_type="np",
        )

    first, times = _timed(call, args.reps)
    dev = jax.devices()[0]
    return _row(
        "sdjax",
        args,
        first,
        times,
        weights_made_s=made,
        device=getattr(dev, "device_kind", str(dev)),
        jax=jax.__version__,
    )


def run_torch(args) -> dict:
    import reference
    import t5_reference
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast

    from sdjax.families.flux.presets import flux_architecture

    a = flux_architecture(args.kind)
    torch.set_grad_enabled(False)
    cuda = args.torch_device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    torch.set_default_device(args.torch_device)
    torch.set_default_dtype(torch.bfloat16)
    transformer = FluxTransformer2DModel(**{k: v for k, v in a.transformer.items() if k != "out_channels"}).eval()
    t5 = T5EncoderModel(T5Config(**a.text_encoder_2)).eval()
    clip_cfg = json.loads((ROOT / "src/sdjax/assets/configs/sd15/text_encoder/config.json").read_text())
    clip = CLIPTextModel(CLIPTextConfig(**(a.text_encoder or clip_cfg))).eval()
    vae = AutoencoderKL(**a.vae).eval()
    torch.set_default_device("cpu")
    torch.set_default_dtype(torch.float32)
    sched = {k: v for k, v in a.scheduler.items() if k != "_class_name"}
    tok_dir = t5_reference.write_t5_tokenizer(Path(os.environ.get("TMPDIR", "/tmp")) / "flux-gpu-t5tok")
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**sched),
        text_encoder=clip,
        tokenizer=reference.clip_tokenizer(),
        text_encoder_2=t5,
        tokenizer_2=T5TokenizerFast.from_pretrained(str(tok_dir)),
        transformer=transformer,
        vae=vae,
    )
    sync()
    made = time.perf_counter() - t0
    guidance = 3.5 if a.transformer["guidance_embeds"] else 0.0

    def call():
        pipe(
            PROMPT,
            num_inference_steps=args.steps,
            height=args.size,
            width=args.size,
            guidance_scale=guidance,
            max_sequence_length=args.seq,
            output_type="np",
        )
        sync()

    rows = []
    first, times = _timed(call, args.reps)
    extra = dict(weights_made_s=made, device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    rows.append(_row("diffusers eager", args, first, times, **extra))
    if args.compile:
        # diffusers' guide compiles the transformer (and the VAE decode); fullgraph=True trips dynamo on the
        # attention processor's `unflatten` here, so graph breaks are allowed.
        pipe.transformer = torch.compile(pipe.transformer)
        pipe.vae.decode = torch.compile(pipe.vae.decode)
        try:
            first, times = _timed(call, args.reps)
        except Exception as e:  # the eager row stands; say why the compiled one is missing
            print(f"torch.compile failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        else:
            rows.append(_row("diffusers torch.compile", args, first, times, mode="default", **extra))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("framework", choices=["sdjax", "torch"])
    ap.add_argument("--kind", default="schnell", help="schnell, dev or tiny (a seconds-long check of the script)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=None, help="T5 length (default: schnell 256, dev 512)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch: also time the torch.compile'd pipeline")
    ap.add_argument("--torch-device", default="cuda", help="cpu: a check of the script on a machine without a GPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.seq is None:
        args.seq = 256 if args.kind in ("schnell", "flux-schnell") else 512
    rows = run_sdjax(args) if args.framework == "sdjax" else run_torch(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows if isinstance(rows, list) else [rows], indent=1))


if __name__ == "__main__":
    main()
