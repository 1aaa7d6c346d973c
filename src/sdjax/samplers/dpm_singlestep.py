"""DPM-Solver++ singlestep (Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion
Probabilistic Models", Algorithm 1 / "DPM-Solver-2S"), mirroring diffusers' `DPMSolverSinglestepScheduler`
with `algorithm_type` "dpmsolver++" or "sde-dpmsolver++", `solver_type` midpoint or heun, `solver_order` 1-3.

Steps are grouped: the orders run 1, 2, (3), 1, 2, ... (`get_order_list`); a group starts from the sample at its
first step and each step of the group reuses it with the model outputs (x0 predictions) taken since, so a group
of order k moves from one sample to the next with k model calls at intermediate grid points. The state keeps the
x0 history, how much of it is filled, and the group's start sample. With `lower_order_final` (forced by diffusers
when the step count is not a multiple of the order, or with `final_sigmas_type="zero"`) the tail uses lower orders.

AUTOMATIC1111's "DPM++ 2S a" (k-diffusion's `sample_dpmpp_2s_ancestral`) has no diffusers equivalent; diffusers'
documentation names this class as the closest, and sdjax maps "DPM++ 2S a" to it with `solver_order=2` and the
stochastic `sde-dpmsolver++` algorithm -- one model call per step, where A1111 makes two.
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
    require_noise,
    select,
    shape_tuple,
    sigma_to_t,
    state_class,
    train_sigmas,
)
from sdjax.samplers.dpm_solver import VPSigmaSampler, _alpha_sigma, _lambda, lambda_clipped_end


@state_class
class DPMSolverSinglestepState:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (N + 1,)
    timesteps: jax.Array  # (N,) integers, as float32
    orders: jax.Array | None = None  # (N,) the order diffusers' `order_list` gives each step
    model_outputs: jax.Array | None = None  # (solver_order, *shape) past x0 predictions, newest last
    filled: jax.Array | None = None  # () how many of them exist (fewer after set_timesteps)
    sample: jax.Array | None = None  # (*shape) the sample the current group of steps started from


def order_list(n: int, order: int, lower_order_final: bool, final_sigmas_type: str) -> list[int]:
    """diffusers' `get_order_list`: the solver order of each of `n` steps."""
    if lower_order_final:
        if order == 3:
            if n % 3 == 0:
                orders = [1, 2, 3] * (n // 3 - 1) + [1, 2] + [1]
            elif n % 3 == 1:
                orders = [1, 2, 3] * (n // 3) + [1]
            else:
                orders = [1, 2, 3] * (n // 3) + [1, 2]
        elif order == 2:
            orders = [1, 2] * (n // 2 - 1) + [1, 1] if n % 2 == 0 else [1, 2] * (n // 2) + [1]
        else:
            orders = [1] * n
    else:
        orders = {3: [1, 2, 3] * (n // 3), 2: [1, 2] * (n // 2), 1: [1] * n}[order]
    if final_sigmas_type == "zero":
        orders[-1] = 1
    return orders


@dataclasses.dataclass(frozen=True)
class DPMSolverSinglestep(VPSigmaSampler):
    """diffusers `DPMSolverSinglestepScheduler` (data-prediction algorithms; no timestep spacing: its grid is
    always linspace up to the lambda-clipped end)."""

    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = False
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -float("inf")

    diffusers_class = "DPMSolverSinglestepScheduler"
    not_keys = ("timestep_spacing", "steps_offset")
    fixed_spacing = "linspace"
    value_aliases = {
        "algorithm_type": {"deis": "dpmsolver++"},
        "solver_type": {"logrho": "midpoint", "bh1": "midpoint", "bh2": "midpoint"},
    }
    unused_keys = {
        "thresholding": (False,),
        "dynamic_thresholding_ratio": ANY,
        "sample_max_value": ANY,
        "use_flow_sigmas": (False, None),
        "flow_shift": ANY,
        "variance_type": (None,),
        "use_dynamic_shifting": (False,),
        "time_shift_type": ANY,
    }
    choices = {
        "solver_order": (1, 2, 3),
        "algorithm_type": ("dpmsolver++", "sde-dpmsolver++"),
        "solver_type": ("midpoint", "heun"),
        "final_sigmas_type": ("zero", "sigma_min"),
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }
    _state_class = DPMSolverSinglestepState
    _ready_field = "model_outputs"

    @property
    def stochastic(self) -> bool:
        return self.algorithm_type == "sde-dpmsolver++"

    def effective_lower_order_final(self, n: int) -> bool:
        """diffusers' `set_timesteps` switches `lower_order_final` on for an uneven step count or a zero final
        sigma (and keeps it on in the scheduler's config; here it is decided per step count)."""
        return self.lower_order_final or n % self.solver_order != 0 or self.final_sigmas_type == "zero"

    def create_state(self) -> DPMSolverSinglestepState:
        T = self.num_train_timesteps
        return DPMSolverSinglestepState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod),
            sigmas=jnp.asarray(train_sigmas(self.alphas_cumprod)),
            timesteps=jnp.asarray(np.linspace(0, T - 1, T, dtype=F32)[::-1].copy()),
        )

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        ac = self.alphas_cumprod
        last = lambda_clipped_end(ac, self.lambda_min_clipped)
        timesteps = np.linspace(0, last - 1, n + 1).round()[::-1][:-1].astype(np.int64)
        sigmas = train_sigmas(ac)
        log_sigmas = np.log(sigmas)
        converted = convert_sigmas(self, sigmas[::-1], n)
        if converted is not None:
            t = sigma_to_t(converted, log_sigmas)
            timesteps = (t.round() if self.use_karras_sigmas else t).astype(np.int64)
            sigmas = converted
        else:
            sigmas = np.interp(timesteps, np.arange(len(sigmas)), sigmas)
        last_sigma = np.sqrt((F32(1) - ac[0]) / ac[0]) if self.final_sigmas_type == "sigma_min" else 0.0
        orders = order_list(n, self.solver_order, self.effective_lower_order_final(n), self.final_sigmas_type)
        return {
            "timesteps": timesteps.astype(F32),
            "sigmas": np.concatenate([sigmas, [last_sigma]]).astype(F32),
            "orders": np.asarray(orders, dtype=F32),
        }

    def set_timesteps(self, state: DPMSolverSinglestepState, num_inference_steps: int, shape):
        self._checked(state, DPMSolverSinglestepState, "set_timesteps")
        tables = {k: jnp.asarray(v) for k, v in self._tables(num_inference_steps).items()}
        shape = shape_tuple(shape)
        return DPMSolverSinglestepState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod),
            model_outputs=jnp.zeros((self.solver_order,) + shape, jnp.float32),
            filled=jnp.zeros((), jnp.float32),
            sample=jnp.zeros(shape, jnp.float32),
            **tables,
        )

    def step(self, state: DPMSolverSinglestepState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, DPMSolverSinglestepState, "step", ready="model_outputs")
        sde = self.stochastic
        noise = require_noise("DPM++ singlestep SDE", noise, sample) if sde else None
        x = sample.astype(jnp.float32)
        sig = state.sigmas
        alpha_s0, sigma_s0 = _alpha_sigma(sig[step_index])
        x0 = alpha_sigma_x0(self.prediction_type, model_output.astype(jnp.float32), x, alpha_s0, sigma_s0)
        outputs = push(state.model_outputs, x0)
        filled = jnp.minimum(state.filled + 1, self.solver_order)
        order = jnp.minimum(state.orders[step_index], filled).astype(jnp.int32)
        start = jnp.where(order == 1, x, state.sample)  # a group starts where its first-order step does

        alpha_t, sigma_t = _alpha_sigma(sig[step_index + 1])
        lambda_t = _lambda(alpha_t, sigma_t)

        def back(k):  # (alpha, sigma, lambda) k steps back
            a, s = _alpha_sigma(sig[jnp.maximum(step_index - k, 0)])
            return a, s, _lambda(a, s)

        def noise_term(h):
            return sigma_t * jnp.sqrt(1.0 - jnp.exp(-2 * h)) * noise

        def first_order():
            h = lambda_t - _lambda(alpha_s0, sigma_s0)
            if sde:
                return (
                    (sigma_t / sigma_s0 * jnp.exp(-h)) * start
                    + (alpha_t * (1 - jnp.exp(-2.0 * h))) * x0
                    + noise_term(h)
                )
            return (sigma_t / sigma_s0) * start - (alpha_t * (jnp.exp(-h) - 1.0)) * x0

        def second_order():
            _, sigma_s1, lambda_s1 = back(1)
            m0, m1 = outputs[-1], outputs[-2]
            h, h_0 = lambda_t - lambda_s1, _lambda(alpha_s0, sigma_s0) - lambda_s1
            d0, d1 = m1, (1.0 / (h_0 / h)) * (m0 - m1)
            if sde:
                out = (sigma_t / sigma_s1 * jnp.exp(-h)) * start + (alpha_t * (1 - jnp.exp(-2.0 * h))) * d0
                if self.solver_type == "midpoint":
                    out = out + 0.5 * (alpha_t * (1 - jnp.exp(-2.0 * h))) * d1
                else:
                    out = out + (alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * d1
                return out + noise_term(h)
            out = (sigma_t / sigma_s1) * start - (alpha_t * (jnp.exp(-h) - 1.0)) * d0
            if self.solver_type == "midpoint":
                return out - 0.5 * (alpha_t * (jnp.exp(-h) - 1.0)) * d1
            return out + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1

        def third_order():
            _, _, lambda_s1 = back(1)
            _, sigma_s2, lambda_s2 = back(2)
            m0, m1, m2 = outputs[-1], outputs[-2], outputs[-3]
            lambda_s0 = _lambda(alpha_s0, sigma_s0)
            h, h_0, h_1 = lambda_t - lambda_s2, lambda_s0 - lambda_s2, lambda_s1 - lambda_s2
            r0, r1 = h_0 / h, h_1 / h
            d0 = m2
            d1_0, d1_1 = (1.0 / r1) * (m1 - m2), (1.0 / r0) * (m0 - m2)
            d1 = (r0 * d1_0 - r1 * d1_1) / (r0 - r1)
            d2 = 2.0 * (d1_1 - d1_0) / (r0 - r1)
            if sde:
                out = (sigma_t / sigma_s2 * jnp.exp(-h)) * start + (alpha_t * (1.0 - jnp.exp(-2.0 * h))) * d0
                if self.solver_type == "midpoint":
                    out = out + (alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * d1_1
                else:
                    out = (
                        out
                        + (alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * d1
                        + (alpha_t * ((1.0 - jnp.exp(-2.0 * h) + (-2.0 * h)) / (-2.0 * h) ** 2 - 0.5)) * d2
                    )
                return out + noise_term(h)
            out = (sigma_t / sigma_s2) * start - (alpha_t * (jnp.exp(-h) - 1.0)) * d0
            if self.solver_type == "midpoint":
                return out + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1_1
            return (
                out
                + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1
                - (alpha_t * ((jnp.exp(-h) - 1.0 + h) / h**2 - 0.5)) * d2
            )

        updates = [first_order, second_order, third_order][: self.solver_order]
        prev = select(order - 1, [update() for update in updates])
        new_state = dataclasses.replace(state, model_outputs=outputs, filled=filled, sample=start)
        return prev.astype(sample.dtype), new_state
