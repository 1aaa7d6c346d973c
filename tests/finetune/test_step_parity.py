"""One LoRA training step against PyTorch: diffusers' UNet2DConditionModel with a peft LoraConfig on the attention
projections (`train_text_to_image_lora.py`), the same latents, noise, timesteps and encoder hidden states, give
the same loss and the same LoRA gradients, for epsilon and v-prediction with Min-SNR-gamma weighting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from finetune_helpers import lora_from_peft, min_snr_loss, parity_batch, peft_forward, worst_grad_error

from sdjax.finetune import step as step_lib
from sdjax.pipelines import load_pipeline

RANK, ALPHA, GAMMA = 4, 8.0, 5.0


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    pipe, params = load_pipeline(str(sd1_dir))
    return pipe, params


def _torch_reference(torch_unet, scheduler_config, prediction_type, batch):
    unet, pred, target, sched, t = peft_forward(torch_unet, scheduler_config, prediction_type, batch, RANK, ALPHA)
    loss = min_snr_loss(pred, target, sched, t, prediction_type, GAMMA)
    loss.backward()
    tensors = {n: p for n, p in unet.named_parameters() if "lora_" in n}
    return unet, float(loss.detach()), tensors


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_lora_step_matches_diffusers_peft(sd1, torch_sd1, prediction_type):
    pipe, params = sd1
    batch = parity_batch(0, [37, 811])  # SNR above and below gamma
    _, ref_loss, tensors = _torch_reference(torch_sd1.unet, torch_sd1.scheduler.config, prediction_type, batch)

    lora = lora_from_peft(params, tensors, RANK)
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

    worst = worst_grad_error(grads, tensors)
    print(f"{prediction_type}: worst LoRA gradient relative error {worst:.2e} over {2 * len(grads)} tensors")


def test_branch_form_with_lora_dropout(sd1, torch_sd1):
    """LoRA dropout runs the UNet LoRA as PEFT's branch (`lora.branch`): at a rate that keeps every input (1e-9
    rounds the keep probability to 1 in float32) it gives peft's loss and gradients; at 0.5 another loss."""
    pipe, params = sd1
    batch = parity_batch(2, [120, 500])
    _, ref_loss, tensors = _torch_reference(torch_sd1.unet, torch_sd1.scheduler.config, "epsilon", batch)
    lora = lora_from_peft(params, tensors, RANK)
    objective = step_lib.Objective(min_snr_gamma=GAMMA)
    ac = jnp.asarray(pipe.scheduler.alphas_cumprod)
    inputs = {k: jnp.asarray(v) for k, v in batch.items()}
    inputs |= {"unet_kwargs": {}, "perturbation": None, "dropout_key": jax.random.PRNGKey(5)}

    def loss_at(rate):
        models = step_lib.Models(None, pipe.unet, pipe.vae, unet_scale=ALPHA / RANK, lora_dropout=rate)
        return lambda lora_unet: step_lib.unet_loss(lora_unet, params["unet"], models, objective, ac, inputs)

    value, grads = jax.jit(jax.value_and_grad(loss_at(1e-9)))(lora["unet"])
    assert abs(float(value) - ref_loss) / ref_loss <= 1e-5
    worst = worst_grad_error(grads, tensors, tol=None)
    print(f"branch form: loss relative error {abs(float(value) - ref_loss) / ref_loss:.2e}, gradients {worst:.2e}")
    assert worst <= 1e-4
    dropped = jax.jit(loss_at(0.5))(lora["unet"])  # only the loss is compared: no backward pass to compile
    assert np.isfinite(float(dropped)) and abs(float(dropped) - float(value)) > 1e-4
