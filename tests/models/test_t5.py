"""The T5 text encoder and its tokenizer against transformers' `T5EncoderModel` and `T5TokenizerFast` (the tiny
model and the small real tokenizer of `tests/t5_reference.py`).

Tolerances (CPU), relative to the largest |value| of transformers' float32 output (~3-4.5):
- float32: 1e-5 (measured at most 7.1e-7, gated-gelu and relu, lengths 7 and 64, with and without a mask);
- bfloat16 params and compute: 3e-2 (measured 7.8e-3); float16: 1e-2 (measured 1.3e-3).
Token ids are compared exactly.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import t5_reference

from sdjax.config import ConfigError
from sdjax.loading.files import read_safetensors
from sdjax.models.convert import WeightLoadError
from sdjax.models.t5 import T5Config, T5EncoderModel, convert_t5_encoder, relative_position_bucket
from sdjax.text.t5_tokenizer import T5Tokenizer
from sdjax.text.tokenizer import PromptTruncatedWarning

RTOL_F32 = 1e-5

PROMPTS = [
    "a photo of an astronaut riding a horse on mars",
    "",
    " ",
    "A majestic lion jumping from a big stone at night, highly detailed, 8k, trending on artstation!!",
    "  leading,trailing and  multiple   spaces\tand\ttabs\nand newlines  ",
    'don\'t stop: ok?! (1+2=3) [x] {y} "q" #tag @user 50% $5 a_b ~^| \\ / <b>',
    "ＦＵＬＬ－ｗｉｄｔｈ\u00a0no-break…ﬁne cafe\u0301 café naïve 東京 😀 Ω ∑ zero\u200bwidth",
    "special tokens </s> inside <pad> text <unk> and <extra_id_0> <extra_id_99> <extra_id_100>",
    "cats " * 100,  # truncated at every length below
]

# FLUX.1-dev's `text_encoder_2/config.json` as transformers 4.43 wrote it.
FLUX_CONFIG = {
    "_name_or_path": "google/t5-v1_1-xxl",
    "architectures": ["T5EncoderModel"],
    "classifier_dropout": 0.0,
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "decoder_start_token_id": 0,
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "t5",
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "output_past": True,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.3",
    "use_cache": True,
    "vocab_size": 32128,
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))


@functools.cache
def _torch_model(feed_forward_proj):
    return t5_reference.t5_encoder({**t5_reference.T5_TINY, "feed_forward_proj": feed_forward_proj})


@functools.cache
def _state_dict(feed_forward_proj):
    return {k: v.detach().numpy() for k, v in _torch_model(feed_forward_proj).state_dict().items()}


def _torch_out(model, ids, mask=None):
    import torch

    with torch.no_grad():
        mask = None if mask is None else torch.from_numpy(np.asarray(mask, np.int64))
        return model(torch.from_numpy(np.asarray(ids, np.int64)), attention_mask=mask).last_hidden_state.numpy()


def _ids(seq_len, tokenizer_dir):
    """Real prompts at length 64 (padding included); random ids (any token of the table) at other lengths."""
    if seq_len == 64:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PromptTruncatedWarning)
            return T5Tokenizer.from_folder(tokenizer_dir)(PROMPTS[:4], seq_len)
    return np.random.default_rng(seq_len).integers(0, t5_reference.T5_VOCAB_SIZE, (3, seq_len))


def _rel_err(out, ref):
    return float(np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max())


# ------------------------------------------------------------------------------------------------ model parity
@pytest.mark.parametrize("seq_len", [7, 64])
@pytest.mark.parametrize("feed_forward_proj", ["gated-gelu", "relu"])
def test_float32_parity(feed_forward_proj, seq_len, tokenizer_dir):
    config = T5Config.from_dict({**t5_reference.T5_TINY, "feed_forward_proj": feed_forward_proj})
    params = convert_t5_encoder(_state_dict(feed_forward_proj), config)
    ids = _ids(seq_len, tokenizer_dir)
    mask = np.ones(ids.shape, np.int32)
    mask[1, seq_len // 2 :] = 0  # a padded row
    mask[2, 1:3] = 0  # holes
    apply = jax.jit(T5EncoderModel(config).apply)
    for m in (None, mask):
        ref = _torch_out(_torch_model(feed_forward_proj), ids, m)
        out = apply({"params": params}, ids, m)
        assert out.dtype == jnp.float32 and out.shape == ids.shape + (config.d_model,)
        err = _rel_err(out, ref)
        assert err < RTOL_F32, f"mask={m is not None}: max relative error {err:.2e}"
    # Without a mask padding is attended (diffusers' Flux and SD 3): the padded row's real tokens change.
    unmasked, masked = apply({"params": params}, ids), apply({"params": params}, ids, mask)
    assert _rel_err(unmasked[1, : seq_len // 2], np.asarray(masked[1, : seq_len // 2])) > 1e-3


@pytest.mark.parametrize(("dtype", "rtol"), [(jnp.bfloat16, 3e-2), (jnp.float16, 1e-2)])
def test_half_precision(dtype, rtol, tokenizer_dir):
    config = T5Config.from_dict(t5_reference.T5_TINY)
    params = convert_t5_encoder(_state_dict("gated-gelu"), config, cast=lambda x: jnp.asarray(x, dtype))
    ids = _ids(64, tokenizer_dir)
    out = jax.jit(T5EncoderModel(config, dtype=dtype).apply)({"params": params}, ids)
    assert out.dtype == dtype
    err = _rel_err(out.astype(jnp.float32), _torch_out(_torch_model("gated-gelu"), ids))
    assert err < rtol, f"{jnp.dtype(dtype).name}: max relative error {err:.2e}"


def test_float16_feed_forward_beyond_float16_range(tokenizer_dir):
    """T5 v1.1 XXL's gated products and `wo` outputs exceed 65504: float16 keeps them (and the residual) float32."""
    config = T5Config.from_dict(t5_reference.T5_TINY)
    sd = dict(_state_dict("gated-gelu"))
    for name in ("wi_0", "wi_1"):  # gate and linear ~300 each: products ~1e5, `wo` outputs ~1e5
        key = f"encoder.block.0.layer.1.DenseReluDense.{name}.weight"
        sd[key] = sd[key] * 300
    ids = _ids(64, tokenizer_dir)
    ref = T5EncoderModel(config).apply({"params": convert_t5_encoder(sd, config)}, ids)
    params = convert_t5_encoder(sd, config, cast=lambda x: jnp.asarray(x, jnp.float16))
    out = T5EncoderModel(config, dtype=jnp.float16).apply({"params": params}, ids)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, np.asarray(ref)) < 1e-2


def test_relative_position_bucket_matches_transformers():
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = np.arange(-3000, 3001)
    for buckets, distance in [(32, 128), (32, 64), (64, 256), (8, 20)]:
        ref = T5Attention._relative_position_bucket(torch.from_numpy(rel), True, buckets, distance).numpy()
        np.testing.assert_array_equal(relative_position_bucket(rel, buckets, distance), ref)


# ------------------------------------------------------------------------------------------------ loading
def test_loader_path(tmp_path, tokenizer_dir):
    """config.json -> T5Config.from_dict, model.safetensors -> convert_t5_encoder, as the pipeline loader does."""
    import json

    folder = t5_reference.save_t5_encoder(tmp_path / "text_encoder_2")
    config = T5Config.from_dict(json.loads((folder / "config.json").read_text()), source="config.json")
    state_dict = read_safetensors(folder / "model.safetensors")
    assert "shared.weight" in list(state_dict) and "encoder.embed_tokens.weight" not in list(state_dict)
    params = convert_t5_encoder(state_dict, config, cast=jnp.asarray)
    ids = _ids(64, tokenizer_dir)
    out = jax.jit(T5EncoderModel(config).apply)({"params": params}, ids)
    assert _rel_err(out, _torch_out(_torch_model("gated-gelu"), ids)) < RTOL_F32


def test_flux_config_and_shapes():
    config = T5Config.from_dict(FLUX_CONFIG, source="text_encoder_2/config.json")
    assert (config.dense_act_fn, config.is_gated_act, config.inner_dim) == ("gelu_new", True, 4096)
    assert T5Config.from_dict({**FLUX_CONFIG, "dense_act_fn": None, "is_gated_act": None}) == config
    relu = T5Config(feed_forward_proj="relu")
    assert (relu.dense_act_fn, relu.is_gated_act) == ("relu", False)
    shapes = jax.tree_util.tree_leaves(T5EncoderModel.init_params_shape(config))
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 10240 + 2 * 4096
    assert sum(s.size for s in shapes) == 32128 * 4096 + 24 * per_layer + 32 * 64 + 4096  # 4.76e9
    block_0 = T5EncoderModel.init_params_shape(config)["encoder"]["block_0"]
    assert block_0["layer_0"]["SelfAttention"]["relative_attention_bias"]["embedding"].shape == (32, 64)
    assert block_0["layer_1"]["DenseReluDense"]["wi_0"]["kernel"].shape == (4096, 10240)


def test_config_errors():
    with pytest.raises(ConfigError, match=r"text_encoder_2/config.json.*unknown config key\(s\) \['num_experts'\]"):
        T5Config.from_dict({**FLUX_CONFIG, "num_experts": 8}, source="text_encoder_2/config.json")
    with pytest.raises(ConfigError, match="is_decoder"):
        T5Config.from_dict({**FLUX_CONFIG, "is_decoder": True})
    with pytest.raises(ConfigError, match="feed_forward_proj='fancy-gelu'"):
        T5Config.from_dict({**FLUX_CONFIG, "feed_forward_proj": "fancy-gelu"})
    with pytest.raises(ConfigError, match="dense_act_fn='swish2'"):
        T5Config.from_dict({**FLUX_CONFIG, "dense_act_fn": "swish2"})


def test_token_table_spellings():
    config = T5Config.from_dict(t5_reference.T5_TINY)
    full = _state_dict("gated-gelu")  # a torch state dict: shared.weight and its tied copy
    table = full["shared.weight"]
    only_shared = {k: v for k, v in full.items() if k != "encoder.embed_tokens.weight"}
    only_copy = {k: v for k, v in full.items() if k != "shared.weight"}
    for sd in (full, only_shared, only_copy):
        np.testing.assert_array_equal(convert_t5_encoder(sd, config)["shared"]["embedding"], table)
    neither = {k: v for k, v in only_shared.items() if k != "shared.weight"}
    with pytest.raises(WeightLoadError, match=r"shared/embedding \(from shared.weight or its tied copy"):
        convert_t5_encoder(neither, config, component="text_encoder_2")


def test_weight_errors_name_keys():
    config = T5Config.from_dict(t5_reference.T5_TINY)
    sd = dict(_state_dict("gated-gelu"))
    del sd["encoder.block.1.layer.1.DenseReluDense.wi_1.weight"]
    sd["decoder.block.0.layer.0.SelfAttention.q.weight"] = sd["encoder.block.0.layer.0.SelfAttention.q.weight"]
    sd["encoder.final_layer_norm.weight"] = np.ones(31, np.float32)
    with pytest.raises(WeightLoadError) as e:
        convert_t5_encoder(sd, config, component="text_encoder_2")
    msg = str(e.value)
    assert msg.startswith("text_encoder_2:")
    assert "encoder/block_1/layer_1/DenseReluDense/wi_1/kernel" in e.value.missing
    assert e.value.unexpected == ["decoder.block.0.layer.0.SelfAttention.q.weight"]
    assert "encoder.final_layer_norm.weight: checkpoint (31,)" in msg
    relu = T5Config.from_dict({**t5_reference.T5_TINY, "feed_forward_proj": "relu"})
    with pytest.raises(WeightLoadError, match="DenseReluDense.wi_0.weight"):  # a gated file for a relu config
        convert_t5_encoder(_state_dict("gated-gelu"), relu)


# ------------------------------------------------------------------------------------------------ tokenizer
@pytest.mark.parametrize("max_length", [512, 77, 16, 2])
def test_tokenizer_ids_match_transformers(max_length, tokenizer_dir):
    from transformers import T5TokenizerFast

    ref = T5TokenizerFast.from_pretrained(str(tokenizer_dir))
    want = ref(PROMPTS, padding="max_length", max_length=max_length, truncation=True, return_tensors="np")
    tok = T5Tokenizer.from_folder(tokenizer_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTruncatedWarning)
        got = tok(PROMPTS, max_length)
    assert got.dtype == np.int32 and got.shape == (len(PROMPTS), max_length)
    np.testing.assert_array_equal(got, want.input_ids)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.model_max_length) == (0, 1, 2, 512)
    assert tok.vocab_size == len(ref) == t5_reference.T5_VOCAB_SIZE


def test_tokenizer_saved_by_transformers(tmp_path, tokenizer_dir):
    """transformers 5's `save_pretrained` writes `extra_special_tokens` and no `added_tokens_decoder`."""
    from transformers import T5TokenizerFast

    T5TokenizerFast.from_pretrained(str(tokenizer_dir)).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTruncatedWarning)
        got = T5Tokenizer.from_folder(tmp_path)(PROMPTS, 77)
        want = T5Tokenizer.from_folder(tokenizer_dir)(PROMPTS, 77)
    np.testing.assert_array_equal(got, want)


def test_tokenizer_truncation_warns(tokenizer_dir):
    tok = T5Tokenizer.from_folder(tokenizer_dir)
    with pytest.warns(
        PromptTruncatedWarning,
        match=r"10 tokens; T5 reads 4 .*6 tokens were dropped: 'astronaut riding a horse on mars'",
    ):
        ids = tok("a photo of an astronaut riding a horse on mars", max_length=5)
    assert ids.tolist() == [tok.encode("a photo of an")[:4] + [1]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok(["a photo of an"], max_length=5)  # 4 tokens + </s>: fits, no warning
    assert tok.decode(tok.encode("a photo of an astronaut")) == "a photo of an astronaut"


def test_tokenizer_bad_input(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        T5Tokenizer.from_folder(tmp_path)
    tok = T5Tokenizer.from_folder(tokenizer_dir)
    with pytest.raises(TypeError, match="texts must be"):
        tok([1, 2])
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        tok("a", max_length=0)
