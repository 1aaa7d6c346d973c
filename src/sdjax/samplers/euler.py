"""Euler and Euler-ancestral samplers in sigma space (Karras et al. 2022, "Elucidating the Design Space of
Diffusion-Based Generative Models", Algorithm 1 without churn; k-diffusion's `sample_euler` and
`sample_euler_ancestral`), mirroring diffusers' `EulerDiscreteScheduler` (the SDXL default) and
`EulerAncestralDiscreteScheduler`.

The sample lives in the variance-exploding parameterisation x = x0 + sigma eps: the model sees
x / sqrt(sigma^2 + 1) (`scale_model_input`), the loop starts from noise times `init_noise_sigma`, and
`add_noise` returns x0 + sigma eps -- already the right starting sample for img2img (the old Flax img2img
pipeline multiplied it by `init_noise_sigma` again, which is wrong for these samplers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import (
    F32,
    Sampler,
    ancestral_down,
    convert_sigmas,
    linspace_f32,
    match_step_index,
    per_sample,
    require_noise,
    sigma_space_x0,
    sigma_to_t,
    spaced_timesteps,
    state_class,
    train_sigmas,
)


@state_class
class SigmaState:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (N + 1,) noise level at each step, then the final one (0 or sigma_min)
    timesteps: jax.Array  # (N,) the values fed to the UNet (fractional with Karras sigmas)


def _zero_snr_alphas_cumprod(alphas_cumprod: np.ndarray) -> np.ndarray:
    """diffusers' sigma-space samplers replace a zero last alpha_bar by 2^-24 so its sigma stays finite."""
    out = alphas_cumprod.copy()
    out[-1] = F32(2.0**-24)
    return out


class _SigmaSampler(Sampler):
    """What Euler, Euler-ancestral and LMS share: the sigma schedule, input scaling and `add_noise`."""

    def _sigma_alphas_cumprod(self) -> np.ndarray:
        ac = self.alphas_cumprod
        return _zero_snr_alphas_cumprod(ac) if getattr(self, "rescale_betas_zero_snr", False) else ac

    def create_state(self) -> SigmaState:
        T = self.num_train_timesteps
        ac = self._sigma_alphas_cumprod()
        sigmas = np.concatenate([train_sigmas(ac)[::-1], [0.0]]).astype(F32)
        return SigmaState(
            alphas_cumprod=jnp.asarray(ac),
            sigmas=jnp.asarray(sigmas),
            timesteps=jnp.asarray(np.linspace(0, T - 1, T)[::-1].astype(F32)),
        )

    def _spaced(self, n: int, *, float64: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(timesteps float32 -- float64 where diffusers computes them so --, sigmas interpolated at them
        float64, log training sigmas float32)."""
        timesteps = spaced_timesteps(
            self.timestep_spacing,
            n,
            self.num_train_timesteps,
            self.steps_offset,
            kind="float64" if float64 else "float",
        )
        sig = train_sigmas(self._sigma_alphas_cumprod())
        return timesteps, np.interp(timesteps, np.arange(len(sig)), sig), np.log(sig)

    def set_timesteps(self, state: SigmaState, num_inference_steps: int, shape=None) -> SigmaState:
        self._checked(state, SigmaState, "set_timesteps")
        tables = self._tables(num_inference_steps)
        return SigmaState(
            alphas_cumprod=jnp.asarray(self._sigma_alphas_cumprod()),
            sigmas=jnp.asarray(tables["sigmas"]),
            timesteps=jnp.asarray(tables["timesteps"]),
        )

    def init_noise_sigma(self, state) -> jax.Array:
        state = self._checked(state, self._state_class, "init_noise_sigma")
        top = jnp.max(state.sigmas)
        return top if self.timestep_spacing in ("linspace", "trailing") else (top**2 + 1) ** 0.5

    def scale_model_input(self, state, sample: jax.Array, step_index) -> jax.Array:
        state = self._checked(state, self._state_class, "scale_model_input")
        sigma = state.sigmas[step_index]
        return (sample.astype(jnp.float32) / (sigma**2 + 1) ** 0.5).astype(sample.dtype)

    def add_noise(self, state, original: jax.Array, noise: jax.Array, timesteps) -> jax.Array:
        """x0 + sigma eps, sigma of the step whose timestep equals `timesteps` (diffusers' lookup: the second
        match if a value repeats). A timestep within float32 rounding of a schedule value (one computed by
        diffusers, say) takes that step; any other uses the training sigma interpolated at it."""
        state = self._checked(state, self._state_class, "add_noise")
        t = jnp.asarray(timesteps, jnp.float32).reshape(-1)
        index, found = match_step_index(state.timesteps, t)
        gap = jnp.abs(state.timesteps[None, :] - t[:, None])
        nearest = jnp.argmin(gap, axis=1)
        near = jnp.min(gap, axis=1) <= 1e-5 * jnp.maximum(1.0, jnp.abs(t))
        sig = train_sigmas_jax(state.alphas_cumprod)
        fallback = jnp.interp(t, jnp.arange(sig.shape[0], dtype=jnp.float32), sig)
        sigma = jnp.where(found, state.sigmas[index], jnp.where(near, state.sigmas[nearest], fallback))
        x0 = original.astype(jnp.float32)
        return (x0 + noise.astype(jnp.float32) * per_sample(sigma, x0.ndim)).astype(original.dtype)

    def add_noise_at(self, state, original: jax.Array, noise: jax.Array, index) -> jax.Array:
        """x0 + sigma eps with the sigma of model call `index` (diffusers' `add_noise` after `set_begin_index`:
        the sigma at the begin index, not a lookup by timestep value). `index == num_model_calls` is the final
        sigma (0: `original` itself)."""
        state = self._checked(state, self._state_class, "add_noise_at", ready=self._ready_field)
        sigma = state.sigmas[jnp.asarray(index, jnp.int32)]
        x0 = original.astype(jnp.float32)
        return (x0 + noise.astype(jnp.float32) * sigma).astype(original.dtype)

    _state_class = SigmaState


def train_sigmas_jax(alphas_cumprod: jax.Array) -> jax.Array:
    return jnp.sqrt((1 - alphas_cumprod) / alphas_cumprod)


@dataclasses.dataclass(frozen=True)
class Euler(_SigmaSampler):
    """diffusers `EulerDiscreteScheduler` (no churn: `s_churn = 0`, its default, so it is deterministic)."""

    timestep_spacing: str = "linspace"
    interpolation_type: str = "linear"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    timestep_type: str = "discrete"
    rescale_betas_zero_snr: bool = False
    final_sigmas_type: str = "zero"

    diffusers_class = "EulerDiscreteScheduler"
    choices = {
        "interpolation_type": ("linear", "log_linear"),
        "timestep_type": ("discrete", "continuous"),
        "final_sigmas_type": ("zero", "sigma_min"),
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps, sigmas, log_sigmas = self._spaced(n)
        if self.interpolation_type == "log_linear":
            sig = train_sigmas(self._sigma_alphas_cumprod())
            sigmas = np.exp(linspace_f32(np.log(sig[-1]), np.log(sig[0]), n + 1))
        converted = convert_sigmas(self, sigmas, n)
        if converted is not None:
            sigmas = converted
            timesteps = sigma_to_t(sigmas, log_sigmas)
        if self.final_sigmas_type == "sigma_min":
            ac = self._sigma_alphas_cumprod()
            last = np.sqrt((F32(1) - ac[0]) / ac[0])
        else:
            last = 0.0
        sigmas = np.concatenate([sigmas, [last]]).astype(F32)
        if self.timestep_type == "continuous" and self.prediction_type == "v_prediction":
            timesteps = F32(0.25) * np.log(sigmas[:-1])
        return {"timesteps": np.asarray(timesteps).astype(F32), "sigmas": sigmas}

    def step(self, state: SigmaState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, SigmaState, "step")
        x = sample.astype(jnp.float32)
        sigma, sigma_next = state.sigmas[step_index], state.sigmas[step_index + 1]
        x0 = sigma_space_x0(self.prediction_type, model_output.astype(jnp.float32), x, sigma)
        derivative = (x - x0) / sigma
        prev = x + derivative * (sigma_next - sigma)
        return prev.astype(sample.dtype), state


@dataclasses.dataclass(frozen=True)
class EulerAncestral(_SigmaSampler):
    """diffusers `EulerAncestralDiscreteScheduler`: an Euler step down to sigma_down, then fresh noise of
    std sigma_up, with sigma_up^2 + sigma_down^2 = sigma_next^2 (eta = 1)."""

    timestep_spacing: str = "linspace"
    rescale_betas_zero_snr: bool = False

    diffusers_class = "EulerAncestralDiscreteScheduler"
    choices = {"prediction_type": ("epsilon", "v_prediction")}

    @property
    def stochastic(self) -> bool:
        return True

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps, sigmas, _ = self._spaced(n)
        return {"timesteps": timesteps, "sigmas": np.concatenate([sigmas, [0.0]]).astype(F32)}

    def step(self, state: SigmaState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        noise = require_noise("EulerAncestral", noise, sample)
        state = self._checked(state, SigmaState, "step")
        x = sample.astype(jnp.float32)
        sigma_from, sigma_to = state.sigmas[step_index], state.sigmas[step_index + 1]
        x0 = sigma_space_x0(self.prediction_type, model_output.astype(jnp.float32), x, sigma_from)
        sigma_up = (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5
        sigma_down = ancestral_down(sigma_from, sigma_to, sigma_up, jnp)
        derivative = (x - x0) / sigma_from
        prev = x + derivative * (sigma_down - sigma_from)
        prev = prev + noise * sigma_up
        return prev.astype(sample.dtype), state
