"""DDIM (Song, Meng & Ermon 2021, "Denoising Diffusion Implicit Models"), mirroring diffusers' `DDIMScheduler`.

x_{t-1} = sqrt(a_prev) x0 + sqrt(1 - a_prev - s^2) eps + s z, with s = eta sqrt((1 - a_prev) / (1 - a_t)
(1 - a_t / a_prev)); `eta = 0` (the default) is deterministic. The previous timestep is `t - T // n` as in
diffusers; below zero it uses `final_alpha_cumprod` (1 with `set_alpha_to_one`, else alpha_bar_0).
`thresholding` (dynamic thresholding, Imagen) is not implemented and refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import (
    ANY,
    F32,
    Sampler,
    alpha_space_x0_eps,
    per_sample,
    require_noise,
    spaced_timesteps,
    state_class,
    to_index,
)


@state_class
class DDIMState:
    alphas_cumprod: jax.Array  # (T,) alpha_bar of the training timesteps
    final_alpha_cumprod: jax.Array  # () alpha_bar used past t = 0
    timesteps: jax.Array  # (N,) the values fed to the UNet (integers, as float32)
    alpha_t: jax.Array | None = None  # (N,) alpha_bar at timesteps[i]
    alpha_prev: jax.Array | None = None  # (N,) alpha_bar at timesteps[i] - T // n (or final_alpha_cumprod)


@dataclasses.dataclass(frozen=True)
class DDIM(Sampler):
    """diffusers `DDIMScheduler`. `eta` is a runtime option (diffusers passes it to `step`)."""

    clip_sample: bool = True
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    rescale_betas_zero_snr: bool = False
    eta: float = 0.0

    diffusers_class = "DDIMScheduler"
    unused_keys = {"thresholding": (False,), "dynamic_thresholding_ratio": ANY, "sample_max_value": ANY}
    options = ("eta",)

    def __post_init__(self):
        super().__post_init__()
        if not self.eta >= 0:
            raise ValueError(f"DDIM: eta must be >= 0, got {self.eta!r}")

    @property
    def stochastic(self) -> bool:
        return self.eta > 0

    @property
    def _final_alpha_cumprod(self) -> np.float32:
        return F32(1.0) if self.set_alpha_to_one else self.alphas_cumprod[0]

    _state_class = DDIMState
    _ready_field = "alpha_t"

    def create_state(self) -> DDIMState:
        T = self.num_train_timesteps
        return DDIMState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod),
            final_alpha_cumprod=jnp.asarray(self._final_alpha_cumprod),
            timesteps=jnp.arange(T - 1, -1, -1, dtype=jnp.float32),
        )

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps = spaced_timesteps(self.timestep_spacing, n, self.num_train_timesteps, self.steps_offset, kind="int")
        prev = timesteps - self.num_train_timesteps // n
        ac = self.alphas_cumprod
        return {
            "timesteps": timesteps.astype(F32),
            "alpha_t": ac[timesteps],
            "alpha_prev": np.where(prev >= 0, ac[np.maximum(prev, 0)], self._final_alpha_cumprod).astype(F32),
        }

    def set_timesteps(self, state: DDIMState, num_inference_steps: int, shape=None) -> DDIMState:
        self._checked(state, DDIMState, "set_timesteps")
        tables = self._tables(num_inference_steps)
        base = self.create_state()
        return DDIMState(
            alphas_cumprod=base.alphas_cumprod,
            final_alpha_cumprod=base.final_alpha_cumprod,
            timesteps=jnp.asarray(tables["timesteps"]),
            alpha_t=jnp.asarray(tables["alpha_t"]),
            alpha_prev=jnp.asarray(tables["alpha_prev"]),
        )

    def init_noise_sigma(self, state: DDIMState) -> jax.Array:
        return jnp.float32(1.0)

    def scale_model_input(self, state: DDIMState, sample: jax.Array, step_index) -> jax.Array:
        return sample

    def step(self, state: DDIMState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, DDIMState, "step", ready="alpha_t")
        if self.stochastic:
            noise = require_noise("DDIM with eta > 0", noise, sample)
        x = sample.astype(jnp.float32)
        m = model_output.astype(jnp.float32)
        a_t, a_prev = state.alpha_t[step_index], state.alpha_prev[step_index]
        beta_t, beta_prev = 1 - a_t, 1 - a_prev
        x0, eps = alpha_space_x0_eps(self.prediction_type, m, x, a_t)
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        variance = beta_prev / beta_t * (1 - a_t / a_prev)
        std = self.eta * variance**0.5
        prev = a_prev**0.5 * x0 + (1 - a_prev - std**2) ** 0.5 * eps
        if self.stochastic:
            prev = prev + std * noise
        return prev.astype(sample.dtype), state

    def add_noise(self, state: DDIMState, original: jax.Array, noise: jax.Array, timesteps) -> jax.Array:
        state = self._checked(state, DDIMState, "add_noise")
        return add_noise_vp(state.alphas_cumprod, original, noise, timesteps)


def add_noise_vp(alphas_cumprod: jax.Array, original: jax.Array, noise: jax.Array, timesteps) -> jax.Array:
    """Forward process q(x_t | x_0) = sqrt(a_t) x0 + sqrt(1 - a_t) eps at integer timesteps (per sample)."""
    a = alphas_cumprod[to_index(timesteps)]
    x0 = original.astype(jnp.float32)
    out = per_sample(a**0.5, x0.ndim) * x0 + per_sample((1 - a) ** 0.5, x0.ndim) * noise.astype(jnp.float32)
    return out.astype(original.dtype)
