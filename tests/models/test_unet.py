"""UNet2DConditionModel vs diffusers on the tiny reference configs (float32), plus config and loading checks.

Inputs have realistic scale: latents ~ N(0, 1), timesteps in [0, 999], encoder states ~ N(0, 1), SDXL time_ids
like (1024, 1024, 0, 0, 1024, 1024). The sdjax models run eagerly (no jit): for these tiny models that is
cheaper than compiling each variant. Measured max abs errors are ~2e-6 against outputs of magnitude ~1.5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

from sdjax.config import ConfigError, config_from_dict
from sdjax.models import layers
from sdjax.models import unet as U
from sdjax.models.convert import WeightLoadError
from sdjax.ops import attention as ops_attention

torch = pytest.importorskip("torch")

# float32 parity: max abs error vs diffusers on outputs of magnitude ~1.5 (measured <= 2.3e-6).
ATOL, RTOL = 1e-5, 1e-5
# runtime options (attention implementation, split_head_dim) against each other: same math, other op order.
OPTION_ATOL = 1e-5

CONFIGS = {"sd1": reference.UNET_SD1, "sd2": reference.UNET_SD2, "sdxl": reference.UNET_SDXL}

# The released checkpoints' unet/config.json files, verbatim (key sets and values).
SD15_CONFIG_JSON = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}
SD21_CONFIG_JSON = {
    **SD15_CONFIG_JSON,
    "_diffusers_version": "0.10.0.dev0",
    "attention_head_dim": [5, 10, 20, 20],
    "cross_attention_dim": 1024,
    "dual_cross_attention": False,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "sample_size": 96,
    "upcast_attention": True,
    "use_linear_projection": True,
}
SDXL_CONFIG_JSON = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.19.0.dev0",
    "act_fn": "silu",
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "center_input_sample": False,
    "class_embed_type": None,
    "class_embeddings_concat": False,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "cross_attention_dim": 2048,
    "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_attention_heads": None,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default",
    "sample_size": 128,
    "time_cond_proj_dim": None,
    "time_embedding_act_fn": None,
    "time_embedding_dim": None,
    "time_embedding_type": "positional",
    "timestep_post_act": None,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None,
    "use_linear_projection": True,
}


class Case:
    """A torch reference UNet, the matching sdjax config/params, random inputs and the reference output."""

    def __init__(self, raw: dict, size=(8, 8), timesteps=(37, 981), seed: int = 0):
        self.torch_model = reference.unet(raw, seed=seed)
        self.config = config_from_dict(U.UNet2DConditionConfig, dict(self.torch_model.config), source="test")
        self.params = U.convert_unet(reference.state_dict_numpy(self.torch_model), self.config)
        rng = np.random.default_rng(seed)
        self.sample = rng.standard_normal((2, 4, *size)).astype(np.float32)
        self.timesteps = np.asarray(timesteps)
        width = self.config.cross_attention_dim
        self.context = rng.standard_normal((2, 7, width)).astype(np.float32)
        self.kwargs, torch_kwargs = {}, {}
        if self.config.addition_embed_type == "text_time":
            pooled = self.config.projection_class_embeddings_input_dim - 6 * self.config.addition_time_embed_dim
            text_embeds = rng.standard_normal((2, pooled)).astype(np.float32)
            time_ids = np.array([[1024, 1024, 0, 0, 1024, 1024], [768, 512, 16, 32, 1024, 1024]], np.float32)
            self.kwargs = dict(text_embeds=text_embeds, time_ids=time_ids)
            torch_kwargs["added_cond_kwargs"] = {k: torch.from_numpy(v) for k, v in self.kwargs.items()}
        if self.config.time_cond_proj_dim is not None:
            self.kwargs["timestep_cond"] = rng.standard_normal((2, self.config.time_cond_proj_dim)).astype(np.float32)
            torch_kwargs["timestep_cond"] = torch.from_numpy(self.kwargs["timestep_cond"])
        with torch.no_grad():
            self.expected = self.torch_model(
                torch.from_numpy(self.sample),
                torch.from_numpy(self.timesteps),
                torch.from_numpy(self.context),
                **torch_kwargs,
            ).sample.numpy()

    def run(self, params=None, dtype=jnp.float32, **options) -> np.ndarray:
        model = U.UNet2DConditionModel(self.config, dtype=dtype, **options)
        params = self.params if params is None else params
        out = model.apply(
            {"params": params}, jnp.asarray(self.sample, dtype), self.timesteps, self.context, **self.kwargs
        )
        return np.asarray(out.astype(jnp.float32))

    def baseline(self) -> np.ndarray:
        """The default options' output (attention="xla"), computed once."""
        if not hasattr(self, "_baseline"):
            self._baseline = self.run()
        return self._baseline


_cases: dict[str, Case] = {}


def case(name: str) -> Case:
    if name not in _cases:
        _cases[name] = Case(CONFIGS[name])
    return _cases[name]


def max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("name", ["sd1", "sd2", "sdxl"])
def test_matches_diffusers(name):
    c = case(name)
    out = c.baseline()
    assert out.shape == c.expected.shape == (2, 4, 8, 8)  # NCHW in, NCHW out
    print(f"{name}: max abs err {max_err(out, c.expected):.2e}, max |ref| {np.abs(c.expected).max():.2f}")
    np.testing.assert_allclose(out, c.expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "attention,split_head_dim",
    [("xla", True), ("dot_product", False), ("dot_product", True), ("chunked", False), ("chunked", True)],
)
def test_attention_options_give_the_same_numbers(attention, split_head_dim):
    # SD2: upcast attention, linear projections, per-block head counts. chunk 24 < 64 tokens: 3 chunks, padded.
    c = case("sd2")
    baseline = c.baseline()
    out = c.run(attention=attention, split_head_dim=split_head_dim, attention_chunk_size=24)
    print(f"{attention} split_head_dim={split_head_dim}: max abs diff to xla {max_err(out, baseline):.2e}")
    np.testing.assert_allclose(out, baseline, atol=OPTION_ATOL, rtol=0)
    np.testing.assert_allclose(out, c.expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("context_len", [None, 11])
def test_attention_function_against_numpy(upcast, context_len):
    # every implementation x split_head_dim against a float64 numpy softmax attention; 37 queries in chunks
    # of 8 exercise the padded last chunk of "chunked".
    rng = np.random.default_rng(0)
    heads, d, t = 3, 8, 37
    s = t if context_len is None else context_len
    q = rng.standard_normal((2, t, heads * d)).astype(np.float32)
    k, v = (rng.standard_normal((2, s, heads * d)).astype(np.float32) for _ in range(2))
    qh, kh, vh = (x.reshape(2, -1, heads, d).astype(np.float64) for x in (q, k, v))
    scores = np.einsum("bthd,bshd->bhts", qh, kh) / np.sqrt(d)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), vh).reshape(2, t, heads * d)
    for implementation in ops_attention.IMPLEMENTATIONS:
        if implementation == "pallas":  # the TPU kernel: tests/ops/test_attention.py runs it in Pallas' interpreter
            continue
        for split in (False, True):
            got = ops_attention.attention(
                jnp.asarray(q),
                jnp.asarray(k),
                jnp.asarray(v),
                heads=heads,
                implementation=implementation,
                split_head_dim=split,
                upcast=upcast,
                chunk_size=8,
            )
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0, err_msg=f"{implementation} {split}")


def test_auto_attention_picks_by_backend_and_size(monkeypatch):
    assert ops_attention.resolve("auto", ops_attention.AUTO_CHUNK_ABOVE) == "xla"  # this suite runs on CPU
    assert ops_attention.resolve("auto", ops_attention.AUTO_CHUNK_ABOVE + 1) == "chunked"
    assert ops_attention.resolve("xla", 10**6) == "xla"  # an explicit choice is kept
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert ops_attention.resolve("auto", 16384) == "dot_product"


def test_odd_latent_size_and_scalar_timestep():
    # 9x9 latents: the downsampler rounds 9 -> 5 and the upsampler must return to 9 (the skip's size), as
    # diffusers does via `upsample_size`; a scalar timestep broadcasts over the batch.
    c = Case(reference.UNET_SD1, size=(9, 9), timesteps=500)
    out = c.run()
    assert out.shape == (2, 4, 9, 9)
    print(f"9x9: max abs err {max_err(out, c.expected):.2e}")
    np.testing.assert_allclose(out, c.expected, atol=ATOL, rtol=RTOL)


LESS_COMMON = {
    # LCM's timestep_cond, only_cross_attention per block, center_input_sample, mid_block_scale_factor,
    # downsample_padding=0, other conv kernels, sin/cos order and frequency shift, per-block layer counts.
    "lcm_and_more": {
        **reference.UNET_SD1,
        "time_cond_proj_dim": 16,
        "only_cross_attention": (True, False),
        "center_input_sample": True,
        "mid_block_scale_factor": 1.5,
        "downsample_padding": 0,
        "conv_in_kernel": 1,
        "conv_out_kernel": 5,
        "flip_sin_to_cos": False,
        "freq_shift": 1,
        "norm_eps": 1e-6,
        "layers_per_block": (1, 2),
        "transformer_layers_per_block": (2, 1),
        "act_fn": "gelu",
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    },
    "no_mid_block": {**reference.UNET_SD1, "mid_block_type": None, "only_cross_attention": True},
}


@pytest.mark.parametrize("name", list(LESS_COMMON))
def test_less_common_options_match_diffusers(name):
    c = Case(LESS_COMMON[name], timesteps=(999, 0))
    out = c.run()
    print(f"{name}: max abs err {max_err(out, c.expected):.2e}")
    np.testing.assert_allclose(out, c.expected, atol=ATOL, rtol=RTOL)


def test_tanh_gelu_in_geglu_would_fail_the_tolerance(monkeypatch):
    # Diffusers' old Flax port used the tanh approximation in GEGLU; the parity tolerance must catch that.
    c = case("sd1")
    monkeypatch.setattr(layers, "_gelu_exact", lambda x: jax.nn.gelu(x, approximate=True))
    out = c.run()
    print(f"tanh GELU: max abs err {max_err(out, c.expected):.2e} (atol {ATOL:.0e}, rtol {RTOL:.0e})")
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(out, c.expected, atol=ATOL, rtol=RTOL)


def test_bfloat16_smoke():
    c = case("sd1")
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), c.params)
    out = c.run(params=params, dtype=jnp.bfloat16)
    assert np.isfinite(out).all()
    err = max_err(out, c.expected)
    print(f"bf16: max abs err {err:.2e}, max |ref| {np.abs(c.expected).max():.2f}")
    assert err < 0.1 * np.abs(c.expected).max()  # bf16 has 8 mantissa bits; this catches wiring, not rounding


# ---------------------------------------------------------------------------------------------- loading
def test_wrong_shape_is_reported_by_name():
    c = case("sd1")
    state = reference.state_dict_numpy(c.torch_model)
    key = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    state[key] = np.zeros((32, 31), np.float32)
    del state["conv_out.bias"]
    state["not.a.weight"] = np.zeros(3, np.float32)
    with pytest.raises(WeightLoadError) as e:
        U.convert_unet(state, c.config)
    msg = str(e.value)
    assert key in msg and "down_blocks_0/attentions_0/transformer_blocks_0/attn2/to_k/kernel" in msg
    assert "conv_out/bias" in msg and "not.a.weight" in msg


def test_param_paths_mirror_diffusers_keys():
    params = case("sdxl").params
    flat = {"/".join(p.key for p in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    for path in [
        "conv_in/kernel",
        "time_embedding/linear_1/kernel",
        "add_embedding/linear_2/bias",
        "down_blocks_1/attentions_0/transformer_blocks_1/attn1/to_q/kernel",
        "down_blocks_1/attentions_0/transformer_blocks_0/ff/net_0/proj/kernel",
        "down_blocks_1/attentions_0/transformer_blocks_0/ff/net_2/kernel",
        "down_blocks_1/attentions_0/transformer_blocks_0/attn2/to_out_0/bias",
        "down_blocks_0/downsamplers_0/conv/kernel",
        "up_blocks_0/upsamplers_0/conv/kernel",
        "mid_block/attentions_0/proj_in/kernel",
        "up_blocks_1/resnets_2/conv_shortcut/kernel",
        "conv_norm_out/scale",
        "conv_out/kernel",
    ]:
        assert path in flat, path


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("raw", [SD15_CONFIG_JSON, SD21_CONFIG_JSON, SDXL_CONFIG_JSON], ids=["sd15", "sd21", "sdxl"])
def test_released_configs_load(raw):
    cfg = config_from_dict(U.UNet2DConditionConfig, raw, source="unet/config.json")
    hash(cfg)  # static under jit
    assert len(cfg.heads_per_block) == len(cfg.block_out_channels)


def test_head_count_quirk_and_num_attention_heads():
    cfg = U.UNet2DConditionConfig(**reference.UNET_SD2)
    assert cfg.heads_per_block == (2, 4)  # attention_head_dim is the head COUNT when num_attention_heads is None
    cfg = U.UNet2DConditionConfig(**{**reference.UNET_SD2, "num_attention_heads": (4, 8)})
    assert cfg.heads_per_block == (4, 8)


@pytest.mark.parametrize(
    "key,value",
    [
        ("class_embed_type", "timestep"),
        ("num_class_embeds", 10),
        ("encoder_hid_dim", 32),
        ("resnet_time_scale_shift", "scale_shift"),
        ("time_embedding_type", "fourier"),
        ("attention_type", "gated"),
        ("dual_cross_attention", True),
        ("addition_embed_type", "text"),
        ("mid_block_type", "UNetMidBlock2D"),
        ("down_block_types", ("SimpleCrossAttnDownBlock2D", "DownBlock2D")),
        ("time_embedding_act_fn", "silu"),
    ],
)
def test_unsupported_architecture_keys_raise(key, value):
    with pytest.raises(ConfigError, match=key):
        config_from_dict(U.UNet2DConditionConfig, {**reference.UNET_SD1, key: value}, source="unet/config.json")


def test_unknown_key_raises():
    with pytest.raises(ConfigError, match="brand_new_key"):
        config_from_dict(U.UNet2DConditionConfig, {**reference.UNET_SD1, "brand_new_key": 1}, source="x")


def test_missing_sdxl_conditioning_is_an_error():
    c = case("sdxl")
    model = U.UNet2DConditionModel(c.config)
    with pytest.raises(ValueError, match="text_embeds"):
        model.apply({"params": c.params}, c.sample, c.timesteps, c.context)


# ---------------------------------------------------------------------------------------------- full size
@pytest.mark.slow
@pytest.mark.parametrize(
    "raw,n_params", [(SD15_CONFIG_JSON, 859_520_964), (SDXL_CONFIG_JSON, 2_567_463_684)], ids=["sd15", "sdxl"]
)
def test_full_size_state_dict_maps_onto_params(raw, n_params):
    """Every key and shape of the full diffusers model (built on torch's meta device) converts."""
    from diffusers import UNet2DConditionModel

    cfg = config_from_dict(U.UNet2DConditionConfig, raw, source="unet/config.json")
    with torch.device("meta"):
        tm = UNet2DConditionModel(**{k: v for k, v in raw.items() if not k.startswith("_")})
    fake = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in tm.state_dict().items()}
    params = U.convert_unet(fake, cfg)
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    assert n == sum(v.numel() for v in tm.state_dict().values()) == n_params
