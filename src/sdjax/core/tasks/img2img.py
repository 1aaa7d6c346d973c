"""Image to image (diffusers `StableDiffusionImg2ImgPipeline` / `StableDiffusionXLImg2ImgPipeline`).

The init image is encoded by the VAE (a posterior sample, drawn from the image's key), then noised to the level
of the window's first model call with the sampler's own `add_noise` (for sigma-space samplers x0 + sigma eps: the
old Flax pipeline multiplied that by `init_noise_sigma` again, which is wrong, and is not repeated here). With
`denoising_start` (a refiner's hand-off) the given latents continue as they are, without new noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from sdjax import rng
from sdjax.core import images as image_lib
from sdjax.core.tasks.base import Context, TaskRequest, TaskSpec


@dataclasses.dataclass(frozen=True)
class Img2Img(TaskSpec):
    """`add_noise`: False for the `denoising_start` hand-off; `latents_input`: the image is given as the denoiser's
    latents `(B, C, h, w)` (as diffusers accepts 4-channel `image` tensors) instead of pixels."""

    add_noise: bool = True
    latents_input: bool = False

    name = "img2img"

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("image_latents",) if self.latents_input else ("image",)

    def prepare(self, ctx: Context, inputs):
        if ctx.model_in_channels != ctx.shape[1]:
            raise ValueError(
                f"this model takes {ctx.model_in_channels} input channels (an inpainting model): "
                f"image-to-image needs a plain {ctx.shape[1]}-channel model; give mask_image= to inpaint"
            )
        x0 = inputs["image_latents"] if self.latents_input else ctx.encode(inputs["image"], rng.ENCODE_IMAGE)
        return (ctx.noised_start(x0) if self.add_noise else x0), []


def prepare_images(
    images: Sequence[Any],
    width: int | None,
    height: int | None,
    *,
    resize_mode: str = "resize",
    multiple: int = 8,
    name: str = "image",
) -> tuple[list, int, int]:
    """Load `images`, pick the size (default: the first image's, which must then be a multiple of `multiple`) and
    resize every image to it -> (PIL images at the target size, width, height)."""
    pil = [image_lib.load_image(im, name if len(images) == 1 else f"{name}[{i}]") for i, im in enumerate(images)]
    if width is None or height is None:
        w0, h0 = pil[0].size
        width, height = width or w0, height or h0
        if width % multiple or height % multiple:
            raise ValueError(
                f"{name} is {w0}x{h0}, not a multiple of {multiple} for this model: pass width= and "
                f"height= (the image is then resized by resize_mode={resize_mode!r}) or resize it"
            )
    return [image_lib.resize(im, width, height, resize_mode) for im in pil], width, height


def request(
    images: Sequence[Any],
    *,
    width: int,
    height: int,
    strength: float = 0.8,
    resize_mode: str = "resize",
    denoising_start: float | None = None,
    denoising_end: float | None = None,
    latents: np.ndarray | None = None,
    start_step: int | None = None,
) -> TaskRequest:
    """Image-to-image for `images` (PIL, numpy, paths or bytes; resized to `width` x `height` by `resize_mode`),
    or for the denoiser's `latents` `(N, C, h, w)` (e.g. a base model's output before a refiner). `start_step` starts at
    that step instead of the one `strength` gives (A1111's rule, see `sdjax.metadata`)."""
    if latents is not None:
        arrays = {"image_latents": np.asarray(latents, np.float32)}
        spec = Img2Img(add_noise=denoising_start is None, latents_input=True)
    else:
        arrays = {
            "image": np.stack(
                [
                    image_lib.image_array(
                        image_lib.resize(image_lib.load_image(im, "image"), width, height, resize_mode)
                    )
                    for im in images
                ]
            )
        }
        spec = Img2Img(add_noise=denoising_start is None)
    return TaskRequest(
        spec,
        arrays,
        strength=strength,
        denoising_start=denoising_start,
        denoising_end=denoising_end,
        start_step=start_step,
    )
