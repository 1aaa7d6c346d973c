"""Pieces shared by the guide API of every pipeline: outputs and argument checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def per_device_guidance(guidance_scale, ndev: int, per_device: int) -> jax.Array:
    """The guidance of a `jit=True` call as the pmapped `_generate` takes it: a scalar or one value per device
    -> `(ndev, 1)`; one value per image -> `(ndev, per_device)` (shapes were checked by `_validate_call`)."""
    g = jnp.asarray(guidance_scale, jnp.float32)
    return jnp.broadcast_to(
        g.reshape(-1, 1) if g.ndim else g, (ndev, 1) if g.ndim < 2 or g.shape[1] == 1 else (ndev, per_device)
    )
