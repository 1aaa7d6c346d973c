"""FluxTransformer2DModel vs diffusers 0.42.1 on tiny configs cut from Flux.1's, the pipeline's packing helpers,
and loading (a saved diffusers folder, the full-size key set, errors).

The tiny models keep Flux.1's structure (double- and single-stream blocks, three rotary axes, guidance embedding
on and off) at widths of 32: 2 + 2 blocks, 2 heads of 16 channels (rotary axes 4 + 6 + 6), T5 width 32, pooled
width 24, 16 input channels (4 latent channels packed 2x2). Each PyTorch model gets non-trivial RMSNorm weights
(fresh ones would hide a swapped `norm_q` / `norm_added_q`), is saved with `save_pretrained` (safetensors) and read
back with `safetensors` + `FluxTransformerConfig.from_dict` + `convert_flux_transformer`.

Inputs have the pipeline's scale: packed latents ~ N(0, 1) of a 16x12 latent (8x6 = 48 tokens), 7 text tokens
~ N(0, 1) whose ids are small distinct integers on all three axes (the pipeline's are zeros, which would leave
the text rotation untested), timesteps t / 1000 = (0.7, 0.25), guidance scales (3.5, 5.0). Errors are measured
relative to the largest output magnitude (~2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from sdjax.config import ConfigError, read_json
from sdjax.models import flux as F
from sdjax.models.convert import WeightLoadError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

# float32 parity, max abs error / max |reference| (measured: 2.3e-6 with guidance, 3.4e-7 without).
REL_TOL = 1e-4
# bfloat16 compute (residuals, norms, softmax float32) vs float32 PyTorch (measured: 5.2e-3).
BF16_REL_TOL = 2e-2
# Same numbers, other runtime options (remat, another attention implementation): float rounding only.
OPTION_REL_TOL = 1e-5

TINY = dict(
    patch_size=1,
    in_channels=16,
    out_channels=None,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    axes_dims_rope=(4, 6, 6),
)
# black-forest-labs/FLUX.1-dev transformer/config.json (schnell: guidance_embeds false).
FLUX_DEV = dict(
    _class_name="FluxTransformer2DModel",
    _diffusers_version="0.30.0.dev0",
    attention_head_dim=128,
    guidance_embeds=True,
    in_channels=64,
    joint_attention_dim=4096,
    num_attention_heads=24,
    num_layers=19,
    num_single_layers=38,
    patch_size=1,
    pooled_projection_dim=768,
    axes_dims_rope=[16, 56, 56],
)
LATENT_H, LATENT_W = 16, 12


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


class Case:
    """A tiny diffusers Flux transformer saved and loaded back, its inputs and its float32 output."""

    def __init__(self, guidance: bool, folder, seed: int = 0):
        torch.manual_seed(seed)
        model = diffusers.FluxTransformer2DModel(**TINY, guidance_embeds=guidance).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.RMSNorm):
                    m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
        model.save_pretrained(folder, safe_serialization=True)
        self.config = F.FluxTransformerConfig.from_dict(read_json(folder / "config.json"))
        self.state = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
        self.params = F.convert_flux_transformer(self.state, self.config)

        rng = np.random.default_rng(seed)
        latents = rng.standard_normal((2, 4, LATENT_H, LATENT_W)).astype(np.float32)
        self.inputs = dict(
            hidden_states=F.pack_latents(latents),
            encoder_hidden_states=rng.standard_normal((2, 7, 32)).astype(np.float32),
            pooled_projections=rng.standard_normal((2, 24)).astype(np.float32),
            timestep=np.array([0.7, 0.25], np.float32),
            img_ids=F.image_ids(LATENT_H, LATENT_W),
            txt_ids=rng.permutation(np.arange(21)).reshape(7, 3).astype(np.float32),
            guidance=np.array([3.5, 5.0], np.float32) if guidance else None,
        )
        with torch.no_grad():
            kwargs = {k: None if v is None else torch.from_numpy(v) for k, v in self.inputs.items()}
            self.reference = model(**kwargs).sample.numpy()

    def run(self, dtype=jnp.float32, **options) -> np.ndarray:
        model = F.FluxTransformer2DModel(self.config, dtype=dtype, **options)
        i = self.inputs
        args = [i[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")]
        args = [jnp.asarray(a, dtype) for a in args[:3]] + [args[3], i["img_ids"], i["txt_ids"], i["guidance"]]
        out = jax.jit(lambda p, *a: model.apply({"params": p}, *a))(self.params, *args)
        assert out.dtype == dtype
        return np.asarray(out.astype(jnp.float32))


_cases: dict[bool, Case] = {}


def _case(guidance: bool, tmp_path_factory) -> Case:
    if guidance not in _cases:
        _cases[guidance] = Case(guidance, tmp_path_factory.mktemp("flux") / "transformer")
    return _cases[guidance]


@pytest.fixture(params=[True, False], ids=["dev", "schnell"])
def case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


@pytest.fixture
def dev(tmp_path_factory):
    return _case(True, tmp_path_factory)


def test_matches_diffusers(case):
    out = case.run()
    assert out.shape == case.reference.shape == (2, 48, 16)
    err = rel_err(out, case.reference)
    top = np.abs(case.reference).max()
    print(f"guidance_embeds={case.config.guidance_embeds}: max rel err {err:.2e} (max |ref| {top:.2f})")
    assert err < REL_TOL


def test_bfloat16_against_float32_torch(dev):
    err = rel_err(dev.run(jnp.bfloat16), dev.reference)
    print(f"bf16: max rel err {err:.2e}")
    assert err < BF16_REL_TOL


def test_runtime_options_keep_the_numbers(dev):
    model = F.FluxTransformer2DModel(dev.config)
    other = model.clone(attention="chunked", remat=True)  # what the generator does with `attention`
    assert other.attention == "chunked" and other.remat
    # "chunked" is what "auto" picks on CPU at real sizes (> 256 image tokens); the tiny model's default is "xla".
    err = rel_err(dev.run(attention="chunked", remat=True), dev.run())
    print(f"remat + chunked attention vs default: {err:.2e}")
    assert err < OPTION_REL_TOL


def test_guidance_argument_must_match_the_config(case):
    model = F.FluxTransformer2DModel(case.config)
    i = case.inputs
    args = [i[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids")]
    wrong = None if case.config.guidance_embeds else np.ones(2, np.float32)
    with pytest.raises(ValueError, match="guidance"):
        model.apply({"params": case.params}, *args, i["txt_ids"], wrong)
    with pytest.raises(ValueError, match=r"img_ids must be \(L=48, 3\)"):
        model.apply({"params": case.params}, *args[:4], i["img_ids"][:-1], i["txt_ids"], i["guidance"])


# ---------------------------------------------------------------------------------------------- pipeline helpers
def test_packing_matches_flux_pipeline():
    pipe = diffusers.FluxPipeline
    latents = np.random.default_rng(1).standard_normal((2, 4, 10, 6)).astype(np.float32)
    ref = pipe._pack_latents(torch.from_numpy(latents), 2, 4, 10, 6).numpy()
    np.testing.assert_array_equal(F.pack_latents(latents), ref)
    np.testing.assert_array_equal(np.asarray(jax.jit(F.pack_latents)(latents)), ref)
    # diffusers' unpack takes the image size in pixels and the VAE's factor; sdjax's the latent size.
    back = pipe._unpack_latents(torch.from_numpy(ref), 10 * 8, 6 * 8, 8).numpy()
    np.testing.assert_array_equal(F.unpack_latents(ref, 10, 6), back)
    np.testing.assert_array_equal(np.asarray(F.unpack_latents(jnp.asarray(ref), 10, 6)), latents)
    ids = pipe._prepare_latent_image_ids(2, 10 // 2, 6 // 2, "cpu", torch.float32).numpy()
    assert F.image_ids(10, 6).dtype == np.float32
    np.testing.assert_array_equal(F.image_ids(10, 6), ids)
    np.testing.assert_array_equal(F.text_ids(5), np.zeros((5, 3), np.float32))
    with pytest.raises(ValueError, match="even"):
        F.pack_latents(latents[:, :, :9])
    with pytest.raises(ValueError, match="2x2 patches"):
        F.unpack_latents(ref, 12, 6)


# ---------------------------------------------------------------------------------------------- loading
def test_full_size_key_set_and_shapes():
    """Every key and shape of the real Flux.1 dev state dict (a PyTorch model on the meta device: shapes, no
    memory) maps onto `init_params_shape` (traced, never allocated), and nothing is left over."""
    config = F.FluxTransformerConfig.from_dict(FLUX_DEV)
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(**{k: v for k, v in FLUX_DEV.items() if not k.startswith("_")})
    state = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in model.state_dict().items()}
    params = F.convert_flux_transformer(state, config)  # zero-stride views: no memory either
    assert sum(int(np.prod(v.shape)) for v in jax.tree_util.tree_leaves(params)) == 11_901_408_320
    shapes = F.FluxTransformer2DModel.init_params_shape(config)
    assert shapes["transformer_blocks_0"]["attn"]["norm_added_q"]["scale"].shape == (128,)
    assert shapes["single_transformer_blocks_37"]["proj_out"]["kernel"].shape == (3072 + 4 * 3072, 3072)
    assert shapes["time_text_embed"]["guidance_embedder"]["linear_1"]["kernel"].shape == (256, 3072)
    schnell = F.FluxTransformerConfig.from_dict({**FLUX_DEV, "guidance_embeds": False})
    assert "guidance_embedder" not in F.init_params_shape(schnell)["time_text_embed"]


def test_weight_errors_name_the_keys(case):
    state = dict(case.state)
    state["transformer_blocks.0.attn.to_q.weight"] = np.zeros((3, 3), np.float32)
    state["single_transformer_blocks.1.attn.norm_k.bias"] = np.zeros(16, np.float32)
    del state["norm_out.linear.bias"]
    with pytest.raises(WeightLoadError) as e:
        F.convert_flux_transformer(state, case.config, component="transformer (tiny)")
    assert e.value.misshaped[0].startswith("transformer_blocks.0.attn.to_q.weight: checkpoint (3, 3)")
    assert e.value.unexpected == ["single_transformer_blocks.1.attn.norm_k.bias"]
    assert e.value.missing == ["norm_out/linear/bias"]
    assert str(e.value).startswith("transformer (tiny): ")


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['qk_norm'\]"):
        F.FluxTransformerConfig.from_dict({**FLUX_DEV, "qk_norm": "rms_norm"}, source="transformer/config.json")
    with pytest.raises(ConfigError, match="axes_dims_rope"):
        F.FluxTransformerConfig.from_dict({**FLUX_DEV, "axes_dims_rope": [16, 56, 48]})
    config = F.FluxTransformerConfig.from_dict(FLUX_DEV)
    assert config.axes_dims_rope == (16, 56, 56) and hash(config)  # lists frozen: jit-static
    assert config.output_channels == 64 and config.inner_dim == 3072
