"""The T5 text encoder: transformers' `T5EncoderModel` in Flax.

The encoder of T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer") as Flux.1 (`text_encoder_2`) and SD 3 (`text_encoder_3`) use it: T5 v1.1 XXL, 24 layers of width
4096, 64 heads of 64, a gated-GELU feed-forward of 10240 (`feed_forward_proj: "gated-gelu"`, tanh GELU
`gelu_new`). The original T5's ReLU feed-forward (`"relu"`) builds too. Its rules, unlike CLIP's:

- no position embeddings: a learned bias per head and relative-position bucket (`relative_attention_bias`, in
  block 0 only) is added to the attention logits of every layer; buckets are bidirectional, half of them exact
  distances, half logarithmic up to `relative_attention_max_distance` (`relative_position_bucket`);
- no 1/sqrt(d_kv) scaling of q.k (folded into the initialisation of `q`);
- RMS norm without mean subtraction or bias (`T5LayerNorm`), pre-norm blocks, a final norm; no Linear has a bias.

Parameter paths mirror transformers' state-dict keys (`shared/embedding`,
`encoder/block_0/layer_0/SelfAttention/q/kernel`, `encoder/block_0/layer_1/DenseReluDense/wi_0/kernel`,
`encoder/block_0/layer_0/layer_norm/weight`, `encoder/final_layer_norm/weight`), so
`models.convert.convert_state_dict` converts checkpoints by its one rule; the exception is the token table, which
files carry as `shared.weight`, as its tied copy `encoder.embed_tokens.weight`, or both (see `convert_t5_encoder`).

Precision: `dtype` is the compute dtype of the matmuls and of the returned array. The residual stream, every RMS
norm, the position bias, the attention logits and softmax, and the feed-forward's activation and gating product
stay float32. With `dtype=float16`, `wo` (the feed-forward's output projection) runs in float32 as well, as
transformers keeps it (`_keep_in_fp32_modules`): T5 v1.1 XXL's activations there exceed float16's range. bfloat16
has float32's range, so its `wo` runs in bfloat16 (as in transformers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import ConfigError, config_from_dict
from sdjax.models import shapes_cache
from sdjax.models.convert import WeightLoadError, convert_state_dict

# transformers' ACT2FN names a T5 `dense_act_fn` can take. `gelu` is the exact erf form; `gelu_new` (what
# "gated-gelu" means) and `gelu_pytorch_tanh` are the tanh approximation.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}

# `config.json` keys that do not change the encoder: the decoder's and the training's settings, token ids, the
# output head's tying (`tie_word_embeddings` only steers T5's decoder output scaling and the LM head), and
# transformers' runtime switches. `T5Config.from_dict` accepts and drops them; `is_decoder` must be false.
IGNORED_KEYS = frozenset(
    {
        "num_decoder_layers",
        "decoder_start_token_id",
        "is_encoder_decoder",
        "is_decoder",
        "tie_word_embeddings",
        "scale_decoder_outputs",
        "dropout_rate",
        "classifier_dropout",
        "initializer_factor",
        "use_cache",
        "output_past",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
        "n_positions",
        "task_specific_params",
        "gradient_checkpointing",
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_return_dict",
        "torchscript",
    }
)


@dataclasses.dataclass(frozen=True)
class T5Config:
    """The encoder keys of a transformers T5 `config.json` (defaults as in transformers 5). `dense_act_fn` and
    `is_gated_act` follow from `feed_forward_proj` (`"gated-gelu"` -> `gelu_new`, gated; `"relu"` -> `relu`, not
    gated) unless the file gives them, in which case the file's values win, as in transformers."""

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    dense_act_fn: str | None = None
    is_gated_act: bool | None = None

    def __post_init__(self):
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ValueError(f"feed_forward_proj={self.feed_forward_proj!r} is not 'ACT' or 'gated-ACT'")
        if self.dense_act_fn is None:
            derived = "gelu_new" if self.feed_forward_proj == "gated-gelu" else parts[-1]
            object.__setattr__(self, "dense_act_fn", derived)
        if self.is_gated_act is None:
            object.__setattr__(self, "is_gated_act", parts[0] == "gated")
        if self.dense_act_fn not in ACTIVATIONS:
            raise ValueError(f"dense_act_fn={self.dense_act_fn!r} is not supported; known: {sorted(ACTIVATIONS)}")
        if self.relative_attention_num_buckets < 4 or self.relative_attention_max_distance < 4:
            raise ValueError("relative_attention_num_buckets and relative_attention_max_distance must be >= 4")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> T5Config:
        """Build from a parsed `config.json`; unknown keys raise `ConfigError` naming `source` and the key."""
        if raw.get("is_decoder"):
            raise ConfigError(f"{source}: is_decoder=true describes T5's decoder stack; sdjax builds the encoder")
        return config_from_dict(cls, dict(raw), source=source, ignore=IGNORED_KEYS)

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv


def relative_position_bucket(relative_position: np.ndarray, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bidirectional bucket of `memory_position - query_position` (Mesh TensorFlow's rule, as transformers'
    `T5Attention._relative_position_bucket(bidirectional=True)` computes it, float32 log included): half the
    buckets for keys after the query; within each half, distances below `num_buckets // 4` get a bucket each and
    longer ones share logarithmically wider buckets, everything from `max_distance` on the last one. Host numpy:
    the sequence length is static."""
    half = num_buckets // 2
    buckets = np.where(relative_position > 0, half, 0).astype(np.int64)
    distance = np.abs(relative_position).astype(np.int64)
    max_exact = half // 2
    with np.errstate(divide="ignore"):  # log(0) for the exact buckets, not used
        log_ratio = np.log(distance.astype(np.float32) / np.float32(max_exact))
    scaled = log_ratio / np.float32(math.log(max_distance / max_exact)) * np.float32(half - max_exact)
    large = max_exact + np.where(distance < max_exact, 0, scaled).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (buckets + np.where(distance < max_exact, distance, large)).astype(np.int32)


class T5LayerNorm(nn.Module):
    """RMS norm (Zhang & Sennrich 2019): `weight * x / sqrt(mean(x^2) + eps)` in float32; no mean, no bias."""

    epsilon: float

    @nn.compact
    def __call__(self, x_btd):
        weight = self.param("weight", nn.initializers.ones, (x_btd.shape[-1],), jnp.float32)
        x_btd = x_btd.astype(jnp.float32)
        variance_bt1 = jnp.mean(jnp.square(x_btd), axis=-1, keepdims=True)
        return weight.astype(jnp.float32) * (x_btd * jax.lax.rsqrt(variance_bt1 + self.epsilon))


class T5Attention(nn.Module):
    """Self-attention with T5's additive position bias `bias_hqk` and no logit scaling; the block that owns the
    bias table (`has_relative_attention_bias`, block 0) computes it, the others reuse it. `mask_bk` (True =
    attend) drops padding keys. Logits and softmax in float32; returns `(out_btd, bias_hqk)`."""

    config: T5Config
    has_relative_attention_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, bias_hqk, mask_bk):
        c = self.config
        if self.has_relative_attention_bias:
            seq_len = x_btd.shape[1]
            positions = np.arange(seq_len)
            bucket_qk = relative_position_bucket(
                positions[None, :] - positions[:, None],
                c.relative_attention_num_buckets,
                c.relative_attention_max_distance,
            )
            table = nn.Embed(c.relative_attention_num_buckets, c.num_heads, name="relative_attention_bias")
            bias_hqk = jnp.transpose(table(jnp.asarray(bucket_qk)).astype(jnp.float32), (2, 0, 1))
        if bias_hqk is None:
            raise ValueError("T5Attention without its own relative_attention_bias needs block 0's position bias")

        def proj(name):
            y = nn.Dense(c.inner_dim, use_bias=False, dtype=self.dtype, name=name)(x_btd)
            return y.reshape(y.shape[:-1] + (c.num_heads, c.d_kv))

        q_bthd, k_bthd, v_bthd = proj("q"), proj("k"), proj("v")
        logits_bhqk = jnp.einsum("bqhd,bkhd->bhqk", q_bthd, k_bthd, preferred_element_type=jnp.float32)
        logits_bhqk = logits_bhqk + bias_hqk[None]
        if mask_bk is not None:
            logits_bhqk = jnp.where(mask_bk[:, None, None, :], logits_bhqk, jnp.finfo(jnp.float32).min)
        probs_bhqk = jax.nn.softmax(logits_bhqk, axis=-1).astype(self.dtype)
        out_bqhd = jnp.einsum("bhqk,bkhd->bqhd", probs_bhqk, v_bthd)
        out_btd = out_bqhd.reshape(out_bqhd.shape[:-2] + (c.inner_dim,))
        return nn.Dense(c.d_model, use_bias=False, dtype=self.dtype, name="o")(out_btd), bias_hqk


class T5DenseReluDense(nn.Module):
    """The feed-forward: `wo(act(wi(x)))`, or gated `wo(act(wi_0(x)) * wi_1(x))` (transformers'
    `T5DenseActDense` / `T5DenseGatedActDense`; both are the attribute `DenseReluDense`). Activation and gate in
    float32; `wo` in float32 when `dtype` is float16 (module docstring)."""

    config: T5Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd):
        c = self.config
        act = ACTIVATIONS[c.dense_act_fn]

        def dense(name, features, x, dtype):
            return nn.Dense(features, use_bias=False, dtype=dtype, name=name)(x)

        if c.is_gated_act:
            h_btf = act(dense("wi_0", c.d_ff, x_btd, self.dtype).astype(jnp.float32))
            h_btf = h_btf * dense("wi_1", c.d_ff, x_btd, self.dtype).astype(jnp.float32)
        else:
            h_btf = act(dense("wi", c.d_ff, x_btd, self.dtype).astype(jnp.float32))
        wo_dtype = jnp.float32 if jnp.dtype(self.dtype) == jnp.float16 else self.dtype
        return dense("wo", c.d_model, h_btf.astype(wo_dtype), wo_dtype)


class T5LayerSelfAttention(nn.Module):
    config: T5Config
    has_relative_attention_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, bias_hqk, mask_bk):
        h_btd = T5LayerNorm(self.config.layer_norm_epsilon, name="layer_norm")(x_btd).astype(self.dtype)
        attn = T5Attention(self.config, self.has_relative_attention_bias, self.dtype, name="SelfAttention")
        out_btd, bias_hqk = attn(h_btd, bias_hqk, mask_bk)
        return x_btd + out_btd.astype(jnp.float32), bias_hqk


class T5LayerFF(nn.Module):
    config: T5Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd):
        h_btd = T5LayerNorm(self.config.layer_norm_epsilon, name="layer_norm")(x_btd).astype(self.dtype)
        return x_btd + T5DenseReluDense(self.config, self.dtype, name="DenseReluDense")(h_btd).astype(jnp.float32)


class T5Block(nn.Module):
    """Pre-norm block: `layer_0` self-attention, `layer_1` feed-forward (transformers' `T5Block.layer` list)."""

    config: T5Config
    has_relative_attention_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, bias_hqk, mask_bk):
        attn = T5LayerSelfAttention(self.config, self.has_relative_attention_bias, self.dtype, name="layer_0")
        x_btd, bias_hqk = attn(x_btd, bias_hqk, mask_bk)
        return T5LayerFF(self.config, self.dtype, name="layer_1")(x_btd), bias_hqk


class T5Stack(nn.Module):
    """transformers' `T5Stack` (the `encoder` attribute) after its token embedding: blocks, then the final norm.
    Takes and returns the float32 residual stream."""

    config: T5Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, mask_bk):
        bias_hqk = None
        for i in range(self.config.num_layers):
            block = T5Block(self.config, has_relative_attention_bias=i == 0, dtype=self.dtype, name=f"block_{i}")
            x_btd, bias_hqk = block(x_btd, bias_hqk, mask_bk)
        return T5LayerNorm(self.config.layer_norm_epsilon, name="final_layer_norm")(x_btd)


class T5EncoderModel(nn.Module):
    """transformers `T5EncoderModel`: `apply({"params": p}, input_ids (B, T) int[, attention_mask (B, T)])
    -> last_hidden_state (B, T, d_model)` in `dtype`.

    Without `attention_mask` (what diffusers' Flux and SD 3 pipelines do) every token attends to every token,
    padding included, exactly as in transformers. The position bias is built for the static `T`."""

    config: T5Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids_bt, attention_mask_bt=None):
        c = self.config
        input_ids_bt = jnp.asarray(input_ids_bt, jnp.int32)
        if input_ids_bt.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq_len) ints, got shape {input_ids_bt.shape}")
        mask_bk = None
        if attention_mask_bt is not None:
            if np.shape(attention_mask_bt) != input_ids_bt.shape:
                raise ValueError(
                    f"attention_mask shape {np.shape(attention_mask_bt)} != input_ids shape {input_ids_bt.shape}"
                )
            mask_bk = jnp.asarray(attention_mask_bt) > 0
        x_btd = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype, name="shared")(input_ids_bt).astype(jnp.float32)
        return T5Stack(c, self.dtype, name="encoder")(x_btd, mask_bk).astype(self.dtype)

    @classmethod
    def init_params_shape(cls, config: T5Config):
        """The params tree as `jax.ShapeDtypeStruct`s (float32), computed by `jax.eval_shape` (nothing allocated)
        and kept on disk for the next process (`shapes_cache`)."""

        def trace():
            ids = jnp.zeros((1, 2), jnp.int32)
            return jax.eval_shape(lambda: cls(config).init(jax.random.key(0), ids))["params"]

        return shapes_cache.cached(cls, config, trace)


# Keyed by the class name that `config.json` "architectures" and `model_index.json` use.
MODEL_CLASSES = {"T5EncoderModel": T5EncoderModel}

_SHARED, _TIED = "shared.weight", "encoder.embed_tokens.weight"


def convert_t5_encoder(
    state_dict: Mapping[str, Any],
    config: T5Config,
    *,
    cast: Callable[[np.ndarray], Any] | None = None,
    component: str | None = None,
):
    """A transformers `T5EncoderModel` state dict (name -> array) -> Flax params for `T5EncoderModel`. Raises
    `models.convert.WeightLoadError` naming every missing, unexpected and mis-shaped key.

    The token table: transformers saves `shared.weight` (FLUX.1-dev's `text_encoder_2`), some exports carry its
    tied copy `encoder.embed_tokens.weight` instead or as well. `shared.weight` wins when both are present (the
    copy is not read); the copy alone is used as the table. A full `T5ForConditionalGeneration` file fails: its
    `decoder.*` and `lm_head.weight` keys are reported as unexpected.
    """
    component = component or "T5EncoderModel"
    if any(key == _SHARED for key in state_dict):  # keys only: a lazy reader's `in` would read the tensor
        renames, ignore = (), (r"encoder\.embed_tokens\.weight",)
    else:
        renames, ignore = ((r"^encoder\.embed_tokens\.weight$", _SHARED),), ()
    try:
        return convert_state_dict(
            state_dict,
            T5EncoderModel.init_params_shape(config),
            component=component,
            renames=renames,
            ignore=ignore,
            cast=cast,
        )
    except WeightLoadError as e:
        missing = [
            f"{m} (from {_SHARED} or its tied copy {_TIED})" if m == "shared/embedding" else m for m in e.missing
        ]
        raise WeightLoadError(component, missing, e.unexpected, e.misshaped) from None
