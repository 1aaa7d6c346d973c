"""Pieces shared by the SD and SDXL pipelines: outputs, validation, keys, the denoising loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.rng import as_key_array, image_keys, per_image_normal  # noqa: F401 (re-exported)

Progress = Callable[[str, int, int], None]


@dataclasses.dataclass
class PipelineOutput:
    """`.images` and `.nsfw_content_detected`; `output[0]` is the images, as in the old diffusers outputs."""

    images: Any
    nsfw_content_detected: Any = None

    def __getitem__(self, index: int):
        return (
            (self.images, self.nsfw_content_detected)[index]
            if self.nsfw_content_detected is not None
            else ((self.images,)[index])
        )


def is_traced(*xs: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


def check_static(name: str, value: Any) -> int:
    """Sizes and step counts fix the compiled shapes: they must be Python ints, not traced values."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced value; it fixes array shapes and must be static: with pmap pass "
            f"static_broadcasted_argnums for it (the guides use [3, 4, 5] for steps, height, width)"
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_size(height: int, width: int, multiple: int) -> None:
    for name, v in (("height", height), ("width", width)):
        if v <= 0 or v % 8:
            raise ValueError(f"{name}={v} must be a positive multiple of 8 (the VAE works on 8x8 pixel patches)")
        if v % multiple:
            raise ValueError(
                f"{name}={v} must be a multiple of {multiple} for this model (its latents are halved "
                f"{int(np.log2(multiple // 8))} times by the UNet); try {v - v % multiple + multiple}"
            )


def check_steps(num_inference_steps: int) -> None:
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps={num_inference_steps} must be at least 1")


def guidance_per_image(guidance_scale: Any, batch: int) -> jax.Array:
    """A scalar, `(1,)` or `(batch,)` guidance scale -> float32 `(batch,)`."""
    g = jnp.asarray(guidance_scale, dtype=jnp.float32).reshape(-1)
    if g.shape[0] not in (1, batch):
        raise ValueError(
            f"guidance_scale has {g.shape[0]} values for a batch of {batch} images; pass one value, "
            f"or one per image (with pmap: shape (num_devices, 1) or (num_devices, batch_per_device))"
        )
    return jnp.broadcast_to(g, (batch,))


def denoise(
    *,
    sampler,
    sampler_state,
    latents: jax.Array,
    keys: jax.Array,
    guidance: jax.Array,
    num_inference_steps: int,
    predict_noise: Callable[[jax.Array, jax.Array], jax.Array],
    guidance_rescale: float = 0.0,
    on_step: Callable[[jax.Array, int], None] | None = None,
) -> jax.Array:
    """Classifier-free-guided sampling loop under `lax.fori_loop`.

    `latents` are the initial noise (not yet scaled by `init_noise_sigma`); `predict_noise(x_2b, t)` runs the UNet
    on the unconditional and conditional halves stacked along the batch (uncond first). `on_step(i, total)`, if
    given, is called on the host after each step (through `jax.debug.callback`, unordered, so it does not
    serialize the loop); it is fixed at trace time.
    """
    state = sampler.set_timesteps(sampler_state, num_inference_steps, latents.shape)
    latents = latents * sampler.init_noise_sigma(state)
    calls = sampler.num_model_calls(num_inference_steps)
    g = guidance.reshape((-1,) + (1,) * (latents.ndim - 1))

    def body(i, carry):
        x, st = carry
        t = st.timesteps[i]
        x_in = sampler.scale_model_input(st, jnp.concatenate([x, x]), i)
        out = predict_noise(x_in, t).astype(jnp.float32)
        uncond, cond = jnp.split(out, 2)
        guided = uncond + g * (cond - uncond)
        if guidance_rescale > 0:
            guided = rescale_noise_cfg(guided, cond, guidance_rescale)
        noise = per_image_normal(keys, i + 1, x.shape[1:]) if sampler.stochastic else None
        x, st = sampler.step(st, guided, i, x, noise=noise)
        if on_step is not None:
            jax.debug.callback(on_step, i, calls, ordered=False)
        return x, st

    latents, _ = jax.lax.fori_loop(0, calls, body, (latents, state))
    return latents


def rescale_noise_cfg(guided: jax.Array, cond: jax.Array, rescale: float) -> jax.Array:
    """Rescale guided noise toward the conditional prediction's per-image std (Lin et al. 2023, sec. 3.4)."""
    axes = tuple(range(1, guided.ndim))
    std_cond = jnp.std(cond, axis=axes, keepdims=True)
    std_guided = jnp.std(guided, axis=axes, keepdims=True)
    rescaled = guided * (std_cond / std_guided)
    return rescale * rescaled + (1 - rescale) * guided


def per_device_guidance(guidance_scale, ndev: int, per_device: int) -> jax.Array:
    """The guidance of a `jit=True` call as the pmapped `_generate` takes it: a scalar or one value per device
    -> `(ndev, 1)`; one value per image -> `(ndev, per_device)` (shapes were checked by `_validate_call`)."""
    g = jnp.asarray(guidance_scale, jnp.float32)
    return jnp.broadcast_to(
        g.reshape(-1, 1) if g.ndim else g, (ndev, 1) if g.ndim < 2 or g.shape[1] == 1 else (ndev, per_device)
    )
