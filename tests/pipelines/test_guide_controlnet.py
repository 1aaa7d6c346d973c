"""The old `FlaxStableDiffusionControlNetPipeline` guide flow on 8 simulated CPU devices (tests/conftest.py), its
numbers against PyTorch diffusers' `StableDiffusionControlNetPipeline` given the same initial latents, a user's
own `pmap` of `_generate`, and bad ControlNet input through both APIs."""

import jax
import numpy as np
import pytest
import torch
from controlnet_cases import control_images, one_torch_thread, torch_controlnet

from sdjax import FlaxControlNetModel, FlaxStableDiffusionControlNetPipeline, StableDiffusionPipeline, replicate, shard
from sdjax.models.controlnet import ControlNetConfig, ControlNetModel

STEPS = 4
ATOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def net(torch_sd1, tmp_path_factory):
    model = torch_controlnet(torch_sd1.unet, 31)
    folder = tmp_path_factory.mktemp("cn-guide")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="module")
def guide(net, sd1_dir):
    # The guide's cells: load the ControlNet, then the pipeline with it, then put its params in.
    controlnet, controlnet_params = FlaxControlNetModel.from_pretrained(str(net[1]), from_pt=True)
    pipe, params = FlaxStableDiffusionControlNetPipeline.from_pretrained(str(sd1_dir), controlnet=controlnet)
    params["controlnet"] = controlnet_params
    return pipe, params


def eight_images():
    a, b = control_images(7)
    return [a, b] * 4


def test_guide_cells_on_eight_devices_match_diffusers(guide, net, torch_sd1):
    import diffusers

    pipe, params = guide
    assert jax.device_count() == 8
    prompts = [f"a photo number {i} of a bird" for i in range(8)]
    prompt_ids = pipe.prepare_text_inputs(prompts)
    processed = pipe.prepare_image_inputs(eight_images())  # 80x72 -> cut to 64x64
    assert prompt_ids.shape == (8, 77) and processed.shape == (8, 3, 64, 64)
    assert processed.min() >= 0 and processed.max() <= 1
    rngs = jax.random.split(jax.random.PRNGKey(0), 8)
    noise = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (8, 4, 8, 8)), np.float32)
    p_params = replicate(params)
    out = pipe(
        shard(prompt_ids),
        shard(processed),
        p_params,
        rngs,
        STEPS,
        latents=shard(noise),
        controlnet_conditioning_scale=0.6,
        jit=True,
    )
    images = np.asarray(out.images)
    assert images.shape == (8, 1, 64, 64, 3)

    torch_pipe = diffusers.StableDiffusionControlNetPipeline(**torch_sd1.components, controlnet=net[0])
    with torch.no_grad():
        ref = torch_pipe(
            prompt=prompts,
            image=torch.from_numpy(processed),
            num_inference_steps=STEPS,
            guidance_scale=7.5,
            latents=torch.from_numpy(noise.copy()),
            controlnet_conditioning_scale=0.6,
            output_type="np",
        ).images
    err = float(np.abs(images.reshape(ref.shape) - ref).max())
    assert err < ATOL, f"max abs image error {err}"

    # Without jit: the same numbers on the global batch; per-device scales of shape (8,) are accepted too.
    flat = pipe(prompt_ids, processed, params, rngs[0], STEPS, latents=noise, controlnet_conditioning_scale=0.6)
    assert float(np.abs(np.asarray(flat.images) - ref).max()) < ATOL
    again = pipe(
        shard(prompt_ids),
        shard(processed),
        p_params,
        rngs,
        STEPS,
        latents=shard(noise),
        controlnet_conditioning_scale=np.full((8,), 0.6, np.float32),
        jit=True,
    )
    np.testing.assert_allclose(np.asarray(again.images), images, atol=1e-6)


def test_users_own_pmap_of_generate(guide):
    pipe, params = guide
    prompt_ids = shard(pipe.prepare_text_inputs(["a bird"] * 8))
    processed = shard(pipe.prepare_image_inputs(eight_images()))
    rngs = jax.random.split(jax.random.PRNGKey(3), 8)
    p_params = replicate(params)
    scale = np.full((8, 1), 0.8, np.float32)
    guidance = np.full((8, 1), 7.5, np.float32)
    p_generate = jax.pmap(pipe._generate, static_broadcasted_argnums=(4,))
    traced = np.asarray(p_generate(prompt_ids, processed, p_params, rngs, STEPS, guidance, None, None, scale))
    called = np.asarray(
        pipe(prompt_ids, processed, p_params, rngs, STEPS, controlnet_conditioning_scale=scale, jit=True).images
    )
    assert traced.shape == called.shape == (8, 1, 64, 64, 3)
    np.testing.assert_allclose(traced, called, atol=1e-5)
    weaker = pipe(prompt_ids, processed, p_params, rngs, STEPS, controlnet_conditioning_scale=0.1, jit=True).images
    assert np.abs(np.asarray(weaker) - called).max() > 1e-2, "the scale had no effect"


def sdxl_net() -> ControlNetModel:
    return ControlNetModel(
        ControlNetConfig(
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            cross_attention_dim=32,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=80,
        )
    )


def test_bad_input_is_named(guide, sd1_dir):
    pipe, params = guide
    net = (pipe.controlnet, params["controlnet"])
    with pytest.raises(ValueError, match="SDXL ControlNet.*SD 1.x/2.x model"):
        FlaxStableDiffusionControlNetPipeline.from_pretrained(str(sd1_dir), controlnet=sdxl_net())
    plain, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    cond = control_images(0)[0].resize((64, 64))
    with pytest.raises(ValueError, match="SDXL ControlNet"):
        plain.generate("x", control_image=cond, controlnet=(sdxl_net(), {}), steps=2)
    with pytest.raises(ValueError, match="controlnet_conditioning_scale: got 3 value"):
        plain.generate("x", control_image=[cond, cond], controlnet=[net, net], controlnet_conditioning_scale=[1, 1, 1])
    with pytest.raises(ValueError, match="control_image: got 3 entries for 2 ControlNets"):
        plain.generate("x", control_image=[cond] * 3, controlnet=[net, net])
    with pytest.raises(ValueError, match="control_image must be a PIL image"):
        plain.generate("x", control_image=42, controlnet=net, steps=2)
    with pytest.raises(ValueError, match="control_image.*uint8"):
        plain.generate("x", control_image=np.zeros((64, 64, 3), np.float32), controlnet=net, steps=2)
    with pytest.raises(ValueError, match="control_guidance_start=0.5 must be below control_guidance_end=0.5"):
        plain.generate("x", control_image=cond, controlnet=net, control_guidance_start=0.5, control_guidance_end=0.5)
    with pytest.raises(ValueError, match="controlnet= and controlnet_conditioning_scale= need control_image="):
        plain.generate("x", controlnet=net)
    with pytest.raises(ValueError, match="needs a ControlNet"):
        plain.generate("x", control_image=cond)
    with pytest.raises(TypeError, match="controlnet must be"):
        plain.generate("x", control_image=cond, controlnet=42)
    # the guide API
    with pytest.raises(ValueError, match="image has to be a PIL.Image.Image"):
        pipe.prepare_image_inputs(np.zeros((64, 64, 3), np.uint8))
    ids = pipe.prepare_text_inputs(["a", "b"])
    key = jax.random.PRNGKey(0)
    with pytest.raises(TypeError, match="image must be an array"):
        pipe(ids, [cond, cond], params, key, 2)
    with pytest.raises(ValueError, match=r"image has shape \(1, 3, 64, 64\)"):
        pipe(ids, pipe.prepare_image_inputs(cond), params, key, 2)
    with pytest.raises(ValueError, match="controlnet_conditioning_scale has shape"):
        pipe(ids, pipe.prepare_image_inputs([cond, cond]), params, key, 2, controlnet_conditioning_scale=[1.0, 2, 3])
    no_net = {k: v for k, v in params.items() if k != "controlnet"}
    with pytest.raises(KeyError, match="controlnet"):
        pipe(ids, pipe.prepare_image_inputs([cond, cond]), no_net, key, 2)


def test_generate_uses_the_loaded_net(guide):
    """`generate(control_image=)` without `controlnet=` runs the pipeline's own net (same image as passing it)."""
    pipe, params = guide
    cond = control_images(0)[0].resize((64, 64))
    pipe.devices = jax.devices()[:1]  # the one image without 7 padding images to compile and run
    try:
        pipe.compile(batch_size=1, height=64, width=64, steps=2, controlnet=True)  # ahead of time
        compiles = pipe.generator.cache.stats.compiles
        a = pipe.generate("a bird", control_image=cond, steps=2, output_type="np")
        b = pipe.generate(
            "a bird", control_image=cond, controlnet=(pipe.controlnet, params["controlnet"]), steps=2, output_type="np"
        )
    finally:
        pipe.devices = None
    np.testing.assert_array_equal(a, b)
    assert a.shape == (1, 64, 64, 3)
    assert pipe.generator.cache.stats.compiles == compiles, "generate() did not use the program compile() built"
