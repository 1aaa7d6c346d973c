"""sdjax: Stable Diffusion 1.x, 2.x and XL in JAX/Flax, the maintained successor of Diffusers' Flax pipelines.

The guides' code runs by changing only the import:

    from sdjax import FlaxStableDiffusionPipeline, replicate, shard
"""

from sdjax import compilation_cache
from sdjax.compilation_cache import enable_compilation_cache
from sdjax.loading.controlnet import FlaxControlNetModel
from sdjax.parallel import replicate, shard, unreplicate
from sdjax.pipelines import (
    EMBEDDED_MODEL,
    PipelineOutput,
    StableDiffusionControlNetPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    load_pipeline,
    make_image_grid,
    numpy_to_pil,
)
from sdjax.precision import cast_params

# The names of Diffusers' Flax classes, for code written against them.
FlaxStableDiffusionPipeline = StableDiffusionPipeline
FlaxStableDiffusionControlNetPipeline = StableDiffusionControlNetPipeline
FlaxStableDiffusionImg2ImgPipeline = StableDiffusionImg2ImgPipeline
FlaxStableDiffusionInpaintPipeline = StableDiffusionInpaintPipeline
FlaxStableDiffusionXLPipeline = StableDiffusionXLPipeline

__version__ = "0.1.0"

__all__ = [
    "EMBEDDED_MODEL",
    "FlaxControlNetModel",
    "FlaxStableDiffusionControlNetPipeline",
    "FlaxStableDiffusionImg2ImgPipeline",
    "FlaxStableDiffusionInpaintPipeline",
    "FlaxStableDiffusionPipeline",
    "FlaxStableDiffusionXLPipeline",
    "PipelineOutput",
    "StableDiffusionControlNetPipeline",
    "StableDiffusionImg2ImgPipeline",
    "StableDiffusionInpaintPipeline",
    "StableDiffusionPipeline",
    "StableDiffusionXLPipeline",
    "cast_params",
    "compilation_cache",
    "enable_compilation_cache",
    "load_pipeline",
    "make_image_grid",
    "numpy_to_pil",
    "replicate",
    "shard",
    "unreplicate",
]
