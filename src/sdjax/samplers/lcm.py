"""Consistency-model samplers for distilled few-step models: LCM (Luo et al. 2023, "Latent Consistency Models",
multistep consistency sampling) and TCD (Zheng et al. 2024, "Trajectory Consistency Distillation", strategic
stochastic sampling), mirroring diffusers' `LCMScheduler` and `TCDScheduler`.

Both take the timesteps from the distillation grid (`original_inference_steps` points, every `T // that` steps)
and map the model output to a clean estimate at each step. LCM applies the consistency boundary condition
(c_skip x + c_out x0, with `timestep_scaling`) and re-noises the estimate to the next timestep with fresh noise
(none after the last step). TCD moves to the intermediate timestep s = floor((1 - gamma) t_prev) along the
predicted trajectory and, with gamma (`eta`) > 0, re-noises from s to t_prev. Timestep spacing and
`steps_offset` are config keys of these classes that they do not use, as in diffusers.

Both expect a model distilled for them (an LCM or TCD checkpoint, or such a LoRA): on another model they run but
the images are poor; `get_sampler` warns when the model's own scheduler is not one of them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import ANY, F32, Sampler, alpha_space_x0_eps, require_noise, state_class
from sdjax.samplers.ddim import add_noise_vp


@state_class
class ConsistencyState:
    alphas_cumprod: jax.Array  # (T,)
    timesteps: jax.Array  # (N,)
    alpha_t: jax.Array | None = None  # (N,) alpha_bar at timesteps[i]
    alpha_prev: jax.Array | None = None  # (N,) alpha_bar at the next timestep (LCM: the same one after the last)
    alpha_s: jax.Array | None = None  # (N,) TCD: alpha_bar at the intermediate timestep s
    c_skip: jax.Array | None = None  # (N,) LCM boundary-condition scalings
    c_out: jax.Array | None = None  # (N,)


class _Consistency(Sampler):
    """What LCM and TCD share: diffusers' defaults, the distillation grid and the per-step tables."""

    _state_class = ConsistencyState
    _ready_field = "alpha_t"
    ignores_spacing = True

    @property
    def _final_alpha_cumprod(self) -> np.float32:
        return F32(1.0) if self.set_alpha_to_one else self.alphas_cumprod[0]

    def check_steps(self, num_inference_steps: int) -> None:
        original = self.original_inference_steps
        if original > self.num_train_timesteps:
            raise ValueError(
                f"{type(self).__name__}: original_inference_steps={original} exceeds "
                f"num_train_timesteps={self.num_train_timesteps}"
            )
        if num_inference_steps > original:
            raise ValueError(
                f"{type(self).__name__}: num_inference_steps={num_inference_steps} exceeds "
                f"original_inference_steps={original} (the steps are a subset of the distillation grid)"
            )

    def _grid(self, n: int) -> np.ndarray:
        """n timesteps evenly picked (floor) from the descending distillation grid k - 1, 2k - 1, ..."""
        k = self.num_train_timesteps // self.original_inference_steps
        origin = (np.arange(1, self.original_inference_steps + 1) * k - 1)[::-1]
        picks = np.floor(np.linspace(0, len(origin), num=n, endpoint=False)).astype(np.int64)
        return origin[picks]

    def _alpha(self, t: np.ndarray) -> np.ndarray:
        return np.where(t >= 0, self.alphas_cumprod[np.maximum(t, 0)], self._final_alpha_cumprod).astype(F32)

    def create_state(self) -> ConsistencyState:
        T = self.num_train_timesteps
        return ConsistencyState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod), timesteps=jnp.arange(T - 1, -1, -1, dtype=jnp.float32)
        )

    def set_timesteps(self, state: ConsistencyState, num_inference_steps: int, shape=None) -> ConsistencyState:
        self._checked(state, ConsistencyState, "set_timesteps")
        tables = {k: jnp.asarray(v) for k, v in self._tables(num_inference_steps).items()}
        return ConsistencyState(alphas_cumprod=jnp.asarray(self.alphas_cumprod), **tables)

    def init_noise_sigma(self, state) -> jax.Array:
        return jnp.float32(1.0)

    def scale_model_input(self, state, sample: jax.Array, step_index) -> jax.Array:
        return sample

    def add_noise(self, state, original: jax.Array, noise: jax.Array, timesteps) -> jax.Array:
        """The forward process at integer timesteps (diffusers' `add_noise`: alpha_bar looked up by value)."""
        state = self._checked(state, ConsistencyState, "add_noise")
        return add_noise_vp(state.alphas_cumprod, original, noise, timesteps)


@dataclasses.dataclass(frozen=True)
class LCM(_Consistency):
    """diffusers `LCMScheduler`."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    original_inference_steps: int = 50
    clip_sample: bool = False
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    timestep_scaling: float = 10.0
    rescale_betas_zero_snr: bool = False

    diffusers_class = "LCMScheduler"
    unused_keys = {"thresholding": (False,), "dynamic_thresholding_ratio": ANY, "sample_max_value": ANY}

    @property
    def stochastic(self) -> bool:
        return True

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps = self._grid(n)
        prev = np.concatenate([timesteps[1:], timesteps[-1:]])
        scaled = timesteps.astype(F32) * F32(self.timestep_scaling)
        sigma_data_sq = F32(0.25)
        return {
            "timesteps": timesteps.astype(F32),
            "alpha_t": self._alpha(timesteps),
            "alpha_prev": self._alpha(prev),
            "c_skip": (sigma_data_sq / (scaled**2 + sigma_data_sq)).astype(F32),
            "c_out": (scaled / (scaled**2 + sigma_data_sq) ** F32(0.5)).astype(F32),
        }

    def step(self, state: ConsistencyState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        noise = require_noise("LCM", noise, sample)
        state = self._checked(state, ConsistencyState, "step", ready="alpha_t")
        x = sample.astype(jnp.float32)
        a_t, a_prev = state.alpha_t[step_index], state.alpha_prev[step_index]
        x0, _ = alpha_space_x0_eps(self.prediction_type, model_output.astype(jnp.float32), x, a_t)
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        denoised = state.c_out[step_index] * x0 + state.c_skip[step_index] * x
        renoised = a_prev**0.5 * denoised + (1 - a_prev) ** 0.5 * noise
        last = step_index == state.timesteps.shape[0] - 1
        return jnp.where(last, denoised, renoised).astype(sample.dtype), state


@dataclasses.dataclass(frozen=True)
class TCD(_Consistency):
    """diffusers `TCDScheduler`. `eta` (gamma, diffusers' `step` argument, default 0.3) is a runtime option: 0 is
    deterministic."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    original_inference_steps: int = 50
    set_alpha_to_one: bool = True
    timestep_scaling: float = 10.0
    rescale_betas_zero_snr: bool = False
    eta: float = 0.3

    diffusers_class = "TCDScheduler"
    options = ("eta",)
    unused_keys = {
        "clip_sample": ANY,
        "clip_sample_range": ANY,
        "thresholding": (False,),
        "dynamic_thresholding_ratio": ANY,
        "sample_max_value": ANY,
    }

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.eta <= 1:
            raise ValueError(f"TCD: eta (gamma) must lie in [0, 1], got {self.eta!r}")

    @property
    def stochastic(self) -> bool:
        return self.eta > 0

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps = self._grid(n)
        prev = np.concatenate([timesteps[1:], [0]])
        s = np.floor(F32(1 - self.eta) * prev.astype(F32)).astype(np.int64)
        return {
            "timesteps": timesteps.astype(F32),
            "alpha_t": self._alpha(timesteps),
            "alpha_prev": self._alpha(prev),
            "alpha_s": self._alpha(s),
        }

    def step(self, state: ConsistencyState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        if self.stochastic:
            noise = require_noise("TCD with eta > 0", noise, sample)
        state = self._checked(state, ConsistencyState, "step", ready="alpha_t")
        x = sample.astype(jnp.float32)
        a_t, a_prev, a_s = state.alpha_t[step_index], state.alpha_prev[step_index], state.alpha_s[step_index]
        x0, eps = alpha_space_x0_eps(self.prediction_type, model_output.astype(jnp.float32), x, a_t)
        noised = a_s**0.5 * x0 + (1 - a_s) ** 0.5 * eps
        if not self.stochastic:
            return noised.astype(sample.dtype), state
        renoised = (a_prev / a_s) ** 0.5 * noised + (1 - a_prev / a_s) ** 0.5 * noise
        last = step_index == state.timesteps.shape[0] - 1
        return jnp.where(last, noised, renoised).astype(sample.dtype), state
