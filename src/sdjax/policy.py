"""Where diffusers' pipelines and AUTOMATIC1111's web UI mean different things by the same request, in one place.

sdjax has two kinds of caller. The Python API follows diffusers: each pipeline class's own defaults
(`DiffusionPipeline.default_strength`: `StableDiffusionImg2ImgPipeline` 0.8 and `...InpaintPipeline` 1.0,
`StableDiffusionXLImg2ImgPipeline` 0.3 and `...InpaintPipeline` 0.9999, Flux and SD 3 0.6), samplers by scheduler
class, prompts as plain text. The faces (the CLI, the A1111 and OpenAI endpoints, infotext) follow
AUTOMATIC1111/Forge, whatever the model: denoising strength 0.75, the hires pass at 0.7. `A1111` holds those once;
a module that needs one reads it here instead of writing the number again. (Sampler names and the prompt syntax
are told apart where they are parsed: `metadata.sampler_id`, `text.prompt_syntax`.)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Policy:
    """The defaults of the faces' tradition (see the module docstring)."""

    name: str
    strength: float  # image-to-image / inpainting denoising strength when a request gives none
    hires_strength: float  # the hires pass's denoising strength


A1111 = Policy("a1111", strength=0.75, hires_strength=0.7)
