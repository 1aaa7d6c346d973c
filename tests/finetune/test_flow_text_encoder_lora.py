"""Text-encoder LoRA and DreamBooth prior preservation of the flow LoRA step (`finetune.flow`, `flow_models`) against
diffusers 0.42.1 + transformers + peft 0.21.2 on the tiny Flux dev and SD 3.5-medium-shaped pipelines of
tests/flux_reference.py and tests/sd3_reference.py.

The reference is `train_dreambooth_lora_flux.py` / `_sd3.py` with `--train_text_encoder`: peft's LoRA
(`text_lora_config`: gaussian init, `q_proj`, `k_proj`, `v_proj`, `out_proj`) on transformers' CLIP encoders (Flux:
CLIP-L, SD 3: CLIP-L and CLIP-G; nonzero B factors), their `encode_prompt` (Flux: CLIP-L's `pooler_output` and
T5's states; SD 3: penultimate CLIP states padded to T5's width before T5's, `text_embeds` pooled), T5 frozen, and
the scripts' loss lines (with `--with_prior_preservation`: `torch.chunk(2)`, `loss + prior_loss_weight *
prior_loss`). Same latents, noise, `u` and token ids: loss <= 1e-5 relative, every LoRA gradient (transformer and
text encoders) <= 1e-4 relative (L2, per tensor).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flow_helpers import (
    dev_and_sd3_pipelines,
    lora_from_peft,
    peft_text_encoder,
    peft_transformer,
    script_loss,
    text_lora_from_peft,
    worst_grad_error,
)

from sdjax.finetune import flow, flow_models

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("optax")

RANK, ALPHA = 4, 8.0  # alpha / r = 2
SIZE, MAX_SEQ = 32, 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (torch pipeline, folder, sdjax pipeline, params) for Flux dev and SD 3."""
    return dev_and_sd3_pipelines(tmp_path_factory, MAX_SEQ)


def _adapter(family: str, pipe):
    if family == "flux":
        return flow_models.FluxAdapter(pipe.transformer)
    return flow_models.SD3Adapter(pipe.transformer)


def _torch_text(family: str, torch_pipe, encoders: dict, ids: dict, t5_ids: np.ndarray):
    """The scripts' `encode_prompt` with the peft CLIP encoders `encoders` on the given ids -> (text, pooled)."""
    ids = {k: torch.from_numpy(v).long() for k, v in ids.items()}
    t5_encoder = torch_pipe.text_encoder_2 if family == "flux" else torch_pipe.text_encoder_3
    with torch.no_grad():
        t5 = t5_encoder(torch.from_numpy(t5_ids).long())[0].float()
    if family == "flux":
        return t5, encoders["text_encoder"](ids["ids"], output_hidden_states=False).pooler_output
    outs = [encoders[c](ids[k], output_hidden_states=True) for c, k in zip(encoders, ("ids", "ids_2"))]
    clip = torch.cat([o.hidden_states[-2] for o in outs], dim=-1)
    pooled = torch.cat([o[0] for o in outs], dim=-1)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2), pooled


def _objective(pipe, scheme: str, precondition: bool, prior: float | None) -> flow.FlowObjective:
    s = pipe.scheduler
    return flow.FlowObjective(
        weighting_scheme=scheme,
        precondition_outputs=precondition,
        num_train_timesteps=s.num_train_timesteps,
        shift=float(getattr(s, "shift", 1.0)),
        use_dynamic_shifting=bool(getattr(s, "use_dynamic_shifting", False)),
        prior_loss_weight=prior,
    )


@pytest.mark.parametrize(
    ("family", "scheme", "precondition", "prior"),
    [("flux", "none", False, None), ("flux", "cosmap", False, 0.7), ("sd3", "logit_normal", True, 0.7)],
)
def test_step_with_text_encoder_lora_matches_the_scripts(models, family, scheme, precondition, prior):
    torch_pipe, _, pipe, params = models[family]
    adapter = _adapter(family, pipe)
    conditioning = pipe.generator.models.conditioning
    captions = ["sks red square", "a sks square on grass"]
    if prior is not None:
        captions += ["a red square", "a red square"]  # [instance; class]
    n = len(captions)
    inputs = flow_models.TextInputs(flow_models.TextStates(conditioning, params), adapter)(captions)
    t5_ids = conditioning.text_inputs(captions, [""] * n)["t5_ids"]
    rng = np.random.default_rng(5)
    draws = {
        "latents": rng.standard_normal((n, 16, SIZE // 2, SIZE // 2)).astype(np.float32),
        "noise": rng.standard_normal((n, 16, SIZE // 2, SIZE // 2)).astype(np.float32),
        "u": np.linspace(0.05, 0.9, n).astype(np.float32),
    }

    # the reference: peft on diffusers' transformer and transformers' CLIP encoders, the scripts' lines
    transformer = peft_transformer(torch_pipe.transformer, adapter.default_targets, RANK, ALPHA)
    encoders = {
        c: peft_text_encoder(getattr(torch_pipe, c), RANK, ALPHA, seed=7 + i)
        for i, c in enumerate(adapter.text_encoders)
    }
    ids = {k: inputs[k] for k in ("ids", "ids_2") if k in inputs}
    text, pooled = _torch_text(family, torch_pipe, encoders, ids, t5_ids)
    ref = script_loss(
        family, transformer, torch_pipe.scheduler.config, {**draws, "text": text, "pooled": pooled},
        weighting_scheme=scheme, precondition_outputs=precondition, prior_loss_weight=prior,
    )  # fmt: skip
    ref.backward()

    # sdjax: the same LoRA values, the step's text path (`batch_text`) and loss
    lora, torch_params = lora_from_peft(params["transformer"], transformer, adapter.default_targets, RANK)
    te_torch = {}
    for c in adapter.text_encoders:
        te_lora, te_torch[c] = text_lora_from_peft(params[c], encoders[c], RANK, c)
        lora |= te_lora
    models_ = flow.FlowModels(adapter, pipe.vae, scale=ALPHA / RANK, conditioning=conditioning)
    objective = _objective(pipe, scheme, precondition, prior)
    frozen = {c: params[c] for c in ("transformer", *adapter.text_encoders)}
    batch = {k: jnp.asarray(v) for k, v in {**draws, **inputs}.items()}

    def loss(lora):
        text, pooled = flow.batch_text(models_, lora, frozen, batch, None)
        step_inputs = {**{k: batch[k] for k in ("latents", "noise", "u")}, "text": text, "pooled": pooled}
        return flow.denoiser_loss(lora["transformer"], frozen["transformer"], models_, objective, step_inputs)

    value, grads = jax.jit(jax.value_and_grad(loss))(lora)
    ref = float(ref.detach())
    rel = abs(float(value) - ref) / abs(ref)
    worst = {"transformer": worst_grad_error(grads["transformer"], torch_params)}
    for c in adapter.text_encoders:
        worst[c] = worst_grad_error(grads[c], te_torch[c])
        assert len(grads[c]) == 4 * pipe_layers(params[c]) and any(
            np.abs(g["down"]).max() > 0 for g in grads[c].values()
        )
    print(f"{family}/{scheme}/prior {prior}: loss {float(value):.7f} vs {ref:.7f} ({rel:.1e}); worst gradients {worst}")
    assert rel <= 1e-5


def pipe_layers(te_params) -> int:
    return len(te_params["text_model"]["encoder"])


def test_prior_loss_is_instance_plus_weighted_class():
    """`flow_loss` with `prior_loss_weight`: the instance half's weighted MSE plus w times the class half's, each
    computed on its own (an independent split of the same arrays)."""
    rng = np.random.default_rng(0)
    pred, latents, noise = (jnp.asarray(rng.standard_normal((4, 3, 2, 2)), jnp.float32) for _ in range(3))
    sigmas = jnp.asarray([0.2, 0.5, 0.7, 0.9], jnp.float32)
    noisy = (1 - sigmas[:, None, None, None]) * latents + sigmas[:, None, None, None] * noise
    both = flow.FlowObjective(weighting_scheme="cosmap", prior_loss_weight=0.3)
    alone = flow.FlowObjective(weighting_scheme="cosmap")
    got = flow.flow_loss(pred, latents, noise, noisy, sigmas, both)
    halves = [
        flow.flow_loss(pred[s], latents[s], noise[s], noisy[s], sigmas[s], alone) for s in (slice(0, 2), slice(2, 4))
    ]
    np.testing.assert_allclose(float(got), float(halves[0] + 0.3 * halves[1]), rtol=1e-6)
