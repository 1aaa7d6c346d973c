"""Flux.1 on CPU, side by side with PyTorch diffusers' FluxPipeline on the same random mid-size model.

Both load the same diffusers folder (random weights from a shrunk FLUX.1-dev config: 4 double- and 8 single-stream
blocks of width 512, a 4-layer T5 of width 512, CLIP-L shrunk, the 16-channel VAE at (64, 128, 256, 256)), float32.
Timed alternately in one run, so the ratio is robust to the machine's load:

- one transformer call (the CFG-free batch of 1 at 512x512: 1024 image tokens + 128 text tokens);
- end to end: prompt -> 4 Euler steps -> decoded image (sdjax's compiled program vs diffusers' eager pipeline).

    python benchmarks/flux_cpu.py [--reps 3] [--json out.json]

Prints a table and (with --json) writes the numbers. Run it on a quiet machine; the ratio is the result, the
absolute times are this CPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SIZE = 512
STEPS = 4
MAX_SEQ = 128


def build(folder: Path):
    import flux_reference
    import reference
    import t5_reference
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5TokenizerFast

    tok = t5_reference.write_t5_tokenizer(folder / "t5tok")
    t5_cfg = {**t5_reference.T5_TINY, "d_model": 512, "d_ff": 1024, "d_kv": 64, "num_heads": 8, "num_layers": 4}
    clip_cfg = {**reference.CLIP_SD1, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4}
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=4,
        num_single_layers=8,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=512,
        pooled_projection_dim=256,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ).eval()
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=(64, 128, 256, 256),
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**flux_reference.SCHEDULERS["dev"]),
        text_encoder=reference.text_encoder(clip_cfg),
        tokenizer=reference.clip_tokenizer(),
        text_encoder_2=t5_reference.t5_encoder(t5_cfg),
        tokenizer_2=T5TokenizerFast.from_pretrained(str(tok)),
        transformer=transformer,
        vae=vae,
    )
    pipe.save_pretrained(folder / "flux", safe_serialization=True)
    return pipe, folder / "flux"


def timed(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import torch

    from sdjax.families.flux.pipeline import FluxPipeline
    from sdjax.models import flux as flux_model

    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        torch_pipe, folder = build(Path(tmp))
        pipe, params = FluxPipeline.from_pretrained(str(folder))

        h = w = SIZE // 8
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 16, h, w)).astype(np.float32)
        tokens = np.asarray(flux_model.pack_latents(x))
        text = rng.standard_normal((1, MAX_SEQ, 512)).astype(np.float32)
        pooled = rng.standard_normal((1, 256)).astype(np.float32)
        img_ids = np.asarray(flux_model.image_ids(h, w))
        txt_ids = np.zeros((MAX_SEQ, 3), np.float32)
        t = np.array([0.5], np.float32)
        g = np.array([3.5], np.float32)
        module = pipe.transformer
        call = jax.jit(lambda p, *a: module.apply({"params": p}, *a))
        args_j = [jnp.asarray(a) for a in (tokens, text, pooled, t, img_ids, txt_ids, g)]
        call(params["transformer"], *args_j).block_until_ready()
        tt = [torch.from_numpy(a) for a in (tokens, text, pooled, t, img_ids, txt_ids, g)]

        def torch_call():
            torch_pipe.transformer(
                hidden_states=tt[0],
                encoder_hidden_states=tt[1],
                pooled_projections=tt[2],
                timestep=tt[3],
                img_ids=tt[4],
                txt_ids=tt[5],
                guidance=tt[6],
            )

        torch_call()
        rows = []
        sj = timed(lambda: call(params["transformer"], *args_j).block_until_ready(), args.reps)
        pt = timed(torch_call, args.reps)
        rows.append(("transformer call (512x512, 1024+128 tokens)", sj, pt))

        def sdjax_e2e():
            pipe.generate(
                "a red circle", steps=STEPS, height=SIZE, width=SIZE, max_sequence_length=MAX_SEQ, output_type="np"
            )

        def torch_e2e():
            torch_pipe(
                "a red circle",
                num_inference_steps=STEPS,
                height=SIZE,
                width=SIZE,
                max_sequence_length=MAX_SEQ,
                output_type="np",
            )

        sdjax_e2e()  # compile
        torch_e2e()
        sj, pt = [], []
        for _ in range(args.reps):  # alternate
            sj.append(timed(sdjax_e2e, 1))
            pt.append(timed(torch_e2e, 1))
        rows.append((f"end to end ({STEPS} steps, 512x512, decode)", min(sj), min(pt)))

    print(f"{'piece':<48} {'sdjax s':>9} {'torch s':>9} {'sdjax/torch':>12}")
    for name, a, b in rows:
        print(f"{name:<48} {a:9.3f} {b:9.3f} {a / b:12.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps([{"piece": n, "sdjax_s": a, "torch_s": b, "ratio": a / b} for n, a, b in rows], indent=1)
        )


if __name__ == "__main__":
    main()
