"""DPM-Solver++ multistep (Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion
Probabilistic Models", Algorithm 2) and its SDE variant, mirroring diffusers' `DPMSolverMultistepScheduler`
with `algorithm_type` "dpmsolver++" (A1111 "DPM++ 2M", "DPM++ 2M Karras") or "sde-dpmsolver++"
("DPM++ 2M SDE"), `solver_type` midpoint or heun, `solver_order` 1-3.

Updates are written in lambda = log(alpha_t / sigma_t) with h = lambda_next - lambda_now on data predictions
x0; the history of x0 predictions and the number of lower-order warm-up steps taken (`lower_order_nums`) live
in the state. The last step drops to first order when `final_sigmas_type="zero"` (its lambda is infinite),
with `euler_at_final`, or with `lower_order_final` below 15 steps -- exactly diffusers' rules.

Flow models (Flux, SD 3): `use_flow_sigmas=True` with `prediction_type="flow_prediction"` and `flow_shift` (diffusers'
keys) run the same solver on the rectified-flow path x = (1 - sigma) x0 + sigma eps: alpha_t = 1 - sigma,
sigma_t = sigma, x0 = x - sigma v. The sigmas are diffusers' flow grid, shift(1 - linspace(1, 1/T, n + 1)) reversed
without its final 0, and the model is fed int(sigma T). With `use_dynamic_shifting` the shift is e^mu, mu from the
latent shape as the Flux pipeline computes it (`sdjax.samplers.flow_match.dynamic_mu`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.samplers.common import (
    ANY,
    F32,
    PREDICTION_TYPES,
    Sampler,
    alpha_sigma_x0,
    convert_sigmas,
    match_step_index,
    per_sample,
    push,
    require_noise,
    select,
    shape_tuple,
    sigma_to_t,
    state_class,
    train_sigmas,
)
from sdjax.samplers.euler import _zero_snr_alphas_cumprod
from sdjax.samplers.flow_match import check_flow_options, checked_steps, shaped_tables


@state_class
class DPMSolverState:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (N + 1,)
    timesteps: jax.Array  # (N,) integers, as float32
    model_outputs: jax.Array | None = None  # (solver_order, *shape) past x0 predictions, newest last
    lower_order_nums: jax.Array | None = None  # () warm-up steps taken (capped at solver_order)


def _alpha_sigma(sigma):
    """VP coefficients of a k-diffusion sigma: alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma alpha_t."""
    alpha_t = 1 / (sigma**2 + 1) ** 0.5
    return alpha_t, sigma * alpha_t


def _lambda(alpha_t, sigma_t):
    return jnp.log(alpha_t) - jnp.log(sigma_t)


def lambda_clipped_end(alphas_cumprod: np.ndarray, lambda_min_clipped: float) -> int:
    """One past the last training timestep whose half-log-SNR lambda is at least `lambda_min_clipped` (diffusers
    cuts the timesteps below it from the top of the grid; it matters for the cosine schedule)."""
    ac = alphas_cumprod
    lambdas = np.log(np.sqrt(ac)) - np.log(np.sqrt(F32(1) - ac))
    return len(ac) - int(np.searchsorted(lambdas[::-1], lambda_min_clipped, side="left"))


class VPSigmaSampler(Sampler):
    """What the DPM-Solver family shares (multistep, singlestep, UniPC, DEIS): the sample is in the variance-
    preserving parameterisation (unscaled model input, unit initial noise), the schedule is kept as k-diffusion
    sigmas, and noise is added as alpha_t x0 + sigma_t eps with alpha_t = 1 / sqrt(sigma^2 + 1)."""

    def init_noise_sigma(self, state) -> jax.Array:
        return jnp.float32(1.0)

    def alpha_sigma(self, sigma):
        """(alpha_t, sigma_t) of a schedule sigma: 1 - sigma and sigma with flow sigmas (`use_flow_sigmas`), else
        the VP coefficients of a k-diffusion sigma."""
        if getattr(self, "use_flow_sigmas", False):
            return 1 - sigma, sigma
        return _alpha_sigma(sigma)

    def x0_from(self, model_output, sample, sigma):
        """The data prediction of a model output at schedule sigma (a flow prediction: x - sigma v)."""
        if self.prediction_type == "flow_prediction":
            return sample - sigma * model_output
        return alpha_sigma_x0(self.prediction_type, model_output, sample, *self.alpha_sigma(sigma))

    def scale_model_input(self, state, sample: jax.Array, step_index) -> jax.Array:
        return sample

    def add_noise_at(self, state, original: jax.Array, noise: jax.Array, index) -> jax.Array:
        """alpha_t x0 + sigma_t eps at the sigma of model call `index` (diffusers' `add_noise` after
        `set_begin_index`). `index == num_model_calls` is the final sigma (0: `original` itself)."""
        state = self._checked(state, self._state_class, "add_noise_at", ready=self._ready_field)
        alpha_t, sigma_t = self.alpha_sigma(state.sigmas[jnp.asarray(index, jnp.int32)])
        x0 = original.astype(jnp.float32)
        return (alpha_t * x0 + sigma_t * noise.astype(jnp.float32)).astype(original.dtype)

    def add_noise(self, state, original: jax.Array, noise: jax.Array, timesteps) -> jax.Array:
        """alpha_t x0 + sigma_t eps at the step whose timestep equals `timesteps` (diffusers' lookup: the second
        match if a value repeats, the last step if none matches)."""
        state = self._checked(state, self._state_class, "add_noise")
        index, _ = match_step_index(state.timesteps, timesteps, missing=state.timesteps.shape[0] - 1)
        alpha_t, sigma_t = self.alpha_sigma(state.sigmas[index])
        x0 = original.astype(jnp.float32)
        out = per_sample(alpha_t, x0.ndim) * x0 + per_sample(sigma_t, x0.ndim) * noise.astype(jnp.float32)
        return out.astype(original.dtype)


@dataclasses.dataclass(frozen=True)
class DPMSolverMultistep(VPSigmaSampler):
    """diffusers `DPMSolverMultistepScheduler` (data-prediction algorithms only)."""

    timestep_spacing: str = "linspace"
    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -float("inf")
    rescale_betas_zero_snr: bool = False
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0
    use_dynamic_shifting: bool = False

    diffusers_class = "DPMSolverMultistepScheduler"
    _state_class = DPMSolverState
    _ready_field = "model_outputs"
    value_aliases = {
        "algorithm_type": {"deis": "dpmsolver++"},
        "solver_type": {"logrho": "midpoint", "bh1": "midpoint", "bh2": "midpoint"},
    }
    unused_keys = {
        "thresholding": (False,),
        "dynamic_thresholding_ratio": ANY,
        "sample_max_value": ANY,
        "use_lu_lambdas": (False, None),
        "variance_type": (None,),
        "time_shift_type": ANY,  # "exponential" is required with dynamic flow shifting (check_flow_options)
    }
    choices = {
        "prediction_type": (*PREDICTION_TYPES, "flow_prediction"),
        "solver_order": (1, 2, 3),
        "algorithm_type": ("dpmsolver++", "sde-dpmsolver++"),
        "solver_type": ("midpoint", "heun"),
        "final_sigmas_type": ("zero", "sigma_min"),
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }

    def __post_init__(self):
        super().__post_init__()
        check_flow_options(self)

    @property
    def stochastic(self) -> bool:
        return self.algorithm_type == "sde-dpmsolver++"

    def _tables(self, num_inference_steps: int, shape=None) -> dict[str, np.ndarray]:
        return shaped_tables(self, num_inference_steps, shape)

    def num_model_calls(self, num_inference_steps: int) -> int:
        if self.use_flow_sigmas:  # n calls whatever the shift (which may need the latent shape)
            return checked_steps(self, num_inference_steps)
        return super().num_model_calls(num_inference_steps)

    def timesteps_for(self, num_inference_steps: int, shape=None) -> np.ndarray:
        """diffusers' `scheduler.timesteps` (float32); `shape` (the latent's) is needed with dynamic flow shifting."""
        return np.array(self._tables(num_inference_steps, shape)["timesteps"], dtype=F32)

    def _sigma_alphas_cumprod(self) -> np.ndarray:
        ac = self.alphas_cumprod
        return _zero_snr_alphas_cumprod(ac) if self.rescale_betas_zero_snr else ac

    def create_state(self) -> DPMSolverState:
        T = self.num_train_timesteps
        return DPMSolverState(
            alphas_cumprod=jnp.asarray(self._sigma_alphas_cumprod()),
            sigmas=jnp.asarray(train_sigmas(self._sigma_alphas_cumprod())),
            timesteps=jnp.asarray(np.linspace(0, T - 1, T, dtype=F32)[::-1].copy()),
        )

    def _make_tables(self, n: int, mu: float | None = None) -> dict[str, np.ndarray]:
        T = self.num_train_timesteps
        ac = self._sigma_alphas_cumprod()
        last = lambda_clipped_end(ac, self.lambda_min_clipped)
        if self.timestep_spacing == "linspace":
            timesteps = np.linspace(0, last - 1, n + 1).round()[::-1][:-1].astype(np.int64)
        elif self.timestep_spacing == "leading":
            ratio = last // (n + 1)
            timesteps = (np.arange(0, n + 1) * ratio).round()[::-1][:-1].astype(np.int64) + self.steps_offset
        else:
            timesteps = np.arange(last, 0, -T / n).round().astype(np.int64) - 1
        sigmas = train_sigmas(ac)
        log_sigmas = np.log(sigmas)
        converted = convert_sigmas(self, sigmas[::-1], n)
        if converted is not None:
            sigmas = converted
            t = sigma_to_t(sigmas, log_sigmas)
            if self.use_karras_sigmas and self.beta_schedule != "squaredcos_cap_v2":
                t = t.round()
            timesteps = t.astype(np.int64)  # truncation, as diffusers' cast to int64
        elif self.use_flow_sigmas:  # with a dynamic shift, diffusers sets flow_shift = e^mu
            shift = self.flow_shift if mu is None else np.exp(mu)
            sigmas = 1.0 - np.linspace(1, 1 / T, n + 1)
            sigmas = np.flip(shift * sigmas / (1 + (shift - 1) * sigmas))[:-1].copy()
            timesteps = (sigmas * T).astype(np.int64)
        else:
            sigmas = np.interp(timesteps, np.arange(len(sigmas)), sigmas)
        last_sigma = np.sqrt((F32(1) - ac[0]) / ac[0]) if self.final_sigmas_type == "sigma_min" else 0.0
        return {"timesteps": timesteps.astype(F32), "sigmas": np.concatenate([sigmas, [last_sigma]]).astype(F32)}

    def set_timesteps(self, state: DPMSolverState, num_inference_steps: int, shape) -> DPMSolverState:
        self._checked(state, DPMSolverState, "set_timesteps")
        tables = self._tables(num_inference_steps, shape)
        return DPMSolverState(
            alphas_cumprod=jnp.asarray(self._sigma_alphas_cumprod()),
            sigmas=jnp.asarray(tables["sigmas"]),
            timesteps=jnp.asarray(tables["timesteps"]),
            model_outputs=jnp.zeros((self.solver_order,) + shape_tuple(shape), jnp.float32),
            lower_order_nums=jnp.zeros((), jnp.float32),
        )

    def _order(self, step_index, num_steps: int, lower_order_nums) -> jax.Array:
        """The solver order diffusers uses at this step (1, 2 or 3)."""
        final = (step_index == num_steps - 1) & (
            self.euler_at_final or (self.lower_order_final and num_steps < 15) or self.final_sigmas_type == "zero"
        )
        second = (step_index == num_steps - 2) & (self.lower_order_final and num_steps < 15)
        if self.solver_order == 1:
            return jnp.int32(1)
        first = (lower_order_nums < 1) | final
        if self.solver_order == 2:
            return jnp.where(first, 1, 2).astype(jnp.int32)
        return jnp.where(first, 1, jnp.where((lower_order_nums < 2) | second, 2, 3)).astype(jnp.int32)

    def step(self, state: DPMSolverState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, DPMSolverState, "step", ready="model_outputs")
        sde = self.stochastic
        noise = require_noise("DPM++ SDE", noise, sample) if sde else None
        x = sample.astype(jnp.float32)
        num_steps = state.timesteps.shape[0]
        order = self._order(step_index, num_steps, state.lower_order_nums)

        sig = state.sigmas
        alpha_s0, sigma_s0 = self.alpha_sigma(sig[step_index])
        x0 = self.x0_from(model_output.astype(jnp.float32), x, sig[step_index])
        outputs = push(state.model_outputs, x0)

        alpha_t, sigma_t = self.alpha_sigma(sig[step_index + 1])
        lambda_t, lambda_s0 = _lambda(alpha_t, sigma_t), _lambda(alpha_s0, sigma_s0)
        h = lambda_t - lambda_s0

        def lambda_back(k):  # lambda of the sigma k steps back
            return _lambda(*self.alpha_sigma(sig[jnp.maximum(step_index - k, 0)]))

        def first_order():
            if sde:
                return (
                    sigma_t / sigma_s0 * jnp.exp(-h) * x
                    + alpha_t * (1 - jnp.exp(-2.0 * h)) * x0
                    + sigma_t * jnp.sqrt(1.0 - jnp.exp(-2 * h)) * noise
                )
            return sigma_t / sigma_s0 * x - alpha_t * (jnp.exp(-h) - 1.0) * x0

        def second_order():
            m0, m1 = outputs[-1], outputs[-2]
            r0 = (lambda_s0 - lambda_back(1)) / h
            d0, d1 = m0, 1.0 / r0 * (m0 - m1)
            if sde:
                out = sigma_t / sigma_s0 * jnp.exp(-h) * x + alpha_t * (1 - jnp.exp(-2.0 * h)) * d0
                if self.solver_type == "midpoint":
                    out = out + 0.5 * (alpha_t * (1 - jnp.exp(-2.0 * h))) * d1
                else:
                    out = out + alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0) * d1
                return out + sigma_t * jnp.sqrt(1.0 - jnp.exp(-2 * h)) * noise
            out = sigma_t / sigma_s0 * x - alpha_t * (jnp.exp(-h) - 1.0) * d0
            if self.solver_type == "midpoint":
                return out - 0.5 * (alpha_t * (jnp.exp(-h) - 1.0)) * d1
            return out + alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0) * d1

        def third_order():
            m0, m1, m2 = outputs[-1], outputs[-2], outputs[-3]
            lambda_s1, lambda_s2 = lambda_back(1), lambda_back(2)
            r0, r1 = (lambda_s0 - lambda_s1) / h, (lambda_s1 - lambda_s2) / h
            d1_0, d1_1 = 1.0 / r0 * (m0 - m1), 1.0 / r1 * (m1 - m2)
            d1 = d1_0 + r0 / (r0 + r1) * (d1_0 - d1_1)
            d2 = 1.0 / (r0 + r1) * (d1_0 - d1_1)
            if sde:
                return (
                    sigma_t / sigma_s0 * jnp.exp(-h) * x
                    + alpha_t * (1.0 - jnp.exp(-2.0 * h)) * m0
                    + alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0) * d1
                    + alpha_t * ((1.0 - jnp.exp(-2.0 * h) - 2.0 * h) / (2.0 * h) ** 2 - 0.5) * d2
                    + sigma_t * jnp.sqrt(1.0 - jnp.exp(-2 * h)) * noise
                )
            return (
                sigma_t / sigma_s0 * x
                - alpha_t * (jnp.exp(-h) - 1.0) * m0
                + alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0) * d1
                - alpha_t * ((jnp.exp(-h) - 1.0 + h) / h**2 - 0.5) * d2
            )

        updates = [first_order, second_order, third_order][: self.solver_order]
        prev = select(order - 1, [update() for update in updates])
        lower = jnp.minimum(state.lower_order_nums + 1, self.solver_order)
        new_state = dataclasses.replace(state, model_outputs=outputs, lower_order_nums=lower)
        return prev.astype(sample.dtype), new_state
