"""DPM-Solver++ (stochastic, "DPM++ SDE"): k-diffusion's `sample_dpmpp_sde` (Lu et al. 2022, "DPM-Solver++",
with Karras et al.'s ancestral noise split), mirroring diffusers' `DPMSolverSDEScheduler` (A1111 "DPM++ SDE"),
and a virtual Brownian tree in JAX for its noise.

Each step from sigma to sigma_next calls the model twice: at sigma, then at the midpoint in t = -log sigma
(sigma_mid = sqrt(sigma sigma_next)); each stage is a first-order DPM-Solver++ step to the ancestral sigma_down
of its target plus noise of std sigma_up. As in diffusers the stages are interleaved in the schedule (timesteps
t_0, t_mid_0, t_1, t_mid_1, ..., `2n - 1` model calls) and the state remembers the stage and the sample the step
started from. The last step, to sigma = 0, is an Euler step.

The noise of a stage is the increment of one Brownian motion W(sigma) over the stage's sigma interval, divided
by the square root of its length (k-diffusion's `BrownianTreeNoiseSampler`): the two stages of a step share the
increment over [sigma_mid, sigma], so their noises are correlated, and the result does not depend on how the
interval is cut. `draw_noise` evaluates W with `brownian_value`, a virtual Brownian tree (Li et al. 2020,
"Scalable Gradients for Stochastic Differential Equations", sec. 4, torchsde's `BrownianInterval`): W at any
point is found by bisecting the domain from the root, drawing each midpoint from the Brownian bridge between its
ends with a key derived from the image's key and the node -- nothing is stored, every draw is reproducible, and
the whole evaluation is a fixed-depth `fori_loop` that jits. It cannot equal torchsde's numbers (another random
generator); parity with diffusers is tested with injected noise, the tree by its statistics.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sdjax import rng
from sdjax.samplers.common import (
    ANY,
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

# Stream folded into an image's key for its Brownian tree (beside sdjax.rng's streams, which stay below 2^21).
BROWNIAN_TREE = 1 << 21
# Bisection levels: in the domain's unit coordinate a leaf is 2^-24 wide, float32's resolution near 1; W between
# the two ends of a leaf is interpolated linearly (its bridge std there is below 3e-4 sqrt(domain length)).
TREE_DEPTH = 24


def brownian_value(key: jax.Array, t: jax.Array, t0: jax.Array, t1: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """W(t) of a Brownian motion on [t0, t1] with W(t0) = 0 (float32 array of `shape`), a pure function of `key`:
    W(t1) ~ N(0, t1 - t0), then `TREE_DEPTH` bisections, each midpoint drawn from the Brownian bridge between the
    current ends (mean their average, variance a quarter of the interval) with the key of its node."""
    t0, t1 = jnp.asarray(t0, jnp.float32), jnp.asarray(t1, jnp.float32)
    span = t1 - t0
    u = jnp.clip((jnp.asarray(t, jnp.float32) - t0) / span, 0.0, 1.0)  # position in the unit interval
    w_end = jnp.sqrt(span) * jax.random.normal(jax.random.fold_in(key, 0), shape, jnp.float32)

    def bisect(level, carry):
        lo, hi, w_lo, w_hi, node = carry
        mid = (lo + hi) / 2
        z = jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, level + 1), node), shape, jnp.float32)
        w_mid = (w_lo + w_hi) / 2 + jnp.sqrt(span * (hi - lo)) / 2 * z
        left = u < mid
        return (
            jnp.where(left, lo, mid),
            jnp.where(left, mid, hi),
            jnp.where(left, w_lo, w_mid),
            jnp.where(left, w_mid, w_hi),
            node * 2 + jnp.where(left, 0, 1).astype(jnp.uint32),
        )

    start = (jnp.float32(0), jnp.float32(1), jnp.zeros(shape, jnp.float32), w_end, jnp.uint32(1))
    lo, hi, w_lo, w_hi, _ = jax.lax.fori_loop(0, TREE_DEPTH, bisect, start)
    return w_lo + (u - lo) / (hi - lo) * (w_hi - w_lo)


def brownian_noise(
    keys: jax.Array, sigma_from: jax.Array, sigma_to: jax.Array, sigma_min, sigma_max, shape: tuple[int, ...]
) -> jax.Array:
    """(W(sigma_to) - W(sigma_from)) / sqrt(|sigma_to - sigma_from|) per image, W the Brownian tree of each
    image's key on [sigma_min, sigma_max] (k-diffusion's `BrownianTreeNoiseSampler(sigma_from, sigma_to)`):
    standard normal for one interval, consistent across intervals."""
    keys = rng.as_key_array(keys)

    def one(key):
        tree = jax.random.fold_in(key, BROWNIAN_TREE)
        w_to = brownian_value(tree, sigma_to, sigma_min, sigma_max, shape)
        w_from = brownian_value(tree, sigma_from, sigma_min, sigma_max, shape)
        return (w_to - w_from) / jnp.sqrt(jnp.abs(sigma_to - sigma_from))

    return jax.vmap(one)(keys)


@state_class
class DPMSolverSDEState:
    alphas_cumprod: jax.Array  # (T,)
    sigmas: jax.Array  # (2n,) interleaved: s_0, s_1, s_1, ..., s_{n-1}, s_{n-1}, 0
    timesteps: jax.Array  # (2n - 1,) t_0, t_mid_0, t_1, t_mid_1, ..., t_{n-1}
    second: jax.Array | None = None  # () 1 when the next call is the midpoint stage of a step
    sample: jax.Array | None = None  # (*shape) the sample the step started from


def _t(sigma):
    return -jnp.log(sigma)


def _sigma(t):
    return jnp.exp(-t)


@dataclasses.dataclass(frozen=True)
class DPMSolverSDE(_SigmaSampler):
    """diffusers `DPMSolverSDEScheduler`. `s_noise` (diffusers' `step` argument) scales the noise; the
    config's `noise_sampler_seed` is not used (the tree is keyed by each image's key)."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    timestep_spacing: str = "linspace"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    s_noise: float = 1.0

    diffusers_class = "DPMSolverSDEScheduler"
    order = 2
    options = ("s_noise",)
    unused_keys = {"noise_sampler_seed": ANY}
    choices = {
        "prediction_type": ("epsilon", "v_prediction"),
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }
    _state_class = DPMSolverSDEState
    _ready_field = "second"

    @property
    def stochastic(self) -> bool:
        return True

    def create_state(self) -> DPMSolverSDEState:
        base = super().create_state()
        return DPMSolverSDEState(alphas_cumprod=base.alphas_cumprod, sigmas=base.sigmas, timesteps=base.timesteps)

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:
        timesteps, sigmas, log_sigmas = sigma_space_schedule(self, n, round_karras=False, float64=True)
        # The midpoint stage's timestep: sigma_mid = exp(-(t_i + t_{i+1}) / 2) of consecutive sigmas.
        t = -np.log(sigmas)
        midpoints = sigma_to_t(np.exp(-(t[:-1] + np.diff(t) * 0.5)), log_sigmas)
        calls = interleave(np.asarray(timesteps, dtype=np.float64), keep_last=True)[:-1]
        calls[1::2] = midpoints
        return {
            "timesteps": calls.astype(F32),
            "sigmas": interleave(np.concatenate([sigmas, [0.0]]).astype(F32), keep_last=False),
        }

    def set_timesteps(self, state: DPMSolverSDEState, num_inference_steps: int, shape) -> DPMSolverSDEState:
        self._checked(state, DPMSolverSDEState, "set_timesteps")
        tables = self._tables(num_inference_steps)
        return DPMSolverSDEState(
            alphas_cumprod=jnp.asarray(self._sigma_alphas_cumprod()),
            sigmas=jnp.asarray(tables["sigmas"]),
            timesteps=jnp.asarray(tables["timesteps"]),
            second=jnp.zeros((), jnp.float32),
            sample=jnp.zeros(shape_tuple(shape), jnp.float32),
        )

    def _stage(self, state: DPMSolverSDEState, step_index):
        """(first stage?, sigma, sigma_next, sigma of the midpoint) of model call `step_index`."""
        first = state.second == 0
        sig = state.sigmas
        sigma = jnp.where(first, sig[step_index], sig[step_index - 1])
        sigma_next = jnp.where(first, sig[step_index + 1], sig[step_index])
        t = _t(sigma)
        sigma_mid = _sigma(t + (_t(sigma_next) - t) * 0.5)
        return first, sigma, sigma_next, sigma_mid

    def scale_model_input(self, state: DPMSolverSDEState, sample: jax.Array, step_index) -> jax.Array:
        state = self._checked(state, DPMSolverSDEState, "scale_model_input", ready="second")
        first, _, _, sigma_mid = self._stage(state, step_index)
        sigma = jnp.where(first, state.sigmas[step_index], sigma_mid)
        return (sample.astype(jnp.float32) / (sigma**2 + 1) ** 0.5).astype(sample.dtype)

    def noise_interval(self, state: DPMSolverSDEState, step_index) -> tuple[jax.Array, jax.Array]:
        """The sigma interval whose Brownian increment is the noise of model call `step_index`: [sigma, sigma_mid]
        for the first stage, [sigma, sigma_next] for the second (equal ends, hence no noise, on the last step)."""
        state = self._checked(state, DPMSolverSDEState, "noise_interval", ready="second")
        first, sigma, sigma_next, sigma_mid = self._stage(state, step_index)
        # As diffusers asks its noise sampler: both ends through t = -log sigma and back.
        sigma_from = _sigma(_t(sigma))
        sigma_to = jnp.where(sigma_next == 0, sigma_from, jnp.where(first, sigma_mid, _sigma(_t(sigma_next))))
        return sigma_from, sigma_to

    def draw_noise(self, keys: jax.Array, step_index, state: DPMSolverSDEState, sample_shape) -> jax.Array:
        """The normalised Brownian-tree increment over this call's sigma interval, one tree per image key on
        [smallest positive sigma, largest sigma] of the schedule (as diffusers builds its noise sampler). On the
        last step (no noise) zeros."""
        shape = shape_tuple(sample_shape)
        keys = rng.as_key_array(keys)
        if keys.shape[0] != shape[0]:
            raise ValueError(f"draw_noise: {keys.shape[0]} keys for a batch of {shape[0]} (sample_shape {shape})")
        state = self._checked(state, DPMSolverSDEState, "draw_noise", ready="second")
        sig = state.sigmas
        sigma_min = jnp.min(jnp.where(sig > 0, sig, jnp.inf))
        sigma_max = jnp.max(sig)
        sigma_from, sigma_to = self.noise_interval(state, step_index)
        noise = brownian_noise(
            keys,
            sigma_from,
            jnp.where(sigma_to == sigma_from, sigma_from * 0.5, sigma_to),
            sigma_min,
            sigma_max,
            shape[1:],
        )
        return jnp.where(sigma_to == sigma_from, 0.0, noise)

    def step(self, state: DPMSolverSDEState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        noise = require_noise("DPMSolverSDE", noise, sample)
        state = self._checked(state, DPMSolverSDEState, "step", ready="second")
        x = sample.astype(jnp.float32)
        first, sigma, sigma_next, sigma_mid = self._stage(state, step_index)
        x0 = sigma_space_x0(
            self.prediction_type, model_output.astype(jnp.float32), x, jnp.where(first, sigma, sigma_mid)
        )
        # Last step (sigma_next = 0): Euler to 0.
        euler = x + (x - x0) / sigma * (sigma_next - sigma)
        # A first-order DPM-Solver++ step to the ancestral sigma_down of the stage's target, plus sigma_up noise.
        base = jnp.where(first, x, state.sample)
        t = _t(sigma)
        sigma_to = jnp.where(first, sigma_mid, sigma_next)
        sigma_from = _sigma(t)
        sigma_up = jnp.minimum(sigma_to, (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5)
        sigma_down = ancestral_down(sigma_from, sigma_to, sigma_up, jnp)
        t_down = _t(sigma_down)
        dpm = (_sigma(t_down) / _sigma(t)) * base - jnp.expm1(t - t_down) * x0
        dpm = dpm + noise * self.s_noise * sigma_up
        last = sigma_next == 0
        prev = jnp.where(last, euler, dpm)
        new_state = dataclasses.replace(
            state,
            second=jnp.where(last, state.second, jnp.where(first, 1.0, 0.0)).astype(jnp.float32),
            sample=jnp.where(first & ~last, x, state.sample),
        )
        return prev.astype(sample.dtype), new_state
