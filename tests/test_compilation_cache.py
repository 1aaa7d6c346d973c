"""The persistent compilation cache (`sdjax.enable_compilation_cache`, the SDXL guide's `initialize_cache`): a
second process loads what the first wrote (the warm start the guide is after), and enabling it again with another
directory in the same process switches to that directory (JAX alone keeps writing to the first one)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp

import sdjax

# One process: compile, enable the cache, compile a new program; report the files written and the cache hits.
_PROGRAM = textwrap.dedent(
    """
    import os, sys
    import jax, jax.numpy as jnp
    import sdjax
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
    jax.jit(lambda x: x - 1.0)(jnp.ones(3)).block_until_ready()  # compiled before the cache is enabled
    sdjax.enable_compilation_cache(sys.argv[1])
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 2.0)(jnp.ones(7)).block_until_ready()
    print(len(os.listdir(sys.argv[1])), len(hits))
    """
)


def _run(cache_dir) -> tuple[int, int]:
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(cache_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    files, hits = out.stdout.split()
    return int(files), int(hits)


def test_a_second_process_loads_what_the_first_wrote(tmp_path):
    files, hits = _run(tmp_path)
    assert files >= 1 and hits == 0
    files_again, hits_again = _run(tmp_path)
    assert files_again == files and hits_again >= 1


def test_enabling_in_a_process_that_already_uses_another_directory(tmp_path):
    config = jax.config
    before = (
        config.jax_compilation_cache_dir,
        config.jax_persistent_cache_min_compile_time_secs,
        config.jax_persistent_cache_min_entry_size_bytes,
    )
    first, second = tmp_path / "first", tmp_path / "second"
    try:
        sdjax.enable_compilation_cache(first)
        jax.jit(lambda x: x * 5.0 - 1.0)(jnp.ones(5)).block_until_ready()
        sdjax.compilation_cache.initialize_cache(second)  # the guide's name for the same call
        jax.jit(lambda x: jnp.cos(x) * 5.0 - 1.0)(jnp.ones(5)).block_until_ready()
        assert len(os.listdir(first)) >= 1 and len(os.listdir(second)) >= 1
    finally:
        config.update("jax_compilation_cache_dir", before[0])
        config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        config.update("jax_persistent_cache_min_entry_size_bytes", before[2])
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
