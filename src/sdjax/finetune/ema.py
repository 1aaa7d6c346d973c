"""Exponential moving average (EMA) of the trained values (a LoRA, textual-inversion rows), as diffusers'
`training_utils.EMAModel` with its defaults (`use_ema_warmup=False`, `update_after_step=0`, `min_decay=0`).

diffusers (0.42, `EMAModel.get_decay` / `EMAModel.step`), called once per optimiser update (`sync_gradients`) in
its training examples, `optimization_step` counting the updates from 1:

    step = max(0, optimization_step - 1)
    decay = 0 if step <= 0 else min(decay, (1 + step) / (10 + step))
    shadow -= (1 - decay) * (shadow - param)

So the first update copies the values (decay 0), and the decay warms up as `(1 + s) / (10 + s)` (0.18 at the
second update, 0.5 at the ninth) until it reaches `ema_decay`. The shadow starts as a copy of the initial values
(`init`). The decay is computed on the host in double precision, as diffusers does, and the update runs jitted in
float32 (`update`), once per optimiser update (after the `accumulation` micro-steps of an update).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def decay_at(optimization_step: int, decay: float) -> float:
    """diffusers' `EMAModel.get_decay(optimization_step)` (no warm-up schedule, `update_after_step` 0)."""
    step = max(0, int(optimization_step) - 1)
    if step <= 0:
        return 0.0
    return min((1 + step) / (10 + step), float(decay))


def init(values: Any) -> Any:
    """The shadow values: a copy of `values` (never the same buffers: the train step donates its state)."""
    return jax.tree_util.tree_map(lambda v: jnp.array(v, copy=True), values)


@jax.jit
def _step(shadow, values, one_minus_decay):
    return jax.tree_util.tree_map(lambda s, v: s - one_minus_decay * (s - v.astype(s.dtype)), shadow, values)


def update(shadow: Any, values: Any, optimization_step: int, decay: float) -> Any:
    """The shadow after optimiser update number `optimization_step` (1 for the first) produced `values`."""
    return _step(shadow, values, jnp.float32(1.0 - decay_at(optimization_step, decay)))
