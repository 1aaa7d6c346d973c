"""SD3Transformer2DModel vs diffusers 0.42.1 on tiny configs cut from the released SD 3 / 3.5 ones, and loading
(a saved diffusers folder, the full-size key sets, errors).

The tiny models keep each release's structure at a width of 32 (2 heads of 16), 3 joint blocks (the last one
context pre-only), patch size 2, 4 latent channels, text width 40, pooled width 24:
- "sd3-medium": no qk_norm, no dual attention;
- "sd35-medium": qk_norm "rms_norm", dual attention in blocks 0 and 1 (SD 3.5 medium has 0..12 of 24);
- "sd35-large": qk_norm "rms_norm", `out_channels` null (= in_channels);
- "no-max-size": `pos_embed_max_size` null (the position table computed for the image, at another size than
  `sample_size`: diffusers' interpolated table).
Each PyTorch model gets non-trivial RMSNorm weights (ones would hide a swapped `norm_q` / `norm_added_q`) and a
random position table in place of the sinusoids (a wrongly placed crop window would still look plausible on a smooth
table); it is saved with `save_pretrained` (safetensors) and read back with `safetensors` +
`SD3TransformerConfig.from_dict` + `convert_sd3_transformer`.

Inputs have the pipeline's scale: latents ~ N(0, 1) of 16x12 (8x6 patches: the `pos_embed_max_size` 12 table is
cropped to its centre, top 2, left 3), 7 text tokens ~ N(0, 1), timesteps t = (700, 250). Errors are measured
relative to the largest output magnitude.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from sdjax.config import ConfigError, read_json
from sdjax.models import sd3 as S
from sdjax.models.convert import WeightLoadError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

# float32 parity, max abs error / max |reference| (measured: 2.9e-7 .. 3.6e-7; with skip_layers 2.9e-7).
REL_TOL = 1e-4
# bfloat16 compute (residuals, norms, softmax float32) vs float32 PyTorch (measured: 4.6e-3).
BF16_REL_TOL = 2e-2
# Same numbers, other runtime options (remat, another attention implementation): float rounding only.
OPTION_REL_TOL = 1e-5

BASE = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    num_layers=3,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=40,
    caption_projection_dim=32,
    pooled_projection_dim=24,
    out_channels=4,
    pos_embed_max_size=12,
)
TINY = {
    "sd3-medium": dict(BASE),
    "sd35-medium": {**BASE, "dual_attention_layers": (0, 1), "qk_norm": "rms_norm", "pos_embed_max_size": 16},
    "sd35-large": {**BASE, "qk_norm": "rms_norm", "out_channels": None},
    "no-max-size": {**BASE, "pos_embed_max_size": None},
}
# stabilityai/stable-diffusion-3.5-large (and -large-turbo) transformer/config.json.
SD35_LARGE = dict(
    _class_name="SD3Transformer2DModel",
    _diffusers_version="0.31.0.dev0",
    attention_head_dim=64,
    caption_projection_dim=2432,
    in_channels=16,
    joint_attention_dim=4096,
    num_attention_heads=38,
    num_layers=38,
    out_channels=16,
    patch_size=2,
    pooled_projection_dim=2048,
    pos_embed_max_size=192,
    qk_norm="rms_norm",
    sample_size=128,
)
# stabilityai/stable-diffusion-3.5-medium transformer/config.json.
SD35_MEDIUM = dict(
    _class_name="SD3Transformer2DModel",
    _diffusers_version="0.31.0.dev0",
    attention_head_dim=64,
    caption_projection_dim=1536,
    dual_attention_layers=list(range(13)),
    in_channels=16,
    joint_attention_dim=4096,
    num_attention_heads=24,
    num_layers=24,
    out_channels=16,
    patch_size=2,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    qk_norm="rms_norm",
    sample_size=128,
)
LATENT_H, LATENT_W = 16, 12


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


class Case:
    """A tiny diffusers SD 3 transformer saved and loaded back, its inputs, and its float32 outputs."""

    def __init__(self, kind: str, folder, seed: int = 0):
        torch.manual_seed(seed)
        self.torch_model = model = diffusers.SD3Transformer2DModel(**TINY[kind]).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, diffusers.models.normalization.RMSNorm):
                    m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
            if model.pos_embed.pos_embed is not None:
                model.pos_embed.pos_embed.copy_(torch.randn(model.pos_embed.pos_embed.shape, generator=g))
        model.save_pretrained(folder, safe_serialization=True)
        self.config = S.SD3TransformerConfig.from_dict(read_json(folder / "config.json"))
        self.state = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
        self.params = S.convert_sd3_transformer(self.state, self.config)

        rng = np.random.default_rng(seed)
        self.inputs = dict(
            hidden_states=rng.standard_normal((2, 4, LATENT_H, LATENT_W)).astype(np.float32),
            encoder_hidden_states=rng.standard_normal((2, 7, 40)).astype(np.float32),
            pooled_projections=rng.standard_normal((2, 24)).astype(np.float32),
            timestep=np.array([700.0, 250.0], np.float32),
        )
        self.reference = self.torch_run()

    def torch_run(self, skip_layers=None) -> np.ndarray:
        with torch.no_grad():
            kwargs = {k: torch.from_numpy(v) for k, v in self.inputs.items()}
            return self.torch_model(**kwargs, skip_layers=skip_layers).sample.numpy()

    def run(self, dtype=jnp.float32, skip_layers=(), **options) -> np.ndarray:
        model = S.SD3Transformer2DModel(self.config, dtype=dtype, **options)
        i = self.inputs
        args = [jnp.asarray(i[k], dtype) for k in ("hidden_states", "encoder_hidden_states", "pooled_projections")]
        fn = jax.jit(lambda p, *a: model.apply({"params": p}, *a, skip_layers=skip_layers))
        out = fn(self.params, *args, i["timestep"])
        assert out.dtype == dtype
        return np.asarray(out.astype(jnp.float32))


_cases: dict[str, Case] = {}


def _case(kind: str, tmp_path_factory) -> Case:
    if kind not in _cases:
        _cases[kind] = Case(kind, tmp_path_factory.mktemp("sd3") / "transformer")
    return _cases[kind]


@pytest.fixture(params=list(TINY))
def case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


@pytest.fixture
def medium35(tmp_path_factory):
    return _case("sd35-medium", tmp_path_factory)


def test_matches_diffusers(case):
    out = case.run()
    assert out.shape == case.reference.shape == (2, 4, LATENT_H, LATENT_W)
    err = rel_err(out, case.reference)
    print(f"{case.config}: max rel err {err:.2e} (max |ref| {np.abs(case.reference).max():.2f})")
    assert err < REL_TOL


@pytest.mark.parametrize("skip", [(1,), (0, 2)], ids=["dual-block", "first-and-last"])
def test_skip_layers_match_diffusers(medium35, skip):
    ref = medium35.torch_run(skip_layers=list(skip))
    err = rel_err(medium35.run(skip_layers=skip), ref)
    print(f"skip_layers={skip}: max rel err {err:.2e}")
    assert err < REL_TOL
    assert rel_err(ref, medium35.reference) > 1e-2  # skipping did change the output


def test_bfloat16_against_float32_torch(medium35):
    err = rel_err(medium35.run(jnp.bfloat16), medium35.reference)
    print(f"bf16: max rel err {err:.2e}")
    assert err < BF16_REL_TOL


def test_runtime_options_keep_the_numbers(medium35):
    err = rel_err(medium35.run(attention="chunked", remat=True), medium35.run())
    print(f"remat + chunked attention vs default: {err:.2e}")
    assert err < OPTION_REL_TOL


def test_bad_inputs_are_named(medium35):
    model = S.SD3Transformer2DModel(medium35.config)
    i = medium35.inputs
    x, ctx, pooled, t = (i[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"))
    with pytest.raises(ValueError, match=r"skip_layers: 3 is not a block index in \[0, 3\)"):
        model.apply({"params": medium35.params}, x, ctx, pooled, t, skip_layers=(3,))
    with pytest.raises(ValueError, match="hidden_states must be .* multiples of 2"):
        model.apply({"params": medium35.params}, x[:, :, :15], ctx, pooled, t)
    with pytest.raises(ValueError, match=r"encoder_hidden_states must be \(B=2, T, 40\)"):
        model.apply({"params": medium35.params}, x, ctx[..., :32], pooled, t)
    big = np.zeros((1, 4, 34, 8), np.float32)  # 17 patches > pos_embed_max_size 16
    with pytest.raises(ValueError, match="more than pos_embed_max_size=16"):
        model.apply({"params": medium35.params}, big, ctx[:1], pooled[:1], t[:1])


def test_sincos_table_matches_diffusers():
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    for grid, base in (((6, 6), 6), ((8, 6), 4), ((5, 7), 12)):
        ref = get_2d_sincos_pos_embed(32, grid, base_size=base, output_type="pt").float().numpy()
        np.testing.assert_allclose(S.sincos_pos_embed(32, *grid, base), ref, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize(
    ("raw", "count"),
    [(SD35_LARGE, 8_146_280_768), (SD35_MEDIUM, 2_469_663_936)],
    ids=["sd35-large", "sd35-medium"],
)
def test_full_size_key_set_and_shapes(raw, count):
    """Every key and shape of the real state dict (a PyTorch model on the meta device: shapes, no memory) maps onto
    `init_params_shape` (traced, never allocated), and nothing is left over."""
    config = S.SD3TransformerConfig.from_dict(raw)
    with torch.device("meta"):
        model = diffusers.SD3Transformer2DModel(**{k: v for k, v in raw.items() if not k.startswith("_")})
    state = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in model.state_dict().items()}
    params = S.convert_sd3_transformer(state, config)  # zero-stride views: no memory either
    assert sum(int(np.prod(v.shape)) for v in jax.tree_util.tree_leaves(params)) == count
    shapes = S.init_params_shape(config)
    m, d = config.pos_embed_max_size, config.inner_dim
    assert shapes["pos_embed"]["pos_embed"].shape == (1, m * m, d)
    assert shapes["pos_embed"]["proj"]["kernel"].shape == (2, 2, 16, d)
    last = shapes[f"transformer_blocks_{config.num_layers - 1}"]
    assert "to_add_out" not in last["attn"] and "ff_context" not in last
    assert last["norm1_context"]["linear"]["kernel"].shape == (d, 2 * d)
    assert ("attn2" in shapes["transformer_blocks_0"]) == bool(config.dual_attention_layers)


def test_weight_errors_name_the_keys(medium35):
    state = dict(medium35.state)
    state["transformer_blocks.0.attn.to_q.weight"] = np.zeros((3, 3), np.float32)
    state["transformer_blocks.2.attn.to_add_out.weight"] = np.zeros((32, 32), np.float32)
    del state["transformer_blocks.1.attn2.norm_k.weight"]
    with pytest.raises(WeightLoadError) as e:
        S.convert_sd3_transformer(state, medium35.config, component="transformer (tiny)")
    assert e.value.misshaped[0].startswith("transformer_blocks.0.attn.to_q.weight: checkpoint (3, 3)")
    assert e.value.unexpected == ["transformer_blocks.2.attn.to_add_out.weight"]
    assert e.value.missing == ["transformer_blocks_1/attn2/norm_k/scale"]
    assert str(e.value).startswith("transformer (tiny): ")


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['guidance_embeds'\]"):
        S.SD3TransformerConfig.from_dict({**SD35_LARGE, "guidance_embeds": True}, source="transformer/config.json")
    with pytest.raises(ConfigError, match="qk_norm='layer_norm' is not supported"):
        S.SD3TransformerConfig.from_dict({**SD35_LARGE, "qk_norm": "layer_norm"})
    with pytest.raises(ConfigError, match="caption_projection_dim 1536 must equal"):
        S.SD3TransformerConfig.from_dict({**SD35_LARGE, "caption_projection_dim": 1536})
    with pytest.raises(ConfigError, match=r"dual_attention_layers \[24\]"):
        S.SD3TransformerConfig.from_dict({**SD35_MEDIUM, "dual_attention_layers": [0, 24]})
    config = S.SD3TransformerConfig.from_dict(SD35_MEDIUM)
    assert config.dual_attention_layers == tuple(range(13)) and hash(config)  # lists frozen: jit-static
    assert config.output_channels == 16 and config.inner_dim == 1536
    assert S.SD3TransformerConfig.from_dict(SD35_LARGE).dual_attention_layers == ()
