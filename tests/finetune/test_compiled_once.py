"""`finetune.loop._compiled_once`: a train step compiled once per process and program, shared by runs whose step
prints the same text, except a step that calls back into Python (its callbacks are its own lowering's)."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import io_callback

from sdjax.finetune import loop


def _step(calls: list | None = None, tag: str = ""):
    def report(v):
        calls.append(tag)
        return np.float32(0)

    def step(x):
        y = x * 3.0 + 1.0
        if calls is not None:
            y = y + io_callback(report, jax.ShapeDtypeStruct((), np.float32), x.sum())
        return y

    return loop._compiled_once(jax.jit(step))


def test_runs_of_one_program_share_its_executable():
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(_step()(x), x * 3 + 1)
    before = dict(loop._COMPILED)
    np.testing.assert_array_equal(_step()(x), x * 3 + 1)  # a second run's step: the same text
    assert len(loop._COMPILED) == len(before) and all(loop._COMPILED[k] is v for k, v in before.items())


def test_a_step_that_calls_back_keeps_its_own_callbacks():
    calls: list = []
    x = np.arange(3, dtype=np.float32)
    steps = [_step(calls, "a"), _step(calls, "b")]  # the same text, different Python functions
    for tag, step in zip("ab", steps):
        np.testing.assert_array_equal(step(x), x * 3 + 1)
        assert calls[-1] == tag
