"""The Stable Diffusion 3 / 3.5 denoiser: diffusers' `SD3Transformer2DModel` behind the core's one call, with
skip-layer guidance and ControlNet block samples.

The loop and the samplers see the latents `(B, 16, h, w)`, as the transformer does (it patchifies them itself); the
timestep is the sampler's t in [0, 1000], passed on as StableDiffusion3Pipeline does; the output is the predicted
flow velocity.

Skip-layer guidance (SLG; diffusers' `skip_guidance_layers`, recommended by Stability AI for SD 3.5 medium): on the
steps it covers, a third transformer call on the conditional branch leaves the blocks `skip_layers` out, and
diffusers adds `scale * (cond - cond_skip)` to the guided prediction `uncond + g (cond - uncond)`. The core loop
forms that guided prediction itself from the stacked `(uncond, cond)` output, so the denoiser returns the
conditional half as `cond + (scale / g) (cond - cond_skip)`: the loop's `uncond + g (cond' - uncond)` is then
exactly diffusers' sum (g > 1 wherever it applies: SLG runs only under classifier-free guidance, and an image whose
scale is <= 1 gets no SLG, as the loop takes its conditional prediction alone). Which steps it covers is per image:
`inputs["slg_timesteps"]` holds the model timesteps of the first and last covered step (the pipeline derives them
from diffusers' step rule), so a call applies SLG when `t_last <= t <= t_first` (timesteps decrease along the
schedule). The third call runs (under `lax.cond`) only on steps where some image needs it. `skip_layers` is static
(part of the compiled program); the scale and the steps are inputs.

A ControlNet's hook (`families.sd3.controlnet`) hands the model `controlnet_block_samples`, which the transformer adds
to its image stream (`models.sd3`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from sdjax.models.sd3 import check_skip_layers


@dataclasses.dataclass(frozen=True, eq=False)
class SD3Denoiser:
    """A `core.protocols.Denoiser` over `models.sd3.SD3Transformer2DModel` (params under "transformer");
    `skip_layers`: the transformer blocks skip-layer guidance leaves out (empty: no SLG call is traced)."""

    transformer: Any
    dtype: Any = jnp.float32
    skip_layers: tuple[int, ...] = ()

    component = "transformer"
    distilled_guidance = False  # SD 3.5 large turbo is run with guidance 0 (one branch), not an embedded scale

    def __post_init__(self):
        layers = check_skip_layers(self.skip_layers, self.transformer.config.num_layers)
        object.__setattr__(self, "skip_layers", tuple(sorted(layers)))

    @property
    def config(self) -> Any:
        return self.transformer.config

    @property
    def in_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    @property
    def sample_size(self) -> tuple[int, int]:
        """The default latent size (the config's `sample_size`: 128, i.e. 1024 pixels)."""
        s = int(self.transformer.config.sample_size)
        return s, s

    @property
    def size_multiple(self) -> int:
        """Latent sizes must be multiples of the patch size."""
        return int(self.transformer.config.patch_size)

    def with_attention(self, attention: str) -> SD3Denoiser:
        return dataclasses.replace(self, transformer=self.transformer.clone(attention=attention))

    def with_skip_layers(self, layers: Iterable[int]) -> SD3Denoiser:
        return dataclasses.replace(self, skip_layers=tuple(layers))

    def bind(self, params: dict, cond: Any, inputs: dict, *, cfg: bool) -> Callable[..., jax.Array]:
        text = cond["text"].astype(self.dtype)
        pooled = cond["pooled"].astype(self.dtype)
        variables = {"params": params[self.component]}
        slg = bool(self.skip_layers) and cfg
        if slg:
            g = inputs["guidance"].astype(jnp.float32)
            weight = jnp.where(g > 1, inputs["slg_scale"].astype(jnp.float32) / jnp.where(g > 1, g, 1.0), 0.0)
            t_first, t_last = (inputs["slg_timesteps"][:, k].astype(jnp.float32) for k in (0, 1))

        def call(x, t, text, pooled, skip_layers=(), samples=None):
            timestep = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (x.shape[0],))
            out = self.transformer.apply(variables, x.astype(self.dtype), text, pooled, timestep, skip_layers, samples)
            return out.astype(jnp.float32)

        def model(x_in, t, controlnet_block_samples=None, **kwargs):
            if kwargs:
                raise TypeError(f"the SD 3 transformer takes controlnet_block_samples only, got {sorted(kwargs)}")
            samples = controlnet_block_samples  # a ControlNet's (families.sd3.controlnet), or None
            out = call(x_in, t, text, pooled, samples=samples)
            if not slg:
                return out
            b = out.shape[0] // 2
            uncond, cond_out = out[:b], out[b:]
            active = (t <= t_first) & (t >= t_last) & (weight != 0)

            def skipped(_):
                cond_samples = None if samples is None else tuple(s[b:] for s in samples)
                return call(x_in[b:], t, text[b:], pooled[b:], self.skip_layers, cond_samples)

            cond_skip = jax.lax.cond(jnp.any(active), skipped, lambda _: cond_out, None)
            w = jnp.where(active, weight, 0.0).reshape((-1,) + (1,) * (out.ndim - 1))
            return jnp.concatenate([uncond, cond_out + w * (cond_out - cond_skip)])

        return model
