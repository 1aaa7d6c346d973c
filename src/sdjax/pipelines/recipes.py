"""Two-pass recipes composed from the core's tasks: the SDXL base -> refiner hand-off and AUTOMATIC1111's hires fix.

- `base_then_refiner`: diffusers' "ensemble of experts". The base model denoises the first `high_noise_frac` of
  the schedule (`denoising_end`) and returns latents; the refiner continues from them, without new noise, over the
  rest (`denoising_start`), with its own text encoder and aesthetic-score conditioning.
- `hires_fix`: A1111's "Hires. fix". Text-to-image at the base size, an upscale (in latent space: bilinear as
  A1111's "Latent", or nearest; or in pixels: Lanczos), then image-to-image at the target size. As in A1111 with
  "Hires steps" set, the second pass runs `hires_steps` steps (default: the first pass's) at the end of a schedule
  of `int(hires_steps / min(strength, 0.999))` steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sdjax.core.tasks import TaskRequest
from sdjax.core.tasks.img2img import Img2Img
from sdjax.pipelines.images import numpy_to_pil, to_uint8

UPSCALERS = ("latent", "latent-nearest", "lanczos", "nearest")


def base_then_refiner(
    base,
    refiner,
    prompt: str | Sequence[str],
    negative_prompt=None,
    *,
    num_images: int = 1,
    seed: int = 0,
    steps: int | None = None,
    refiner_steps: int | None = None,
    guidance_scale: float | None = None,
    refiner_guidance_scale: float | None = None,
    height: int | None = None,
    width: int | None = None,
    high_noise_frac: float = 0.8,
    sampler=None,
    refiner_sampler=None,
    output_type: str = "pil",
    progress=None,
    **conditioning,
):
    """SDXL base for the first `high_noise_frac` of the schedule, the refiner for the rest -> images."""
    if not 0 < high_noise_frac < 1:
        raise ValueError(f"high_noise_frac={high_noise_frac} must lie strictly between 0 and 1")
    if base.vae.config.latent_channels != refiner.vae.config.latent_channels:
        raise ValueError("base and refiner disagree on the latent channels: they are not an SDXL base/refiner pair")
    latents = base.generate(
        prompt,
        negative_prompt,
        num_images=num_images,
        seed=seed,
        steps=steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        sampler=sampler,
        denoising_end=high_noise_frac,
        output_type="latent",
        progress=progress,
        **conditioning,
    )
    return refiner.generate(
        prompt,
        negative_prompt,
        num_images=num_images,
        seed=seed,
        steps=refiner_steps or steps,
        guidance_scale=refiner_guidance_scale or guidance_scale,
        sampler=refiner_sampler,
        image=latents,
        denoising_start=high_noise_frac,
        output_type=output_type,
        progress=progress,
    )


def hires_target(height: int, width: int, scale: float | None = None, resize: tuple[int, int] | None = None):
    """The second pass's size: `resize` (height, width) if given, else the base size times `scale` (A1111:
    `int(side * scale)`)."""
    if resize is not None:
        return int(resize[0]), int(resize[1])
    if scale is None or not scale > 0:
        raise ValueError(f"hires scale={scale!r} must be a positive number")
    return int(height * scale), int(width * scale)


def hires_window(hires_steps: int, strength: float) -> tuple[int, int]:
    """(schedule steps, first step) of A1111's second pass: `hires_steps` steps at the end of a longer schedule."""
    if not 0 < strength <= 1:
        raise ValueError(f"hires strength={strength} must lie in (0, 1]")
    total = int(hires_steps / min(strength, 0.999))
    return total, total - hires_steps


def upscale_latents(latents: np.ndarray, height: int, width: int, method: str) -> np.ndarray:
    """Latents `(N, C, h, w)` -> `(N, C, height, width)`: bilinear (half-pixel centres, no antialiasing, as
    `torch.nn.functional.interpolate(mode="bilinear")`) or nearest (torch's legacy nearest: floor(i * in / out))."""
    n, c, h, w = latents.shape
    if method == "latent-nearest":
        rows = np.floor(np.arange(height) * h / height).astype(int)
        cols = np.floor(np.arange(width) * w / width).astype(int)
        return latents[:, :, rows][:, :, :, cols]

    def axis(n_in, n_out):
        x = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
        x = np.clip(x, 0, n_in - 1)
        lo = np.floor(x).astype(int)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, (x - lo).astype(np.float32)

    r0, r1, fr = axis(h, height)
    c0, c1, fc = axis(w, width)
    top = latents[:, :, r0] * (1 - fr)[:, None] + latents[:, :, r1] * fr[:, None]
    return top[..., c0] * (1 - fc) + top[..., c1] * fc


def hires_fix(
    pipe,
    prompt: str | Sequence[str],
    negative_prompt=None,
    *,
    num_images: int = 1,
    seed: int = 0,
    steps: int | None = None,
    guidance_scale: float | None = None,
    height: int | None = None,
    width: int | None = None,
    sampler=None,
    scale: float | None = 2.0,
    resize: tuple[int, int] | None = None,
    upscaler: str = "latent",
    hires_steps: int | None = None,
    strength: float = 0.7,
    hires_sampler=None,
    output_type: str = "pil",
    progress=None,
    params: dict | None = None,
    **conditioning,
) -> Any:
    """A1111's hires fix with `pipe`; returns the second pass's images (PIL, or float arrays with "np")."""
    if upscaler not in UPSCALERS:
        raise ValueError(f"upscaler={upscaler!r} must be one of {list(UPSCALERS)}")
    dh, dw = pipe.default_size
    height, width = height or dh, width or dw
    th, tw = hires_target(height, width, scale, resize)
    pipe.validate(height=th, width=tw)
    steps = pipe.default_steps if steps is None else steps
    total, start = hires_window(hires_steps or steps, strength)
    latent = upscaler.startswith("latent")
    first = pipe.generate(
        prompt,
        negative_prompt,
        num_images=num_images,
        seed=seed,
        steps=steps,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        sampler=sampler,
        output_type="latent" if latent else "np",
        progress=progress,
        params=params,
        **conditioning,
    )
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    negs = (
        [negative_prompt or ""] * len(prompts)
        if not isinstance(negative_prompt, (list, tuple))
        else list(negative_prompt)
    )
    all_prompts = [p for p in prompts for _ in range(num_images)]
    all_negs = [q for q in negs for _ in range(num_images)]
    n = len(all_prompts)
    if latent:
        f = pipe.vae_scale_factor
        up = upscale_latents(np.asarray(first, np.float32), th // f, tw // f, upscaler)
        task = TaskRequest(Img2Img(latents_input=True), {"image_latents": up}, start_step=start)
    else:
        from sdjax.core import images as image_lib

        resample = image_lib.Image.LANCZOS if upscaler == "lanczos" else image_lib.Image.NEAREST
        pil = [im.resize((tw, th), resample=resample) for im in numpy_to_pil(to_uint8(first))]
        task = TaskRequest(Img2Img(), {"image": np.stack([image_lib.image_array(im) for im in pil])}, start_step=start)
    g = pipe.default_guidance_scale if guidance_scale is None else guidance_scale
    out = pipe.generate_arrays(
        all_prompts,
        all_negs,
        [seed] * n,
        list(range(n)),
        [g] * n,
        steps=total,
        height=th,
        width=tw,
        sampler=hires_sampler or sampler,
        task=task,
        progress=progress,
        params=params,
        output="float" if output_type == "np" else "images",
        **conditioning,
    )
    return out if output_type == "np" else numpy_to_pil(out)
