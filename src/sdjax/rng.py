"""Explicit randomness: one key per image, and a named stream per use of randomness.

Image `i` of a call owns the key `fold_in(key, i)` (so it does not change with batch size or device count). Every
random draw of that image folds a fixed *stream* number into its key: the initial latents, the VAE posterior
sample of each encoded image, and the noise of sampling step `k`. Tests that compare with PyTorch draw the same
arrays through these functions and inject them into the reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Stream numbers folded into an image's key. Step `k` of a stochastic sampler uses `STEP_NOISE + k`.
LATENTS = 0  # the initial noise (txt2img latents; the forward noise of img2img and inpainting)
STEP_NOISE = 1  # + step index: the noise a stochastic sampler adds at that step
ENCODE_IMAGE = 1 << 20  # the VAE posterior sample of the init image (img2img, inpainting)
ENCODE_MASKED_IMAGE = (1 << 20) + 1  # the VAE posterior sample of the masked image (9-channel inpainting)
FILL_NOISE = (1 << 20) + 2  # A1111's "latent noise" fill of the masked region (inpainting)
ENCODE_CONTROL = 1 << 21  # + net index: the VAE posterior sample of a ControlNet's control image (SD 3)


def as_key_array(keys: Any) -> jax.Array:
    """Accept raw uint32 keys `(..., 2)` or typed keys; return raw uint32 keys."""
    keys = jnp.asarray(keys) if not isinstance(keys, jax.Array) else keys
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(keys)
    return keys


def image_keys(key: jax.Array, count: int) -> jax.Array:
    """One key per image: `fold_in(key, i)`, so an image does not depend on how the batch is split."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(count))


def per_image_normal(keys: jax.Array, stream: int | jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """Standard normal noise of `(len(keys),) + shape`, image `i` drawn from `fold_in(keys[i], stream)`."""
    return jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, stream), shape, dtype))(keys)


def step_noise(keys: jax.Array, step_index: int | jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The standard normal noise a stochastic sampler gets at model call `step_index` (per image)."""
    return per_image_normal(keys, STEP_NOISE + step_index, shape)
