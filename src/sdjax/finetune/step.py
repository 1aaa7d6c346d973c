"""One LoRA training step of a latent-diffusion model (SD 1.x / 2.x / XL): the logic of diffusers'
`train_text_to_image_lora.py` as one jitted function.

- Latents: the VAE posterior sample of the batch (`core.autoencoder.encode`, its scaling rules), frozen; or the
  batch's cached latents (`finetune.cache`), the VAE then not in the step.
- Text: the frozen (or LoRA-adapted) text encoders on the batch's token ids; or the batch's cached text states
  (`finetune.cache.TextEncoderCache`), the text encoders then not in the step.
- Noise: DDPM forward process `x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps` with the scheduler config's betas,
  timesteps uniform in `[0, num_train_timesteps)`; noise offset (`eps + offset * n`, n of shape `(B, C, 1, 1)`;
  Guttenberg 2023) and input perturbation (Ning et al. 2023: `x_t` from `eps + p * n'`, the target from `eps`).
- Target: `eps` (epsilon) or `v = sqrt(abar) eps - sqrt(1 - abar) x_0` (v-prediction; Salimans & Ho 2022).
- Loss: the mean squared error per example, weighted by Min-SNR-gamma (Hang et al. 2023) as diffusers:
  `min(snr, gamma) / snr` (epsilon) or `/ (snr + 1)` (v-prediction), then the mean over the batch.
- The LoRA (`finetune.lora`) is merged into the frozen kernels inside the loss (with LoRA dropout, the UNet's runs
  as PEFT's branch `W x + s * up(down(dropout(x)))` instead); only it is differentiated and
  updated (optax AdamW, or Adafactor / Prodigy / Lion: `update_rule`, with warm-up and a constant or cosine
  schedule, gradient clipping, accumulation through `optax.MultiSteps`). Frozen params may be bfloat16 (the
  compute dtype); the LoRA and optimiser stay float32.
- Randomness: every draw of micro-step `s` comes from `fold_in(key, s)`, so a resumed run repeats an unbroken one.
- Data parallel: the step runs under `jit` on a `Mesh`; the batch is split over `data`, params replicated, and
  the LoRA gradients are summed across devices by the compiler.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdjax.core import autoencoder
from sdjax.finetune import lora as lora_lib

PREDICTION_TYPES = ("epsilon", "v_prediction")
SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("adamw", "adafactor", "prodigy", "lion")


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the UNet learns to predict and how the loss is weighted (static under `jit`)."""

    prediction_type: str = "epsilon"
    num_train_timesteps: int = 1000
    min_snr_gamma: float | None = None
    noise_offset: float = 0.0
    input_perturbation: float = 0.0
    # DreamBooth prior preservation (`finetune.dreambooth`): the batch is [instance; class] halves and the loss
    # is `MSE(instance) + prior_loss_weight * MSE(class)` (diffusers' `train_dreambooth_lora.py`); None: off.
    prior_loss_weight: float | None = None

    def __post_init__(self):
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"prediction_type={self.prediction_type!r}: LoRA training supports {PREDICTION_TYPES} (the "
                "scheduler config's prediction_type)"
            )
        if self.min_snr_gamma is not None and self.min_snr_gamma <= 0:
            raise ValueError(f"min_snr_gamma={self.min_snr_gamma} must be positive (or None: off)")
        if self.prior_loss_weight is not None and self.min_snr_gamma is not None:
            raise ValueError(
                "min_snr_gamma with prior preservation: diffusers' train_dreambooth_lora.py has no Min-SNR "
                "weighting, and its SDXL script weights the instance half's losses with the SNRs of the whole "
                "[instance; class] batch (shapes that do not match); sdjax refuses the combination"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class Models:
    """The frozen modules a step runs: the family's conditioning (`encode(params, inputs, cfg=False)`), the UNet,
    the VAE, and the scales `alpha / r` of the UNet and text-encoder LoRAs (`unet_conv_scale`: conv_alpha /
    conv_rank of the UNet LoRA's convolutions wider than 1x1, LoCon; None: `unet_scale`)."""

    conditioning: Any
    unet: Any
    vae: Any
    dtype: Any = jnp.float32
    unet_scale: float = 1.0
    text_scale: float = 1.0
    remat: bool = False
    lora_dropout: float = 0.0  # > 0: PEFT's branch form with dropout (`lora.branch`) instead of the merge
    unet_conv_scale: float | None = None


def add_noise(latents, noise, timesteps, alphas_cumprod):
    """DDPM `q(x_t | x_0)` as diffusers' `DDPMScheduler.add_noise`."""
    abar = alphas_cumprod[timesteps].reshape(-1, 1, 1, 1)
    return jnp.sqrt(abar) * latents + jnp.sqrt(1.0 - abar) * noise


def diffusion_loss(pred, latents, noise, timesteps, alphas_cumprod, objective: Objective):
    """The weighted MSE of the prediction against the objective's target (float32 scalar)."""
    abar = alphas_cumprod[timesteps]
    if objective.prediction_type == "epsilon":
        target = noise
    else:
        a = abar.reshape(-1, 1, 1, 1)
        target = jnp.sqrt(a) * noise - jnp.sqrt(1.0 - a) * latents
    per_example = jnp.mean((pred.astype(jnp.float32) - target.astype(jnp.float32)) ** 2, axis=(1, 2, 3))
    if objective.prior_loss_weight is not None:  # torch.chunk(2): instance half, then class half
        instance, prior = jnp.split(per_example, 2)
        return jnp.mean(instance) + objective.prior_loss_weight * jnp.mean(prior)
    if objective.min_snr_gamma is None:
        return jnp.mean(per_example)
    snr = (jnp.sqrt(abar) / jnp.sqrt(1.0 - abar)) ** 2  # diffusers.training_utils.compute_snr
    weight = jnp.minimum(snr, objective.min_snr_gamma)
    weight = weight / snr if objective.prediction_type == "epsilon" else weight / (snr + 1.0)
    return jnp.mean(per_example * weight)


def unet_loss(lora_unet, unet_params, models: Models, objective: Objective, alphas_cumprod, batch: dict):
    """The loss of the UNet with `lora_unet` merged, on given `latents`, `noise`, `timesteps`, `context`,
    `unet_kwargs` (and `perturbation`, the input perturbation's extra noise, or None; `dropout_key` with LoRA
    dropout)."""
    as_branch = bool(lora_unet) and models.lora_dropout > 0
    merged = bool(lora_unet) and not as_branch
    conv_scale = models.unet_conv_scale
    params = lora_lib.merge(unet_params, lora_unet, models.unet_scale, conv_scale=conv_scale) if merged else unet_params
    noisy_from = batch["noise"] if batch.get("perturbation") is None else batch["noise"] + batch["perturbation"]
    noisy = add_noise(batch["latents"], noisy_from, batch["timesteps"], alphas_cumprod)

    def run(p, x, t, ctx, kw):
        return models.unet.apply({"params": p}, x.astype(models.dtype), t, ctx, **kw)

    if models.remat:  # recompute the UNet's activations in the backward pass, keeping the matmul outputs
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    with _lora_branch(lora_unet if as_branch else None, models.unet_scale, models, batch.get("dropout_key")):
        pred = run(params, noisy, batch["timesteps"], batch["context"], batch["unet_kwargs"])
    return diffusion_loss(pred, batch["latents"], batch["noise"], batch["timesteps"], alphas_cumprod, objective)


def _lora_branch(lora_c, scale: float, models: Models, key):
    if not lora_c:
        return contextlib.nullcontext()
    return lora_lib.branch(lora_c, scale, models.lora_dropout, key, conv_scale=models.unet_conv_scale)


def encode_text(lora, frozen, models: Models, inputs: dict):
    """`conditioning.encode` with the text-encoder LoRAs merged -> (context, UNet keyword arguments). (LoRA
    dropout is the UNet's only: SDXL's two encoders share module paths, which `lora.branch` matches by.)"""
    params = {}
    for component in models.conditioning.components:
        p = frozen[component]
        if component in lora:
            p = lora_lib.merge(p, lora[component], models.text_scale)
        params[component] = p
    return models.conditioning.encode(params, inputs, cfg=False)


def batch_text(lora, frozen, models: Models, batch: dict):
    """The batch's (context, UNet keyword arguments): its cached text states when it carries them (`context`, and
    SDXL's pooled `text_embeds` beside its `time_ids`; `finetune.cache.TextEncoderCache`, no text encoder in the
    step), else `encode_text` of its `ids` at its `clip_skip`."""
    if "context" not in batch:
        return encode_text(lora, frozen, models, {k: batch[k] for k in ("ids", "clip_skip", "time_ids")})
    if "text_embeds" not in batch:  # SD 1.x / 2.x: the context alone
        return batch["context"], {}
    return batch["context"], {"text_embeds": batch["text_embeds"], "time_ids": batch["time_ids"].astype(jnp.float32)}


def draw(key, latents_shape, objective: Objective) -> dict:
    """The step's noise, timesteps, offset and perturbation noise from one key."""
    k_noise, k_t, k_off, k_pert = jax.random.split(key, 4)
    batch, channels = latents_shape[:2]
    noise = jax.random.normal(k_noise, latents_shape, jnp.float32)
    if objective.noise_offset:
        noise = noise + objective.noise_offset * jax.random.normal(k_off, (batch, channels, 1, 1), jnp.float32)
    timesteps = jax.random.randint(k_t, (batch,), 0, objective.num_train_timesteps)
    perturbation = None
    if objective.input_perturbation:
        perturbation = objective.input_perturbation * jax.random.normal(k_pert, latents_shape, jnp.float32)
    return {"noise": noise, "timesteps": timesteps, "perturbation": perturbation}


def encode_latents(models: Models, vae_params, pixels, key):
    """The frozen VAE's latents of `pixels` (sampled with noise from `key`), without gradient."""
    factor = 2 ** (len(models.vae.config.block_out_channels) - 1)
    b, _, h, w = pixels.shape
    eps = jax.random.normal(key, (b, models.vae.config.latent_channels, h // factor, w // factor))
    return jax.lax.stop_gradient(autoencoder.encode(models.vae, vae_params, pixels, eps, models.dtype))


def batch_latents(models: Models, frozen: dict, batch: dict, key):
    """The batch's latents: `batch["latents"]` when a latent cache gave them (`finetune.cache`; no VAE in the
    step), else the VAE posterior sample of `batch["pixels"]` with noise from `key`."""
    if "latents" in batch:
        latents = jnp.asarray(batch["latents"], jnp.float32)
    else:
        latents = encode_latents(models, frozen["vae"], batch["pixels"], key)
    # The rest of the step compiles the same with and without the VAE in front (no fusion across the latents).
    return jax.lax.optimization_barrier(latents)


def make_loss(models: Models, objective: Objective, alphas_cumprod: np.ndarray) -> Callable:
    """`loss(lora, frozen, batch, key)`: pixels -> latents (frozen VAE; or cached latents), text -> context (or
    cached text states), the diffusion loss."""
    ac = jnp.asarray(alphas_cumprod, jnp.float32)

    def loss(lora, frozen, batch, key):
        k_vae, k_draw, k_unet = jax.random.split(key, 3)
        latents = batch_latents(models, frozen, batch, k_vae)
        context, kwargs = batch_text(lora, frozen, models, batch)
        draws = draw(k_draw, latents.shape, objective)
        inputs = {"latents": latents, "context": context, "unet_kwargs": kwargs, "dropout_key": k_unet, **draws}
        return unet_loss(lora.get("unet"), frozen["unet"], models, objective, ac, inputs)

    return loss


# ------------------------------------------------------------------------------------------------ optimiser
def lr_schedule(lr: float, steps: int, warmup: int, schedule: str) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup` updates, then constant or cosine decay to 0 at `steps`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r} is not one of {SCHEDULES}")
    after = (
        optax.constant_schedule(lr)
        if schedule == "constant"
        else optax.cosine_decay_schedule(lr, max(1, steps - warmup))
    )
    if warmup <= 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def update_rule(
    optimizer: str,
    schedule: optax.Schedule,
    *,
    weight_decay: float = 1e-2,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """The optimiser `optimizer` (one of `OPTIMIZERS`) at the learning rates of `schedule`, each with decoupled
    weight decay `p -= lr_t * weight_decay * p` (AdamW's rule; Prodigy's lr_t includes its step-size estimate):

    - "adamw": `optax.adamw(b1, b2, eps)` (diffusers' defaults).
    - "adafactor": Adafactor (Shazeer & Stern 2018; `optax.adafactor`'s pieces): factored second moments of
      decay `1 - t^-0.8`, updates clipped to block RMS 1, no momentum, with `schedule` as the absolute step size
      (no parameter-scale multiplication, as transformers' `Adafactor(scale_parameter=False, relative_step=False)`).
      optax's own `adafactor` adds its weight decay after the learning rate (the weights shrink by the rate itself
      each update); here the decay is scaled by the learning rate as AdamW's.
    - "prodigy": `optax.contrib.prodigy` (Mishchenko & Defazio 2023) with betas `(b1, b2)`: it estimates the step
      size itself, and `schedule` multiplies that estimate (1.0 is the method's intended value).
    - "lion": `optax.lion` (Chen et al. 2023) at its defaults b1 0.9, b2 0.99: `sign` updates, so the learning
      rate is usually 3-10x below AdamW's.
    """
    if optimizer == "adamw":
        return optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if optimizer == "adafactor":
        return optax.chain(
            optax.scale_by_factored_rms(),
            optax.clip_by_block_rms(1.0),
            optax.add_decayed_weights(weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
    if optimizer == "prodigy":
        return optax.contrib.prodigy(schedule, betas=(b1, b2), eps=eps, weight_decay=weight_decay)
    if optimizer == "lion":
        return optax.lion(schedule, weight_decay=weight_decay)
    raise ValueError(f"optimizer={optimizer!r} (--optimizer) is not one of {OPTIMIZERS}")


def make_optimizer(
    schedule: optax.Schedule,
    *,
    optimizer: str = "adamw",
    weight_decay: float = 1e-2,
    max_grad_norm: float | None = 1.0,
    accumulation: int = 1,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    text_schedule: optax.Schedule | None = None,
):
    """`update_rule(optimizer)` (default AdamW, diffusers' defaults) after global-norm clipping at `max_grad_norm`
    (over every trained value together); `accumulation` micro-batches per update (`optax.MultiSteps`). With
    `text_schedule`, the values of a LoRA's text-encoder components (`text_encoder*` at the top of the trained
    tree) get their own copy of the rule at those learning rates (`optax.multi_transform`)."""
    rule = update_rule(optimizer, schedule, weight_decay=weight_decay, b1=b1, b2=b2, eps=eps)
    if text_schedule is not None:
        text_rule = update_rule(optimizer, text_schedule, weight_decay=weight_decay, b1=b1, b2=b2, eps=eps)
        rule = optax.multi_transform({"denoiser": rule, "text": text_rule}, param_labels=_text_labels)
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    tx = optax.chain(*parts, rule)
    if accumulation > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=accumulation)
    return tx


def _text_labels(trained: dict) -> dict:
    """`multi_transform`'s labels of a LoRA tree `{component: ...}`: "text" under the text encoders."""
    return {
        c: jax.tree_util.tree_map(lambda _, c=c: "text" if c.startswith("text_encoder") else "denoiser", tree)
        for c, tree in trained.items()
    }


def make_train_step(models: Models, objective: Objective, alphas_cumprod: np.ndarray, optimizer) -> Callable:
    """`step(state, frozen, batch, key) -> (state, loss)` (jitted; `state = {"lora", "opt_state", "step"}`, the
    batch's draws from `fold_in(key, state["step"])`)."""
    return jit_step(make_loss(models, objective, alphas_cumprod), optimizer)


def jit_step(loss_fn: Callable, optimizer, trained: str = "lora") -> Callable:
    """`step(state, frozen, batch, key) -> (state, loss)` (jitted) of `loss_fn(state[trained], frozen, batch, k)`
    with `k = fold_in(key, state["step"])`; `state = {trained, "opt_state", "step"}`."""

    def step(state, frozen, batch, key):
        k = jax.random.fold_in(key, state["step"])
        loss, grads = jax.value_and_grad(loss_fn)(state[trained], frozen, batch, k)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state[trained])
        values = optax.apply_updates(state[trained], updates)
        return {trained: values, "opt_state": opt_state, "step": state["step"] + 1}, loss

    return jax.jit(step, donate_argnums=(0,))


def init_state(values, optimizer, trained: str = "lora") -> dict:
    """`{trained: values, "opt_state": optimizer.init(values), "step": 0}`. An optimiser state leaf that is one of
    the values' arrays (Prodigy keeps the initial values, `params0`) is copied: the step donates its state, and
    one buffer cannot be donated twice."""
    values = jax.tree_util.tree_map(jnp.asarray, values)
    shared = {id(x) for x in jax.tree_util.tree_leaves(values)}
    opt_state = jax.tree_util.tree_map(
        lambda x: jnp.array(x, copy=True) if id(x) in shared else x, optimizer.init(values)
    )
    return {trained: values, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}
