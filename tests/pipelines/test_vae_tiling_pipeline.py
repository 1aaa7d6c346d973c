"""`pipe.enable_vae_tiling()` in generation: the decode (and the image-to-image encode) run diffusers' VAE tiling.

The tiny SD 1.x pipeline's VAE has 8x downsampling; `enable_vae_tiling(tile_size=32)` makes a 64x64 image a 3x3 grid
of 4-latent tiles (short tiles of 2 latents at the bottom and right). Expectations come from diffusers' own
`AutoencoderKL` with tiling enabled and the same tile sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from sdjax import StableDiffusionPipeline
from sdjax.core import ProgramSpec, autoencoder

torch = pytest.importorskip("torch")

ATOL = 1e-4  # images in [0, 1]; the tiled decode itself agrees to ~1e-5 (tests/models/test_vae_tiling.py)


@pytest.fixture(scope="module")
def sd(sd1_dir):
    pipe, params = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    pipe.devices = jax.devices()[:1]  # one image per program, not padded to the 8 simulated devices
    return pipe, params


@pytest.fixture
def torch_vae(torch_sd1):
    """diffusers' VAE of the same pipeline with 32 px / 4-latent tiles (restored afterwards)."""
    vae = torch_sd1.vae
    saved = vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 4
    yield vae
    vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size = saved


def test_generation_decodes_with_diffusers_tiling(sd, torch_vae):
    pipe, _ = sd
    kw = dict(seed=3, steps=2, height=64, width=64)
    latents = np.array(pipe.generate("a red boat", output_type="latent", **kw))
    pipe.enable_vae_tiling(tile_size=32)
    try:
        assert pipe.vae_tiling.sample_size == 32 and pipe.vae_tiling.latent_size == 4
        tiled = np.asarray(pipe.generate("a red boat", output_type="np", **kw))
        keys = pipe.generator.cache.keys()  # each holds the ProgramSpec (with the mesh and the params' layout)
        specs = [part for key in keys for part in key if isinstance(part, ProgramSpec)]
        assert any(spec.vae_tiling == pipe.vae_tiling for spec in specs)  # tiling is in the compile key
    finally:
        pipe.disable_vae_tiling()
    assert pipe.generator.spec(batch=1, height=64, width=64, steps=2).vae_tiling is None
    with torch.no_grad():
        z = torch.from_numpy(latents) / torch_vae.config.scaling_factor
        want = (torch_vae.decode(z).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
        torch_vae.disable_tiling()
        plain = (torch_vae.decode(z).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    print(f"tiled generation vs diffusers tiled decode: max abs err {np.abs(tiled - want).max():.2e}")
    np.testing.assert_allclose(tiled, want, atol=ATOL)
    assert np.abs(tiled - plain).max() > 1e-3  # tiling did change the decode


def test_encode_with_tiling_matches_diffusers(sd, torch_vae):
    """The encode the image-to-image and inpainting tasks call (posterior mean, scaled) against diffusers."""
    pipe, params = sd
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 64, 64)).astype(np.float32)
    pipe.enable_vae_tiling(tile_size=32)
    try:
        got = autoencoder.encode(pipe.vae, params["vae"], jnp.asarray(x), None, jnp.float32, pipe.vae_tiling)
    finally:
        pipe.disable_vae_tiling()
    with torch.no_grad():
        want = torch_vae.encode(torch.from_numpy(x)).latent_dist.mean.numpy() * torch_vae.config.scaling_factor
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


def test_img2img_encodes_with_tiling(sd):
    pipe, _ = sd
    a = np.random.default_rng(1).integers(0, 255, (8, 8, 3), np.uint8)
    image = Image.fromarray(a).resize((64, 64), Image.BILINEAR)
    kw = dict(seed=1, steps=2, height=64, width=64, image=image, strength=0.5, output_type="latent")
    plain = np.asarray(pipe.generate("a house", **kw))
    pipe.enable_vae_tiling(tile_size=32)
    try:
        tiled = np.asarray(pipe.generate("a house", **kw))
    finally:
        pipe.disable_vae_tiling()
    assert np.abs(tiled - plain).max() > 1e-3  # the latents start from the tiled encode


def test_bad_tile_size_names_the_argument(sd):
    pipe, _ = sd
    with pytest.raises(ValueError, match="sample_size=0"):
        pipe.enable_vae_tiling(tile_size=0)
    with pytest.raises(ValueError, match="overlap_factor"):
        pipe.enable_vae_tiling(overlap_factor=1.5)
    assert pipe.vae_tiling is None
