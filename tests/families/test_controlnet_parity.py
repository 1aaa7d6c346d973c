"""ControlNet generation against PyTorch diffusers 0.42.1, given the same noise (tests/inject.py).

diffusers' `StableDiffusionControlNetPipeline` (one net, two nets as `MultiControlNetModel`, non-default scale
and guidance start/end), `StableDiffusionXLControlNetPipeline` (guess mode too),
`StableDiffusionControlNetImg2ImgPipeline` and `StableDiffusionControlNetInpaintPipeline` (9-channel UNet) on the
tiny models of tests/reference.py. The ControlNets are `ControlNetModel.from_unet` copies of the tiny UNets with
random zero convs (else their residuals would be 0 and the comparison would prove nothing) and perturbed norms.
Images in [0, 1] agree to 1e-3 absolute (float32); each case also checks the nets change the image by far more.
The image without a net (or without the second net) comes from the same call with that net's scale 0: the net is
skipped and its residuals are exactly 0, so the image is the one without it, from the already compiled program.
"""

import json

import inject
import numpy as np
import pytest
import reference
import torch
from controlnet_cases import control_images, one_torch_thread, torch_controlnet

from sdjax import StableDiffusionPipeline, rng
from sdjax.core.tasks import window
from sdjax.families.sd.controlnet import keep_table
from sdjax.loading.controlnet import FlaxControlNetModel

ATOL = 1e-3
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
NEGATIVE = ["blurry, low quality", "green"]
STEPS = 5
SHAPE = (4, 8, 8)
ZERO = {"controlnet_conditioning_scale": 0.0}  # the nets skipped: the image without ControlNet (module docstring)


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread():
    with one_torch_thread():
        yield


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


def test_keep_table_is_diffusers_controlnet_keep():
    """`1 - (i / n < start or (i + 1) / n > end)` over the window's calls, n counted from the window's start."""
    starts, ends = np.array([[0.1, 0.0], [0.5, 0.3]]), np.array([[0.8, 1.0], [1.0, 0.6]])
    table = keep_table(starts, ends, start=0, end=5, calls=5)
    np.testing.assert_array_equal(table[0, :, 0], [0, 1, 1, 1, 0])  # 0/5 < 0.1; 5/5 > 0.8
    np.testing.assert_array_equal(table[0, :, 1], [1, 1, 1, 1, 1])
    np.testing.assert_array_equal(table[1, :, 0], [0, 0, 0, 1, 1])  # 2/5 < 0.5, 3/5 is not
    np.testing.assert_array_equal(table[1, :, 1], [0, 0, 1, 0, 0])  # 1/5 < 0.3; 4/5 > 0.6
    # img2img: the window starts at call 2 of 6 (n = 4); denoising_end stops at call 5 without changing n.
    table = keep_table(np.array([[0.25]]), np.array([[0.75]]), start=2, end=5, calls=6)
    np.testing.assert_array_equal(table[0, :, 0], [0, 0, 0, 1, 1, 0])


def on_two_devices(pipe):
    """A data-parallel mesh of 2 devices: the 2 images without the 6 padding images of the default 8-device mesh
    (a quarter of the work, a smaller program). The `sd` pipeline keeps the default mesh, padding included."""
    import jax

    from sdjax.parallel import make_mesh

    pipe.mesh = make_mesh(2, 1, jax.devices()[:2])
    return pipe


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


# Guess mode is compared on SDXL (test_sdxl_guess_mode_matches_diffusers): the same hook code as SD 1.x (the
# conditional half of the sample and context, zero residuals for the unconditional half, `guess_mode_scales`), plus
# the halved `text_embeds`/`time_ids`; the net's guess-mode weights on SD 1.x are tests/models/test_controlnet.py's.
# An SD 1.x guess-mode case here compiled a program of its own (static `guess_mode`): 8 s of CPU (the file
# 110 -> 95 s, `/usr/bin/time pytest tests/families/test_controlnet_parity.py`).
@pytest.mark.parametrize(
    "case",
    [dict(controlnet_conditioning_scale=0.7, control_guidance_start=0.1, control_guidance_end=0.8)],
    ids=["scale-start-end"],
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
    plain = sd_generate(sd, "euler_a", control_image=cond, controlnet=nets[0], height=64, width=64, **case | ZERO)
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


def test_two_nets_match_multicontrolnet(sd, sd_nets, torch_sd1, sd1_dir):
    """Per-net scales and windows; diffusers' nested image list (one list of per-net images per prompt)."""
    import diffusers

    torch_nets, nets = sd_nets
    torch_pipe = diffusers.StableDiffusionControlNetPipeline(**torch_sd1.components, controlnet=list(torch_nets))
    swap(torch_pipe, sd1_dir, "DDIMScheduler")
    sampler = sd._sampler("ddim")
    keys = inject.image_keys(7, 2)
    a, b = control_images(1), control_images(2)
    nested = [[a[0], b[0]], [a[1], b[1]]]
    case = dict(
        controlnet_conditioning_scale=[0.9, 0.6], control_guidance_start=[0.0, 0.2], control_guidance_end=[0.7, 1.0]
    )
    start, end = window(sampler, STEPS)
    ref = run_torch(
        torch_pipe, sampler=sampler, keys=keys, start=start, end=end, image=nested, height=64, width=64, **case
    )
    out = sd_generate(sd, "ddim", seed=7, control_image=nested, controlnet=list(nets), height=64, width=64, **case)
    one = sd_generate(  # the first net alone: the second at scale 0
        sd,
        "ddim",
        seed=7,
        control_image=nested,
        controlnet=list(nets),
        height=64,
        width=64,
        **case | {"controlnet_conditioning_scale": [0.9, 0.0]},
    )
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(out - one).max()) > 50 * ATOL, "the second net did not change the image"


@pytest.fixture(scope="module")
def sdxl_net(torch_sdxl, tmp_path_factory):
    net = torch_controlnet(torch_sdxl.unet, 21)
    return net, saved(net, tmp_path_factory, "cn-sdxl")


@pytest.fixture(scope="module")
def sdxl(sdxl_dir):
    """One SDXL pipeline for the module: its compiled programs are shared by the tests of the same shape."""
    from sdjax import StableDiffusionXLPipeline

    return on_two_devices(StableDiffusionXLPipeline.from_pretrained(str(sdxl_dir))[0])


def test_sdxl_txt2img_matches_diffusers(sdxl, sdxl_net, torch_sdxl):
    import diffusers

    torch_net, net = sdxl_net
    torch_pipe = diffusers.StableDiffusionXLControlNetPipeline(**torch_sdxl.components, controlnet=torch_net)
    pipe = sdxl
    sampler = pipe._sampler(None)
    keys = inject.image_keys(3, 2)
    cond = control_images(3)
    case = dict(controlnet_conditioning_scale=0.8, control_guidance_end=0.6)
    start, end = window(sampler, STEPS)
    ref = run_torch(
        torch_pipe, sampler=sampler, keys=keys, start=start, end=end, image=cond, height=64, width=64, **case
    )
    out = sd_generate(pipe, None, seed=3, control_image=cond, controlnet=net, height=64, width=64, **case)
    plain = sd_generate(pipe, None, seed=3, control_image=cond, controlnet=net, height=64, width=64, **ZERO)
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(out - plain).max()) > 50 * ATOL, "the ControlNet did not change the image"
    # denoising_end (the base -> refiner hand-off): diffusers' keep factors count the whole schedule.
    case = dict(control_guidance_start=0.2, control_guidance_end=0.5, denoising_end=0.6)
    ref = run_torch(
        torch_pipe, sampler=sampler, keys=keys, start=start, end=end, image=cond, height=64, width=64, **case
    )
    out = sd_generate(pipe, None, seed=3, control_image=cond, controlnet=net, height=64, width=64, **case)
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"denoising_end: max abs image error {err}"


def test_sd_img2img_matches_diffusers(sd, sd_nets, torch_sd1, sd1_dir):
    """diffusers' default scale for image-to-image (0.8) applies when none is given."""
    import diffusers

    torch_nets, nets = sd_nets
    torch_pipe = diffusers.StableDiffusionControlNetImg2ImgPipeline(**torch_sd1.components, controlnet=torch_nets[1])
    swap(torch_pipe, sd1_dir, "EulerDiscreteScheduler")
    sampler = sd._sampler("euler")
    keys = inject.image_keys(4, 2)
    cond, init = control_images(4), init_images()
    start, end = window(sampler, STEPS, strength=0.6)
    ref = run_torch(
        torch_pipe,
        sampler=sampler,
        keys=keys,
        start=start,
        end=end,
        streams=[rng.ENCODE_IMAGE],
        image=init,
        control_image=cond,
        strength=0.6,
        control_guidance_start=0.3,
        height=64,
        width=64,
    )
    kwargs = dict(image=init, strength=0.6, control_image=cond, controlnet=nets[1], control_guidance_start=0.3)
    out = sd_generate(sd, "euler", seed=4, **kwargs)
    full = sd_generate(sd, "euler", seed=4, **kwargs, controlnet_conditioning_scale=1.0)
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(full - ref).max()) > 10 * ATOL, "the default scale is not diffusers' 0.8"


@pytest.fixture(scope="module")
def inpaint9(torch_sd1, tmp_path_factory):
    """A tiny 9-channel SD inpainting model (diffusers parts, folder and the sdjax pipeline loaded from it)."""
    unet9 = reference.unet({**reference.UNET_SD1, "in_channels": 9}, seed=7)
    parts = {**torch_sd1.components, "unet": unet9}
    import diffusers

    folder = tmp_path_factory.mktemp("tiny-sd1-inpaint-cn")
    diffusers.StableDiffusionInpaintPipeline(**parts).save_pretrained(folder, safe_serialization=True)
    return parts, folder, on_two_devices(StableDiffusionPipeline.from_pretrained(str(folder))[0])


def test_sd_inpaint_9_channels_matches_diffusers(inpaint9, sd_nets):
    """The nets see the 4 latent channels of the 9-channel UNet's input; diffusers' inpainting default scale 0.5."""
    import diffusers

    parts, folder, pipe = inpaint9
    torch_nets, nets = sd_nets
    torch_pipe = diffusers.StableDiffusionControlNetInpaintPipeline(**parts, controlnet=torch_nets[0])
    swap(torch_pipe, folder, "EulerAncestralDiscreteScheduler")
    sampler = pipe._sampler("euler_a")
    keys, strength = inject.image_keys(6, 2), 1.0
    cond, init, mask = control_images(5), init_images(), masks()
    start, end = window(sampler, STEPS, strength=strength)
    streams = ([rng.ENCODE_IMAGE] if strength < 1 else []) + [rng.ENCODE_MASKED_IMAGE]
    ref = run_torch(
        torch_pipe,
        sampler=sampler,
        keys=keys,
        start=start,
        end=end,
        streams=streams,
        image=init,
        mask_image=mask,
        control_image=cond,
        strength=strength,
        height=64,
        width=64,
    )
    kwargs = dict(image=init, mask_image=mask, strength=strength)
    out = sd_generate(pipe, "euler_a", seed=6, **kwargs, control_image=cond, controlnet=nets[0])
    plain = sd_generate(pipe, "euler_a", seed=6, **kwargs, control_image=cond, controlnet=nets[0], **ZERO)
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(out - plain).max()) > 50 * ATOL, "the ControlNet did not change the image"


def test_sdxl_inpaint_matches_diffusers(sdxl, sdxl_net, torch_sdxl):
    """Latent blending (4-channel UNet) with an SDXL net; diffusers' SDXL inpainting default scale is 1.0, not SD's
    0.5."""
    import diffusers

    torch_net, net = sdxl_net
    torch_pipe = diffusers.StableDiffusionXLControlNetInpaintPipeline(**torch_sdxl.components, controlnet=torch_net)
    pipe = sdxl
    sampler = pipe._sampler(None)
    keys = inject.image_keys(4, 2)
    cond, init, mask = control_images(6), init_images(), masks()
    start, end = window(sampler, STEPS, strength=1.0)
    streams = [rng.ENCODE_IMAGE, rng.ENCODE_MASKED_IMAGE]
    kwargs = dict(image=init, mask_image=mask, strength=1.0)
    ref = run_torch(
        torch_pipe,
        sampler=sampler,
        keys=keys,
        start=start,
        end=end,
        streams=streams,
        control_image=cond,
        height=64,
        width=64,
        **kwargs,
    )
    out = sd_generate(pipe, None, seed=4, control_image=cond, controlnet=net, **kwargs)
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    half = sd_generate(
        pipe, None, seed=4, control_image=cond, controlnet=net, controlnet_conditioning_scale=0.5, **kwargs
    )
    assert float(np.abs(half - ref).max()) > 10 * ATOL, "the default scale is not diffusers' 1.0"


def test_sdxl_guess_mode_matches_diffusers(sdxl, sdxl_net, torch_sdxl):
    """SDXL guess mode: the net sees the conditional half only, with its `text_embeds` and `time_ids`."""
    import diffusers

    torch_net, net = sdxl_net
    torch_pipe = diffusers.StableDiffusionXLControlNetPipeline(**torch_sdxl.components, controlnet=torch_net)
    pipe = sdxl
    sampler = pipe._sampler(None)
    keys = inject.image_keys(8, 2)
    cond = control_images(7)
    start, end = window(sampler, STEPS)
    ref = run_torch(
        torch_pipe, sampler=sampler, keys=keys, start=start, end=end, image=cond, height=64, width=64, guess_mode=True
    )
    out = sd_generate(pipe, None, seed=8, control_image=cond, controlnet=net, height=64, width=64, guess_mode=True)
    both = sd_generate(pipe, None, seed=8, control_image=cond, controlnet=net, height=64, width=64)
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(out - both).max()) > 50 * ATOL, "guess mode changed nothing"


def test_two_nets_img2img_match_multicontrolnet(sd, sd_nets, torch_sd1, sd1_dir):
    """`StableDiffusionControlNetImg2ImgPipeline` with `MultiControlNetModel`: per-net scales and windows, one map
    per net shared by every image (diffusers' image-to-image and inpainting pipelines refuse per-image maps with
    several nets: "A single batch of multiple conditionings are supported at the moment")."""
    import diffusers

    torch_nets, nets = sd_nets
    torch_pipe = diffusers.StableDiffusionControlNetImg2ImgPipeline(**torch_sd1.components, controlnet=list(torch_nets))
    swap(torch_pipe, sd1_dir, "EulerDiscreteScheduler")
    sampler = sd._sampler("euler")
    keys = inject.image_keys(9, 2)
    (a, b), init = control_images(8), init_images()
    case = dict(
        controlnet_conditioning_scale=[0.9, 0.6], control_guidance_start=[0.0, 0.3], control_guidance_end=[0.8, 1.0]
    )
    start, end = window(sampler, STEPS, strength=0.7)
    ref = run_torch(
        torch_pipe, sampler=sampler, keys=keys, start=start, end=end, streams=[rng.ENCODE_IMAGE], image=init,
        control_image=[a, b], strength=0.7, height=64, width=64, **case,
    )  # fmt: skip
    out = sd_generate(
        sd, "euler", seed=9, image=init, strength=0.7, control_image=[a, b], controlnet=list(nets), **case
    )
    one = sd_generate(
        sd, "euler", seed=9, image=init, strength=0.7, control_image=a, controlnet=nets[0],
        controlnet_conditioning_scale=0.9, control_guidance_end=0.8,
    )  # fmt: skip
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(out - one).max()) > 50 * ATOL, "the second net did not change the image"


def test_two_nets_inpaint_match_multicontrolnet(inpaint9, sd_nets):
    """`StableDiffusionControlNetInpaintPipeline` (9-channel UNet) with `MultiControlNetModel`: both nets see the
    latent channels only; one map per net for every image; the default scale 0.5 for each net."""
    import diffusers

    parts, folder, pipe = inpaint9
    torch_nets, nets = sd_nets
    torch_pipe = diffusers.StableDiffusionControlNetInpaintPipeline(**parts, controlnet=list(torch_nets))
    swap(torch_pipe, folder, "DDIMScheduler")
    sampler = pipe._sampler("ddim")
    keys, strength = inject.image_keys(10, 2), 0.8
    a, b = control_images(10)
    init, mask = init_images(), masks()
    start, end = window(sampler, STEPS, strength=strength)
    case = dict(control_guidance_start=[0.2, 0.0], control_guidance_end=[1.0, 0.6])
    ref = run_torch(
        torch_pipe, sampler=sampler, keys=keys, start=start, end=end,
        streams=[rng.ENCODE_IMAGE, rng.ENCODE_MASKED_IMAGE], image=init, mask_image=mask, control_image=[a, b],
        strength=strength, height=64, width=64, **case,
    )  # fmt: skip
    kwargs = dict(image=init, mask_image=mask, strength=strength)
    out = sd_generate(pipe, "ddim", seed=10, **kwargs, control_image=[a, b], controlnet=list(nets), **case)
    one = sd_generate(  # the first net alone (its default scale 0.5, its window): the second at scale 0
        pipe, "ddim", seed=10, **kwargs, control_image=[a, b], controlnet=list(nets), **case,
        controlnet_conditioning_scale=[0.5, 0.0],
    )  # fmt: skip
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(out - one).max()) > 50 * ATOL, "the second net did not change the image"


def test_guidance_distilled_unet_with_controlnet_matches_diffusers(torch_sd1, tmp_path_factory):
    """An LCM-style UNet (`time_cond_proj_dim`) with a ControlNet in `StableDiffusionControlNetPipeline`: no
    classifier-free guidance, the guidance embedding goes to the UNet only (`timestep_cond=`); the ControlNet gets
    none (diffusers' `ControlNetModel` has no `cond_proj`, and the pipeline does not pass it)."""
    import diffusers

    from sdjax.loading.controlnet import FlaxControlNetModel

    unet = reference.unet({**reference.UNET_SD1, "time_cond_proj_dim": 32}, seed=5)
    # (a net from the plain UNet: `from_unet` cannot copy an LCM UNet's time embedding, which has a `cond_proj`)
    torch_net = torch_controlnet(torch_sd1.unet, 13)
    parts = {**torch_sd1.components, "unet": unet}
    folder = tmp_path_factory.mktemp("tiny-lcm-cn")
    diffusers.StableDiffusionPipeline(**parts).save_pretrained(folder, safe_serialization=True)
    net_folder = tmp_path_factory.mktemp("tiny-lcm-cn-net")
    torch_net.save_pretrained(net_folder, safe_serialization=True)
    assert "time_cond_proj_dim" not in json.loads((net_folder / "config.json").read_text())
    torch_pipe = diffusers.StableDiffusionControlNetPipeline(**parts, controlnet=torch_net)
    swap(torch_pipe, folder, "EulerDiscreteScheduler")
    pipe = on_two_devices(StableDiffusionPipeline.from_pretrained(str(folder))[0])
    net = FlaxControlNetModel.from_pretrained(str(net_folder))
    latents = np.random.default_rng(3).standard_normal((2, *SHAPE)).astype(np.float32)
    cond = control_images(11)
    common = dict(height=64, width=64, output_type="np")
    with torch.no_grad():
        ref = torch_pipe(
            PROMPTS, image=cond, num_inference_steps=3, guidance_scale=4.0, latents=torch.from_numpy(latents),
            controlnet_conditioning_scale=0.8, **common,
        ).images  # fmt: skip
    ours = np.asarray(
        pipe.generate(
            PROMPTS, steps=3, guidance_scale=4.0, noise=latents, sampler="euler", control_image=cond, controlnet=net,
            controlnet_conditioning_scale=0.8, **common,
        )
    )  # fmt: skip
    plain = np.asarray(
        pipe.generate(
            PROMPTS, steps=3, guidance_scale=4.0, noise=latents, sampler="euler", control_image=cond, controlnet=net,
            **common, **ZERO,
        )
    )  # fmt: skip
    err = float(np.abs(ours - ref).max())
    assert err < ATOL, f"max abs image error {err}"
    assert float(np.abs(ours - plain).max()) > 50 * ATOL, "the ControlNet did not change the image"
