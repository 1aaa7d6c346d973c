"""Pipelines with the API of Diffusers' Flax pipelines (thin shims over `sdjax.core`), plus the high-level
`generate` API."""

from sdjax.pipelines.auto import EMBEDDED_MODEL, load_pipeline
from sdjax.pipelines.common import PipelineOutput
from sdjax.pipelines.images import make_image_grid, numpy_to_pil
from sdjax.pipelines.stable_diffusion import (
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
)
from sdjax.pipelines.stable_diffusion_controlnet import StableDiffusionControlNetPipeline
from sdjax.pipelines.stable_diffusion_xl import StableDiffusionXLPipeline

__all__ = [
    "EMBEDDED_MODEL",
    "PipelineOutput",
    "StableDiffusionControlNetPipeline",
    "StableDiffusionImg2ImgPipeline",
    "StableDiffusionInpaintPipeline",
    "StableDiffusionPipeline",
    "StableDiffusionXLPipeline",
    "load_pipeline",
    "make_image_grid",
    "numpy_to_pil",
]
