"""Linear multistep (k-diffusion's `sample_lms`, after Karras et al. 2022), mirroring diffusers'
`LMSDiscreteScheduler`.

x_{i+1} = x_i + sum_k c_{i,k} d_{i-k}, d = (x - x0) / sigma, where c_{i,k} integrates the Lagrange basis
polynomial through the last `order` sigmas from sigma_i to sigma_{i+1}. diffusers integrates numerically with
scipy inside `step`, which made the old Flax LMS impossible to jit; the coefficients depend only on the sigma
schedule, so here they are integrated exactly (polynomials, float64) once in `set_timesteps` and stored in the
state as an (N, 4) table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import (
    F32,
    convert_sigmas,
    push,
    shape_tuple,
    sigma_space_x0,
    sigma_to_t,
    state_class,
)
from sdjax.samplers.euler import _SigmaSampler

ORDER = 4  # diffusers' default `order` argument of `step`


@state_class
class LMSState:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (N + 1,)
    timesteps: jax.Array  # (N,)
    coefficients: jax.Array | None = None  # (N, 4): step i weights derivative i, i-1, i-2, i-3
    derivatives: jax.Array | None = None  # (4, *shape) past derivatives, newest last


def lms_coefficients(sigmas: np.ndarray, order: int = ORDER) -> np.ndarray:
    """(N, order) table: coefficient k of step i is the integral over [sigma_i, sigma_{i+1}] of the Lagrange
    basis polynomial that is 1 at sigma_{i-k} and 0 at the other sigmas of the step's `min(i + 1, order)`."""
    s = np.asarray(sigmas, dtype=np.float64)
    n = len(s) - 1
    out = np.zeros((n, order))
    for i in range(n):
        used = min(i + 1, order)
        nodes = [s[i - j] for j in range(used)]
        for k in range(used):
            others = [nodes[j] for j in range(used) if j != k]
            basis = np.polynomial.Polynomial.fromroots(others) if others else np.polynomial.Polynomial([1.0])
            basis = basis / np.prod([nodes[k] - o for o in others])
            antiderivative = basis.integ()
            out[i, k] = antiderivative(s[i + 1]) - antiderivative(s[i])
    return out


@dataclasses.dataclass(frozen=True)
class LMS(_SigmaSampler):
    """diffusers `LMSDiscreteScheduler` (order 4)."""

    timestep_spacing: str = "linspace"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    diffusers_class = "LMSDiscreteScheduler"
    choices = {
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }
    _state_class = LMSState
    _ready_field = "derivatives"

    def create_state(self) -> LMSState:
        base = super().create_state()
        return LMSState(alphas_cumprod=base.alphas_cumprod, sigmas=base.sigmas, timesteps=base.timesteps)

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps, sigmas, log_sigmas = self._spaced(n)
        converted = convert_sigmas(self, sigmas, n)
        if converted is not None:
            sigmas = converted
            timesteps = sigma_to_t(sigmas, log_sigmas)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(F32)
        return {
            "timesteps": np.asarray(timesteps).astype(F32),
            "sigmas": sigmas,
            "coefficients": lms_coefficients(sigmas).astype(F32),
        }

    def set_timesteps(self, state: LMSState, num_inference_steps: int, shape) -> LMSState:
        self._checked(state, LMSState, "set_timesteps")
        tables = {k: jnp.asarray(v) for k, v in self._tables(num_inference_steps).items()}
        return LMSState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod),
            derivatives=jnp.zeros((ORDER,) + shape_tuple(shape), jnp.float32),
            **tables,
        )

    def step(self, state: LMSState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, LMSState, "step", ready="derivatives")
        x = sample.astype(jnp.float32)
        sigma = state.sigmas[step_index]
        x0 = sigma_space_x0(self.prediction_type, model_output.astype(jnp.float32), x, sigma)
        derivatives = push(state.derivatives, (x - x0) / sigma)
        c = state.coefficients[step_index]
        # Unfilled history is zero, so early steps (order < 4) add exact zeros, as diffusers' shorter sum.
        total = c[0] * derivatives[3]
        for k in range(1, ORDER):
            total = total + c[k] * derivatives[3 - k]
        prev = x + total
        return prev.astype(sample.dtype), dataclasses.replace(state, derivatives=derivatives)
