"""Exponential moving average (EMA) of the trained values (a LoRA, textual-inversion rows, a fine-tune's UNet), as
diffusers' `training_utils.EMAModel` with its warm-up options (`EmaSchedule`).

diffusers (0.42, `EMAModel.get_decay` / `EMAModel.step`) is stepped once per optimiser update (`sync_gradients`) in
its training examples, `optimization_step` counting the updates from 1. With `s = optimization_step -
update_after_step - 1`:

    decay = 0                                   if s <= 0
          = 1 - (1 + s / inv_gamma) ** -power   with use_ema_warmup
          = (1 + s) / (10 + s)                  without (diffusers' default)
    decay = max(min(decay, max_decay), min_decay)   (for s > 0 only: min_decay does not lift the zeros)
    shadow -= (1 - decay) * (shadow - param)

So each of the first `update_after_step + 1` updates still runs the update with decay 0, which makes the shadow
the current values (`shadow - (shadow - param)`); the averaging starts after them. Without warm-up the decay rises
as `(1 + s) / (10 + s)` (0.18 at s = 1, 0.5 at s = 8); with it as `1 - (1 + s / inv_gamma) ** -power` (diffusers'
defaults inv_gamma 1, power 2/3: 0.37 at s = 1, 0.999 at s = 31.6K); both capped by the decay and raised to
`min_decay`. The shadow starts as a copy of the initial values (`init`). The decay is computed on the host in
double precision, as diffusers does, and the update runs jitted in float32 (`update`), once per optimiser update
(after the `accumulation` micro-steps of an update).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class EmaSchedule:
    """The decay schedule of an EMA: diffusers' `EMAModel(decay, min_decay, update_after_step, use_ema_warmup,
    inv_gamma, power)` with diffusers' defaults."""

    decay: float
    warmup: bool = False
    inv_gamma: float = 1.0
    power: float = 2 / 3
    update_after_step: int = 0
    min_decay: float = 0.0

    @classmethod
    def of(cls, cfg: Any) -> EmaSchedule | None:
        """The schedule of a trainer config's `ema_*` settings; None when `cfg.ema_decay` is None (no EMA)."""
        if cfg.ema_decay is None:
            return None
        return cls(
            decay=float(cfg.ema_decay),
            warmup=bool(cfg.ema_warmup),
            inv_gamma=float(cfg.ema_inv_gamma),
            power=float(cfg.ema_power),
            update_after_step=int(cfg.ema_update_after_step),
            min_decay=float(cfg.ema_min_decay),
        )


def decay_at(optimization_step: int, schedule: EmaSchedule) -> float:
    """diffusers' `EMAModel.get_decay(optimization_step)` under `schedule` (a Python float, double precision)."""
    s = max(0, int(optimization_step) - schedule.update_after_step - 1)
    if s <= 0:
        return 0.0
    if schedule.warmup:
        value = 1 - (1 + s / schedule.inv_gamma) ** -schedule.power
    else:
        value = (1 + s) / (10 + s)
    return max(min(value, schedule.decay), schedule.min_decay)


def init(values: Any) -> Any:
    """The shadow values: a copy of `values` (never the same buffers: the train step donates its state)."""
    return jax.tree_util.tree_map(lambda v: jnp.array(v, copy=True), values)


@jax.jit
def _step(shadow, values, one_minus_decay):
    return jax.tree_util.tree_map(lambda s, v: s - one_minus_decay * (s - v.astype(s.dtype)), shadow, values)


def update(shadow: Any, values: Any, optimization_step: int, schedule: EmaSchedule) -> Any:
    """The shadow after optimiser update number `optimization_step` (1 for the first) produced `values`."""
    return _step(shadow, values, jnp.float32(1.0 - decay_at(optimization_step, schedule)))
