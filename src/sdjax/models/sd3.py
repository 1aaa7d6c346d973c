"""The Stable Diffusion 3 / 3.5 transformer (MMDiT): diffusers `SD3Transformer2DModel` in flax.linen.

Architecture (Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis"; SD 3.5's
MMDiT-X): the latent `(B, 16, h, w)` is cut into `patch_size` x `patch_size` patches by a strided convolution
(`pos_embed.proj`) and gets a fixed 2-D sinusoidal position table (`pos_embed.pos_embed`, a `pos_embed_max_size`^2
grid stored in the checkpoint, of which the centred `h/p x w/p` window is used: diffusers' `PatchEmbed` cropping).
The text states (CLIP-L + CLIP-G + T5, `joint_attention_dim` wide) go through `context_embedder`. `num_layers` joint
blocks (`JointTransformerBlock`) follow: each stream has its own AdaLayerNormZero, q/k/v projections and MLP, and
one attention runs over the concatenated [image, text] tokens. Variants, all from the config:
- `qk_norm="rms_norm"` (SD 3.5): a per-head RMSNorm (eps 1e-6, with weights) on q and k of both streams;
- `dual_attention_layers` (SD 3.5 medium): those blocks also run a self-attention over the image tokens alone
  (`attn2`), modulated by three more AdaLN chunks (`SD35AdaLayerNormZeroX`, 9 chunks instead of 6);
- the last block is "context pre-only": the text stream is only read (its norm is AdaLayerNormContinuous, there is
  no `to_add_out`, `ff_context`), since nothing uses the text tokens afterwards.
Every block is modulated by `temb`: the sinusoidal timestep (the scheduler's t in [0, 1000], not rescaled) through
an MLP plus the pooled CLIP embeddings through another (`time_text_embed`, the same modules as Flux's). The image
tokens then go through `norm_out` (AdaLayerNormContinuous) and `proj_out` and are folded back into patches.
`skip_layers` (skip-layer guidance, SD 3.5 medium) leaves the listed blocks out: both streams pass them unchanged.

Layout: tokens `(B, L, C)` row-major over patches; attention heads are the inner factor of the width (`(B, S, H*D)`,
reshaped to `(B, S, H, D)` only for the q/k RMSNorm); `sdjax.ops.attention.attention` does the attention. Each output
token is a patch in `(p, q, channel)` order (diffusers' `einsum("nhwpqc->nchpwq")`).

Precision: `dtype` is the compute dtype of every matmul (the Linears, the patch convolution, attention's q/k/v).
The residual streams, the LayerNorm/RMSNorm statistics, the modulation, the sinusoids, the position table, the GELUs
and the attention softmax stay float32; the timestep is never rounded to `dtype`.

Params mirror the diffusers state dict (`transformer_blocks_0/attn/add_q_proj/kernel`, `pos_embed/proj/kernel`,
`pos_embed/pos_embed`, `transformer_blocks_3/attn2/norm_q/scale`), so `convert_sd3_transformer` needs no rename
table. The shared MM-DiT pieces (AdaLN, the MLP, the timestep/text embedding, RMSNorm) are `models.flux`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import ConfigError, config_from_dict
from sdjax.models import shapes_cache
from sdjax.models.convert import convert_state_dict
from sdjax.models.flux import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    CombinedTimestepTextProjEmbeddings,
    FeedForward,
    RMSNorm,
    layer_norm,
    modulate,
)
from sdjax.models.layers import ATTENTION_IMPLEMENTATIONS
from sdjax.ops import attention as ops_attention

Dtype = Any

QK_NORMS = (None, "rms_norm")  # what the released models use (SD 3: none; SD 3.5: "rms_norm")
POS_EMBED_THETA = 10000.0  # diffusers `get_1d_sincos_pos_embed_from_grid`


# ---------------------------------------------------------------------------------------------- config
def check_mmdit_config(config: Any, *, joint: bool = True) -> None:
    """What a transformer config and its ControlNet's (`models.sd3_controlnet.SD3ControlNetConfig`) both require,
    raising `ConfigError` named after the config's class: a q/k norm in `QK_NORMS`; with `joint` (text blocks) a text
    stream as wide as the image stream; `dual_attention_layers` among the block indices; a positive or null
    `pos_embed_max_size`; a width divisible by 4 (the 2-D sinusoids split it in four). A `dual_attention_layers`
    list (JSON) becomes a tuple, since configs are jit-static and must hash."""
    if isinstance(config.dual_attention_layers, list):
        object.__setattr__(config, "dual_attention_layers", tuple(config.dual_attention_layers))
    name, width = type(config).__name__, config.inner_dim
    if config.qk_norm not in QK_NORMS:
        raise ConfigError(f"{name}: qk_norm={config.qk_norm!r} is not supported (choose one of {QK_NORMS})")
    if joint and config.caption_projection_dim != width:
        raise ConfigError(
            f"{name}: caption_projection_dim {config.caption_projection_dim} must equal num_attention_heads * "
            f"attention_head_dim = {width} (the text stream is as wide as the image stream)"
        )
    bad = [i for i in config.dual_attention_layers if not 0 <= i < config.num_layers]
    if bad:
        raise ConfigError(f"{name}: dual_attention_layers {bad} are not block indices below {config.num_layers}")
    if config.pos_embed_max_size is not None and config.pos_embed_max_size < 1:
        raise ConfigError(f"{name}: pos_embed_max_size must be a positive int or null, got {config.pos_embed_max_size}")
    if width % 4:
        raise ConfigError(f"{name}: the width {width} must be a multiple of 4 (2-D sinusoidal positions)")


@dataclasses.dataclass(frozen=True)
class SD3TransformerConfig:
    """The keys of a diffusers `SD3Transformer2DModel` `config.json`, with diffusers' defaults.

    SD 3 medium: 24 layers of 24 heads, no qk_norm, `pos_embed_max_size` 192; SD 3.5 medium: the same width,
    `dual_attention_layers` 0..12, qk_norm "rms_norm", 384; SD 3.5 large / large turbo: 38 layers of 38 heads,
    qk_norm "rms_norm", 192 (no `dual_attention_layers` key). `pos_embed_max_size` None means a table computed for
    the image (diffusers' non-persistent buffer; no released model uses it)."""

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16
    pos_embed_max_size: int | None = 96
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> SD3TransformerConfig:
        """Build from a parsed `config.json`; unknown keys raise `ConfigError` naming `source`."""
        return config_from_dict(cls, dict(raw), source=source)

    def __post_init__(self):
        check_mmdit_config(self)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        """Latent channels of the output: diffusers' `out_channels or in_channels`."""
        return self.out_channels if self.out_channels is not None else self.in_channels


# ---------------------------------------------------------------------------------------------- positions
def sincos_pos_embed(embed_dim: int, grid_h: int, grid_w: int, base_size: int) -> np.ndarray:
    """diffusers `get_2d_sincos_pos_embed(embed_dim, (grid_h, grid_w), base_size=base_size)`: `(grid_h * grid_w,
    embed_dim)` float32, row-major over the grid; the first half of the channels encode the column, the second the
    row (positions scaled by `base_size / grid`), each as [sin, cos] of `embed_dim / 4` frequencies."""
    rows = np.arange(grid_h, dtype=np.float32) / np.float32(grid_h / base_size)
    cols = np.arange(grid_w, dtype=np.float32) / np.float32(grid_w / base_size)
    omega = 1.0 / POS_EMBED_THETA ** (np.arange(embed_dim // 4, dtype=np.float64) / (embed_dim / 4.0))

    def one_axis(pos):
        out = np.outer(pos.astype(np.float64), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    col, row = np.meshgrid(cols, rows, indexing="xy")  # each (grid_h, grid_w)
    return np.concatenate([one_axis(col.reshape(-1)), one_axis(row.reshape(-1))], axis=1).astype(np.float32)


class PatchEmbed(nn.Module):
    """diffusers `PatchEmbed` as SD 3 configures it: `proj` (Conv p x p, stride p) -> tokens `(B, h/p * w/p, D)`
    float32, plus the position table: with `pos_embed_max_size` M the centred window of the stored M x M table
    (`pos_embed`, `(1, M*M, D)`), without it a table computed for this grid."""

    config: SD3TransformerConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bchw: jax.Array) -> jax.Array:
        cfg = self.config
        p, dim, m = cfg.patch_size, cfg.inner_dim, cfg.pos_embed_max_size
        b, _, h, w = x_bchw.shape
        gh, gw = h // p, w // p
        x = jnp.transpose(x_bchw.astype(self.dtype), (0, 2, 3, 1))
        x = nn.Conv(dim, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype, name="proj")(x)
        tokens = x.reshape(b, gh * gw, dim).astype(jnp.float32)
        if m is None:
            return tokens + jnp.asarray(sincos_pos_embed(dim, gh, gw, cfg.sample_size // p))[None]
        if gh > m or gw > m:
            raise ValueError(
                f"SD3Transformer2DModel: a {h}x{w} latent is {gh}x{gw} patches, more than pos_embed_max_size={m} "
                f"on a side (at most {m * p} latent pixels)"
            )
        table = self.param("pos_embed", nn.initializers.zeros, (1, m * m, dim), jnp.float32)
        top, left = (m - gh) // 2, (m - gw) // 2
        window = table.astype(jnp.float32).reshape(m, m, dim)[top : top + gh, left : left + gw]
        return tokens + window.reshape(1, gh * gw, dim)


# ---------------------------------------------------------------------------------------------- blocks
class SD35AdaLayerNormZeroX(nn.Module):
    """diffusers `SD35AdaLayerNormZeroX` (dual-attention blocks): `linear(silu(temb))` in 9 chunks (shift, scale,
    gate) x (attention, MLP, second attention). Returns `(modulated x, (gate_msa, shift_mlp, scale_mlp, gate_mlp),
    modulated x for attn2, gate_msa2)`, float32."""

    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array, temb_bd: jax.Array):
        emb = nn.Dense(9 * x_bld.shape[-1], dtype=self.dtype, name="linear")(jax.nn.silu(temb_bd))
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp, shift2, scale2, gate2 = jnp.split(
            emb.astype(jnp.float32), 9, axis=-1
        )
        normed = layer_norm(x_bld)
        rest = (gate, shift_mlp, scale_mlp, gate_mlp)
        return modulate(normed, shift, scale), rest, modulate(normed, shift2, scale2), gate2


class JointAttention(nn.Module):
    """diffusers `Attention` with `JointAttnProcessor2_0`, all projections with biases.

    `context`: "joint" (the text tokens get their own `add_q_proj`/`add_k_proj`/`add_v_proj`, the attention runs over
    [image, text], the parts go out through `to_out_0` and `to_add_out`: returns `(image, text)`), "pre_only" (the
    same without `to_add_out`: returns `(image, None)`), or "none" (`attn2`: self-attention of the image tokens,
    returns the image part). With `qk_norm` "rms_norm", q and k of each stream get a per-head RMSNorm (`norm_q`,
    `norm_k`, `norm_added_q`, `norm_added_k`)."""

    heads: int
    dim_head: int
    qk_norm: str | None
    context: str = "joint"
    implementation: str = "auto"
    dtype: Dtype = jnp.float32

    def _qkv(self, x_bsc, names: tuple[str, str, str], norms: tuple[str, str]):
        inner = self.heads * self.dim_head
        q, k, v = (nn.Dense(inner, dtype=self.dtype, name=n)(x_bsc) for n in names)
        if self.qk_norm == "rms_norm":
            b, s, _ = x_bsc.shape

            def norm(t, name):
                t = RMSNorm(1e-6, name=name)(t.reshape(b, s, self.heads, self.dim_head))
                return t.reshape(b, s, inner).astype(self.dtype)

            q, k = norm(q, norms[0]), norm(k, norms[1])
        return q, k, v

    @nn.compact
    def __call__(self, x_bld: jax.Array, context_btd: jax.Array | None = None):
        q, k, v = self._qkv(x_bld, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
        n, d = x_bld.shape[1], x_bld.shape[-1]
        if self.context != "none":
            cq, ck, cv = self._qkv(
                context_btd, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k")
            )
            q, k, v = (jnp.concatenate([x, c], axis=1) for x, c in ((q, cq), (k, ck), (v, cv)))
        out = ops_attention.attention(q, k, v, heads=self.heads, implementation=self.implementation)
        image = nn.Dense(d, dtype=self.dtype, name="to_out_0")(out[:, :n])
        if self.context == "none":
            return image
        if self.context == "pre_only":
            return image, None
        return image, nn.Dense(d, dtype=self.dtype, name="to_add_out")(out[:, n:])


class JointTransformerBlock(nn.Module):
    """diffusers `JointTransformerBlock`: image `x` and text `ctx` (float32 residual streams) through their AdaLN
    (`norm1`, `norm1_context`), one joint attention with gated residuals, [the dual block's `attn2` on the image],
    then each stream's LayerNorm (eps 1e-6) modulated by its MLP shift/scale and a gated tanh-GELU MLP (`ff`,
    `ff_context`). A context pre-only block (the last) returns `(x, None)`."""

    heads: int
    dim_head: int
    qk_norm: str | None
    context_pre_only: bool = False
    dual: bool = False
    attention: str = "auto"
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld, ctx_btd, temb_bd):
        if self.dual:
            nx, (gate_msa, shift_mlp, scale_mlp, gate_mlp), nx2, gate_msa2 = SD35AdaLayerNormZeroX(
                self.dtype, name="norm1"
            )(x_bld, temb_bd)
        else:
            nx, (gate_msa, shift_mlp, scale_mlp, gate_mlp) = AdaLayerNormZero(6, self.dtype, name="norm1")(
                x_bld, temb_bd
            )
        if self.context_pre_only:
            nc = AdaLayerNormContinuous(self.dtype, name="norm1_context")(ctx_btd, temb_bd)
        else:
            nc, c_mod = AdaLayerNormZero(6, self.dtype, name="norm1_context")(ctx_btd, temb_bd)
        context = "pre_only" if self.context_pre_only else "joint"
        attn = JointAttention(self.heads, self.dim_head, self.qk_norm, context, self.attention, self.dtype, name="attn")
        attn_x, attn_c = attn(nx.astype(self.dtype), nc.astype(self.dtype))
        x_bld = x_bld + gate_msa[:, None] * attn_x.astype(jnp.float32)
        if self.dual:
            attn2 = JointAttention(
                self.heads, self.dim_head, self.qk_norm, "none", self.attention, self.dtype, name="attn2"
            )
            x_bld = x_bld + gate_msa2[:, None] * attn2(nx2.astype(self.dtype)).astype(jnp.float32)

        def mlp(h, shift, scale, gate, name):
            ff = FeedForward(self.dtype, name=name)(modulate(layer_norm(h), shift, scale).astype(self.dtype))
            return h + gate[:, None] * ff.astype(jnp.float32)

        x_bld = mlp(x_bld, shift_mlp, scale_mlp, gate_mlp, "ff")
        if self.context_pre_only:
            return x_bld, None
        c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = c_mod
        ctx_btd = ctx_btd + c_gate_msa[:, None] * attn_c.astype(jnp.float32)
        return x_bld, mlp(ctx_btd, c_shift_mlp, c_scale_mlp, c_gate_mlp, "ff_context")


# ---------------------------------------------------------------------------------------------- model
def check_skip_layers(skip_layers: Iterable[int], num_layers: int) -> frozenset[int]:
    """`skip_layers` as a set of block indices; a non-int or an index outside `[0, num_layers)` raises."""
    out = set()
    for i in skip_layers:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < num_layers:
            raise ValueError(f"skip_layers: {i!r} is not a block index in [0, {num_layers})")
        out.add(int(i))
    return frozenset(out)


def controlnet_sample_index(block: int, num_layers: int, num_samples: int) -> int:
    """Which of `num_samples` ControlNet block samples transformer block `block` adds: diffusers'
    `int(index_block / interval_control)` with `interval_control = num_layers / num_samples`, in Python floats."""
    return int(block / (num_layers / num_samples))


class SD3Transformer2DModel(nn.Module):
    """diffusers `SD3Transformer2DModel` (SD 3 medium, SD 3.5 medium / large / large turbo); see the module
    docstring.

    `__call__(hidden_states_bchw, encoder_hidden_states_btd, pooled_projections_bd, timestep_b, skip_layers=())
    -> (B, output_channels, H, W)` in `dtype`:
    - `hidden_states_bchw`: latents `(B, in_channels, H, W)`, H and W multiples of `patch_size`;
    - `encoder_hidden_states_btd`: text states `(B, T, joint_attention_dim)`; `pooled_projections_bd`: pooled CLIP
      embeddings `(B, pooled_projection_dim)`;
    - `timestep_b`: scalar or `(B,)`, as StableDiffusion3Pipeline passes it: the scheduler's t in [0, 1000];
    - `skip_layers`: block indices to leave out (diffusers' `skip_layers`; static: a Python tuple, not traced);
    - `controlnet_block_samples`: a ControlNet's outputs (`models.sd3_controlnet`), each `(B, tokens, inner_dim)`,
      added to the image stream after every block but the last (`controlnet_sample_index`), or None.

    Runtime options (never the numbers, beyond float rounding): `dtype` (compute dtype; see Precision above),
    `attention` (a `sdjax.ops.attention` implementation), `remat` (recompute each block in the backward pass,
    `jax.checkpoint`; param paths unchanged).
    """

    config: SD3TransformerConfig
    dtype: Dtype = jnp.float32
    attention: str = "auto"
    remat: bool = False

    def _check_inputs(self, x, ctx, pooled, samples=()) -> None:
        cfg = self.config

        def check(ok: bool, name: str, want: str, arr) -> None:
            if not ok:
                raise ValueError(f"SD3Transformer2DModel: {name} must be {want}; got shape {jnp.shape(arr)}")

        p = cfg.patch_size
        ok = x.ndim == 4 and x.shape[1] == cfg.in_channels and x.shape[2] % p == 0 and x.shape[3] % p == 0
        check(ok, "hidden_states", f"(B, {cfg.in_channels}, H, W) with H, W multiples of {p}", x)
        b, d = x.shape[0], cfg.joint_attention_dim
        check(ctx.ndim == 3 and ctx.shape[::2] == (b, d), "encoder_hidden_states", f"(B={b}, T, {d})", ctx)
        check(jnp.shape(pooled) == (b, cfg.pooled_projection_dim), "pooled_projections", f"(B={b}, P)", pooled)
        tokens = (b, (x.shape[2] // p) * (x.shape[3] // p), cfg.inner_dim)
        for k, s in enumerate(samples):
            check(jnp.shape(s) == tokens, f"controlnet_block_samples[{k}]", f"{tokens} (tokens of the latents)", s)

    @nn.compact
    def __call__(
        self,
        hidden_states_bchw,
        encoder_hidden_states_btd,
        pooled_projections_bd,
        timestep_b,
        skip_layers: Iterable[int] = (),
        controlnet_block_samples: Sequence[jax.Array] | None = None,
    ):
        cfg = self.config
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"SD3: unknown attention {self.attention!r}; choose one of {ATTENTION_IMPLEMENTATIONS}")
        x, ctx, pooled = hidden_states_bchw, encoder_hidden_states_btd, pooled_projections_bd
        samples = tuple(controlnet_block_samples or ())
        self._check_inputs(x, ctx, pooled, samples)
        skip = check_skip_layers(skip_layers, cfg.num_layers)
        b, _, h, w = x.shape
        p, inner = cfg.patch_size, cfg.inner_dim

        t = jnp.broadcast_to(jnp.asarray(timestep_b, jnp.float32), (b,))
        temb = CombinedTimestepTextProjEmbeddings(inner, False, self.dtype, name="time_text_embed")(
            t, pooled.astype(self.dtype)
        )
        x = PatchEmbed(cfg, self.dtype, name="pos_embed")(x)
        ctx = nn.Dense(cfg.caption_projection_dim, dtype=self.dtype, name="context_embedder")(ctx.astype(self.dtype))
        ctx = ctx.astype(jnp.float32)

        block_cls = nn.remat(JointTransformerBlock) if self.remat else JointTransformerBlock
        for i in range(cfg.num_layers):
            if i not in skip:
                block = block_cls(
                    cfg.num_attention_heads,
                    cfg.attention_head_dim,
                    cfg.qk_norm,
                    context_pre_only=i == cfg.num_layers - 1,
                    dual=i in cfg.dual_attention_layers,
                    attention=self.attention,
                    dtype=self.dtype,
                    name=f"transformer_blocks_{i}",
                )
                x, ctx = block(x, ctx, temb)
            if samples and i != cfg.num_layers - 1:  # a ControlNet's residual, skipped block or not (diffusers)
                x = x + samples[controlnet_sample_index(i, cfg.num_layers, len(samples))].astype(jnp.float32)

        x = AdaLayerNormContinuous(self.dtype, name="norm_out")(x, temb)
        c = cfg.output_channels
        out = nn.Dense(p * p * c, dtype=self.dtype, name="proj_out")(x.astype(self.dtype))
        out = out.reshape(b, h // p, w // p, p, p, c)
        return jnp.einsum("nhwpqc->nchpwq", out).reshape(b, c, h, w)

    # ------------------------------------------------------------------ params
    @classmethod
    def init_params_shape(cls, config: SD3TransformerConfig) -> dict:
        """The params tree (`jax.ShapeDtypeStruct` leaves, float32) the model built from `config` expects.

        Traced once per config (`jax.eval_shape`: nothing is allocated; SD 3.5 large is 8.1e9 parameters, 0.09e9
        of them the position table) and kept on disk for the next process (`shapes_cache`)."""
        return jax.tree_util.tree_map(lambda x: x, _init_params_shape(config))  # a fresh tree per caller


@functools.lru_cache(maxsize=8)
def _init_params_shape(config: SD3TransformerConfig) -> dict:
    model = SD3Transformer2DModel(config)

    def init():
        p = config.patch_size
        x = jnp.zeros((1, config.in_channels, p, p))
        ctx = jnp.zeros((1, 1, config.joint_attention_dim))
        pooled = jnp.zeros((1, config.pooled_projection_dim))
        return model.init(jax.random.key(0), x, ctx, pooled, jnp.zeros((1,)))["params"]

    return shapes_cache.cached(SD3Transformer2DModel, config, lambda: jax.eval_shape(init))


def init_params_shape(config: SD3TransformerConfig) -> dict:
    return SD3Transformer2DModel.init_params_shape(config)


# State-dict keys equal the param paths (after `name.N` -> `name_N`): no renames. The position table
# `pos_embed.pos_embed` is a persistent buffer in diffusers (with `pos_embed_max_size`) and a param here.
SD3_RENAMES: tuple[tuple[str, str], ...] = ()


def convert_sd3_transformer(
    state_dict: Mapping[str, Any], config: SD3TransformerConfig, *, cast=None, component: str | None = None
) -> dict:
    """diffusers `SD3Transformer2DModel` state dict (name -> array) -> params; raises `WeightLoadError` naming
    every missing, unexpected and mis-shaped key (`component` names the source, default "transformer")."""
    return convert_state_dict(
        state_dict,
        init_params_shape(config),
        component=component or "transformer",
        renames=SD3_RENAMES,
        cast=cast,
    )
