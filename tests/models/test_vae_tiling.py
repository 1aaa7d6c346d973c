"""Tiled VAE encode/decode against diffusers' `AutoencoderKL.enable_tiling()` (float32), and the tiling loop's
bookkeeping on its own.

The tiny reference VAE (4 levels, scale factor 8) with `sample_size=32` has tiles of 32 px / 4 latents: a 64x80 image
(8x10 latents) is a 3x4 grid with short tiles at the bottom and right edges (latent tile heights 4, 4, 2 and widths
4, 4, 4, 1; image tile heights 32, 32, 16 and widths 32, 32, 32, 8), so every blend and crop case runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

from sdjax.config import config_from_dict
from sdjax.models import vae as V
from sdjax.models import vae_tiling as T

torch = pytest.importorskip("torch")

# float32 parity: same tolerance as the untiled VAE test (tests/models/test_vae.py), relative to outputs of
# magnitude ~2. Measured max abs errors are printed.
ATOL, RTOL = 2e-5, 1e-5


@pytest.fixture(scope="module")
def tiny():
    model = reference.vae({**reference.VAE, "sample_size": 32}, seed=3)
    model.enable_tiling()
    config = config_from_dict(V.AutoencoderKLConfig, dict(model.config), source="vae/config.json")
    params = V.convert_vae(reference.state_dict_numpy(model), config)
    return model, V.AutoencoderKL(config), params


def _err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_tiling_settings_follow_diffusers(tiny):
    model, vae, _ = tiny
    tiling = T.VaeTiling.for_config(vae.config)
    assert (tiling.sample_size, tiling.latent_size, tiling.overlap_factor) == (
        model.tile_sample_min_size,
        model.tile_latent_min_size,
        model.tile_overlap_factor,
    )


def test_tiled_decode_matches_diffusers(tiny):
    model, vae, params = tiny
    tiling = T.VaeTiling.for_config(vae.config)
    z = np.random.default_rng(0).standard_normal((2, 4, 8, 10)).astype(np.float32)
    with torch.no_grad():
        want = model.decode(torch.from_numpy(z)).sample.numpy()
        model.disable_tiling()
        plain = model.decode(torch.from_numpy(z)).sample.numpy()
        model.enable_tiling()
    got = np.asarray(jax.jit(lambda p, x: T.tiled_decode(vae, p, x, tiling))(params, z))
    print(f"tiled decode: max abs err {_err(got, want):.2e}; tiled vs untiled differ by {_err(want, plain):.2e}")
    assert got.shape == want.shape == (2, 3, 64, 80)
    assert _err(want, plain) > 1e-2  # diffusers did tile: a seam-blended result, not the plain decode
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_tiled_encode_matches_diffusers(tiny):
    model, vae, params = tiny
    tiling = T.VaeTiling.for_config(vae.config)
    x = np.random.default_rng(1).uniform(-1, 1, (2, 3, 64, 80)).astype(np.float32)
    with torch.no_grad():
        posterior = model.encode(torch.from_numpy(x)).latent_dist
        mean, logvar = posterior.mean.numpy(), posterior.logvar.numpy()
        model.disable_tiling()
        plain = model.encode(torch.from_numpy(x)).latent_dist.mean.numpy()
        model.enable_tiling()
    got = jax.jit(lambda p, x: T.tiled_encode(vae, p, x, tiling))(params, x)
    print(f"tiled encode: mean {_err(got.mean, mean):.2e}, logvar {_err(got.logvar, logvar):.2e}")
    assert got.mean.shape == mean.shape == (2, 4, 8, 10)
    assert _err(mean, plain) > 1e-3
    np.testing.assert_allclose(np.asarray(got.mean), mean, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(got.logvar), logvar, atol=ATOL, rtol=RTOL)


def test_no_tiling_when_the_input_fits_one_tile(tiny):
    """diffusers tiles only inputs larger than a tile: up to 4x4 latents / 32x32 px the output is the plain one."""
    _, vae, params = tiny
    tiling = T.VaeTiling.for_config(vae.config)
    rng = np.random.default_rng(2)
    z = rng.standard_normal((1, 4, 4, 3)).astype(np.float32)
    x = rng.uniform(-1, 1, (1, 3, 32, 24)).astype(np.float32)

    @jax.jit
    def both(p, z, x):
        tiled = T.tiled_decode(vae, p, z, tiling), T.tiled_encode(vae, p, x, tiling).mean
        plain = vae.apply({"params": p}, z, method=vae.decode), vae.apply({"params": p}, x, method=vae.encode).mean
        return tiled, plain

    (img, mean), (plain_img, plain_mean) = both(params, z, x)
    assert img.shape == (1, 3, 32, 24) and mean.shape == (1, 4, 4, 3)
    np.testing.assert_array_equal(img, plain_img)
    np.testing.assert_array_equal(mean, plain_mean)


def _upsample(x, f=3):
    """A map without spatial context (each output pixel depends on one input pixel): tiling must not change it."""
    return jnp.repeat(jnp.repeat(x * 2.0 + 1.0, f, axis=2), f, axis=3)


@pytest.mark.parametrize("seed", range(3))
def test_tiling_loop_reproduces_a_local_map(seed):
    """Property: for a map without spatial context, tiled == untiled for any grid (short edge tiles, one or many
    tiles per axis, blends wider than short tiles): the grid covers the input, crops line up and blend weights sum
    to one."""
    rng = np.random.default_rng(seed)
    overlap, tiles = [(0.0, (1, 2, 3, 5)), (0.25, (4, 8)), (0.5, (2, 4, 6))][seed % 3]
    tile = int(rng.choice(tiles))
    f = 3
    stride, blend = int(tile * (1 - overlap)), int(tile * f * overlap)
    limit = tile * f - blend  # == stride * f: the crops step like the tiles (diffusers' configs satisfy it too)
    h, w = (int(v) for v in rng.integers(1, 30, 2))
    x = jnp.asarray(rng.standard_normal((2, 3, h, w)), jnp.float32)
    got = jax.jit(lambda x: T.tiled_apply(_upsample, x, tile=tile, stride=stride, blend=blend, limit=limit))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_upsample(x)), rtol=1e-6, atol=1e-6)


def test_bad_settings_name_the_argument(tiny):
    _, vae, _ = tiny
    with pytest.raises(ValueError, match="sample_size"):
        T.VaeTiling.for_config(vae.config, sample_size=0)
    with pytest.raises(ValueError, match="overlap_factor"):
        T.VaeTiling(64, 8, overlap_factor=1.0)
    with pytest.raises(ValueError, match="sample_size=40"):  # 5-latent tiles: crops of 30 px step 24 px
        T.VaeTiling.for_config(vae.config, sample_size=40)
    with pytest.raises(ValueError, match="sample_size=40"):  # the same tiles built by hand fail when used
        T.tiled_decode(vae, None, jnp.zeros((1, 4, 12, 12)), T.VaeTiling(40, 5))
