"""The UNet families' denoiser (SD 1.x, 2.x, XL): diffusers' `UNet2DConditionModel` behind the core's one call.

`bind` prepares, once per program and outside the loop, what every model call shares: the CPU paths' transformed
convolution kernels (`ops.conv.prepare`; leaves the generator prepared ahead are used as they are) and, for
guidance-distilled UNets (LCM: `time_cond_proj_dim`), the guidance-scale embedding. The conditioning is the
families' `(context, added UNet arguments)` pair; the model output is what the UNet predicts (epsilon, v or sample:
the sampler's `prediction_type` says which).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sdjax.families.sd import guidance_embedding
from sdjax.ops import conv as ops_conv


@dataclasses.dataclass(frozen=True, eq=False)
class UNetDenoiser:
    """A `core.protocols.Denoiser` over a `models.unet.UNet2DConditionModel` (params under "unet")."""

    unet: Any
    dtype: Any = jnp.float32

    component = "unet"

    @property
    def config(self) -> Any:
        return self.unet.config

    @property
    def in_channels(self) -> int:
        return int(self.unet.config.in_channels)

    @property
    def sample_size(self) -> tuple[int, int]:
        """The default latent size `(h, w)` (the config's `sample_size`)."""
        s = self.unet.config.sample_size
        return (s, s) if isinstance(s, int) else tuple(s)

    @property
    def size_multiple(self) -> int:
        """Latent sizes must be multiples of this (one halving per down level)."""
        return 2 ** (len(self.unet.config.block_out_channels) - 1)

    @property
    def distilled_guidance(self) -> bool:
        return guidance_embedding.distilled(self.unet.config)

    def with_attention(self, attention: str) -> UNetDenoiser:
        return dataclasses.replace(self, unet=self.unet.clone(attention=attention))

    def bind(self, params: dict, cond: Any, inputs: dict, *, cfg: bool) -> Callable[..., jax.Array]:
        context, added = cond
        unet_params = ops_conv.prepare(params[self.component])
        if self.distilled_guidance:  # LCM: the guidance enters as an embedding, one branch
            dim = int(self.unet.config.time_cond_proj_dim)
            added = {**added, "timestep_cond": guidance_embedding.guidance_embedding(inputs["guidance"], dim)}

        def model(x_in, t, **kwargs):
            return self.unet.apply({"params": unet_params}, x_in.astype(self.dtype), t, context, **added, **kwargs)

        return model
