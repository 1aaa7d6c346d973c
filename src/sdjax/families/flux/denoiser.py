"""The Flux.1 denoiser: diffusers' `FluxTransformer2DModel` behind the core's one call.

The loop and the samplers see unpacked latents `(B, 16, h, w)`; the transformer sees tokens. Per call the adapter
packs 2x2 latent patches into `(B, h/2 * w/2, 64)` tokens (diffusers' `_pack_latents`), gives the transformer the
image position ids of that grid and zero ids for the text tokens, the timestep as the pipeline does (the
sampler's `t` = sigma * 1000, divided by 1000; the model multiplies again inside), dev's embedded guidance, and
unpacks the predicted flow velocity. Packing is a permutation, so sampling unpacked latents is the same
arithmetic as diffusers' sampling of packed ones.

A ControlNet's hook (`families.flux.controlnet`) hands the model `controlnet_block_samples` and
`controlnet_single_block_samples` (packed tokens), which the transformer adds to its image stream (`models.flux`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sdjax.models import flux as flux_model


@dataclasses.dataclass(frozen=True, eq=False)
class FluxDenoiser:
    """A `core.protocols.Denoiser` over `models.flux.FluxTransformer2DModel` (params under "transformer")."""

    transformer: Any
    dtype: Any = jnp.float32

    component = "transformer"
    distilled_guidance = False  # dev's guidance is an input of the network, but true CFG can still be asked for

    @property
    def config(self) -> Any:
        return self.transformer.config

    @property
    def in_channels(self) -> int:
        return int(self.transformer.config.in_channels) // 4  # 2x2 patches packed into channels

    sample_size = (128, 128)  # 1024 x 1024 pixels, the released models' training size
    size_multiple = 2  # latents are packed in 2x2 patches

    def with_attention(self, attention: str) -> FluxDenoiser:
        return dataclasses.replace(self, transformer=self.transformer.clone(attention=attention))

    def bind(self, params: dict, cond: Any, inputs: dict, *, cfg: bool) -> Callable[..., jax.Array]:
        text = cond["text"].astype(self.dtype)
        pooled = cond["pooled"].astype(self.dtype)
        guidance = cond["guidance"].astype(jnp.float32) if self.transformer.config.guidance_embeds else None
        txt_ids = jnp.zeros((text.shape[1], 3), jnp.float32)
        p = params[self.component]

        def model(x_in, t, controlnet_block_samples=None, controlnet_single_block_samples=None, **kwargs):
            if kwargs:
                raise TypeError(
                    f"the Flux transformer takes controlnet_block_samples and controlnet_single_block_samples only, "
                    f"got {sorted(kwargs)}"
                )
            rows, _, h, w = x_in.shape
            tokens = flux_model.pack_latents(x_in.astype(self.dtype))
            img_ids = jnp.asarray(flux_model.image_ids(h, w), jnp.float32)
            timestep = model_timestep(t, rows, self.dtype)
            out = self.transformer.apply(
                {"params": p},
                tokens,
                text,
                pooled,
                timestep,
                img_ids,
                txt_ids,
                guidance,
                controlnet_block_samples,
                controlnet_single_block_samples,
            )
            return flux_model.unpack_latents(out.astype(jnp.float32), h, w)

        return model


def model_timestep(t, rows: int, dtype) -> jax.Array:
    """The sampler's `t` (sigma * 1000) as FluxPipeline hands it to the transformer and its ControlNets: divided
    by 1000, one per row, in the compute dtype."""
    return jnp.broadcast_to(jnp.asarray(t, jnp.float32) / 1000.0, (rows,)).astype(dtype)
