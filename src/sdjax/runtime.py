"""Process-level XLA:CPU settings that make Stable Diffusion fast on CPU (measured: docs/benchmarks.md).

Two ways to apply them; both leave every flag the user set explicitly alone:

- `configure_cpu()`: adds the flags to the `XLA_FLAGS` environment variable. XLA reads `XLA_FLAGS` once, when
  the first backend initializes (the first `jax.devices()`, array creation or compile), so this must run
  before that; afterwards it changes nothing and says so (returns False, warns). Call it at the top of a
  program (the CLI and the server do), before any JAX computation.
- `cpu_compiler_options()`: the same settings as a `compiler_options` dict for one compilation
  (`jax.jit(f, compiler_options=...)` or `jit(f).lower(...).compile(compiler_options=...)`): works at any
  time, on a backend already started, and only for that executable.

The setting that matters (jaxlib 0.8 - 0.10, x86 CPUs): XLA:CPU sends convolutions, dots and some reductions to
YNNPACK by default. YNNPACK's float32 convolutions are up to 4x slower than the Eigen convolutions XLA used
before (worst at small spatial size x many channels: 8x8x1280 in the SD UNet); with
`xla_cpu_experimental_ynn_fusion_type` empty, XLA uses its own emitters and Eigen again.
"""

from __future__ import annotations

import os
import warnings

# name -> value of `xla_cpu_experimental_ynn_fusion_type` (flag syntax / compiler_options enum names).
_YNN_TYPES = {
    "eigen": ("", ""),  # no YNNPACK at all
    "ynn-noconv": (
        "dot,reduce,individual_dot",
        "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    ),
}
DEFAULT_MODE = "eigen"


def recommended_xla_flags(mode: str = DEFAULT_MODE) -> dict[str, str]:
    """flag name -> value for `XLA_FLAGS` on CPU."""
    if mode not in _YNN_TYPES:
        raise ValueError(f"unknown CPU mode {mode!r}; choose one of {sorted(_YNN_TYPES)}")
    return {"xla_cpu_experimental_ynn_fusion_type": _YNN_TYPES[mode][0]}


def cpu_compiler_options(mode: str = DEFAULT_MODE) -> dict[str, str]:
    """`compiler_options` for one CPU compilation with the recommended settings (see the module docstring).

    Only for the CPU backend: other backends reject these option names.
    """
    if mode not in _YNN_TYPES:
        raise ValueError(f"unknown CPU mode {mode!r}; choose one of {sorted(_YNN_TYPES)}")
    return {"xla_cpu_experimental_ynn_fusion_type": _YNN_TYPES[mode][1]}


def _flag_names(xla_flags: str) -> set[str]:
    names = set()
    for tok in xla_flags.split():
        if tok.startswith("--"):
            names.add(tok[2:].split("=", 1)[0])
    return names


def merged_xla_flags(existing: str, mode: str = DEFAULT_MODE) -> str:
    """`existing` XLA_FLAGS plus the recommended flags the user has not set (theirs always win)."""
    given = _flag_names(existing)
    extra = [f"--{k}={v}" for k, v in recommended_xla_flags(mode).items() if k not in given]
    return " ".join([existing.strip(), *extra]).strip()


def backend_initialized() -> bool:
    """Whether a JAX backend has started (after which XLA_FLAGS is no longer read)."""
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX internals moved
        return False
    return bool(getattr(xla_bridge, "_backends", None))


def configure_cpu(mode: str = DEFAULT_MODE, *, force: bool = False) -> bool:
    """Add the recommended XLA:CPU flags to `XLA_FLAGS` (never overriding one the user set); call before JAX
    starts a backend. Returns True if the environment now holds them in effect, False if a backend was
    already running (then nothing is changed and a warning explains why; use `cpu_compiler_options`).

    Setting `SDJAX_NO_CPU_TUNING=1` (or calling with `mode="off"`) leaves XLA's defaults. Harmless on
    GPU/TPU machines: the flags only affect the CPU backend. `force` sets the flags even if a backend is up
    (only meaningful for a subprocess that inherits the environment).
    """
    if mode == "off" or os.environ.get("SDJAX_NO_CPU_TUNING", "") not in ("", "0"):
        return False
    if backend_initialized() and not force:
        warnings.warn(
            "sdjax.runtime.configure_cpu: a JAX backend is already initialized, so XLA_FLAGS is no "
            "longer read; call configure_cpu() before any JAX computation, or compile with "
            "compiler_options=sdjax.runtime.cpu_compiler_options()",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    os.environ["XLA_FLAGS"] = merged_xla_flags(os.environ.get("XLA_FLAGS", ""), mode)
    return True
