"""CLIP text encoders against transformers' `CLIPTextModel` / `CLIPTextModelWithProjection` (tiny models from
`tests/reference.py`, real prompts tokenized by transformers' CLIPTokenizer).

Tolerances (float32, CPU): every output within atol 1e-5 (measured about 1e-6 to 2e-6 on values up to ~4.5).
A tanh-approximate GELU misses that by ~50x (measured ~5e-4), so the tolerance pins the exact erf GELU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

from sdjax.config import ConfigError
from sdjax.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, convert_clip_text
from sdjax.models.convert import WeightLoadError

ATOL = 1e-5  # float32 parity, absolute

PROMPTS = [
    "a photo of an astronaut riding a horse on mars",
    "",
    "A majestic lion jumping from a big stone at night, highly detailed, 8k, trending on artstation!!",
    "café naïve 😀 東京 " * 12,  # longer than 77 tokens: truncated
]

CASES = {  # name: (config, with_projection, pad token of the tokenizer that feeds it)
    "sd1_quick_gelu": (reference.CLIP_SD1, False, "<|endoftext|>"),
    "sd2_gelu": (reference.CLIP_SD2, False, "<|endoftext|>"),
    "sdxl_1": (reference.CLIP_SDXL_1, False, "<|endoftext|>"),
    "sdxl_2_projection": (reference.CLIP_SDXL_2, True, "!"),
    "legacy_eos_2": ({**reference.CLIP_SD1, "eos_token_id": 2}, False, "<|endoftext|>"),  # real SD configs
}


def _ids(pad="<|endoftext|>"):
    tok = reference.clip_tokenizer(pad_token=pad)
    return tok(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="np").input_ids


def _torch_outputs(model, ids, attention_mask=None):
    import torch

    with torch.no_grad():
        mask = None if attention_mask is None else torch.from_numpy(attention_mask)
        out = model(torch.from_numpy(np.asarray(ids)).long(), attention_mask=mask, output_hidden_states=True)
    return {
        k: (tuple(h.numpy() for h in v) if isinstance(v, tuple) else v.numpy()) for k, v in out.items() if v is not None
    }


def _build(name):
    config_dict, with_projection, pad = CASES[name]
    torch_model = reference.text_encoder(config_dict, with_projection=with_projection)
    config = CLIPTextConfig.from_dict(config_dict, source=name)
    params = convert_clip_text(reference.state_dict_numpy(torch_model), config, with_projection=with_projection)
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    return torch_model, model, params, pad


def _max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_transformers(name):
    torch_model, model, params, pad = _build(name)
    ids = _ids(pad)
    want = _torch_outputs(torch_model, ids)
    got = jax.jit(model.apply)({"params": params}, ids)

    assert len(got.hidden_states) == model.config.num_hidden_layers + 1 == len(want["hidden_states"])
    for i, (g, w) in enumerate(zip(got.hidden_states, want["hidden_states"], strict=True)):
        np.testing.assert_allclose(g, w, atol=ATOL, rtol=0, err_msg=f"hidden_states[{i}]")
    np.testing.assert_allclose(got.last_hidden_state, want["last_hidden_state"], atol=ATOL, rtol=0)
    if "text_embeds" in want:
        np.testing.assert_allclose(got.text_embeds, want["text_embeds"], atol=ATOL, rtol=0)
        assert got.text_embeds.shape == (len(PROMPTS), model.config.projection_dim)
    else:
        np.testing.assert_allclose(got.pooler_output, want["pooler_output"], atol=ATOL, rtol=0)
        assert got.text_embeds is None


@pytest.mark.parametrize("eos_token_id", [2, 49407])
def test_pooling_rule_without_eos_in_ids(eos_token_id):
    """Ids with no EOS token separate transformers' two pooling rules (argmax id vs first EOS position)."""
    config_dict = {**reference.CLIP_SD1, "eos_token_id": eos_token_id, "num_hidden_layers": 1}
    torch_model = reference.text_encoder(config_dict)
    config = CLIPTextConfig.from_dict(config_dict, source="test")
    params = convert_clip_text(reference.state_dict_numpy(torch_model), config, with_projection=False)
    ids = np.random.default_rng(0).integers(0, 49000, size=(3, 16))
    got = CLIPTextModel(config).apply({"params": params}, ids)
    np.testing.assert_allclose(got.pooler_output, _torch_outputs(torch_model, ids)["pooler_output"], atol=ATOL, rtol=0)


def test_attention_mask_matches_transformers():
    torch_model, model, params, pad = _build("sd2_gelu")
    ids = _ids(pad)
    mask = np.zeros(ids.shape, np.int64)
    for row, length in enumerate([11, 2, 25, 77]):
        mask[row, :length] = 1
    want = _torch_outputs(torch_model, ids, attention_mask=mask)
    got = model.apply({"params": params}, ids, mask)
    np.testing.assert_allclose(got.last_hidden_state, want["last_hidden_state"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got.pooler_output, want["pooler_output"], atol=ATOL, rtol=0)


def test_tanh_gelu_would_fail_the_tolerance():
    """Same weights, `hidden_act` swapped to the tanh approximation: the error is far outside ATOL."""
    torch_model, model, params, pad = _build("sd2_gelu")
    ids = _ids(pad)
    want = _torch_outputs(torch_model, ids)["last_hidden_state"]
    exact = _max_err(model.apply({"params": params}, ids).last_hidden_state, want)
    tanh_model = CLIPTextModel(dataclasses.replace(model.config, hidden_act="gelu_new"))
    approx = _max_err(tanh_model.apply({"params": params}, ids).last_hidden_state, want)
    assert exact < ATOL
    assert approx > 10 * ATOL, f"tanh GELU error {approx:.2e} would not be caught by atol {ATOL}"


def test_bf16_compute_smoke():
    torch_model, model, params, pad = _build("sdxl_2_projection")
    ids = _ids(pad)
    want = _torch_outputs(torch_model, ids)
    bf16_model = CLIPTextModelWithProjection(model.config, dtype=jnp.bfloat16)
    for p in (params, jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), params)):
        got = jax.jit(bf16_model.apply)({"params": p}, ids)
        assert got.last_hidden_state.dtype == jnp.bfloat16 and got.text_embeds.dtype == jnp.bfloat16
        for name, g in (
            ("last_hidden_state", got.last_hidden_state),
            ("penultimate", got.hidden_states[-2]),
            ("text_embeds", got.text_embeds),
        ):
            w = want["hidden_states"][-2] if name == "penultimate" else want[name]
            assert np.isfinite(np.asarray(g, np.float32)).all(), name
            # bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.004); values here reach ~4.5, ~10 layers deep.
            np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=0.1, rtol=0.05, err_msg=name)


def test_both_checkpoint_spellings_convert():
    """SD checkpoints prefix `text_model.` and carry the `position_ids` buffer; transformers 5 saves neither."""
    torch_model, model, params, _ = _build("sd1_quick_gelu")
    v5 = reference.state_dict_numpy(torch_model)
    assert not any(k.startswith("text_model.") for k in v5)
    legacy = {f"text_model.{k}": v for k, v in v5.items()}
    legacy["text_model.embeddings.position_ids"] = np.arange(77)[None]
    converted = convert_clip_text(legacy, model.config, with_projection=False)
    jax.tree_util.tree_map(np.testing.assert_array_equal, converted, params)


def test_conversion_reports_bad_keys_by_name():
    torch_model, model, _, _ = _build("sdxl_2_projection")
    good = reference.state_dict_numpy(torch_model)
    bad = dict(good)
    del bad["text_model.encoder.layers.1.mlp.fc2.bias"]
    bad["text_model.encoder.layers.9.mlp.fc2.bias"] = good["text_model.encoder.layers.0.mlp.fc2.bias"]
    bad["text_model.final_layer_norm.weight"] = np.ones(7, np.float32)
    bad["text_projection.weight"] = good["text_projection.weight"].T
    with pytest.raises(WeightLoadError) as info:
        convert_clip_text(bad, model.config, with_projection=True, component="text_encoder_2")
    err = info.value
    assert err.missing == ["text_model/encoder/layers_1/mlp/fc2/bias"]
    assert err.unexpected == ["text_model.encoder.layers.9.mlp.fc2.bias"]
    assert len(err.misshaped) == 2
    assert any(m.startswith("text_model.final_layer_norm.weight: checkpoint (7,)") for m in err.misshaped)
    want = "text_projection.weight: checkpoint (48, 40) (as Flax (40, 48)) vs model (48, 40)"
    assert any(m.startswith(want) for m in err.misshaped)
    assert "text_encoder_2" in str(err)
    # A projection head fed to the plain encoder is unexpected; its absence is missing the other way round.
    with pytest.raises(WeightLoadError, match="unexpected.*text_projection.weight"):
        convert_clip_text(good, model.config, with_projection=False)
    no_head = {k: v for k, v in good.items() if k != "text_projection.weight"}
    with pytest.raises(WeightLoadError, match="missing.*text_projection/kernel"):
        convert_clip_text(no_head, model.config, with_projection=True)


def test_cast_runs_per_tensor():
    torch_model, model, _, _ = _build("sd1_quick_gelu")
    params = convert_clip_text(
        reference.state_dict_numpy(torch_model),
        model.config,
        with_projection=False,
        cast=lambda a: jnp.asarray(a, jnp.bfloat16),
    )
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}


# Real `text_encoder*/config.json` files (SD 1.5, SD 2.1, SDXL base 1.0 encoder 2), bookkeeping keys included.
_REAL_COMMON = {
    "architectures": ["CLIPTextModel"],
    "model_type": "clip_text_model",
    "torch_dtype": "float32",
    "transformers_version": "4.25.0.dev0",
    "_name_or_path": "openai/clip-vit-large-patch14",
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "vocab_size": 49408,
}
REAL_CONFIGS = {
    "sd15": (
        {
            **_REAL_COMMON,
            "hidden_act": "quick_gelu",
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
            "projection_dim": 768,
        },
        False,
        123_060_480,
    ),
    "sd21": (
        {
            **_REAL_COMMON,
            "hidden_act": "gelu",
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 23,
            "projection_dim": 512,
        },
        False,
        340_387_840,
    ),
    "sdxl_2": (
        {
            **_REAL_COMMON,
            "architectures": ["CLIPTextModelWithProjection"],
            "hidden_act": "gelu",
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_attention_heads": 20,
            "num_hidden_layers": 32,
            "projection_dim": 1280,
        },
        True,
        694_659_840,
    ),
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_full_size_key_sets_convert_without_allocating(name):
    """Every key and shape of the full-size transformers model converts (zero-stride arrays: no memory)."""
    import torch
    from transformers import CLIPTextConfig as HFConfig
    from transformers import CLIPTextModel as HFModel
    from transformers import CLIPTextModelWithProjection as HFModelWithProjection

    raw, with_projection, n_params = REAL_CONFIGS[name]
    config = CLIPTextConfig.from_dict(raw, source=f"{name}/text_encoder/config.json")
    with torch.device("meta"):
        hf = (HFModelWithProjection if with_projection else HFModel)(HFConfig(**dataclasses.asdict(config)))
    shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    state = {
        ("" if k.startswith(("text_model.", "text_projection")) else "text_model.") + k: np.broadcast_to(
            np.float32(0), s
        )
        for k, s in shapes.items()
    }
    params = convert_clip_text(state, config, with_projection=with_projection)
    assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)) == n_params


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match="use_rotary"):
        CLIPTextConfig.from_dict({**reference.CLIP_SD1, "use_rotary": True}, source="x/config.json")
    with pytest.raises(ConfigError, match="hidden_act"):
        CLIPTextConfig.from_dict({**reference.CLIP_SD1, "hidden_act": "swiglu"}, source="x/config.json")
    with pytest.raises(ConfigError, match="multiple"):
        CLIPTextConfig.from_dict({**reference.CLIP_SD1, "num_attention_heads": 5}, source="x/config.json")
    # Runtime-only keys transformers may write are accepted and dropped.
    assert (
        CLIPTextConfig.from_dict({**reference.CLIP_SD1, "_attn_implementation_autoset": True}, source="x").hidden_size
        == 32
    )


def test_init_params_shape_allocates_nothing_and_mirrors_transformers_paths():
    config = CLIPTextConfig.from_dict(reference.CLIP_SDXL_2, source="test")
    shapes = CLIPTextModelWithProjection.init_params_shape(config)
    assert isinstance(jax.tree_util.tree_leaves(shapes)[0], jax.ShapeDtypeStruct)
    assert shapes["text_model"]["embeddings"]["token_embedding"]["embedding"].shape == (49408, 48)
    assert shapes["text_model"]["encoder"]["layers_0"]["self_attn"]["q_proj"]["kernel"].shape == (48, 48)
    assert shapes["text_model"]["final_layer_norm"]["scale"].shape == (48,)
    assert shapes["text_projection"]["kernel"].shape == (48, 40)
    assert "text_projection" not in CLIPTextModel.init_params_shape(config)
