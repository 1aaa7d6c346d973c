"""The Stable Diffusion UNet (SD 1.x, 2.x, XL, LCM): diffusers `UNet2DConditionModel` in flax.linen.

Architecture (Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion Models"; SDXL:
Podell et al. 2023): conv_in -> down blocks (ResNet blocks, optional spatial transformers, stride-2 conv) ->
mid block (ResNet, transformer, ResNet) -> up blocks (skip connections concatenated, nearest upsampling) ->
GroupNorm, act, conv_out. The timestep enters as a sinusoidal embedding through `time_embedding`; SDXL adds
the pooled text embedding and the micro-conditioning numbers (six for the base model, five for the refiner)
through `add_embedding`.

The encoder half (time embedding, `conv_in`, down blocks, mid block) is shared with `models.controlnet`, which
is a copy of it: `EncoderConfig`, `validate_encoder`, `embed_time`, `encode` and `middle` below build it inside
the calling module, under the same param names. The UNet takes a ControlNet's residuals
(`down_block_additional_residuals`, `mid_block_additional_residual`) and adds them to the skip connections and
the mid-block output, as diffusers does.

Layout: `UNet2DConditionModel.__call__` takes latents NCHW `(B, C, h, w)` and returns NCHW, like diffusers
(and its old Flax port); inside everything is NHWC (the conversion lives in `layers.nchw_to_nhwc`).

Params mirror the diffusers state dict (`down_blocks_0/attentions_0/transformer_blocks_0/attn1/to_q/kernel`),
so `convert_unet` needs no rename table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sdjax.config import ConfigError, config_from_dict
from sdjax.models import shapes_cache
from sdjax.models.convert import convert_state_dict
from sdjax.models.layers import (
    ACTIVATIONS,
    ATTENTION_IMPLEMENTATIONS,
    Downsample2D,
    GroupNorm,
    ResnetBlock2D,
    TimestepEmbedding,
    Transformer2DModel,
    Upsample2D,
    activation,
    conv,
    nchw_to_nhwc,
    nhwc_to_nchw,
    timestep_embedding,
)

Dtype = Any

DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn", None)


class EncoderConfig:
    """Per-block values of the config keys the UNet's encoder half reads; shared by `UNet2DConditionConfig` and
    `models.controlnet.ControlNetConfig`, whose key sets overlap there."""

    def _per_block(self, value) -> tuple:
        return tuple(value) if isinstance(value, tuple) else (value,) * len(self.block_out_channels)

    @property
    def heads_per_block(self) -> tuple[int, ...]:
        """Attention head COUNT per down block (diffusers: `num_attention_heads or attention_head_dim`)."""
        heads = self.num_attention_heads if self.num_attention_heads is not None else self.attention_head_dim
        return self._per_block(heads)

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.block_out_channels[0]


@dataclasses.dataclass(frozen=True)
class UNet2DConditionConfig(EncoderConfig):
    """The keys of a diffusers `UNet2DConditionModel` `config.json`, with diffusers' defaults.

    Naming quirk kept from diffusers: when `num_attention_heads` is None, `attention_head_dim` is the number of
    attention HEADS per block (not their width); the head width is `channels // heads`.

    Keys that select architectures SD checkpoints never use raise when set to anything but their default
    (see `_UNSUPPORTED`). Keys with no effect on the block types built here are accepted and ignored, as
    diffusers ignores them for these blocks: `dropout` (inference only), `resnet_skip_time_act`,
    `resnet_out_scale_factor`, `cross_attention_norm`, `mid_block_only_cross_attention`,
    `addition_embed_type_num_heads`, `sample_size` (used by pipelines for the default image size).
    """

    sample_size: int | tuple[int, int] | None = None
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    )
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int | tuple[int, ...] = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1
    dropout: float = 0.0
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int | tuple[int, ...] = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    reverse_transformer_layers_per_block: tuple | None = None
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    dual_cross_attention: bool | None = False
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool | None = False
    resnet_time_scale_shift: str = "default"
    resnet_skip_time_act: bool = False
    resnet_out_scale_factor: float = 1.0
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None
    time_embedding_act_fn: str | None = None
    timestep_post_act: str | None = None
    time_cond_proj_dim: int | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    projection_class_embeddings_input_dim: int | None = None
    attention_type: str = "default"
    class_embeddings_concat: bool = False
    mid_block_only_cross_attention: bool | None = None
    cross_attention_norm: str | None = None
    addition_embed_type_num_heads: int = 64

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> UNet2DConditionConfig:
        """Build from a parsed `config.json`; unknown keys raise `ConfigError` naming `source`."""
        return config_from_dict(cls, dict(raw), source=source)

    def __post_init__(self):
        for f in dataclasses.fields(self):  # lists (from JSON or callers) -> tuples: configs are jit-static
            v = getattr(self, f.name)
            if isinstance(v, list):
                object.__setattr__(self, f.name, tuple(tuple(x) if isinstance(x, list) else x for x in v))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        name = type(self).__name__
        n = len(self.block_out_channels)
        if len(self.up_block_types) != n:
            raise ConfigError(
                f"{name}: up_block_types ({len(self.up_block_types)}) and block_out_channels ({n}) "
                f"must have the same length"
            )
        bad = [b for b in self.up_block_types if b not in UP_BLOCKS]
        if bad:
            raise ConfigError(f"{name}: up_block_types contains {bad}; supported: {list(UP_BLOCKS)}")
        if self.mid_block_type not in MID_BLOCKS:
            raise ConfigError(
                f"{name}: mid_block_type={self.mid_block_type!r} is not supported; supported: {list(MID_BLOCKS)}"
            )
        if self.conv_in_kernel % 2 == 0 or self.conv_out_kernel % 2 == 0:
            raise ConfigError(f"{name}: conv_in_kernel and conv_out_kernel must be odd")
        # Up block i mirrors down block n-1-i and uses its head count.
        attention_blocks = {n - 1 - i for i, b in enumerate(self.up_block_types) if b == "CrossAttnUpBlock2D"}
        validate_encoder(self, _UNSUPPORTED, attention_blocks)


# Architecture keys SD checkpoints leave at their defaults; any other value would be silently wrong here.
_UNSUPPORTED: dict[str, Any] = {
    "class_embed_type": None,
    "num_class_embeds": None,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "dual_cross_attention": False,
    "resnet_time_scale_shift": "default",
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "time_embedding_act_fn": None,
    "timestep_post_act": None,
    "attention_type": "default",
    "class_embeddings_concat": False,
    "reverse_transformer_layers_per_block": None,
}


def validate_encoder(cfg: EncoderConfig, unsupported: Mapping[str, Any], attention_blocks: set[int]) -> None:
    """Check the config keys of the encoder half (shared by the UNet and the ControlNet); `ConfigError` names
    the key. `unsupported`: key -> the only value sdjax builds. `attention_blocks`: indices of blocks whose head
    count is used outside the down blocks (the UNet's cross-attention up blocks; the mid block is added here)."""
    name = type(cfg).__name__
    for key, default in unsupported.items():
        value = getattr(cfg, key)
        if value != default and not (default is False and value is None):
            raise ConfigError(
                f"{name}: {key}={value!r} is not supported (only {default!r}); "
                f"sdjax builds the Stable Diffusion UNet family only"
            )
    n = len(cfg.block_out_channels)
    if len(cfg.down_block_types) != n:
        raise ConfigError(
            f"{name}: down_block_types ({len(cfg.down_block_types)}) and block_out_channels ({n}) "
            f"must have the same length"
        )
    bad = [b for b in cfg.down_block_types if b not in DOWN_BLOCKS]
    if bad:
        raise ConfigError(f"{name}: down_block_types contains {bad}; supported: {list(DOWN_BLOCKS)}")
    if cfg.addition_embed_type not in (None, "text_time"):
        raise ConfigError(
            f"{name}: addition_embed_type={cfg.addition_embed_type!r} is not supported (only None or 'text_time', SDXL)"
        )
    if cfg.addition_embed_type == "text_time":
        if cfg.addition_time_embed_dim is None or cfg.projection_class_embeddings_input_dim is None:
            raise ConfigError(
                f"{name}: addition_embed_type='text_time' needs addition_time_embed_dim and "
                f"projection_class_embeddings_input_dim"
            )
        if cfg.projection_class_embeddings_input_dim <= cfg.addition_time_embed_dim:
            raise ConfigError(
                f"{name}: projection_class_embeddings_input_dim ({cfg.projection_class_embeddings_input_dim}) must "
                f"exceed addition_time_embed_dim ({cfg.addition_time_embed_dim}): it is the pooled text width plus "
                f"addition_time_embed_dim per micro-conditioning number"
            )
    if cfg.act_fn not in ACTIVATIONS:
        raise ConfigError(f"{name}: act_fn={cfg.act_fn!r} unknown; known: {sorted(ACTIVATIONS)}")
    if cfg.norm_num_groups is None:
        raise ConfigError(f"{name}: norm_num_groups=None is not supported")
    for key in (
        "only_cross_attention",
        "layers_per_block",
        "cross_attention_dim",
        "transformer_layers_per_block",
        "attention_head_dim",
        "num_attention_heads",
    ):
        value = getattr(cfg, key)
        if isinstance(value, tuple) and len(value) != n:
            raise ConfigError(f"{name}: {key} has {len(value)} entries for {n} blocks")
    if isinstance(cfg.transformer_layers_per_block, tuple) and any(
        isinstance(x, tuple) for x in cfg.transformer_layers_per_block
    ):
        raise ConfigError(f"{name}: per-layer transformer_layers_per_block (asymmetric UNets) is not supported")
    heads = cfg.heads_per_block
    if any(h is None for h in heads):
        raise ConfigError(f"{name}: attention_head_dim (or num_attention_heads) must be set")
    # Heads matter only where there is attention: cross-attention down blocks, the mid block (the last block's
    # head count) and `attention_blocks`. diffusers' own test configs give a DownBlock2D fewer channels than heads.
    with_attention = {i for i, b in enumerate(cfg.down_block_types) if b == "CrossAttnDownBlock2D"}
    with_attention |= set(attention_blocks)
    if cfg.mid_block_type == "UNetMidBlock2DCrossAttn":
        with_attention.add(n - 1)
    for i, c in enumerate(cfg.block_out_channels):
        if c % cfg.norm_num_groups or (i in with_attention and c % heads[i]):
            raise ConfigError(
                f"{name}: block {i} has {c} channels, not divisible by its "
                f"{heads[i]} attention heads or {cfg.norm_num_groups} norm groups"
            )


# ---------------------------------------------------------------------------------------------- blocks
@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """How a block builds its `Transformer2DModel`s (architecture and runtime attention options)."""

    heads: int
    depth: int
    groups: int
    use_linear_projection: bool
    only_cross_attention: bool
    upcast: bool
    implementation: str
    split_head_dim: bool
    chunk_size: int
    dtype: Dtype

    def build(self, name: str) -> Transformer2DModel:
        return Transformer2DModel(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, name=name)


class DownBlock(nn.Module):
    """diffusers `CrossAttnDownBlock2D` (with `transformer`) or `DownBlock2D` (without): `num_layers` x
    (resnet[, transformer]), then an optional stride-2 downsampler. Returns the output and every skip."""

    out_channels: int
    num_layers: int
    add_downsample: bool
    downsample_padding: int
    groups: int
    eps: float
    act_fn: str
    transformer: TransformerSpec | None
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, temb, context):
        skips = []
        for i in range(self.num_layers):
            x = ResnetBlock2D(
                self.out_channels, self.groups, self.eps, self.act_fn, dtype=self.dtype, name=f"resnets_{i}"
            )(x, temb)
            if self.transformer is not None:
                x = self.transformer.build(f"attentions_{i}")(x, context)
            skips.append(x)
        if self.add_downsample:
            x = Downsample2D(self.out_channels, self.downsample_padding, dtype=self.dtype, name="downsamplers_0")(x)
            skips.append(x)
        return x, skips


class UpBlock(nn.Module):
    """diffusers `CrossAttnUpBlock2D` / `UpBlock2D`: per layer, concatenate the last skip on channels, resnet
    [, transformer]; then an optional nearest upsampler to `upsample_size` (the next skip's size)."""

    out_channels: int
    num_layers: int
    add_upsample: bool
    groups: int
    eps: float
    act_fn: str
    transformer: TransformerSpec | None
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, skips, temb, context, upsample_size=None):
        skips = list(skips)
        for i in range(self.num_layers):
            x = jnp.concatenate([x, skips.pop().astype(x.dtype)], axis=-1)
            x = ResnetBlock2D(
                self.out_channels, self.groups, self.eps, self.act_fn, dtype=self.dtype, name=f"resnets_{i}"
            )(x, temb)
            if self.transformer is not None:
                x = self.transformer.build(f"attentions_{i}")(x, context)
        if self.add_upsample:
            x = Upsample2D(self.out_channels, dtype=self.dtype, name="upsamplers_0")(x, upsample_size)
        return x


class MidBlock(nn.Module):
    """diffusers `UNetMidBlock2DCrossAttn`: resnet, transformer, resnet (ResNet outputs / `output_scale_factor`).
    Without `transformer`: diffusers `UNetMidBlock2D(num_layers=0, add_attention=False)`, one resnet (what the
    ControlNet builds for `mid_block_type="UNetMidBlock2D"`)."""

    groups: int
    eps: float
    act_fn: str
    output_scale_factor: float
    transformer: TransformerSpec | None
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, temb, context):
        c = x.shape[-1]

        def resnet(name):
            return ResnetBlock2D(
                c, self.groups, self.eps, self.act_fn, self.output_scale_factor, dtype=self.dtype, name=name
            )

        x = resnet("resnets_0")(x, temb)
        if self.transformer is None:
            return x
        x = self.transformer.build("attentions_0")(x, context)
        return resnet("resnets_1")(x, temb)


# ---------------------------------------------------------------------------------------------- encoder half
# Functions, not modules: they create their submodules (`time_embedding`, `add_embedding`, `down_blocks_i`,
# `mid_block`) in the module whose compact `__call__` calls them, so the UNet and the ControlNet share the code
# and both keep diffusers' top-level param names.


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Runtime attention choices of the calling model (they never change the numbers beyond float rounding)."""

    implementation: str = "auto"
    split_head_dim: bool = False
    chunk_size: int = 1024


def transformer_spec(
    cfg: EncoderConfig, i: int, depth: int, only_cross: bool, options: AttentionOptions, dtype: Dtype
) -> TransformerSpec:
    """The `Transformer2DModel` settings of block `i` (head count of down block `i`)."""
    return TransformerSpec(
        heads=cfg.heads_per_block[i],
        depth=depth,
        groups=cfg.norm_num_groups,
        use_linear_projection=bool(cfg.use_linear_projection),
        only_cross_attention=bool(only_cross),
        upcast=bool(cfg.upcast_attention),
        implementation=options.implementation,
        split_head_dim=options.split_head_dim,
        chunk_size=options.chunk_size,
        dtype=dtype,
    )


def embed_time(
    cfg: EncoderConfig,
    timesteps,
    batch: int,
    *,
    text_embeds=None,
    time_ids=None,
    timestep_cond=None,
    time_cond_proj_dim: int | None = None,
    dtype: Dtype = jnp.float32,
    owner: str = "UNet",
) -> jax.Array:
    """diffusers `time_proj` + `time_embedding` (+ SDXL's `add_time_proj` + `add_embedding`) -> `(B, 4 * C0)`.

    `timesteps`: scalar or `(B,)`. SDXL (`addition_embed_type="text_time"`): `text_embeds (B, P)` and
    `time_ids (B, N)`, N micro-conditioning numbers, each embedded with `addition_time_embed_dim` sinusoids, so
    `P + N * addition_time_embed_dim` must equal `projection_class_embeddings_input_dim` (N = 6 for the base
    model, 5 for the refiner). `owner` names the model in errors.
    """
    t = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32).reshape(-1), (batch,))
    t_emb = timestep_embedding(
        t, cfg.block_out_channels[0], flip_sin_to_cos=cfg.flip_sin_to_cos, freq_shift=cfg.freq_shift
    ).astype(dtype)
    if timestep_cond is not None:
        timestep_cond = timestep_cond.astype(dtype)
    emb = TimestepEmbedding(cfg.time_embed_dim, cfg.act_fn, time_cond_proj_dim, dtype=dtype, name="time_embedding")(
        t_emb, timestep_cond
    )
    if cfg.addition_embed_type != "text_time":
        return emb
    text_embeds, time_ids = jnp.asarray(text_embeds), jnp.asarray(time_ids)
    if text_embeds.ndim != 2 or time_ids.ndim != 2 or text_embeds.shape[0] != batch or time_ids.shape[0] != batch:
        raise ValueError(
            f"{owner}: text_embeds must be (B={batch}, P) and time_ids (B={batch}, N); "
            f"got {text_embeds.shape} and {time_ids.shape}"
        )
    width = text_embeds.shape[-1] + time_ids.shape[-1] * cfg.addition_time_embed_dim
    if width != cfg.projection_class_embeddings_input_dim:
        need = (cfg.projection_class_embeddings_input_dim - text_embeds.shape[-1]) / cfg.addition_time_embed_dim
        raise ValueError(
            f"{owner}: text_embeds width {text_embeds.shape[-1]} + {time_ids.shape[-1]} time_ids x "
            f"addition_time_embed_dim {cfg.addition_time_embed_dim} = {width} != "
            f"projection_class_embeddings_input_dim {cfg.projection_class_embeddings_input_dim} "
            f"(with this text_embeds width the model wants {need:g} time_ids: 6 for the SDXL base model, "
            f"5 for the refiner)"
        )
    time_embeds = timestep_embedding(
        time_ids.astype(jnp.float32).reshape(-1),
        cfg.addition_time_embed_dim,
        flip_sin_to_cos=cfg.flip_sin_to_cos,
        freq_shift=cfg.freq_shift,
    ).reshape(batch, -1)
    add_embeds = jnp.concatenate([text_embeds.astype(jnp.float32), time_embeds], axis=-1)
    return emb + TimestepEmbedding(cfg.time_embed_dim, "silu", dtype=dtype, name="add_embedding")(
        add_embeds.astype(dtype)
    )


def encode(
    cfg: EncoderConfig, x_nhwc, emb, context, options: AttentionOptions, dtype: Dtype
) -> tuple[jax.Array, list[jax.Array]]:
    """The down blocks `down_blocks_i` on the output of `conv_in` -> (last output, every skip connection NHWC).

    The skips are what diffusers calls `down_block_res_samples`: `conv_in`'s output, then each resnet[+attention]
    output and each downsampler output, in order.
    """
    n_blocks = len(cfg.block_out_channels)
    layers = cfg._per_block(cfg.layers_per_block)
    depths = cfg._per_block(cfg.transformer_layers_per_block)
    only_cross = cfg._per_block(cfg.only_cross_attention)
    skips = [x_nhwc]
    x = x_nhwc
    for i, kind in enumerate(cfg.down_block_types):
        spec = (
            transformer_spec(cfg, i, depths[i], only_cross[i], options, dtype)
            if kind == "CrossAttnDownBlock2D"
            else None
        )
        x, block_skips = DownBlock(
            cfg.block_out_channels[i],
            layers[i],
            i < n_blocks - 1,
            cfg.downsample_padding,
            groups=cfg.norm_num_groups,
            eps=cfg.norm_eps,
            act_fn=cfg.act_fn,
            transformer=spec,
            dtype=dtype,
            name=f"down_blocks_{i}",
        )(x, emb, context)
        skips += block_skips
    return x, skips


def middle(cfg: EncoderConfig, x_nhwc, emb, context, options: AttentionOptions, dtype: Dtype) -> jax.Array:
    """`mid_block` (`UNetMidBlock2DCrossAttn`, or `UNetMidBlock2D` without attention); identity when None."""
    if cfg.mid_block_type is None:
        return x_nhwc
    depth = cfg._per_block(cfg.transformer_layers_per_block)[-1]
    spec = (
        transformer_spec(cfg, len(cfg.block_out_channels) - 1, depth, False, options, dtype)
        if cfg.mid_block_type == "UNetMidBlock2DCrossAttn"
        else None
    )
    return MidBlock(
        groups=cfg.norm_num_groups,
        eps=cfg.norm_eps,
        act_fn=cfg.act_fn,
        output_scale_factor=cfg.mid_block_scale_factor,
        transformer=spec,
        dtype=dtype,
        name="mid_block",
    )(x_nhwc, emb, context)


# ---------------------------------------------------------------------------------------------- model
class UNet2DConditionModel(nn.Module):
    """diffusers `UNet2DConditionModel` for SD 1.x / 2.x / XL (and LCM's `time_cond_proj_dim`).

    `__call__(sample, timesteps, encoder_hidden_states, *, text_embeds=None, time_ids=None, timestep_cond=None,
    down_block_additional_residuals=None, mid_block_additional_residual=None)`
    - `sample`: latents NCHW `(B, in_channels, h, w)`; returns the prediction NCHW `(B, out_channels, h, w)`
      in `dtype`.
    - `timesteps`: scalar or `(B,)`, int or float (float32 inside).
    - `encoder_hidden_states`: `(B, S, cross_attention_dim)`.
    - SDXL (`addition_embed_type="text_time"`): `text_embeds (B, P)` (pooled text embedding of encoder 2) and
      `time_ids (B, N)`: N = 6 for the base model (orig_h, orig_w, crop_top, crop_left, target_h, target_w),
      N = 5 for the refiner (orig_h, orig_w, crop_top, crop_left, aesthetic_score); P + N *
      addition_time_embed_dim must equal projection_class_embeddings_input_dim. diffusers' `added_cond_kwargs` as
      explicit arguments.
    - LCM (`time_cond_proj_dim`): `timestep_cond (B, time_cond_proj_dim)` (guidance-scale embedding), optional.
    - ControlNet (`models.controlnet`): `down_block_additional_residuals`, a sequence of NCHW arrays, one per skip
      connection (`conv_in`, then every resnet and downsampler output of the down blocks), each added to its
      skip; `mid_block_additional_residual` (NCHW) added to the mid-block output. Both or neither; they
      broadcast (a `global_pool_conditions` ControlNet gives `(B, C, 1, 1)`).

    Runtime options (never the numbers, beyond float rounding): `dtype` (compute dtype; norms, softmax and
    sinusoids in float32), `attention` ("auto", "xla", "dot_product", "chunked"), `split_head_dim`,
    `attention_chunk_size` (queries per chunk for "chunked").
    """

    config: UNet2DConditionConfig
    dtype: Dtype = jnp.float32
    attention: str = "auto"
    split_head_dim: bool = False
    attention_chunk_size: int = 1024

    def _check_inputs(self, sample, encoder_hidden_states, text_embeds, time_ids, timestep_cond):
        cfg = self.config
        if sample.ndim != 4 or sample.shape[1] != cfg.in_channels:
            raise ValueError(f"UNet: sample must be NCHW (B, {cfg.in_channels}, h, w); got shape {sample.shape}")
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[0] != sample.shape[0]:
            raise ValueError(
                f"UNet: encoder_hidden_states must be (B={sample.shape[0]}, S, D); "
                f"got shape {encoder_hidden_states.shape}"
            )
        if isinstance(cfg.cross_attention_dim, int) and encoder_hidden_states.shape[-1] != cfg.cross_attention_dim:
            raise ValueError(
                f"UNet: encoder_hidden_states width {encoder_hidden_states.shape[-1]} != "
                f"cross_attention_dim {cfg.cross_attention_dim}"
            )
        if cfg.addition_embed_type == "text_time":
            if text_embeds is None or time_ids is None:
                raise ValueError(
                    "UNet: this SDXL UNet (addition_embed_type='text_time') needs text_embeds (B, P) "
                    "and time_ids (B, N) (N = 6 micro-conditioning numbers for the base model, 5 for the refiner)"
                )
        elif text_embeds is not None or time_ids is not None:
            raise ValueError("UNet: text_embeds/time_ids given, but the config has no addition_embed_type")
        if timestep_cond is not None and cfg.time_cond_proj_dim is None:
            raise ValueError("UNet: timestep_cond given, but the config has no time_cond_proj_dim")

    @staticmethod
    def _residuals_nhwc(skips, down_residuals, mid_residual):
        """Check the ControlNet residuals against the skips -> (down residuals NHWC, mid residual NHWC)."""
        if (down_residuals is None) != (mid_residual is None):
            raise ValueError(
                "UNet: pass both down_block_additional_residuals and mid_block_additional_residual (a ControlNet's "
                "two outputs) or neither"
            )
        down = list(down_residuals)
        if len(down) != len(skips):
            raise ValueError(
                f"UNet: down_block_additional_residuals has {len(down)} arrays; this UNet has {len(skips)} skip "
                f"connections (is the ControlNet built for this UNet?)"
            )

        def fits(r_nhwc, target_nhwc) -> bool:
            try:
                return jnp.broadcast_shapes(r_nhwc.shape, target_nhwc.shape) == target_nhwc.shape
            except ValueError:
                return False

        out = []
        for j, (r, skip) in enumerate(zip(down, skips)):
            r = nchw_to_nhwc(jnp.asarray(r)) if jnp.ndim(r) == 4 else None
            if r is None or not fits(r, skip):
                raise ValueError(
                    f"UNet: down_block_additional_residuals[{j}] has shape {jnp.shape(down[j])}; skip {j} is NCHW "
                    f"{nhwc_to_nchw(skip).shape}"
                )
            out.append(r)
        mid = jnp.asarray(mid_residual)
        if mid.ndim != 4:
            raise ValueError(f"UNet: mid_block_additional_residual must be NCHW; got shape {mid.shape}")
        return out, nchw_to_nhwc(mid)

    @nn.compact
    def __call__(
        self,
        sample,
        timesteps,
        encoder_hidden_states,
        *,
        text_embeds=None,
        time_ids=None,
        timestep_cond=None,
        down_block_additional_residuals=None,
        mid_block_additional_residual=None,
    ):
        cfg = self.config
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"UNet: unknown attention {self.attention!r}; choose one of {ATTENTION_IMPLEMENTATIONS}")
        self._check_inputs(sample, encoder_hidden_states, text_embeds, time_ids, timestep_cond)
        options = AttentionOptions(self.attention, self.split_head_dim, self.attention_chunk_size)
        n_blocks = len(cfg.block_out_channels)
        context = encoder_hidden_states.astype(self.dtype)
        x = nchw_to_nhwc(sample)
        if cfg.center_input_sample:
            x = 2 * x - 1.0

        emb = embed_time(
            cfg,
            timesteps,
            sample.shape[0],
            text_embeds=text_embeds,
            time_ids=time_ids,
            timestep_cond=timestep_cond,
            time_cond_proj_dim=cfg.time_cond_proj_dim,
            dtype=self.dtype,
        )
        x = conv(cfg.block_out_channels[0], cfg.conv_in_kernel, dtype=self.dtype, name="conv_in")(x.astype(self.dtype))
        x, skips = encode(cfg, x, emb, context, options, self.dtype)
        controlled = down_block_additional_residuals is not None or mid_block_additional_residual is not None
        if controlled:
            down, mid = self._residuals_nhwc(skips, down_block_additional_residuals, mid_block_additional_residual)
            skips = [s + r.astype(s.dtype) for s, r in zip(skips, down)]
        x = middle(cfg, x, emb, context, options, self.dtype)
        if controlled:
            x = x + mid.astype(x.dtype)

        layers = cfg._per_block(cfg.layers_per_block)
        depths = cfg._per_block(cfg.transformer_layers_per_block)
        only_cross = cfg._per_block(cfg.only_cross_attention)
        common = dict(groups=cfg.norm_num_groups, eps=cfg.norm_eps, act_fn=cfg.act_fn, dtype=self.dtype)
        for i, kind in enumerate(cfg.up_block_types):
            r = n_blocks - 1 - i  # the down block this up block mirrors
            n = layers[r] + 1
            block_skips, skips = skips[-n:], skips[:-n]
            final = i == n_blocks - 1
            spec = (
                transformer_spec(cfg, r, depths[r], only_cross[r], options, self.dtype)
                if kind == "CrossAttnUpBlock2D"
                else None
            )
            # Upsample to the next skip's size: 2x, except where a downsampler rounded an odd size up.
            size = None if final else tuple(skips[-1].shape[1:3])
            x = UpBlock(cfg.block_out_channels[r], n, not final, transformer=spec, name=f"up_blocks_{i}", **common)(
                x, block_skips, emb, context, size
            )

        x = GroupNorm(cfg.norm_num_groups, cfg.norm_eps, dtype=self.dtype, name="conv_norm_out")(x)
        x = activation(cfg.act_fn)(x)
        x = conv(cfg.out_channels, cfg.conv_out_kernel, dtype=self.dtype, name="conv_out")(x)
        return nhwc_to_nchw(x)

    # ------------------------------------------------------------------ params
    @staticmethod
    def init_params_shape(config: UNet2DConditionConfig) -> dict:
        """The params tree (`jax.ShapeDtypeStruct` leaves, float32) the model built from `config` expects.

        Traced once per config (`jax.eval_shape`: nothing is allocated; the full SDXL UNet takes ~15 s on CPU) and
        kept on disk for the next process (`shapes_cache`).
        """
        return jax.tree_util.tree_map(lambda x: x, _init_params_shape(config))  # a fresh tree per caller


@functools.lru_cache(maxsize=8)
def _init_params_shape(config: UNet2DConditionConfig) -> dict:
    model = UNet2DConditionModel(config)
    size = 2 ** (len(config.block_out_channels) - 1)
    ctx = config.cross_attention_dim if isinstance(config.cross_attention_dim, int) else config.cross_attention_dim[0]

    def init():
        kwargs = {}
        if config.addition_embed_type == "text_time":
            kwargs.update(added_conditioning_shapes(config))
        if config.time_cond_proj_dim is not None:  # cond_proj exists only when called with a condition
            kwargs["timestep_cond"] = jnp.zeros((1, config.time_cond_proj_dim))
        sample = jnp.zeros((1, config.in_channels, size, size))
        return model.init(jax.random.key(0), sample, jnp.zeros((1,)), jnp.zeros((1, 1, ctx)), **kwargs)["params"]

    return shapes_cache.cached(UNet2DConditionModel, config, lambda: jax.eval_shape(init))


def init_params_shape(config: UNet2DConditionConfig) -> dict:
    return UNet2DConditionModel.init_params_shape(config)


def added_conditioning_shapes(config: EncoderConfig) -> dict[str, jax.Array]:
    """Stand-in SDXL `text_embeds`/`time_ids` for tracing the params shapes: only their summed embedding width
    (`projection_class_embeddings_input_dim`) shapes a parameter, so one time id and the rest as pooled text
    width serve the base model (6 ids), the refiner (5) and any other split alike."""
    pooled = config.projection_class_embeddings_input_dim - config.addition_time_embed_dim
    return dict(text_embeds=jnp.zeros((1, pooled)), time_ids=jnp.zeros((1, 1)))


# State-dict keys equal the param paths (after `name.N` -> `name_N`): no renames, no buffers to ignore.
UNET_RENAMES: tuple[tuple[str, str], ...] = ()


def convert_unet(state_dict: Mapping[str, Any], config: UNet2DConditionConfig, *, cast=None) -> dict:
    """diffusers UNet state dict (name -> array) -> params; raises `WeightLoadError` naming every bad key."""
    return convert_state_dict(state_dict, init_params_shape(config), component="unet", renames=UNET_RENAMES, cast=cast)
