"""SD 3 / 3.5 LoRA training: the flow step of `sdjax.finetune.flow` with the SD 3 adapter, against diffusers 0.42.1 +
peft 0.21.2 on the tiny SD 3.5-medium-shaped pipeline of tests/sd3_reference.py (dual-attention block 0, a
context pre-only last block, T5), saved as a diffusers folder.

- The step: diffusers' `SD3Transformer2DModel` with the peft LoRA of `train_dreambooth_lora_sd3.py` (its default
  `--lora_layers`: the attention projections of both streams) computing the script's loss (the scheduler's shifted
  grid, shift 3; the timestep itself, not divided; `--precondition_outputs` 1, its default, and 0) on the same
  latents, noise, `u` and text states: loss <= 1e-5 relative, LoRA gradients <= 1e-4 relative (L2, per tensor).
- A short run through `train_lora` writes diffusers' LoRA file, which `StableDiffusion3Pipeline.load_lora_weights`
  and sdjax's `load_lora` read to the same image (the SD 3 pipeline tests' 1e-3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flow_helpers import lora_from_peft, peft_transformer, save_sd3, script_loss, tiny_lora_run, worst_grad_error

from sdjax.finetune import flow, flow_models

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("optax")

RANK, ALPHA = 4, 2.0  # alpha / r = 0.5
SIZE, MAX_SEQ = 32, 16
ATOL = 1e-3  # tests/families/test_sd3_pipeline.py


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    import t5_reference

    from sdjax.pipelines import load_pipeline

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    torch_pipe, folder = save_sd3(tmp_path_factory, tok)
    pipe, params = load_pipeline(str(folder))
    return torch_pipe, folder, pipe, params


@pytest.mark.parametrize(("scheme", "precondition"), [("logit_normal", True), ("sigma_sqrt", False)])
def test_step_matches_the_diffusers_script(sd3, scheme, precondition):
    torch_pipe, _, pipe, params = sd3
    rng = np.random.default_rng(2)
    cfg = pipe.transformer.config
    batch = {
        "latents": rng.standard_normal((2, 16, SIZE // 2, SIZE // 2)).astype(np.float32),
        "noise": rng.standard_normal((2, 16, SIZE // 2, SIZE // 2)).astype(np.float32),
        "u": np.asarray([0.12, 0.88], np.float32),
        "text": rng.standard_normal((2, 9, cfg.joint_attention_dim)).astype(np.float32),
        "pooled": rng.standard_normal((2, cfg.pooled_projection_dim)).astype(np.float32),
    }
    targets = flow_models.SD3_TARGETS
    model = peft_transformer(torch_pipe.transformer, targets, RANK, ALPHA)
    ref = script_loss(
        "sd3",
        model,
        torch_pipe.scheduler.config,
        batch,
        weighting_scheme=scheme,
        precondition_outputs=precondition,
    )
    ref.backward()
    ref = float(ref.detach())

    lora, torch_params = lora_from_peft(params["transformer"], model, targets, RANK)
    assert len(lora["transformer"]) == 8 + 8 + 7  # the last block is context pre-only: no to_add_out
    models = flow.FlowModels(flow_models.SD3Adapter(pipe.transformer), pipe.vae, scale=ALPHA / RANK)
    s = pipe.scheduler
    objective = flow.FlowObjective(
        weighting_scheme=scheme, precondition_outputs=precondition, shift=s.shift, use_dynamic_shifting=False
    )
    inputs = {k: jnp.asarray(v) for k, v in batch.items()}

    def loss(lora_t):
        return flow.denoiser_loss(lora_t, params["transformer"], models, objective, inputs)

    value, grads = jax.jit(jax.value_and_grad(loss))(lora["transformer"])
    rel = abs(float(value) - ref) / abs(ref)
    worst = worst_grad_error(grads, torch_params)
    print(f"SD 3 {scheme}, precondition {precondition}: loss {float(value):.7f} vs {ref:.7f} ({rel:.1e}); "
          f"worst gradient {worst:.1e}")  # fmt: skip
    assert rel <= 1e-5


def test_a_run_writes_the_file_diffusers_draws_alike(sd3, tmp_path):
    import inject
    from PIL import Image

    from sdjax import rng

    torch_pipe, folder, pipe, _ = sd3
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        img = np.full((SIZE, SIZE, 3), (30, 60, 220 - 40 * i), np.uint8)
        Image.fromarray(img).save(data / f"b{i}.png")
        (data / f"b{i}.txt").write_text("sks blue")
    result = tiny_lora_run(
        data, tmp_path / "sd3.safetensors", folder, size=SIZE, steps=6, rank=RANK, alpha=ALPHA, lr=2e-2,
        max_sequence_length=MAX_SEQ,
    )  # fmt: skip
    assert len(result.losses) == 6 and np.all(np.isfinite(result.losses))

    prompts, negative, seed = ["sks blue", "a red circle"], ["", "green"], 3
    keys = inject.image_keys(seed, len(prompts))
    kw = dict(negative_prompt=negative, guidance_scale=5.0, height=SIZE, width=SIZE, max_sequence_length=MAX_SEQ)
    torch_pipe.load_lora_weights(str(result.out), adapter_name="trained")
    try:
        noise = inject.stream(keys, rng.LATENTS, (16, SIZE // 2, SIZE // 2))
        with inject.prescribed(torch_pipe, latents_noise=noise), torch.no_grad():
            ref = torch_pipe(prompt=prompts, num_inference_steps=4, output_type="np", **kw).images
    finally:
        torch_pipe.unload_lora_weights()
    base = pipe.generate(prompts, steps=4, seed=seed, output_type="np", **kw)
    name = pipe.load_lora(result.out)
    try:
        assert {f.alpha_over_rank for f in pipe.loaded_loras[name].factors.values()} == {ALPHA / RANK}
        out = pipe.generate(prompts, steps=4, seed=seed, output_type="np", **kw)
    finally:
        pipe.unload_loras()
    err, moved = float(np.abs(out - ref).max()), float(np.abs(out - base).max())
    print(f"trained SD 3 LoRA: max |sdjax - diffusers| {err:.2e}; it moves the image by {moved:.2e}")
    assert err < ATOL and moved > 10 * ATOL
