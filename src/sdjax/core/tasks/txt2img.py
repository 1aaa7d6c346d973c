"""Text to image: start from noise scaled by the sampler's `init_noise_sigma` (diffusers' `prepare_latents`)."""

from __future__ import annotations

import dataclasses

from sdjax.core.tasks.base import Context, TaskRequest, TaskSpec


@dataclasses.dataclass(frozen=True)
class Txt2Img(TaskSpec):
    name = "txt2img"

    def prepare(self, ctx: Context, inputs):
        if ctx.model_in_channels != ctx.shape[1]:
            raise ValueError(
                f"this model takes {ctx.model_in_channels} input channels (an inpainting model): "
                f"text-to-image needs a plain {ctx.shape[1]}-channel model; give image= and mask_image= "
                f"to inpaint"
            )
        return ctx.noise * ctx.sampler.init_noise_sigma(ctx.state), []


def request(*, denoising_end: float | None = None) -> TaskRequest:
    """Text to image; `denoising_end` stops early (a base -> refiner hand-off returns latents there)."""
    return TaskRequest(Txt2Img(), denoising_end=denoising_end)
