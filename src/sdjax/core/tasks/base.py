"""What every task shares: the static spec contract, the request a caller builds, and the step window.

A task is a frozen, hashable spec (part of the compile key) with one traced method, `prepare(ctx, inputs)`, that
returns the initial latents and the loop hooks; the per-image arrays it needs (an init image, a mask) travel in a
`TaskRequest` built on the host by the task module's `request(...)` function, next to the strength or
denoising window that selects the model calls `[start, end)` of the schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.core.loop import Hook


@dataclasses.dataclass(frozen=True)
class Context:
    """What a task's `prepare` gets inside the generation program."""

    sampler: Any
    state: Any  # the sampler state after set_timesteps
    calls: int  # model calls of the full schedule
    shape: tuple[int, ...]  # latent shape (B, C, h, w)
    keys: jax.Array  # (B, 2) per-image keys
    noise: jax.Array  # (B, C, h, w) the initial noise (drawn from the keys, or given)
    start: jax.Array  # first model call (traced int32)
    end: jax.Array  # one past the last model call (traced int32)
    cfg: bool
    model_in_channels: int
    encode: Callable[[jax.Array, int], jax.Array]  # (images NCHW in [-1, 1], rng stream) -> model latents

    def add_noise_at(self, x0: jax.Array, index: jax.Array) -> jax.Array:
        """`x0` noised to the level of model call `index` with the initial noise (diffusers' `add_noise` after
        `set_begin_index(index)`)."""
        return add_noise_at(self.sampler, self.state, x0, self.noise, index)

    def noised_start(self, x0: jax.Array) -> jax.Array:
        """`x0` noised to the window's first model call; `x0` itself when the window is empty (strength 0)."""
        index = jnp.minimum(self.start, self.calls - 1)
        return jnp.where(self.start < self.calls, self.add_noise_at(x0, index), x0)


def add_noise_at(sampler, state, x0, noise, index):
    """`x0` noised to the level of model call `index` (`Sampler.add_noise_at`)."""
    return sampler.add_noise_at(state, x0, noise, index)


class TaskSpec:
    """A task's static part. Subclasses are frozen dataclasses (hashable: they key compiled programs)."""

    name: ClassVar[str] = ""
    inputs: ClassVar[tuple[str, ...]] = ()  # per-image arrays the task reads from the program inputs

    def prepare(self, ctx: Context, inputs: dict[str, jax.Array]) -> tuple[jax.Array, list[Hook]]:
        raise NotImplementedError


@dataclasses.dataclass
class TaskRequest:
    """A task with its per-image host arrays (leading dimension = number of images) and its window settings."""

    spec: TaskSpec
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    strength: float = 1.0
    denoising_start: float | None = None
    denoising_end: float | None = None
    finish: Callable[[np.ndarray], np.ndarray] | None = None  # host post-processing of uint8 images (N, H, W, 3)
    start_step: int | None = None  # an explicit first step (overrides strength: AUTOMATIC1111's img2img, hires fix)

    def __post_init__(self):
        check_fraction("strength", self.strength, allow_zero=True)
        bad = isinstance(self.start_step, bool) or not isinstance(self.start_step, (int, np.integer, type(None)))
        if bad or (self.start_step is not None and self.start_step < 0):
            raise ValueError(f"start_step={self.start_step!r} must be an int >= 0")
        for name in ("denoising_start", "denoising_end"):
            value = getattr(self, name)
            if value is not None:
                check_fraction(name, value, allow_zero=False)
        if (
            self.denoising_start is not None
            and self.denoising_end is not None
            and self.denoising_start >= self.denoising_end
        ):
            raise ValueError(f"denoising_start={self.denoising_start} must be below denoising_end={self.denoising_end}")


def check_fraction(name: str, value: Any, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(value).__name__} {value!r}")
    value = float(value)
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value <= 1):
        raise ValueError(f"{name}={value!r} must lie in {'[0, 1]' if allow_zero else '(0, 1]'}")
    return value


# ----------------------------------------------------------------------------------------------- the window
STRENGTH_RULES = ("int", "float")


def sampler_timesteps(sampler, steps: int) -> np.ndarray:
    """The timesteps fed to the model at each model call (one per call)."""
    return np.asarray(sampler.timesteps_for(steps))


def window(
    sampler,
    steps: int,
    *,
    strength: float = 1.0,
    denoising_start: float | None = None,
    denoising_end: float | None = None,
    start_step: int | None = None,
    strength_rule: str = "int",
) -> tuple[int, int]:
    """The model calls `[start, end)` diffusers runs for these settings.

    - `strength` (img2img, inpainting): with `strength_rule="int"` (the SD pipelines) `init = min(int(steps *
      strength), steps)` and the loop starts at step `steps - init`, i.e. model call `(steps - init) *
      sampler.order`; when `init` is 0 (strength 0, or below `1 / steps`) no model call runs and the result is the
      VAE round trip of the input (diffusers refuses). With `"float"` (the flow-matching pipelines) the start step
      is `int(steps - min(steps * strength, steps))`: the fraction is dropped after the subtraction, so 4 steps at
      strength 0.6 start at step 1, not 2.
    - `denoising_start` (a refiner hand-off: a second model finishes; overrides `strength`): the calls whose
      timestep is below `round(T - denoising_start * T)`, one more for a second-order sampler when the count is
      even.
    - `start_step`: the loop starts at that step (model call `start_step * order`), whatever the strength.
    - `denoising_end` (a base model's hand-off to a refiner): the leading calls of the window whose timestep is at least
      `round(T - denoising_end * T)`.
    """
    if strength_rule not in STRENGTH_RULES:
        raise ValueError(f"strength_rule={strength_rule!r} must be one of {STRENGTH_RULES}")
    calls = int(sampler.num_model_calls(steps))
    order = int(sampler.order)
    T = sampler.num_train_timesteps
    if start_step is not None:
        if start_step > steps:
            raise ValueError(f"start_step={start_step} exceeds the {steps} steps")
        start = calls if start_step == steps else start_step * order
    elif denoising_start is not None:
        cutoff = int(round(T - denoising_start * T))
        count = int((sampler_timesteps(sampler, steps) < cutoff).sum())
        if order == 2 and count % 2 == 0:
            count += 1
        start = max(calls - count, 0)
    elif strength_rule == "float":
        first = int(max(steps - min(steps * strength, steps), 0))
        start = calls if first >= steps else first * order
    else:
        init = min(int(steps * strength), steps)
        start = calls if init == 0 else (steps - init) * order
    end = calls
    if denoising_end is not None:
        cutoff = int(round(T - denoising_end * T))
        end = start + int((sampler_timesteps(sampler, steps)[start:] >= cutoff).sum())
    return start, end
