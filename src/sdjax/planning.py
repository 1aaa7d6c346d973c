"""The one place where a request's task is decided: text-to-image, image-to-image or inpainting, from what the
request gives, checked against the model, with the caller's meanings (`sdjax.policy`) applied.

Every way into a generation builds its task here. The Python API (`DiffusionPipeline.__call__` / `generate`) plans
under `DIFFUSERS`: the pipeline class's default strength and diffusers' step rule (`int(strength * steps)` steps).
The faces (the CLI, the A1111 and OpenAI endpoints, infotext; `metadata.generate_images`) plan under `A1111`:
strength 0.75 when none is given, A1111's step rule (`int(min(s, 0.999) * steps) + 1` steps) and the original
pasted back outside the mask. The same inputs, the same checks and the same core task requests
(`sdjax.core.tasks`) either way; only the policy's fields differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from sdjax.core.tasks import TaskRequest, img2img, inpaint, txt2img
from sdjax.policy import Policy

TASKS = ("txt2img", "img2img", "inpaint")


def task_name(image: Any, mask_image: Any) -> str:
    """The task a request's inputs ask for: an init image makes image-to-image, an init image and a mask
    inpainting (a mask alone is refused by `plan_task`)."""
    if image is None:
        return "txt2img"
    return "img2img" if mask_image is None else "inpaint"


@dataclasses.dataclass(frozen=True)
class TaskInputs:
    """What a request gives for its task. `image` / `mask_image`: one or a list (one per image) of PIL images,
    arrays, paths or bytes; `image` may also be denoiser latents `(N, C, h, w)` (a base model's output for a
    refiner). `strength` None: the policy's default. `paste_back` None: the policy's default (diffusers: only with
    `padding_mask_crop`). `fill` / `invert_mask`: A1111's masked content and mask mode. `start_step`: the first
    sampler step, set by a recipe with its own step rule (AUTOMATIC1111's hires pass) instead of the policy's."""

    image: Any = None
    mask_image: Any = None
    strength: float | None = None
    resize_mode: str = "resize"
    mask_blur: float = 0.0
    padding_mask_crop: int | None = None
    paste_back: bool | None = None
    fill: str = "original"
    invert_mask: bool = False
    denoising_start: float | None = None
    denoising_end: float | None = None
    start_step: int | None = None  # an explicit first step (a recipe's own rule: the hires pass); beats the policy's

    @property
    def task(self) -> str:
        return task_name(self.image, self.mask_image)


def default_strength(pipe: Any, task: str, policy: Policy) -> float:
    """The denoising strength when a request gives none: the policy's, else the pipeline class's (diffusers)."""
    return policy.strength if policy.strength is not None else pipe.default_strength[task]


def plan_task(
    pipe: Any, inputs: TaskInputs, *, height: int, width: int, count: int, steps: int | None, policy: Policy
) -> TaskRequest:
    """The core task request for `inputs` (`count` images of `height` x `width`, `steps` sampler steps; `steps`
    may be None under a policy that does not use it), checked against `pipe`'s model; raises ValueError naming the
    argument before anything compiles."""
    image, mask_image = inputs.image, inputs.mask_image
    if image is None:
        if mask_image is not None:
            raise ValueError("mask_image= needs image= (the image to inpaint)")
        if inputs.strength is not None or inputs.denoising_start is not None:
            raise ValueError("strength= and denoising_start= need image= (they set how much of it to keep)")
        _check_not_inpainting_model(pipe, "pass image= and mask_image=")
        return txt2img.request(denoising_end=inputs.denoising_end)
    images = image if isinstance(image, (list, tuple)) else [image]
    common = dict(
        width=width, height=height, denoising_start=inputs.denoising_start, denoising_end=inputs.denoising_end
    )
    if is_latents(images[0], pipe.vae.config.latent_channels):
        if mask_image is not None:
            raise ValueError("image= given as latents cannot be inpainted here; pass pixels")
        latents = np.concatenate([np.asarray(x, np.float32) for x in images])
        strength = 1.0 if inputs.strength is None else inputs.strength
        return img2img.request(
            [], strength=strength, latents=repeat(latents, count, "image"), start_step=inputs.start_step, **common
        )
    images = repeat_list(images, count, "image")
    task = inputs.task
    strength = default_strength(pipe, task, policy) if inputs.strength is None else inputs.strength
    start_step = policy.start_step(steps, strength) if inputs.start_step is None else inputs.start_step
    if mask_image is None:
        _check_not_inpainting_model(pipe, "it needs mask_image= as well as image=")
        return img2img.request(
            images, strength=strength, resize_mode=inputs.resize_mode, start_step=start_step, **common
        )
    masks = repeat_list(mask_image if isinstance(mask_image, (list, tuple)) else [mask_image], count, "mask_image")
    return inpaint.request(
        images,
        masks,
        strength=strength,
        resize_mode=inputs.resize_mode,
        mask_blur=inputs.mask_blur,
        padding_mask_crop=inputs.padding_mask_crop,
        paste_back=policy.paste_back if inputs.paste_back is None else inputs.paste_back,
        start_step=start_step,
        fill=inputs.fill,
        invert_mask=inputs.invert_mask,
        **common,
    )


def task_size(pipe: Any, inputs: TaskInputs, height: int | None, width: int | None) -> tuple[int, int]:
    """The output size: given, else the init image's (image-to-image, inpainting; from latents their size times
    the VAE's factor), else the model's default."""
    image = inputs.image
    if image is None or is_latents(first(image), pipe.vae.config.latent_channels):
        if image is not None and height is None and width is None:
            z = np.asarray(first(image))
            return z.shape[-2] * pipe.vae_scale_factor, z.shape[-1] * pipe.vae_scale_factor
        dh, dw = pipe.default_size
        return height or dh, width or dw
    if height is not None and width is not None:
        return height, width
    from sdjax.core import images as image_lib

    loaded = image_lib.load_image(first(image), "image")
    w0, h0 = loaded.size
    height, width = height or h0, width or w0
    multiple = pipe._size_multiple()
    if height % multiple or width % multiple:
        raise ValueError(
            f"image is {w0}x{h0}, not a multiple of {multiple} for this model: pass width= and height= (the image "
            "is then resized) or resize it"
        )
    return height, width


def _check_not_inpainting_model(pipe: Any, advice: str) -> None:
    if pipe.is_inpainting_model:
        raise ValueError(
            f"this model's denoiser takes {pipe.denoiser.in_channels} input channels (an inpainting model): {advice}"
        )


def first(image: Any) -> Any:
    return image[0] if isinstance(image, (list, tuple)) else image


def is_latents(x: Any, channels: int) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) == 4 and np.shape(x)[1] == channels


def repeat(x: np.ndarray, n: int, name: str) -> np.ndarray:
    if x.shape[0] == n:
        return x
    if x.shape[0] == 1:
        return np.repeat(x, n, axis=0)
    raise ValueError(f"{name}: got {x.shape[0]} for {n} images; pass one, or one per image")


def repeat_list(items: list, n: int, name: str) -> list:
    if len(items) == n:
        return list(items)
    if len(items) == 1:
        return list(items) * n
    raise ValueError(f"{name}: got {len(items)} for {n} images; pass one, or one per image")
