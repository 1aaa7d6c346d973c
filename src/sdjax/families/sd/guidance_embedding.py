"""Guidance-distilled UNets (LCM checkpoints: `time_cond_proj_dim` in the UNet config) take the guidance scale as
an embedding added to the time embedding instead of running classifier-free guidance; the pipeline then runs one
branch only (the core reads that from `Denoiser.distilled_guidance`, which `UNetDenoiser` answers with
`distilled`). As diffusers' `get_guidance_scale_embedding`: `w = guidance - 1` scaled by 1000, sinusoids over
`dim // 2` log-spaced frequencies, sines then cosines (a zero column when `dim` is odd)."""

from __future__ import annotations

import jax.numpy as jnp


def guidance_embedding(guidance: jnp.ndarray, dim: int) -> jnp.ndarray:
    """`(B,)` guidance scales -> `(B, dim)` float32."""
    w = (guidance.astype(jnp.float32) - 1.0) * 1000.0
    half = dim // 2
    freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(jnp.log(10000.0) / (half - 1)))
    emb = w[:, None] * freqs[None, :]
    emb = jnp.concatenate([jnp.sin(emb), jnp.cos(emb)], axis=1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


def distilled(unet_config) -> bool:
    """Whether the UNet takes the guidance as an embedding (and so runs without classifier-free guidance)."""
    return getattr(unet_config, "time_cond_proj_dim", None) is not None
