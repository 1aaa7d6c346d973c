"""ControlNetModel vs diffusers 0.42.1 on tiny random models, the UNet's ControlNet residuals, the SDXL refiner's
micro-conditioning, and loading ControlNet folders.

The tiny models use diffusers' OWN test configs (tests/pipelines/controlnet/test_controlnet.py and
test_controlnet_sdxl.py, `get_dummy_components`), plus variants for the SDXL "-small" layout (no attention in the
down blocks) and the less common options. Each PyTorch model is saved with `save_pretrained` and loaded by
`FlaxControlNetModel.from_pretrained`, so config parsing and weight conversion are under test too. ControlNets start
with zero 1x1 convs (their residuals would all be 0 and every comparison trivially pass): those layers get random
weights, and every norm gets a non-trivial scale and bias (`reference.perturb_norms`), so a swapped scale/bias or
a wrong zero conv fails.

Inputs have realistic scale: latents ~ N(0, 1), timesteps (37, 981), text states ~ N(0, 1), control images
uniform in [0, 1], SDXL time ids like (1024, 1024, 0, 0, 1024, 1024). sdjax runs eagerly (no jit), as in
test_unet.py. Errors are measured per residual relative to its largest magnitude.
"""

from __future__ import annotations

import copy
import json
import shutil

import flax.serialization
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference
from flax.traverse_util import flatten_dict
from safetensors.numpy import load_file, save_file

from sdjax.config import ConfigError, config_from_dict
from sdjax.loading import files
from sdjax.loading.components import load_pipeline_components
from sdjax.loading.controlnet import FlaxControlNetModel
from sdjax.models import controlnet as C
from sdjax.models import unet as U
from sdjax.models.convert import WeightLoadError

torch = pytest.importorskip("torch")

# float32 parity, relative to each residual's largest magnitude (measured: <= 1e-6).
REL_TOL = 1e-5
# UNet outputs (magnitude ~1): absolute, as in test_unet.py.
ATOL, RTOL = 1e-5, 1e-5

# diffusers tests/pipelines/controlnet/test_controlnet.py, ControlNetPipelineFastTests.get_dummy_components
SD_CONTROLNET = dict(
    block_out_channels=(4, 8),
    layers_per_block=2,
    in_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    cross_attention_dim=32,
    conditioning_embedding_out_channels=(16, 32),
    norm_num_groups=1,
)
SD_UNET = dict(
    block_out_channels=(4, 8),
    layers_per_block=2,
    sample_size=32,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=32,
    norm_num_groups=1,
)
# diffusers tests/pipelines/controlnet/test_controlnet_sdxl.py, StableDiffusionXLControlNetPipelineFastTests
_SDXL_COMMON = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    in_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
    cross_attention_dim=64,
)
SDXL_CONTROLNET = {**_SDXL_COMMON, "conditioning_embedding_out_channels": (16, 32)}
SDXL_UNET = {
    **_SDXL_COMMON,
    "sample_size": 32,
    "out_channels": 4,
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
}
CONFIGS = {
    "sd": SD_CONTROLNET,
    "sdxl": SDXL_CONTROLNET,
    # diffusers/controlnet-*-sdxl-1.0-small: DownBlock2D everywhere, attention in the mid block only.
    "sdxl_small": {**SDXL_CONTROLNET, "down_block_types": ("DownBlock2D", "DownBlock2D")},
    # The options released ControlNets rarely set: BGR channel order, a 4-channel condition, the mid block
    # without attention (diffusers' test_conditioning_channels), global pooling, a 3-stage condition embedding
    # (4x, not 2x), one layer per block, only-cross-attention, upcast attention, other activation, sinusoid
    # order and shift, mid-block scale, asymmetric downsampling.
    "options": {
        **SD_CONTROLNET,
        "controlnet_conditioning_channel_order": "bgr",
        "conditioning_channels": 4,
        "mid_block_type": "UNetMidBlock2D",
        "global_pool_conditions": True,
        "conditioning_embedding_out_channels": (8, 16, 16),
        "layers_per_block": 1,
        "only_cross_attention": True,
        "upcast_attention": True,
        "act_fn": "gelu",
        "flip_sin_to_cos": False,
        "freq_shift": 1,
        "mid_block_scale_factor": 1.5,
        "downsample_padding": 0,
    },
}
SDXL_TIME_IDS = np.array([[1024, 1024, 0, 0, 1024, 1024], [768, 512, 16, 32, 1024, 1024]], np.float32)


def torch_controlnet(config: dict, seed: int = 0):
    """A diffusers ControlNetModel with random weights everywhere, zero-initialised convs included."""
    from diffusers import ControlNetModel

    reference.seed_everything(seed)
    model = ControlNetModel(**config).eval()
    g = torch.Generator().manual_seed(seed + 100)
    zero_init = [*model.controlnet_down_blocks, model.controlnet_mid_block, model.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for layer in zero_init:
            layer.weight.copy_(0.3 * torch.randn(layer.weight.shape, generator=g))
            layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=g))
    reference.perturb_norms(model, seed)
    return model


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


class Case:
    """A torch ControlNet saved as a diffusers folder, the sdjax model loaded from it, and random inputs."""

    def __init__(self, raw: dict, folder, seed: int = 0):
        self.torch_model = torch_controlnet(raw, seed)
        self.folder = folder
        self.torch_model.save_pretrained(folder, safe_serialization=True)
        self.model, self.params = FlaxControlNetModel.from_pretrained(folder)
        cfg = self.config = self.model.config
        rng = np.random.default_rng(seed)
        size = 8
        image = size * cfg.conditioning_downscale
        self.sample = rng.standard_normal((2, cfg.in_channels, size, size)).astype(np.float32)
        self.timesteps = np.array([37, 981])
        self.context = rng.standard_normal((2, 7, cfg.cross_attention_dim)).astype(np.float32)
        self.cond = rng.random((2, cfg.conditioning_channels, image, image)).astype(np.float32)
        self.kwargs, self.torch_kwargs = {}, {}
        if cfg.addition_embed_type == "text_time":
            pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
            self.kwargs = dict(text_embeds=rng.standard_normal((2, pooled)).astype(np.float32), time_ids=SDXL_TIME_IDS)
            self.torch_kwargs["added_cond_kwargs"] = {k: torch.from_numpy(v) for k, v in self.kwargs.items()}

    def expected(self, scale: float = 1.0, guess_mode: bool = False, cond=None):
        with torch.no_grad():
            down, mid = self.torch_model(
                torch.from_numpy(self.sample),
                torch.from_numpy(self.timesteps),
                torch.from_numpy(self.context),
                torch.from_numpy(self.cond if cond is None else cond),
                conditioning_scale=scale,
                guess_mode=guess_mode,
                return_dict=False,
                **self.torch_kwargs,
            )
        return [d.numpy() for d in down], mid.numpy()

    def run(self, scale=1.0, guess_mode=False, cond=None, params=None):
        down, mid = self.model.apply(
            {"params": self.params if params is None else params},
            self.sample,
            self.timesteps,
            self.context,
            self.cond if cond is None else cond,
            scale,
            guess_mode,
            **self.kwargs,
        )
        return [np.asarray(d) for d in down], np.asarray(mid)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    cases: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cases:
            cases[name] = Case(CONFIGS[name], tmp_path_factory.mktemp(f"controlnet-{name}"))
        return cases[name]

    return get


# ---------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("name", list(CONFIGS))
def test_residuals_match_diffusers(case, name):
    c = case(name)
    for scale, guess in [(1.0, False), (0.55, True)]:
        want_down, want_mid = c.expected(scale, guess)
        got_down, got_mid = c.run(scale, guess)
        assert len(got_down) == len(want_down) == c.config.num_down_residuals
        errs = []
        for j, (g, w) in enumerate(zip(got_down, want_down)):
            assert g.shape == w.shape, (j, g.shape, w.shape)
            errs.append(rel_err(g, w))
        mid_err = rel_err(got_mid, want_mid)
        print(
            f"{name} scale={scale} guess_mode={guess}: down residuals max rel err "
            f"{', '.join(f'{e:.1e}' for e in errs)}; mid {mid_err:.1e}"
        )
        assert max(errs) <= REL_TOL and mid_err <= REL_TOL
        assert min(np.abs(w).max() for w in want_down) > 1e-2  # non-trivial residuals (no zero convs left)


def test_a_swapped_norm_scale_and_bias_fails_the_tolerance(case):
    c = case("sd")
    params = jax.tree_util.tree_map(lambda x: x, c.params)
    norm = params["down_blocks_1"]["resnets_0"]["norm1"]
    norm["scale"], norm["bias"] = norm["bias"], norm["scale"]
    want_down, _ = c.expected()
    got_down, _ = c.run(params=params)
    err = rel_err(got_down[4], want_down[4])  # skip 4: the output of down_blocks_1/resnets_0
    print(f"swapped GroupNorm scale/bias: rel err {err:.1e}")
    assert err > 100 * REL_TOL


def test_guess_mode_weights_are_diffusers_logspace(case):
    c = case("sd")
    plain_down, plain_mid = c.run(0.8)
    guess_down, guess_mid = c.run(0.8, True)
    weights = C.guess_mode_scales(len(plain_down))
    np.testing.assert_allclose(weights, torch.logspace(-1, 0, len(plain_down) + 1).numpy(), rtol=1e-6)
    assert weights[0] == pytest.approx(0.1) and weights[-1] == pytest.approx(1.0)
    for j, (p, g) in enumerate(zip(plain_down, guess_down)):
        np.testing.assert_allclose(g, p * weights[j], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(guess_mid, plain_mid, rtol=1e-6)


def test_global_pool_ignores_guess_mode_and_pools(case):
    c = case("options")
    down, mid = c.run(0.5, True)
    plain_down, _ = c.run(0.5, False)
    assert all(d.shape[2:] == (1, 1) for d in down) and mid.shape[2:] == (1, 1)
    for a, b in zip(down, plain_down):
        np.testing.assert_array_equal(a, b)


def test_bgr_order_flips_the_condition(case):
    # A bgr ControlNet reading a BGR image equals the same weights reading the RGB image as an rgb ControlNet.
    c = case("options")
    rgb_model = C.ControlNetModel(
        dataclasses_replace(c.config, controlnet_conditioning_channel_order="rgb"), dtype=jnp.float32
    )
    want_down, _ = c.run()
    got_down, _ = rgb_model.apply({"params": c.params}, c.sample, c.timesteps, c.context, c.cond[:, ::-1])
    for a, b in zip(got_down, want_down):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7)


def dataclasses_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_scale_is_traced_and_linear(case):
    # One compile serves every conditioning_scale (a per-step on/off switch needs no recompile).
    c = case("sd")

    @jax.jit
    def residuals(params, scale):
        return c.model.apply({"params": params}, c.sample, c.timesteps, c.context, c.cond, scale)

    base_down, base_mid = c.run(1.0)
    for scale in (0.0, 0.35):
        down, mid = residuals(c.params, jnp.float32(scale))
        for d, b in zip(down, base_down):
            np.testing.assert_allclose(np.asarray(d), scale * b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(mid), scale * base_mid, rtol=1e-5, atol=1e-6)
    assert residuals._cache_size() == 1


def test_condition_batch_of_one_is_shared(case):
    c = case("sdxl")
    one = c.cond[:1]
    got_down, got_mid = c.run(cond=one)
    want_down, want_mid = c.run(cond=np.repeat(one, 2, axis=0))
    for a, b in zip(got_down + [got_mid], want_down + [want_mid]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bfloat16_smoke(case):
    c = case("sd")
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), c.params)
    model = C.ControlNetModel(c.config, dtype=jnp.bfloat16)
    down, mid = model.apply({"params": params}, c.sample, c.timesteps, c.context, c.cond)
    want_down, want_mid = c.expected()
    assert all(d.dtype == jnp.bfloat16 for d in down) and mid.dtype == jnp.bfloat16
    errs = [rel_err(np.asarray(d, np.float32), w) for d, w in zip(down, want_down)]
    print(f"bf16: max rel err per residual {max(errs):.2e}")
    assert max(errs) < 0.1  # 8 mantissa bits: this catches wiring, not rounding


# ---------------------------------------------------------------------------------------------- the UNet side
UNETS = {"sd": SD_UNET, "sdxl": SDXL_UNET}


@pytest.mark.parametrize("name", list(UNETS))
def test_unet_adds_residuals_like_diffusers(case, name):
    c = case(name)
    tu = reference.unet(UNETS[name], seed=1)
    ucfg = config_from_dict(U.UNet2DConditionConfig, dict(tu.config), source="unet")
    uparams = U.convert_unet(reference.state_dict_numpy(tu), ucfg)
    unet = U.UNet2DConditionModel(ucfg)
    torch_down, torch_mid = c.expected(0.7)

    def torch_unet(down, mid):
        kw = {}
        if down is not None:
            kw = dict(
                down_block_additional_residuals=[torch.from_numpy(d) for d in down],
                mid_block_additional_residual=torch.from_numpy(mid),
            )
        with torch.no_grad():
            return tu(
                torch.from_numpy(c.sample),
                torch.from_numpy(c.timesteps),
                torch.from_numpy(c.context),
                **c.torch_kwargs,
                **kw,
            ).sample.numpy()

    def jax_unet(down, mid):
        kw = {} if down is None else dict(down_block_additional_residuals=down, mid_block_additional_residual=mid)
        return np.asarray(unet.apply({"params": uparams}, c.sample, c.timesteps, c.context, **c.kwargs, **kw))

    want = torch_unet(torch_down, torch_mid)
    plain = torch_unet(None, None)
    assert max_err(want, plain) > 100 * ATOL  # the residuals change the prediction
    got = jax_unet(torch_down, torch_mid)  # the same residuals in both
    print(
        f"{name}: UNet with residuals max abs err {max_err(got, want):.2e} (residual effect {max_err(want, plain):.2f})"
    )
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    # the whole step: sdjax ControlNet -> sdjax UNet against diffusers ControlNet -> diffusers UNet
    chained = jax_unet(*c.run(0.7))
    print(f"{name}: ControlNet + UNet max abs err {max_err(chained, want):.2e}")
    np.testing.assert_allclose(chained, want, atol=ATOL, rtol=RTOL)
    if name == "sd":  # pooled (B, C, 1, 1) residuals broadcast, as in PyTorch
        pooled_down = [d.mean(axis=(2, 3), keepdims=True) for d in torch_down]
        pooled_mid = torch_mid.mean(axis=(2, 3), keepdims=True)
        np.testing.assert_allclose(
            jax_unet(pooled_down, pooled_mid), torch_unet(pooled_down, pooled_mid), atol=ATOL, rtol=RTOL
        )


def test_unet_residual_errors(case):
    c = case("sd")
    tu_cfg = U.UNet2DConditionConfig(**SD_UNET)
    unet = U.UNet2DConditionModel(tu_cfg)
    params = jax.tree_util.tree_map(jnp.zeros_like, U.init_params_shape(tu_cfg))
    down, mid = c.run()

    def call(**kw):
        return unet.apply({"params": params}, c.sample, c.timesteps, c.context, **kw)

    with pytest.raises(ValueError, match="both down_block_additional_residuals and mid_block_additional_residual"):
        call(down_block_additional_residuals=down)
    with pytest.raises(ValueError, match="has 5 arrays; this UNet has 6 skip connections"):
        call(down_block_additional_residuals=down[:5], mid_block_additional_residual=mid)
    bad = list(down)
    bad[2] = bad[2][:, :, :4]
    with pytest.raises(ValueError, match=r"down_block_additional_residuals\[2\] has shape \(2, 4, 4, 8\)"):
        call(down_block_additional_residuals=bad, mid_block_additional_residual=mid)


# ---------------------------------------------------------------------------------------------- SDXL refiner
# A tiny UNet with the refiner's conditioning numbers: addition_time_embed_dim 256, projection_class_embeddings
# _input_dim 2560 = 1280 (pooled OpenCLIP bigG) + 5 * 256 (orig size, crop, aesthetic score), cross_attention_dim
# 1280 (the refiner has only the bigG text encoder).
REFINER_UNET = {
    **SDXL_UNET,
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2560,
    "cross_attention_dim": 1280,
}


def test_refiner_unet_with_five_time_ids_matches_diffusers():
    tu = reference.unet(REFINER_UNET, seed=2)
    cfg = config_from_dict(U.UNet2DConditionConfig, dict(tu.config), source="unet")
    params = U.convert_unet(reference.state_dict_numpy(tu), cfg)
    rng = np.random.default_rng(2)
    sample = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    context = rng.standard_normal((2, 5, 1280)).astype(np.float32)
    added = dict(
        text_embeds=rng.standard_normal((2, 1280)).astype(np.float32),
        time_ids=np.array([[1024, 1024, 0, 0, 6.0], [768, 512, 16, 32, 2.5]], np.float32),
    )
    with torch.no_grad():
        want = tu(
            torch.from_numpy(sample),
            torch.tensor([37, 981]),
            torch.from_numpy(context),
            added_cond_kwargs={k: torch.from_numpy(v) for k, v in added.items()},
        ).sample.numpy()
    model = U.UNet2DConditionModel(cfg)
    got = np.asarray(model.apply({"params": params}, sample, np.array([37, 981]), context, **added))
    print(f"refiner: max abs err {max_err(got, want):.2e}")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    six = dict(added, time_ids=np.zeros((2, 6), np.float32))
    with pytest.raises(ValueError, match="the model wants 5 time_ids"):
        model.apply({"params": params}, sample, np.array([37, 981]), context, **six)


# ---------------------------------------------------------------------------------------------- loading
def test_param_paths_mirror_diffusers_keys(case):
    c = case("sdxl")
    flat = {"/".join(k) for k in flatten_dict(c.params)}
    for path in [
        "controlnet_cond_embedding/conv_in/kernel",
        "controlnet_cond_embedding/blocks_1/kernel",
        "controlnet_cond_embedding/conv_out/bias",
        "controlnet_down_blocks_0/kernel",
        "controlnet_down_blocks_5/bias",
        "controlnet_mid_block/kernel",
        "add_embedding/linear_1/kernel",
        "down_blocks_1/attentions_1/transformer_blocks_1/attn2/to_k/kernel",
        "mid_block/attentions_0/proj_in/kernel",
    ]:
        assert path in flat, path
    assert len(flat) == len(c.torch_model.state_dict())


def test_variant_dtype_and_old_flax_names(case, tmp_path):
    c = case("sd")
    folder = tmp_path / "cn"
    copy.deepcopy(c.torch_model).half().save_pretrained(folder, safe_serialization=True, variant="fp16")
    config = json.loads((folder / "config.json").read_text())
    config["_class_name"] = "FlaxControlNetModel"
    (folder / "config.json").write_text(json.dumps(config))
    model, params = FlaxControlNetModel.from_pretrained(folder, variant="fp16", dtype=jnp.bfloat16)
    assert model.dtype == jnp.bfloat16 and model.config == c.config
    want = {k: v.astype(np.float16).astype(ml_dtypes.bfloat16) for k, v in flatten_dict(c.params).items()}
    got = flatten_dict(params)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg="/".join(k))
    with pytest.raises(files.MissingWeightsError, match="no weights of variant 'fp16'"):
        FlaxControlNetModel.from_pretrained(c.folder, variant="fp16")


def test_controlnet_in_a_pipeline_folder_and_as_subfolder(case, tmp_path):
    c = case("sd")
    shutil.copytree(c.folder, tmp_path / "controlnet")
    index = {"_class_name": "FlaxStableDiffusionControlNetPipeline", "controlnet": ["diffusers", "FlaxControlNetModel"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    components, params, _ = load_pipeline_components(tmp_path)
    assert isinstance(components["controlnet"], C.ControlNetModel)
    _, sub_params = FlaxControlNetModel.from_pretrained(tmp_path, subfolder="controlnet", from_pt=True)
    for got in (params["controlnet"], sub_params):
        for k, v in flatten_dict(c.params).items():
            np.testing.assert_array_equal(np.asarray(flatten_dict(got)[k]), np.asarray(v))
    with pytest.raises(FileNotFoundError, match="no subfolder 'unet'"):
        FlaxControlNetModel.from_pretrained(tmp_path, subfolder="unet")


def test_old_flax_msgpack_weights(case, tmp_path):
    # diffusers' FlaxControlNetModel saved its params tree (named as sdjax names it) as diffusion_flax_model.msgpack.
    c = case("sd")
    (tmp_path / "config.json").write_text((c.folder / "config.json").read_text())
    tree = jax.tree_util.tree_map(np.asarray, c.params)
    (tmp_path / "diffusion_flax_model.msgpack").write_bytes(flax.serialization.msgpack_serialize(tree))
    _, params = FlaxControlNetModel.from_pretrained(tmp_path)
    for k, v in flatten_dict(c.params).items():
        np.testing.assert_array_equal(np.asarray(flatten_dict(params)[k]), np.asarray(v))


def test_unknown_config_key_names_key_and_file(case, tmp_path):
    c = case("sd")
    shutil.copytree(c.folder, tmp_path / "cn")
    config = json.loads((tmp_path / "cn" / "config.json").read_text())
    # the old Flax class's extra keys are accepted...
    (tmp_path / "cn" / "config.json").write_text(json.dumps({**config, "sample_size": 32, "dropout": 0.0}))
    FlaxControlNetModel.from_pretrained(tmp_path / "cn")
    # ...any other unknown key is not
    (tmp_path / "cn" / "config.json").write_text(json.dumps({**config, "controlnet_type": "union"}))
    with pytest.raises(ConfigError, match=r"cn/config\.json: unknown config key\(s\) \['controlnet_type'\]"):
        FlaxControlNetModel.from_pretrained(tmp_path / "cn")


def test_misshaped_and_missing_weights_are_named(case, tmp_path):
    c = case("sd")
    shutil.copytree(c.folder, tmp_path / "cn")
    path = tmp_path / "cn" / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    state["controlnet_down_blocks.3.weight"] = np.zeros((8, 8, 3, 3), np.float32)
    del state["controlnet_mid_block.bias"]
    save_file(state, path)
    with pytest.raises(WeightLoadError) as e:
        FlaxControlNetModel.from_pretrained(tmp_path / "cn")
    msg = str(e.value)
    assert (
        "controlnet_down_blocks.3.weight: checkpoint (8, 8, 3, 3)" in msg and "controlnet_down_blocks_3/kernel" in msg
    )
    assert "missing (1): controlnet_mid_block/bias" in msg and str(tmp_path / "cn") in msg


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """Patch the Hub listing and download; record what `snapshot_download` was asked for."""
    import huggingface_hub

    calls = {}
    repo_files = [
        "config.json",
        "README.md",
        "diffusion_pytorch_model.safetensors",
        "diffusion_pytorch_model.fp16.safetensors",
        "diffusion_pytorch_model.bin",
        "images/canny.png",
        "controlnet/config.json",
        "controlnet/diffusion_pytorch_model.safetensors.index.json",
        "controlnet/diffusion_pytorch_model-00001-of-00002.safetensors",
        "controlnet/diffusion_pytorch_model-00002-of-00002.safetensors",
    ]

    def snapshot_download(repo_id, **kw):
        calls["snapshot"] = (repo_id, kw)
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(files, "_list_repo_files", lambda repo_id, revision, token: list(repo_files))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def test_hub_downloads_only_config_and_chosen_weights(fake_hub, tmp_path):
    from sdjax.loading.components import resolve_model_folder

    folder = resolve_model_folder("org/controlnet-canny", variant="fp16", revision="main")
    repo, kw = fake_hub["snapshot"]
    assert folder == tmp_path / "snapshot" and repo == "org/controlnet-canny" and kw["revision"] == "main"
    assert set(kw["allow_patterns"]) == {"config.json", "diffusion_pytorch_model.fp16.safetensors"}
    folder = resolve_model_folder("org/controlnet-canny", subfolder="controlnet")
    assert folder == tmp_path / "snapshot" / "controlnet"
    assert set(fake_hub["snapshot"][1]["allow_patterns"]) == {
        "controlnet/config.json",
        "controlnet/diffusion_pytorch_model.safetensors.index.json",
        "controlnet/diffusion_pytorch_model-00001-of-00002.safetensors",
        "controlnet/diffusion_pytorch_model-00002-of-00002.safetensors",
    }
    del fake_hub["snapshot"]
    with pytest.raises(files.MissingWeightsError, match="org/controlnet-canny@main: no weights of variant 'int8'"):
        resolve_model_folder("org/controlnet-canny", variant="int8")
    with pytest.raises(FileNotFoundError, match="no config.json, so not a diffusers model repo"):
        resolve_model_folder("org/controlnet-canny", subfolder="images")
    assert "snapshot" not in fake_hub  # nothing downloaded for a request that cannot load


def test_offline_from_the_hf_cache(case, tmp_path, monkeypatch):
    c = case("sd")

    def no_network(*a, **k):
        raise AssertionError("network call while offline")

    monkeypatch.setattr(files, "_list_repo_files", no_network)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--org--tiny-controlnet"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(c.folder, repo / "snapshots" / commit)
    _, params = FlaxControlNetModel.from_pretrained(
        "org/tiny-controlnet", local_files_only=True, cache_dir=tmp_path / "cache"
    )
    np.testing.assert_array_equal(np.asarray(params["conv_in"]["kernel"]), np.asarray(c.params["conv_in"]["kernel"]))
    with pytest.raises(FileNotFoundError, match=r"org/other@main: not in the Hugging Face cache"):
        FlaxControlNetModel.from_pretrained("org/other", local_files_only=True, cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------------------------------------- config
# Released config.json files, verbatim: lllyasviel/control_v11p_sd15_canny (as copied into a pipeline repo),
# diffusers/controlnet-canny-sdxl-1.0, and an old diffusers 0.15 ControlNet carrying the Flax class's
# sample_size and dropout.
SD15_CANNY_JSON = {
    "_class_name": "ControlNetModel",
    "_diffusers_version": "0.21.0.dev0",
    "_name_or_path": "/home/patrick/controlnet_v1_1/control_v11p_sd15_canny",
    "act_fn": "silu",
    "addition_embed_type": None,
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": None,
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "class_embed_type": None,
    "conditioning_channels": 3,
    "conditioning_embedding_out_channels": [16, 32, 96, 256],
    "controlnet_conditioning_channel_order": "rgb",
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "global_pool_conditions": False,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_attention_heads": None,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "projection_class_embeddings_input_dim": None,
    "resnet_time_scale_shift": "default",
    "transformer_layers_per_block": 1,
    "upcast_attention": False,
    "use_linear_projection": False,
}
SDXL_CANNY_JSON = {
    **SD15_CANNY_JSON,
    "_diffusers_version": "0.20.0.dev0",
    "_name_or_path": "diffusers/controlnet-canny-sdxl-1.0",
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "projection_class_embeddings_input_dim": 2816,
    "transformer_layers_per_block": [1, 2, 10],
    "upcast_attention": None,
    "use_linear_projection": True,
}
SD15_OLD_JSON = {
    "_class_name": "ControlNetModel",
    "_diffusers_version": "0.15.0.dev0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "class_embed_type": None,
    "conditioning_embedding_out_channels": [16, 32, 96, 256],
    "controlnet_conditioning_channel_order": "rgb",
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "dropout": 0.0,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "projection_class_embeddings_input_dim": None,
    "resnet_time_scale_shift": "default",
    "sample_size": 32,
    "upcast_attention": False,
    "use_linear_projection": False,
}


@pytest.mark.parametrize("raw", [SD15_CANNY_JSON, SDXL_CANNY_JSON, SD15_OLD_JSON], ids=["sd15", "sdxl", "old"])
def test_released_configs_load(raw):
    cfg = C.ControlNetConfig.from_dict(raw, source="config.json")
    hash(cfg)  # static under jit
    assert cfg.conditioning_downscale == 8
    n = len(cfg.block_out_channels)
    assert cfg.num_down_residuals == {4: 12, 3: 9}[n]  # the SD 1.5 / SDXL UNet's skip counts


@pytest.mark.parametrize(
    "key,value",
    [
        ("class_embed_type", "timestep"),
        ("num_class_embeds", 10),
        ("encoder_hid_dim", 32),
        ("resnet_time_scale_shift", "scale_shift"),
        ("addition_embed_type", "text"),
        ("mid_block_type", None),
        ("down_block_types", ("SimpleCrossAttnDownBlock2D", "DownBlock2D")),
        ("controlnet_conditioning_channel_order", "rbg"),
        ("conditioning_embedding_out_channels", ()),
        ("layers_per_block", (1, 2)),
    ],
)
def test_unsupported_values_raise_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        C.ControlNetConfig.from_dict({**SD_CONTROLNET, key: value}, source="controlnet/config.json")


def test_unknown_key_raises():
    with pytest.raises(ConfigError, match="brand_new_key"):
        C.ControlNetConfig.from_dict({**SD_CONTROLNET, "brand_new_key": 1}, source="x")


def test_bad_inputs_are_named(case):
    c = case("sdxl")

    def call(context=c.context, cond=c.cond, added=c.kwargs):
        return c.model.apply({"params": c.params}, c.sample, c.timesteps, context, cond, **added)

    with pytest.raises(ValueError, match=r"controlnet_cond must be NCHW \(B=2 or 1, 3, 16, 16\).*got shape"):
        call(cond=c.cond[:, :, :12, :12])
    with pytest.raises(ValueError, match="needs text_embeds"):
        call(added={})
    with pytest.raises(ValueError, match="encoder_hidden_states width 32 != cross_attention_dim 64"):
        call(context=c.context[..., :32])


# ---------------------------------------------------------------------------------------------- full size
@pytest.mark.slow
@pytest.mark.parametrize("raw", [SD15_CANNY_JSON, SDXL_CANNY_JSON], ids=["sd15", "sdxl"])
def test_full_size_state_dict_maps_onto_params(raw):
    """Every key and shape of the full diffusers ControlNet (built on torch's meta device) converts."""
    from diffusers import ControlNetModel

    cfg = C.ControlNetConfig.from_dict(raw, source="config.json")
    with torch.device("meta"):
        tm = ControlNetModel(**{k: v for k, v in raw.items() if not k.startswith("_")})
    fake = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in tm.state_dict().items()}
    params = C.convert_controlnet(fake, cfg)
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    print(f"{raw['_name_or_path']}: {n} parameters")
    assert n == sum(v.numel() for v in tm.state_dict().values())
