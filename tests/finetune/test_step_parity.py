"""One LoRA training step against PyTorch: diffusers' UNet2DConditionModel with a peft LoraConfig on the attention
projections (`train_text_to_image_lora.py`), the same latents, noise, timesteps and encoder hidden states, give
the same loss and the same LoRA gradients, for epsilon and v-prediction with Min-SNR-gamma weighting."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax.finetune import lora as lora_lib
from sdjax.finetune import step as step_lib
from sdjax.models.convert import path_to_torch_key
from sdjax.pipelines import load_pipeline

RANK, ALPHA, GAMMA = 4, 8.0, 5.0
TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    pipe, params = load_pipeline(str(sd1_dir))
    return pipe, params


def _torch_reference(torch_unet, scheduler_config, prediction_type, batch):
    import torch
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr
    from peft import LoraConfig

    unet = copy.deepcopy(torch_unet)
    unet.requires_grad_(False)
    torch.manual_seed(0)  # peft's gaussian init of the A factors
    unet.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights="gaussian", target_modules=TARGETS))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_B" in name:  # nonzero up weights: the gradients of both factors are then meaningful
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    sched = DDPMScheduler.from_config(scheduler_config, prediction_type=prediction_type)
    latents, noise = torch.from_numpy(batch["latents"]), torch.from_numpy(batch["noise"])
    t = torch.from_numpy(batch["timesteps"]).long()
    noisy = sched.add_noise(latents, noise, t)
    target = noise if prediction_type == "epsilon" else sched.get_velocity(latents, noise, t)
    pred = unet(noisy, t, torch.from_numpy(batch["context"])).sample
    snr = compute_snr(sched, t)
    weights = torch.stack([snr, GAMMA * torch.ones_like(t)], dim=1).min(dim=1)[0]
    weights = weights / snr if prediction_type == "epsilon" else weights / (snr + 1)
    mse = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=[1, 2, 3])
    loss = (mse * weights).mean()
    loss.backward()
    tensors = {n: p for n, p in unet.named_parameters() if "lora_" in n}
    return unet, float(loss.detach()), tensors


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_lora_step_matches_diffusers_peft(sd1, torch_sd1, prediction_type):
    pipe, params = sd1
    rng = np.random.default_rng(0)
    batch = {
        "latents": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
        "noise": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
        "timesteps": np.asarray([37, 811], np.int32),  # SNR above and below gamma
        "context": rng.standard_normal((2, 9, 32)).astype(np.float32),
    }
    _, ref_loss, tensors = _torch_reference(torch_sd1.unet, torch_sd1.scheduler.config, prediction_type, batch)

    lora = lora_lib.init_lora(jax.random.PRNGKey(0), params, {"unet": lora_lib.UNET_TARGETS}, RANK)
    for name in lora["unet"]:
        module = path_to_torch_key(tuple(name.split("/"))).removesuffix(".weight")
        lora["unet"][name] = {
            "down": tensors[f"{module}.lora_A.default.weight"].detach().numpy(),
            "up": tensors[f"{module}.lora_B.default.weight"].detach().numpy(),
        }
    assert len(lora["unet"]) * 2 == len(tensors)  # every peft layer has its sdjax twin
    models = step_lib.Models(None, pipe.unet, pipe.vae, unet_scale=ALPHA / RANK)
    objective = step_lib.Objective(prediction_type=prediction_type, min_snr_gamma=GAMMA)
    ac = jnp.asarray(pipe.scheduler.alphas_cumprod)
    inputs = {k: jnp.asarray(v) for k, v in batch.items()} | {"unet_kwargs": {}, "perturbation": None}

    def loss(lora_unet):
        return step_lib.unet_loss(lora_unet, params["unet"], models, objective, ac, inputs)

    value, grads = jax.jit(jax.value_and_grad(loss))(lora["unet"])
    loss_rel = abs(float(value) - ref_loss) / abs(ref_loss)
    print(f"{prediction_type}: loss {float(value):.8f} vs {ref_loss:.8f}, relative error {loss_rel:.2e}")
    assert loss_rel <= 1e-5

    worst = 0.0
    for name, g in grads.items():
        module = path_to_torch_key(tuple(name.split("/"))).removesuffix(".weight")
        for ours, theirs in (("down", "lora_A"), ("up", "lora_B")):
            ref = tensors[f"{module}.{theirs}.default.weight"].grad.numpy()
            err = np.linalg.norm(np.asarray(g[ours]) - ref) / np.linalg.norm(ref)
            worst = max(worst, err)
            assert err <= 1e-4, f"{module}.{theirs}: gradient relative error {err:.2e}"
    print(f"{prediction_type}: worst LoRA gradient relative error {worst:.2e} over {2 * len(grads)} tensors")


def test_branch_form_with_lora_dropout(sd1, torch_sd1):
    """LoRA dropout runs the UNet LoRA as PEFT's branch (`lora.branch`): at a rate that keeps every input (1e-9
    rounds the keep probability to 1 in float32) it gives peft's loss and gradients; at 0.5 another loss."""
    pipe, params = sd1
    rng = np.random.default_rng(2)
    batch = {
        "latents": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
        "noise": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
        "timesteps": np.asarray([120, 500], np.int32),
        "context": rng.standard_normal((2, 9, 32)).astype(np.float32),
    }
    _, ref_loss, tensors = _torch_reference(torch_sd1.unet, torch_sd1.scheduler.config, "epsilon", batch)
    lora = lora_lib.init_lora(jax.random.PRNGKey(0), params, {"unet": lora_lib.UNET_TARGETS}, RANK)
    for name in lora["unet"]:
        module = path_to_torch_key(tuple(name.split("/"))).removesuffix(".weight")
        lora["unet"][name] = {
            "down": tensors[f"{module}.lora_A.default.weight"].detach().numpy(),
            "up": tensors[f"{module}.lora_B.default.weight"].detach().numpy(),
        }
    objective = step_lib.Objective(min_snr_gamma=GAMMA)
    ac = jnp.asarray(pipe.scheduler.alphas_cumprod)
    inputs = {k: jnp.asarray(v) for k, v in batch.items()}
    inputs |= {"unet_kwargs": {}, "perturbation": None, "dropout_key": jax.random.PRNGKey(5)}

    def value_and_grad(rate):
        models = step_lib.Models(None, pipe.unet, pipe.vae, unet_scale=ALPHA / RANK, lora_dropout=rate)
        fn = lambda lora_unet: step_lib.unet_loss(lora_unet, params["unet"], models, objective, ac, inputs)
        return jax.jit(jax.value_and_grad(fn))(lora["unet"])

    value, grads = value_and_grad(1e-9)
    assert abs(float(value) - ref_loss) / ref_loss <= 1e-5
    worst = 0.0
    for name, g in grads.items():
        module = path_to_torch_key(tuple(name.split("/"))).removesuffix(".weight")
        for ours, theirs in (("down", "lora_A"), ("up", "lora_B")):
            ref = tensors[f"{module}.{theirs}.default.weight"].grad.numpy()
            worst = max(worst, np.linalg.norm(np.asarray(g[ours]) - ref) / np.linalg.norm(ref))
    print(f"branch form: loss relative error {abs(float(value) - ref_loss) / ref_loss:.2e}, gradients {worst:.2e}")
    assert worst <= 1e-4
    dropped, _ = value_and_grad(0.5)
    assert np.isfinite(float(dropped)) and abs(float(dropped) - float(value)) > 1e-4
