"""What every sampler shares: noise schedules in numpy, config validation, and the `Sampler` base class.

A sampler is a frozen, hashable dataclass whose fields are the diffusers `scheduler_config.json` keys it honours;
it is a static argument under `jit`. Everything that depends only on the config and on the (static) number of
inference steps -- betas, timesteps, sigmas, multistep coefficients -- is computed once in numpy (float64 where
diffusers computes in float64, float32 where it computes in float32, so the arrays equal diffusers' to the last
bit or within an ulp) and placed in the state as float32 constants. What changes from step to step -- a step
counter, the history of model outputs -- lives in the state too, so `step` is a pure function that runs inside
`lax.fori_loop` with a traced step index.

The state is a float32 pytree (`params["scheduler"]`). `set_timesteps` rebuilds every schedule array from the
config, so a state that a user cast to bf16 together with the other params comes back exact; every other method
casts the state it gets back to float32 before using it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sdjax import rng
from sdjax.config import BOOKKEEPING_KEYS, ConfigError

F32 = np.float32
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
TIMESTEP_SPACINGS = ("linspace", "leading", "trailing")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")

ANY = object()  # "any value is harmless" in a sampler's table of keys it accepts but does not use

# Every key a diffusers scheduler config of the Karras-compatible family can hold (diffusers 0.42). Real configs
# carry keys of other schedulers (SD 1.5's PNDM config holds `clip_sample: false`, SD 2.1's DDIM config
# `skip_prk_steps: true`). The class they are loaded into does not use them, but diffusers keeps them in its
# `config`, and `X.from_config(config)` passes every key X's constructor takes: so DDIM swapped in on SD 1.5 does
# not clip, and PNDM on SD 2.1 skips the PRK warm-up. sdjax keeps them too (`Sampler.hidden`) for the same reason.
# A key outside this table is reported: it is a scheduler we do not know.
DIFFUSERS_SCHEDULER_KEYS = frozenset(
    {
        "algorithm_type",
        "base_image_seq_len",
        "base_shift",
        "beta_end",
        "beta_schedule",
        "beta_start",
        "clip_sample",
        "clip_sample_range",
        "disable_corrector",
        "dynamic_thresholding_ratio",
        "euler_at_final",
        "final_sigmas_type",
        "flow_shift",
        "interpolation_type",
        "invert_sigmas",
        "lambda_min_clipped",
        "lower_order_final",
        "max_image_seq_len",
        "max_shift",
        "noise_sampler_seed",
        "num_train_timesteps",
        "original_inference_steps",
        "predict_x0",
        "prediction_type",
        "rescale_betas_zero_snr",
        "rho",
        "sample_max_value",
        "set_alpha_to_one",
        "shift",
        "shift_terminal",
        "sigma_data",
        "sigma_max",
        "sigma_min",
        "sigma_schedule",
        "skip_prk_steps",
        "solver_order",
        "solver_p",
        "solver_type",
        "steps_offset",
        "stochastic_sampling",
        "thresholding",
        "time_shift_type",
        "timestep_scaling",
        "timestep_spacing",
        "timestep_type",
        "trained_betas",
        "use_beta_sigmas",
        "use_dynamic_shifting",
        "use_exponential_sigmas",
        "use_flow_sigmas",
        "use_karras_sigmas",
        "use_lu_lambdas",
        "variance_type",
    }
)

# Keys of other schedulers that still define the noise schedule the model was trained with: dropping them
# silently (as diffusers does when swapping) samples a different process, so a sampler without them refuses.
SCHEDULE_DEFINING = {"rescale_betas_zero_snr": (False, None)}


# ----------------------------------------------------------------------------------------------- noise schedule
def betas_for_alpha_bar(num_train_timesteps: int, max_beta: float = 0.999) -> np.ndarray:
    """Cosine schedule (Nichol & Dhariwal 2021, `squaredcos_cap_v2`): betas from alpha_bar(t), float64 math."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    out = [
        min(1 - alpha_bar((i + 1) / num_train_timesteps) / alpha_bar(i / num_train_timesteps), max_beta)
        for i in range(num_train_timesteps)
    ]
    return np.asarray(out, dtype=np.float64).astype(F32)


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Rescale betas so the last timestep has zero SNR (Lin et al. 2023, "Common Diffusion Noise Schedules and
    Sample Steps are Flawed", Algorithm 1). Float32 arithmetic, in diffusers' order."""
    alphas = F32(1) - betas
    sqrt_bar = np.sqrt(cumprod(alphas))
    first, last = sqrt_bar[0], sqrt_bar[-1]
    sqrt_bar = (sqrt_bar - last) * (first / (first - last))
    bar = sqrt_bar * sqrt_bar
    alphas = np.concatenate([bar[:1], bar[1:] / bar[:-1]])
    return (F32(1) - alphas).astype(F32)


def cumprod(x: np.ndarray) -> np.ndarray:
    """Cumulative product of a float32 array accumulated in float64, rounded per element (what torch does on CPU)."""
    return np.cumprod(x.astype(np.float64)).astype(F32)


def linspace_f32(start: float, end: float, n: int) -> np.ndarray:
    """`n` evenly spaced float32 values equal to PyTorch's CPU `torch.linspace(..., dtype=torch.float32)` bit for
    bit: a float32 step, each value one fused multiply-add from the nearer end (the product of a float32 and a
    small integer is exact in float64, so float64 arithmetic rounds like the FMA)."""
    start32, end32 = F32(start), F32(end)
    if n == 1:
        return np.array([start32], dtype=F32)
    step = F32((end32 - start32) / F32(n - 1))
    i = np.arange(n)
    lower = i < n // 2
    k = np.where(lower, i, n - 1 - i).astype(np.float64)
    from_start = np.float64(start32) + np.float64(step) * k
    from_end = np.float64(end32) - np.float64(step) * k
    return np.where(lower, from_start, from_end).astype(F32)


def make_betas(
    num_train_timesteps: int,
    beta_start: float,
    beta_end: float,
    beta_schedule: str,
    trained_betas: tuple[float, ...] | None,
) -> np.ndarray:
    """The float32 betas of a diffusers config (`linear`, `scaled_linear`, `squaredcos_cap_v2` or
    `trained_betas`), equal to diffusers' (float32 torch) to the bit."""
    if trained_betas is not None:
        betas = np.asarray(trained_betas, dtype=F32)
        if betas.shape != (num_train_timesteps,):
            raise ConfigError(f"trained_betas has {betas.size} values, num_train_timesteps is {num_train_timesteps}")
        return betas
    if beta_schedule == "linear":
        return linspace_f32(beta_start, beta_end, num_train_timesteps)
    if beta_schedule == "scaled_linear":
        root = linspace_f32(beta_start**0.5, beta_end**0.5, num_train_timesteps)
        return root * root
    if beta_schedule == "squaredcos_cap_v2":
        return betas_for_alpha_bar(num_train_timesteps)
    raise ConfigError(f"beta_schedule={beta_schedule!r} is not one of {BETA_SCHEDULES}")


def train_sigmas(alphas_cumprod: np.ndarray) -> np.ndarray:
    """k-diffusion sigmas of the training timesteps, sqrt((1 - alpha_bar) / alpha_bar), float32, ascending in t."""
    return np.sqrt((F32(1) - alphas_cumprod) / alphas_cumprod)


# ------------------------------------------------------------------------------------------------ timestep grids
def spaced_timesteps(spacing: str, n: int, num_train_timesteps: int, steps_offset: int, *, kind: str) -> np.ndarray:
    """Descending inference timesteps for `timestep_spacing` (Lin et al. 2023, Table 2), as diffusers makes them.

    `kind="int"` (DDIM, DDPM, PNDM): int64, rounded. `kind="float"` (Euler, LMS): float32, where `linspace`
    keeps fractions; `kind="float64"` (DPM++ SDE) the same in float64. `steps_offset` shifts the `leading` grid only.
    """
    T = num_train_timesteps
    if spacing not in TIMESTEP_SPACINGS:
        raise ConfigError(f"timestep_spacing={spacing!r} is not one of {TIMESTEP_SPACINGS}")
    if kind in ("float", "float64"):
        dtype = F32 if kind == "float" else np.float64
        if spacing == "linspace":
            return np.linspace(0, T - 1, n, dtype=dtype)[::-1].copy()
        if spacing == "leading":
            return (np.arange(0, n) * (T // n)).round()[::-1].astype(dtype) + dtype(steps_offset)
        return np.arange(T, 0, -T / n).round().astype(dtype) - dtype(1)
    if kind == "int":
        if spacing == "linspace":
            return np.linspace(0, T - 1, n).round()[::-1].astype(np.int64)
        if spacing == "leading":
            return (np.arange(0, n) * (T // n)).round()[::-1].astype(np.int64) + steps_offset
        return np.round(np.arange(T, 0, -T / n)).astype(np.int64) - 1
    raise ValueError(f"unknown kind {kind!r}")


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al. 2022 (eq. 5) noise levels: `n` sigmas from `sigma_max` down to `sigma_min`, float64."""
    ramp = np.linspace(0, 1, n)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def exponential_sigmas(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """Log-uniform sigmas from `sigma_max` down to `sigma_min`, float64."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))


def beta_sigmas(sigma_min: float, sigma_max: float, n: int, alpha: float = 0.6, beta: float = 0.6) -> np.ndarray:
    """Sigmas at the quantiles of a Beta(alpha, beta) distribution between `sigma_max` and `sigma_min` (Lee et
    al. 2024, "Beta Sampling is All You Need"; diffusers' `use_beta_sigmas`), float64. scipy (a dependency of
    jax) computes the quantile function, as in diffusers."""
    from scipy import stats

    quantiles = [stats.beta.ppf(q, alpha, beta) for q in 1 - np.linspace(0, 1, n)]
    return np.array([sigma_min + q * (sigma_max - sigma_min) for q in quantiles], dtype=np.float64)


SIGMA_SCHEDULE_KEYS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


def convert_sigmas(sampler, in_sigmas: np.ndarray, n: int) -> np.ndarray | None:
    """The sigma schedule a `use_*_sigmas` key of `sampler` asks for (Karras, exponential or beta), between the
    first and last of `in_sigmas` (or the config's `sigma_max`/`sigma_min` where the class has them), as
    diffusers' `_convert_to_karras` / `_convert_to_exponential` / `_convert_to_beta`; None if none is set."""
    lo = getattr(sampler, "sigma_min", None)
    hi = getattr(sampler, "sigma_max", None)
    lo = float(in_sigmas[-1]) if lo is None else lo
    hi = float(in_sigmas[0]) if hi is None else hi
    if getattr(sampler, "use_karras_sigmas", False):
        return karras_sigmas(lo, hi, n)
    if getattr(sampler, "use_exponential_sigmas", False):
        return exponential_sigmas(lo, hi, n)
    if getattr(sampler, "use_beta_sigmas", False):
        return beta_sigmas(lo, hi, n)
    return None


def sigma_to_t(sigmas: np.ndarray, log_train_sigmas: np.ndarray, dtype=np.float64) -> np.ndarray:
    """Fractional training timestep of each sigma: linear interpolation in log-sigma between the two training
    timesteps around it (clamped to the grid), in float64 (diffusers on numpy sigmas) or float32 (diffusers on
    torch tensors: KDPM2's midpoints)."""
    log_sigma = np.log(np.maximum(np.asarray(sigmas, dtype=dtype), dtype(1e-10)))
    log_train_sigmas = np.asarray(log_train_sigmas, dtype=np.promote_types(log_train_sigmas.dtype, dtype))
    # Index of the last training log-sigma <= log_sigma (log-sigmas ascend with t), kept inside [0, T - 2].
    low = np.clip((log_train_sigmas[:, None] <= log_sigma[None, :]).sum(axis=0) - 1, 0, len(log_train_sigmas) - 2)
    lo, hi = log_train_sigmas[low], log_train_sigmas[low + 1]
    w = np.clip((lo - log_sigma) / (lo - hi), 0, 1).astype(log_sigma.dtype)
    return (1 - w) * low.astype(log_sigma.dtype) + w * (low + 1).astype(log_sigma.dtype)


# ------------------------------------------------------------------------------------------ prediction types
def alpha_space_x0_eps(prediction_type: str, model_output, sample, alpha_prod_t):
    """(x0, eps) from a model output in the variance-preserving parameterisation x = sqrt(a) x0 + sqrt(1 - a) eps."""
    beta_prod_t = 1 - alpha_prod_t
    if prediction_type == "epsilon":
        return (sample - beta_prod_t**0.5 * model_output) / alpha_prod_t**0.5, model_output
    if prediction_type == "sample":
        return model_output, (sample - alpha_prod_t**0.5 * model_output) / beta_prod_t**0.5
    # v-prediction (Salimans & Ho 2022): v = sqrt(a) eps - sqrt(1 - a) x0.
    return (
        alpha_prod_t**0.5 * sample - beta_prod_t**0.5 * model_output,
        alpha_prod_t**0.5 * model_output + beta_prod_t**0.5 * sample,
    )


def ancestral_down(sigma_from, sigma_to, sigma_up, xp):
    """The ancestral step's target sigma_down = sqrt(sigma_to^2 - sigma_up^2), as diffusers computes it, except where
    float32 cancellation leaves that difference <= 0 though sigma_to > 0 (sigma_from >> sigma_to: 2 steps,
    157 -> 0.01, where diffusers' sqrt gives NaN): there the same quantity in its exact form sigma_to^2 / sigma_from
    (eta = 1). `xp` is numpy or jax.numpy."""
    diff = sigma_to**2 - sigma_up**2
    safe = xp.where(diff > 0, diff, 1.0)
    return xp.where(diff > 0, safe**0.5, sigma_to**2 / xp.where(sigma_from > 0, sigma_from, 1.0))


def sigma_space_x0(prediction_type: str, model_output, sample, sigma):
    """x0 from a model output in the variance-exploding (k-diffusion) parameterisation x = x0 + sigma eps, where
    the model saw x / sqrt(sigma^2 + 1)."""
    if prediction_type == "epsilon":
        return sample - sigma * model_output
    if prediction_type == "sample":
        return model_output
    return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1)


def alpha_sigma_x0(prediction_type: str, model_output, sample, alpha_t, sigma_t):
    """x0 from a model output given the VP coefficients x = alpha_t x0 + sigma_t eps (DPM-Solver's form)."""
    if prediction_type == "epsilon":
        return (sample - sigma_t * model_output) / alpha_t
    if prediction_type == "sample":
        return model_output
    return alpha_t * sample - sigma_t * model_output


# ---------------------------------------------------------------------------------------------- jax helpers
def as_float32(state):
    """The state with every leaf float32 (a user may have cast it to bf16 together with the other params)."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), state)


def to_index(t) -> jax.Array:
    """Integer-valued float timesteps -> int32 indices."""
    return jnp.round(jnp.asarray(t, jnp.float32)).astype(jnp.int32)


def per_sample(values: jax.Array, ndim: int) -> jax.Array:
    """Flatten per-sample scalars and add trailing axes to broadcast against an `ndim` array (diffusers' rule)."""
    values = values.reshape(-1)
    return values.reshape(values.shape + (1,) * (ndim - 1))


def push(buffer: jax.Array, value: jax.Array) -> jax.Array:
    """Drop the oldest entry of a history buffer (axis 0, newest last) and append `value`."""
    return jnp.concatenate([buffer[1:], value[None].astype(buffer.dtype)], axis=0)


def match_step_index(schedule_timesteps: jax.Array, timesteps: jax.Array, *, missing: int | None = None):
    """Index of each timestep in the schedule as diffusers finds it: the second match if the value occurs more
    than once, else the first. Returns (index, found). `missing` (if given) is the index used when not found."""
    t = jnp.asarray(timesteps, jnp.float32).reshape(-1)
    eq = schedule_timesteps[None, :] == t[:, None]
    count = eq.sum(axis=1)
    first = jnp.argmax(eq, axis=1)
    after_first = eq & (jnp.arange(eq.shape[1])[None, :] > first[:, None])
    second = jnp.argmax(after_first, axis=1)
    index = jnp.where(count > 1, second, first)
    if missing is not None:
        index = jnp.where(count > 0, index, missing)
    return index, count > 0


def select(index: jax.Array, candidates: list[jax.Array]) -> jax.Array:
    """`candidates[index]` for a traced scalar index, as elementwise selects: every candidate is a few
    elementwise ops on the sample, so computing all of them costs less than a `lax.switch` (and compiles
    faster); a non-finite value in a candidate that is not selected does not leak."""
    out = candidates[-1]
    for k in range(len(candidates) - 2, -1, -1):
        out = jnp.where(index == k, candidates[k], out)
    return out


def require_noise(name: str, noise, sample) -> jax.Array:
    if noise is None:
        raise ValueError(
            f"{name} is stochastic: step() needs `noise`, a standard normal array of the sample's "
            f"shape {tuple(sample.shape)}, drawn by the caller"
        )
    if tuple(noise.shape) != tuple(sample.shape):
        raise ValueError(f"{name}: noise has shape {tuple(noise.shape)}, the sample {tuple(sample.shape)}")
    return jnp.asarray(noise, jnp.float32)


def state_class(cls):
    """A frozen dataclass registered as a pytree whose fields are all data (arrays, or None before
    `set_timesteps`)."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


# ------------------------------------------------------------------------------------------------- base class
@dataclasses.dataclass(frozen=True)
class Sampler:
    """Fields shared by every sampler: exactly the diffusers config keys of the noise schedule.

    Subclasses add their own keys and set `diffusers_class`; `unused_keys` maps keys that the diffusers class
    accepts but this sampler does not implement to the values that are harmless (`ANY`: every value); `choices`
    maps a field to its valid values; `options` names fields that are runtime options, not config keys (DDIM's
    `eta`).
    """

    # Keys of the config this sampler does not use (another scheduler's, or `_use_default_values`): kept so that a
    # sampler swapped in from this one's config gets them, as diffusers' `from_config` does; not part of equality.
    hidden: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), compare=False, repr=False)
    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str = "epsilon"
    timestep_spacing: str = "leading"
    steps_offset: int = 0

    diffusers_class: ClassVar[str] = ""
    # diffusers' `scheduler.order`: model calls per step of the method (2 for Heun and DPM2, whose timesteps
    # interleave the two stages). img2img starts at model call `t_start * order`, as diffusers' pipelines do.
    order: ClassVar[int] = 1
    unused_keys: ClassVar[dict[str, Any]] = {}
    choices: ClassVar[dict[str, tuple]] = {}
    options: ClassVar[tuple[str, ...]] = ()
    # Base fields the mirrored diffusers class has no key for (DPM-Solver singlestep has no timestep spacing):
    # not config keys, so a swapped-in config's value stays hidden instead of pretending to act.
    not_keys: ClassVar[tuple[str, ...]] = ()
    # Values diffusers' constructor rewrites (DEIS turns `algorithm_type="dpmsolver++"` into "deis"), so that a
    # config swapped from a related scheduler builds as it does in diffusers.
    value_aliases: ClassVar[dict[str, dict[Any, Any]]] = {}
    # The timestep grid of a class without a `timestep_spacing` key (DPM-Solver singlestep: linspace), and whether
    # a class ignores the key it has (LCM, TCD: the distillation grid); schedules consult both.
    fixed_spacing: ClassVar[str | None] = None
    ignores_spacing: ClassVar[bool] = False

    # ---------------------------------------------------------------------------------------- construction
    def __post_init__(self):
        for f in dataclasses.fields(self):  # JSON `null` for a boolean switch means off
            if isinstance(f.default, bool) and getattr(self, f.name) is None:
                object.__setattr__(self, f.name, False)
        if self.trained_betas is not None and not isinstance(self.trained_betas, tuple):
            object.__setattr__(self, "trained_betas", tuple(float(b) for b in self.trained_betas))
        for key, mapping in self.value_aliases.items():
            value = getattr(self, key)
            if isinstance(value, str) and value in mapping:
                object.__setattr__(self, key, mapping[value])
        chosen = [k for k in SIGMA_SCHEDULE_KEYS if getattr(self, k, False)]
        if len(chosen) > 1:
            raise ConfigError(f"{type(self).__name__}: {' and '.join(chosen)} are exclusive (pick one sigma schedule)")
        checks = {
            "prediction_type": PREDICTION_TYPES,
            "timestep_spacing": TIMESTEP_SPACINGS,
            "beta_schedule": BETA_SCHEDULES,
            **self.choices,
        }
        for key, valid in checks.items():
            if key == "beta_schedule" and self.trained_betas is not None:
                continue
            value = getattr(self, key)
            if value not in valid:
                raise ConfigError(
                    f"{type(self).__name__}: {key}={value!r} is not supported; expected one of {list(valid)}"
                )
        if int(self.num_train_timesteps) != self.num_train_timesteps or self.num_train_timesteps < 2:
            raise ConfigError(f"{type(self).__name__}: num_train_timesteps={self.num_train_timesteps!r}")

    @classmethod
    def config_keys(cls) -> tuple[str, ...]:
        """The diffusers config keys this sampler honours (its fields minus runtime options)."""
        skip = {"hidden", *cls.options, *cls.not_keys}
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in skip)

    @classmethod
    def diffusers_keys(cls) -> frozenset[str]:
        """Every key of the mirrored diffusers class's config (honoured or known to be harmless)."""
        return frozenset(cls.config_keys()) | frozenset(cls.unused_keys)

    @classmethod
    def from_config(cls, raw: dict[str, Any], *, source: str | None = None, **options):
        """Build from a diffusers `scheduler_config.json` dict (plus runtime `options`, e.g. DDIM's `eta`).

        Bookkeeping keys (`_class_name`, `_diffusers_version`, ...) and keys that belong to other diffusers
        schedulers are ignored, as diffusers does; keys of the mirrored class that this sampler does not
        implement must have their harmless value; any other key raises `ConfigError` naming it.
        """
        source = source or f"{cls.diffusers_class} config"
        fields = set(cls.config_keys())
        kwargs, unknown, hidden = {}, [], {}
        for key, value in raw.items():
            if key.startswith("_") or key in BOOKKEEPING_KEYS:
                continue
            if key not in fields:
                hidden[key] = tuple(value) if isinstance(value, list) else value
            if key in fields:
                kwargs[key] = tuple(value) if isinstance(value, list) else value
            elif key in cls.unused_keys:
                allowed = cls.unused_keys[key]
                if allowed is not ANY and value not in allowed:
                    raise ConfigError(
                        f"{source}: {key}={value!r} is not implemented by sdjax's "
                        f"{cls.diffusers_class} (supported: {list(allowed)})"
                    )
            elif key in SCHEDULE_DEFINING:
                if value not in SCHEDULE_DEFINING[key]:
                    raise ConfigError(
                        f"{source}: {key}={value!r} changes the noise schedule, but "
                        f"{cls.diffusers_class} has no such option; pick a sampler that has it"
                    )
            elif key not in DIFFUSERS_SCHEDULER_KEYS:
                unknown.append(key)
        if unknown:
            raise ConfigError(
                f"{source}: unknown scheduler config key(s) {sorted(unknown)} for "
                f"{cls.diffusers_class} (known keys: {sorted(fields)})"
            )
        bad = sorted(set(options) - set(cls.options))
        if bad:
            raise ConfigError(f"{cls.diffusers_class}: unknown option(s) {bad}; options: {list(cls.options)}")
        # As diffusers' `register_to_config`: the keys left at their defaults, which a swap does not carry over.
        hidden["_use_default_values"] = tuple(sorted(k for k in fields if k not in kwargs))
        try:
            return cls(**kwargs, **options, hidden=tuple(sorted(hidden.items())))
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from e

    @property
    def config(self) -> dict[str, Any]:
        """The diffusers config dict of this sampler (what `scheduler_config.json` would hold): its own keys, and
        the keys of the config it came from that it does not use (as diffusers' `scheduler.config`)."""
        out: dict[str, Any] = {"_class_name": self.diffusers_class}
        out.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.hidden})
        for key in self.config_keys():
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    # ------------------------------------------------------------------------------------------ schedule
    @functools.cached_property
    def _train_schedule(self) -> tuple[np.ndarray, np.ndarray]:
        """(betas, alphas_cumprod), float32 numpy, as diffusers builds them in `__init__`."""
        betas = make_betas(
            self.num_train_timesteps, self.beta_start, self.beta_end, self.beta_schedule, self.trained_betas
        )
        if getattr(self, "rescale_betas_zero_snr", False):
            betas = rescale_zero_terminal_snr(betas)
        alphas_cumprod = cumprod(F32(1) - betas)
        return _readonly(betas), _readonly(alphas_cumprod)

    @property
    def alphas_cumprod(self) -> np.ndarray:
        return self._train_schedule[1]

    def num_model_calls(self, num_inference_steps: int) -> int:
        """How many times the sampling loop calls the model (static: the `fori_loop` length)."""
        return len(self._tables(num_inference_steps)["timesteps"])

    def _tables(self, num_inference_steps: int) -> dict[str, np.ndarray]:
        n = int(num_inference_steps)
        if n != num_inference_steps or n < 1:
            raise ValueError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}")
        if n > self.num_train_timesteps:
            raise ValueError(f"num_inference_steps={n} exceeds num_train_timesteps={self.num_train_timesteps}")
        self.check_steps(n)
        return _cached_tables(self, n)

    def check_steps(self, num_inference_steps: int) -> None:
        """Raise `ValueError` naming the limit if this sampler cannot run `num_inference_steps` steps (PNDM's
        Runge-Kutta warm-up needs 4, LCM at most `original_inference_steps`); the default accepts any."""

    def _make_tables(self, n: int) -> dict[str, np.ndarray]:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def stochastic(self) -> bool:
        """Whether `step` needs `noise` (the pipeline draws it from one key per image)."""
        return False

    # ------------------------------------------------------------------------------- what the loop calls
    def timesteps_for(self, num_inference_steps: int) -> np.ndarray:
        """The values fed to the model, one per model call (length `num_model_calls(n)`), float32: diffusers'
        `scheduler.timesteps` after `set_timesteps(n)`."""
        return np.array(self._tables(num_inference_steps)["timesteps"], dtype=F32)

    def add_noise_at(self, state, original: jax.Array, noise: jax.Array, index) -> jax.Array:
        """`original` noised to the level of model call `index` (absolute, may be traced): what diffusers'
        `add_noise(original, noise, timesteps[index:index + 1])` returns after `set_begin_index(index)`.

        This default is the variance-preserving forward process at alpha_bar(timesteps[index]) (DDIM, DDPM,
        PNDM, LCM, TCD: diffusers looks alpha_bar up by timestep value). `index == num_model_calls` (no step
        left: diffusers' pipelines refuse that strength) returns `original` unchanged. Sigma-space samplers
        override it with the sigma at `index`."""
        state = self._checked(state, self._state_class, "add_noise_at", ready=self._ready_field)
        n = state.timesteps.shape[0]
        index = jnp.asarray(index, jnp.int32)
        a = state.alphas_cumprod[to_index(state.timesteps[jnp.minimum(index, n - 1)])]
        x0 = original.astype(jnp.float32)
        noisy = a**0.5 * x0 + (1 - a) ** 0.5 * noise.astype(jnp.float32)
        return jnp.where(index < n, noisy, x0).astype(original.dtype)

    def draw_noise(self, keys: jax.Array, step_index, state, sample_shape) -> jax.Array:
        """The noise `step` gets at model call `step_index` of a stochastic sampler, `(B, ...)` float32: a
        standard normal drawn from each image's key (`sdjax.rng.step_noise`; `keys` are `(B, 2)` raw uint32
        keys, or typed keys). The DPM++ SDE sampler overrides it with increments of a Brownian tree."""
        shape = shape_tuple(sample_shape)
        keys = rng.as_key_array(keys)
        if keys.shape[0] != shape[0]:
            raise ValueError(f"draw_noise: {keys.shape[0]} keys for a batch of {shape[0]} (sample_shape {shape})")
        return rng.step_noise(keys, step_index, shape[1:])

    _state_class: ClassVar[type] = object  # the sampler's state class (checked by `_checked`)
    _ready_field: ClassVar[str | None] = None  # a state field that `set_timesteps` fills

    def _checked(self, state, cls, method: str, *, ready: str | None = None):
        """`state` cast to float32, after checking it is this sampler's (and, with `ready`, that
        `set_timesteps` has filled that field)."""
        if not isinstance(state, cls):
            raise TypeError(
                f"{type(self).__name__}.{method}: expected a {cls.__name__} (from this sampler's "
                f"create_state), got {type(state).__name__}"
            )
        if ready is not None and getattr(state, ready) is None:
            raise ValueError(
                f"{type(self).__name__}.{method}: call set_timesteps(state, num_inference_steps, shape) first"
            )
        return as_float32(state)


@functools.lru_cache(maxsize=256)
def _cached_tables(sampler: Sampler, n: int) -> dict[str, np.ndarray]:
    return {k: _readonly(v) for k, v in sampler._make_tables(n).items()}


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    a.setflags(write=False)
    return a


def shape_tuple(shape) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in shape)
    except TypeError as e:
        raise TypeError(f"shape must be the sample's shape (a tuple of ints), got {shape!r}") from e
