"""Heun's second-order sampler (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative
Models", Algorithm 1 without churn; k-diffusion's `sample_heun`), mirroring diffusers' `HeunDiscreteScheduler`
(A1111 "Heun").

Each step from sigma_i to sigma_{i+1} calls the model twice: an Euler step to sigma_{i+1}, then the model at the
Euler estimate, and the average of the two slopes replaces the first. As in diffusers, the schedule interleaves
the two stages -- timesteps [t_0, t_1, t_1, t_2, t_2, ...] and sigmas [s_0, s_1, s_1, ..., s_{n-1}, s_{n-1}, 0] --
so the loop calls the model once per iteration (`num_model_calls(n) = 2n - 1`) and the state remembers which
stage comes next (with the first slope, the step size and the sample the step started from). The last step, to
sigma = 0, is a plain Euler step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import (
    F32,
    convert_sigmas,
    shape_tuple,
    sigma_space_x0,
    sigma_to_t,
    state_class,
)
from sdjax.samplers.euler import _SigmaSampler


@state_class
class HeunState:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (2n,) interleaved: s_0, s_1, s_1, ..., s_{n-1}, s_{n-1}, 0
    timesteps: jax.Array  # (2n - 1,) t_0, t_1, t_1, ..., t_{n-1}, t_{n-1}
    second: jax.Array | None = None  # () 1 when the next call is the correction stage of a step
    prev_derivative: jax.Array | None = None  # (*shape) the first stage's slope
    dt: jax.Array | None = None  # () the step size sigma_next - sigma
    sample: jax.Array | None = None  # (*shape) the sample the step started from


def interleave(values: np.ndarray, *, keep_last: bool) -> np.ndarray:
    """diffusers' two-stage layout: the first value once, then every other value twice (the last one once more
    with `keep_last`, so that index `i + 1` exists for the last call)."""
    middle = values[1:] if keep_last else values[1:-1]
    return np.concatenate([values[:1], np.repeat(middle, 2), values[-1:]])


def sigma_space_schedule(
    sampler, n: int, *, round_karras: bool, float64: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(timesteps, sigmas, log training sigmas) of a k-diffusion-style sampler before interleaving: the spaced
    timesteps with their interpolated sigmas, or a Karras/exponential/beta sigma schedule with its fractional
    timesteps (rounded for Karras where diffusers rounds: KDPM2)."""
    timesteps, sigmas, log_sigmas = sampler._spaced(n, float64=float64)
    converted = convert_sigmas(sampler, sigmas, n)
    if converted is not None:
        sigmas = converted
        timesteps = sigma_to_t(sigmas, log_sigmas)
        if round_karras and getattr(sampler, "use_karras_sigmas", False):
            timesteps = timesteps.round()
    return np.asarray(timesteps), np.asarray(sigmas, dtype=np.float64), log_sigmas


@dataclasses.dataclass(frozen=True)
class Heun(_SigmaSampler):
    """diffusers `HeunDiscreteScheduler` (no churn, gamma = 0)."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    timestep_spacing: str = "linspace"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    clip_sample: bool = False
    clip_sample_range: float = 1.0

    diffusers_class = "HeunDiscreteScheduler"
    order = 2
    choices = {
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }
    _state_class = HeunState
    _ready_field = "second"

    def create_state(self) -> HeunState:
        base = super().create_state()
        return HeunState(alphas_cumprod=base.alphas_cumprod, sigmas=base.sigmas, timesteps=base.timesteps)

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps, sigmas, _ = sigma_space_schedule(self, n, round_karras=False)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(F32)
        timesteps = np.asarray(timesteps, dtype=F32)
        return {"timesteps": interleave(timesteps, keep_last=True)[:-1], "sigmas": interleave(sigmas, keep_last=False)}

    def set_timesteps(self, state: HeunState, num_inference_steps: int, shape) -> HeunState:
        self._checked(state, HeunState, "set_timesteps")
        tables = self._tables(num_inference_steps)
        zeros = jnp.zeros(shape_tuple(shape), jnp.float32)
        return HeunState(
            alphas_cumprod=jnp.asarray(self._sigma_alphas_cumprod()),
            sigmas=jnp.asarray(tables["sigmas"]),
            timesteps=jnp.asarray(tables["timesteps"]),
            second=jnp.zeros((), jnp.float32),
            prev_derivative=zeros,
            dt=jnp.zeros((), jnp.float32),
            sample=zeros,
        )

    def step(self, state: HeunState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, HeunState, "step", ready="second")
        x = sample.astype(jnp.float32)
        m = model_output.astype(jnp.float32)
        first = state.second == 0
        sig = state.sigmas
        sigma = jnp.where(first, sig[step_index], sig[step_index - 1])
        sigma_next = jnp.where(first, sig[step_index + 1], sig[step_index])
        x0 = sigma_space_x0(self.prediction_type, m, x, jnp.where(first, sigma, sigma_next))
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        # First stage: an Euler step, remembering its slope, step size and start.
        slope = (x - x0) / sigma
        dt = sigma_next - sigma
        euler = x + slope * dt
        # Second stage: the average of the two slopes, from the start of the step.
        averaged = (state.prev_derivative + (x - x0) / sigma_next) / 2
        heun = state.sample + averaged * state.dt
        prev = jnp.where(first, euler, heun)
        new_state = dataclasses.replace(
            state,
            second=jnp.where(first, 1.0, 0.0).astype(jnp.float32),
            prev_derivative=jnp.where(first, slope, state.prev_derivative),
            dt=jnp.where(first, dt, state.dt),
            sample=jnp.where(first, x, state.sample),
        )
        return prev.astype(sample.dtype), new_state
