"""Casting params between float32, bfloat16 and float16, keeping the scheduler state float32."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_FLOAT_DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
}


def resolve_dtype(dtype: Any) -> Any:
    """`"bf16"`, `"bfloat16"`, `jnp.bfloat16`, ... -> the jnp dtype; anything else raises naming it."""
    if isinstance(dtype, str):
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(_FLOAT_DTYPES)}")
        return _FLOAT_DTYPES[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
    return jnp.dtype(dtype).type


def cast_params(params: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """Cast the floating leaves of every component to `dtype`; `params["scheduler"]` stays float32.

    A bf16 scheduler state gives NaN or black images; this is the helper for what the SDXL guide does by hand.
    """
    dtype = resolve_dtype(dtype)

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    out = {}
    for name, tree in params.items():
        out[name] = tree if name == "scheduler" else jax.tree_util.tree_map(cast, tree)
    return out
