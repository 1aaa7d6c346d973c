"""Where diffusers' pipelines and AUTOMATIC1111's web UI mean different things by the same request, in one place.

sdjax has two kinds of caller. The Python API follows diffusers: each pipeline class's own defaults
(`DiffusionPipeline.default_strength`: `StableDiffusionImg2ImgPipeline` 0.8 and `...InpaintPipeline` 1.0,
`StableDiffusionXLImg2ImgPipeline` 0.3 and `...InpaintPipeline` 0.9999, Flux and SD 3 0.6), samplers by scheduler
class, prompts as plain text. The faces (the CLI, the A1111 and OpenAI endpoints, infotext) follow
AUTOMATIC1111/Forge, whatever the model: denoising strength 0.75, the hires pass at 0.7, A1111's image-to-image
step rule, the original pasted back outside an inpainting mask. `DIFFUSERS` and `A1111` hold those once; the task
planner (`sdjax.planning.plan_task`) applies them, and a module that needs a value reads it here instead of writing
the number again. (Sampler names and the prompt syntax are told apart where they are parsed: `infotext.sampler_id`,
`text.prompt_syntax`.)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Policy:
    """One tradition's meanings of a request (see the module docstring)."""

    name: str
    # image-to-image / inpainting denoising strength when a request gives none; None: the pipeline class's own
    # (`DiffusionPipeline.default_strength`, diffusers' defaults)
    strength: float | None
    hires_strength: float  # the hires pass's denoising strength
    a1111_steps: bool = False  # image-to-image runs A1111's step count (`a1111_start_step`), not diffusers'
    paste_back: bool | None = None  # inpainting composites the original back; None: only with a padding crop

    def start_step(self, steps: int | None, strength: float) -> int | None:
        """The first sampler step of an image-to-image run, or None for diffusers' rule (decided in the task)."""
        if not self.a1111_steps:
            return None
        if steps is None:
            raise ValueError(f"the {self.name} policy's image-to-image step rule needs the step count")
        return a1111_start_step(steps, strength)


def a1111_start_step(steps: int, strength: float) -> int:
    """AUTOMATIC1111's first img2img step: `t_enc = int(min(strength, 0.999) * steps)` steps run after it, plus one
    (`sigmas[steps - t_enc - 1:]` in its k-diffusion sampler)."""
    t_enc = int(min(strength, 0.999) * steps)
    return steps - t_enc - 1


# diffusers' hires strength does not exist (no hires fix there); the Python API's `Hires` recipe uses A1111's 0.7
DIFFUSERS = Policy("diffusers", strength=None, hires_strength=0.7)
A1111 = Policy("a1111", strength=0.75, hires_strength=0.7, a1111_steps=True, paste_back=True)
