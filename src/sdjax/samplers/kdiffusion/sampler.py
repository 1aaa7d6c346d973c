"""A sampler made of (prediction, schedule, step rule) that speaks the loop's Sampler contract
(`sdjax.core.loop.denoise`, docs/DEVELOPING.md), so it runs wherever the diffusers-parity samplers run.

The host builds per-model-call tables once: the sigma each call sees (then the final 0), the timestep the network is
fed (`Prediction.timesteps`), the step it belongs to (from, to) and its stage (0, or 1 for a two-stage rule's
correction call). `step` converts the model output to x0 once (`Prediction.denoised`) and hands the rule sigmas only.

Built from a diffusers scheduler config (`samplers.get_sampler`, `kdiffusion.from_diffusers(sampler)`), a sampler
keeps that config's front object as `origin` (the diffusers-parity `Sampler` that parsed and validated the config):
its `config` is the origin's (the keys a swap carries over, `_use_default_values` included), its config keys read as
attributes (`sampler.shift`, `sampler.prediction_type`, as diffusers' scheduler attributes), and `samplers.name_of`
names it as the origin (registry or diffusers class name).

`form` is the sample the loop holds between steps, for a variance-preserving model (a flow model's is always its
path sample, starting from unit noise):
- "ve": k-diffusion's x0 + sigma eps, the first sample sqrt(sigma^2 + 1) times unit noise (the VE image of unit VP
  noise: ComfyUI's `max_denoise`);
- "ve_sigma": the same sample, the first one sigma times unit noise (k-diffusion, and diffusers' Euler, Euler a and
  Heun on a linspace or trailing grid);
- "vp": the variance-preserving sample (x0 + sigma eps) / sqrt(sigma^2 + 1) from unit noise, fed to the network
  unscaled (diffusers' DPM-Solver): `step` converts it to the VE sample and back around the rule, so latents handed
  between samplers, to a refiner or to a mask blend mean what they mean in diffusers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax import rng
from sdjax.config import ConfigError
from sdjax.samplers.common import F32, require_noise, shape_tuple, state_class
from sdjax.samplers.kdiffusion.prediction import Prediction
from sdjax.samplers.kdiffusion.rules import Rule, get_rule, init_memory
from sdjax.samplers.kdiffusion.schedules import Schedule


@state_class
class KState:
    sigmas: jax.Array  # (M + 1,) the sigma of each model call, then the final one (0)
    timesteps: jax.Array  # (M,) what the network is fed
    step_from: jax.Array  # (M,) the sigma the call's step starts from
    step_to: jax.Array  # (M,) the sigma it ends at
    stage: jax.Array  # (M,) 0, or 1 for the second call of a two-stage step
    memory: dict | None = None  # the rule's memory (`rules.py`), after set_timesteps


FORMS = ("ve", "ve_sigma", "vp")


@dataclasses.dataclass(frozen=True)
class KDiffusionSampler:
    """k-diffusion form: `rule` (a `rules.RULES` name) on `schedule`'s sigmas for a model described by
    `prediction`; `eta` scales the ancestral / SDE noise (1: the rules' defaults); `form` and `origin`: module
    docstring."""

    rule: str = "euler"
    schedule: Schedule = Schedule()
    prediction: Prediction = Prediction()
    eta: float = 1.0
    form: str = "ve"
    origin: Any = None

    def __post_init__(self):
        get_rule(self.rule)
        self.schedule.check(self.prediction)
        if self.form not in FORMS:
            raise ConfigError(f"form={self.form!r} is not one of {list(FORMS)}")

    def __getattr__(self, name: str) -> Any:
        """A config key of the diffusers config this sampler stands for (`config`), as diffusers' attributes."""
        if name.startswith("_") or name in _FIELDS:
            raise AttributeError(name)
        config = self.config
        if name in config:
            return config[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or config key {name!r}")

    @property
    def step_rule(self) -> Rule:
        return get_rule(self.rule)

    @property
    def order(self) -> int:
        """Model calls per step (img2img starts at model call `t_start * order`, as for diffusers' Heun)."""
        return self.step_rule.stages

    @property
    def stochastic(self) -> bool:
        return self.step_rule.stochastic and self.eta != 0

    @property
    def num_train_timesteps(self) -> int:
        return self.prediction.num_train_timesteps

    @property
    def name(self) -> str:
        """A stable description, `kdiffusion:RULE:SCHEDULE` plus `:eta=X` where a stochastic rule's eta is not 1
        (what `samplers.name_of` and `pipe.default_sampler` give; `samplers.get_sampler` reads it back)."""
        eta = f":eta={self.eta:g}" if self.step_rule.stochastic and self.eta != 1.0 else ""
        return f"kdiffusion:{self.rule}:{self.schedule.name}{eta}"

    @property
    def config(self) -> dict[str, Any]:
        """The model's scheduler config as far as this sampler knows it, in diffusers' keys: a variance-preserving
        model's beta schedule and prediction type, a flow model's FlowMatch shift keys; the origin's whole config
        where there is one. What swapping to another sampler starts from (`samplers.get_sampler(name,
        base_config=this)`), as a diffusers scheduler's `config`."""
        if self.origin is not None:
            return self.origin.config
        p, s = self.prediction, self.schedule
        if p.flow:
            out: dict[str, Any] = {"_class_name": "FlowMatchEulerDiscreteScheduler"}
            out.update(num_train_timesteps=p.num_train_timesteps, shift=s.shift)
            if s.use_dynamic_shifting:
                out.update(
                    use_dynamic_shifting=True,
                    base_shift=s.base_shift,
                    max_shift=s.max_shift,
                    base_image_seq_len=s.base_image_seq_len,
                    max_image_seq_len=s.max_image_seq_len,
                    time_shift_type=s.time_shift_type,
                )
            if s.shift_terminal:
                out["shift_terminal"] = s.shift_terminal
            return out
        out = {
            "num_train_timesteps": p.num_train_timesteps,
            "beta_start": p.beta_start,
            "beta_end": p.beta_end,
            "beta_schedule": p.beta_schedule,
            "prediction_type": p.kind,
        }
        if p.trained_betas is not None:
            out["trained_betas"] = list(p.trained_betas)
        if s.name == "spaced":
            out.update(timestep_spacing=s.spacing, steps_offset=s.steps_offset)
        return out

    @property
    def diffusers_class(self) -> str | None:
        """The diffusers scheduler class this sampler stands for (its origin's; a flow model's FlowMatch Euler;
        None for a variance-preserving one built by hand)."""
        return self.config.get("_class_name")

    @property
    def alphas_cumprod(self) -> np.ndarray:
        """The training alpha_bar of a variance-preserving model (float32, as diffusers builds it)."""
        if self.prediction.flow:
            raise AttributeError("a flow-matching model has no alphas_cumprod")
        return self.prediction.alphas_cumprod()

    # -------------------------------------------------------------------------------------------- tables
    def tables(self, num_inference_steps: int, shape=None) -> dict[str, np.ndarray]:
        n = _checked_steps(self, num_inference_steps)
        mu = self.schedule.mu(shape)  # None unless the schedule shifts by resolution
        return _tables(self, n, mu, None if mu is None else shape_tuple(shape))

    def num_model_calls(self, num_inference_steps: int) -> int:
        # Every schedule ends in 0, and a two-stage rule's step to 0 is one call: 2n - 1 calls.
        n = self.schedule.steps(_checked_steps(self, num_inference_steps), self.prediction)
        return n if self.step_rule.stages == 1 else 2 * n - 1

    def timesteps_for(self, num_inference_steps: int, shape=None) -> np.ndarray:
        return np.array(self.tables(num_inference_steps, shape)["timesteps"], dtype=F32)

    def sigmas_for(self, num_inference_steps: int, shape=None) -> np.ndarray:
        """The schedule's `n + 1` sigmas (float32), before any two-stage interleaving."""
        return np.asarray(self.schedule.sigmas(int(num_inference_steps), self.prediction, shape), dtype=F32)

    # ------------------------------------------------------------------------------- what the loop calls
    def create_state(self) -> KState:
        empty = jnp.zeros((0,), jnp.float32)
        return KState(sigmas=empty, timesteps=empty, step_from=empty, step_to=empty, stage=empty)

    def set_timesteps(self, state: KState, num_inference_steps: int, shape=None) -> KState:
        if shape is None:
            raise ValueError(
                "KDiffusionSampler.set_timesteps needs the latent shape (the state holds the rule's memory)"
            )
        tables = self.tables(num_inference_steps, shape)
        return KState(
            **{k: jnp.asarray(v) for k, v in tables.items()},
            memory=init_memory(self.step_rule, shape_tuple(shape)),
        )

    @property
    def _vp(self) -> bool:
        return self.form == "vp" and not self.prediction.flow

    def init_noise_sigma(self, state: KState) -> jax.Array:
        sigma = _f32(state).sigmas[0]
        if self._vp:
            return jnp.ones_like(sigma)
        return sigma if self.form == "ve_sigma" and not self.prediction.flow else self.prediction.start_scale(sigma)

    def scale_model_input(self, state: KState, sample: jax.Array, step_index) -> jax.Array:
        if self._vp or self.prediction.flow:  # the VP sample / the flow sample is what the network is fed
            return sample
        sigma = _f32(state).sigmas[step_index]
        return (sample.astype(jnp.float32) * self.prediction.input_scale(sigma)).astype(sample.dtype)

    def step(self, state: KState, model_output: jax.Array, step_index, sample: jax.Array, noise=None):
        if state.memory is None:
            raise ValueError("KDiffusionSampler.step: call set_timesteps(state, num_inference_steps, shape) first")
        state = _f32(state)
        if self.stochastic:
            noise = require_noise(f"KDiffusionSampler({self.rule})", noise, sample)
        x = sample.astype(jnp.float32)
        if self._vp:
            x = x * jnp.sqrt(state.sigmas[step_index] ** 2 + 1.0)
        denoised = self.prediction.denoised(model_output.astype(jnp.float32), x, state.sigmas[step_index])
        out, memory = self.step_rule.fn(
            self.prediction,
            x,
            denoised,
            state.step_from[step_index],
            state.step_to[step_index],
            state.memory,
            noise=noise if noise is not None else jnp.zeros_like(x),
            stage=state.stage[step_index],
            eta=self.eta,
        )
        if self._vp:
            out = out / jnp.sqrt(state.sigmas[step_index + 1] ** 2 + 1.0)
        return out.astype(sample.dtype), dataclasses.replace(state, memory=memory)

    def add_noise_at(self, state: KState, original: jax.Array, noise: jax.Array, index) -> jax.Array:
        """`original` on the path at the sigma of model call `index` (the final 0 at `num_model_calls`)."""
        sigma = _f32(state).sigmas[jnp.asarray(index, jnp.int32)]
        x0 = original.astype(jnp.float32)
        if self._vp:  # alpha_t x0 + sigma_t eps
            alpha_t = 1.0 / jnp.sqrt(sigma**2 + 1.0)
            return (alpha_t * x0 + sigma * alpha_t * noise.astype(jnp.float32)).astype(original.dtype)
        return self.prediction.noised(x0, noise.astype(jnp.float32), sigma).astype(original.dtype)

    def draw_noise(self, keys: jax.Array, step_index, state, sample_shape) -> jax.Array:
        """Standard normal noise from each image's key (`sdjax.rng.step_noise`), as the other samplers draw it."""
        shape = shape_tuple(sample_shape)
        keys = rng.as_key_array(keys)
        if keys.shape[0] != shape[0]:
            raise ValueError(f"draw_noise: {keys.shape[0]} keys for a batch of {shape[0]} (sample_shape {shape})")
        return rng.step_noise(keys, step_index, shape[1:])


_FIELDS = frozenset(f.name for f in dataclasses.fields(KDiffusionSampler))


def _checked_steps(sampler: KDiffusionSampler, num_inference_steps) -> int:
    n = int(num_inference_steps)
    if n != num_inference_steps or n < 1:
        raise ValueError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}")
    if n > sampler.num_train_timesteps:
        raise ValueError(f"num_inference_steps={n} exceeds num_train_timesteps={sampler.num_train_timesteps}")
    return n


def _f32(state: KState) -> KState:
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), state)


@functools.lru_cache(maxsize=256)
def _tables(sampler: KDiffusionSampler, n: int, mu: float | None, shape) -> dict[str, np.ndarray]:
    sigmas = sampler.schedule.sigmas(n, sampler.prediction, shape)  # float64, n + 1, ending in 0
    if sigmas[-1] != 0 or np.any(np.diff(sigmas) >= 0):
        raise ConfigError(f"schedule {sampler.schedule.name!r} gave sigmas that do not descend to 0: {sigmas}")
    index, frm, to, stage = [], [], [], []  # per model call: its sigma's index in the schedule, its step, its stage
    for k in range(len(sigmas) - 1):  # n steps; a trailing grid may hold one more (diffusers keeps it)
        index.append(k)
        frm.append(sigmas[k])
        to.append(sigmas[k + 1])
        stage.append(0)
        if sampler.step_rule.stages == 2 and sigmas[k + 1] > 0:
            index.append(k + 1)
            frm.append(sigmas[k])
            to.append(sigmas[k + 1])
            stage.append(1)
    calls64 = sigmas[np.asarray(index)].astype(np.float64)
    grid = sampler.schedule.grid_timesteps(n, sampler.prediction)
    out: dict[str, Any] = {
        "sigmas": np.concatenate([calls64, [0.0]]).astype(F32),
        "timesteps": sampler.prediction.timesteps(calls64) if grid is None else grid[np.asarray(index)].astype(F32),
        "step_from": np.asarray(frm).astype(F32),
        "step_to": np.asarray(to).astype(F32),
        "stage": np.asarray(stage, dtype=F32),
    }
    for value in out.values():
        value.setflags(write=False)
    return out
