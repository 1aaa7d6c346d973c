"""Building blocks shared by the UNet and the VAE, in flax.linen, channels-last (NHWC) throughout.

Every module is named after the diffusers class it mirrors and its submodules after the PyTorch attributes, so
`models.convert.torch_key_to_path` maps state-dict keys onto these param paths without a table.

Layout: the models' public calls take and return NCHW arrays, as diffusers does; `nchw_to_nhwc` /
`nhwc_to_nchw` below are the one place where that conversion happens. Everything inside is NHWC, the layout
XLA's convolutions want on CPU, GPU and TPU.

Precision: `dtype` is the compute dtype. Normalization statistics, the attention softmax and the sinusoidal
embeddings are always computed in float32, whatever the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sdjax.ops import attention as ops_attention
from sdjax.ops import conv as ops_conv

Dtype = Any

# The attention implementations a model's `attention` field may name (`sdjax.ops.attention`, the one dispatcher).
ATTENTION_IMPLEMENTATIONS = ops_attention.IMPLEMENTATIONS


# ----------------------------------------------------------------------------------------------- layout
def nchw_to_nhwc(x_nchw: jax.Array) -> jax.Array:
    return jnp.transpose(x_nchw, (0, 2, 3, 1))


def nhwc_to_nchw(x_nhwc: jax.Array) -> jax.Array:
    return jnp.transpose(x_nhwc, (0, 3, 1, 2))


# ----------------------------------------------------------------------------------------------- activations
def _gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


def _mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


# diffusers `activations.get_activation`: GELU there is PyTorch's exact (erf) GELU.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": _gelu_exact,
    "relu": jax.nn.relu,
    "mish": _mish,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


# ----------------------------------------------------------------------------------------------- norms
# GroupNorm's statistics in one pass (True) or two; benchmarks set False to time the two-pass form.
GROUPNORM_ONE_PASS = True


class GroupNorm(nn.Module):
    """`torch.nn.GroupNorm` over the last (channel) axis; statistics in float32, in one pass over the input.

    Params `scale`, `bias` (C,). Input `(B, ..., C)`; output in `dtype`.

    One pass: E[x] and E[x^2] from the same read, var = max(E[x^2] - E[x]^2, 0). XLA makes the two sums one
    multi-output reduction. The two-pass form (the mean, then the mean of (x - mean)^2) compiled to two reductions
    with a float32 `x - mean` tensor written between them: the SD 1.5 UNet step's GroupNorms took 354 H100 kernels
    instead of 225 (850 -> 721 in all; `benchmarks/gpu_kernel_count.py`). The cost is cancellation where a group's
    |mean| >> std: the variance's relative error grows as (mean / std)^2, measured 3e-5 at |mean| = 10 std and 3e-3
    at 100 std (float32, 40960-element groups), against ~1e-7 for two passes. Shifting the sums by one value of
    each group (d = x - x[0]) removes that error (1e-6 at any mean, tried) but XLA:GPU then writes d as a float32
    tensor or splits the reductions: 760 or 751 kernels instead of 721. `GROUPNORM_ONE_PASS` (read when traced)
    selects the two-pass form instead.
    """

    num_groups: int
    epsilon: float = 1e-5
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        if c % self.num_groups:
            raise ValueError(f"GroupNorm: {c} channels do not split into {self.num_groups} groups")
        scale = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        x_bsgc = x.astype(jnp.float32).reshape(x.shape[0], -1, self.num_groups, c // self.num_groups)
        mean = jnp.mean(x_bsgc, axis=(1, 3), keepdims=True)
        if GROUPNORM_ONE_PASS:
            mean_sq = jnp.mean(jnp.square(x_bsgc), axis=(1, 3), keepdims=True)
            var = jnp.maximum(mean_sq - jnp.square(mean), 0.0)
        else:
            var = jnp.mean(jnp.square(x_bsgc - mean), axis=(1, 3), keepdims=True)
        y = ((x_bsgc - mean) * jax.lax.rsqrt(var + self.epsilon)).reshape(x.shape)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(self.dtype)


class LayerNorm(nn.Module):
    """`torch.nn.LayerNorm` over the last axis with affine params `scale`, `bias`; statistics in float32.

    Two-pass variance, unlike GroupNorm: XLA:GPU compiles this form to one Triton normalization kernel per norm;
    the one-pass form falls out of that pattern into a reduction and an elementwise kernel (+63 kernels per SD 1.5
    UNet step, `benchmarks/gpu_kernel_count.py`).
    """

    epsilon: float = 1e-5
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.epsilon)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def conv(
    features: int,
    kernel: int = 3,
    *,
    stride: int = 1,
    padding: int | None = None,
    dtype: Dtype,
    name: str | None = None,
    use_bias: bool = True,
    upsample2x: bool = False,
) -> ops_conv.Conv:
    """`torch.nn.Conv2d(kernel, stride, padding)` on NHWC; padding defaults to `(kernel - 1) // 2`.

    `sdjax.ops.conv.Conv` is `nn.Conv` with the same params, plus Winograd's algorithm on CPU where prepared.
    `upsample2x`: the conv of the input upsampled 2x (nearest), without the upsampled tensor on CPU.
    """
    p = (kernel - 1) // 2 if padding is None else padding
    return ops_conv.Conv(
        features,
        (kernel, kernel),
        strides=(stride, stride),
        padding=((p, p), (p, p)),
        use_bias=use_bias,
        dtype=dtype,
        name=name,
        upsample2x=upsample2x,
    )


# ----------------------------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """diffusers `Attention` (the default `AttnProcessor2_0` path) on token sequences `(B, T, C)`.

    Self-attention when `context` is None, cross-attention otherwise. Submodules `to_q`, `to_k`, `to_v`,
    `to_out_0` (the PyTorch `to_out.0`). The UNet's transformers use it bare (`qkv_bias=False`); the VAE's
    mid-block attention sets `qkv_bias`, `norm_groups` (a `group_norm` applied to the input first) and
    `residual_connection` (input added to the output), as diffusers' `Attention` options do.
    """

    heads: int
    dim_head: int
    qkv_bias: bool = False
    norm_groups: int | None = None
    norm_eps: float = 1e-5
    residual_connection: bool = False
    upcast: bool = False
    implementation: str = "auto"
    split_head_dim: bool = False
    chunk_size: int = 1024
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_btc: jax.Array, context_bsd: jax.Array | None = None) -> jax.Array:
        inner = self.heads * self.dim_head
        residual = x_btc
        if self.norm_groups is not None:
            x_btc = GroupNorm(self.norm_groups, self.norm_eps, dtype=self.dtype, name="group_norm")(x_btc)
        context_bsd = x_btc if context_bsd is None else context_bsd

        def dense(name, bias):
            return nn.Dense(inner, use_bias=bias, dtype=self.dtype, name=name)

        q = dense("to_q", self.qkv_bias)(x_btc)
        k = dense("to_k", self.qkv_bias)(context_bsd)
        v = dense("to_v", self.qkv_bias)(context_bsd)
        out = ops_attention.attention(
            q,
            k,
            v,
            heads=self.heads,
            implementation=self.implementation,
            split_head_dim=self.split_head_dim,
            upcast=self.upcast,
            chunk_size=self.chunk_size,
        )
        out = nn.Dense(x_btc.shape[-1], dtype=self.dtype, name="to_out_0")(out)
        if self.residual_connection:
            out = out + residual.astype(out.dtype)
        return out


# ----------------------------------------------------------------------------------------------- transformer
class GEGLU(nn.Module):
    """diffusers `GEGLU`: `proj` to 2 * inner, `hidden * gelu(gate)` with the EXACT (erf) GELU, as PyTorch's
    `F.gelu` computes it. (Diffusers' old Flax port used the tanh approximation: a bug not repeated here.)"""

    inner_dim: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(2 * self.inner_dim, dtype=self.dtype, name="proj")(x)
        hidden, gate = jnp.split(h, 2, axis=-1)
        return hidden * _gelu_exact(gate.astype(jnp.float32)).astype(hidden.dtype)


class FeedForward(nn.Module):
    """diffusers `FeedForward` with `activation_fn="geglu"`: `net_0` (GEGLU), `net_2` (Linear); inner = 4 * dim."""

    mult: int = 4
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dim = x.shape[-1]
        h = GEGLU(dim * self.mult, dtype=self.dtype, name="net_0")(x)
        return nn.Dense(dim, dtype=self.dtype, name="net_2")(h)


class BasicTransformerBlock(nn.Module):
    """diffusers `BasicTransformerBlock` (layer_norm, geglu): self-attention, cross-attention, feed-forward,
    each pre-normed (`norm1..3`) and residual. With `only_cross_attention`, `attn1` attends to the context too."""

    heads: int
    dim_head: int
    only_cross_attention: bool = False
    upcast: bool = False
    implementation: str = "auto"
    split_head_dim: bool = False
    chunk_size: int = 1024
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_btc: jax.Array, context_bsd: jax.Array) -> jax.Array:
        def attn(name):
            return Attention(
                self.heads,
                self.dim_head,
                upcast=self.upcast,
                implementation=self.implementation,
                split_head_dim=self.split_head_dim,
                chunk_size=self.chunk_size,
                dtype=self.dtype,
                name=name,
            )

        def norm(name):
            return LayerNorm(1e-5, dtype=self.dtype, name=name)

        x_btc = x_btc + attn("attn1")(norm("norm1")(x_btc), context_bsd if self.only_cross_attention else None)
        x_btc = x_btc + attn("attn2")(norm("norm2")(x_btc), context_bsd)
        return x_btc + FeedForward(dtype=self.dtype, name="ff")(norm("norm3")(x_btc))


class Transformer2DModel(nn.Module):
    """diffusers `Transformer2DModel` on continuous NHWC inputs: GroupNorm(eps 1e-6), `proj_in` (1x1 conv, or
    Linear with `use_linear_projection`), `depth` transformer blocks, `proj_out`, plus the input residual."""

    heads: int
    depth: int = 1
    groups: int = 32
    use_linear_projection: bool = False
    only_cross_attention: bool = False
    upcast: bool = False
    implementation: str = "auto"
    split_head_dim: bool = False
    chunk_size: int = 1024
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nhwc: jax.Array, context_bsd: jax.Array) -> jax.Array:
        b, h, w, c = x_nhwc.shape
        if c % self.heads:
            raise ValueError(f"Transformer2DModel: {c} channels do not split into {self.heads} heads")
        y = GroupNorm(self.groups, 1e-6, dtype=self.dtype, name="norm")(x_nhwc)
        if self.use_linear_projection:
            y_btc = nn.Dense(c, dtype=self.dtype, name="proj_in")(y.reshape(b, h * w, c))
        else:
            y_btc = conv(c, 1, dtype=self.dtype, name="proj_in")(y).reshape(b, h * w, c)
        for i in range(self.depth):
            y_btc = BasicTransformerBlock(
                self.heads,
                c // self.heads,
                only_cross_attention=self.only_cross_attention,
                upcast=self.upcast,
                implementation=self.implementation,
                split_head_dim=self.split_head_dim,
                chunk_size=self.chunk_size,
                dtype=self.dtype,
                name=f"transformer_blocks_{i}",
            )(y_btc, context_bsd)
        if self.use_linear_projection:
            y = nn.Dense(c, dtype=self.dtype, name="proj_out")(y_btc).reshape(b, h, w, c)
        else:
            y = conv(c, 1, dtype=self.dtype, name="proj_out")(y_btc.reshape(b, h, w, c))
        return y + x_nhwc


# ----------------------------------------------------------------------------------------------- resnets
class ResnetBlock2D(nn.Module):
    """diffusers `ResnetBlock2D` (time_embedding_norm="default"): norm1, act, conv1, + time_emb_proj(act(temb)),
    norm2, act, conv2, plus the input (through the 1x1 `conv_shortcut` when the channel count changes),
    divided by `output_scale_factor`. Without `temb` (the VAE) there is no `time_emb_proj`."""

    out_channels: int
    groups: int = 32
    eps: float = 1e-5
    act_fn: str = "silu"
    output_scale_factor: float = 1.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nhwc: jax.Array, temb: jax.Array | None = None) -> jax.Array:
        act = activation(self.act_fn)
        h = act(GroupNorm(self.groups, self.eps, dtype=self.dtype, name="norm1")(x_nhwc))
        h = conv(self.out_channels, 3, dtype=self.dtype, name="conv1")(h)
        if temb is not None:
            t = nn.Dense(self.out_channels, dtype=self.dtype, name="time_emb_proj")(act(temb))
            h = h + t[:, None, None, :]
        h = act(GroupNorm(self.groups, self.eps, dtype=self.dtype, name="norm2")(h))
        h = conv(self.out_channels, 3, dtype=self.dtype, name="conv2")(h)
        if x_nhwc.shape[-1] != self.out_channels:
            x_nhwc = conv(self.out_channels, 1, dtype=self.dtype, name="conv_shortcut")(x_nhwc)
        out = x_nhwc.astype(h.dtype) + h
        if self.output_scale_factor != 1.0:
            out = out / self.output_scale_factor
        return out


class Downsample2D(nn.Module):
    """diffusers `Downsample2D(use_conv=True)`: 3x3 stride-2 `conv`. `padding=0` pads bottom/right by one first
    (the VAE encoder), `padding=1` pads symmetrically (the UNet)."""

    out_channels: int
    padding: int = 1
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nhwc: jax.Array) -> jax.Array:
        if self.padding == 0:
            x_nhwc = jnp.pad(x_nhwc, ((0, 0), (0, 1), (0, 1), (0, 0)))
        return conv(self.out_channels, 3, stride=2, padding=self.padding, dtype=self.dtype, name="conv")(x_nhwc)


def upsample_nearest(x_nhwc: jax.Array, size: tuple[int, int] | None = None) -> jax.Array:
    """`F.interpolate(mode="nearest")` to `size` (default twice the input), NHWC.

    The 2x case is a broadcast + reshape (fuses into the next conv); other sizes (odd latent sizes, where the
    UNet upsamples to the skip connection's size) gather rows/columns at floor(i * in / out) as PyTorch does.
    """
    b, h, w, c = x_nhwc.shape
    oh, ow = (2 * h, 2 * w) if size is None else size
    if (oh, ow) == (2 * h, 2 * w):
        return ops_conv.upsample2x_nearest(x_nhwc)

    def index(n_in, n_out):
        scale = np.float32(n_in) / np.float32(n_out)
        return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int32), n_in - 1)

    return x_nhwc[:, index(h, oh)][:, :, index(w, ow)]


class Upsample2D(nn.Module):
    """diffusers `Upsample2D(use_conv=True)`: nearest-neighbour upsampling (to `size`, default 2x), 3x3 `conv`.

    The 2x case is one `Conv(upsample2x=True)` (on CPU, a 2x2 sub-pixel conv of the input: `sdjax.ops.conv`)."""

    out_channels: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_nhwc: jax.Array, size: tuple[int, int] | None = None) -> jax.Array:
        _, h, w, _ = x_nhwc.shape
        if size is None or tuple(size) == (2 * h, 2 * w):
            return conv(self.out_channels, 3, dtype=self.dtype, name="conv", upsample2x=True)(x_nhwc)
        return conv(self.out_channels, 3, dtype=self.dtype, name="conv")(upsample_nearest(x_nhwc, size))


# ----------------------------------------------------------------------------------------------- time
def timestep_embedding(
    t: jax.Array, dim: int, *, flip_sin_to_cos: bool, freq_shift: float, max_period: float = 10000.0
) -> jax.Array:
    """diffusers `get_timestep_embedding` (DDPM / transformer sinusoids), float32: `(N,)` -> `(N, dim)`.

    freq_k = exp(-ln(max_period) * k / (dim/2 - freq_shift)); [sin, cos] (or [cos, sin] with flip_sin_to_cos);
    an odd `dim` is zero-padded by one column.
    """
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    args = t.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
    sin, cos = jnp.sin(args), jnp.cos(args)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class TimestepEmbedding(nn.Module):
    """diffusers `TimestepEmbedding`: `linear_1`, act, `linear_2`; with `cond_proj_dim` (LCM's guidance
    embedding) the condition enters through `cond_proj` (no bias), added to the input first."""

    time_embed_dim: int
    act_fn: str = "silu"
    cond_proj_dim: int | None = None
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, condition: jax.Array | None = None) -> jax.Array:
        if condition is not None:
            if self.cond_proj_dim is None:
                raise ValueError("a timestep condition was given but the config has no time_cond_proj_dim")
            x = x + nn.Dense(x.shape[-1], use_bias=False, dtype=self.dtype, name="cond_proj")(condition)
        h = nn.Dense(self.time_embed_dim, dtype=self.dtype, name="linear_1")(x)
        h = activation(self.act_fn)(h)
        return nn.Dense(self.time_embed_dim, dtype=self.dtype, name="linear_2")(h)
