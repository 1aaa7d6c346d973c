"""UniPC (Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of Diffusion
Models"), mirroring diffusers' `UniPCMultistepScheduler` (B(h) variants bh1 and bh2, orders 1-3, data or noise
prediction). AUTOMATIC1111's "UniPC" is this method with its own defaults (bh1, order 3).

Every step first corrects the sample the previous step predicted (UniC, using the model output just computed at
it), then predicts the next one (UniP, a multistep update over the last `order` model outputs); the order warms
up from 1 and, with `lower_order_final`, drops again on the last steps. The coefficients rho solve small linear
systems in the ratios of lambda = log(alpha / sigma) steps, computed per step in float32 as diffusers does. The
state keeps the output history, the warm-up count, the last predicted sample and the order that predicted it.

Two deliberate differences, both on a last step to sigma = 0 where diffusers returns NaN: with
`solver_type="bh1"` it multiplies an infinite B(h) by a zero residual, and with `predict_x0=False` it multiplies
sigma_t = 0 by an infinite e^h - 1. sdjax drops the zero term and takes the limit of the update (the x0
prediction), which is finite.

Flow models (Flux, SD 3): `use_flow_sigmas=True` with `prediction_type="flow_prediction"` (diffusers' keys; data
prediction only) run on the rectified-flow path: alpha_t = 1 - sigma, sigma_t = sigma, x0 = x - sigma v; the sigmas
are linspace(1, 1/T, n + 1) without its last point, shifted by `flow_shift` or, with `use_dynamic_shifting`, by
diffusers' `time_shift` with mu from the latent shape (`sdjax.samplers.flow_match.dynamic_mu`), stretched to
`shift_terminal`, the first moved 1e-6 below 1 (diffusers': its log would be infinite); the model is fed int(sigma T).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import ConfigError
from sdjax.samplers.common import (
    ANY,
    F32,
    PREDICTION_TYPES,
    convert_sigmas,
    push,
    select,
    shape_tuple,
    sigma_to_t,
    spaced_timesteps,
    state_class,
    train_sigmas,
)
from sdjax.samplers.dpm_solver import VPSigmaSampler, _lambda
from sdjax.samplers.euler import _zero_snr_alphas_cumprod
from sdjax.samplers.flow_match import (
    TIME_SHIFT_TYPES,
    check_flow_options,
    check_terminal_steps,
    checked_steps,
    shaped_tables,
    static_shift,
    stretch_to_terminal,
    time_shift,
)


@state_class
class UniPCState:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (N + 1,)
    timesteps: jax.Array  # (N,) integers, as float32
    corrector: jax.Array | None = None  # (N,) 1 where the corrector runs at that step (not disabled)
    model_outputs: jax.Array | None = None  # (solver_order, *shape) converted outputs, newest last
    lower_order_nums: jax.Array | None = None  # () warm-up steps taken (capped at solver_order)
    last_sample: jax.Array | None = None  # (*shape) the sample the previous step predicted from
    has_last: jax.Array | None = None  # () 1 once a step has run since set_timesteps
    this_order: jax.Array | None = None  # () the order of the previous step's predictor


def multistep_spaced(spacing: str, n: int, T: int, steps_offset: int) -> np.ndarray:
    """The integer timestep grid of diffusers' multistep solvers (UniPC, DEIS): `n + 1` points for linspace and
    leading with the last dropped, trailing as elsewhere."""
    if spacing == "linspace":
        return np.linspace(0, T - 1, n + 1).round()[::-1][:-1].astype(np.int64)
    if spacing == "leading":
        ratio = T // (n + 1)
        return (np.arange(0, n + 1) * ratio).round()[::-1][:-1].astype(np.int64) + steps_offset
    return spaced_timesteps(spacing, n, T, steps_offset, kind="int")


def _b_coefficients(hh, b_h, order: int) -> list:
    """b_i = h phi_{i}(hh) i! / B(h), i = 1..order (the right-hand side of UniPC's order conditions)."""
    h_phi_k = jnp.expm1(hh) / hh - 1
    factorial = 1
    out = []
    for i in range(1, order + 1):
        out.append(h_phi_k * factorial / b_h)
        factorial *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return out


@dataclasses.dataclass(frozen=True)
class UniPC(VPSigmaSampler):
    """diffusers `UniPCMultistepScheduler` (no `solver_p`, no thresholding; flow sigmas without Karras)."""

    timestep_spacing: str = "linspace"
    solver_order: int = 2
    predict_x0: bool = True
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    final_sigmas_type: str = "zero"
    rescale_betas_zero_snr: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None

    diffusers_class = "UniPCMultistepScheduler"
    value_aliases = {"solver_type": {"midpoint": "bh2", "heun": "bh2", "logrho": "bh2"}}
    unused_keys = {
        "thresholding": (False,),
        "dynamic_thresholding_ratio": ANY,
        "sample_max_value": ANY,
        "solver_p": (None,),
    }
    choices = {
        "prediction_type": (*PREDICTION_TYPES, "flow_prediction"),
        "time_shift_type": TIME_SHIFT_TYPES,
        "solver_order": (1, 2, 3),
        "solver_type": ("bh1", "bh2"),
        "final_sigmas_type": ("zero", "sigma_min"),
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }
    _state_class = UniPCState
    _ready_field = "model_outputs"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.disable_corrector, tuple):
            object.__setattr__(self, "disable_corrector", tuple(int(i) for i in self.disable_corrector))
        check_flow_options(self)
        if self.shift_terminal is not None and not self.use_flow_sigmas:
            raise ConfigError("UniPC: shift_terminal is only supported with use_flow_sigmas=True")
        if self.prediction_type == "flow_prediction" and not self.predict_x0:
            raise ConfigError("UniPC: prediction_type='flow_prediction' needs predict_x0=True (data prediction)")

    def check_steps(self, num_inference_steps: int) -> None:
        if self.use_flow_sigmas:
            check_terminal_steps(self, num_inference_steps)

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

    def create_state(self) -> UniPCState:
        T = self.num_train_timesteps
        ac = self._sigma_alphas_cumprod()
        return UniPCState(
            alphas_cumprod=jnp.asarray(ac),
            sigmas=jnp.asarray(train_sigmas(ac)),
            timesteps=jnp.asarray(np.linspace(0, T - 1, T, dtype=F32)[::-1].copy()),
        )

    def _flow_sigmas(self, n: int, mu: float | None) -> np.ndarray:
        """The `n` flow sigmas of the model calls, float64 (diffusers' `use_flow_sigmas` branch)."""
        sigmas = np.linspace(1, 1 / self.num_train_timesteps, n + 1)[:-1]
        if self.use_dynamic_shifting:
            sigmas = time_shift(self.time_shift_type, mu, sigmas)
        else:
            sigmas = static_shift(self.flow_shift, sigmas)
        if self.shift_terminal:
            sigmas = stretch_to_terminal(sigmas, self.shift_terminal)
        sigmas = np.array(sigmas, dtype=np.float64)
        if np.fabs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6
        return sigmas

    def _make_tables(self, n: int, mu: float | None = None) -> dict[str, np.ndarray]:
        ac = self._sigma_alphas_cumprod()
        timesteps = multistep_spaced(self.timestep_spacing, n, self.num_train_timesteps, self.steps_offset)
        sigmas = train_sigmas(ac)
        log_sigmas = np.log(sigmas)
        converted = convert_sigmas(self, sigmas[::-1], n)
        if self.use_flow_sigmas:
            flow = self._flow_sigmas(n, mu)
            timesteps = (flow * self.num_train_timesteps).astype(np.int64)  # truncation, as diffusers' cast
            sigmas = np.concatenate([flow, [flow[-1] if self.final_sigmas_type == "sigma_min" else 0.0]])
        elif converted is not None:
            t = sigma_to_t(converted, log_sigmas)
            timesteps = (t.round() if self.use_karras_sigmas else t).astype(np.int64)
            last = converted[-1] if self.final_sigmas_type == "sigma_min" else 0.0
            sigmas = np.concatenate([converted, [last]])
        else:
            sigmas = np.interp(timesteps, np.arange(len(sigmas)), sigmas)
            last = np.sqrt((F32(1) - ac[0]) / ac[0]) if self.final_sigmas_type == "sigma_min" else 0.0
            sigmas = np.concatenate([sigmas, [last]])
        steps = np.arange(len(timesteps))
        corrector = ~np.isin(steps - 1, np.asarray(self.disable_corrector, dtype=np.int64))
        return {
            "timesteps": timesteps.astype(F32),
            "sigmas": sigmas.astype(F32),
            "corrector": corrector.astype(F32),
        }

    def set_timesteps(self, state: UniPCState, num_inference_steps: int, shape) -> UniPCState:
        self._checked(state, UniPCState, "set_timesteps")
        tables = {k: jnp.asarray(v) for k, v in self._tables(num_inference_steps, shape).items()}
        shape = shape_tuple(shape)
        zero = jnp.zeros((), jnp.float32)
        return UniPCState(
            alphas_cumprod=jnp.asarray(self._sigma_alphas_cumprod()),
            model_outputs=jnp.zeros((self.solver_order,) + shape, jnp.float32),
            lower_order_nums=zero,
            last_sample=jnp.zeros(shape, jnp.float32),
            has_last=zero,
            this_order=zero,
            **tables,
        )

    # ------------------------------------------------------------------------------------------- update
    def _convert(self, model_output, sample, sigma):
        alpha_t, sigma_t = self.alpha_sigma(sigma)
        x0 = self.x0_from(model_output, sample, sigma)
        if self.predict_x0:
            return x0
        if self.prediction_type == "epsilon":
            return model_output
        return (sample - alpha_t * x0) / sigma_t

    def _bh(self, sig, to_index, from_index):
        """(alpha_t, sigma_t, alpha_s0, sigma_s0, h, hh, expm1(hh), B(h)) of the update from sigma[from] to
        sigma[to]."""
        alpha_t, sigma_t = self.alpha_sigma(sig[to_index])
        alpha_s0, sigma_s0 = self.alpha_sigma(sig[from_index])
        h = _lambda(alpha_t, sigma_t) - _lambda(alpha_s0, sigma_s0)
        hh = -h if self.predict_x0 else h
        h_phi_1 = jnp.expm1(hh)
        b_h = hh if self.solver_type == "bh1" else jnp.expm1(hh)
        return alpha_t, sigma_t, alpha_s0, sigma_s0, h, hh, h_phi_1, b_h

    def _base(self, x, m0, alpha_t, sigma_t, alpha_s0, sigma_s0, h_phi_1):
        if self.predict_x0:
            return sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
        # sigma_t (e^h - 1) -> alpha_t sigma_s / alpha_s as sigma_t -> 0 (diffusers: 0 * inf = NaN there).
        scale = jnp.where(sigma_t == 0, alpha_t * sigma_s0 / alpha_s0, sigma_t * h_phi_1)
        return alpha_t / alpha_s0 * x - scale * m0

    def _residual(self, alpha_t, sigma_t, b_h, res):
        return (alpha_t if self.predict_x0 else sigma_t) * b_h * res

    def _rks(self, sig, anchor, order, h, outputs, m0):
        """rk = (lambda_{anchor - i - offset} - lambda_anchor) / h and D1_i = (m_i - m0) / rk, i = 1..order-1."""
        rks, d1s = [], []
        lambda_anchor = _lambda(*self.alpha_sigma(sig[anchor]))
        for i in range(1, order):
            a, s = self.alpha_sigma(sig[jnp.maximum(anchor - i, 0)])
            rk = (_lambda(a, s) - lambda_anchor) / h
            rks.append(rk)
            d1s.append((outputs[-(i + 1)] - m0) / rk)
        return rks, d1s

    def _predict(self, outputs, x, step_index, order: int, sig):
        """UniP-B(h) of the given (static) order: x at sigma[k] -> sigma[k + 1]."""
        alpha_t, sigma_t, alpha_s0, sigma_s0, h, hh, h_phi_1, b_h = self._bh(sig, step_index + 1, step_index)
        m0 = outputs[-1]
        x_t = self._base(x, m0, alpha_t, sigma_t, alpha_s0, sigma_s0, h_phi_1)
        if order == 1:  # no residual (diffusers multiplies B(h) by a zero, NaN for bh1 at a zero final sigma)
            return x_t
        rks, d1s = self._rks(sig, step_index, order, h, outputs, m0)
        if order == 2:
            rhos = [jnp.float32(0.5)]
        else:
            b = _b_coefficients(hh, b_h, order)
            matrix = jnp.stack([jnp.ones(2), jnp.stack(rks)])
            rhos = list(jnp.linalg.solve(matrix, jnp.stack(b[:2])))
        res = sum(r * d for r, d in zip(rhos, d1s, strict=True))
        return x_t - self._residual(alpha_t, sigma_t, b_h, res)

    def _correct(self, outputs, this_output, last_sample, step_index, order: int, sig):
        """UniC-B(h) of the given (static) order: the sample predicted at sigma[k] from sigma[k - 1], corrected
        with the model output at it."""
        alpha_t, sigma_t, alpha_s0, sigma_s0, h, hh, h_phi_1, b_h = self._bh(sig, step_index, step_index - 1)
        m0 = outputs[-1]
        x_t = self._base(last_sample, m0, alpha_t, sigma_t, alpha_s0, sigma_s0, h_phi_1)
        rks, d1s = self._rks(sig, step_index - 1, order, h, outputs, m0)
        b = _b_coefficients(hh, b_h, order)
        if order == 1:
            rhos = [jnp.float32(0.5)]
        else:
            matrix = jnp.stack([jnp.stack(rks + [jnp.float32(1)]) ** i for i in range(order)])
            rhos = list(jnp.linalg.solve(matrix, jnp.stack(b)))
        res = sum((r * d for r, d in zip(rhos[:-1], d1s, strict=True)), jnp.zeros_like(m0))
        return x_t - self._residual(alpha_t, sigma_t, b_h, res + rhos[-1] * (this_output - m0))

    def step(self, state: UniPCState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, UniPCState, "step", ready="model_outputs")
        x = sample.astype(jnp.float32)
        sig = state.sigmas
        num_steps = state.timesteps.shape[0]
        converted = self._convert(model_output.astype(jnp.float32), x, sig[step_index])

        # UniC: correct the sample the previous step predicted (with the order that predicted it).
        use_corrector = (step_index > 0) & (state.corrector[step_index] > 0) & (state.has_last > 0)
        prev_order = jnp.clip(state.this_order, 1, self.solver_order).astype(jnp.int32)
        corrected = select(
            prev_order - 1,
            [
                self._correct(state.model_outputs, converted, state.last_sample, step_index, p, sig)
                for p in range(1, self.solver_order + 1)
            ],
        )
        x = jnp.where(use_corrector, corrected, x)

        # UniP: predict the next sample.
        outputs = push(state.model_outputs, converted)
        cap = jnp.minimum(self.solver_order, num_steps - step_index) if self.lower_order_final else self.solver_order
        order = jnp.minimum(cap, state.lower_order_nums + 1).astype(jnp.int32)
        prev = select(
            order - 1, [self._predict(outputs, x, step_index, p, sig) for p in range(1, self.solver_order + 1)]
        )
        new_state = dataclasses.replace(
            state,
            model_outputs=outputs,
            lower_order_nums=jnp.minimum(state.lower_order_nums + 1, self.solver_order),
            last_sample=x,
            has_last=jnp.ones((), jnp.float32),
            this_order=order.astype(jnp.float32),
        )
        return prev.astype(sample.dtype), new_state
