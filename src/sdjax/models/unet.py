"""The Stable Diffusion UNet (SD 1.x, 2.x, XL, LCM): diffusers `UNet2DConditionModel` in flax.linen.

Architecture (Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion Models"; SDXL:
Podell et al. 2023): conv_in -> down blocks (ResNet blocks, optional spatial transformers, stride-2 conv) ->
mid block (ResNet, transformer, ResNet) -> up blocks (skip connections concatenated, nearest upsampling) ->
GroupNorm, act, conv_out. The timestep enters as a sinusoidal embedding through `time_embedding`; SDXL adds
the pooled text embedding and the six micro-conditioning numbers through `add_embedding`.

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


@dataclasses.dataclass(frozen=True)
class UNet2DConditionConfig:
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
        for key, default in _UNSUPPORTED.items():
            value = getattr(self, key)
            if value != default and not (default is False and value is None):
                raise ConfigError(
                    f"UNet2DConditionConfig: {key}={value!r} is not supported (only {default!r}); "
                    f"sdjax builds the Stable Diffusion UNet family only"
                )
        n = len(self.block_out_channels)
        if len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise ConfigError(
                f"UNet2DConditionConfig: down_block_types ({len(self.down_block_types)}), "
                f"up_block_types ({len(self.up_block_types)}) and block_out_channels ({n}) "
                f"must have the same length"
            )
        for key, allowed in (("down_block_types", DOWN_BLOCKS), ("up_block_types", UP_BLOCKS)):
            bad = [b for b in getattr(self, key) if b not in allowed]
            if bad:
                raise ConfigError(f"UNet2DConditionConfig: {key} contains {bad}; supported: {list(allowed)}")
        if self.mid_block_type not in MID_BLOCKS:
            raise ConfigError(
                f"UNet2DConditionConfig: mid_block_type={self.mid_block_type!r} is not supported; "
                f"supported: {list(MID_BLOCKS)}"
            )
        if self.addition_embed_type not in (None, "text_time"):
            raise ConfigError(
                f"UNet2DConditionConfig: addition_embed_type={self.addition_embed_type!r} is not "
                f"supported (only None or 'text_time', SDXL)"
            )
        if self.addition_embed_type == "text_time" and (
            self.addition_time_embed_dim is None or self.projection_class_embeddings_input_dim is None
        ):
            raise ConfigError(
                "UNet2DConditionConfig: addition_embed_type='text_time' needs "
                "addition_time_embed_dim and projection_class_embeddings_input_dim"
            )
        if self.act_fn not in ACTIVATIONS:
            raise ConfigError(f"UNet2DConditionConfig: act_fn={self.act_fn!r} unknown; known: {sorted(ACTIVATIONS)}")
        if self.norm_num_groups is None:
            raise ConfigError("UNet2DConditionConfig: norm_num_groups=None is not supported")
        if self.conv_in_kernel % 2 == 0 or self.conv_out_kernel % 2 == 0:
            raise ConfigError("UNet2DConditionConfig: conv_in_kernel and conv_out_kernel must be odd")
        for key in (
            "only_cross_attention",
            "layers_per_block",
            "cross_attention_dim",
            "transformer_layers_per_block",
            "attention_head_dim",
            "num_attention_heads",
        ):
            value = getattr(self, key)
            if isinstance(value, tuple) and len(value) != n:
                raise ConfigError(f"UNet2DConditionConfig: {key} has {len(value)} entries for {n} blocks")
        if isinstance(self.transformer_layers_per_block, tuple) and any(
            isinstance(x, tuple) for x in self.transformer_layers_per_block
        ):
            raise ConfigError(
                "UNet2DConditionConfig: per-layer transformer_layers_per_block (asymmetric UNets) is not supported"
            )
        heads = self.heads_per_block
        if any(h is None for h in heads):
            raise ConfigError("UNet2DConditionConfig: attention_head_dim (or num_attention_heads) must be set")
        for i, (c, h) in enumerate(zip(self.block_out_channels, heads)):
            if c % h or c % self.norm_num_groups:
                raise ConfigError(
                    f"UNet2DConditionConfig: block {i} has {c} channels, not divisible by its "
                    f"{h} attention heads or {self.norm_num_groups} norm groups"
                )

    # ------------------------------------------------------------------ per-block values
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
    """diffusers `UNetMidBlock2DCrossAttn`: resnet, transformer, resnet (ResNet outputs / `output_scale_factor`)."""

    groups: int
    eps: float
    act_fn: str
    output_scale_factor: float
    transformer: TransformerSpec
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, temb, context):
        c = x.shape[-1]

        def resnet(name):
            return ResnetBlock2D(
                c, self.groups, self.eps, self.act_fn, self.output_scale_factor, dtype=self.dtype, name=name
            )

        x = resnet("resnets_0")(x, temb)
        x = self.transformer.build("attentions_0")(x, context)
        return resnet("resnets_1")(x, temb)


# ---------------------------------------------------------------------------------------------- model
class UNet2DConditionModel(nn.Module):
    """diffusers `UNet2DConditionModel` for SD 1.x / 2.x / XL (and LCM's `time_cond_proj_dim`).

    `__call__(sample, timesteps, encoder_hidden_states, *, text_embeds=None, time_ids=None, timestep_cond=None)`
    - `sample`: latents NCHW `(B, in_channels, h, w)`; returns the prediction NCHW `(B, out_channels, h, w)`
      in `dtype`.
    - `timesteps`: scalar or `(B,)`, int or float (float32 inside).
    - `encoder_hidden_states`: `(B, S, cross_attention_dim)`.
    - SDXL (`addition_embed_type="text_time"`): `text_embeds (B, projection_dim)` (pooled text embedding of
      encoder 2) and `time_ids (B, 6)` = (orig_h, orig_w, crop_top, crop_left, target_h, target_w);
      diffusers' `added_cond_kwargs` as explicit arguments.
    - LCM (`time_cond_proj_dim`): `timestep_cond (B, time_cond_proj_dim)` (guidance-scale embedding), optional.

    Runtime options (never the numbers, beyond float rounding): `dtype` (compute dtype; norms, softmax and
    sinusoids in float32), `attention` ("auto", "xla", "dot_product", "chunked"), `split_head_dim`,
    `attention_chunk_size` (queries per chunk for "chunked").
    """

    config: UNet2DConditionConfig
    dtype: Dtype = jnp.float32
    attention: str = "auto"
    split_head_dim: bool = False
    attention_chunk_size: int = 1024

    def _transformer(self, i: int, depth: int, only_cross: bool) -> TransformerSpec:
        cfg = self.config
        return TransformerSpec(
            heads=cfg.heads_per_block[i],
            depth=depth,
            groups=cfg.norm_num_groups,
            use_linear_projection=bool(cfg.use_linear_projection),
            only_cross_attention=bool(only_cross),
            upcast=bool(cfg.upcast_attention),
            implementation=self.attention,
            split_head_dim=self.split_head_dim,
            chunk_size=self.attention_chunk_size,
            dtype=self.dtype,
        )

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
                    "UNet: this SDXL UNet (addition_embed_type='text_time') needs text_embeds (B, D) "
                    "and time_ids (B, 6)"
                )
        elif text_embeds is not None or time_ids is not None:
            raise ValueError("UNet: text_embeds/time_ids given, but the config has no addition_embed_type")
        if timestep_cond is not None and cfg.time_cond_proj_dim is None:
            raise ValueError("UNet: timestep_cond given, but the config has no time_cond_proj_dim")

    @nn.compact
    def __call__(
        self, sample, timesteps, encoder_hidden_states, *, text_embeds=None, time_ids=None, timestep_cond=None
    ):
        cfg = self.config
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"UNet: unknown attention {self.attention!r}; choose one of {ATTENTION_IMPLEMENTATIONS}")
        self._check_inputs(sample, encoder_hidden_states, text_embeds, time_ids, timestep_cond)
        n_blocks = len(cfg.block_out_channels)
        batch = sample.shape[0]
        context = encoder_hidden_states.astype(self.dtype)
        x = nchw_to_nhwc(sample)
        if cfg.center_input_sample:
            x = 2 * x - 1.0

        # time (and SDXL's added) embedding
        t = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32).reshape(-1), (batch,))
        t_emb = timestep_embedding(
            t, cfg.block_out_channels[0], flip_sin_to_cos=cfg.flip_sin_to_cos, freq_shift=cfg.freq_shift
        ).astype(self.dtype)
        if timestep_cond is not None:
            timestep_cond = timestep_cond.astype(self.dtype)
        emb = TimestepEmbedding(
            cfg.time_embed_dim, cfg.act_fn, cfg.time_cond_proj_dim, dtype=self.dtype, name="time_embedding"
        )(t_emb, timestep_cond)
        if cfg.addition_embed_type == "text_time":
            time_embeds = timestep_embedding(
                jnp.asarray(time_ids, jnp.float32).reshape(-1),
                cfg.addition_time_embed_dim,
                flip_sin_to_cos=cfg.flip_sin_to_cos,
                freq_shift=cfg.freq_shift,
            ).reshape(batch, -1)
            add_embeds = jnp.concatenate([text_embeds.astype(jnp.float32), time_embeds], axis=-1)
            if add_embeds.shape[-1] != cfg.projection_class_embeddings_input_dim:
                raise ValueError(
                    f"UNet: text_embeds width {text_embeds.shape[-1]} + 6 * addition_time_embed_dim "
                    f"({time_embeds.shape[-1]}) != projection_class_embeddings_input_dim "
                    f"{cfg.projection_class_embeddings_input_dim}"
                )
            emb = emb + TimestepEmbedding(cfg.time_embed_dim, "silu", dtype=self.dtype, name="add_embedding")(
                add_embeds.astype(self.dtype)
            )

        layers = cfg._per_block(cfg.layers_per_block)
        depths = cfg._per_block(cfg.transformer_layers_per_block)
        only_cross = cfg._per_block(cfg.only_cross_attention)
        common = dict(groups=cfg.norm_num_groups, eps=cfg.norm_eps, act_fn=cfg.act_fn, dtype=self.dtype)

        x = conv(cfg.block_out_channels[0], cfg.conv_in_kernel, dtype=self.dtype, name="conv_in")(x.astype(self.dtype))
        skips = [x]
        for i, kind in enumerate(cfg.down_block_types):
            spec = self._transformer(i, depths[i], only_cross[i]) if kind == "CrossAttnDownBlock2D" else None
            x, block_skips = DownBlock(
                cfg.block_out_channels[i],
                layers[i],
                i < n_blocks - 1,
                cfg.downsample_padding,
                transformer=spec,
                name=f"down_blocks_{i}",
                **common,
            )(x, emb, context)
            skips += block_skips

        if cfg.mid_block_type is not None:
            x = MidBlock(
                output_scale_factor=cfg.mid_block_scale_factor,
                transformer=self._transformer(n_blocks - 1, depths[-1], False),
                name="mid_block",
                **common,
            )(x, emb, context)

        for i, kind in enumerate(cfg.up_block_types):
            r = n_blocks - 1 - i  # the down block this up block mirrors
            n = layers[r] + 1
            block_skips, skips = skips[-n:], skips[:-n]
            final = i == n_blocks - 1
            spec = self._transformer(r, depths[r], only_cross[r]) if kind == "CrossAttnUpBlock2D" else None
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

        Traced once per config (`jax.eval_shape`: nothing is allocated; the full SDXL UNet takes ~15 s on CPU).
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
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            kwargs.update(text_embeds=jnp.zeros((1, pooled)), time_ids=jnp.zeros((1, 6)))
        if config.time_cond_proj_dim is not None:  # cond_proj exists only when called with a condition
            kwargs["timestep_cond"] = jnp.zeros((1, config.time_cond_proj_dim))
        sample = jnp.zeros((1, config.in_channels, size, size))
        return model.init(jax.random.key(0), sample, jnp.zeros((1,)), jnp.zeros((1, 1, ctx)), **kwargs)["params"]

    return jax.eval_shape(init)


def init_params_shape(config: UNet2DConditionConfig) -> dict:
    return UNet2DConditionModel.init_params_shape(config)


# State-dict keys equal the param paths (after `name.N` -> `name_N`): no renames, no buffers to ignore.
UNET_RENAMES: tuple[tuple[str, str], ...] = ()


def convert_unet(state_dict: Mapping[str, Any], config: UNet2DConditionConfig, *, cast=None) -> dict:
    """diffusers UNet state dict (name -> array) -> params; raises `WeightLoadError` naming every bad key."""
    return convert_state_dict(state_dict, init_params_shape(config), component="unet", renames=UNET_RENAMES, cast=cast)
