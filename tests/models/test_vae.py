"""AutoencoderKL vs diffusers on the tiny reference configs (float32), plus loading of both checkpoint namings.

Images are uniform in [-1, 1] (B, 3, 16, 16); latents ~ N(0, 1) (B, 4, 4, 4) decode to (B, 3, 32, 32).
Measured max abs errors: encoder mean/logvar <= 2e-6, decoder <= 8.1e-6 on outputs of magnitude ~2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

from sdjax.config import ConfigError, config_from_dict
from sdjax.models import vae as V
from sdjax.models.convert import WeightLoadError

torch = pytest.importorskip("torch")

# float32 parity, max abs error vs diffusers (outputs of magnitude ~2; measured: encoder <= 2e-6, decoder
# <= 8.1e-6).
ATOL, RTOL = 2e-5, 1e-5
OPTION_ATOL = 1e-5


class Case:
    def __init__(self, raw: dict, seed: int = 0):
        self.torch_model = reference.vae(raw, seed=seed)
        self.config = config_from_dict(V.AutoencoderKLConfig, dict(self.torch_model.config), source="vae/config.json")
        self.state = reference.state_dict_numpy(self.torch_model)
        self.params = V.convert_vae(self.state, self.config)
        rng = np.random.default_rng(seed)
        self.images = rng.uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
        self.latents = rng.standard_normal((2, 4, 4, 4)).astype(np.float32)
        with torch.no_grad():
            posterior = self.torch_model.encode(torch.from_numpy(self.images)).latent_dist
            self.mean, self.logvar = posterior.mean.numpy(), posterior.logvar.numpy()
            self.decoded = self.torch_model.decode(torch.from_numpy(self.latents)).sample.numpy()

    def run(self, params=None, dtype=jnp.float32, **options):
        """(mean, logvar, decoded) from sdjax, one jit per call."""
        model = V.AutoencoderKL(self.config, dtype=dtype, **options)

        @jax.jit
        def f(p, images, latents):
            posterior = model.apply({"params": p}, images, method=model.encode)
            return posterior.mean, posterior.logvar, model.apply({"params": p}, latents, method=model.decode)

        out = f(
            self.params if params is None else params, jnp.asarray(self.images, dtype), jnp.asarray(self.latents, dtype)
        )
        return tuple(np.asarray(x.astype(jnp.float32)) for x in out)


_cases: dict[str, Case] = {}


def case(name: str) -> Case:
    if name not in _cases:
        _cases[name] = Case(*{"sd": (reference.VAE, 0), "sdxl": (reference.VAE_SDXL, 1)}[name])
    return _cases[name]


def max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("name", ["sd", "sdxl"])
def test_matches_diffusers(name):
    c = case(name)
    mean, logvar, decoded = c.run()
    assert mean.shape == logvar.shape == (2, 4, 2, 2) and decoded.shape == (2, 3, 32, 32)  # NCHW at the boundary
    print(
        f"{name}: mean {max_err(mean, c.mean):.2e}, logvar {max_err(logvar, c.logvar):.2e}, "
        f"decode {max_err(decoded, c.decoded):.2e} (max |ref| {np.abs(c.decoded).max():.2f})"
    )
    np.testing.assert_allclose(mean, c.mean, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(logvar, c.logvar, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(decoded, c.decoded, atol=ATOL, rtol=RTOL)


def test_config_fields():
    c = case("sdxl")
    assert c.config.scaling_factor == 0.13025 and c.config.force_upcast is True
    assert c.config.shift_factor is None and c.config.use_quant_conv and c.config.use_post_quant_conv


def test_attention_options_give_the_same_numbers():
    # the mid-block attention sees 4 tokens (encode) and 16 (decode); chunks of 3 force padded chunking.
    c = case("sd")
    base = c.run()
    for options in (
        dict(attention="chunked", attention_chunk_size=3, split_head_dim=True),
        dict(attention="dot_product"),
    ):
        for got, want in zip(c.run(**options), base):
            print(f"{options}: max abs diff {max_err(got, want):.2e}")
            np.testing.assert_allclose(got, want, atol=OPTION_ATOL, rtol=0)


def test_old_attention_names_load():
    # Checkpoints written before diffusers 0.14 name the mid-block attention query/key/value/proj_attn.
    c = case("sd")
    old = {}
    for k, v in c.state.items():
        for new, legacy in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), ("to_out.0", "proj_attn")):
            k = k.replace(f"attentions.0.{new}.", f"attentions.0.{legacy}.")
        old[k] = v
    assert any(".proj_attn." in k for k in old) and not any(".to_q." in k for k in old)
    params = V.convert_vae(old, c.config)
    flat_new = jax.tree_util.tree_leaves_with_path(c.params)
    flat_old = dict(jax.tree_util.tree_leaves_with_path(params))
    assert len(flat_new) == len(flat_old)
    for path, value in flat_new:
        np.testing.assert_array_equal(flat_old[path], value)


def test_wrong_shape_is_reported_by_name():
    c = case("sd")
    state = dict(c.state)
    key = "decoder.mid_block.attentions.0.to_v.weight"
    state[key] = np.zeros((64, 32), np.float32)
    with pytest.raises(WeightLoadError, match=r"decoder\.mid_block\.attentions\.0\.to_v\.weight"):
        V.convert_vae(state, c.config)


def test_posterior_sample_and_mode():
    mean = jnp.zeros((2, 4, 3, 3))
    posterior = V.DiagonalGaussian.from_moments(jnp.concatenate([mean, jnp.full_like(mean, 100.0)], axis=1))
    assert float(posterior.logvar.max()) == 20.0  # clamped as in diffusers
    assert posterior.mode() is posterior.mean
    a, b = posterior.sample(jax.random.key(0)), posterior.sample(jax.random.key(1))
    assert a.shape == mean.shape and not np.allclose(a, b)


def test_bfloat16_smoke():
    c = case("sd")
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), c.params)
    mean, logvar, decoded = c.run(params=params, dtype=jnp.bfloat16)
    assert all(np.isfinite(x).all() for x in (mean, logvar, decoded))
    print(f"bf16: mean {max_err(mean, c.mean):.2e}, decode {max_err(decoded, c.decoded):.2e}")
    assert max_err(decoded, c.decoded) < 0.1 * np.abs(c.decoded).max()
    assert max_err(mean, c.mean) < 0.1 * np.abs(c.mean).max()


@pytest.mark.parametrize("key,value", [("down_block_types", ("DownBlock2D",) * 4), ("act_fn", "tanh")])
def test_unsupported_config_raises(key, value):
    with pytest.raises(ConfigError, match=key):
        config_from_dict(V.AutoencoderKLConfig, {**reference.VAE, key: value}, source="vae/config.json")


def test_optional_parts_match_diffusers():
    # no quant convs, no mid-block attention, two resnets per block, 3 blocks
    raw = {
        **reference.VAE,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": False,
        "layers_per_block": 2,
        "block_out_channels": (32, 64, 64),
        "down_block_types": ("DownEncoderBlock2D",) * 3,
        "up_block_types": ("UpDecoderBlock2D",) * 3,
    }
    c = Case(raw)
    assert "quant_conv" not in c.params and "attentions_0" not in c.params["decoder"]["mid_block"]
    mean, logvar, decoded = c.run()
    print(f"optional parts: mean {max_err(mean, c.mean):.2e}, decode {max_err(decoded, c.decoded):.2e}")
    np.testing.assert_allclose(mean, c.mean, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(logvar, c.logvar, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(decoded, c.decoded, atol=ATOL, rtol=RTOL)
