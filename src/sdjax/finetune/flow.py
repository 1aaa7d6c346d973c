"""One LoRA training step of a flow-matching model (Flux.1, SD 3 / 3.5): the logic of diffusers'
`examples/dreambooth/train_dreambooth_lora_flux.py` and `train_dreambooth_lora_sd3.py` as one jitted function.

- Latents: the frozen VAE's posterior sample of the batch, shifted and scaled by the VAE config
  (`(z - shift_factor) * scaling_factor`, `core.autoencoder.to_model_latents`), or a latent cache's
  (`finetune.cache`, the scripts' `--cache_latents`).
- Timesteps: `u` in [0, 1) from the weighting scheme (diffusers' `compute_density_for_timestep_sampling`: uniform
  for "none", "sigma_sqrt", "cosmap"; `sigmoid(N(logit_mean, logit_std))` for "logit_normal"; the "mode" density
  `1 - u - mode_scale (cos^2(pi u / 2) - 1 + u)` of uniform u), then the index `floor(u * T)` into the training
  grid of the scheduler config (`FlowMatchEulerDiscreteScheduler.__init__`: timesteps `T, T-1, ..., 1`, sigmas
  `t / T`, statically shifted `s sigma / (1 + (s - 1) sigma)` unless `use_dynamic_shifting`), which gives each
  example's timestep and sigma. Indices are clipped to the grid (the "mode" density can reach 1.0).
- Noising (rectified flow, Esser et al. 2024): `x_t = (1 - sigma) x_0 + sigma * noise`; target `noise - x_0`
  (the velocity the model predicts). With `precondition_outputs` (the SD 3 script's default) the prediction is
  turned into `x_0`'s estimate `x_t - sigma * v` and compared with `x_0`.
- Loss: `mean_b mean_chw(w(sigma) * (pred - target)^2)` with diffusers' `compute_loss_weighting_for_sd3`:
  `sigma^-2` ("sigma_sqrt"), `2 / (pi (1 - 2 sigma + 2 sigma^2))` ("cosmap"), else 1.
- The LoRA is PEFT's branch `W x + alpha/r * up(down(dropout(x)))` on the targeted Dense layers
  (`finetune.lora.branch`): in bfloat16 compute the frozen kernels stay bfloat16 while the LoRA's matmuls run in
  float32, as peft runs a float32 LoRA beside a bfloat16 base layer (the merged form would round small updates away).
- Prior preservation (DreamBooth, the scripts' `--with_prior_preservation`): the batch is [instance; class] halves
  and the loss is `loss(instance half) + prior_loss_weight * loss(class half)`, each the weighted MSE above
  (the scripts' `torch.chunk(2)` of prediction, target and weighting).
- The model call is the family adapter's (`finetune.flow_models`: Flux packs 2x2 patches and adds ids and
  guidance; SD 3 takes the latents as they are). Without text-encoder LoRA the text states are inputs of the step
  (computed once per caption outside it), so no text encoder is traced. With it (the scripts'
  `--train_text_encoder`) the step runs the CLIP encoders on the batch's ids with their LoRA (the adapter's
  `encode_text`; T5's states stay inputs: T5 is frozen), and their LoRA is differentiated with the transformer's.

Randomness: the VAE sample, noise, u and LoRA dropout of micro-step `s` come from `fold_in(key, s)` (the shared
`step.jit_step`), so a resumed run repeats an unbroken one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.core import autoencoder
from sdjax.finetune import lora as lora_lib

WEIGHTING_SCHEMES = ("none", "logit_normal", "mode", "sigma_sqrt", "cosmap")


@dataclasses.dataclass(frozen=True)
class FlowObjective:
    """How timesteps are drawn and the loss weighted (static under `jit`), with the scheduler config's grid."""

    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    precondition_outputs: bool = False
    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    prior_loss_weight: float | None = None  # DreamBooth prior preservation: [instance; class] batches; None: off

    def __post_init__(self):
        if self.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(
                f"weighting_scheme={self.weighting_scheme!r} (--weighting-scheme) must be one of {WEIGHTING_SCHEMES}"
            )
        if not (math.isfinite(self.logit_std) and self.logit_std > 0):
            raise ValueError(f"logit_std={self.logit_std} (--logit-std) must be a positive number")
        if not math.isfinite(self.logit_mean) or not math.isfinite(self.mode_scale):
            raise ValueError(f"logit_mean={self.logit_mean} and mode_scale={self.mode_scale} must be finite")
        if int(self.num_train_timesteps) != self.num_train_timesteps or self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps={self.num_train_timesteps} must be a positive integer")
        if not self.shift > 0:
            raise ValueError(f"scheduler shift={self.shift} must be positive")
        w = self.prior_loss_weight
        if w is not None and not (math.isfinite(w) and w >= 0):
            raise ValueError(f"prior_loss_weight={w} (--prior-loss-weight) must be a finite number >= 0")


def training_grid(objective: FlowObjective) -> tuple[np.ndarray, np.ndarray]:
    """`(timesteps, sigmas)` float32 `(T,)`, descending: `FlowMatchEulerDiscreteScheduler`'s tables as built from
    its config (what the training scripts' `noise_scheduler_copy.timesteps` / `.sigmas` hold)."""
    n = int(objective.num_train_timesteps)
    timesteps = np.linspace(1, n, n, dtype=np.float32)[::-1].copy()
    sigmas = timesteps / np.float32(n)
    if not objective.use_dynamic_shifting:
        s = np.float32(objective.shift)
        sigmas = s * sigmas / (np.float32(1) + (s - np.float32(1)) * sigmas)
    return (sigmas * np.float32(n)).astype(np.float32), sigmas.astype(np.float32)


def density(objective: FlowObjective, uniform: jax.Array, normal: jax.Array) -> jax.Array:
    """`u` of `compute_density_for_timestep_sampling` from base draws (`uniform` in [0, 1), standard `normal`)."""
    if objective.weighting_scheme == "logit_normal":
        return jax.nn.sigmoid(objective.logit_mean + objective.logit_std * normal)
    if objective.weighting_scheme == "mode":
        u = uniform
        return 1.0 - u - objective.mode_scale * (jnp.cos(jnp.pi * u / 2.0) ** 2 - 1.0 + u)
    return uniform


def draw_u(key: jax.Array, n: int, objective: FlowObjective) -> jax.Array:
    """`(n,)` float32 draws of the weighting scheme's timestep density."""
    k_uniform, k_normal = jax.random.split(key)
    uniform = jax.random.uniform(k_uniform, (n,), jnp.float32)
    normal = jax.random.normal(k_normal, (n,), jnp.float32)
    return density(objective, uniform, normal)


def timesteps_and_sigmas(u: jax.Array, objective: FlowObjective) -> tuple[jax.Array, jax.Array]:
    """The training grid's `(timesteps (B,), sigmas (B,))` at `floor(u * T)` (the scripts' `(u * T).long()`)."""
    timesteps, sigmas = (jnp.asarray(a) for a in training_grid(objective))
    n = objective.num_train_timesteps
    index = jnp.clip(jnp.floor(u.astype(jnp.float32) * n).astype(jnp.int32), 0, n - 1)
    return timesteps[index], sigmas[index]


def loss_weighting(scheme: str, sigmas: jax.Array) -> jax.Array:
    """diffusers' `compute_loss_weighting_for_sd3`."""
    if scheme == "sigma_sqrt":
        return sigmas**-2.0
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * sigmas + 2.0 * sigmas**2))
    return jnp.ones_like(sigmas)


def flow_loss(pred, latents, noise, noisy, sigmas, objective: FlowObjective) -> jax.Array:
    """The weighted flow-matching MSE (float32 scalar); `sigmas` `(B,)`."""
    s = sigmas.astype(jnp.float32).reshape(-1, *([1] * (latents.ndim - 1)))
    pred = pred.astype(jnp.float32)
    if objective.precondition_outputs:  # x_0 = x_t - sigma v (EDM's preconditioning, the SD 3 script's default)
        pred = pred * (-s) + noisy.astype(jnp.float32)
        target = latents.astype(jnp.float32)
    else:
        target = noise.astype(jnp.float32) - latents.astype(jnp.float32)
    weighting = loss_weighting(objective.weighting_scheme, s)
    per_example = jnp.mean((weighting * (pred - target) ** 2).reshape(pred.shape[0], -1), axis=1)
    if objective.prior_loss_weight is not None:  # torch.chunk(2): the instance half, then the class half
        instance, prior = jnp.split(per_example, 2)
        return jnp.mean(instance) + objective.prior_loss_weight * jnp.mean(prior)
    return jnp.mean(per_example)


@dataclasses.dataclass(frozen=True, eq=False)
class FlowModels:
    """The frozen pieces a flow step runs: the family adapter (`predict(params, x, timesteps, cond)`), the VAE,
    the compute dtype, the LoRA scale `alpha / r`, PEFT's LoRA dropout, and with text-encoder LoRA the family's
    conditioning (whose CLIP modules the adapter's `encode_text` runs)."""

    adapter: Any
    vae: Any
    dtype: Any = jnp.float32
    scale: float = 1.0
    lora_dropout: float = 0.0
    conditioning: Any = None


def denoiser_loss(lora_t, params_t, models: FlowModels, objective: FlowObjective, inputs: dict) -> jax.Array:
    """The loss of the denoiser with the LoRA `lora_t` (`{kernel path: {"down", "up"}}`) beside its frozen
    `params_t`, on given `latents`, `noise`, `u` `(B,)`, text states `text`, `pooled` (and `dropout_key` with LoRA
    dropout)."""
    latents = inputs["latents"].astype(jnp.float32)
    timesteps, sigmas = timesteps_and_sigmas(inputs["u"], objective)
    s = sigmas.reshape(-1, *([1] * (latents.ndim - 1)))
    noisy = (1.0 - s) * latents + s * inputs["noise"].astype(jnp.float32)
    cond = {"text": inputs["text"], "pooled": inputs["pooled"]}
    with lora_lib.branch(lora_t, models.scale, models.lora_dropout, inputs.get("dropout_key")):
        pred = models.adapter.predict(params_t, noisy, timesteps, cond)
    return flow_loss(pred, latents, inputs["noise"], noisy, sigmas, objective)


def encode_latents(models: FlowModels, vae_params, pixels, key) -> jax.Array:
    """The frozen VAE's latents of `pixels` (the posterior sampled with noise from `key`), without gradient."""
    factor = 2 ** (len(models.vae.config.block_out_channels) - 1)
    b, _, h, w = pixels.shape
    eps = jax.random.normal(key, (b, models.vae.config.latent_channels, h // factor, w // factor))
    return jax.lax.stop_gradient(autoencoder.encode(models.vae, vae_params, pixels, eps, models.dtype))


def batch_text(models: FlowModels, lora: dict, frozen: dict, batch: dict, key) -> tuple[jax.Array, jax.Array]:
    """The batch's `(text, pooled)`: given (`batch["text"]`, `batch["pooled"]`), or with a text-encoder LoRA in
    `lora` the adapter's `encode_text` of the batch's ids with it (LoRA dropout from `key`)."""
    adapter = models.adapter
    if not any(c in lora for c in adapter.text_encoders):
        return batch["text"], batch["pooled"]
    rate = models.lora_dropout
    return adapter.encode_text(models.conditioning, frozen, lora, models.scale, batch, rate, key)


def make_flow_loss(models: FlowModels, objective: FlowObjective) -> Callable:
    """`loss(lora, frozen, batch, key)`: `batch` holds `pixels` `(B, 3, H, W)` in [-1, 1] (or cached `latents`)
    and the captions' text states `text`, `pooled` (with a text-encoder LoRA, a `lora` component besides the
    transformer's: their CLIP `ids` (`ids_2`) and T5 states `t5`, `flow_models.TextInputs`); `frozen` the
    denoiser's params under the adapter's component, the VAE's (not needed with cached latents) and the CLIP
    encoders' with a text-encoder LoRA."""
    component = models.adapter.component

    def loss(lora, frozen, batch, key):
        k_vae, k_noise, k_u, k_drop = jax.random.split(key, 4)
        text, pooled = batch_text(models, lora, frozen, batch, jax.random.fold_in(k_drop, 1 << 20))
        if "latents" in batch:  # from a latent cache (`finetune.cache`): no VAE in the step
            latents = jnp.asarray(batch["latents"], jnp.float32)
        else:
            latents = encode_latents(models, frozen["vae"], batch["pixels"], k_vae)
        inputs = {
            "latents": latents,
            "noise": jax.random.normal(k_noise, latents.shape, jnp.float32),
            "u": draw_u(k_u, latents.shape[0], objective),
            "text": text,
            "pooled": pooled,
            "dropout_key": k_drop,
        }
        return denoiser_loss(lora[component], frozen[component], models, objective, inputs)

    return loss


def make_flow_train_step(models: FlowModels, objective: FlowObjective, optimizer) -> Callable:
    """`step(state, frozen, batch, key) -> (state, loss)` (jitted; `state = {"lora", "opt_state", "step"}`)."""
    from sdjax.finetune import step as step_lib

    return step_lib.jit_step(make_flow_loss(models, objective), optimizer)
