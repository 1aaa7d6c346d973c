"""DEIS (Zhang & Chen 2023, "Fast Sampling of Diffusion Models with Exponential Integrator"), the log-rho
multistep variant, mirroring diffusers' `DEISMultistepScheduler`.

With rho = sigma_t / alpha_t, the update integrates a Lagrange polynomial through the last `order` noise
predictions in log rho exactly: x_t = alpha_t (x_s / alpha_s + sum_k c_k eps_k). The order warms up from 1 and,
with `lower_order_final` below 15 steps, drops on the last two steps. Without a Karras/exponential/beta schedule
the last sigma is sigma_min (diffusers' DEIS has no `final_sigmas_type`), so the result keeps that small noise
level; with one, the last sigma repeats and the last step is the identity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import (
    ANY,
    F32,
    alpha_sigma_x0,
    convert_sigmas,
    push,
    select,
    shape_tuple,
    sigma_to_t,
    state_class,
    train_sigmas,
)
from sdjax.samplers.dpm_solver import VPSigmaSampler, _alpha_sigma, _lambda
from sdjax.samplers.unipc import multistep_spaced


@state_class
class DEISState:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (N + 1,)
    timesteps: jax.Array  # (N,) integers, as float32
    model_outputs: jax.Array | None = None  # (solver_order, *shape) past noise predictions, newest last
    lower_order_nums: jax.Array | None = None  # () warm-up steps taken (capped at solver_order)


def _ind2(t, b, c):
    """Integral in log rho of the Lagrange basis through (b, c) that is 1 at b (diffusers' second-order ind_fn)."""
    return t * (-jnp.log(c) + jnp.log(t) - 1) / (jnp.log(b) - jnp.log(c))


def _ind3(t, b, c, d):
    """The same through (b, c, d), 1 at b (diffusers' third-order ind_fn)."""
    lt, lc, ld = jnp.log(t), jnp.log(c), jnp.log(d)
    numerator = t * (lc * (ld - lt + 1) - ld * lt + ld + lt**2 - 2 * lt + 2)
    return numerator / ((jnp.log(b) - lc) * (jnp.log(b) - ld))


@dataclasses.dataclass(frozen=True)
class DEIS(VPSigmaSampler):
    """diffusers `DEISMultistepScheduler` (algorithm "deis", solver "logrho")."""

    timestep_spacing: str = "linspace"
    solver_order: int = 2
    algorithm_type: str = "deis"
    solver_type: str = "logrho"
    lower_order_final: bool = True
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    diffusers_class = "DEISMultistepScheduler"
    value_aliases = {
        "algorithm_type": {"dpmsolver": "deis", "dpmsolver++": "deis"},
        "solver_type": {"midpoint": "logrho", "heun": "logrho", "bh1": "logrho", "bh2": "logrho"},
    }
    unused_keys = {
        "thresholding": (False,),
        "dynamic_thresholding_ratio": ANY,
        "sample_max_value": ANY,
        "use_flow_sigmas": (False, None),
        "flow_shift": ANY,
        "use_dynamic_shifting": (False,),
        "time_shift_type": ANY,
    }
    choices = {
        "solver_order": (1, 2, 3),
        "algorithm_type": ("deis",),
        "solver_type": ("logrho",),
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }
    _state_class = DEISState
    _ready_field = "model_outputs"

    def create_state(self) -> DEISState:
        T = self.num_train_timesteps
        return DEISState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod),
            sigmas=jnp.asarray(train_sigmas(self.alphas_cumprod)),
            timesteps=jnp.asarray(np.linspace(0, T - 1, T, dtype=F32)[::-1].copy()),
        )

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        ac = self.alphas_cumprod
        timesteps = multistep_spaced(self.timestep_spacing, n, self.num_train_timesteps, self.steps_offset)
        sigmas = train_sigmas(ac)
        log_sigmas = np.log(sigmas)
        converted = convert_sigmas(self, sigmas[::-1], n)
        if converted is not None:
            t = sigma_to_t(converted, log_sigmas)
            timesteps = (t.round() if self.use_karras_sigmas else t).astype(np.int64)
            sigmas = np.concatenate([converted, converted[-1:]])
        else:
            sigmas = np.interp(timesteps, np.arange(len(sigmas)), sigmas)
            sigmas = np.concatenate([sigmas, [np.sqrt((F32(1) - ac[0]) / ac[0])]])
        return {"timesteps": timesteps.astype(F32), "sigmas": sigmas.astype(F32)}

    def set_timesteps(self, state: DEISState, num_inference_steps: int, shape) -> DEISState:
        self._checked(state, DEISState, "set_timesteps")
        tables = {k: jnp.asarray(v) for k, v in self._tables(num_inference_steps).items()}
        return DEISState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod),
            model_outputs=jnp.zeros((self.solver_order,) + shape_tuple(shape), jnp.float32),
            lower_order_nums=jnp.zeros((), jnp.float32),
            **tables,
        )

    def step(self, state: DEISState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, DEISState, "step", ready="model_outputs")
        x = sample.astype(jnp.float32)
        sig = state.sigmas
        num_steps = state.timesteps.shape[0]
        few = self.lower_order_final and num_steps < 15
        final = (step_index == num_steps - 1) & few
        second = (step_index == num_steps - 2) & few

        alpha_s0, sigma_s0 = _alpha_sigma(sig[step_index])
        x0 = alpha_sigma_x0(self.prediction_type, model_output.astype(jnp.float32), x, alpha_s0, sigma_s0)
        eps = (x - alpha_s0 * x0) / sigma_s0
        outputs = push(state.model_outputs, eps)
        alpha_t, sigma_t = _alpha_sigma(sig[step_index + 1])

        def rho(k):  # sigma / alpha, k steps back
            a, s = _alpha_sigma(sig[jnp.maximum(step_index - k, 0)])
            return s / a

        rho_t = sigma_t / alpha_t

        def first_order():
            h = _lambda(alpha_t, sigma_t) - _lambda(alpha_s0, sigma_s0)
            return (alpha_t / alpha_s0) * x - (sigma_t * (jnp.exp(h) - 1.0)) * eps

        def second_order():
            r0, r1 = rho(0), rho(1)
            coef1 = _ind2(rho_t, r0, r1) - _ind2(r0, r0, r1)
            coef2 = _ind2(rho_t, r1, r0) - _ind2(r0, r1, r0)
            return alpha_t * (x / alpha_s0 + coef1 * outputs[-1] + coef2 * outputs[-2])

        def third_order():
            r0, r1, r2 = rho(0), rho(1), rho(2)
            coef1 = _ind3(rho_t, r0, r1, r2) - _ind3(r0, r0, r1, r2)
            coef2 = _ind3(rho_t, r1, r2, r0) - _ind3(r0, r1, r2, r0)
            coef3 = _ind3(rho_t, r2, r0, r1) - _ind3(r0, r2, r0, r1)
            return alpha_t * (x / alpha_s0 + coef1 * outputs[-1] + coef2 * outputs[-2] + coef3 * outputs[-3])

        lon = state.lower_order_nums
        if self.solver_order == 1:
            order = jnp.int32(1)
        else:
            first = (lon < 1) | final
            order = jnp.where(first, 1, jnp.where((self.solver_order == 2) | (lon < 2) | second, 2, 3))
        updates = [first_order, second_order, third_order][: self.solver_order]
        prev = select(order - 1, [update() for update in updates])
        new_state = dataclasses.replace(
            state, model_outputs=outputs, lower_order_nums=jnp.minimum(lon + 1, self.solver_order)
        )
        return prev.astype(sample.dtype), new_state
