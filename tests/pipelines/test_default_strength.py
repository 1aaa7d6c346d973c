"""The Python API's image-to-image and inpainting strength without `strength=` is diffusers' default of the mirrored
pipeline class (read here from diffusers' own signatures), per family; the faces use A1111's (`sdjax.policy`)."""

from __future__ import annotations

import inspect

import diffusers
import numpy as np
import pytest

from sdjax import StableDiffusionPipeline, StableDiffusionXLPipeline
from sdjax.families.flux.pipeline import FluxPipeline
from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline
from sdjax.policy import A1111


def _default(cls_name: str) -> float:
    return inspect.signature(getattr(diffusers, cls_name).__call__).parameters["strength"].default


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (StableDiffusionPipeline, "StableDiffusion"),
        (StableDiffusionXLPipeline, "StableDiffusionXL"),
        (FluxPipeline, "Flux"),
        (StableDiffusion3Pipeline, "StableDiffusion3"),
    ],
)
def test_each_family_defaults_to_its_diffusers_pipelines_strength(ours, theirs):
    assert ours.default_strength == {
        "img2img": _default(f"{theirs}Img2ImgPipeline"),
        "inpaint": _default(f"{theirs}InpaintPipeline"),
    }


def test_sdxl_image_to_image_without_strength_runs_diffusers_default(sdxl_dir):
    """SDXL's is 0.3 (it was SD's 0.8 before): the image equals the one asked with strength=0.3, and A1111's 0.75
    (what the faces send) gives another."""
    pipe, _ = StableDiffusionXLPipeline.from_pretrained(str(sdxl_dir))
    init = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    kw = dict(image=init, steps=4, height=64, width=64, seed=2, output_type="np")
    default = pipe.generate("a cat", **kw)
    np.testing.assert_array_equal(default, pipe.generate("a cat", strength=0.3, **kw))
    assert np.abs(default - pipe.generate("a cat", strength=A1111.strength, **kw)).max() > 1e-2
