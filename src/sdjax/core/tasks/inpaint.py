"""Inpainting (diffusers `StableDiffusionInpaintPipeline` / `StableDiffusionXLInpaintPipeline`): white mask pixels
are repainted, black ones kept.

- An inpainting model (whose input has 2C + 1 channels for C latent channels: 9 with a 4-channel VAE) sees,
  after the scaled latents, the mask at latent resolution and the VAE latents of the masked image
  (`image * (mask < 0.5)`), concatenated along channels: a `model_input` hook.
- Any plain model (C input channels) inpaints by latent blending: after each step the kept region is replaced by
  the init image's latents noised to the next step's level (clean after the last step): an `after_step` hook.
- Strength 1 starts from pure noise (times `init_noise_sigma`), lower strengths from the noised init image.
- `padding_mask_crop` (A1111's "inpaint only masked"): the region around the mask, widened to the output's aspect
  ratio, is cropped, repainted at full resolution and pasted back; `paste_back` composites the original over the
  result where the mask is black (soft where a blurred mask is grey), so unmasked pixels come back exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax import rng
from sdjax.core import images as image_lib
from sdjax.core.loop import Hook
from sdjax.core.tasks.base import Context, TaskRequest, TaskSpec


@dataclasses.dataclass(frozen=True)
class Inpaint(TaskSpec):
    """`from_noise`: strength 1 (start from pure noise); `add_noise`: False for the `denoising_start` hand-off."""

    from_noise: bool = False
    add_noise: bool = True
    fill: str = "original"  # the masked region's starting latents: A1111's "original", "latent noise", "latent nothing"

    name = "inpaint"
    inputs = ("image", "mask")

    def __post_init__(self):
        if self.fill not in LATENT_FILLS:
            raise ValueError(f"inpainting fill={self.fill!r} must be one of {list(LATENT_FILLS)}")

    def prepare(self, ctx: Context, inputs):
        image, mask = inputs["image"].astype(jnp.float32), inputs["mask"].astype(jnp.float32)
        channels = ctx.shape[1]
        nine = ctx.model_in_channels == 2 * channels + 1
        if not nine and ctx.model_in_channels != channels:
            raise ValueError(
                f"inpainting needs a model with {channels} (latent blending) or {2 * channels + 1} "
                f"(inpainting model) input channels, this one has {ctx.model_in_channels}"
            )
        f = image.shape[-1] // ctx.shape[-1]
        mask_latent = mask[:, :, ::f, ::f]  # nearest, as torch.nn.functional.interpolate's default
        image_latents = None
        if not nine or not self.from_noise or not self.add_noise or self.fill != "original":
            image_latents = ctx.encode(image, rng.ENCODE_IMAGE)
        if self.fill == "latent noise":  # A1111: the masked region starts from fresh noise before it is noised
            fresh = rng.per_image_normal(ctx.keys, rng.FILL_NOISE, ctx.shape[1:])
            image_latents = image_latents * (1 - mask_latent) + fresh * mask_latent
        elif self.fill == "latent nothing":
            image_latents = image_latents * (1 - mask_latent)
        if not self.add_noise:
            latents = image_latents
        elif self.from_noise:
            latents = ctx.noise * ctx.sampler.init_noise_sigma(ctx.state)
        else:
            latents = ctx.noised_start(image_latents)
        if nine:
            masked_latents = ctx.encode(image * (mask < 0.5), rng.ENCODE_MASKED_IMAGE)
            return latents, [MaskedImageInput(mask_latent, masked_latents, ctx.cfg)]
        return latents, [LatentBlend(ctx, image_latents, mask_latent)]


LATENT_FILLS = ("original", "latent noise", "latent nothing")


@dataclasses.dataclass(frozen=True)
class MaskedImageInput(Hook):
    """Inpainting models (2C + 1 input channels): concatenate the latent mask and the masked image's latents after
    the model input."""

    mask: jax.Array
    masked_latents: jax.Array
    cfg: bool

    def model_input(self, step, x_in):
        extra = jnp.concatenate([self.mask, self.masked_latents], axis=1)
        if self.cfg:
            extra = jnp.concatenate([extra, extra])
        return jnp.concatenate([x_in, extra.astype(x_in.dtype)], axis=1)


@dataclasses.dataclass(frozen=True)
class LatentBlend(Hook):
    """Plain models (C input channels): keep the init image's latents, noised to the next step's level, outside
    the mask."""

    ctx: Context
    image_latents: jax.Array
    mask: jax.Array

    def after_step(self, step, x, state):
        ctx, nxt = self.ctx, step + 1
        noised = ctx.add_noise_at(self.image_latents, jnp.minimum(nxt, ctx.calls - 1))
        proper = jnp.where(nxt < ctx.end, noised, self.image_latents)
        return (1 - self.mask) * proper + self.mask * x


def request(
    images: Sequence[Any],
    masks: Sequence[Any],
    *,
    width: int,
    height: int,
    strength: float = 1.0,
    resize_mode: str = "resize",
    mask_blur: float = 0.0,
    padding_mask_crop: int | None = None,
    paste_back: bool | None = None,
    denoising_start: float | None = None,
    denoising_end: float | None = None,
    start_step: int | None = None,
    fill: str = "original",
    invert_mask: bool = False,
) -> TaskRequest:
    """Inpaint `images` where `masks` are white (black with `invert_mask`). `fill` is what the masked region starts
    from: "original" (the image, noised), "fill" (the image with the masked region filled by blurred surrounding
    colours, A1111's "fill"), "latent noise" or "latent nothing" (A1111's latent fills). Images and masks are
    loaded, (cropped,) resized to `width` x `height`; `paste_back` (default: on with `padding_mask_crop`)
    composites the originals back."""
    images = [image_lib.load_image(im, "image") for im in images]
    masks = [image_lib.load_image(m, "mask_image") for m in masks]
    image_lib.check_same_size(images, masks)
    if fill not in ("fill", *LATENT_FILLS):
        raise ValueError(f"fill={fill!r} must be one of {['fill', *LATENT_FILLS]}")
    if invert_mask:
        from PIL import ImageOps

        masks = [ImageOps.invert(m.convert("L")) for m in masks]
    masks = [image_lib.blur_mask(m, mask_blur) for m in masks]
    if fill == "fill":
        images = [image_lib.fill_masked(im, m) for im, m in zip(images, masks)]
    boxes = [None] * len(images)
    if padding_mask_crop is not None:
        if padding_mask_crop < 0:
            raise ValueError(f"padding_mask_crop={padding_mask_crop} must be >= 0")
        boxes = [image_lib.crop_region(m, width, height, padding_mask_crop) for m in masks]
        mode = "fill"
        model_images = [image_lib.resize(im.crop(b), width, height, mode) for im, b in zip(images, boxes)]
        model_masks = [image_lib.resize(m.crop(b), width, height, mode) for m, b in zip(masks, boxes)]
    else:
        model_images = [image_lib.resize(im, width, height, resize_mode) for im in images]
        model_masks = [image_lib.resize(m, width, height, resize_mode) for m in masks]
    arrays = {
        "image": np.stack([image_lib.image_array(im) for im in model_images]),
        "mask": np.stack([image_lib.mask_array(m) for m in model_masks]),
    }
    if not arrays["mask"].any():
        raise ValueError("mask_image: the mask is empty (no pixel >= 0.5), there is nothing to repaint")
    from_noise = strength == 1.0 and denoising_start is None and start_step is None
    spec = Inpaint(
        from_noise=from_noise, add_noise=denoising_start is None, fill=fill if fill in LATENT_FILLS else "original"
    )
    paste_back = padding_mask_crop is not None if paste_back is None else paste_back
    finish = None
    if paste_back:
        originals = images if padding_mask_crop is not None else model_images
        keep_masks = masks if padding_mask_crop is not None else model_masks

        def finish(generated: np.ndarray) -> np.ndarray:
            from PIL import Image

            out = [
                np.asarray(image_lib.paste_back(o.convert("RGB"), m, Image.fromarray(g), b))
                for o, m, g, b in zip(originals, keep_masks, generated, boxes)
            ]
            if len({a.shape for a in out}) != 1:
                raise ValueError("paste_back: the original images differ in size; inpaint them in separate calls")
            return np.stack(out)

    return TaskRequest(
        spec,
        arrays,
        strength=strength,
        denoising_start=denoising_start,
        denoising_end=denoising_end,
        finish=finish,
        start_step=start_step,
    )
