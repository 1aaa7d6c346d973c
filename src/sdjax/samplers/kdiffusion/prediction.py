"""The model side of k-diffusion-style sampling: one wrapper that turns a network's output into a denoised
estimate x0, so that the step rules (`rules.py`) and the schedules (`schedules.py`) never see a prediction type.

Two sample paths, both written as x = alpha(sigma) x0 + sigma eps:
- variance-preserving models (SD 1.x/2.x, SDXL: epsilon, v_prediction, sample) in k-diffusion's variance-exploding
  form, alpha = 1 and sigma = sqrt((1 - alpha_bar) / alpha_bar); the network was trained on the VP sample, which is
  x / sqrt(sigma^2 + 1) (`input_scale`), and its timestep is found from sigma on the training table;
- flow-matching models (Flux, SD 3: rectified flow, a velocity v = eps - x0) with alpha = 1 - sigma, sigma in [0, 1],
  x0 = x - sigma v, no input scaling, timestep sigma * num_train_timesteps.

How sigma becomes the network's timestep (`timestep`) is a property of the model wrapper, as k-diffusion's
`DiscreteSchedule(quantize=...)`; the modes reproduce what diffusers' schedulers feed:
- "log": linear interpolation in log sigma between the two training sigmas around it (k-diffusion, and diffusers'
  `_sigma_to_t` for Karras/exponential/beta sigmas); "round" / "floor": the same, rounded / truncated (diffusers'
  DPM-Solver with Karras / other sigma schedules); "linear": the inverse of a linear interpolation in sigma
  (diffusers' Euler on a spaced grid, whose sigmas are interpolated linearly at fractional timesteps).
- flow: "scaled" sigma * T (FlowMatch schedulers), "floor" int(sigma * T) (DPM-Solver/UniPC with flow sigmas).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from sdjax.config import ConfigError
from sdjax.samplers.common import F32, cumprod, make_betas, sigma_space_x0, sigma_to_t, train_sigmas

PREDICTIONS = ("epsilon", "v_prediction", "sample", "flow")
VP_TIMESTEPS = ("log", "round", "floor", "linear")
FLOW_TIMESTEPS = ("scaled", "floor")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the network predicts (`kind`), its training noise schedule (the diffusers beta keys; unused for flow)
    and how a sigma becomes its timestep (`timestep`, module docstring; None: "log" for VP, "scaled" for flow)."""

    kind: str = "epsilon"
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    trained_betas: tuple[float, ...] | None = None
    timestep: str | None = None

    def __post_init__(self):
        if self.kind not in PREDICTIONS:
            raise ConfigError(f"prediction {self.kind!r} is not one of {list(PREDICTIONS)}")
        valid = FLOW_TIMESTEPS if self.flow else VP_TIMESTEPS
        if self.timestep is None:
            object.__setattr__(self, "timestep", valid[0])
        if self.timestep not in valid:
            raise ConfigError(f"timestep={self.timestep!r} for a {self.kind} model; expected one of {list(valid)}")
        if self.trained_betas is not None and not isinstance(self.trained_betas, tuple):
            object.__setattr__(self, "trained_betas", tuple(float(b) for b in self.trained_betas))

    @property
    def flow(self) -> bool:
        return self.kind == "flow"

    # ------------------------------------------------------------------------------------------ host (numpy)
    def alphas_cumprod(self) -> np.ndarray:
        """alpha_bar of every training timestep of a variance-preserving model (float32, diffusers' arithmetic)."""
        betas = make_betas(self.num_train_timesteps, self.beta_start, self.beta_end, self.beta_schedule,
                           self.trained_betas)  # fmt: skip
        return cumprod(F32(1) - betas)

    @functools.cached_property
    def _train_sigmas(self) -> np.ndarray:
        T = self.num_train_timesteps
        if self.flow:  # unshifted: the shift is the schedule's (`schedules.py`)
            out = np.arange(1, T + 1, dtype=np.float64) / T
        else:
            out = train_sigmas(self.alphas_cumprod())
        out.setflags(write=False)
        return out

    def train_sigmas(self) -> np.ndarray:
        """The sigma of every training timestep, ascending in t (VP: float32 from alphas_cumprod; flow: t / T)."""
        return self._train_sigmas

    def timesteps(self, sigmas: np.ndarray) -> np.ndarray:
        """The network's timestep for each sigma (`timestep` mode), float32."""
        sigmas = np.asarray(sigmas, dtype=np.float64)
        T = self.num_train_timesteps
        if self.timestep == "scaled":
            return (sigmas * T).astype(F32)
        if self.timestep == "floor" and self.flow:
            return (sigmas * T).astype(np.int64).astype(F32)
        table = self._train_sigmas
        if self.timestep == "linear":
            return np.interp(sigmas, table.astype(np.float64), np.arange(T, dtype=np.float64)).astype(F32)
        t = sigma_to_t(sigmas, np.log(table))
        if self.timestep == "round":
            t = np.round(t)
        elif self.timestep == "floor":
            t = np.trunc(t)
        return t.astype(F32)

    # ----------------------------------------------------------------------------------------- traced (jax)
    def alpha(self, sigma):
        """The data coefficient of the sample path at `sigma`: 1 (VE form of a VP model) or 1 - sigma (flow)."""
        return 1.0 - sigma if self.flow else jnp.ones_like(sigma)

    def input_scale(self, sigma):
        """The factor on the sample before the network sees it."""
        return jnp.ones_like(sigma) if self.flow else 1.0 / jnp.sqrt(sigma**2 + 1.0)

    def start_scale(self, sigma):
        """The factor on unit noise for the first sample of a full denoise at `sigma`: 1 for flow; sqrt(sigma^2 +
        1) for VP, the VE image of a unit-variance VP sample (ComfyUI's `max_denoise`, diffusers' DPM-Solver/UniPC
        start; k-diffusion and diffusers' Euler on a linspace grid use sigma itself)."""
        return jnp.ones_like(sigma) if self.flow else jnp.sqrt(sigma**2 + 1.0)

    def denoised(self, model_output, x, sigma):
        """The denoised estimate x0 from the network's output at `sigma` (the one conversion)."""
        if self.flow:
            return x - sigma * model_output
        return sigma_space_x0(self.kind, model_output, x, sigma)

    def noised(self, x0, noise, sigma):
        """x0 on the path at `sigma`: alpha x0 + sigma eps."""
        return self.alpha(sigma) * x0 + sigma * noise
