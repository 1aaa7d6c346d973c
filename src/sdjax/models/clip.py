"""CLIP text encoders: transformers' `CLIPTextModel` and `CLIPTextModelWithProjection` in Flax.

The text tower of CLIP (Radford et al. 2021, "Learning Transferable Visual Models From Natural Language
Supervision"): token + learned position embeddings, `num_hidden_layers` pre-LayerNorm transformer blocks with
causal self-attention, a final LayerNorm, and the pooled feature taken at the end-of-text token.

- SD 1.x: OpenAI ViT-L/14 text tower (`quick_gelu`), `last_hidden_state` conditions the UNet.
- SD 2.x: OpenCLIP ViT-H text tower (exact erf `gelu`, 23 layers kept of 24), `last_hidden_state`.
- SDXL: ViT-L (`text_encoder`) and OpenCLIP bigG with `text_projection` (`text_encoder_2`); the UNet takes the
  penultimate layers `hidden_states[-2]` (before the final LayerNorm) and the projected pooled `text_embeds`.

Parameter paths mirror transformers' state-dict keys (`text_model/encoder/layers_0/self_attn/q_proj/kernel`,
`text_projection/kernel`), so `models.convert.convert_state_dict` converts checkpoints by its one rule; the only
exceptions are the buffer `position_ids` and the transformers-v5 `CLIPTextModel` files that drop the `text_model.`
prefix (see `convert_clip_text`). `dtype` is the compute dtype of the matmuls and of the returned arrays; layer
norms, the attention softmax and the residual stream stay float32 (cheap at 77 tokens, and it halves the bf16 error).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import config_from_dict
from sdjax.models import shapes_cache
from sdjax.models.convert import convert_state_dict


def _quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


def _gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


# transformers' ACT2FN names used by CLIP checkpoints. `gelu` is the exact erf form (torch.nn.GELU()); the tanh
# approximation is only `gelu_new` / `gelu_pytorch_tanh`, never a stand-in for `gelu`.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "quick_gelu": _quick_gelu,
    "gelu": _gelu_exact,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
}

# `config.json` keys transformers may write that only steer its own PyTorch runtime (outputs returned, attention
# kernel); they do not change the architecture, so `CLIPTextConfig.from_dict` accepts and drops them.
RUNTIME_KEYS = frozenset(
    {
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_return_dict",
        "torchscript",
    }
)


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """The `config.json` of a transformers `CLIPTextModel` / `CLIPTextModelWithProjection` (defaults as in
    transformers 5). Real SD/SDXL files carry every field below; their legacy `eos_token_id: 2` selects the
    argmax pooling rule (see `_pool`)."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    dropout: float = 0.0
    initializer_range: float = 0.02
    initializer_factor: float = 1.0
    pad_token_id: int | None = 1
    bos_token_id: int | None = 49406
    eos_token_id: int = 49407

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; known: {sorted(ACTIVATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}"
            )
        if not isinstance(self.eos_token_id, int):
            raise ValueError(f"eos_token_id must be one int, got {self.eos_token_id!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> CLIPTextConfig:
        """Build from a parsed `config.json`; unknown architecture keys raise `ConfigError` naming `source`."""
        return config_from_dict(cls, dict(raw), source=source, ignore=RUNTIME_KEYS)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@flax.struct.dataclass
class CLIPTextOutput:
    """What the text encoders return (arrays in the compute dtype).

    `hidden_states` holds `num_hidden_layers + 1` arrays `(B, T, D)`: the embeddings, then each layer's output
    (before the final LayerNorm), so `hidden_states[-2]` is SDXL's penultimate layer. `last_hidden_state` is the
    final LayerNorm of `hidden_states[-1]`. `pooler_output` `(B, D)` is `last_hidden_state` at the end-of-text
    token; `text_embeds` `(B, projection_dim)` is its projection (only `CLIPTextModelWithProjection`, else None).
    """

    last_hidden_state: jax.Array
    pooler_output: jax.Array
    hidden_states: tuple[jax.Array, ...]
    text_embeds: jax.Array | None = None


def _layer_norm(config: CLIPTextConfig, name: str) -> nn.LayerNorm:
    # Two-pass variance in float32, as torch.nn.LayerNorm computes it.
    return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=jnp.float32, use_fast_variance=False, name=name)


class CLIPTextEmbeddings(nn.Module):
    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids_bt):
        c = self.config
        seq_len = input_ids_bt.shape[-1]
        if seq_len > c.max_position_embeddings:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings={c.max_position_embeddings}")
        tokens_btd = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, name="token_embedding")(input_ids_bt)
        positions_td = nn.Embed(c.max_position_embeddings, c.hidden_size, dtype=self.dtype, name="position_embedding")(
            jnp.arange(seq_len)
        )
        return tokens_btd.astype(jnp.float32) + positions_td[None].astype(jnp.float32)


class CLIPAttention(nn.Module):
    """Multi-head self-attention; `mask_bqk` (True = attend) is the text tower's causal (and key-padding) mask, None
    for the vision tower. Softmax in float32."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, mask_bqk):
        c = self.config
        heads, head_dim = c.num_attention_heads, c.head_dim

        def proj(name):
            y = nn.Dense(c.hidden_size, dtype=self.dtype, name=name)(x_btd)
            return y.reshape(y.shape[:-1] + (heads, head_dim))

        q_bthd, k_bthd, v_bthd = proj("q_proj"), proj("k_proj"), proj("v_proj")
        logits_bhqk = jnp.einsum("bqhd,bkhd->bhqk", q_bthd, k_bthd, preferred_element_type=jnp.float32)
        logits_bhqk = logits_bhqk * head_dim**-0.5
        if mask_bqk is not None:
            logits_bhqk = jnp.where(mask_bqk[:, None], logits_bhqk, jnp.finfo(jnp.float32).min)
        probs_bhqk = jax.nn.softmax(logits_bhqk, axis=-1).astype(self.dtype)
        out_bthd = jnp.einsum("bhqk,bkhd->bqhd", probs_bhqk, v_bthd)
        out_btd = out_bthd.reshape(out_bthd.shape[:-2] + (c.hidden_size,))
        return nn.Dense(c.hidden_size, dtype=self.dtype, name="out_proj")(out_btd)


class CLIPMLP(nn.Module):
    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd):
        c = self.config
        h = nn.Dense(c.intermediate_size, dtype=self.dtype, name="fc1")(x_btd)
        h = ACTIVATIONS[c.hidden_act](h)
        return nn.Dense(c.hidden_size, dtype=self.dtype, name="fc2")(h)


class CLIPEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, mask_bqk):
        h = _layer_norm(self.config, "layer_norm1")(x_btd).astype(self.dtype)
        x_btd = x_btd + CLIPAttention(self.config, self.dtype, name="self_attn")(h, mask_bqk).astype(jnp.float32)
        h = _layer_norm(self.config, "layer_norm2")(x_btd).astype(self.dtype)
        return x_btd + CLIPMLP(self.config, self.dtype, name="mlp")(h).astype(jnp.float32)


class CLIPEncoder(nn.Module):
    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, mask_bqk):
        hidden_states = [x_btd]
        for i in range(self.config.num_hidden_layers):
            x_btd = CLIPEncoderLayer(self.config, self.dtype, name=f"layers_{i}")(x_btd, mask_bqk)
            hidden_states.append(x_btd)
        return tuple(hidden_states)


def _pool(config: CLIPTextConfig, last_btd, input_ids_bt):
    """The feature at the end-of-text token, by transformers' rule: configs written before transformers PR #24773
    say `eos_token_id: 2` and take the position of the largest id (the EOS id 49407 is the largest in CLIP's
    vocabulary); newer configs take the first position equal to `eos_token_id`."""
    if config.eos_token_id == 2:
        index_b = jnp.argmax(input_ids_bt, axis=-1)
    else:
        index_b = jnp.argmax((input_ids_bt == config.eos_token_id).astype(jnp.int32), axis=-1)
    return jnp.take_along_axis(last_btd, index_b[:, None, None], axis=1)[:, 0]


class CLIPTextTransformer(nn.Module):
    """transformers' `CLIPTextTransformer` (the `text_model` attribute of both encoders)."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids_bt, attention_mask_bt=None) -> CLIPTextOutput:
        input_ids_bt = jnp.asarray(input_ids_bt, jnp.int32)
        if input_ids_bt.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq_len) ints, got shape {input_ids_bt.shape}")
        seq_len = input_ids_bt.shape[1]
        mask_bqk = jnp.tril(jnp.ones((seq_len, seq_len), bool))[None]
        if attention_mask_bt is not None:
            mask_bqk = mask_bqk & (jnp.asarray(attention_mask_bt) > 0)[:, None, :]
        x_btd = CLIPTextEmbeddings(self.config, self.dtype, name="embeddings")(input_ids_bt)
        hidden_states = CLIPEncoder(self.config, self.dtype, name="encoder")(x_btd, mask_bqk)
        last_btd = _layer_norm(self.config, "final_layer_norm")(hidden_states[-1]).astype(self.dtype)
        return CLIPTextOutput(
            last_hidden_state=last_btd,
            pooler_output=_pool(self.config, last_btd, input_ids_bt),
            hidden_states=tuple(h.astype(self.dtype) for h in hidden_states),
        )


def final_layer_norm(config: CLIPTextConfig, params: Mapping[str, Any], x_btd, dtype=jnp.float32):
    """The text model's `final_layer_norm` on any hidden state (CLIP skip); `params` are the encoder's params."""
    norm = _layer_norm(config, "final_layer_norm")
    p = params["text_model"]["final_layer_norm"]
    return norm.apply({"params": p}, jnp.asarray(x_btd, jnp.float32)).astype(dtype)


class _InitShapes:
    @classmethod
    def init_params_shape(cls, config: CLIPTextConfig):
        """The params tree as `jax.ShapeDtypeStruct`s (float32), computed by `jax.eval_shape` (nothing allocated)
        and kept on disk for the next process (`shapes_cache`)."""

        def trace():
            ids = jnp.zeros((1, config.max_position_embeddings), jnp.int32)
            return jax.eval_shape(lambda: cls(config).init(jax.random.key(0), ids))["params"]

        return shapes_cache.cached(cls, config, trace)


class CLIPTextModel(_InitShapes, nn.Module):
    """transformers `CLIPTextModel`: `apply({"params": p}, input_ids (B, T) int[, attention_mask (B, T)])
    -> CLIPTextOutput` (`text_embeds` None). The SD 1.x/2.x `text_encoder` and SDXL's `text_encoder`.

    Without `attention_mask` (what the SD pipelines do) attention is causal only and padding tokens are attended
    to, exactly as in transformers and diffusers."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids_bt, attention_mask_bt=None) -> CLIPTextOutput:
        return CLIPTextTransformer(self.config, self.dtype, name="text_model")(input_ids_bt, attention_mask_bt)


class CLIPTextModelWithProjection(_InitShapes, nn.Module):
    """transformers `CLIPTextModelWithProjection` (SDXL `text_encoder_2`, OpenCLIP bigG): `CLIPTextModel` plus
    `text_embeds = text_projection(pooler_output)`, a bias-free Linear to `projection_dim`."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids_bt, attention_mask_bt=None) -> CLIPTextOutput:
        out = CLIPTextTransformer(self.config, self.dtype, name="text_model")(input_ids_bt, attention_mask_bt)
        embeds = nn.Dense(self.config.projection_dim, use_bias=False, dtype=self.dtype, name="text_projection")(
            out.pooler_output
        )
        return out.replace(text_embeds=embeds)


# Keyed by the class names that `config.json` "architectures" and `model_index.json` use.
MODEL_CLASSES = {"CLIPTextModel": CLIPTextModel, "CLIPTextModelWithProjection": CLIPTextModelWithProjection}

# transformers 5 saves `CLIPTextModel` without the `text_model.` prefix that every SD checkpoint (and
# `CLIPTextModelWithProjection`) has; both spellings load, and a file holding both fails as a duplicate.
_RENAMES = ((r"^(embeddings|encoder|final_layer_norm)\.", r"text_model.\1."),)
# A buffer (arange), not a parameter; present in checkpoints written by transformers < 4.31.
_IGNORE = (r"(text_model\.)?embeddings\.position_ids",)


def convert_clip_text(
    state_dict: Mapping[str, Any],
    config: CLIPTextConfig,
    *,
    with_projection: bool,
    cast: Callable[[np.ndarray], Any] | None = None,
    component: str | None = None,
):
    """A transformers CLIP text-encoder state dict (name -> array) -> Flax params for `CLIPTextModel`
    (`with_projection=False`) or `CLIPTextModelWithProjection`. Raises `models.convert.WeightLoadError` naming
    every missing, unexpected and mis-shaped key."""
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return convert_state_dict(
        state_dict,
        cls.init_params_shape(config),
        component=component or cls.__name__,
        renames=_RENAMES,
        ignore=_IGNORE,
        cast=cast,
    )
