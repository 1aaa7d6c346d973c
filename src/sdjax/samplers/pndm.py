"""PNDM / PLMS (Liu et al. 2022, "Pseudo Numerical Methods for Diffusion Models on Manifolds"), mirroring
diffusers' `PNDMScheduler` (the Stable Diffusion 1.x default, with `skip_prk_steps=True`).

The transfer x_t -> x_prev (eq. 9) is applied to a linear multistep combination of model outputs:
with `skip_prk_steps` (PLMS) the loop calls the model `n + 1` times -- a first Euler step, a Heun-like
correction at the same timestep that averages the first two outputs, then Adams-Bashforth of order 2, 3 and 4;
without it, twelve Runge-Kutta calls (three RK4 steps over half-spaced timesteps) warm up the order-4 history
and the loop calls the model `n + 9` times. diffusers counts steps taken (not the step index) to pick the
formula; the state keeps that counter too, so a loop that starts mid-schedule (img2img) behaves the same.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import F32, Sampler, select, shape_tuple, spaced_timesteps, state_class
from sdjax.samplers.ddim import add_noise_vp

# Formula selected per step (from the counter): PLMS warm-up and Adams-Bashforth orders, then RK4 stages.
_FIRST, _AVERAGE, _AB2, _AB3, _AB4, _RK0, _RK1, _RK2, _RK3 = range(9)
_PRK_CALLS = 12


@state_class
class PNDMState:
    alphas_cumprod: jax.Array  # (T,)
    final_alpha_cumprod: jax.Array  # ()
    timesteps: jax.Array  # (N,) the values fed to the UNet
    alpha_t: jax.Array | None = None  # (N,) alpha_bar of the timestep the step moves from
    alpha_prev: jax.Array | None = None  # (N,) alpha_bar of the timestep the step moves to
    alpha_t_corr: jax.Array | None = None  # (N,) the same for the PLMS correction step (counter == 1)
    alpha_prev_corr: jax.Array | None = None
    counter: jax.Array | None = None  # () steps taken since set_timesteps
    ets: jax.Array | None = None  # (4, *shape) past model outputs, newest last
    cur_sample: jax.Array | None = None  # (*shape) the sample a multi-call step started from
    cur_model_output: jax.Array | None = None  # (*shape) running RK4 sum


@dataclasses.dataclass(frozen=True)
class PNDM(Sampler):
    """diffusers `PNDMScheduler` (prediction types epsilon and v_prediction, as diffusers)."""

    skip_prk_steps: bool = False
    set_alpha_to_one: bool = False

    diffusers_class = "PNDMScheduler"
    choices = {"prediction_type": ("epsilon", "v_prediction")}

    def check_steps(self, num_inference_steps: int) -> None:
        if not self.skip_prk_steps and num_inference_steps < 4:
            raise ValueError(
                f"PNDM with skip_prk_steps=False (the Runge-Kutta warm-up over the last 4 grid points) needs "
                f"num_inference_steps >= 4, got {num_inference_steps}"
            )

    @property
    def _final_alpha_cumprod(self) -> np.float32:
        return F32(1.0) if self.set_alpha_to_one else self.alphas_cumprod[0]

    _state_class = PNDMState
    _ready_field = "ets"

    def create_state(self) -> PNDMState:
        T = self.num_train_timesteps
        return PNDMState(
            alphas_cumprod=jnp.asarray(self.alphas_cumprod),
            final_alpha_cumprod=jnp.asarray(self._final_alpha_cumprod),
            timesteps=jnp.arange(T - 1, -1, -1, dtype=jnp.float32),
        )

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        T = self.num_train_timesteps
        grid = spaced_timesteps(self.timestep_spacing, n, T, self.steps_offset, kind="int")[::-1]  # ascending
        ratio = T // n
        if self.skip_prk_steps:
            # [t_{n-1}, t_{n-2}, t_{n-2}, t_{n-3}, ..., t_0]: the second call repeats the timestep.
            timesteps = np.concatenate([grid[:-1], grid[-2:-1], grid[-1:]])[::-1].astype(np.int64)
            counters = np.arange(len(timesteps))
            t_from = np.where(counters == 1, timesteps + ratio, timesteps)
            t_to = np.where(counters == 1, timesteps, timesteps - ratio)
        else:
            # RK4 over the last four grid points at half steps, then PLMS over the rest.
            half = ratio // 2
            prk = np.repeat(grid[-4:], 2) + np.tile(np.array([0, half]), 4)
            prk = np.repeat(prk[:-1], 2)[1:-1][::-1]
            plms = grid[:-3][::-1]
            timesteps = np.concatenate([prk, plms]).astype(np.int64)
            counters = np.arange(len(timesteps))
            in_prk = counters < len(prk)
            group_start = timesteps[np.minimum(counters // 4 * 4, len(prk) - 1)]
            t_from = np.where(in_prk, group_start, timesteps)
            t_to = np.where(in_prk, timesteps - np.where(counters % 2 == 1, 0, half), timesteps - ratio)
        # What a correction step (counter 1) at index i would use, for loops that start mid-schedule.
        t_from_corr, t_to_corr = timesteps + ratio, timesteps
        ac, final = self.alphas_cumprod, self._final_alpha_cumprod

        def alpha(t):
            return np.where(t >= 0, ac[np.clip(t, 0, T - 1)], final).astype(F32)

        return {
            "timesteps": timesteps.astype(F32),
            "alpha_t": alpha(t_from),
            "alpha_prev": alpha(t_to),
            "alpha_t_corr": alpha(t_from_corr),
            "alpha_prev_corr": alpha(t_to_corr),
        }

    def set_timesteps(self, state: PNDMState, num_inference_steps: int, shape) -> PNDMState:
        self._checked(state, PNDMState, "set_timesteps")
        shape = shape_tuple(shape)
        tables = {k: jnp.asarray(v) for k, v in self._tables(num_inference_steps).items()}
        base = self.create_state()
        zeros = jnp.zeros(shape, jnp.float32)
        return PNDMState(
            alphas_cumprod=base.alphas_cumprod,
            final_alpha_cumprod=base.final_alpha_cumprod,
            counter=jnp.zeros((), jnp.float32),
            ets=jnp.zeros((4,) + shape, jnp.float32),
            cur_sample=zeros,
            cur_model_output=zeros,
            **tables,
        )

    def init_noise_sigma(self, state: PNDMState) -> jax.Array:
        return jnp.float32(1.0)

    def scale_model_input(self, state: PNDMState, sample: jax.Array, step_index) -> jax.Array:
        return sample

    def _formula(self, counter: jax.Array) -> jax.Array:
        if self.skip_prk_steps:
            return jnp.minimum(counter, _AB4)
        return jnp.where(counter < _PRK_CALLS, _RK0 + counter % 4, _AB4)

    def step(self, state: PNDMState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, PNDMState, "step", ready="ets")
        x = sample.astype(jnp.float32)
        m = model_output.astype(jnp.float32)
        counter = state.counter.astype(jnp.int32)
        formula = self._formula(counter)

        # History: every call but the PLMS correction and the RK4 stages 1-3 adds its output.
        pushes = (formula == _FIRST) | (formula == _AB2) | (formula == _AB3) | (formula == _AB4) | (formula == _RK0)
        ets = jnp.where(pushes, jnp.concatenate([state.ets[1:], m[None]]), state.ets)
        e1, e2, e3, e4 = ets[3], ets[2], ets[1], ets[0]
        cmo = state.cur_model_output
        candidates = [
            m,  # _FIRST
            (m + e1) / 2,  # _AVERAGE
            (3 * e1 - e2) / 2,  # _AB2
            (23 * e1 - 16 * e2 + 5 * e3) / 12,  # _AB3
            (1 / 24) * (55 * e1 - 59 * e2 + 37 * e3 - 9 * e4),  # _AB4
            m,
            m,
            m,  # _RK0.._RK2
            cmo + (1 / 6) * m,  # _RK3
        ]
        combined = select(formula, candidates)
        cmo = select(
            jnp.clip(formula - _AB4, 0, 4),
            [cmo, (1 / 6) * m, cmo + (1 / 3) * m, cmo + (1 / 3) * m, jnp.zeros_like(cmo)],
        )
        starts = (formula == _FIRST) | (formula == _RK0)
        cur_sample = jnp.where(starts, x, state.cur_sample)
        from_sample = jnp.where((formula == _AVERAGE) | (formula >= _RK0), cur_sample, x)

        correction = formula == _AVERAGE
        a_t = jnp.where(correction, state.alpha_t_corr[step_index], state.alpha_t[step_index])
        a_prev = jnp.where(correction, state.alpha_prev_corr[step_index], state.alpha_prev[step_index])
        prev = self._transfer(from_sample, combined, a_t, a_prev)
        new_state = dataclasses.replace(
            state, counter=state.counter + 1, ets=ets, cur_sample=cur_sample, cur_model_output=cmo
        )
        return prev.astype(sample.dtype), new_state

    def _transfer(self, sample, model_output, a_t, a_prev):
        """PNDM's transfer function phi (eq. 9): x_t -> x_prev given the noise estimate."""
        beta_t, beta_prev = 1 - a_t, 1 - a_prev
        if self.prediction_type == "v_prediction":
            model_output = a_t**0.5 * model_output + beta_t**0.5 * sample
        sample_coeff = (a_prev / a_t) ** 0.5
        denom = a_t * beta_prev**0.5 + (a_t * beta_t * a_prev) ** 0.5
        return sample_coeff * sample - (a_prev - a_t) * model_output / denom

    def add_noise(self, state: PNDMState, original: jax.Array, noise: jax.Array, timesteps) -> jax.Array:
        state = self._checked(state, PNDMState, "add_noise")
        return add_noise_vp(state.alphas_cumprod, original, noise, timesteps)
