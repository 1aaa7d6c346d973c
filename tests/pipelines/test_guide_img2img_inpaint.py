"""The old Flax image-to-image and inpainting examples (diffusers v0.39's `FlaxStableDiffusionImg2ImgPipeline` and
`FlaxStableDiffusionInpaintPipeline` docstrings) with only the import changed, on 8 simulated devices: `jit=True`,
`jit=False` and a user's own `pmap` of `_generate` give the same images, and they are the user API's images."""

import jax
import numpy as np
import pytest
from PIL import Image

from sdjax import FlaxStableDiffusionImg2ImgPipeline, FlaxStableDiffusionInpaintPipeline, replicate, shard


def _picture(seed=0, size=64):
    a = np.random.default_rng(seed).integers(0, 255, (size // 8, size // 8, 3), np.uint8)
    return Image.fromarray(a).resize((size, size), Image.BILINEAR)


def _mask(size=64):
    m = np.zeros((size, size), np.uint8)
    m[8:40, 16:56] = 255
    return Image.fromarray(m).convert("RGB")


def test_img2img_example(sd1_dir):
    pipeline, params = FlaxStableDiffusionImg2ImgPipeline.from_pretrained(str(sd1_dir))
    num_samples = jax.device_count()
    prompt_ids, processed_image = pipeline.prepare_inputs(
        prompt=["a fantasy landscape"] * num_samples, image=[_picture(1)] * num_samples
    )
    assert prompt_ids.shape == (8, 77) and processed_image.shape == (8, 3, 64, 64)
    assert processed_image.min() >= -1 and processed_image.max() <= 1
    p_params = replicate(params)
    prng_seed = jax.random.split(jax.random.PRNGKey(0), jax.device_count())
    output = pipeline(
        prompt_ids=shard(prompt_ids),
        image=shard(processed_image),
        params=p_params,
        prng_seed=prng_seed,
        strength=0.75,
        num_inference_steps=5,
        jit=True,
        height=64,
        width=64,
    ).images
    assert output.shape == (8, 1, 64, 64, 3)
    # Device d's image = the same call without jit on that device's key alone.
    for d in (0, 3):
        single = pipeline(
            prompt_ids[d : d + 1],
            processed_image[d : d + 1],
            params,
            prng_seed[d],
            strength=0.75,
            num_inference_steps=5,
        ).images
        np.testing.assert_allclose(output[d, 0], single[0], atol=2e-5)
    # A user's own pmap of _generate (the old API's static arguments: start step, steps, height, width).
    start = pipeline.get_timestep_start(5, 0.75)
    p_generate = jax.pmap(pipeline._generate, static_broadcasted_argnums=(4, 5, 6, 7))
    mine = p_generate(
        shard(prompt_ids),
        shard(processed_image),
        p_params,
        prng_seed,
        start,
        5,
        64,
        64,
        np.full((8, 1), 7.5, np.float32),
    )
    np.testing.assert_allclose(np.asarray(mine), output, atol=2e-5)
    # The old API's strength is diffusers' (int(steps * strength) steps), which the user API also follows.
    user = pipeline.generate("a fantasy landscape", image=_picture(1), strength=0.75, steps=5, output_type="np")
    key_images = pipeline(
        prompt_ids[:1], processed_image[:1], params, jax.random.PRNGKey(0), strength=0.75, num_inference_steps=5
    ).images
    np.testing.assert_allclose(user, key_images, atol=2e-5)


def test_inpaint_example(tmp_path_factory, torch_sd1):
    import diffusers
    import reference

    unet9 = reference.unet({**reference.UNET_SD1, "in_channels": 9}, seed=7)
    folder = tmp_path_factory.mktemp("tiny-inpaint-guide")
    diffusers.StableDiffusionInpaintPipeline(**{**torch_sd1.components, "unet": unet9}).save_pretrained(
        folder, safe_serialization=True
    )
    pipeline, params = FlaxStableDiffusionInpaintPipeline.from_pretrained(str(folder))
    num_samples = jax.device_count()
    prompt = ["Face of a yellow cat, high resolution, sitting on a park bench"] * num_samples
    prompt_ids, processed_masked_images, processed_masks = pipeline.prepare_inputs(
        prompt, [_picture(2)] * num_samples, [_mask()] * num_samples
    )
    assert processed_masked_images.shape == (8, 3, 64, 64) and processed_masks.shape == (8, 1, 64, 64)
    assert set(np.unique(processed_masks)) <= {0.0, 1.0}
    assert (processed_masked_images[:, :, 8:40, 16:56] == 0).all()  # the masked region is blanked
    p_params = replicate(params)
    prng_seed = jax.random.split(jax.random.PRNGKey(0), jax.device_count())
    images = pipeline(
        shard(prompt_ids), shard(processed_masks), shard(processed_masked_images), p_params, prng_seed, 4, jit=True
    ).images
    assert images.shape == (8, 1, 64, 64, 3)
    single = pipeline(prompt_ids[:1], processed_masks[:1], processed_masked_images[:1], params, prng_seed[0], 4).images
    np.testing.assert_allclose(images[0, 0], single[0], atol=2e-5)
    with pytest.raises(ValueError, match="mask has shape"):
        pipeline(prompt_ids[:1], processed_masks[:1, :, :32], processed_masked_images[:1], params, prng_seed[0], 4)
