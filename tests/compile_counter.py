"""Count XLA backend compiles while a block runs (jax.monitoring's compile-duration event): the tests that promise
"no request compiles" or "switching LoRAs never recompiles" use it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax.monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[float]]:
    """Yields a list that gets one duration per backend compile until the block ends."""
    compiles: list[float] = []

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield compiles
    finally:  # only this block's listener: others of the process (sdjax's progress, a profiler) keep theirs
        jax.monitoring.unregister_event_duration_listener(on_event)
