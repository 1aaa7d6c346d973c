"""Image-to-image and inpainting against PyTorch diffusers 0.42.1, given the same noise (tests/inject.py).

Tiny random SD 1.x models with real configs; diffusers' `StableDiffusionImg2ImgPipeline` and
`StableDiffusionInpaintPipeline` (9-channel inpainting UNet and latent blending with a 4-channel UNet), for DDIM,
Euler, Euler a and DPM++ 2M, at strengths 1.0, a middle value and one that leaves one step. Images in [0, 1]
agree to 1e-3 absolute (float32); a wrong start step, sigma or blend moves them by 1e-2 or more.
"""

import contextlib
import json

import inject
import jax
import numpy as np
import pytest
import torch

from sdjax import StableDiffusionPipeline, rng
from sdjax.core.tasks import window

ATOL = 1e-3
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
NEGATIVE = ["blurry, low quality", "green"]
STEPS = 6
SAMPLERS = [  # (sdjax name, diffusers class, extra from_config keys)
    ("ddim", "DDIMScheduler", {}),
    ("euler", "EulerDiscreteScheduler", {}),
    ("euler_a", "EulerAncestralDiscreteScheduler", {}),
    ("dpmpp_2m", "DPMSolverMultistepScheduler", {}),
]


def _images(seed: int) -> list:
    from PIL import Image

    r = np.random.default_rng(seed)
    base = np.zeros((64, 64, 3), np.uint8)
    base[..., 0] = np.linspace(0, 255, 64, dtype=np.uint8)[None]
    base[16:48, 16:48] = (30, 200, 90)
    noisy = np.clip(base.astype(int) + r.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    return [Image.fromarray(noisy), Image.fromarray(255 - noisy)]


def _masks() -> list:
    from PIL import Image

    a = np.zeros((64, 64), np.uint8)
    a[8:40, 24:56] = 255
    b = np.zeros((64, 64), np.uint8)
    b[32:, :] = 255
    return [Image.fromarray(a), Image.fromarray(b)]


def _swap(torch_pipe, folder, cls_name, extra):
    import diffusers

    on_disk = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    torch_pipe.scheduler = getattr(diffusers, cls_name).from_config(on_disk, **extra)


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))


@contextlib.contextmanager
def on_devices(pipe, name):
    """DDIM runs the batch of 2 padded to the 8 simulated devices (padding against diffusers, and the program
    test_img2img_strength_changes_the_image_without_recompiling reuses); the other samplers run it on 2 devices: no
    padding images to compile and run."""
    pipe.devices = None if name == "ddim" else jax.devices()[:2]
    try:
        yield pipe
    finally:
        pipe.devices = None


@pytest.fixture(scope="module")
def torch_img2img(torch_sd1):
    import diffusers

    return diffusers.StableDiffusionImg2ImgPipeline(**torch_sd1.components)


def _run_torch(pipe, *, sampler, keys, start, end, encode_streams, **kwargs):
    shape = (4, 8, 8)
    with (
        inject.prescribed(
            pipe,
            latents_noise=inject.stream(keys, rng.LATENTS, shape),
            encode_eps=[inject.stream(keys, s, shape) for s in encode_streams],
            step_noise=inject.step_noises(sampler, keys, shape, start, end) if sampler.stochastic else [],
        ),
        torch.no_grad(),
    ):
        return pipe(
            prompt=PROMPTS,
            negative_prompt=NEGATIVE,
            num_inference_steps=STEPS,
            guidance_scale=7.5,
            output_type="np",
            **kwargs,
        ).images


@pytest.mark.parametrize("name,cls_name,extra", SAMPLERS)
def test_img2img_matches_diffusers(name, cls_name, extra, sd, torch_img2img, sd1_dir):
    pipe, _ = sd
    _swap(torch_img2img, sd1_dir, cls_name, extra)
    sampler = pipe._sampler(name)
    keys = inject.image_keys(5, 2)
    images = _images(0)
    errors = {}
    for strength in (1.0, 0.55, 1.5 / STEPS):
        start, end = window(sampler, STEPS, strength=strength)
        ref = _run_torch(
            torch_img2img,
            sampler=sampler,
            keys=keys,
            start=start,
            end=end,
            encode_streams=[rng.ENCODE_IMAGE],
            image=images,
            strength=strength,
        )
        with on_devices(pipe, name):
            out = pipe.generate(
                PROMPTS,
                negative_prompt=NEGATIVE,
                image=images,
                strength=strength,
                steps=STEPS,
                guidance_scale=7.5,
                seed=5,
                sampler=name,
                output_type="np",
            )
        assert out.shape == ref.shape == (2, 64, 64, 3)
        errors[strength] = float(np.abs(out - ref).max())
    assert max(errors.values()) < ATOL, f"{name}: max abs image error by strength {errors}"
    assert window(sampler, STEPS, strength=1.5 / STEPS)[1] - window(sampler, STEPS, strength=1.5 / STEPS)[0] == 1


def test_img2img_strength_changes_the_image_without_recompiling(sd):
    pipe, _ = sd
    images = _images(1)
    # DDIM at STEPS on a batch of 2 padded to the 8 devices: the program test_img2img_matches_diffusers[ddim] compiled.
    prompts = ["a cat", "a dog"]
    before = pipe.generator.cache.stats.compiles
    a = pipe.generate(prompts, image=images, strength=0.3, steps=STEPS, sampler="ddim", output_type="np")
    compiles = pipe.generator.cache.stats.compiles
    b = pipe.generate(prompts, image=images, strength=0.9, steps=STEPS, sampler="ddim", output_type="np")
    assert pipe.generator.cache.stats.compiles == compiles <= before + 1
    assert np.abs(a - b).max() > 1e-2


@pytest.fixture(scope="module")
def inpaint_models(torch_sd1, tmp_path_factory):
    """A tiny 9-channel SD inpainting model (torch pipeline, diffusers folder, the sdjax pipeline loaded from it)."""
    import diffusers
    import reference

    unet9 = reference.unet({**reference.UNET_SD1, "in_channels": 9}, seed=7)
    parts = {**torch_sd1.components, "unet": unet9}
    torch_pipe = diffusers.StableDiffusionInpaintPipeline(**parts)
    folder = tmp_path_factory.mktemp("tiny-sd1-inpaint")
    torch_pipe.save_pretrained(folder, safe_serialization=True)
    return torch_pipe, folder, StableDiffusionPipeline.from_pretrained(str(folder))[0]


# Each sampler with one kind of UNet, each kind with a deterministic, an ancestral or a multistep sampler.
# The 9-channel UNet with DDIM and Euler a, the 4-channel one (known latents blended back each step) with DPM++ 2M;
# the 4-channel path with Euler is tests/core/test_sdxl_tasks_parity.py's SDXL inpainting (the suite's time budget).
# Strength 1 (from noise) and a lower one (from the noised image) compile two programs: each kind of UNet runs
# both, the 9-channel one with one sampler each (Euler a from noise, DDIM from the image; each sampler's start
# inside the schedule is test_img2img_matches_diffusers'). Both strengths for both 9-channel samplers: 2 programs
# more: the file 62 -> 53 s of CPU (`/usr/bin/time pytest tests/core/test_img2img_inpaint_parity.py`, paired runs).
INPAINT_CASES = [(*SAMPLERS[0], 9, (0.6,)), (*SAMPLERS[2], 9, (1.0,)), (*SAMPLERS[3], 4, (1.0, 0.6))]


@pytest.mark.parametrize("name,cls_name,extra,channels,strengths", INPAINT_CASES)
def test_inpaint_matches_diffusers(channels, strengths, name, cls_name, extra, inpaint_models, torch_sd1, sd1_dir, sd):
    import diffusers

    if channels == 9:
        torch_pipe, folder, pipe = inpaint_models
    else:
        torch_pipe, folder = diffusers.StableDiffusionInpaintPipeline(**torch_sd1.components), sd1_dir
        pipe = sd[0]
    _swap(torch_pipe, folder, cls_name, extra)
    sampler = pipe._sampler(name)
    keys = inject.image_keys(3, 2)
    images, masks = _images(2), _masks()
    errors = {}
    for strength in strengths:
        start, end = window(sampler, STEPS, strength=strength)
        # diffusers encodes the masked image for 4-channel UNets too (and then does not use it).
        streams = ([rng.ENCODE_IMAGE] if channels == 4 or strength < 1 else []) + [rng.ENCODE_MASKED_IMAGE]
        ref = _run_torch(
            torch_pipe,
            sampler=sampler,
            keys=keys,
            start=start,
            end=end,
            encode_streams=streams,
            image=images,
            mask_image=masks,
            strength=strength,
            height=64,
            width=64,
        )
        with on_devices(pipe, name):
            out = pipe.generate(
                PROMPTS,
                negative_prompt=NEGATIVE,
                image=images,
                mask_image=masks,
                strength=strength,
                steps=STEPS,
                guidance_scale=7.5,
                seed=3,
                sampler=name,
                output_type="np",
            )
        errors[strength] = float(np.abs(out - ref).max())
    assert max(errors.values()) < ATOL, f"{channels}-channel {name}: max abs image error by strength {errors}"
