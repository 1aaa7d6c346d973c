"""The JAX/Flax guide (shared/seeds/jax-flax-stable-diffusion-guide.md), cell by cell, with only the import changed.

Runs on a tiny SD1-style model with 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS).
"""

import jax
import numpy as np
import pytest


@pytest.fixture(scope="module")
def guide(sd1_dir):
    # --- "Load a model" (the guide's import, changed to sdjax) ---
    import jax.numpy as jnp
    from jax import pmap  # noqa: F401

    from sdjax import FlaxStableDiffusionPipeline, replicate, shard

    dtype = jnp.bfloat16
    pipeline, params = FlaxStableDiffusionPipeline.from_pretrained(str(sd1_dir), variant=None, dtype=dtype)
    return pipeline, params, replicate, shard


def test_guide_cells(guide):
    pipeline, params, replicate, shard = guide
    from sdjax import make_image_grid

    assert jax.device_count() == 8
    prompt = "A cinematic film still of Morgan Freeman starring as Jimi Hendrix, portrait, 40mm lens, shallow depth"
    prompt = [prompt] * jax.device_count()
    prompt_ids = pipeline.prepare_inputs(prompt)
    assert prompt_ids.shape == (8, 77)

    p_params = replicate(params)
    prompt_ids = shard(prompt_ids)
    assert prompt_ids.shape == (8, 1, 77)

    def create_key(seed=0):
        return jax.random.PRNGKey(seed)

    rng = create_key(0)
    rng = jax.random.split(rng, jax.device_count())

    images = pipeline(prompt_ids, p_params, rng, jit=True)[0]
    assert images.shape == (8, 1, 64, 64, 3)
    assert np.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    # Each device has its own key: the 8 images differ.
    first = images.reshape((8, 64, 64, 3)).copy()
    flat = images.reshape((8, -1))
    assert min(np.abs(flat[i] - flat[j]).max() for i in range(8) for j in range(i)) > 1e-2

    images = images.reshape((images.shape[0] * images.shape[1],) + images.shape[-3:])
    images = pipeline.numpy_to_pil(images)
    grid = make_image_grid(images, rows=2, cols=4)
    assert grid.size == (4 * 64, 2 * 64)

    # --- "Using different prompts" ---
    prompts = [
        "Labrador in the style of Hokusai",
        "Painting of a squirrel skating in New York",
        "HAL-9000 in the style of Van Gogh",
        "Times Square under water, with fish and a dolphin swimming around",
        "Ancient Roman fresco showing a man working on his laptop",
        "Close-up photograph of young black woman against urban background, high quality, bokeh",
        "Armchair in the shape of an avocado",
        "Clown astronaut in space, with Earth in the background",
    ]
    prompt_ids = pipeline.prepare_inputs(prompts)
    prompt_ids = shard(prompt_ids)
    images2 = pipeline(prompt_ids, p_params, rng, jit=True).images
    images2 = images2.reshape((images2.shape[0] * images2.shape[1],) + images2.shape[-3:])
    assert images2.shape == (8, 64, 64, 3)
    # Same keys, different prompts: different images (the text reaches the UNet on every device).
    assert all(np.abs(images2[i] - first[i]).max() > 1e-3 for i in range(8))
    pil = pipeline.numpy_to_pil(images2)
    make_image_grid(pil, 2, 4)

    # --- "How does parallelization work?": pmap the private _generate ---
    from jax import pmap

    p_generate = pmap(pipeline._generate)
    images3 = p_generate(prompt_ids, p_params, rng)
    images3 = images3.block_until_ready()
    assert images3.shape == (8, 1, 64, 64, 3)
    # pmap(_generate) with the defaults is the same computation as pipeline(..., jit=True).
    np.testing.assert_allclose(np.asarray(images3).reshape(images2.shape), images2, atol=2e-2)


def test_summary_pmap_of_call(guide):
    """The seed summary wraps the whole pipeline call (jit=False) in the user's own pmap."""
    pipeline, params, replicate, shard = guide
    from jax import pmap

    prompt_ids = shard(pipeline.prepare_inputs(["a cat"] * jax.device_count()))
    p_params = replicate(params)
    rng = jax.random.split(jax.random.PRNGKey(0), jax.device_count())

    @pmap
    def generate(prompt_ids, p_params, rng):
        return pipeline(
            prompt_ids=prompt_ids, params=p_params, prng_seed=rng, num_inference_steps=4, guidance_scale=7.5
        ).images

    images = generate(prompt_ids, p_params, rng)
    assert images.shape == (8, 1, 64, 64, 3)
    ref = pipeline(prompt_ids, p_params, rng, num_inference_steps=4, jit=True).images
    np.testing.assert_allclose(np.asarray(images), ref, atol=2e-2)
