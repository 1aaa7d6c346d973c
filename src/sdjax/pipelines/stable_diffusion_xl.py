"""Stable Diffusion XL with the API of Diffusers' `FlaxStableDiffusionXLPipeline`, as a thin shim over `sdjax.core`.

The guide API differs from SD's in argument order (`__call__` takes guidance before height/width) and in
`_generate`'s trailing static `return_latents` (argument 9 in the guide's AOT recipe). The same class loads the
base model, the refiner (`StableDiffusionXLImg2ImgPipeline` folders: `text_encoder_2` only,
`requires_aesthetics_score`) and SDXL inpainting models; `generate(..., image=, mask_image=, denoising_start=)`
covers image-to-image, inpainting and the refiner hand-off (`sdjax.pipelines.recipes.base_then_refiner`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.core.tasks import TaskRequest
from sdjax.core.tasks.txt2img import Txt2Img
from sdjax.families.sd import UNetDenoiser
from sdjax.families.sdxl import SDXLConditioning
from sdjax.pipelines import common
from sdjax.pipelines.base import DiffusionPipeline
from sdjax.pipelines.flax_api import GuideCall

SDXL_CLASSES = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline")


class StableDiffusionXLPipeline(DiffusionPipeline):
    """SDXL (diffusers `StableDiffusionXLPipeline`, and the refiner's `StableDiffusionXLImg2ImgPipeline`)."""

    model_index_classes = SDXL_CLASSES
    pipeline_config_keys = ("force_zeros_for_empty_prompt", "requires_aesthetics_score")
    default_strength = {"img2img": 0.3, "inpaint": 0.9999}  # StableDiffusionXLImg2ImgPipeline, ...InpaintPipeline
    latent_rgb_factors = (
        (0.3920, 0.4054, 0.4549),
        (-0.2634, -0.0196, 0.0653),
        (0.0568, 0.1687, -0.0755),
        (-0.3112, -0.2359, -0.2076),
    )

    def __init__(
        self,
        *,
        tokenizer=None,
        tokenizer_2,
        text_encoder=None,
        text_encoder_2,
        unet,
        vae,
        scheduler,
        force_zeros_for_empty_prompt: bool = True,
        requires_aesthetics_score: bool = False,
        **kwargs,
    ):
        self.tokenizer = tokenizer
        self.tokenizer_2 = tokenizer_2
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        self.requires_aesthetics_score = requires_aesthetics_score
        if (text_encoder is None) != (tokenizer is None):
            raise ValueError("SDXL: text_encoder and tokenizer must be given together (the refiner has neither)")
        self.unet = unet
        super().__init__(
            denoiser=UNetDenoiser(unet, kwargs.get("dtype", jnp.float32)), vae=vae, scheduler=scheduler, **kwargs
        )

    def _conditioning(self):
        return SDXLConditioning(
            self.tokenizer,
            self.tokenizer_2,
            self.text_encoder,
            self.text_encoder_2,
            force_zeros_for_empty_prompt=self.force_zeros_for_empty_prompt,
            requires_aesthetics_score=self.requires_aesthetics_score,
        )

    @property
    def is_refiner(self) -> bool:
        return self.text_encoder is None

    def prepare_inputs(self, prompt: str | Sequence[str]) -> np.ndarray:
        """Tokenize with each tokenizer: int32 `(N, 2, 77)` (the refiner: `(N, 1, 77)`)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not isinstance(prompt, (list, tuple)) or not all(isinstance(p, str) for p in prompt):
            raise TypeError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")
        return self.generator.models.conditioning.tokenize(list(prompt))

    def default_time_ids(self, height: int, width: int) -> tuple[float, ...]:
        return (height, width, 0, 0, height, width)

    # ------------------------------------------------------------------ the guide's API
    def _generate(
        self,
        prompt_ids,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        latents=None,
        neg_prompt_ids=None,
        return_latents: bool = False,
    ):
        """Per-device SDXL generation: ids `(B, 2, 77)`, one key -> images `(B, H, W, 3)` (or latents)."""
        if isinstance(return_latents, jax.core.Tracer):
            raise TypeError("return_latents must be static: with pmap add 9 to static_broadcasted_argnums")
        return self._traced(
            GuideCall(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                guidance_scale,
                neg_prompt_ids,
                TaskRequest(Txt2Img()),
                noise=latents,
                output="latents" if return_latents else "images",
            )
        )

    def __call__(
        self,
        prompt_ids,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        guidance_scale=7.5,
        height: int | None = None,
        width: int | None = None,
        latents=None,
        neg_prompt_ids=None,
        return_dict: bool = True,
        output_type: str | None = None,
        jit: bool = False,
    ):
        """The old Flax SDXL call (guidance before height/width). `output_type="latent"` returns latents."""
        dh, dw = self.default_size
        return self._guide(
            GuideCall(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                dh if height is None else height,
                dw if width is None else width,
                guidance_scale,
                neg_prompt_ids,
                TaskRequest(Txt2Img()),
                jit=jit,
                return_dict=return_dict,
                noise=latents,
                output="latents" if output_type == "latent" else "images",
                traced=common.is_traced(prompt_ids, prng_seed, params),
            )
        )
