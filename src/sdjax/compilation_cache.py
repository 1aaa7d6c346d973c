"""JAX's persistent compilation cache, under the name the guides need.

The SDXL guide calls `jax.experimental.compilation_cache.compilation_cache.initialize_cache(dir)`, which JAX
removed; the modern form is `jax.config.update("jax_compilation_cache_dir", dir)`. `enable_compilation_cache`
does that and also caches small programs, which JAX skips by default. `initialize_cache` is the same function
under the old name, so the guide's `from sdjax import compilation_cache as cc; cc.initialize_cache(dir)` works.

JAX opens the cache directory once per process, at the first compile after it is set; pointing the setting at
another directory later is silently ignored (entries keep going to the first one). `enable_compilation_cache`
resets JAX's cache state, so the directory it is given is the one used from the next compile on.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache


def enable_compilation_cache(path: str | os.PathLike, *, min_compile_time_secs: float = 0.0) -> str:
    """Persist compiled executables under `path` (created if needed); later processes load them from disk."""
    path = os.fspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # Close the directory JAX may have opened earlier in this process; the next compile opens `path`.
    _jax_cache.reset_cache()
    return path


initialize_cache = enable_compilation_cache
