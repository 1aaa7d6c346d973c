"""`pipe.enable_vae_slicing()`: the VAE runs over the batch a slice at a time (`models.vae_slicing`), with the same
images and less memory; on a mesh a slice is one image per device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import StableDiffusionPipeline
from sdjax.models import vae_slicing
from sdjax.parallel.sharding import make_mesh


def test_slices_take_images_with_a_stride_and_results_come_back_in_order():
    """A function that mixes the images of its batch shows which images share a slice: with 6 images, 2 a slice,
    slice j holds images j and j + 3 (one from each half: one image of each device's block of 3)."""
    x = jnp.arange(6.0)[:, None] * jnp.ones((1, 2))
    got = np.asarray(vae_slicing.sliced(lambda b: b + 10 * b.sum(0, keepdims=True), x, 2))
    want = np.asarray([[i + 10 * (i % 3 + i % 3 + 3)] * 2 for i in range(6)])
    np.testing.assert_array_equal(got, want)
    # tuple outputs come back per image too; a size that does not divide the batch is cut to a divisor
    a, b = vae_slicing.sliced(lambda v: (v * 2, v.sum(1)), x, 4)
    np.testing.assert_array_equal(a, x * 2)
    np.testing.assert_array_equal(b, x.sum(1))
    assert vae_slicing.slice_count(6, 4) == 3 and vae_slicing.slice_count(8, 8) == 1
    with pytest.raises(ValueError, match="slice size must be at least 1, got 0"):
        vae_slicing.slice_count(4, 0)


@pytest.fixture(scope="module")
def sd(sd1_dir):
    pipe, params = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    pipe.devices = jax.devices()[:1]
    return pipe, params


KW = dict(steps=2, seed=5, num_images=4, output_type="np")


def test_sliced_generation_gives_the_same_images_with_less_decode_memory(sd):
    pipe, _ = sd
    gen = pipe.generator
    whole = pipe.generate("a lighthouse", **KW)
    spec = gen.spec(batch=4, height=64, width=64, steps=2)
    plain_decode = gen.executables(spec)[1]
    pipe.enable_vae_slicing()
    try:
        sliced = pipe.generate("a lighthouse", **KW)
        spec = gen.spec(batch=4, height=64, width=64, steps=2)
        assert spec.vae_slicing == 1  # one device: one image at a time
        sliced_decode = gen.executables(spec)[1]
    finally:
        pipe.disable_vae_slicing()
    np.testing.assert_allclose(sliced, whole, atol=1e-5)  # float rounding of a smaller batch
    temp = [d.memory_analysis().temp_size_in_bytes for d in (plain_decode, sliced_decode)]
    assert temp[1] < 0.5 * temp[0], temp  # one image's activations at a time instead of four


def test_on_a_mesh_a_slice_is_one_image_per_device(sd):
    """The slice size follows the mesh's data axis (the order it implies is the unit test's above); the per-device
    programs of the guide's pmap decode one image at a time."""
    pipe, _ = sd
    gen = pipe.generator
    pipe.enable_vae_slicing()
    try:
        assert (
            gen.spec(
                batch=4, height=64, width=64, steps=2, mesh=make_mesh(data=2, model=1, devices=jax.devices()[:2])
            ).vae_slicing
            == 2
        )
        assert gen.spec(batch=4, height=64, width=64, steps=2, vae_slice=1).vae_slicing == 1
    finally:
        pipe.disable_vae_slicing()
    assert gen.spec(batch=4, height=64, width=64, steps=2).vae_slicing == 0


def test_the_encoder_is_sliced_too(sd):
    """img2img and inpainting encode through `autoencoder.encode`: sliced, the same posterior sample."""
    from sdjax.core import autoencoder

    pipe, params = sd
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.uniform(-1, 1, (4, 3, 64, 64)), jnp.float32)
    eps = jnp.asarray(rng.standard_normal((4, 4, 8, 8)), jnp.float32)

    def encode(slicing):
        return jax.jit(lambda p, x, e: autoencoder.encode(pipe.vae, p, x, e, jnp.float32, None, slicing))(
            params["vae"], images, eps
        )

    np.testing.assert_allclose(encode(1), encode(0), atol=1e-5)
