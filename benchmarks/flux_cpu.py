"""Flux.1 on CPU, side by side with PyTorch diffusers' FluxPipeline on the same random mid-size model.

Both load the same diffusers folder (random weights from a shrunk FLUX.1-dev config: 4 double- and 8 single-stream
blocks of width 512, a 4-layer T5 of width 512, CLIP-L shrunk, the 16-channel VAE at (64, 128, 256, 256)), float32.
Timed alternately in one run (`side_by_side.py`: one warm-up call of each excluded, medians of `--reps`), so the
ratio is robust to the machine's load:

- one transformer call (the CFG-free batch of 1 at 512x512: 1024 image tokens + 128 text tokens);
- end to end: prompt -> 4 Euler steps -> decoded image (sdjax's compiled program vs diffusers' eager pipeline).

    python benchmarks/flux_cpu.py [--reps 3] [--json out.json]

Then each side's end to end once more, each in a fresh process of its own, for its peak resident memory
(`side_by_side.own_process_peaks`).

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

POOLED = 256  # the shrunk CLIP-L's width


def build(folder: Path):
    """The random diffusers FluxPipeline, saved under `folder`: `(pipeline, its folder)`."""
    import flux_reference
    import reference
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip_cfg = {**reference.CLIP_SD1, "hidden_size": POOLED, "intermediate_size": 1024, "num_attention_heads": 4}
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=4,
        num_single_layers=8,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=T5_WIDTH,
        pooled_projection_dim=POOLED,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ).eval()
    autoencoder = vae(scaling_factor=0.3611, shift_factor=0.1159)
    t5, t5_tokenizer = t5_parts(folder)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**flux_reference.SCHEDULERS["dev"]),
        text_encoder=reference.text_encoder(clip_cfg),
        tokenizer=reference.clip_tokenizer(),
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
        vae=autoencoder,
    )
    pipe.save_pretrained(folder / "flux", safe_serialization=True)
    return pipe, folder / "flux"


def transformer_inputs() -> tuple[np.ndarray, ...]:
    """One step's transformer inputs at 512x512: packed latents, T5 states, pooled CLIP, t, ids, guidance."""
    from sdjax.models import flux as flux_model

    h = w = SIZE // 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, h, w)).astype(np.float32)
    tokens = np.asarray(flux_model.pack_latents(x))
    text = rng.standard_normal((1, MAX_SEQ, T5_WIDTH)).astype(np.float32)
    pooled = rng.standard_normal((1, POOLED)).astype(np.float32)
    img_ids = np.asarray(flux_model.image_ids(h, w))
    t, g = np.array([0.5], np.float32), np.array([3.5], np.float32)
    return tokens, text, pooled, t, img_ids, flux_model.text_ids(MAX_SEQ), g


def transformer_row(pipe, params, torch_pipe, reps: int):
    import jax
    import jax.numpy as jnp
    import torch

    inputs = transformer_inputs()
    module = pipe.transformer
    call = jax.jit(lambda p, *a: module.apply({"params": p}, *a))
    args_j = [jnp.asarray(a) for a in inputs]
    names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids")
    kwargs = {k: torch.from_numpy(a) for k, a in zip((*names, "guidance"), inputs)}

    def sdjax_call():
        call(params["transformer"], *args_j).block_until_ready()

    def torch_call():
        torch_pipe.transformer(**kwargs)

    return ("transformer call (512x512, 1024+128 tokens)", *alternate(sdjax_call, torch_call, reps))


COMMON = dict(height=SIZE, width=SIZE, max_sequence_length=MAX_SEQ, output_type="np")


def load_sdjax(folder):
    """sdjax's FluxPipeline from the saved folder: `(pipeline, params)`."""
    from sdjax.families.flux.pipeline import FluxPipeline

    return FluxPipeline.from_pretrained(str(folder))


def load_torch(folder):
    """diffusers' FluxPipeline from the saved folder (the memory child's torch side; the timing uses `build`'s)."""
    import torch
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)


def sdjax_e2e(pipe):
    return lambda: pipe.generate("a red circle", steps=STEPS, **COMMON)


def torch_e2e(torch_pipe):
    return lambda: torch_pipe("a red circle", num_inference_steps=STEPS, **COMMON)


def end_to_end_row(pipe, torch_pipe, reps: int):
    row = alternate(sdjax_e2e(pipe), torch_e2e(torch_pipe), reps)
    return (f"end to end ({STEPS} steps, 512x512, decode)", *row)


def main() -> None:
    args = parse_args(__doc__)
    if serve_memory_child(
        args,
        sdjax=lambda folder: sdjax_e2e(load_sdjax(folder)[0]),
        torch=lambda folder: torch_e2e(load_torch(folder)),
    ):
        return
    import torch

    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        torch_pipe, folder = build(Path(tmp))
        pipe, params = load_sdjax(folder)
        before = load_average()
        rows = [transformer_row(pipe, params, torch_pipe, args.reps), end_to_end_row(pipe, torch_pipe, args.reps)]
        load = (before, load_average())
        report(rows, args, load, peaks=own_process_peaks(folder))


if __name__ == "__main__":
    main()
