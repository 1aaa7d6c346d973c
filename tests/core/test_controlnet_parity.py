"""ControlNet generation against PyTorch diffusers 0.42.1, given the same noise (tests/inject.py).

diffusers' `StableDiffusionControlNetPipeline` (one net, two nets as `MultiControlNetModel`, guess mode,
non-default scale and guidance start/end), `StableDiffusionXLControlNetPipeline`,
`StableDiffusionControlNetImg2ImgPipeline` and `StableDiffusionControlNetInpaintPipeline` (9-channel UNet) on the
tiny models of tests/reference.py. The ControlNets are `ControlNetModel.from_unet` copies of the tiny UNets with
random zero convs (else their residuals would be 0 and the comparison would prove nothing) and perturbed norms.
Images in [0, 1] agree to 1e-3 absolute (float32); each case also checks the nets change the image by far more.
"""

import json

import inject
import numpy as np
import pytest
import reference
import torch

from sdjax import StableDiffusionPipeline, rng
from sdjax.core.tasks import window
from sdjax.loading.controlnet import FlaxControlNetModel

ATOL = 1e-3
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
NEGATIVE = ["blurry, low quality", "green"]
STEPS = 5
SHAPE = (4, 8, 8)


def torch_controlnet(unet, seed: int):
    """`ControlNetModel.from_unet(unet)` with random zero convs and norms (tests/models/test_controlnet.py)."""
    from diffusers import ControlNetModel

    reference.seed_everything(seed)
    model = ControlNetModel.from_unet(unet).eval()
    g = torch.Generator().manual_seed(seed + 100)
    zero_init = [*model.controlnet_down_blocks, model.controlnet_mid_block, model.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for layer in zero_init:
            layer.weight.copy_(0.3 * torch.randn(layer.weight.shape, generator=g))
            layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=g))
        for layer in model.controlnet_cond_embedding.blocks:
            layer.weight.mul_(3.0)
    reference.perturb_norms(model, seed)
    return model


def control_images(seed: int) -> list:
    """Two 64x64 control maps (edges-like: white strokes on black), 80x72 so that they get resized."""
    from PIL import Image

    r = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        a = np.zeros((72, 80, 3), np.uint8)
        for _ in range(6):
            y, x = r.integers(0, 60), r.integers(0, 70)
            a[y : y + r.integers(2, 12), x : x + r.integers(2, 12)] = 255
        out.append(Image.fromarray(a))
    return out


def init_images() -> list:
    from PIL import Image

    r = np.random.default_rng(0)
    a = r.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    big = Image.fromarray(a).resize((64, 64), Image.BILINEAR)
    return [big, big.transpose(Image.FLIP_LEFT_RIGHT)]


def masks() -> list:
    from PIL import Image

    m = np.zeros((64, 64), np.uint8)
    m[10:50, 20:44] = 255
    return [Image.fromarray(m), Image.fromarray(m.T.copy())]


def swap(torch_pipe, folder, cls_name="EulerDiscreteScheduler"):
    import diffusers

    on_disk = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    torch_pipe.scheduler = getattr(diffusers, cls_name).from_config(on_disk)


def run_torch(pipe, *, sampler, keys, start, end, streams=(), **kwargs):
    with (
        inject.prescribed(
            pipe,
            latents_noise=inject.stream(keys, rng.LATENTS, SHAPE),
            encode_eps=[inject.stream(keys, s, SHAPE) for s in streams],
            step_noise=inject.step_noises(sampler, keys, SHAPE, start, end) if sampler.stochastic else [],
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


def saved(model, tmp_path_factory, name):
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, safe_serialization=True)
    return FlaxControlNetModel.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def sd_nets(torch_sd1, tmp_path_factory):
    """Two torch ControlNets for the tiny SD 1.x UNet and their sdjax (module, params) pairs."""
    nets = [torch_controlnet(torch_sd1.unet, seed) for seed in (11, 12)]
    return nets, [saved(n, tmp_path_factory, f"cn-sd-{i}") for i, n in enumerate(nets)]


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))[0]


def sd_generate(pipe, name="euler", seed=5, **kwargs):
    return pipe.generate(
        PROMPTS,
        negative_prompt=NEGATIVE,
        steps=STEPS,
        guidance_scale=7.5,
        seed=seed,
        sampler=name,
        output_type="np",
        **kwargs,
    )


@pytest.mark.parametrize(
    "case",
    [
        dict(controlnet_conditioning_scale=0.7, control_guidance_start=0.1, control_guidance_end=0.8),
        dict(guess_mode=True),
    ],
    ids=["scale-start-end", "guess-mode"],
)
def test_sd_txt2img_matches_diffusers(case, sd, sd_nets, torch_sd1, sd1_dir):
    import diffusers

    torch_nets, nets = sd_nets
    torch_pipe = diffusers.StableDiffusionControlNetPipeline(**torch_sd1.components, controlnet=torch_nets[0])
    swap(torch_pipe, sd1_dir, "EulerAncestralDiscreteScheduler")
    sampler = sd._sampler("euler_a")
    keys = inject.image_keys(5, 2)
    cond = control_images(0)
    start, end = window(sampler, STEPS)
    ref = run_torch(
        torch_pipe, sampler=sampler, keys=keys, start=start, end=end, image=cond, height=64, width=64, **case
    )
    out = sd_generate(sd, "euler_a", control_image=cond, controlnet=nets[0], height=64, width=64, **case)
    plain = sd_generate(sd, "euler_a", height=64, width=64)
    assert out.shape == ref.shape == (2, 64, 64, 3)
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(out - plain).max()) > 50 * ATOL, "the ControlNet did not change the image"
    if "control_guidance_end" in case:  # the start/end window matters, and changing it does not recompile
        compiles = sd.generator.cache.stats.compiles
        full = sd_generate(
            sd,
            "euler_a",
            control_image=cond,
            controlnet=nets[0],
            controlnet_conditioning_scale=0.7,
            height=64,
            width=64,
        )
        assert float(np.abs(full - ref).max()) > 10 * ATOL
        assert sd.generator.cache.stats.compiles == compiles
    print(f"{case}: error {err:.2e}, control effect {float(np.abs(out - plain).max()):.2e}")
