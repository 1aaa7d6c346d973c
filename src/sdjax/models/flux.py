"""The Flux.1 transformer (dev, schnell): diffusers `FluxTransformer2DModel` in flax.linen.

Architecture (Black Forest Labs 2024, "FLUX.1"; the MM-DiT of Esser et al. 2024, "Scaling Rectified Flow
Transformers for High-Resolution Image Synthesis"): packed latent tokens (`x_embedder`) and T5 text tokens
(`context_embedder`) go through `num_layers` double-stream blocks (`FluxTransformerBlock`: each stream has its own
AdaLayerNormZero, projections and MLP; one attention over the concatenated [text, image] tokens), then
`num_single_layers` single-stream blocks over the concatenation (`FluxSingleTransformerBlock`: attention and MLP
side by side from one AdaLayerNormZeroSingle, one `proj_out` over both), then the image tokens through `norm_out`
(AdaLayerNormContinuous) and `proj_out`. Every block is modulated by one conditioning vector `temb`: the sinusoidal
timestep (x1000) through an MLP, plus the guidance scale (x1000) through another (`guidance_embeds`, dev only), plus
the pooled CLIP text embedding through a third (`time_text_embed`). Positions enter only as rotary embeddings
(`flux_pos_embed`): three axes (index, row, column) of `axes_dims_rope` channels each, from the concatenated
text and image ids, applied to q and k in diffusers' interleaved-pairs convention.

Layout: tokens `(B, L, C)` throughout. Attention heads are the inner factor of the width, so q/k `(B, S, H*D)`
reshape to `(B, S, H, D)` for the RMSNorm and the rotary embedding and back again with no transpose; the
attention itself is `sdjax.ops.attention.attention` on `(B, S, H*D)`. `pack_latents` / `unpack_latents` convert
between the VAE's NCHW latents and these tokens (2x2 patches), `image_ids` / `text_ids` build the positions; all
four are the pipeline's helpers, here because they define the model's input format.

Precision: `dtype` is the compute dtype of every matmul (the Linears and attention's q/k/v). The two residual
streams, the LayerNorm/RMSNorm statistics, the modulation (`x * (1 + scale) + shift`, gates), the rotary embedding,
the sinusoids, the GELUs and the attention softmax stay float32. Unlike diffusers in bf16, the timestep is never
rounded to `dtype` before its sinusoid. The rotary frequencies are float32 here (float64 in diffusers): the angle at
position p is off by at most ~p * 1e-7 rad (1e-5 at p = 128, a 2048-pixel side).

Params mirror the diffusers state dict (`transformer_blocks_0/attn/to_q/kernel`,
`single_transformer_blocks_0/proj_mlp/kernel`, `time_text_embed/timestep_embedder/linear_1/kernel`), so
`convert_flux_transformer` needs no rename table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import ConfigError, config_from_dict
from sdjax.models import shapes_cache
from sdjax.models.convert import convert_state_dict
from sdjax.models.layers import ATTENTION_IMPLEMENTATIONS, TimestepEmbedding, timestep_embedding
from sdjax.ops import attention as ops_attention

Dtype = Any

ROPE_THETA = 10000.0  # diffusers `FluxPosEmbed(theta=10000)`
TIME_CHANNELS = 256  # `Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0)`
TIME_FACTOR = 1000.0  # the model multiplies timestep and guidance by this before their sinusoids


# ---------------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class FluxTransformerConfig:
    """The keys of a diffusers `FluxTransformer2DModel` `config.json`, with diffusers' defaults (Flux.1 schnell;
    dev sets `guidance_embeds`). `out_channels` None means `in_channels`."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> FluxTransformerConfig:
        """Build from a parsed `config.json`; unknown keys raise `ConfigError` naming `source`."""
        return config_from_dict(cls, dict(raw), source=source)

    def __post_init__(self):
        if isinstance(self.axes_dims_rope, list):  # configs are jit-static: hashable
            object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        name = type(self).__name__
        if sum(self.axes_dims_rope) != self.attention_head_dim or any(d % 2 for d in self.axes_dims_rope):
            raise ConfigError(
                f"{name}: axes_dims_rope {self.axes_dims_rope} must be even and sum to attention_head_dim "
                f"{self.attention_head_dim} (the rotary embedding covers each head's channels)"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        """Width of the output tokens: diffusers' `patch_size**2 * (out_channels or in_channels)`."""
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


# ---------------------------------------------------------------------------------------------- packing
def pack_latents(x_bchw):
    """diffusers `FluxPipeline._pack_latents`: latents `(B, C, h, w)` -> tokens `(B, (h/2)(w/2), 4C)`.

    Each token is one 2x2 patch, row-major over patches; its width is channel-major: `c * 4 + dy * 2 + dx`.
    Works on numpy and jax arrays alike (traceable); h and w must be even.
    """
    b, c, h, w = x_bchw.shape
    if h % 2 or w % 2:
        raise ValueError(f"pack_latents: latent height and width must be even; got {h}x{w}")
    x = x_bchw.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens_bld, h: int, w: int):
    """diffusers `FluxPipeline._unpack_latents`, the inverse of `pack_latents`: tokens `(B, (h/2)(w/2), 4C)` ->
    latents `(B, C, h, w)`. `h`, `w` are the LATENT height and width (diffusers takes pixels and divides by 8)."""
    b, n, d = tokens_bld.shape
    if h % 2 or w % 2 or n != (h // 2) * (w // 2) or d % 4:
        raise ValueError(
            f"unpack_latents: tokens {tokens_bld.shape} are not the 2x2 patches of an even {h}x{w} latent "
            f"((h/2)*(w/2) = {(h // 2) * (w // 2)} tokens of 4 * C channels)"
        )
    x = tokens_bld.reshape(b, h // 2, w // 2, d // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int) -> np.ndarray:
    """diffusers `FluxPipeline._prepare_latent_image_ids` for an `h x w` latent (image / 8): `(h/2 * w/2, 3)`
    float32 rows `(0, row, column)` of each packed token, in `pack_latents`' order."""
    if h % 2 or w % 2:
        raise ValueError(f"image_ids: latent height and width must be even; got {h}x{w}")
    rows, cols = np.meshgrid(np.arange(h // 2), np.arange(w // 2), indexing="ij")
    return np.stack([np.zeros_like(rows), rows, cols], axis=-1).reshape(-1, 3).astype(np.float32)


def text_ids(n: int) -> np.ndarray:
    """The text tokens' positions as `FluxPipeline.encode_prompt` makes them: `(n, 3)` float32 zeros."""
    return np.zeros((n, 3), np.float32)


# ---------------------------------------------------------------------------------------------- rotary
def flux_pos_embed(ids_n3: jax.Array, axes_dims: tuple[int, ...], theta: float = ROPE_THETA):
    """diffusers `FluxPosEmbed`: positions `(N, n_axes)` -> `(cos, sin)`, each `(N, sum(axes_dims) / 2)` float32.

    Axis i contributes `axes_dims[i] / 2` frequencies `theta ** (-2k / axes_dims[i])`. diffusers repeats each
    column twice (`repeat_interleave_real`) to the full head width; `apply_rope` uses the half tables directly.
    """
    if ids_n3.ndim != 2 or ids_n3.shape[-1] != len(axes_dims):
        raise ValueError(f"flux_pos_embed: ids must be (N, {len(axes_dims)}); got shape {ids_n3.shape}")
    freqs = [1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d) for d in axes_dims]
    axis = np.concatenate([np.full(d // 2, i) for i, d in enumerate(axes_dims)])
    angles = ids_n3.astype(jnp.float32)[:, axis] * jnp.asarray(np.concatenate(freqs), jnp.float32)
    # Materialized once: without the barrier XLA fuses cos and sin into every block's rotation of q and of k and
    # evaluates them again per element there (24 times per call for 12 blocks, per head and per channel pair).
    return jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))


def apply_rope(x_bshd: jax.Array, rope) -> jax.Array:
    """diffusers `apply_rotary_emb(use_real=True, use_real_unbind_dim=-1)`: channels (2k, 2k+1) of each head are
    the (real, imaginary) parts of one complex number, rotated by the angle of table column k. Float32 out."""
    cos_sk, sin_sk = rope
    b, s, h, d = x_bshd.shape
    x = x_bshd.astype(jnp.float32).reshape(b, s, h, d // 2, 2)
    re, im = x[..., 0], x[..., 1]
    cos, sin = cos_sk[None, :, None, :], sin_sk[None, :, None, :]
    return jnp.stack([re * cos - im * sin, im * cos + re * sin], axis=-1).reshape(b, s, h, d)


# ---------------------------------------------------------------------------------------------- norms
def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`nn.LayerNorm(elementwise_affine=False, eps)` over the last axis, float32 in and out."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


def modulate(x_bld: jax.Array, shift_bd: jax.Array, scale_bd: jax.Array) -> jax.Array:
    """`x * (1 + scale) + shift` per sample (adaLN), float32."""
    return x_bld * (1.0 + scale_bd[:, None, :]) + shift_bd[:, None, :]


class RMSNorm(nn.Module):
    """`torch.nn.RMSNorm(dim, eps)` over the last axis with param `scale` (the PyTorch `weight`); float32 out."""

    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x = x.astype(jnp.float32)
        return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon) * scale


class AdaLayerNormZero(nn.Module):
    """diffusers `AdaLayerNormZero` (`chunks=6`) and `AdaLayerNormZeroSingle` (`chunks=3`): `linear(silu(temb))`
    split into (shift, scale, *rest); returns `(modulate(layer_norm(x), shift, scale), rest)`, all float32.
    `rest` is (gate_msa, shift_mlp, scale_mlp, gate_mlp), or (gate,) for the single-stream block."""

    chunks: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array, temb_bd: jax.Array):
        dim = x_bld.shape[-1]
        emb = nn.Dense(self.chunks * dim, dtype=self.dtype, name="linear")(jax.nn.silu(temb_bd))
        shift, scale, *rest = jnp.split(emb.astype(jnp.float32), self.chunks, axis=-1)
        return modulate(layer_norm(x_bld), shift, scale), rest


class AdaLayerNormContinuous(nn.Module):
    """diffusers `AdaLayerNormContinuous(elementwise_affine=False, eps=1e-6)`: `linear(silu(temb))` split into
    (scale, shift): note the order, the reverse of AdaLayerNormZero's. Float32 out."""

    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array, temb_bd: jax.Array) -> jax.Array:
        emb = nn.Dense(2 * x_bld.shape[-1], dtype=self.dtype, name="linear")(jax.nn.silu(temb_bd))
        scale, shift = jnp.split(emb.astype(jnp.float32), 2, axis=-1)
        return modulate(layer_norm(x_bld), shift, scale)


# ---------------------------------------------------------------------------------------------- blocks
def _gelu_tanh(x: jax.Array) -> jax.Array:
    """`nn.GELU(approximate="tanh")`, computed in float32."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


class GELU(nn.Module):
    """diffusers `GELU(approximate="tanh")`: `proj`, then the tanh GELU."""

    features: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _gelu_tanh(nn.Dense(self.features, dtype=self.dtype, name="proj")(x))


class FeedForward(nn.Module):
    """diffusers `FeedForward(activation_fn="gelu-approximate")`: `net_0` (GELU to 4 * dim), `net_2` (Linear)."""

    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dim = x.shape[-1]
        return nn.Dense(dim, dtype=self.dtype, name="net_2")(GELU(4 * dim, dtype=self.dtype, name="net_0")(x))


class FluxAttention(nn.Module):
    """diffusers `FluxAttention` with `FluxAttnProcessor`: per-head RMSNorm (eps 1e-6) on q and k, the rotary
    embedding on both, softmax attention, all with biases.

    `joint` (double-stream blocks): the text tokens `context` get their own projections (`add_q_proj`,
    `add_k_proj`, `add_v_proj`, norms `norm_added_q/k`), the attention runs over [text, image] and the two parts
    go out through `to_out_0` (image) and `to_add_out` (text): returns `(image, text)`. Otherwise (single-stream
    blocks, diffusers `pre_only`) the tokens are already [text, image] and the attention output is returned as
    is, `(B, S, H*D)`, without an output projection.
    """

    heads: int
    dim_head: int
    joint: bool
    implementation: str = "auto"
    dtype: Dtype = jnp.float32

    def _qkv(self, x_bsc, names: tuple[str, str, str], norms: tuple[str, str]):
        """Project -> q, k float32 `(B, S, H, D)` after their RMSNorm; v `(B, S, H*D)` in `dtype`."""
        inner = self.heads * self.dim_head
        q, k, v = (nn.Dense(inner, dtype=self.dtype, name=n)(x_bsc) for n in names)
        b, s, _ = x_bsc.shape
        q, k = (RMSNorm(1e-6, name=n)(t.reshape(b, s, self.heads, self.dim_head)) for t, n in zip((q, k), norms))
        return q, k, v

    @nn.compact
    def __call__(self, x_bld: jax.Array, rope, context_btd: jax.Array | None = None):
        q, k, v = self._qkv(x_bld, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
        if self.joint:
            cq, ck, cv = self._qkv(
                context_btd, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k")
            )
            q, k, v = (jnp.concatenate([c, x], axis=1) for c, x in ((cq, q), (ck, k), (cv, v)))
        b, s = q.shape[:2]
        q, k = (apply_rope(t, rope).reshape(b, s, -1).astype(self.dtype) for t in (q, k))
        out = ops_attention.attention(q, k, v, heads=self.heads, implementation=self.implementation)
        if not self.joint:
            return out
        t, d = context_btd.shape[1], x_bld.shape[-1]
        image = nn.Dense(d, dtype=self.dtype, name="to_out_0")(out[:, t:])
        text = nn.Dense(d, dtype=self.dtype, name="to_add_out")(out[:, :t])
        return image, text


class FluxTransformerBlock(nn.Module):
    """diffusers `FluxTransformerBlock` (double stream): image `x` and text `ctx` (float32 residual streams) each
    through AdaLayerNormZero (`norm1`, `norm1_context`), one joint attention, gated residuals, then each through
    LayerNorm (eps 1e-6) modulated by its MLP shift/scale and a gated tanh-GELU MLP (`ff`, `ff_context`).
    Returns `(x, ctx)`."""

    heads: int
    dim_head: int
    attention: str = "auto"
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld, ctx_btd, temb_bd, rope):
        nx, (gate_msa, shift_mlp, scale_mlp, gate_mlp) = AdaLayerNormZero(6, self.dtype, name="norm1")(x_bld, temb_bd)
        nc, (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp) = AdaLayerNormZero(6, self.dtype, name="norm1_context")(
            ctx_btd, temb_bd
        )
        attn = FluxAttention(self.heads, self.dim_head, True, self.attention, self.dtype, name="attn")
        attn_x, attn_c = attn(nx.astype(self.dtype), rope, nc.astype(self.dtype))

        def mlp(h, attn_out, gate_attn, shift, scale, gate, name):
            h = h + gate_attn[:, None] * attn_out.astype(jnp.float32)
            ff = FeedForward(self.dtype, name=name)(modulate(layer_norm(h), shift, scale).astype(self.dtype))
            return h + gate[:, None] * ff.astype(jnp.float32)

        x_bld = mlp(x_bld, attn_x, gate_msa, shift_mlp, scale_mlp, gate_mlp, "ff")
        ctx_btd = mlp(ctx_btd, attn_c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp, "ff_context")
        return x_bld, ctx_btd


class FluxSingleTransformerBlock(nn.Module):
    """diffusers `FluxSingleTransformerBlock` on the [text, image] stream `h` (float32): AdaLayerNormZeroSingle
    (`norm`), then attention and the tanh-GELU MLP (`proj_mlp`, 4 * dim) side by side, `proj_out` over their
    concatenation, a gated residual."""

    heads: int
    dim_head: int
    attention: str = "auto"
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h_bsd, temb_bd, rope):
        dim = h_bsd.shape[-1]
        nh, (gate,) = AdaLayerNormZero(3, self.dtype, name="norm")(h_bsd, temb_bd)
        nh = nh.astype(self.dtype)
        mlp = _gelu_tanh(nn.Dense(4 * dim, dtype=self.dtype, name="proj_mlp")(nh))
        attn = FluxAttention(self.heads, self.dim_head, False, self.attention, self.dtype, name="attn")(nh, rope)
        out = nn.Dense(dim, dtype=self.dtype, name="proj_out")(jnp.concatenate([attn, mlp], axis=-1))
        return h_bsd + gate[:, None] * out.astype(jnp.float32)


class CombinedTimestepTextProjEmbeddings(nn.Module):
    """diffusers `CombinedTimestepTextProjEmbeddings` / (with `guidance`) `CombinedTimestepGuidanceTextProjEmbeddings`:
    `timestep_embedder(sinusoid(t))` [+ `guidance_embedder(sinusoid(g))`] + `text_embedder(pooled)`, float32.
    The sinusoids are 256 channels, cos first. `text_embedder` is diffusers' `PixArtAlphaTextProjection(act_fn=
    "silu")`: the same two Linears around a SiLU as `TimestepEmbedding`, so it is built as one."""

    dim: int
    guidance: bool
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, t_b, pooled_bp, g_b=None):
        def embed(x_b, name):
            proj = timestep_embedding(x_b, TIME_CHANNELS, flip_sin_to_cos=True, freq_shift=0)
            return TimestepEmbedding(self.dim, dtype=self.dtype, name=name)(proj).astype(jnp.float32)

        temb = embed(t_b, "timestep_embedder")
        if self.guidance:
            temb = temb + embed(g_b, "guidance_embedder")
        text = TimestepEmbedding(self.dim, dtype=self.dtype, name="text_embedder")(pooled_bp)
        return temb + text.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------- model
class FluxTransformer2DModel(nn.Module):
    """diffusers `FluxTransformer2DModel` (Flux.1 dev and schnell); see the module docstring.

    `__call__(hidden_states_bld, encoder_hidden_states_btd, pooled_projections_bd, timestep_b, img_ids_l3,
    txt_ids_t3, guidance_b=None) -> (B, L, output_channels)` in `dtype`:
    - `hidden_states_bld`: packed latents `(B, L, in_channels)` (`pack_latents`).
    - `encoder_hidden_states_btd`: T5 states `(B, T, joint_attention_dim)`; `pooled_projections_bd`: pooled CLIP
      `(B, pooled_projection_dim)`.
    - `timestep_b`: scalar or `(B,)`, as FluxPipeline passes it: the scheduler's timestep / 1000 (the sigma).
      `guidance_b` (only and always with `guidance_embeds`): the guidance scale itself (e.g. 3.5), undivided.
      Both are multiplied by 1000 inside, as diffusers does.
    - `img_ids_l3`, `txt_ids_t3`: positions `(L, 3)`, `(T, 3)` (`image_ids`, `text_ids`), shared by the batch;
      diffusers' deprecated batched `(B, N, 3)` ids are refused.
    - `controlnet_block_samples`, `controlnet_single_block_samples`: a ControlNet's outputs
      (`models.flux_controlnet`), each `(B, L, inner_dim)`, or None. After double block i the image stream gets
      sample `i // ceil(num_layers / len(samples))`, and after single block j the image tokens get single sample
      `j // ceil(num_single_layers / len(single samples))`, as diffusers (without its `controlnet_blocks_repeat`,
      which only nets with a pixel-space hint block use).

    Runtime options (never the numbers, beyond float rounding): `dtype` (compute dtype; see Precision above),
    `attention` (a `sdjax.ops.attention` implementation), `remat` (recompute each block in the backward pass,
    `jax.checkpoint`; param paths unchanged).
    """

    config: FluxTransformerConfig
    dtype: Dtype = jnp.float32
    attention: str = "auto"
    remat: bool = False

    def _check_samples(self, name: str, samples, x) -> tuple | None:
        """A ControlNet's samples as a tuple of `(B, L, inner_dim)` arrays (None or empty: None)."""
        if samples is None or len(samples) == 0:
            return None
        want = (*x.shape[:2], self.config.inner_dim)
        for k, s in enumerate(samples):
            if jnp.shape(s) != want:
                raise ValueError(f"FluxTransformer2DModel: {name}[{k}] must be {want}; got shape {jnp.shape(s)}")
        return tuple(samples)

    def _check_inputs(self, x, ctx, pooled, img_ids, txt_ids, guidance) -> None:
        cfg = self.config

        def check(ok: bool, name: str, want: str, arr) -> None:
            if not ok:
                raise ValueError(f"FluxTransformer2DModel: {name} must be {want}; got shape {jnp.shape(arr)}")

        check(x.ndim == 3 and x.shape[-1] == cfg.in_channels, "hidden_states", f"(B, L, {cfg.in_channels})", x)
        b, n = x.shape[:2]
        d = cfg.joint_attention_dim
        check(ctx.ndim == 3 and ctx.shape[::2] == (b, d), "encoder_hidden_states", f"(B={b}, T, {d})", ctx)
        p = cfg.pooled_projection_dim
        check(jnp.shape(pooled) == (b, p), "pooled_projections", f"(B={b}, {p})", pooled)
        a = len(cfg.axes_dims_rope)
        check(jnp.shape(img_ids) == (n, a), "img_ids", f"(L={n}, {a}), one row per image token", img_ids)
        check(jnp.shape(txt_ids) == (ctx.shape[1], a), "txt_ids", f"(T={ctx.shape[1]}, {a})", txt_ids)
        if cfg.guidance_embeds and guidance is None:
            raise ValueError("FluxTransformer2DModel: this model has guidance_embeds (Flux.1 dev): pass guidance_b")
        if not cfg.guidance_embeds and guidance is not None:
            raise ValueError("FluxTransformer2DModel: guidance_b given, but the config has no guidance_embeds")

    @nn.compact
    def __call__(
        self,
        hidden_states_bld,
        encoder_hidden_states_btd,
        pooled_projections_bd,
        timestep_b,
        img_ids_l3,
        txt_ids_t3,
        guidance_b=None,
        controlnet_block_samples=None,
        controlnet_single_block_samples=None,
    ):
        cfg = self.config
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"Flux: unknown attention {self.attention!r}; choose one of {ATTENTION_IMPLEMENTATIONS}")
        x, ctx, pooled = hidden_states_bld, encoder_hidden_states_btd, pooled_projections_bd
        self._check_inputs(x, ctx, pooled, img_ids_l3, txt_ids_t3, guidance_b)
        double_samples = self._check_samples("controlnet_block_samples", controlnet_block_samples, x)
        single_samples = self._check_samples("controlnet_single_block_samples", controlnet_single_block_samples, x)
        b, t = x.shape[0], ctx.shape[1]
        inner, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim

        def per_sample(v):
            return None if v is None else jnp.broadcast_to(jnp.asarray(v, jnp.float32), (b,)) * TIME_FACTOR

        temb = CombinedTimestepTextProjEmbeddings(inner, cfg.guidance_embeds, self.dtype, name="time_text_embed")(
            per_sample(timestep_b), pooled.astype(self.dtype), per_sample(guidance_b)
        )
        x = nn.Dense(inner, dtype=self.dtype, name="x_embedder")(x.astype(self.dtype)).astype(jnp.float32)
        ctx = nn.Dense(inner, dtype=self.dtype, name="context_embedder")(ctx.astype(self.dtype)).astype(jnp.float32)
        rope = flux_pos_embed(jnp.concatenate([txt_ids_t3, img_ids_l3], axis=0), cfg.axes_dims_rope)

        double = nn.remat(FluxTransformerBlock) if self.remat else FluxTransformerBlock
        single = nn.remat(FluxSingleTransformerBlock) if self.remat else FluxSingleTransformerBlock
        for i in range(cfg.num_layers):
            block = double(heads, head_dim, self.attention, self.dtype, name=f"transformer_blocks_{i}")
            x, ctx = block(x, ctx, temb, rope)
            if double_samples is not None:
                x = x + double_samples[i // _interval(cfg.num_layers, len(double_samples))].astype(jnp.float32)
        h = jnp.concatenate([ctx, x], axis=1)
        for i in range(cfg.num_single_layers):
            h = single(heads, head_dim, self.attention, self.dtype, name=f"single_transformer_blocks_{i}")(
                h, temb, rope
            )
            if single_samples is not None:
                sample = single_samples[i // _interval(cfg.num_single_layers, len(single_samples))]
                h = jnp.concatenate([h[:, :t], h[:, t:] + sample.astype(jnp.float32)], axis=1)
        x = AdaLayerNormContinuous(self.dtype, name="norm_out")(h[:, t:], temb)
        return nn.Dense(cfg.output_channels, dtype=self.dtype, name="proj_out")(x.astype(self.dtype))

    # ------------------------------------------------------------------ params
    @classmethod
    def init_params_shape(cls, config: FluxTransformerConfig) -> dict:
        """The params tree (`jax.ShapeDtypeStruct` leaves, float32) the model built from `config` expects.

        Traced once per config (`jax.eval_shape`: nothing is allocated; Flux.1 dev is 11.9e9 parameters) and kept
        on disk for the next process (`shapes_cache`)."""
        return jax.tree_util.tree_map(lambda x: x, _init_params_shape(config))  # a fresh tree per caller


def _interval(blocks: int, samples: int) -> int:
    """Blocks per ControlNet sample: diffusers' `int(np.ceil(blocks / samples))` (the last samples may go unused)."""
    return max(1, -(-blocks // samples))


@functools.lru_cache(maxsize=8)
def _init_params_shape(config: FluxTransformerConfig) -> dict:
    model = FluxTransformer2DModel(config)

    def init():
        x = jnp.zeros((1, 1, config.in_channels))
        ctx = jnp.zeros((1, 1, config.joint_attention_dim))
        pooled = jnp.zeros((1, config.pooled_projection_dim))
        ids = jnp.zeros((1, 3))
        guidance = jnp.zeros((1,)) if config.guidance_embeds else None
        return model.init(jax.random.key(0), x, ctx, pooled, jnp.zeros((1,)), ids, ids, guidance)["params"]

    return shapes_cache.cached(FluxTransformer2DModel, config, lambda: jax.eval_shape(init))


def init_params_shape(config: FluxTransformerConfig) -> dict:
    return FluxTransformer2DModel.init_params_shape(config)


# State-dict keys equal the param paths (after `name.N` -> `name_N`): no renames, no buffers to ignore.
FLUX_RENAMES: tuple[tuple[str, str], ...] = ()


def convert_flux_transformer(
    state_dict: Mapping[str, Any], config: FluxTransformerConfig, *, cast=None, component: str | None = None
) -> dict:
    """diffusers `FluxTransformer2DModel` state dict (name -> array) -> params; raises `WeightLoadError` naming
    every missing, unexpected and mis-shaped key (`component` names the source, default "transformer")."""
    return convert_state_dict(
        state_dict,
        init_params_shape(config),
        component=component or "transformer",
        renames=FLUX_RENAMES,
        cast=cast,
    )
