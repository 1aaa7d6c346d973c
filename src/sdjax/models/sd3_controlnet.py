"""The Stable Diffusion 3 / 3.5 ControlNet: diffusers `SD3ControlNetModel` in flax.linen.

A ControlNet of the MMDiT (InstantX's SD 3 ControlNets, Stability AI's SD 3.5 large ControlNets) is a shorter copy of
the transformer's trunk that reads the control condition and hands the transformer one residual per control block:

    x      = patch_embed(latents) + pos_embed_input(control latents)      # tokens (B, L, D), float32
    temb   = time_text_embed(t, pooled)                                   # the transformer's modules
    ctx    = context_embedder(text)                                       # joint nets only
    for i < num_layers:  x[, ctx] = block_i(x[, ctx], temb);  out_i = controlnet_blocks_i(x) * conditioning_scale

- `pos_embed_input` is a strided `patch_size` x `patch_size` convolution without positions over the control latents
  (`in_channels + extra_conditioning_channels` channels: an inpainting net takes the mask as an extra channel); it
  and the per-block output Linears `controlnet_blocks_i` start at zero when a net is made, so an untrained net adds
  nothing.
- Joint nets (`joint_attention_dim` set: InstantX's SD 3 nets) run `JointTransformerBlock`s as the transformer does
  (none of them context pre-only; `dual_attention_layers` and `qk_norm` as configured). Nets without text
  (`joint_attention_dim` null: the SD 3.5 large nets) run `SD3SingleTransformerBlock`s: AdaLN-Zero, self-attention
  over the image tokens, a gated MLP; they take no text states.
- `use_pos_embed` false (the SD 3.5 large nets): the net has no patch embedding of its own; it borrows the
  transformer's (diffusers' pipeline copies it into the net). Here the module is given the transformer's config as
  `pos_embed_config` and its params get the transformer's `pos_embed` tree (`families.sd3.controlnet` does both).
- `pos_embed_type` null with `use_pos_embed`: the patch embedding has no position table.
- `force_zeros_for_pooled_projection` is read by the pipeline (zero pooled embeddings for the net, and the control
  latents without the VAE's shift); the module itself takes whatever pooled embeddings it is given.

`SD3Transformer2DModel(..., controlnet_block_samples=)` adds the outputs to its image stream after every block but
the last, block i getting sample `int(i / (num_layers / len(samples)))` (diffusers' `interval_control`).

Layouts as `models.sd3`: tokens `(B, L, C)` row-major over patches, float32 residual streams, `dtype` for the
matmuls. Params mirror the diffusers state dict (`controlnet_blocks_0/kernel`, `pos_embed_input/proj/kernel`,
`transformer_blocks_0/attn/to_q/kernel`), so `convert_sd3_controlnet` needs no rename table.
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
from sdjax.models.flux import AdaLayerNormZero, CombinedTimestepTextProjEmbeddings, FeedForward, layer_norm, modulate
from sdjax.models.layers import ATTENTION_IMPLEMENTATIONS
from sdjax.models.sd3 import (
    JointAttention,
    JointTransformerBlock,
    PatchEmbed,
    SD3TransformerConfig,
    check_mmdit_config,
)

Dtype = Any

POS_EMBED_TYPES = (None, "sincos")


# ---------------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class SD3ControlNetConfig:
    """The keys of a diffusers `SD3ControlNetModel` `config.json`, with diffusers' defaults.

    InstantX SD 3 nets: joint blocks as wide as SD 3 medium's, `pos_embed_max_size` 192, the defaults for the rest
    (`force_zeros_for_pooled_projection` true). SD 3.5 large nets: 19 single blocks of 38 heads,
    `joint_attention_dim` null, `use_pos_embed` false, `pos_embed_type` null, `force_zeros_for_pooled_projection`
    false."""

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int | None = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16  # unused by the net (diffusers keeps it for the config's sake)
    pos_embed_max_size: int | None = 96
    extra_conditioning_channels: int = 0
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None
    pos_embed_type: str | None = "sincos"
    use_pos_embed: bool = True
    force_zeros_for_pooled_projection: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> SD3ControlNetConfig:
        """Build from a parsed `config.json`; unknown keys raise `ConfigError` naming `source`."""
        return config_from_dict(cls, dict(raw), source=source)

    def __post_init__(self):
        check_mmdit_config(self, joint=self.joint)
        name = type(self).__name__
        if self.pos_embed_type not in POS_EMBED_TYPES:
            raise ConfigError(f"{name}: pos_embed_type={self.pos_embed_type!r} must be one of {POS_EMBED_TYPES}")
        if self.num_layers < 1:
            raise ConfigError(f"{name}: num_layers must be at least 1, got {self.num_layers}")
        if self.extra_conditioning_channels < 0:
            n = self.extra_conditioning_channels
            raise ConfigError(f"{name}: extra_conditioning_channels must be >= 0, got {n}")
        if not self.joint and (self.dual_attention_layers or self.qk_norm is not None):
            raise ConfigError(
                f"{name}: dual_attention_layers and qk_norm apply to joint blocks; a net without "
                f"joint_attention_dim runs single blocks, which have neither"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def joint(self) -> bool:
        """Joint (text + image) blocks; else single blocks over the image tokens alone."""
        return self.joint_attention_dim is not None

    @property
    def cond_channels(self) -> int:
        """Channels of the control condition `pos_embed_input` takes."""
        return self.in_channels + self.extra_conditioning_channels

    def patch_config(self) -> SD3TransformerConfig:
        """The config `models.sd3.PatchEmbed` reads for the net's own patch embedding (sincos positions)."""
        return SD3TransformerConfig(
            sample_size=self.sample_size,
            patch_size=self.patch_size,
            in_channels=self.in_channels,
            num_layers=1,
            attention_head_dim=self.attention_head_dim,
            num_attention_heads=self.num_attention_heads,
            caption_projection_dim=self.inner_dim,
            pos_embed_max_size=self.pos_embed_max_size,
        )


# ---------------------------------------------------------------------------------------------- modules
class PatchProjection(nn.Module):
    """diffusers `PatchEmbed(pos_embed_type=None)`: the strided p x p convolution `proj` alone -> tokens
    `(B, h/p * w/p, dim)` float32."""

    patch_size: int
    dim: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bchw: jax.Array) -> jax.Array:
        p = self.patch_size
        b, _, h, w = x_bchw.shape
        x = jnp.transpose(x_bchw.astype(self.dtype), (0, 2, 3, 1))
        x = nn.Conv(self.dim, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype, name="proj")(x)
        return x.reshape(b, (h // p) * (w // p), self.dim).astype(jnp.float32)


class SD3SingleTransformerBlock(nn.Module):
    """diffusers `SD3SingleTransformerBlock` (the SD 3.5 large ControlNets): AdaLayerNormZero (`norm1`),
    self-attention over the image tokens (`attn`: q/k/v and `to_out_0` with biases, no q/k norm) with a gated
    residual, then LayerNorm (eps 1e-6) modulated by the MLP shift/scale and a gated tanh-GELU MLP (`ff`)."""

    heads: int
    dim_head: int
    attention: str = "auto"
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_bld: jax.Array, temb_bd: jax.Array) -> jax.Array:
        nx, (gate_msa, shift_mlp, scale_mlp, gate_mlp) = AdaLayerNormZero(6, self.dtype, name="norm1")(x_bld, temb_bd)
        attn = JointAttention(self.heads, self.dim_head, None, "none", self.attention, self.dtype, name="attn")
        x_bld = x_bld + gate_msa[:, None] * attn(nx.astype(self.dtype)).astype(jnp.float32)
        ff = FeedForward(self.dtype, name="ff")(modulate(layer_norm(x_bld), shift_mlp, scale_mlp).astype(self.dtype))
        return x_bld + gate_mlp[:, None] * ff.astype(jnp.float32)


class SD3ControlNetModel(nn.Module):
    """diffusers `SD3ControlNetModel`; see the module docstring.

    `__call__(hidden_states_bchw, controlnet_cond_bchw, encoder_hidden_states_btd, pooled_projections_bd,
    timestep_b, conditioning_scale=1.0) -> tuple of num_layers block samples (B, h/p * w/p, inner_dim)` in `dtype`:
    - `hidden_states_bchw`: the transformer's input latents `(B, in_channels, H, W)`;
    - `controlnet_cond_bchw`: the control condition `(B, in_channels + extra_conditioning_channels, H, W)` (the
      VAE latents of the control image, as the pipeline prepares them);
    - `encoder_hidden_states_btd`: text states `(B, T, joint_attention_dim)` for joint nets, None for the others;
    - `pooled_projections_bd`, `timestep_b`: as the transformer takes them;
    - `conditioning_scale`: a float or one per sample `(B,)`, multiplied into every output.

    `pos_embed_config`: for a net with `use_pos_embed` false, the transformer's config, whose patch embedding the
    net runs (params `pos_embed`, the transformer's); None otherwise. `dtype`, `attention`, `remat` as in
    `models.sd3.SD3Transformer2DModel`.
    """

    config: SD3ControlNetConfig
    pos_embed_config: SD3TransformerConfig | None = None
    dtype: Dtype = jnp.float32
    attention: str = "auto"
    remat: bool = False

    def _check_inputs(self, x, cond, ctx, pooled) -> None:
        cfg = self.config

        def check(ok: bool, name: str, want: str, arr) -> None:
            if not ok:
                raise ValueError(f"SD3ControlNetModel: {name} must be {want}; got shape {jnp.shape(arr)}")

        p = cfg.patch_size
        ok = x.ndim == 4 and x.shape[1] == cfg.in_channels and x.shape[2] % p == 0 and x.shape[3] % p == 0
        check(ok, "hidden_states", f"(B, {cfg.in_channels}, H, W) with H, W multiples of {p}", x)
        b = x.shape[0]
        want = (b, cfg.cond_channels, *x.shape[2:])
        check(jnp.shape(cond) == want, "controlnet_cond", f"{want} (in_channels + extra_conditioning_channels)", cond)
        check(jnp.shape(pooled) == (b, cfg.pooled_projection_dim), "pooled_projections", f"(B={b}, P)", pooled)
        if cfg.joint:
            d = cfg.joint_attention_dim
            ok = ctx is not None and ctx.ndim == 3 and ctx.shape[::2] == (b, d)
            check(ok, "encoder_hidden_states", f"(B={b}, T, {d})", ctx)
        elif ctx is not None:
            raise ValueError(
                "SD3ControlNetModel: this net has no joint_attention_dim and takes no encoder_hidden_states"
            )

    def _patch_embed(self):
        cfg = self.config
        if not cfg.use_pos_embed:
            pe = self.pos_embed_config
            if pe is None:
                raise ValueError(
                    "SD3ControlNetModel: this net has use_pos_embed=false and borrows the transformer's patch "
                    "embedding; build it with pos_embed_config=<the transformer's config> and params['pos_embed'] "
                    "from the transformer's params (families.sd3.controlnet does this)"
                )
            if pe.inner_dim != cfg.inner_dim or pe.patch_size != cfg.patch_size:
                raise ValueError(
                    f"SD3ControlNetModel: the transformer's patch embedding is {pe.inner_dim} wide with patch size "
                    f"{pe.patch_size}, the net is {cfg.inner_dim} wide with patch size {cfg.patch_size}"
                )
            return PatchEmbed(pe, self.dtype, name="pos_embed")
        if cfg.pos_embed_type is None:
            return PatchProjection(cfg.patch_size, cfg.inner_dim, self.dtype, name="pos_embed")
        return PatchEmbed(cfg.patch_config(), self.dtype, name="pos_embed")

    @nn.compact
    def __call__(
        self,
        hidden_states_bchw,
        controlnet_cond_bchw,
        encoder_hidden_states_btd,
        pooled_projections_bd,
        timestep_b,
        conditioning_scale=1.0,
    ) -> tuple[jax.Array, ...]:
        cfg = self.config
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"SD3 ControlNet: unknown attention {self.attention!r} ({ATTENTION_IMPLEMENTATIONS})")
        x, cond = hidden_states_bchw, controlnet_cond_bchw
        ctx, pooled = encoder_hidden_states_btd, pooled_projections_bd
        self._check_inputs(x, cond, ctx, pooled)
        b, inner = x.shape[0], cfg.inner_dim

        x = self._patch_embed()(x)
        t = jnp.broadcast_to(jnp.asarray(timestep_b, jnp.float32), (b,))
        temb = CombinedTimestepTextProjEmbeddings(inner, False, self.dtype, name="time_text_embed")(
            t, pooled.astype(self.dtype)
        )
        if cfg.joint:
            embed = nn.Dense(cfg.caption_projection_dim, dtype=self.dtype, name="context_embedder")
            ctx = embed(ctx.astype(self.dtype)).astype(jnp.float32)
        x = x + PatchProjection(cfg.patch_size, inner, self.dtype, name="pos_embed_input")(cond)

        scale = jnp.broadcast_to(jnp.asarray(conditioning_scale, jnp.float32), (b,))[:, None, None]
        samples = []
        for i in range(cfg.num_layers):
            name = f"transformer_blocks_{i}"
            if cfg.joint:
                block_cls = nn.remat(JointTransformerBlock) if self.remat else JointTransformerBlock
                block = block_cls(
                    cfg.num_attention_heads,
                    cfg.attention_head_dim,
                    cfg.qk_norm,
                    context_pre_only=False,
                    dual=i in cfg.dual_attention_layers,
                    attention=self.attention,
                    dtype=self.dtype,
                    name=name,
                )
                x, ctx = block(x, ctx, temb)
            else:
                single_cls = nn.remat(SD3SingleTransformerBlock) if self.remat else SD3SingleTransformerBlock
                x = single_cls(cfg.num_attention_heads, cfg.attention_head_dim, self.attention, self.dtype, name=name)(
                    x, temb
                )
            out = nn.Dense(inner, dtype=self.dtype, name=f"controlnet_blocks_{i}")(x.astype(self.dtype))
            samples.append((out.astype(jnp.float32) * scale).astype(out.dtype))
        return tuple(samples)

    # ------------------------------------------------------------------ params
    @classmethod
    def init_params_shape(cls, config: SD3ControlNetConfig) -> dict:
        """The params tree (`jax.ShapeDtypeStruct` leaves, float32) of the net as its checkpoint stores it (a
        `use_pos_embed` false net without `pos_embed`)."""
        return jax.tree_util.tree_map(lambda x: x, _init_params_shape(config))


@functools.lru_cache(maxsize=8)
def _init_params_shape(config: SD3ControlNetConfig) -> dict:
    pos = None
    if not config.use_pos_embed:  # traced with a stand-in patch embedding, dropped below
        pos = config.patch_config()
    model = SD3ControlNetModel(config, pos_embed_config=pos)

    def init():
        p = config.patch_size
        x = jnp.zeros((1, config.in_channels, p, p))
        cond = jnp.zeros((1, config.cond_channels, p, p))
        ctx = jnp.zeros((1, 1, config.joint_attention_dim)) if config.joint else None
        pooled = jnp.zeros((1, config.pooled_projection_dim))
        return model.init(jax.random.key(0), x, cond, ctx, pooled, jnp.zeros((1,)))["params"]

    def trace():
        shapes = dict(jax.eval_shape(init))
        if not config.use_pos_embed:
            shapes.pop("pos_embed")
        return shapes

    return shapes_cache.cached(SD3ControlNetModel, config, trace)


def init_params_shape(config: SD3ControlNetConfig) -> dict:
    return SD3ControlNetModel.init_params_shape(config)


def convert_sd3_controlnet(
    state_dict: Mapping[str, Any], config: SD3ControlNetConfig, *, cast=None, component: str | None = None
) -> dict:
    """diffusers `SD3ControlNetModel` state dict (name -> array) -> params; raises `WeightLoadError` naming every
    missing, unexpected and mis-shaped key (`component` names the source, default "controlnet")."""
    return convert_state_dict(
        state_dict, init_params_shape(config), component=component or "controlnet", renames=(), cast=cast
    )
