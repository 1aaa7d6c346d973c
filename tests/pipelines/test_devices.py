"""8 simulated CPU devices: per-device prompts, and images that do not depend on device count or batch size."""

import contextlib

import jax
import numpy as np
import pytest

from sdjax import StableDiffusionPipeline, replicate, shard


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))


def test_different_prompt_per_device(sd):
    pipe, params = sd
    prompts = [
        f"a photo of {w}" for w in ("a cat", "a dog", "a car", "a tree", "a boat", "a house", "the sea", "a cake")
    ]
    ids = shard(pipe.prepare_inputs(prompts))
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    # The same key on every device: differences between devices come from the prompts alone.
    same_keys = np.stack([np.asarray(keys[0])] * 8)
    images = pipe(ids, replicate(params), same_keys, num_inference_steps=3, jit=True).images
    assert images.shape == (8, 1, 64, 64, 3)
    # Device i's image equals the single-device image of prompt i with that key.
    for i in (0, 5):
        single = pipe(pipe.prepare_inputs([prompts[i]]), params, keys[0], num_inference_steps=3).images
        np.testing.assert_allclose(images[i, 0], single[0], atol=1e-5)
    assert np.abs(images[0] - images[1]).max() > 1e-3


@pytest.mark.parametrize("ndev", [1, 2, 8])
def test_same_image_whatever_device_count_and_batch(sd, ndev):
    pipe, _ = sd
    pipe.devices = jax.devices()[:ndev]
    try:
        # Three prompts: padded to the device count; image i keeps fold_in(PRNGKey(seed), i).
        many = pipe.generate(["a cat", "a dog", "a car"], num_images=1, seed=11, steps=3)
        alone = pipe.generate_arrays(["a dog"], [""], [11], [1], [7.5], steps=3, height=64, width=64)
    finally:
        pipe.devices = None
    ref = _reference_images(pipe)
    for i, im in enumerate(many):
        np.testing.assert_allclose(np.asarray(im, np.int16), ref[i], atol=1)
    np.testing.assert_allclose(alone[0].astype(np.int16), ref[1], atol=1)


_cache = {}


def _reference_images(pipe):
    if "ref" not in _cache:
        pipe.devices = jax.devices()[:1]
        try:
            _cache["ref"] = [
                np.asarray(pipe.generate(p, seed=11, steps=3)[0], np.int16)
                if i == 0
                else pipe.generate_arrays([p], [""], [11], [i], [7.5], steps=3, height=64, width=64)[0].astype(np.int16)
                for i, p in enumerate(["a cat", "a dog", "a car"])
            ]
        finally:
            pipe.devices = None
    return _cache["ref"]


@contextlib.contextmanager
def on_one_device(pipe):
    """One device: the program of 3 images (or of 1) that test_same_image_whatever_device_count_and_batch[1] and its
    reference compiled, and 3 (or 1) images to run instead of 8 (the 8-device mesh pads to 8)."""
    pipe.devices = jax.devices()[:1]
    try:
        yield pipe
    finally:
        pipe.devices = None


def test_num_images_per_prompt_are_distinct(sd):
    with on_one_device(sd[0]) as pipe:
        images = pipe.generate("a cat", num_images=3, seed=0, steps=3)
        again = pipe.generate("a cat", num_images=3, seed=0, steps=3)
    arrays = [np.asarray(im) for im in images]
    assert len(arrays) == 3
    assert len({a.tobytes() for a in arrays}) == 3
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(arrays, again))


def test_other_sampler_than_the_loaded_one(sd):
    """The high-level path builds the requested sampler's own state (not the loaded scheduler's)."""
    with on_one_device(sd[0]) as pipe:
        a = pipe.generate("a cat", seed=4, steps=3, sampler="euler_a")
        b = pipe.generate("a cat", seed=4, steps=3, sampler="Euler a")
        c = pipe.generate("a cat", seed=4, steps=3)
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert np.abs(np.asarray(a[0], np.int16) - np.asarray(c[0], np.int16)).max() > 2
