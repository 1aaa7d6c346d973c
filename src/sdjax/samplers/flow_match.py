"""Flow-matching samplers (rectified flow: Liu et al. 2022, "Flow Straight and Fast"; Esser et al. 2024, "Scaling
Rectified Flow Transformers for High-Resolution Image Synthesis", SD 3), mirroring diffusers'
`FlowMatchEulerDiscreteScheduler` (Stable Diffusion 3/3.5, Flux.1) and `FlowMatchHeunDiscreteScheduler`, plus the
shifting helpers that DPM-Solver++ and UniPC share for their `use_flow_sigmas` mode.

The sample is x_sigma = (1 - sigma) x0 + sigma eps with sigma from 1 (noise) down to 0; the model predicts the
velocity v = eps - x0 and is fed t = sigma * num_train_timesteps. Euler is x + (sigma_next - sigma) v; nothing scales
the model input, the initial noise has unit scale, and img2img noises with diffusers' `scale_noise`:
sigma eps + (1 - sigma) x0 at the sigma of the first model call.

The sigma grid before shifting (`sigma_grid`, a runtime option, not a config key: in diffusers it is what the pipeline
passes to `set_timesteps`):
- "scheduler": diffusers' own `set_timesteps(n)`: t = linspace(sigma_max T, sigma_min T, n), sigma = t / T, where
  sigma_max/sigma_min are the ends of the training schedule, already shifted when the shift is static (so the static
  shift applies twice at the low end, as in diffusers). What the SD 3/3.5 pipelines use.
- "flux": what `FluxPipeline` (and its img2img/inpaint/fill/control siblings) passes: sigmas = linspace(1, 1/n, n)
  (float32), then shifted.

Then the shift: `use_dynamic_shifting` takes mu from the latent shape as the Flux and SD 3 pipelines compute it
(`image_seq_len = (h // 2) * (w // 2)` of the unpacked latent `(B, C, h, w)`, then `calculate_shift`), and applies
diffusers' `time_shift` ("exponential": e^mu / (e^mu + 1/sigma - 1), or "linear"); otherwise the static
shift * sigma / (1 + (shift - 1) sigma). Then `shift_terminal` stretches the grid to end there, and a
`use_*_sigmas` key replaces it by a Karras/exponential/beta schedule between its ends. The arithmetic follows
diffusers' dtypes: float32 for the "flux" grid and the training schedule, float64 for the "scheduler" grid, rounded
to float32 at the end; sigmas and timesteps equal diffusers' to the bit (checked in tests/samplers/test_flow_match.py).

Schedules that depend on the latent shape (`use_dynamic_shifting`) need it: `set_timesteps(state, n, shape)` gets it,
and `timesteps_for(n, shape)` without it raises.

`FlowMatchHeun` is diffusers' `FlowMatchHeunDiscreteScheduler` (its config keys are `num_train_timesteps` and
`shift`), extended with the schedule keys of the Euler class (dynamic shifting, `shift_terminal`, Karras/exponential/
beta sigmas, `sigma_grid`): diffusers' Heun has no `mu`, so `FluxPipeline` cannot run it at all; sdjax runs it on
Flux's own schedule. Its two stages interleave in the schedule as in `sdjax.samplers.heun`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import ConfigError
from sdjax.samplers.common import (
    F32,
    PREDICTION_TYPES,
    Sampler,
    convert_sigmas,
    require_noise,
    shape_tuple,
    state_class,
)
from sdjax.samplers.heun import interleave

SIGMA_GRIDS = ("scheduler", "flux")
TIME_SHIFT_TYPES = ("exponential", "linear")
# The pipelines' defaults for the dynamic-shift keys (`scheduler.config.get(key, default)` in FluxPipeline and
# StableDiffusion3Pipeline): a DPM-Solver/UniPC config swapped from a Flux config keeps them as hidden keys.
SHIFT_DEFAULTS = (("base_image_seq_len", 256), ("max_image_seq_len", 4096), ("base_shift", 0.5), ("max_shift", 1.15))
# Keys of the variance-preserving (DDPM) noise schedule: a flow sampler swapped onto such a config would sample an
# epsilon/v model as if it predicted a velocity.
VP_SCHEDULE_KEYS = ("beta_schedule", "beta_start", "beta_end", "trained_betas")


# ----------------------------------------------------------------------------------------------- shifting
def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """mu of the resolution-dependent shift: linear in the image's token count through (base_seq_len, base_shift)
    and (max_seq_len, max_shift) (diffusers' `calculate_shift` of the Flux and SD 3 pipelines, Python floats)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def image_seq_len(shape) -> int:
    """Tokens of an unpacked latent `(B, C, h, w)` in 2x2 patches (Flux packs them; SD 3's patch size is 2)."""
    shape = shape_tuple(shape)
    if len(shape) != 4:
        raise ValueError(f"the latent shape must be (B, C, h, w), got {shape}")
    return (shape[2] // 2) * (shape[3] // 2)


def _setting(sampler: Sampler, key: str, default: Any) -> Any:
    """A config value as the pipelines read it: the sampler's own key, else the key it keeps from the config it
    was swapped from (diffusers' hidden config), else the pipeline's default."""
    if key in sampler.config_keys():
        return getattr(sampler, key)
    return dict(sampler.hidden).get(key, default)


def dynamic_mu(sampler: Sampler, shape) -> float | None:
    """mu for `shape` if `sampler` shifts its flow sigmas by resolution (`use_dynamic_shifting`), else None."""
    flow = getattr(sampler, "use_flow_sigmas", True)  # the FlowMatch classes have no such key: always flow
    if not (getattr(sampler, "use_dynamic_shifting", False) and flow):
        return None
    if shape is None:
        raise ValueError(
            f"{type(sampler).__name__} has use_dynamic_shifting=True: its schedule depends on the latent shape "
            "(mu from the image's token count, as the Flux and SD 3 pipelines compute it); pass shape=(B, C, h, w)"
        )
    return calculate_shift(image_seq_len(shape), *(_setting(sampler, k, d) for k, d in SHIFT_DEFAULTS))


def time_shift(kind: str, mu: float, sigmas: np.ndarray) -> np.ndarray:
    """diffusers' `time_shift(mu, 1.0, sigmas)`, in the dtype of `sigmas`."""
    if kind == "exponential":
        return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
    return mu / (mu + (1 / sigmas - 1) ** 1.0)


def static_shift(shift: float, sigmas: np.ndarray) -> np.ndarray:
    """shift * sigma / (1 + (shift - 1) sigma) (SD 3's resolution-independent shift), in the dtype of `sigmas`."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def stretch_to_terminal(sigmas: np.ndarray, shift_terminal: float) -> np.ndarray:
    """diffusers' `stretch_shift_to_terminal`: 1 - sigma scaled so that the last sigma is `shift_terminal`."""
    one_minus_z = 1 - sigmas
    scale_factor = one_minus_z[-1] / (1 - shift_terminal)
    return 1 - (one_minus_z / scale_factor)


# ------------------------------------------------------------------------------------------------ tables
def check_terminal_steps(sampler: Sampler, num_inference_steps: int) -> None:
    """`shift_terminal` stretches 1 - sigma by its last value: one step divides 0 by 0 (diffusers: NaN sigmas)."""
    if getattr(sampler, "shift_terminal", None) and num_inference_steps < 2:
        raise ValueError(
            f"{type(sampler).__name__} with shift_terminal={sampler.shift_terminal} needs at least 2 steps "
            f"(got {num_inference_steps})"
        )


def checked_steps(sampler: Sampler, num_inference_steps: int) -> int:
    """The step count as an int, after the checks `Sampler._tables` makes (for schedules cached with a mu)."""
    n = int(num_inference_steps)
    if n != num_inference_steps or n < 1:
        raise ValueError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}")
    if n > sampler.num_train_timesteps:
        raise ValueError(f"num_inference_steps={n} exceeds num_train_timesteps={sampler.num_train_timesteps}")
    sampler.check_steps(n)
    return n


def shaped_tables(sampler: Sampler, num_inference_steps: int, shape=None) -> dict[str, np.ndarray]:
    """The schedule tables of `sampler._make_tables(n, mu)` for this latent shape (mu from `dynamic_mu`), cached."""
    n = checked_steps(sampler, num_inference_steps)
    return _cached_tables(sampler, n, dynamic_mu(sampler, shape))


@functools.lru_cache(maxsize=256)
def _cached_tables(sampler: Sampler, n: int, mu: float | None) -> dict[str, np.ndarray]:
    out = {}
    for key, value in sampler._make_tables(n, mu).items():
        value = np.asarray(value)
        value.setflags(write=False)
        out[key] = value
    return out


def check_flow_options(sampler: Sampler) -> None:
    """The `use_flow_sigmas` rules of DPM-Solver++ and UniPC: a flow prediction needs flow sigmas (diffusers would
    take x0 = x - sigma v on a variance-preserving sample), flow sigmas exclude the Karras/exponential/beta keys
    (diffusers would build those from the VP training sigmas and read them as flow sigmas), and DPM-Solver's
    resolution shift is exponential (diffusers asserts it when the pipeline passes mu)."""
    name = type(sampler).__name__
    flow = sampler.use_flow_sigmas
    if sampler.prediction_type == "flow_prediction" and not flow:
        raise ConfigError(f"{name}: prediction_type='flow_prediction' needs use_flow_sigmas=True")
    if flow and sampler.prediction_type == "sample":
        raise ConfigError(f"{name}: use_flow_sigmas=True with prediction_type='sample' is not supported")
    chosen = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas") if getattr(sampler, k)]
    if flow and chosen:
        raise ConfigError(f"{name}: use_flow_sigmas=True and {chosen[0]}=True are exclusive (pick one sigma schedule)")
    shift_type = _setting(sampler, "time_shift_type", "exponential")
    own = "time_shift_type" in sampler.config_keys()  # UniPC applies either; DPM-Solver sets flow_shift = e^mu
    if flow and sampler.use_dynamic_shifting and not own and shift_type != "exponential":
        raise ConfigError(f"{name}: use_dynamic_shifting needs time_shift_type='exponential', got {shift_type!r}")


def check_flow_config(raw: dict[str, Any], source: str) -> None:
    """Refuse a config of a variance-preserving (epsilon/v) model for a flow sampler: its beta schedule or prediction
    type would be dropped silently (diffusers' swap does drop them) and the model sampled as if it were a flow model.
    A config that says it is a flow model (`use_flow_sigmas`, `prediction_type="flow_prediction"`) passes."""
    if raw.get("use_flow_sigmas") or raw.get("prediction_type") == "flow_prediction":
        return
    vp = [k for k in VP_SCHEDULE_KEYS if raw.get(k) is not None]
    if raw.get("prediction_type") in PREDICTION_TYPES:
        vp.append("prediction_type")
    if vp:
        raise ConfigError(
            f"{source}: {', '.join(f'{k}={raw[k]!r}' for k in vp)} describe a variance-preserving (DDPM-family) "
            "model; flow-matching samplers sample flow models (Flux, SD 3) only"
        )


# ------------------------------------------------------------------------------------------------ samplers
@state_class
class FlowState:
    sigmas: jax.Array  # (N + 1,) sigma at each model call, then the final one (0; 1 with invert_sigmas)
    timesteps: jax.Array  # (N,) sigma * num_train_timesteps: the values fed to the model


@state_class
class FlowHeunState:
    sigmas: jax.Array  # (2n,) interleaved: s_0, s_1, s_1, ..., s_{n-1}, s_{n-1}, 0
    timesteps: jax.Array  # (2n - 1,) t_0, t_1, t_1, ..., t_{n-1}, t_{n-1}
    second: jax.Array | None = None  # () 1 when the next call is the correction stage of a step
    prev_derivative: jax.Array | None = None  # (*shape) the first stage's slope
    dt: jax.Array | None = None  # () the step size sigma_next - sigma
    sample: jax.Array | None = None  # (*shape) the sample the step started from


@dataclasses.dataclass(frozen=True)
class _FlowSampler(Sampler):
    """What both flow-matching samplers share: the shifted sigma schedule, no input scaling, unit initial noise and
    diffusers' `scale_noise`."""

    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float | None = 0.5
    max_shift: float | None = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    shift_terminal: float | None = None
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    time_shift_type: str = "exponential"
    prediction_type: str = "flow_prediction"  # the model predicts the velocity (not a config key of these classes)
    sigma_grid: str = "scheduler"  # runtime option (see the module docstring)

    options = ("sigma_grid",)
    not_keys = ("beta_start", "beta_end", "beta_schedule", "trained_betas", "prediction_type", "timestep_spacing",
                "steps_offset")  # fmt: skip
    # A1111's sigma schedules apply (Karras, Exponential, Beta; Uniform/Normal: the grid itself); its spacing
    # schedules do not (`sdjax.samplers.schedules`).
    fixed_spacing = "linspace"
    choices = {
        "prediction_type": ("flow_prediction",),
        "time_shift_type": TIME_SHIFT_TYPES,
        "sigma_grid": SIGMA_GRIDS,
        "use_karras_sigmas": (False, True, None),
        "use_exponential_sigmas": (False, True, None),
        "use_beta_sigmas": (False, True, None),
    }

    @classmethod
    def from_config(cls, raw: dict[str, Any], *, source: str | None = None, **options):
        check_flow_config(raw, source or f"{cls.diffusers_class} config")
        return super().from_config(raw, source=source, **options)

    # ---------------------------------------------------------------------------------------------- schedule
    def check_steps(self, num_inference_steps: int) -> None:
        check_terminal_steps(self, num_inference_steps)

    def _train_sigma_range(self) -> tuple[float, float]:
        """(sigma_max, sigma_min) of the training schedule as diffusers' constructor builds it (float32; shifted
        unless the shift is dynamic)."""
        T = self.num_train_timesteps
        sigmas = np.linspace(1, T, T, dtype=F32)[::-1] / T
        if not self.use_dynamic_shifting:
            sigmas = static_shift(self.shift, sigmas)
        return float(sigmas[0]), float(sigmas[-1])

    def _sigmas(self, n: int, mu: float | None) -> np.ndarray:
        """The `n` sigmas of the model calls, float32 (diffusers' `set_timesteps` before the final sigma)."""
        T = self.num_train_timesteps
        if self.sigma_grid == "flux":
            sigmas = np.linspace(1.0, 1 / n, n).astype(F32)
        else:
            sigma_max, sigma_min = self._train_sigma_range()
            sigmas = np.linspace(sigma_max * T, sigma_min * T, n) / T
        if self.use_dynamic_shifting:
            sigmas = time_shift(self.time_shift_type, mu, sigmas)
        else:
            sigmas = static_shift(self.shift, sigmas)
        if self.shift_terminal:
            sigmas = stretch_to_terminal(sigmas, self.shift_terminal)
        converted = convert_sigmas(self, sigmas, n)
        return np.asarray(sigmas if converted is None else converted).astype(F32)

    def _tables(self, num_inference_steps: int, shape=None) -> dict[str, np.ndarray]:
        return shaped_tables(self, num_inference_steps, shape)

    def timesteps_for(self, num_inference_steps: int, shape=None) -> np.ndarray:
        """The values fed to the model, one per model call, float32 (diffusers' `scheduler.timesteps`); `shape` (the
        latent's) is needed with `use_dynamic_shifting`."""
        return np.array(self._tables(num_inference_steps, shape)["timesteps"], dtype=F32)

    def set_timesteps(self, state, num_inference_steps: int, shape=None):
        self._checked(state, self._state_class, "set_timesteps")
        tables = self._tables(num_inference_steps, shape)
        return self._state_class(sigmas=jnp.asarray(tables["sigmas"]), timesteps=jnp.asarray(tables["timesteps"]))

    def create_state(self):
        """The training schedule (diffusers' constructor): sigmas (T,), timesteps sigma * T."""
        T = self.num_train_timesteps
        sigmas = np.linspace(1, T, T, dtype=F32)[::-1] / T
        if not self.use_dynamic_shifting:
            sigmas = static_shift(self.shift, sigmas)
        return self._state_class(sigmas=jnp.asarray(sigmas), timesteps=jnp.asarray(sigmas * F32(T)))

    # ------------------------------------------------------------------------------- what the loop calls
    def init_noise_sigma(self, state) -> jax.Array:
        return jnp.float32(1.0)

    def scale_model_input(self, state, sample: jax.Array, step_index) -> jax.Array:
        return sample

    def add_noise_at(self, state, original: jax.Array, noise: jax.Array, index) -> jax.Array:
        """sigma eps + (1 - sigma) x0 at the sigma of model call `index` (diffusers' `scale_noise` after
        `set_begin_index(index)`). `index == num_model_calls` is the final sigma (0: `original` itself)."""
        state = self._checked(state, self._state_class, "add_noise_at", ready=self._ready_field)
        sigma = state.sigmas[jnp.asarray(index, jnp.int32)]
        x0 = original.astype(jnp.float32)
        return (sigma * noise.astype(jnp.float32) + (1.0 - sigma) * x0).astype(original.dtype)


@dataclasses.dataclass(frozen=True)
class FlowMatchEuler(_FlowSampler):
    """diffusers `FlowMatchEulerDiscreteScheduler` (no churn; `stochastic_sampling` re-noises x0 to the next sigma
    with fresh noise)."""

    invert_sigmas: bool = False
    stochastic_sampling: bool = False

    diffusers_class = "FlowMatchEulerDiscreteScheduler"
    _state_class = FlowState

    @property
    def stochastic(self) -> bool:
        return bool(self.stochastic_sampling)

    def num_model_calls(self, num_inference_steps: int) -> int:
        return checked_steps(self, num_inference_steps)

    def _make_tables(self, n: int, mu: float | None = None) -> dict[str, np.ndarray]:
        T = F32(self.num_train_timesteps)
        sigmas = self._sigmas(n, mu)
        timesteps = sigmas * T
        final = F32(0)
        if self.invert_sigmas:
            sigmas = F32(1) - sigmas
            timesteps = sigmas * T
            final = F32(1)
        return {"timesteps": timesteps, "sigmas": np.concatenate([sigmas, [final]]).astype(F32)}

    def step(self, state: FlowState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        noise = require_noise("FlowMatchEuler", noise, sample) if self.stochastic else None
        state = self._checked(state, FlowState, "step")
        x = sample.astype(jnp.float32)
        v = model_output.astype(jnp.float32)
        sigma, sigma_next = state.sigmas[step_index], state.sigmas[step_index + 1]
        if self.stochastic:
            x0 = x - sigma * v
            prev = (1.0 - sigma_next) * x0 + sigma_next * noise
        else:
            prev = x + (sigma_next - sigma) * v
        return prev.astype(sample.dtype), state


@dataclasses.dataclass(frozen=True)
class FlowMatchHeun(_FlowSampler):
    """diffusers `FlowMatchHeunDiscreteScheduler` (no churn), with the Euler class's schedule keys (module
    docstring). The last step, to sigma 0, is a plain Euler step."""

    diffusers_class = "FlowMatchHeunDiscreteScheduler"
    order = 2
    unused_keys = {"invert_sigmas": (False, None), "stochastic_sampling": (False, None)}
    _state_class = FlowHeunState
    _ready_field = "second"

    def num_model_calls(self, num_inference_steps: int) -> int:
        return 2 * checked_steps(self, num_inference_steps) - 1

    def _make_tables(self, n: int, mu: float | None = None) -> dict[str, np.ndarray]:
        sigmas = self._sigmas(n, mu)
        timesteps = sigmas * F32(self.num_train_timesteps)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(F32)
        return {"timesteps": interleave(timesteps, keep_last=True)[:-1], "sigmas": interleave(sigmas, keep_last=False)}

    def set_timesteps(self, state, num_inference_steps: int, shape=None) -> FlowHeunState:
        if shape is None:
            raise ValueError("FlowMatchHeun.set_timesteps needs the sample's shape (its state holds a sample)")
        base = super().set_timesteps(state, num_inference_steps, shape)
        zeros = jnp.zeros(shape_tuple(shape), jnp.float32)
        return dataclasses.replace(
            base, second=jnp.zeros((), jnp.float32), prev_derivative=zeros, dt=jnp.zeros((), jnp.float32), sample=zeros
        )

    def step(self, state: FlowHeunState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        state = self._checked(state, FlowHeunState, "step", ready="second")
        x = sample.astype(jnp.float32)
        v = model_output.astype(jnp.float32)
        first = state.second == 0
        sig = state.sigmas
        sigma = jnp.where(first, sig[step_index], sig[step_index - 1])
        sigma_next = jnp.where(first, sig[step_index + 1], sig[step_index])
        # First stage: an Euler step, remembering its slope, step size and start (diffusers' arithmetic: the slope
        # is (x - x0) / sigma with x0 = x - v sigma).
        slope = (x - (x - v * sigma)) / sigma
        dt = sigma_next - sigma
        euler = x + slope * dt
        # Second stage: the average of the two slopes, from the start of the step.
        averaged = 0.5 * (state.prev_derivative + (x - (x - v * sigma_next)) / sigma_next)
        heun = state.sample + averaged * state.dt
        prev = jnp.where(first, euler, heun)
        new_state = dataclasses.replace(
            state,
            second=jnp.where(first, 1.0, 0.0).astype(jnp.float32),
            prev_derivative=jnp.where(first, slope, state.prev_derivative),
            dt=jnp.where(first, dt, state.dt),
            sample=jnp.where(first, x, state.sample),
        )
        return prev.astype(sample.dtype), new_state
