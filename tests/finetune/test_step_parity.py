"""One LoRA training step against PyTorch: diffusers' UNet2DConditionModel with a peft LoraConfig on the attention
projections (`train_text_to_image_lora.py`), the same latents, noise, timesteps and encoder hidden states, give
the same loss and the same LoRA gradients, for epsilon and v-prediction with Min-SNR-gamma weighting; LoCon (kohya's
conv_dim layers, their own rank and alpha) against peft's conv LoRA with `rank_pattern` / `alpha_pattern`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from finetune_helpers import (
    kohya_conv_config,
    lora_from_peft,
    min_snr_loss,
    parity_batch,
    peft_forward,
    worst_grad_error,
)

from sdjax.finetune import step as step_lib
from sdjax.pipelines import load_pipeline

RANK, ALPHA, GAMMA = 4, 8.0, 5.0
CONV_RANK, CONV_ALPHA = 3, 1.5  # LoCon: another rank and scale than the linear layers', so a mix-up fails


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    pipe, params = load_pipeline(str(sd1_dir))
    return pipe, params


def _torch_reference(torch_unet, scheduler_config, prediction_type, batch, **config):
    unet, pred, target, sched, t = peft_forward(
        torch_unet, scheduler_config, prediction_type, batch, RANK, ALPHA, **config
    )
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


def test_locon_step_matches_diffusers_peft(sd1, torch_sd1):
    """LoCon (`conv_rank`): the attention LoRA plus kohya's conv_dim layers (3x3 convs of the ResNet blocks and
    samplers at CONV_RANK / CONV_ALPHA, `time_emb_proj` and the 1x1 `conv_shortcut` at RANK / ALPHA), against peft's
    LoRA on the layers kohya's rule picks on the PyTorch UNet (`kohya_conv_config`): the same layers, loss and
    gradients. The branch form (LoRA dropout, here at a rate that keeps every input) runs each conv LoRA as a conv of
    the layer's strides and padding on the input PyTorch's conv sees (an upsampler's upsampled): it gives the merge's
    outputs on the UNet's downsampler, upsampler and a ResNet block with its 1x1 shortcut (module by module, without
    compiling a UNet: the merge is the form checked against peft)."""
    from sdjax.finetune import lora as lora_lib
    from sdjax.models import layers

    pipe, params = sd1
    batch = parity_batch(4, [37, 811])
    config = kohya_conv_config(torch_sd1.unet, CONV_RANK, CONV_ALPHA)
    _, ref_loss, tensors = _torch_reference(torch_sd1.unet, torch_sd1.scheduler.config, "epsilon", batch, **config)
    lora = lora_from_peft(params, tensors, RANK, conv_rank=CONV_RANK)
    assert len(lora["unet"]) * 2 == len(tensors)  # the same layers on both sides
    convs = [ab for ab in lora["unet"].values() if ab["down"].ndim == 4 and ab["down"].shape[2:] == (3, 3)]
    assert len(convs) == 18 and all(ab["down"].shape[0] == CONV_RANK for ab in convs)
    scale, conv_scale = ALPHA / RANK, CONV_ALPHA / CONV_RANK
    models = step_lib.Models(None, pipe.unet, pipe.vae, unet_scale=scale, unet_conv_scale=conv_scale)
    objective = step_lib.Objective(min_snr_gamma=GAMMA)
    ac = jnp.asarray(pipe.scheduler.alphas_cumprod)
    inputs = {k: jnp.asarray(v) for k, v in batch.items()} | {"unet_kwargs": {}, "perturbation": None}

    def loss(lora_unet):
        return step_lib.unet_loss(lora_unet, params["unet"], models, objective, ac, inputs)

    value, grads = jax.jit(jax.value_and_grad(loss))(lora["unet"])
    loss_rel = abs(float(value) - ref_loss) / abs(ref_loss)
    # the time_emb_proj LoRAs of the 32-channel blocks get no gradient: norm2 (32 groups of 32 channels) removes the
    # per-channel constant they add (peft's and sdjax's gradients there are rounding noise, about 1e-9)
    worst = worst_grad_error(grads, tensors, zero=1e-6)
    print(f"LoCon: loss relative error {loss_rel:.2e}, worst LoRA gradient {worst:.2e} over {2 * len(grads)} tensors")
    assert loss_rel <= 1e-5

    rng = np.random.default_rng(0)
    temb = rng.standard_normal((2, 128)).astype(np.float32)
    cases = [  # (module, its params' path in the UNet, input shape, more inputs)
        (layers.Downsample2D(32), "down_blocks_0/downsamplers_0", (2, 8, 8, 32), ()),
        (layers.Upsample2D(64), "up_blocks_0/upsamplers_0", (2, 4, 4, 64), ()),
        (layers.ResnetBlock2D(64), "up_blocks_0/resnets_0", (2, 4, 4, 128), (temb,)),
    ]
    branch_err = 0.0
    for module, where, shape, more in cases:
        p = params["unet"]
        for key in where.split("/"):
            p = p[key]
        own = {k.removeprefix(where + "/"): ab for k, ab in lora["unet"].items() if k.startswith(where + "/")}
        x = rng.standard_normal(shape).astype(np.float32)
        merged = module.apply({"params": lora_lib.merge(p, own, scale, conv_scale=conv_scale)}, x, *more)
        with lora_lib.branch(own, scale, 1e-9, jax.random.PRNGKey(3), conv_scale=conv_scale):
            branched = module.apply({"params": p}, x, *more)
        base = module.apply({"params": p}, x, *more)
        assert float(jnp.abs(merged - base).max()) > 1e-2, where  # the LoRA moves the output
        branch_err = max(branch_err, float(jnp.abs(branched - merged).max() / jnp.abs(merged).max()))
    print(f"LoCon branch form vs merge: {branch_err:.2e} relative to the largest output")
    assert branch_err <= 1e-5
