"""The Stable Diffusion VAE: diffusers `AutoencoderKL` (Kingma & Welling's VAE with the KL-regularised latent
of Rombach et al. 2022) in flax.linen.

Encoder: conv_in -> down blocks (ResNets, stride-2 conv with bottom/right padding) -> mid block (ResNet,
single-head self-attention, ResNet) -> GroupNorm, SiLU, conv_out to 2 x latent channels -> `quant_conv`
-> `DiagonalGaussian(mean, logvar)`. Decoder: `post_quant_conv` -> conv_in -> mid block -> up blocks (ResNets,
nearest upsampling + conv) -> GroupNorm, SiLU, conv_out.

Layout: images NCHW `(B, 3, H, W)` in [-1, 1] and latents NCHW `(B, 4, H/8, W/8)` at the public boundary, as in
diffusers; NHWC inside (`layers.nchw_to_nhwc` is the one conversion). Latent scaling (`scaling_factor`,
`shift_factor`) and `force_upcast` (float16 only) are the pipeline's business; they are config fields here.

Checkpoint generations: the mid-block attention is `to_q/to_k/to_v/to_out.0` in current diffusers files and
`query/key/value/proj_attn` in old ones; `convert_vae` accepts both (`VAE_RENAMES`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from sdjax.config import ConfigError, config_from_dict
from sdjax.models import shapes_cache
from sdjax.models.convert import convert_state_dict
from sdjax.models.layers import (
    ACTIVATIONS,
    ATTENTION_IMPLEMENTATIONS,
    Attention,
    Downsample2D,
    GroupNorm,
    ResnetBlock2D,
    Upsample2D,
    activation,
    conv,
    nchw_to_nhwc,
    nhwc_to_nchw,
)

Dtype = Any

VAE_EPS = 1e-6  # every norm in diffusers' Encoder/Decoder


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig:
    """The keys of a diffusers `AutoencoderKL` `config.json`, with diffusers' defaults.

    `scaling_factor` / `shift_factor`: latents for the UNet are `(z - shift_factor) * scaling_factor`.
    `latents_mean` / `latents_std`: per-channel statistics some checkpoints publish (not used by SD/SDXL).
    `force_upcast`: run this VAE in float32 when the pipeline runs in float16 (SDXL's VAE overflows in fp16).
    """

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, int] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> AutoencoderKLConfig:
        """Build from a parsed `config.json`; unknown keys raise `ConfigError` naming `source`."""
        return config_from_dict(cls, dict(raw), source=source)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                object.__setattr__(self, f.name, tuple(v))
        n = len(self.block_out_channels)
        if len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise ConfigError(
                f"AutoencoderKLConfig: down_block_types ({len(self.down_block_types)}), "
                f"up_block_types ({len(self.up_block_types)}) and block_out_channels ({n}) must "
                f"have the same length"
            )
        for key, allowed in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
            bad = [b for b in getattr(self, key) if b != allowed]
            if bad:
                raise ConfigError(f"AutoencoderKLConfig: {key} contains {bad}; only {allowed!r} is supported")
        if self.act_fn not in ACTIVATIONS:
            raise ConfigError(f"AutoencoderKLConfig: act_fn={self.act_fn!r} unknown; known: {sorted(ACTIVATIONS)}")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ConfigError(
                f"AutoencoderKLConfig: block_out_channels {bad} not divisible by norm_num_groups {self.norm_num_groups}"
            )


@flax.struct.dataclass
class DiagonalGaussian:
    """diffusers `DiagonalGaussianDistribution`: the encoder's posterior, NCHW float32. `logvar` is clamped to
    [-30, 20] as in diffusers."""

    mean: jax.Array
    logvar: jax.Array

    @classmethod
    def from_moments(cls, moments_nchw: jax.Array) -> DiagonalGaussian:
        mean, logvar = jnp.split(moments_nchw.astype(jnp.float32), 2, axis=1)
        return cls(mean, jnp.clip(logvar, -30.0, 20.0))

    @property
    def std(self) -> jax.Array:
        return jnp.exp(0.5 * self.logvar)

    @property
    def var(self) -> jax.Array:
        return jnp.exp(self.logvar)

    def sample(self, key: jax.Array) -> jax.Array:
        return self.mean + self.std * jax.random.normal(key, self.mean.shape, self.mean.dtype)

    def mode(self) -> jax.Array:
        return self.mean


@dataclasses.dataclass(frozen=True)
class _Runtime:
    """Compute dtype and attention options, passed down unchanged."""

    dtype: Dtype
    attention: str
    split_head_dim: bool
    chunk_size: int


class MidBlock(nn.Module):
    """diffusers `UNetMidBlock2D` as the VAE uses it: resnet, [single-head self-attention,] resnet; no temb."""

    groups: int
    act_fn: str
    add_attention: bool
    rt: _Runtime

    @nn.compact
    def __call__(self, x_nhwc):
        b, h, w, c = x_nhwc.shape
        dtype = self.rt.dtype
        x_nhwc = ResnetBlock2D(c, self.groups, VAE_EPS, self.act_fn, dtype=dtype, name="resnets_0")(x_nhwc)
        if self.add_attention:
            attn = Attention(
                1,
                c,
                qkv_bias=True,
                norm_groups=self.groups,
                norm_eps=VAE_EPS,
                residual_connection=True,
                implementation=self.rt.attention,
                split_head_dim=self.rt.split_head_dim,
                chunk_size=self.rt.chunk_size,
                dtype=dtype,
                name="attentions_0",
            )
            x_nhwc = attn(x_nhwc.reshape(b, h * w, c)).reshape(b, h, w, c)
        return ResnetBlock2D(c, self.groups, VAE_EPS, self.act_fn, dtype=dtype, name="resnets_1")(x_nhwc)


class DownEncoderBlock2D(nn.Module):
    """diffusers `DownEncoderBlock2D`: `num_layers` resnets, then an optional stride-2 conv (padded bottom/right)."""

    out_channels: int
    num_layers: int
    add_downsample: bool
    groups: int
    act_fn: str
    dtype: Dtype

    @nn.compact
    def __call__(self, x_nhwc):
        for j in range(self.num_layers):
            x_nhwc = ResnetBlock2D(
                self.out_channels, self.groups, VAE_EPS, self.act_fn, dtype=self.dtype, name=f"resnets_{j}"
            )(x_nhwc)
        if self.add_downsample:
            x_nhwc = Downsample2D(self.out_channels, padding=0, dtype=self.dtype, name="downsamplers_0")(x_nhwc)
        return x_nhwc


class UpDecoderBlock2D(nn.Module):
    """diffusers `UpDecoderBlock2D`: `num_layers` resnets, then an optional 2x nearest upsampling + conv."""

    out_channels: int
    num_layers: int
    add_upsample: bool
    groups: int
    act_fn: str
    dtype: Dtype

    @nn.compact
    def __call__(self, x_nhwc):
        for j in range(self.num_layers):
            x_nhwc = ResnetBlock2D(
                self.out_channels, self.groups, VAE_EPS, self.act_fn, dtype=self.dtype, name=f"resnets_{j}"
            )(x_nhwc)
        if self.add_upsample:
            x_nhwc = Upsample2D(self.out_channels, dtype=self.dtype, name="upsamplers_0")(x_nhwc)
        return x_nhwc


class Encoder(nn.Module):
    """diffusers `vae.Encoder` (double_z): NHWC image -> NHWC moments `(B, h, w, 2 * latent_channels)`."""

    config: AutoencoderKLConfig
    rt: _Runtime

    @nn.compact
    def __call__(self, x_nhwc):
        cfg, dtype = self.config, self.rt.dtype
        n = len(cfg.block_out_channels)
        x = conv(cfg.block_out_channels[0], 3, dtype=dtype, name="conv_in")(x_nhwc.astype(dtype))
        for i, ch in enumerate(cfg.block_out_channels):
            x = DownEncoderBlock2D(
                ch, cfg.layers_per_block, i < n - 1, cfg.norm_num_groups, cfg.act_fn, dtype, name=f"down_blocks_{i}"
            )(x)
        x = MidBlock(cfg.norm_num_groups, cfg.act_fn, cfg.mid_block_add_attention, self.rt, name="mid_block")(x)
        x = activation(cfg.act_fn)(GroupNorm(cfg.norm_num_groups, VAE_EPS, dtype=dtype, name="conv_norm_out")(x))
        return conv(2 * cfg.latent_channels, 3, dtype=dtype, name="conv_out")(x)


class Decoder(nn.Module):
    """diffusers `vae.Decoder`: NHWC latents -> NHWC image."""

    config: AutoencoderKLConfig
    rt: _Runtime

    @nn.compact
    def __call__(self, z_nhwc):
        cfg, dtype = self.config, self.rt.dtype
        chans = cfg.block_out_channels[::-1]
        x = conv(chans[0], 3, dtype=dtype, name="conv_in")(z_nhwc.astype(dtype))
        x = MidBlock(cfg.norm_num_groups, cfg.act_fn, cfg.mid_block_add_attention, self.rt, name="mid_block")(x)
        for i, ch in enumerate(chans):
            x = UpDecoderBlock2D(
                ch,
                cfg.layers_per_block + 1,
                i < len(chans) - 1,
                cfg.norm_num_groups,
                cfg.act_fn,
                dtype,
                name=f"up_blocks_{i}",
            )(x)
        x = activation(cfg.act_fn)(GroupNorm(cfg.norm_num_groups, VAE_EPS, dtype=dtype, name="conv_norm_out")(x))
        return conv(cfg.out_channels, 3, dtype=dtype, name="conv_out")(x)


class AutoencoderKL(nn.Module):
    """diffusers `AutoencoderKL`.

    - `encode(images)`: images NCHW `(B, in_channels, H, W)` in [-1, 1] -> `DiagonalGaussian` over latents NCHW
      `(B, latent_channels, H/f, W/f)`, f = 2 ** (len(block_out_channels) - 1); `.mode()`, `.sample(key)`.
    - `decode(latents)`: latents NCHW -> images NCHW `(B, out_channels, H, W)`, roughly in [-1, 1], in `dtype`.
      (Unscaled latents: the pipeline divides by `scaling_factor` and adds `shift_factor` first.)
    - `__call__(images, key=None)`: encode, then decode the posterior's sample (`key`) or mode.

    Runtime options as in the UNet: `dtype` (norms and softmax in float32 regardless), `attention`,
    `split_head_dim`, `attention_chunk_size` (the mid-block attention is single-head over all h*w positions:
    "chunked" bounds its memory at large sizes).
    """

    config: AutoencoderKLConfig
    dtype: Dtype = jnp.float32
    attention: str = "auto"
    split_head_dim: bool = False
    attention_chunk_size: int = 1024

    def setup(self):
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"VAE: unknown attention {self.attention!r}; choose one of {ATTENTION_IMPLEMENTATIONS}")
        cfg = self.config
        rt = _Runtime(self.dtype, self.attention, self.split_head_dim, self.attention_chunk_size)
        self.encoder = Encoder(cfg, rt)
        self.decoder = Decoder(cfg, rt)
        self.quant_conv = conv(2 * cfg.latent_channels, 1, dtype=self.dtype) if cfg.use_quant_conv else None
        self.post_quant_conv = conv(cfg.latent_channels, 1, dtype=self.dtype) if cfg.use_post_quant_conv else None

    def moments(self, images_nchw: jax.Array) -> jax.Array:
        """The encoder and `quant_conv`: images NCHW -> the posterior's moments NCHW `(B, 2 * latent_channels, h,
        w)` (mean, then logvar before clamping; diffusers `_encode`)."""
        if images_nchw.ndim != 4 or images_nchw.shape[1] != self.config.in_channels:
            raise ValueError(
                f"VAE.encode: images must be NCHW (B, {self.config.in_channels}, H, W); got shape {images_nchw.shape}"
            )
        moments = self.encoder(nchw_to_nhwc(images_nchw))
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return nhwc_to_nchw(moments)

    def encode(self, images_nchw: jax.Array) -> DiagonalGaussian:
        return DiagonalGaussian.from_moments(self.moments(images_nchw))

    def decode(self, latents_nchw: jax.Array) -> jax.Array:
        if latents_nchw.ndim != 4 or latents_nchw.shape[1] != self.config.latent_channels:
            raise ValueError(
                f"VAE.decode: latents must be NCHW (B, {self.config.latent_channels}, h, w); "
                f"got shape {latents_nchw.shape}"
            )
        z = nchw_to_nhwc(latents_nchw).astype(self.dtype)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return nhwc_to_nchw(self.decoder(z))

    def __call__(self, images_nchw: jax.Array, key: jax.Array | None = None) -> jax.Array:
        posterior = self.encode(images_nchw)
        return self.decode(posterior.mode() if key is None else posterior.sample(key))

    # ------------------------------------------------------------------ params
    @staticmethod
    def init_params_shape(config: AutoencoderKLConfig) -> dict:
        """The params tree (`jax.ShapeDtypeStruct` leaves, float32) the model built from `config` expects (traced
        once per config, kept on disk for the next process: `shapes_cache`)."""
        return jax.tree_util.tree_map(lambda x: x, _init_params_shape(config))


@functools.lru_cache(maxsize=8)
def _init_params_shape(config: AutoencoderKLConfig) -> dict:
    model = AutoencoderKL(config)
    size = 2 ** (len(config.block_out_channels) - 1)
    return shapes_cache.cached(
        AutoencoderKL,
        config,
        lambda: jax.eval_shape(
            lambda: model.init(jax.random.key(0), jnp.zeros((1, config.in_channels, size, size)))["params"]
        ),
    )


def init_params_shape(config: AutoencoderKLConfig) -> dict:
    return AutoencoderKL.init_params_shape(config)


# Old checkpoints (diffusers' deprecated `AttentionBlock`) name the mid-block attention query/key/value/proj_attn.
VAE_RENAMES: tuple[tuple[str, str], ...] = (
    (r"(mid_block\.attentions\.\d+)\.query\.", r"\1.to_q."),
    (r"(mid_block\.attentions\.\d+)\.key\.", r"\1.to_k."),
    (r"(mid_block\.attentions\.\d+)\.value\.", r"\1.to_v."),
    (r"(mid_block\.attentions\.\d+)\.proj_attn\.", r"\1.to_out.0."),
)


def convert_vae(state_dict: Mapping[str, Any], config: AutoencoderKLConfig, *, cast=None) -> dict:
    """diffusers VAE state dict (either attention naming) -> params; raises `WeightLoadError` naming bad keys."""
    return convert_state_dict(state_dict, init_params_shape(config), component="vae", renames=VAE_RENAMES, cast=cast)
