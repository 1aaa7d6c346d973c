"""DDPM ancestral sampling (Ho, Jain & Abbeel 2020, "Denoising Diffusion Probabilistic Models", eq. 6-7),
mirroring diffusers' `DDPMScheduler` with the spaced timesteps of `set_timesteps`.

x_prev = c0 x0 + c1 x_t + s z: the posterior mean of q(x_prev | x_t, x0) and its std; `fixed_small` is the
posterior variance (1 - a_prev) / (1 - a_t) (1 - a_t / a_prev), clamped at 1e-20, `fixed_large` the step's beta.
The previous timestep is the next one of the schedule (t = 0 after the last). Noise is added while t > 0.
The old Flax DDPM produced black images; this one follows the PyTorch scheduler step for step (tested).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import ANY, F32, Sampler, alpha_space_x0_eps, require_noise, spaced_timesteps, state_class
from sdjax.samplers.ddim import add_noise_vp


@state_class
class DDPMState:
    alphas_cumprod: jax.Array  # (T,)
    timesteps: jax.Array  # (N,)
    alpha_t: jax.Array | None = None  # (N,) alpha_bar at timesteps[i]
    alpha_prev: jax.Array | None = None  # (N,) alpha_bar at timesteps[i + 1] (1 after the last)
    add_noise_mask: jax.Array | None = None  # (N,) 1 where timesteps[i] > 0


@dataclasses.dataclass(frozen=True)
class DDPM(Sampler):
    """diffusers `DDPMScheduler` (variance types fixed_small, fixed_small_log, fixed_large)."""

    variance_type: str = "fixed_small"
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    rescale_betas_zero_snr: bool = False

    diffusers_class = "DDPMScheduler"
    unused_keys = {"thresholding": (False,), "dynamic_thresholding_ratio": ANY, "sample_max_value": ANY}
    choices = {"variance_type": ("fixed_small", "fixed_small_log", "fixed_large")}

    @property
    def stochastic(self) -> bool:
        return True

    _state_class = DDPMState
    _ready_field = "alpha_t"

    def create_state(self) -> DDPMState:
        T = self.num_train_timesteps
        return DDPMState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod), timesteps=jnp.arange(T - 1, -1, -1, dtype=jnp.float32)
        )

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps = spaced_timesteps(self.timestep_spacing, n, self.num_train_timesteps, self.steps_offset, kind="int")
        prev = np.concatenate([timesteps[1:], [-1]])
        ac = self.alphas_cumprod
        return {
            "timesteps": timesteps.astype(F32),
            "alpha_t": ac[timesteps],
            "alpha_prev": np.where(prev >= 0, ac[np.maximum(prev, 0)], F32(1.0)).astype(F32),
            "add_noise_mask": (timesteps > 0).astype(F32),
        }

    def set_timesteps(self, state: DDPMState, num_inference_steps: int, shape=None) -> DDPMState:
        self._checked(state, DDPMState, "set_timesteps")
        tables = {k: jnp.asarray(v) for k, v in self._tables(num_inference_steps).items()}
        return DDPMState(alphas_cumprod=jnp.asarray(self.alphas_cumprod), **tables)

    def init_noise_sigma(self, state: DDPMState) -> jax.Array:
        return jnp.float32(1.0)

    def scale_model_input(self, state: DDPMState, sample: jax.Array, step_index) -> jax.Array:
        return sample

    def step(self, state: DDPMState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        noise = require_noise("DDPM", noise, sample)
        state = self._checked(state, DDPMState, "step", ready="alpha_t")
        x = sample.astype(jnp.float32)
        a_t, a_prev = state.alpha_t[step_index], state.alpha_prev[step_index]
        beta_t, beta_prev = 1 - a_t, 1 - a_prev
        current_alpha = a_t / a_prev
        current_beta = 1 - current_alpha
        x0, _ = alpha_space_x0_eps(self.prediction_type, model_output.astype(jnp.float32), x, a_t)
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        mean = (a_prev**0.5 * current_beta / beta_t) * x0 + (current_alpha**0.5 * beta_prev / beta_t) * x
        variance = jnp.maximum((1 - a_prev) / (1 - a_t) * current_beta, 1e-20)
        if self.variance_type == "fixed_small":
            std = variance**0.5
        elif self.variance_type == "fixed_small_log":
            std = jnp.exp(0.5 * jnp.log(variance))
        else:  # fixed_large
            std = current_beta**0.5
        prev = jnp.where(state.add_noise_mask[step_index] > 0, mean + std * noise, mean)
        return prev.astype(sample.dtype), state

    def add_noise(self, state: DDPMState, original: jax.Array, noise: jax.Array, timesteps) -> jax.Array:
        state = self._checked(state, DDPMState, "add_noise")
        return add_noise_vp(state.alphas_cumprod, original, noise, timesteps)
