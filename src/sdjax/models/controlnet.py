"""ControlNet for SD 1.x / 2.x and SDXL: diffusers `ControlNetModel` (and the old `FlaxControlNetModel`) in flax.linen.

Zhang, Rao & Agrawala 2023, "Adding Conditional Control to Text-to-Image Diffusion Models": a trainable copy of
the UNet's encoder half (time embedding, `conv_in`, down blocks, mid block) reads the noisy latents plus a
control image (edges, depth, pose, ...) embedded by a small conv net (`controlnet_cond_embedding`, four 3x3
convs with stride 2 by default: image pixels -> latent size). Every skip connection of the copy goes through a
zero-initialised 1x1 conv (`controlnet_down_blocks_j`, `controlnet_mid_block`); the UNet adds those residuals to
its own skips and mid-block output (`UNet2DConditionModel(..., down_block_additional_residuals=...,
mid_block_additional_residual=...)`).

SDXL ControlNets are the same class with `addition_embed_type="text_time"` (pooled text embedding and
micro-conditioning, as the SDXL UNet); the small SDXL variants (diffusers/controlnet-*-sdxl-1.0-small / -mid)
change only the config (DownBlock2D instead of cross-attention blocks, fewer transformer layers).

The encoder half is the UNet's own code (`models.unet.embed_time`, `encode`, `middle`), built in this module
under the same param names, so params mirror the diffusers state dict (`controlnet_cond_embedding/blocks_0`,
`controlnet_down_blocks_3`, `down_blocks_1/attentions_0/...`) and `convert_controlnet` needs no rename table.

Layout: NCHW in and out, like diffusers; `controlnet_cond` is the control image with pixels in [0, 1]
(`sdjax.preprocess.prepare_control_image` makes it from a PIL image).
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
from sdjax.models.layers import ATTENTION_IMPLEMENTATIONS, conv, nchw_to_nhwc, nhwc_to_nchw
from sdjax.models.unet import (
    AttentionOptions,
    EncoderConfig,
    added_conditioning_shapes,
    embed_time,
    encode,
    middle,
    validate_encoder,
)

Dtype = Any

MID_BLOCKS = ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D")
CHANNEL_ORDERS = ("rgb", "bgr")

# Keys the old FlaxControlNetModel wrote into config.json that the PyTorch class does not have; they have no
# effect on inference (`sample_size` sized the old init, `dropout` is training only).
_IGNORED_KEYS = frozenset({"sample_size", "dropout"})

# Architecture keys released ControlNets leave at their defaults; any other value would be silently wrong here.
_UNSUPPORTED: dict[str, Any] = {
    "class_embed_type": None,
    "num_class_embeds": None,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "resnet_time_scale_shift": "default",
}


@dataclasses.dataclass(frozen=True)
class ControlNetConfig(EncoderConfig):
    """The keys of a diffusers `ControlNetModel` `config.json`, with diffusers' defaults.

    As in the UNet, `attention_head_dim` is the number of attention HEADS per block when `num_attention_heads`
    is None. `addition_embed_type_num_heads` is accepted and ignored (it configures an embedding type sdjax does
    not build, as diffusers ignores it for "text_time"); `sample_size` and `dropout`, written by the old Flax
    class, are accepted and ignored when read from a file. Unknown keys raise.
    """

    in_channels: int = 4
    conditioning_channels: int = 3
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    )
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool | None = False
    resnet_time_scale_shift: str = "default"
    projection_class_embeddings_input_dim: int | None = None
    controlnet_conditioning_channel_order: str = "rgb"
    conditioning_embedding_out_channels: tuple[int, ...] | None = (16, 32, 96, 256)
    global_pool_conditions: bool = False
    addition_embed_type_num_heads: int = 64

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> ControlNetConfig:
        """Build from a parsed `config.json`; unknown keys raise `ConfigError` naming `source`."""
        return config_from_dict(cls, dict(raw), source=source, ignore=_IGNORED_KEYS)

    def __post_init__(self):
        for f in dataclasses.fields(self):  # lists (from JSON or callers) -> tuples: configs are jit-static
            v = getattr(self, f.name)
            if isinstance(v, list):
                object.__setattr__(self, f.name, tuple(v))
        self._validate()

    def _validate(self) -> None:
        name = type(self).__name__
        if self.mid_block_type not in MID_BLOCKS:
            raise ConfigError(
                f"{name}: mid_block_type={self.mid_block_type!r} is not supported; supported: {list(MID_BLOCKS)}"
            )
        if not isinstance(self.layers_per_block, int):
            raise ConfigError(f"{name}: layers_per_block must be one int for all blocks (diffusers' ControlNetModel)")
        if not isinstance(self.cross_attention_dim, int):
            raise ConfigError(f"{name}: cross_attention_dim must be one int (diffusers' ControlNetModel)")
        if self.controlnet_conditioning_channel_order not in CHANNEL_ORDERS:
            raise ConfigError(
                f"{name}: controlnet_conditioning_channel_order={self.controlnet_conditioning_channel_order!r}; "
                f"choose one of {list(CHANNEL_ORDERS)}"
            )
        emb = self.conditioning_embedding_out_channels
        if not emb or not all(isinstance(c, int) and c > 0 for c in emb):
            raise ConfigError(
                f"{name}: conditioning_embedding_out_channels={emb!r} must be a non-empty list of channel counts"
            )
        validate_encoder(self, _UNSUPPORTED, set())

    @property
    def conditioning_downscale(self) -> int:
        """How much smaller than the control image the latents are: one stride-2 conv per embedding stage
        after the first (8 for the default (16, 32, 96, 256), the VAE's factor)."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)

    @property
    def num_down_residuals(self) -> int:
        """How many down residuals the model returns: `conv_in`, each resnet, each downsampler."""
        n = len(self.block_out_channels)
        return 1 + n * self.layers_per_block + (n - 1)


def config_from_unet(unet: Mapping[str, Any]) -> dict:
    """The `config.json` of a ControlNet made from a UNet with config `unet` (diffusers
    `ControlNetModel.from_unet`: the keys both classes have, the rest at the ControlNet's defaults)."""
    keys = {f.name for f in dataclasses.fields(ControlNetConfig)}
    return {k: v for k, v in unet.items() if k in keys}


class ControlNetConditioningEmbedding(nn.Module):
    """diffusers `ControlNetConditioningEmbedding`: `conv_in` (3x3), SiLU, then per stage a 3x3 conv
    (`blocks_{2k}`) and a 3x3 stride-2 conv to the next width (`blocks_{2k+1}`), each followed by SiLU, then
    `conv_out` (3x3, zero-initialised in training) to the UNet's first block width. NHWC."""

    out_channels: int
    block_out_channels: tuple[int, ...]
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nhwc: jax.Array) -> jax.Array:
        chans = self.block_out_channels
        x = jax.nn.silu(conv(chans[0], 3, dtype=self.dtype, name="conv_in")(x_nhwc))
        for k in range(len(chans) - 1):
            x = jax.nn.silu(conv(chans[k], 3, dtype=self.dtype, name=f"blocks_{2 * k}")(x))
            x = jax.nn.silu(conv(chans[k + 1], 3, stride=2, dtype=self.dtype, name=f"blocks_{2 * k + 1}")(x))
        return conv(self.out_channels, 3, dtype=self.dtype, name="conv_out")(x)


def _embedded_size(size: int, stages: int) -> int:
    """A 3x3 stride-2 conv with padding 1 maps n pixels to ceil(n / 2)."""
    for _ in range(stages):
        size = (size + 1) // 2
    return size


def guess_mode_scales(n_down: int) -> np.ndarray:
    """Guess mode's per-residual weights: `logspace(-1, 0, n_down + 1)`, 0.1 for the shallowest down residual up
    to 1.0 for the mid residual (the last one), as diffusers computes them (float32)."""
    return np.logspace(-1.0, 0.0, n_down + 1).astype(np.float32)


class ControlNetModel(nn.Module):
    """diffusers `ControlNetModel` (SD 1.x / 2.x, and SDXL with `addition_embed_type="text_time"`).

    `__call__(sample, timesteps, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
    guess_mode=False, text_embeds=None, time_ids=None) -> (down_residuals, mid_residual)`
    - `sample`: latents NCHW `(B, in_channels, h, w)`; `timesteps`: scalar or `(B,)`;
      `encoder_hidden_states`: `(B, S, cross_attention_dim)`.
    - `controlnet_cond`: the control image NCHW `(B or 1, conditioning_channels, H, W)`, pixels in [0, 1], RGB
      (flipped to BGR inside when `controlnet_conditioning_channel_order="bgr"`); `(H, W)` must embed to `(h, w)`,
      i.e. `H = h * conditioning_downscale` (8 by default). A batch of 1 is shared by the whole batch (one
      embedding, e.g. for both halves of classifier-free guidance).
    - `conditioning_scale`: multiplies every residual; a Python float or a traced scalar (so a denoising loop
      can switch a ControlNet on and off per step without recompiling).
    - `guess_mode` (static): weights the residuals by `guess_mode_scales` (0.1 for the shallowest up to 1.0 for
      the mid residual) times `conditioning_scale`, unless `global_pool_conditions`; diffusers' guess mode.
      The pipeline then runs the ControlNet on the conditional half of a classifier-free-guidance batch only.
    - SDXL: `text_embeds (B, P)`, `time_ids (B, N)` as for the SDXL UNet.
    - Returns `down_residuals`, a tuple of `config.num_down_residuals` NCHW arrays (the UNet's skip shapes),
      and `mid_residual` NCHW, all in `dtype`. With `global_pool_conditions` each is averaged over its spatial
      axes to `(B, C, 1, 1)` (it broadcasts when the UNet adds it).

    Runtime options as the UNet's: `dtype`, `attention`, `split_head_dim`, `attention_chunk_size`.
    """

    config: ControlNetConfig
    dtype: Dtype = jnp.float32
    attention: str = "auto"
    split_head_dim: bool = False
    attention_chunk_size: int = 1024

    def _check_inputs(self, sample, encoder_hidden_states, controlnet_cond, text_embeds, time_ids):
        cfg = self.config
        if sample.ndim != 4 or sample.shape[1] != cfg.in_channels:
            raise ValueError(f"ControlNet: sample must be NCHW (B, {cfg.in_channels}, h, w); got shape {sample.shape}")
        b, _, h, w = sample.shape
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[0] != b:
            raise ValueError(
                f"ControlNet: encoder_hidden_states must be (B={b}, S, D); got shape {encoder_hidden_states.shape}"
            )
        if encoder_hidden_states.shape[-1] != cfg.cross_attention_dim:
            raise ValueError(
                f"ControlNet: encoder_hidden_states width {encoder_hidden_states.shape[-1]} != "
                f"cross_attention_dim {cfg.cross_attention_dim}"
            )
        stages = len(cfg.conditioning_embedding_out_channels) - 1
        shape = tuple(controlnet_cond.shape)
        if (
            len(shape) != 4
            or shape[0] not in (1, b)
            or shape[1] != cfg.conditioning_channels
            or (_embedded_size(shape[2], stages), _embedded_size(shape[3], stages)) != (h, w)
        ):
            f = cfg.conditioning_downscale
            raise ValueError(
                f"ControlNet: controlnet_cond must be NCHW (B={b} or 1, {cfg.conditioning_channels}, {h * f}, "
                f"{w * f}): the control image at {f}x the latent size {h}x{w}, pixels in [0, 1]; got shape {shape}"
            )
        if cfg.addition_embed_type == "text_time":
            if text_embeds is None or time_ids is None:
                raise ValueError(
                    "ControlNet: this SDXL ControlNet (addition_embed_type='text_time') needs text_embeds (B, P) "
                    "and time_ids (B, N), the same as the SDXL UNet gets"
                )
        elif text_embeds is not None or time_ids is not None:
            raise ValueError("ControlNet: text_embeds/time_ids given, but the config has no addition_embed_type")

    @nn.compact
    def __call__(
        self,
        sample,
        timesteps,
        encoder_hidden_states,
        controlnet_cond,
        conditioning_scale=1.0,
        guess_mode: bool = False,
        text_embeds=None,
        time_ids=None,
    ) -> tuple[tuple[jax.Array, ...], jax.Array]:
        cfg = self.config
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"ControlNet: unknown attention {self.attention!r}; choose one of {ATTENTION_IMPLEMENTATIONS}"
            )
        controlnet_cond = jnp.asarray(controlnet_cond)
        self._check_inputs(sample, encoder_hidden_states, controlnet_cond, text_embeds, time_ids)
        options = AttentionOptions(self.attention, self.split_head_dim, self.attention_chunk_size)
        context = encoder_hidden_states.astype(self.dtype)

        emb = embed_time(
            cfg,
            timesteps,
            sample.shape[0],
            text_embeds=text_embeds,
            time_ids=time_ids,
            dtype=self.dtype,
            owner="ControlNet",
        )
        cond_nhwc = nchw_to_nhwc(controlnet_cond).astype(self.dtype)
        if cfg.controlnet_conditioning_channel_order == "bgr":
            cond_nhwc = cond_nhwc[..., ::-1]
        cond_nhwc = ControlNetConditioningEmbedding(
            cfg.block_out_channels[0],
            tuple(cfg.conditioning_embedding_out_channels),
            dtype=self.dtype,
            name="controlnet_cond_embedding",
        )(cond_nhwc)
        x = conv(cfg.block_out_channels[0], 3, dtype=self.dtype, name="conv_in")(
            nchw_to_nhwc(sample).astype(self.dtype)
        )
        x = x + cond_nhwc

        x, skips = encode(cfg, x, emb, context, options, self.dtype)
        x = middle(cfg, x, emb, context, options, self.dtype)

        down = [
            conv(s.shape[-1], 1, dtype=self.dtype, name=f"controlnet_down_blocks_{j}")(s) for j, s in enumerate(skips)
        ]
        mid = conv(x.shape[-1], 1, dtype=self.dtype, name="controlnet_mid_block")(x)

        scale = jnp.asarray(conditioning_scale, jnp.float32)
        if guess_mode and not cfg.global_pool_conditions:
            weights = jnp.asarray(guess_mode_scales(len(down))) * scale
            down = [r * weights[j] for j, r in enumerate(down)]
            mid = mid * weights[-1]
        else:
            down = [r * scale for r in down]
            mid = mid * scale
        if cfg.global_pool_conditions:
            down = [jnp.mean(r, axis=(1, 2), keepdims=True) for r in down]
            mid = jnp.mean(mid, axis=(1, 2), keepdims=True)
        return tuple(nhwc_to_nchw(r.astype(self.dtype)) for r in down), nhwc_to_nchw(mid.astype(self.dtype))

    # ------------------------------------------------------------------ params
    @staticmethod
    def init_params_shape(config: ControlNetConfig) -> dict:
        """The params tree (`jax.ShapeDtypeStruct` leaves, float32) the model built from `config` expects
        (`jax.eval_shape`: nothing is allocated; kept on disk for the next process: `shapes_cache`)."""
        return jax.tree_util.tree_map(lambda x: x, _init_params_shape(config))  # a fresh tree per caller


@functools.lru_cache(maxsize=8)
def _init_params_shape(config: ControlNetConfig) -> dict:
    model = ControlNetModel(config)
    size = 2 ** (len(config.block_out_channels) - 1)
    image = size * config.conditioning_downscale

    def init():
        kwargs = added_conditioning_shapes(config) if config.addition_embed_type == "text_time" else {}
        sample = jnp.zeros((1, config.in_channels, size, size))
        cond = jnp.zeros((1, config.conditioning_channels, image, image))
        context = jnp.zeros((1, 1, config.cross_attention_dim))
        return model.init(jax.random.key(0), sample, jnp.zeros((1,)), context, cond, **kwargs)["params"]

    return shapes_cache.cached(ControlNetModel, config, lambda: jax.eval_shape(init))


def init_params_shape(config: ControlNetConfig) -> dict:
    return ControlNetModel.init_params_shape(config)


# State-dict keys equal the param paths (after `name.N` -> `name_N`): no renames, no buffers to ignore.
CONTROLNET_RENAMES: tuple[tuple[str, str], ...] = ()


def convert_controlnet(state_dict: Mapping[str, Any], config: ControlNetConfig, *, cast=None) -> dict:
    """diffusers ControlNet state dict (name -> array) -> params; raises `WeightLoadError` naming every bad key."""
    return convert_state_dict(
        state_dict, init_params_shape(config), component="controlnet", renames=CONTROLNET_RENAMES, cast=cast
    )


# The old diffusers Flax class name, as the guides import it.
