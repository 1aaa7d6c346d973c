"""The SDXL guide's two scripts (sdxl_single.py and sdxl_single_aot.py) with only the imports changed.

Changed lines: `from diffusers import FlaxStableDiffusionXLPipeline` -> `from sdjax import ...`,
`from flax.jax_utils import replicate` -> `from sdjax import replicate`, and
`from jax.experimental.compilation_cache import compilation_cache as cc` -> `from sdjax import compilation_cache as
cc`. The model path is the tiny SDXL folder, its size 64x64 and fewer steps, so the test runs on CPU.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(scope="module")
def loaded(sdxl_dir, tmp_path_factory):
    from sdjax import FlaxStableDiffusionXLPipeline
    from sdjax import compilation_cache as cc

    cc.initialize_cache(str(tmp_path_factory.mktemp("sdxl_cache")))
    pipeline, params = FlaxStableDiffusionXLPipeline.from_pretrained(str(sdxl_dir), revision=None, split_head_dim=True)
    scheduler_state = params.pop("scheduler")
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    params["scheduler"] = scheduler_state
    return pipeline, params


default_prompt = "a colorful photo of a castle in the middle of a forest with trees and bushes, by Ismail Inceoglu"
default_neg_prompt = "fog, grainy, purple"
default_seed = 33
default_guidance_scale = 5.0
default_num_steps = 4
height = width = 64


def test_sdxl_single(loaded, tmp_path):
    from sdjax import replicate

    pipeline, params = loaded
    NUM_DEVICES = jax.device_count()

    def tokenize_prompt(prompt, neg_prompt):
        prompt_ids = pipeline.prepare_inputs(prompt)
        neg_prompt_ids = pipeline.prepare_inputs(neg_prompt)
        return prompt_ids, neg_prompt_ids

    p_params = replicate(params)

    def replicate_all(prompt_ids, neg_prompt_ids, seed):
        p_prompt_ids = replicate(prompt_ids)
        p_neg_prompt_ids = replicate(neg_prompt_ids)
        rng = jax.random.PRNGKey(seed)
        rng = jax.random.split(rng, NUM_DEVICES)
        return p_prompt_ids, p_neg_prompt_ids, rng

    def generate(
        prompt,
        negative_prompt,
        seed=default_seed,
        guidance_scale=default_guidance_scale,
        num_inference_steps=default_num_steps,
    ):
        prompt_ids, neg_prompt_ids = tokenize_prompt(prompt, negative_prompt)
        prompt_ids, neg_prompt_ids, rng = replicate_all(prompt_ids, neg_prompt_ids, seed)
        images = pipeline(
            prompt_ids,
            p_params,
            rng,
            num_inference_steps=num_inference_steps,
            neg_prompt_ids=neg_prompt_ids,
            guidance_scale=guidance_scale,
            jit=True,
        ).images
        images = images.reshape((images.shape[0] * images.shape[1],) + images.shape[-3:])
        return pipeline.numpy_to_pil(np.array(images))

    start = time.time()
    generate(default_prompt, default_neg_prompt)
    print(f"Compiled in {time.time() - start}")
    prompt = "photo of a rhino dressed suit and tie sitting at a table in a bar with a bar stools"
    neg_prompt = "cartoon, illustration, animation. face. male, female"
    images = generate(prompt, neg_prompt)
    assert len(images) == NUM_DEVICES and images[0].size == (64, 64)
    for i, image in enumerate(images):
        image.save(tmp_path / f"castle_{i}.png")
    arrays = np.stack([np.asarray(im, np.float32) for im in images])
    assert arrays.std() > 1.0  # not blank, not NaN-black
    assert len({a.tobytes() for a in arrays}) == NUM_DEVICES  # one key per device


def test_sdxl_single_aot(loaded):
    from jax import pmap

    from sdjax import replicate

    pipeline, params = loaded
    NUM_DEVICES = jax.device_count()
    p_params = replicate(params)

    def tokenize_prompt(prompt, neg_prompt):
        return pipeline.prepare_inputs(prompt), pipeline.prepare_inputs(neg_prompt)

    def replicate_all(prompt_ids, neg_prompt_ids, seed):
        rng = jax.random.split(jax.random.PRNGKey(seed), NUM_DEVICES)
        return replicate(prompt_ids), replicate(neg_prompt_ids), rng

    def aot_compile(
        prompt=default_prompt,
        negative_prompt=default_neg_prompt,
        seed=default_seed,
        guidance_scale=default_guidance_scale,
        num_inference_steps=default_num_steps,
    ):
        prompt_ids, neg_prompt_ids = tokenize_prompt(prompt, negative_prompt)
        prompt_ids, neg_prompt_ids, rng = replicate_all(prompt_ids, neg_prompt_ids, seed)
        g = jnp.array([guidance_scale] * prompt_ids.shape[0], dtype=jnp.float32)
        g = g[:, None]
        return (
            pmap(pipeline._generate, static_broadcasted_argnums=[3, 4, 5, 9])
            .lower(prompt_ids, p_params, rng, num_inference_steps, height, width, g, None, neg_prompt_ids, False)
            .compile()
        )

    p_generate = aot_compile()

    def generate(prompt, negative_prompt, seed=default_seed, guidance_scale=default_guidance_scale):
        prompt_ids, neg_prompt_ids = tokenize_prompt(prompt, negative_prompt)
        prompt_ids, neg_prompt_ids, rng = replicate_all(prompt_ids, neg_prompt_ids, seed)
        g = jnp.array([guidance_scale] * prompt_ids.shape[0], dtype=jnp.float32)
        g = g[:, None]
        images = p_generate(prompt_ids, p_params, rng, g, None, neg_prompt_ids)
        images = images.reshape((images.shape[0] * images.shape[1],) + images.shape[-3:])
        return pipeline.numpy_to_pil(np.array(images)), np.array(images)

    prompt = "photo of a rhino dressed suit and tie sitting at a table in a bar with a bar stools"
    neg_prompt = "cartoon, illustration, animation. face. male, female"
    pil, aot = generate(prompt, neg_prompt)
    assert len(pil) == NUM_DEVICES and aot.shape == (NUM_DEVICES, 64, 64, 3)
    # The AOT executable computes what the pipeline's own jit=True path computes.
    ids = replicate(pipeline.prepare_inputs(prompt))
    neg = replicate(pipeline.prepare_inputs(neg_prompt))
    rng = jax.random.split(jax.random.PRNGKey(default_seed), NUM_DEVICES)
    ref = pipeline(
        ids,
        p_params,
        rng,
        num_inference_steps=default_num_steps,
        guidance_scale=default_guidance_scale,
        neg_prompt_ids=neg,
        jit=True,
    ).images
    np.testing.assert_allclose(aot, ref.reshape(aot.shape), atol=2e-2)
