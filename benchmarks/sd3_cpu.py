"""SD 3.5 on CPU, side by side with PyTorch diffusers' StableDiffusion3Pipeline on the same random mid-size model.

Both load the same diffusers folder, random weights from an SD 3.5 medium config shrunk in depth and width: an
MMDiT of 6 joint blocks of width 512 (8 heads of 64; the first 3 with the dual attention of SD 3.5, qk RMSNorm,
the last block context pre-only), `pos_embed_max_size` 384 as released; CLIP-L and CLIP-G with projection shrunk to
widths 192 and 320 (together the 512 of the T5 width, as 768 + 1280 <= 4096 in the release); a 4-layer T5 v1.1 of
width 512; the 16-channel VAE at (64, 128, 256, 256). float32, 512x512, 4 flow-matching Euler steps (shift 3),
classifier-free guidance 7 on, 128 T5 tokens. Timed alternately in one run (`side_by_side.py`: one warm-up call
of each excluded, medians of `--reps`):

- one transformer call (the CFG batch of 2 at 512x512: 1024 image tokens + 77 CLIP + 128 T5 text tokens);
- end to end: prompt -> text encoders -> 4 steps -> decoded image (sdjax's compiled program vs diffusers' eager
  pipeline).

Then a sanity line: sdjax is handed diffusers' initial noise and the two end-to-end images are compared; and each
side's end to end once more, each in a fresh process of its own, for its peak resident memory
(`side_by_side.own_process_peaks`).

    python benchmarks/sd3_cpu.py [--reps 3] [--json out.json]

Prints a table and the load average and (with --json) writes the numbers. Run it on a quiet machine; the ratio is
the result, the absolute times are this CPU's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from side_by_side import (
    MAX_SEQ,
    SIZE,
    STEPS,
    T5_WIDTH,
    alternate,
    load_average,
    own_process_peaks,
    parse_args,
    report,
    serve_memory_child,
    t5_parts,
    vae,
)

GUIDANCE = 7.0
PROMPT = "a red circle on a blue background"
WIDTH = T5_WIDTH  # the transformer's width: 8 heads of 64


def build(folder: Path):
    """The random diffusers StableDiffusion3Pipeline, saved under `folder`: `(pipeline, its folder)`."""
    import reference
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    clip_l = {**reference.CLIP_SDXL_1, "hidden_size": 192, "intermediate_size": 768, "num_attention_heads": 3}
    clip_l["projection_dim"] = 192
    clip_g = {**reference.CLIP_SDXL_2, "hidden_size": 320, "intermediate_size": 1280, "num_attention_heads": 5}
    clip_g["projection_dim"] = 320
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=6,
        attention_head_dim=64,
        num_attention_heads=WIDTH // 64,
        joint_attention_dim=WIDTH,
        caption_projection_dim=WIDTH,
        pooled_projection_dim=clip_l["projection_dim"] + clip_g["projection_dim"],
        out_channels=16,
        pos_embed_max_size=384,
        dual_attention_layers=(0, 1, 2),
        qk_norm="rms_norm",
    ).eval()
    autoencoder = vae(scaling_factor=1.5305, shift_factor=0.0609)
    t5, t5_tokenizer = t5_parts(folder, seed=2)
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        text_encoder=reference.text_encoder(clip_l, with_projection=True, seed=0),
        tokenizer=reference.clip_tokenizer(),
        text_encoder_2=reference.text_encoder(clip_g, with_projection=True, seed=1),
        tokenizer_2=reference.clip_tokenizer(pad_token="!"),
        text_encoder_3=t5,
        tokenizer_3=t5_tokenizer,
        transformer=transformer,
        vae=autoencoder,
    )
    pipe.save_pretrained(folder / "sd3", safe_serialization=True)
    return pipe, folder / "sd3"


def transformer_row(pipe, params, torch_pipe, reps: int):
    """One transformer call on the CFG batch of 2, the inputs one step of the pipeline would give it."""
    import jax
    import jax.numpy as jnp
    import torch

    h = w = SIZE // 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, h, w)).astype(np.float32)
    text = rng.standard_normal((2, 77 + MAX_SEQ, WIDTH)).astype(np.float32)
    pooled = rng.standard_normal((2, 512)).astype(np.float32)
    t = np.full((2,), 750.0, np.float32)
    module = pipe.transformer
    call = jax.jit(lambda p, *a: module.apply({"params": p}, *a))
    args_j = [jnp.asarray(a) for a in (x, text, pooled, t)]
    tt = [torch.from_numpy(a) for a in (x, text, pooled, t)]

    def sdjax_call():
        call(params["transformer"], *args_j).block_until_ready()

    def torch_call():
        torch_pipe.transformer(
            hidden_states=tt[0], encoder_hidden_states=tt[1], pooled_projections=tt[2], timestep=tt[3]
        )

    return ("transformer call (CFG batch 2, 1024+205 tokens)", *alternate(sdjax_call, torch_call, reps))


COMMON = dict(height=SIZE, width=SIZE, max_sequence_length=MAX_SEQ, guidance_scale=GUIDANCE, output_type="np")
LATENTS = (1, 16, SIZE // 8, SIZE // 8)


def torch_noise():
    """diffusers' initial latents: one torch-seeded draw (sdjax gets the same values as `noise=`)."""
    import torch

    return torch.randn(LATENTS, generator=torch.Generator().manual_seed(0))


def load_sdjax(folder):
    """sdjax's StableDiffusion3Pipeline from the saved folder: `(pipeline, params)`."""
    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(str(folder))


def load_torch(folder):
    """diffusers' StableDiffusion3Pipeline from the saved folder (the memory child's torch side; the timing uses
    `build`'s)."""
    import torch
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(str(folder), torch_dtype=torch.float32)


def sdjax_e2e(pipe, noise: np.ndarray):
    """sdjax's end-to-end call from the given initial noise; returns the images."""
    return lambda: pipe.generate(PROMPT, steps=STEPS, noise=noise, **COMMON)


def torch_e2e(torch_pipe, noise):
    """diffusers' end-to-end call from the given latents (a torch tensor, cloned per call); returns the images."""
    return lambda: torch_pipe(PROMPT, num_inference_steps=STEPS, latents=noise.clone(), **COMMON).images


def end_to_end_row(pipe, torch_pipe, reps: int):
    """End to end, and the max abs difference of the two images: sdjax starts from diffusers' noise."""
    noise = torch_noise()
    calls = {"sdjax": sdjax_e2e(pipe, noise.numpy()), "torch": torch_e2e(torch_pipe, noise)}
    images = {}

    def sdjax_call():
        images["sdjax"] = calls["sdjax"]()

    def torch_call():
        images["torch"] = calls["torch"]()

    row = (f"end to end ({STEPS} steps, CFG, 512x512, decode)", *alternate(sdjax_call, torch_call, reps))
    a, b = np.asarray(images["sdjax"], np.float32), np.asarray(images["torch"], np.float32)
    diff = float(np.abs(a - b).max()) if a.shape == b.shape else float("nan")
    return (
        row,
        f"end-to-end images from the same noise, shapes {a.shape} / {b.shape}: max abs difference {diff:.2e}",
        diff,
    )


def main() -> None:
    args = parse_args(__doc__)
    # The sdjax memory child draws its noise with numpy (same shape and dtype): torch's import would count in its
    # memory; the values do not change what a generation holds.
    numpy_noise = np.random.default_rng(0).standard_normal(LATENTS).astype(np.float32)
    if serve_memory_child(
        args,
        sdjax=lambda folder: sdjax_e2e(load_sdjax(folder)[0], numpy_noise),
        torch=lambda folder: torch_e2e(load_torch(folder), torch_noise()),
    ):
        return
    import torch

    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        torch_pipe, folder = build(Path(tmp))
        pipe, params = load_sdjax(folder)
        before = load_average()
        rows = [transformer_row(pipe, params, torch_pipe, args.reps)]
        e2e, sanity, diff = end_to_end_row(pipe, torch_pipe, args.reps)
        rows.append(e2e)
        load = (before, load_average())
        report(rows, args, load, [sanity], peaks=own_process_peaks(folder), image_max_abs_diff=diff)


if __name__ == "__main__":
    main()
