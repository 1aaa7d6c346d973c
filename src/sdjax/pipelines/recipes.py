"""Two-pass recipes whose passes are planned as any request is (`sdjax.planning`): the SDXL base -> refiner hand-off and
AUTOMATIC1111's hires fix.

- base -> refiner: diffusers' "ensemble of experts". The base model denoises the first `switch` fraction of the
  schedule (`denoising_end`) and returns latents; the refiner continues from them, without new noise, over the
  rest (`denoising_start`), with its own text encoder and aesthetic-score conditioning.
- hires fix: A1111's "Hires. fix". Text-to-image at the base size, an upscale (in latent space: bilinear as
  A1111's "Latent", or nearest; or in pixels: Lanczos or nearest), then image-to-image at the target size. As in
  A1111 with "Hires steps" set, the second pass runs `hires_steps` steps (default: the first pass's) at the end
  of a schedule of `int(hires_steps / min(strength, 0.999))` steps.

`refine_arrays` and `hires_arrays` take per-image lists like `generate_arrays` (the CLI and the server use
them); `base_then_refiner` and `hires_fix` are the prompt-level conveniences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from sdjax import planning
from sdjax.pipelines.images import numpy_to_pil, to_uint8
from sdjax.policy import A1111, DIFFUSERS

UPSCALERS = ("latent", "latent-nearest", "lanczos", "nearest")


@dataclasses.dataclass(frozen=True)
class Hires:
    """Hires-fix settings: `scale` of the base size, or an explicit `resize` (width, height); `steps` 0 = the first
    pass's; `strength` of the second pass; `sampler` None = the first pass's."""

    scale: float = 2.0
    resize: tuple[int, int] | None = None
    upscaler: str = "latent"
    steps: int = 0
    strength: float = A1111.hires_strength
    sampler: str | None = None

    def __post_init__(self):
        if self.upscaler not in UPSCALERS:
            raise ValueError(f"hires upscaler={self.upscaler!r} must be one of {list(UPSCALERS)}")
        if not 0 < self.strength <= 1:
            raise ValueError(f"hires strength={self.strength} must lie in (0, 1]")
        if self.resize is None and not self.scale > 0:
            raise ValueError(f"hires scale={self.scale!r} must be a positive number")
        if self.steps < 0:
            raise ValueError(f"hires steps={self.steps} must be >= 0 (0: the first pass's)")

    def target(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the second pass: `resize` if given, else `int(side * scale)` (A1111)."""
        if self.resize is not None:
            return int(self.resize[1]), int(self.resize[0])
        return int(height * self.scale), int(width * self.scale)

    def window(self, first_steps: int) -> tuple[int, int]:
        """(schedule steps, first step) of the second pass."""
        steps = self.steps or first_steps
        total = int(steps / min(self.strength, 0.999))
        return total, total - steps


def upscale_latents(latents: np.ndarray, height: int, width: int, method: str) -> np.ndarray:
    """Latents `(N, C, h, w)` -> `(N, C, height, width)`: bilinear (half-pixel centres, no antialiasing, as
    `torch.nn.functional.interpolate(mode="bilinear")`) or nearest (torch's legacy nearest: floor(i * in / out))."""
    _, _, h, w = latents.shape
    if method == "latent-nearest":
        rows = np.floor(np.arange(height) * h / height).astype(int)
        cols = np.floor(np.arange(width) * w / width).astype(int)
        return latents[:, :, rows][:, :, :, cols]

    def axis(n_in, n_out):
        x = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        lo = np.floor(x).astype(int)
        return lo, np.minimum(lo + 1, n_in - 1), (x - lo).astype(np.float32)

    r0, r1, fr = axis(h, height)
    c0, c1, fc = axis(w, width)
    rows = latents[:, :, r0] * (1 - fr)[:, None] + latents[:, :, r1] * fr[:, None]
    return rows[..., c0] * (1 - fc) + rows[..., c1] * fc


def hires_arrays(
    pipe,
    prompts: Sequence[str],
    negative_prompts: Sequence[str],
    seeds: Sequence[int],
    image_indices: Sequence[int],
    guidance_scales: Sequence[float],
    *,
    steps: int,
    height: int,
    width: int,
    sampler=None,
    hires: Hires,
    output: str = "images",
    **kwargs: Any,
) -> np.ndarray:
    """Hires fix over per-image lists (as `generate_arrays`) -> images at the target size (uint8, or float with
    `output="float"`). `kwargs` go to both `generate_arrays` calls (pad_to, progress, should_stop, params, ...)."""
    th, tw = hires.target(height, width)
    pipe.validate(height=th, width=tw)
    total, start = hires.window(steps)
    args = (list(prompts), list(negative_prompts), list(seeds), list(image_indices), list(guidance_scales))
    latent = hires.upscaler.startswith("latent")
    first = pipe.generate_arrays(
        *args,
        steps=steps,
        height=height,
        width=width,
        sampler=sampler,
        output="latents" if latent else "float",
        **kwargs,
    )
    if latent:
        f = pipe.vae_scale_factor
        init = upscale_latents(np.asarray(first, np.float32), th // f, tw // f, hires.upscaler)
    else:
        from sdjax.core import images as image_lib

        resample = image_lib.Image.LANCZOS if hires.upscaler == "lanczos" else image_lib.Image.NEAREST
        init = [im.resize((tw, th), resample=resample) for im in numpy_to_pil(to_uint8(first))]
    # the second pass is image-to-image from the hires rule's own first step (not a policy's: `Hires.window`)
    inputs = planning.TaskInputs(image=init, strength=1.0, start_step=start)
    task = planning.plan_task(pipe, inputs, height=th, width=tw, count=len(args[0]), steps=total, policy=DIFFUSERS)
    return pipe.generate_arrays(
        *args, steps=total, height=th, width=tw, sampler=hires.sampler or sampler, task=task, output=output, **kwargs
    )


def refine_arrays(
    base,
    refiner,
    prompts: Sequence[str],
    negative_prompts: Sequence[str],
    seeds: Sequence[int],
    image_indices: Sequence[int],
    guidance_scales: Sequence[float],
    *,
    steps: int,
    height: int,
    width: int,
    switch: float = 0.8,
    sampler=None,
    refiner_sampler=None,
    output: str = "images",
    **kwargs: Any,
) -> np.ndarray:
    """Base for the first `switch` of the schedule, refiner for the rest, over per-image lists."""
    if not 0 < switch < 1:
        raise ValueError(f"the refiner switch {switch} must lie strictly between 0 and 1")
    if base.vae.config.latent_channels != refiner.vae.config.latent_channels:
        raise ValueError("base and refiner disagree on the latent channels: they are not an SDXL base/refiner pair")
    args = (list(prompts), list(negative_prompts), list(seeds), list(image_indices), list(guidance_scales))
    n = len(args[0])
    plan = dict(height=height, width=width, count=n, steps=steps, policy=DIFFUSERS)
    latents = base.generate_arrays(
        *args,
        steps=steps,
        height=height,
        width=width,
        sampler=sampler,
        task=planning.plan_task(base, planning.TaskInputs(denoising_end=switch), **plan),
        output="latents",
        **kwargs,
    )
    # the refiner continues the base's latents from `switch` (no new noise: diffusers' denoising_start hand-off)
    task = planning.plan_task(refiner, planning.TaskInputs(image=latents, denoising_start=switch), **plan)
    return refiner.generate_arrays(
        *args, steps=steps, height=height, width=width, sampler=refiner_sampler, task=task, output=output, **kwargs
    )


# ------------------------------------------------------------------------------------------- prompt level
def _expand(prompt, negative_prompt, num_images: int) -> tuple[list[str], list[str]]:
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    negs = (
        [negative_prompt or ""] * len(prompts)
        if not isinstance(negative_prompt, (list, tuple))
        else list(negative_prompt)
    )
    if len(negs) != len(prompts):
        raise ValueError(f"negative_prompt: got {len(negs)} for {len(prompts)} prompts")
    return [p for p in prompts for _ in range(num_images)], [q for q in negs for _ in range(num_images)]


def _finish(out: np.ndarray, output_type: str):
    if output_type not in ("pil", "np"):
        raise ValueError(f"output_type={output_type!r} must be 'pil' or 'np'")
    return out if output_type == "np" else numpy_to_pil(out)


def base_then_refiner(
    base,
    refiner,
    prompt: str | Sequence[str],
    negative_prompt=None,
    *,
    num_images: int = 1,
    seed: int = 0,
    steps: int | None = None,
    guidance_scale: float | None = None,
    height: int | None = None,
    width: int | None = None,
    high_noise_frac: float = 0.8,
    sampler=None,
    refiner_sampler=None,
    output_type: str = "pil",
    **kwargs: Any,
):
    """SDXL base for the first `high_noise_frac` of the schedule, the refiner for the rest -> images (PIL, or
    float arrays with `output_type="np"`). Image `i` uses `fold_in(PRNGKey(seed), i)` in both models."""
    prompts, negs = _expand(prompt, negative_prompt, num_images)
    n = len(prompts)
    dh, dw = base.default_size
    g = base.default_guidance_scale if guidance_scale is None else guidance_scale
    out = refine_arrays(
        base,
        refiner,
        prompts,
        negs,
        [seed] * n,
        list(range(n)),
        [g] * n,
        steps=steps or base.default_steps,
        height=height or dh,
        width=width or dw,
        switch=high_noise_frac,
        sampler=sampler,
        refiner_sampler=refiner_sampler,
        output="float" if output_type == "np" else "images",
        **kwargs,
    )
    return _finish(out, output_type)


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
    hires: Hires = Hires(),
    output_type: str = "pil",
    **kwargs: Any,
):
    """A1111's hires fix with `pipe` -> the second pass's images (PIL, or float arrays with "np")."""
    prompts, negs = _expand(prompt, negative_prompt, num_images)
    n = len(prompts)
    dh, dw = pipe.default_size
    g = pipe.default_guidance_scale if guidance_scale is None else guidance_scale
    out = hires_arrays(
        pipe,
        prompts,
        negs,
        [seed] * n,
        list(range(n)),
        [g] * n,
        steps=steps or pipe.default_steps,
        height=height or dh,
        width=width or dw,
        sampler=sampler,
        hires=hires,
        output="float" if output_type == "np" else "images",
        **kwargs,
    )
    return _finish(out, output_type)
