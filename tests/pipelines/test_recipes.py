"""Hires fix: A1111's second-pass schedule by hand, the latent upscale against torch's interpolate, and the two
passes as separate calls."""

import numpy as np
import pytest
import torch

from sdjax import StableDiffusionPipeline
from sdjax.core.tasks import TaskRequest
from sdjax.core.tasks.img2img import Img2Img
from sdjax.pipelines.recipes import Hires, hires_fix, upscale_latents


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))[0]


def test_second_pass_schedule_is_a1111s():
    # A1111 (`setup_img2img_steps` with hires steps given): int(steps / min(strength, 0.999)) steps, last `steps` run
    assert Hires(strength=0.5, steps=20).window(30) == (40, 20)
    assert Hires(strength=0.7).window(20) == (28, 8)
    assert Hires(strength=1.0).window(20) == (20, 0)
    assert Hires(scale=1.5).target(512, 768) == (768, 1152)
    assert Hires(resize=(640, 384)).target(512, 512) == (384, 640)
    with pytest.raises(ValueError, match="upscaler='bicubic'"):
        Hires(upscaler="bicubic")


@pytest.mark.parametrize("method,torch_mode", [("latent", "bilinear"), ("latent-nearest", "nearest")])
def test_latent_upscale_matches_torch_interpolate(method, torch_mode):
    z = np.random.default_rng(0).standard_normal((2, 4, 5, 7)).astype(np.float32)
    kwargs = {"align_corners": False} if torch_mode == "bilinear" else {}
    for size in ((10, 14), (8, 16), (13, 9)):
        ref = torch.nn.functional.interpolate(torch.from_numpy(z), size=size, mode=torch_mode, **kwargs).numpy()
        np.testing.assert_allclose(upscale_latents(z, *size, method), ref, atol=1e-6)


def test_hires_fix_is_the_two_passes(sd):
    hires = Hires(scale=2, strength=0.6, steps=3)
    calls = []

    def progress(stage, step, total):
        if stage == "denoise" and step == 0:
            calls.append(total)

    out = hires_fix(sd, "a cat", steps=4, height=32, width=32, hires=hires, seed=5, output_type="np", progress=progress)
    assert out.shape == (1, 64, 64, 3)
    pndm_extra = 1  # PNDM calls the model once more than its step count
    assert calls == [4 + pndm_extra, 3 + pndm_extra]  # the second pass runs `hires.steps` steps
    first = sd.generate("a cat", steps=4, height=32, width=32, seed=5, output_type="latent")
    up = upscale_latents(first, 8, 8, "latent")
    total, start = hires.window(4)
    second = sd.generate_arrays(
        ["a cat"],
        [""],
        [5],
        [0],
        [7.5],
        steps=total,
        height=64,
        width=64,
        task=TaskRequest(Img2Img(latents_input=True), {"image_latents": up}, start_step=start),
        output="float",
    )
    np.testing.assert_allclose(out, second, atol=1e-5)  # separate programs: float rounding may differ
