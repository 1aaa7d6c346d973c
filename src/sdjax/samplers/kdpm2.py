"""DPM-Solver-2 in k-diffusion's form (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based
Generative Models", the second-order sampler with a midpoint in log sigma; k-diffusion's `sample_dpm_2` and
`sample_dpm_2_ancestral`), mirroring diffusers' `KDPM2DiscreteScheduler` (A1111 "DPM2") and
`KDPM2AncestralDiscreteScheduler` ("DPM2 a").

Each step from sigma_i calls the model at sigma_i, takes an Euler step to the geometric midpoint
sigma_mid = sqrt(sigma_i sigma_target), calls the model there and steps from sigma_i with the midpoint's slope.
DPM2 targets sigma_{i+1}; DPM2 a targets sigma_down and adds fresh noise of std sigma_up, the ancestral split of
sigma_{i+1} (sigma_up^2 + sigma_down^2 = sigma_{i+1}^2). As in diffusers the two stages are interleaved in the
schedule (timesteps t_0, t_mid_1, t_1, ..., one model call per loop iteration, `2n - 1` calls) and the state
remembers the stage and the sample the step started from. The last step, to sigma = 0, is an Euler step.

A1111's DPM2 samplers also drop the next-to-last sigma (`discard_next_to_last_sigma`); diffusers does not, and
neither does sdjax, which follows diffusers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import (
    F32,
    ancestral_down,
    require_noise,
    shape_tuple,
    sigma_space_x0,
    sigma_to_t,
    state_class,
)
from sdjax.samplers.euler import _SigmaSampler
from sdjax.samplers.heun import interleave, sigma_space_schedule


@state_class
class KDPM2State:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (2n + 2,) interleaved: s_0, s_1, s_1, ..., 0, 0, 0
    timesteps: jax.Array  # (2n - 1,) t_0, t_mid, t_1, t_mid, ...
    sigmas_interpol: jax.Array | None = None  # (2n + 2,) the midpoint sigmas, interleaved like `sigmas`
    sigmas_up: jax.Array | None = None  # (2n + 2,) ancestral noise std (DPM2 a)
    sigmas_down: jax.Array | None = None  # (2n + 2,) ancestral target sigma (DPM2 a)
    second: jax.Array | None = None  # () 1 when the next call is the midpoint stage of a step
    sample: jax.Array | None = None  # (*shape) the sample the step started from


def _log_midpoint(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """exp(lerp(log a, log b, 1/2)) in float32 with torch's formula for weight 1/2 (`end - (end - start) / 2`):
    the geometric mean, 0 where either is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        la, lb = np.log(a.astype(F32)), np.log(b.astype(F32))
        return np.exp(lb - (lb - la) * F32(0.5)).astype(F32)


@dataclasses.dataclass(frozen=True)
class _KDPM2Base(_SigmaSampler):
    """What DPM2 and DPM2 a share: diffusers' defaults, the sigma schedule and the stage bookkeeping."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    timestep_spacing: str = "linspace"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    order = 2
    choices = {
        "prediction_type": ("epsilon", "v_prediction"),
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }
    _state_class = KDPM2State
    _ready_field = "second"

    def create_state(self) -> KDPM2State:
        base = super().create_state()
        return KDPM2State(alphas_cumprod=base.alphas_cumprod, sigmas=base.sigmas, timesteps=base.timesteps)

    def set_timesteps(self, state: KDPM2State, num_inference_steps: int, shape) -> KDPM2State:
        self._checked(state, KDPM2State, "set_timesteps")
        tables = {k: jnp.asarray(v) for k, v in self._tables(num_inference_steps).items()}
        return KDPM2State(
            alphas_cumprod=jnp.asarray(self._sigma_alphas_cumprod()),
            second=jnp.zeros((), jnp.float32),
            sample=jnp.zeros(shape_tuple(shape), jnp.float32),
            **tables,
        )

    def _base_schedule(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        timesteps, sigmas, log_sigmas = sigma_space_schedule(self, n, round_karras=True)
        return timesteps, np.concatenate([sigmas, [0.0]]).astype(F32), log_sigmas


@dataclasses.dataclass(frozen=True)
class KDPM2(_KDPM2Base):
    """diffusers `KDPM2DiscreteScheduler` (DPM-Solver-2, no churn)."""

    diffusers_class = "KDPM2DiscreteScheduler"

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps, sigmas, log_sigmas = self._base_schedule(n)
        # Midpoint i lies between sigma_{i-1} and sigma_i (the one before is the step's start).
        interpol = _log_midpoint(sigmas, np.roll(sigmas, 1))
        t_interpol = sigma_to_t(np.nan_to_num(interpol, nan=1.0), log_sigmas, F32)
        calls = np.stack([t_interpol[1:-1], timesteps[1:]], axis=-1).reshape(-1)
        return {
            "timesteps": np.concatenate([timesteps[:1], calls]).astype(F32),
            "sigmas": interleave(sigmas, keep_last=True),
            "sigmas_interpol": interleave(interpol, keep_last=True),
        }

    def scale_model_input(self, state: KDPM2State, sample: jax.Array, step_index) -> jax.Array:
        state = self._checked(state, KDPM2State, "scale_model_input", ready="second")
        sigma = jnp.where(state.second == 0, state.sigmas[step_index], state.sigmas_interpol[step_index])
        return (sample.astype(jnp.float32) / (sigma**2 + 1) ** 0.5).astype(sample.dtype)

    def step(self, state: KDPM2State, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, KDPM2State, "step", ready="second")
        x = sample.astype(jnp.float32)
        first = state.second == 0
        sig, interpol = state.sigmas, state.sigmas_interpol
        sigma = jnp.where(first, sig[step_index], sig[step_index - 1])
        sigma_mid = jnp.where(first, interpol[step_index + 1], interpol[step_index])
        sigma_next = jnp.where(first, sig[step_index + 1], sig[step_index])
        x0 = sigma_space_x0(
            self.prediction_type, model_output.astype(jnp.float32), x, jnp.where(first, sigma, sigma_mid)
        )
        to_midpoint = x + (x - x0) / sigma * (sigma_mid - sigma)
        from_start = state.sample + (x - x0) / sigma_mid * (sigma_next - sigma)
        prev = jnp.where(first, to_midpoint, from_start)
        new_state = dataclasses.replace(
            state, second=jnp.where(first, 1.0, 0.0).astype(jnp.float32), sample=jnp.where(first, x, state.sample)
        )
        return prev.astype(sample.dtype), new_state


@dataclasses.dataclass(frozen=True)
class KDPM2Ancestral(_KDPM2Base):
    """diffusers `KDPM2AncestralDiscreteScheduler` (DPM-Solver-2 to sigma_down, then noise of std sigma_up)."""

    diffusers_class = "KDPM2AncestralDiscreteScheduler"

    @property
    def stochastic(self) -> bool:
        return True

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps, sigmas, log_sigmas = self._base_schedule(n)
        nxt = np.concatenate([sigmas[1:], [0.0]]).astype(F32)
        with np.errstate(divide="ignore", invalid="ignore"):
            up = ((nxt**2 * (sigmas**2 - nxt**2) / sigmas**2) ** F32(0.5)).astype(F32)
            down = ancestral_down(sigmas, nxt, up, np).astype(F32)
        down[-1] = 0.0
        interpol = _log_midpoint(sigmas, down)
        interpol[-2:] = 0.0
        t_interpol = sigma_to_t(interpol, log_sigmas, F32)
        calls = np.stack([t_interpol[:-2], timesteps[1:]], axis=-1).reshape(-1)
        return {
            "timesteps": np.concatenate([timesteps[:1], calls]).astype(F32),
            "sigmas": interleave(sigmas, keep_last=True),
            "sigmas_interpol": interleave(interpol, keep_last=True),
            "sigmas_up": interleave(up, keep_last=True),
            "sigmas_down": interleave(down, keep_last=True),
        }

    def scale_model_input(self, state: KDPM2State, sample: jax.Array, step_index) -> jax.Array:
        state = self._checked(state, KDPM2State, "scale_model_input", ready="second")
        sigma = jnp.where(state.second == 0, state.sigmas[step_index], state.sigmas_interpol[step_index - 1])
        return (sample.astype(jnp.float32) / (sigma**2 + 1) ** 0.5).astype(sample.dtype)

    def step(self, state: KDPM2State, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        noise = require_noise("KDPM2Ancestral", noise, sample)
        state = self._checked(state, KDPM2State, "step", ready="second")
        x = sample.astype(jnp.float32)
        first = state.second == 0
        at = jnp.where(first, step_index, step_index - 1)
        sigma, sigma_mid = state.sigmas[at], state.sigmas_interpol[at]
        sigma_up, sigma_down = state.sigmas_up[step_index - 1], state.sigmas_down[step_index - 1]
        x0 = sigma_space_x0(
            self.prediction_type, model_output.astype(jnp.float32), x, jnp.where(first, sigma, sigma_mid)
        )
        to_midpoint = x + (x - x0) / sigma * (sigma_mid - sigma)
        from_start = state.sample + (x - x0) / sigma_mid * (sigma_down - sigma) + noise * sigma_up
        prev = jnp.where(first, to_midpoint, from_start)
        new_state = dataclasses.replace(
            state, second=jnp.where(first, 1.0, 0.0).astype(jnp.float32), sample=jnp.where(first, x, state.sample)
        )
        return prev.astype(sample.dtype), new_state
