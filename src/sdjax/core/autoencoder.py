"""Pixels <-> the denoiser's latents through the VAE, with the scaling rules of diffusers' pipelines.

- encode: images NCHW in [-1, 1] -> a sample of the VAE posterior `mean + std * eps` (diffusers'
  `retrieve_latents(..., sample_mode="sample")`; `eps` is a given standard normal array, drawn by the caller from
  the image's key) -> `(z - latents_mean) * scaling_factor / latents_std` when the config has per-channel
  statistics, else `(z - shift_factor) * scaling_factor`.
- decode: the inverse scaling, the decoder, then `images / 2 + 0.5` limited to [0, 1], NHWC float32.

A VAE whose config says `force_upcast` runs in float32 when the pipeline computes in float16 (such VAEs
overflow in float16), as diffusers does. `tiling` (a `models.vae_tiling.VaeTiling`) runs the encoder/decoder
tile by tile as diffusers' `enable_vae_tiling()` does; None runs it on the whole image. `slicing` (images per slice,
0: the whole batch) runs it over the batch a slice at a time as `enable_vae_slicing()` does (`models.vae_slicing`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sdjax.models import vae_slicing, vae_tiling
from sdjax.ops import conv as ops_conv


def _runtime(vae, vae_params, dtype):
    """The VAE module and params to run: float32 when the config asks for it under float16."""
    if jnp.dtype(dtype) == jnp.float16 and vae.config.force_upcast:
        return vae.clone(dtype=jnp.float32), jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), vae_params)
    return vae, vae_params


def _stats(cfg, ndim: int):
    shape = (1, -1) + (1,) * (ndim - 2)
    mean = jnp.asarray(cfg.latents_mean, jnp.float32).reshape(shape) if cfg.latents_mean is not None else None
    std = jnp.asarray(cfg.latents_std, jnp.float32).reshape(shape) if cfg.latents_std is not None else None
    return mean, std


def to_model_latents(cfg, z: jax.Array) -> jax.Array:
    """VAE latents -> the denoiser's latent space (scaled, shifted or normalized per channel)."""
    mean, std = _stats(cfg, z.ndim)
    if mean is not None and std is not None:
        return (z - mean) * cfg.scaling_factor / std
    return (z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor


def from_model_latents(cfg, latents: jax.Array) -> jax.Array:
    """The denoiser's latent space -> VAE latents."""
    mean, std = _stats(cfg, latents.ndim)
    if mean is not None and std is not None:
        return latents * std / cfg.scaling_factor + mean
    return latents / cfg.scaling_factor + (cfg.shift_factor or 0.0)


def encode(
    vae, vae_params: Any, images_nchw: jax.Array, eps: jax.Array | None, dtype, tiling=None, slicing: int = 0
) -> jax.Array:
    """Images NCHW in [-1, 1] -> the denoiser's latents NCHW float32 (the posterior sample with `eps`, or its mean when
    `eps` is None)."""
    module, p = _runtime(vae, vae_params, dtype)
    p = ops_conv.prepare(p)

    def moments(x):
        if tiling is not None:
            posterior = vae_tiling.tiled_encode(module, p, x, tiling)
        else:
            posterior = module.apply({"params": p}, x, method=module.encode)
        return posterior.mean, posterior.std

    mean, std = _batched(moments, images_nchw.astype(module.dtype), slicing)
    z = mean if eps is None else mean + std * eps.astype(jnp.float32)
    return to_model_latents(vae.config, z.astype(jnp.float32))


def decode(vae, vae_params: Any, latents: jax.Array, dtype, tiling=None, slicing: int = 0) -> jax.Array:
    """The denoiser's latents NCHW -> images NHWC float32 in [0, 1]."""
    module, p = _runtime(vae, vae_params, dtype)
    p = ops_conv.prepare(p)

    def run(z):
        if tiling is not None:
            return vae_tiling.tiled_decode(module, p, z, tiling)
        return module.apply({"params": p}, z, method=module.decode)

    z = from_model_latents(vae.config, latents.astype(jnp.float32)).astype(module.dtype)
    images = _batched(run, z, slicing)
    images = jnp.minimum(jnp.maximum(images.astype(jnp.float32) / 2 + 0.5, 0.0), 1.0)
    return images.transpose(0, 2, 3, 1)


def _batched(fn, x, slicing: int):
    """`fn(x)`, or with `slicing` images at a time (`models.vae_slicing`)."""
    return vae_slicing.sliced(fn, x, slicing) if slicing else fn(x)
