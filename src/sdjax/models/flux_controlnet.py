"""The Flux.1 ControlNet: diffusers `FluxControlNetModel` in flax.linen.

A Flux ControlNet (InstantX's, Shakker-Labs' and their union nets) is a shorter Flux transformer trunk that reads
the control condition and hands the transformer one residual per double block and one per single block:

    x      = x_embedder(packed latents) + controlnet_x_embedder(packed control latents)   # (B, L, D) float32
    temb   = time_text_embed(t * 1000, [guidance * 1000,] pooled)                         # guidance_embeds only
    ctx    = context_embedder(T5 states)                                                    # (B, T, D)
    union nets (num_mode set): ctx = [controlnet_mode_embedder(mode), ctx], one more text token (position 0)
    for i < num_layers:         x, ctx = transformer_blocks_i(x, ctx, temb, rope);  double_i = x
    h = [ctx, x]
    for j < num_single_layers:  h = single_transformer_blocks_j(h, temb, rope);      single_j = h[:, text:]
    outputs: controlnet_blocks_i(double_i) * scale, controlnet_single_blocks_j(single_j) * scale

- The blocks, embeddings and rotary table are `models.flux`'s own (the net has the transformer's block classes);
  `controlnet_x_embedder` and every `controlnet_blocks_*` / `controlnet_single_blocks_*` Linear start at zero
  when diffusers makes a net, so an untrained net adds nothing.
- The control condition is the VAE latents of the control image packed 2x2 like the image latents
  (`models.flux.pack_latents`): `in_channels` wide, one token per image token.
- `conditioning_embedding_channels` (diffusers' pixel-space `input_hint_block`, the layout XLabs-style nets are
  converted to, which the transformer then adds with `controlnet_blocks_repeat`) is not implemented: a config that
  sets it is refused by name.
- `patch_size` is read by diffusers only for that pixel path; it is kept for the config's sake.

`FluxTransformer2DModel(..., controlnet_block_samples=, controlnet_single_block_samples=)` adds the outputs to its
image stream (`models.flux`).

Layouts and precision as `models.flux`: tokens `(B, L, C)`, float32 residual streams, `dtype` for the matmuls.
Params mirror the diffusers state dict (`controlnet_blocks_0/kernel`, `controlnet_mode_embedder/embedding`,
`transformer_blocks_0/attn/to_q/kernel`), so `convert_flux_controlnet` needs no rename table.
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
from sdjax.models.flux import (
    TIME_FACTOR,
    CombinedTimestepTextProjEmbeddings,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
    FluxTransformerConfig,
    flux_pos_embed,
)
from sdjax.models.layers import ATTENTION_IMPLEMENTATIONS

Dtype = Any


# ---------------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class FluxControlNetConfig:
    """The keys of a diffusers `FluxControlNetModel` `config.json`, with diffusers' defaults.

    InstantX's Flux.1-dev nets: 5 double and 10 single blocks of the transformer's width, `guidance_embeds` true.
    Shakker-Labs' and InstantX's union nets add `num_mode` (canny, tile, depth, blur, pose, gray, low quality,
    ...); Shakker-Labs' Union-Pro-2.0 has no single blocks (`num_single_layers` 0)."""

    patch_size: int = 1
    in_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    num_mode: int | None = None
    conditioning_embedding_channels: int | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> FluxControlNetConfig:
        """Build from a parsed `config.json`; unknown keys raise `ConfigError` naming `source`."""
        return config_from_dict(cls, dict(raw), source=source)

    def __post_init__(self):
        if isinstance(self.axes_dims_rope, list):  # configs are jit-static: hashable
            object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        name = type(self).__name__
        self.trunk_config()  # the transformer config's own checks (the rotary axes against the head width)
        if self.num_layers < 0 or self.num_single_layers < 0 or self.num_layers + self.num_single_layers == 0:
            raise ConfigError(
                f"{name}: num_layers={self.num_layers} and num_single_layers={self.num_single_layers} must be >= 0 "
                f"and not both 0 (the net would have no outputs)"
            )
        if self.num_mode is not None and self.num_mode < 1:
            raise ConfigError(f"{name}: num_mode must be at least 1 (or null: not a union net), got {self.num_mode}")
        if self.conditioning_embedding_channels is not None:
            raise ConfigError(
                f"{name}: conditioning_embedding_channels={self.conditioning_embedding_channels} (diffusers' "
                f"pixel-space input_hint_block, with the transformer's controlnet_blocks_repeat) is not supported "
                f"by sdjax; nets that read VAE latents of the control image (InstantX, Shakker-Labs; the config's "
                f"conditioning_embedding_channels null) are"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def union(self) -> bool:
        """A ControlNet-Union net: it takes a control mode per image (`num_mode` of them)."""
        return self.num_mode is not None

    def trunk_config(self) -> FluxTransformerConfig:
        """The transformer config of the same trunk (what the shared Flux blocks and embeddings read)."""
        return FluxTransformerConfig(
            patch_size=self.patch_size,
            in_channels=self.in_channels,
            num_layers=self.num_layers,
            num_single_layers=self.num_single_layers,
            attention_head_dim=self.attention_head_dim,
            num_attention_heads=self.num_attention_heads,
            joint_attention_dim=self.joint_attention_dim,
            pooled_projection_dim=self.pooled_projection_dim,
            guidance_embeds=self.guidance_embeds,
            axes_dims_rope=self.axes_dims_rope,
        )


# ---------------------------------------------------------------------------------------------- model
class FluxControlNetModel(nn.Module):
    """diffusers `FluxControlNetModel`; see the module docstring.

    `__call__(hidden_states_bld, controlnet_cond_bld, encoder_hidden_states_btd, pooled_projections_bd,
    timestep_b, img_ids_l3, txt_ids_t3, guidance_b=None, controlnet_mode_b=None, conditioning_scale=1.0)
    -> (block samples, single block samples)`: tuples of `num_layers` and `num_single_layers` arrays
    `(B, L, inner_dim)` in `dtype`.
    - `hidden_states_bld`, `encoder_hidden_states_btd`, `pooled_projections_bd`, `timestep_b`, `img_ids_l3`,
      `txt_ids_t3`, `guidance_b`: as `models.flux.FluxTransformer2DModel` takes them (timestep and guidance
      undivided by 1000 inside; `guidance_b` only and always with `guidance_embeds`);
    - `controlnet_cond_bld`: the packed control latents, the shape of `hidden_states_bld`;
    - `controlnet_mode_b`: int `(B,)` (or a scalar), each in `[0, num_mode)`: union nets only, and always;
    - `conditioning_scale`: a float or one per sample `(B,)`, multiplied into every output.
    `dtype`, `attention`, `remat` as in `models.flux.FluxTransformer2DModel`.
    """

    config: FluxControlNetConfig
    dtype: Dtype = jnp.float32
    attention: str = "auto"
    remat: bool = False

    def _check_inputs(self, x, cond, ctx, pooled, img_ids, txt_ids, guidance, mode) -> None:
        cfg = self.config

        def check(ok: bool, name: str, want: str, arr) -> None:
            if not ok:
                raise ValueError(f"FluxControlNetModel: {name} must be {want}; got shape {jnp.shape(arr)}")

        check(x.ndim == 3 and x.shape[-1] == cfg.in_channels, "hidden_states", f"(B, L, {cfg.in_channels})", x)
        b, n = x.shape[:2]
        check(jnp.shape(cond) == x.shape, "controlnet_cond", f"{x.shape} (packed control latents)", cond)
        d = cfg.joint_attention_dim
        check(ctx.ndim == 3 and ctx.shape[::2] == (b, d), "encoder_hidden_states", f"(B={b}, T, {d})", ctx)
        p = cfg.pooled_projection_dim
        check(jnp.shape(pooled) == (b, p), "pooled_projections", f"(B={b}, {p})", pooled)
        a = len(cfg.axes_dims_rope)
        check(jnp.shape(img_ids) == (n, a), "img_ids", f"(L={n}, {a})", img_ids)
        check(jnp.shape(txt_ids) == (ctx.shape[1], a), "txt_ids", f"(T={ctx.shape[1]}, {a})", txt_ids)
        if cfg.guidance_embeds != (guidance is not None):
            raise ValueError(
                f"FluxControlNetModel: guidance_b is {'required' if cfg.guidance_embeds else 'not taken'}: the "
                f"config's guidance_embeds is {cfg.guidance_embeds}"
            )
        if cfg.union != (mode is not None):
            raise ValueError(
                "FluxControlNetModel: this is a ControlNet-Union net (num_mode set): pass controlnet_mode_b"
                if cfg.union
                else "FluxControlNetModel: controlnet_mode_b given, but the net has no num_mode (not a union net)"
            )
        if mode is not None:
            check(jnp.ndim(mode) == 0 or jnp.shape(mode) == (b,), "controlnet_mode", f"a scalar or (B={b},)", mode)

    @nn.compact
    def __call__(
        self,
        hidden_states_bld,
        controlnet_cond_bld,
        encoder_hidden_states_btd,
        pooled_projections_bd,
        timestep_b,
        img_ids_l3,
        txt_ids_t3,
        guidance_b=None,
        controlnet_mode_b=None,
        conditioning_scale=1.0,
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        cfg = self.config
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"Flux ControlNet: unknown attention {self.attention!r} ({ATTENTION_IMPLEMENTATIONS})")
        x, cond, ctx = hidden_states_bld, controlnet_cond_bld, encoder_hidden_states_btd
        pooled, mode = pooled_projections_bd, controlnet_mode_b
        self._check_inputs(x, cond, ctx, pooled, img_ids_l3, txt_ids_t3, guidance_b, mode)
        b = x.shape[0]
        inner, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim

        def dense(name):
            return nn.Dense(inner, dtype=self.dtype, name=name)

        x = dense("x_embedder")(x.astype(self.dtype)).astype(jnp.float32)
        x = x + dense("controlnet_x_embedder")(cond.astype(self.dtype)).astype(jnp.float32)

        def per_sample(v):
            return None if v is None else jnp.broadcast_to(jnp.asarray(v, jnp.float32), (b,)) * TIME_FACTOR

        temb = CombinedTimestepTextProjEmbeddings(inner, cfg.guidance_embeds, self.dtype, name="time_text_embed")(
            per_sample(timestep_b), pooled.astype(self.dtype), per_sample(guidance_b)
        )
        ctx = dense("context_embedder")(ctx.astype(self.dtype)).astype(jnp.float32)
        txt_ids = jnp.asarray(txt_ids_t3, jnp.float32)
        if cfg.union:  # the mode's embedding is one more text token, at the first text token's position
            modes = jnp.broadcast_to(jnp.asarray(mode, jnp.int32), (b,))
            embed = nn.Embed(cfg.num_mode, inner, dtype=self.dtype, name="controlnet_mode_embedder")(modes)
            ctx = jnp.concatenate([embed.astype(jnp.float32)[:, None], ctx], axis=1)
            txt_ids = jnp.concatenate([txt_ids[:1], txt_ids], axis=0)
        t = ctx.shape[1]
        rope = flux_pos_embed(
            jnp.concatenate([txt_ids, jnp.asarray(img_ids_l3, jnp.float32)], axis=0), cfg.axes_dims_rope
        )

        scale = jnp.broadcast_to(jnp.asarray(conditioning_scale, jnp.float32), (b,))[:, None, None]

        def output(name, sample):
            out = dense(name)(sample.astype(self.dtype))
            return (out.astype(jnp.float32) * scale).astype(out.dtype)

        double = nn.remat(FluxTransformerBlock) if self.remat else FluxTransformerBlock
        single = nn.remat(FluxSingleTransformerBlock) if self.remat else FluxSingleTransformerBlock
        block_samples = []
        for i in range(cfg.num_layers):
            x, ctx = double(heads, head_dim, self.attention, self.dtype, name=f"transformer_blocks_{i}")(
                x, ctx, temb, rope
            )
            block_samples.append(output(f"controlnet_blocks_{i}", x))
        single_samples = []
        if cfg.num_single_layers:
            h = jnp.concatenate([ctx, x], axis=1)
            for j in range(cfg.num_single_layers):
                h = single(heads, head_dim, self.attention, self.dtype, name=f"single_transformer_blocks_{j}")(
                    h, temb, rope
                )
                single_samples.append(output(f"controlnet_single_blocks_{j}", h[:, t:]))
        return tuple(block_samples), tuple(single_samples)

    # ------------------------------------------------------------------ params
    @classmethod
    def init_params_shape(cls, config: FluxControlNetConfig) -> dict:
        """The params tree (`jax.ShapeDtypeStruct` leaves, float32) the net built from `config` expects (traced
        once per config, kept on disk by `shapes_cache`)."""
        return jax.tree_util.tree_map(lambda x: x, _init_params_shape(config))


@functools.lru_cache(maxsize=8)
def _init_params_shape(config: FluxControlNetConfig) -> dict:
    model = FluxControlNetModel(config)

    def init():
        x = jnp.zeros((1, 1, config.in_channels))
        ctx = jnp.zeros((1, 1, config.joint_attention_dim))
        pooled = jnp.zeros((1, config.pooled_projection_dim))
        ids = jnp.zeros((1, len(config.axes_dims_rope)))
        guidance = jnp.zeros((1,)) if config.guidance_embeds else None
        mode = jnp.zeros((1,), jnp.int32) if config.union else None
        args = (x, x, ctx, pooled, jnp.zeros((1,)), ids, ids, guidance, mode)
        return model.init(jax.random.key(0), *args)["params"]

    return shapes_cache.cached(FluxControlNetModel, config, lambda: jax.eval_shape(init))


def init_params_shape(config: FluxControlNetConfig) -> dict:
    return FluxControlNetModel.init_params_shape(config)


def convert_flux_controlnet(
    state_dict: Mapping[str, Any], config: FluxControlNetConfig, *, cast=None, component: str | None = None
) -> dict:
    """diffusers `FluxControlNetModel` state dict (name -> array) -> params; raises `WeightLoadError` naming every
    missing, unexpected and mis-shaped key (`component` names the source, default "controlnet")."""
    return convert_state_dict(
        state_dict, init_params_shape(config), component=component or "controlnet", renames=(), cast=cast
    )
