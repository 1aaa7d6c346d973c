"""tests/compile_counter.py's block counts the backend compiles inside it and leaves the process's other
jax.monitoring listeners (sdjax's progress listener, a profiler) registered after it ends."""

import jax
import jax.monitoring
import jax.numpy as jnp
from compile_counter import COMPILE_EVENT, counting_compiles


def test_the_block_counts_its_compiles_and_keeps_other_listeners():
    outside: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        outside.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        x, y = jnp.arange(5.0), jnp.arange(7.0)  # their own small programs, before the block
        with counting_compiles() as compiles:
            jax.jit(lambda x: x * 3 + 1)(x).block_until_ready()
        assert len(compiles) == 1
        outside.clear()
        jax.jit(lambda x: x * 5 - 2)(y).block_until_ready()  # a new program after the block
        assert COMPILE_EVENT in outside  # the outer listener still hears compiles
        assert len(compiles) == 1  # the block's own listener is gone
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
