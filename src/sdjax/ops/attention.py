"""Multi-head scaled dot-product attention, softmax(q k^T / sqrt(d)) v: the one dispatcher every model uses.

`attention(q_btc, k_bsc, v_bsc, heads=, implementation=)` takes projected inputs `(B, T, H*D)`, `(B, S, H*D)`,
`(B, S, H*Dv)` and returns `(B, T, H*Dv)` (diffusers `Attention` between `to_q/k/v` and `to_out`). The
implementations compute the same function (scores and softmax in float32); they differ in memory traffic:

- "xla": the whole `(B, H, T, S)` score tensor, a float32 softmax, then `p @ v`. At SD 1.5's 64x64 latents
  (T = S = 4096, B*H = 16) the scores are 1 GiB: every pass over them streams that through memory.
- "deferred": the same, but the softmax normalization is applied after `p @ v` (`(exp(s - max) @ v) / sum`),
  dividing a `(B, H, T, Dv)` tensor instead of the scores: one pass over the scores fewer (as flash attention).
- "chunked": the softmax on blocks of `chunk_size` queries, one (batch, head) at a time (`lax.map`), each block
  two plain 2-D matrix products, so each block's scores stay in cache; memory O(chunk * S).
- "flash": online softmax over key blocks of `block_size` (Dao et al. 2022, "FlashAttention"), all heads at once.
- "dot_product": `jax.nn.dot_product_attention`: cuDNN flash attention on GPU for half-precision inputs with head
  widths it supports, XLA's lowering elsewhere.
- "pallas": JAX's Pallas flash-attention kernel for TPUs (`jax.experimental.pallas.ops.tpu.flash_attention`): no
  score matrix in HBM. TPU programs only (a TPU VM, or a TPU slice compiled on a CPU host with `sdjax.aot`); shapes
  the kernel does not take (sequences not a multiple of `PALLAS_BLOCK`, such as the 77 text tokens of
  cross-attention; head widths over 128 that are not a multiple of 128) use "xla".
- "auto" (the default; see `resolve`): "dot_product" on GPU, "chunked" on CPU above `AUTO_CHUNK_ABOVE` query
  tokens (the 32x32 and 64x64 levels of a 512x512 image's UNet), "xla" otherwise. On XLA:CPU chunking made the
  SD 1.5 UNet step 17.3 s -> 11.6 s; chunking the 1024-token level too and 2-D block products took the
  1024-token self-attention from 2.3x to 0.6x PyTorch's time (docs/benchmarks.md).

`split_head_dim` keeps heads on their own axis `(B, T, H, D)` instead of folding them into the batch; `upcast`
computes q k^T from float32 q and k (diffusers `upcast_attention`, SD 2.1). Neither changes the numbers beyond
float rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

IMPLEMENTATIONS = ("auto", "xla", "deferred", "chunked", "flash", "dot_product", "pallas")
PALLAS_BLOCK = 128  # the kernel's default query and key block: both sequence lengths must divide by it
AUTO_CHUNK_ABOVE = 256


_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("sdjax_attention_platform", default=None)
_TARGET_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("sdjax_attention_mesh", default=None)


@contextlib.contextmanager
def lowering_for(platform: str | None, mesh: Mesh | None = None):
    """Trace attention for `platform` ("cpu", "gpu", "tpu"; a device's `.platform`) instead of the default backend,
    in a program partitioned over `mesh` (a `(batch, model)` mesh as `sdjax.parallel.sharding.make_mesh` makes).

    "auto" is resolved when a program is traced; a program lowered for other devices than the default backend's
    (a TPU slice compiled on a CPU host: `sdjax.aot`) must get that platform's choice, the one a machine with those
    devices makes. The mesh is for kernels XLA cannot partition itself ("pallas": run per device with
    `shard_map`, the batch over the mesh's first axis, the heads over its second). `Generator.lower` traces its
    programs inside this context."""
    token, mesh_token = _TARGET_PLATFORM.set(platform), _TARGET_MESH.set(mesh)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)
        _TARGET_MESH.reset(mesh_token)


def target_platform() -> str:
    """The platform programs are being traced for: `lowering_for`'s, else the default backend."""
    return _TARGET_PLATFORM.get() or jax.default_backend()


def resolve(implementation: str, query_tokens: int) -> str:
    """The implementation "auto" stands for on the target platform and sequence length; any other name unchanged."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention: unknown implementation {implementation!r}; choose one of {IMPLEMENTATIONS}")
    if implementation == "pallas" and target_platform() != "tpu":
        raise ValueError(
            f"attention='pallas' is the TPU kernel; this program is traced for {target_platform()!r} (choose auto, "
            "xla, chunked, flash or dot_product there)"
        )
    if implementation != "auto":
        return implementation
    backend = target_platform()
    if backend == "gpu":
        return "dot_product"
    if backend == "cpu" and query_tokens > AUTO_CHUNK_ABOVE:
        return "chunked"
    return "xla"


# ------------------------------------------------------------------------------------- on (B, T, N, D) heads
def _scores(q_btnd, k_bsnd):
    s = jnp.einsum("btnd,bsnd->bnts", q_btnd, k_bsnd, preferred_element_type=jnp.float32)
    return s * (1.0 / math.sqrt(q_btnd.shape[-1]))


def _attend_xla(q_btnd, k_bsnd, v_bsnd):
    p = jax.nn.softmax(_scores(q_btnd, k_bsnd), axis=-1).astype(v_bsnd.dtype)
    return jnp.einsum("bnts,bsnd->btnd", p, v_bsnd)


def _attend_deferred(q_btnd, k_bsnd, v_bsnd):
    s = _scores(q_btnd, k_bsnd)
    e = jnp.exp(s - lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    denom_bnt = jnp.sum(e, axis=-1)
    o = jnp.einsum("bnts,bsnd->btnd", e.astype(v_bsnd.dtype), v_bsnd, preferred_element_type=jnp.float32)
    return (o / jnp.transpose(denom_bnt, (0, 2, 1))[..., None]).astype(v_bsnd.dtype)


def _fold_heads(x_btnd):
    b, t, n, d = x_btnd.shape
    return jnp.transpose(x_btnd, (0, 2, 1, 3)).reshape(b * n, t, d)


def _softmax_block(q_td, k_sd, v_sw, dv):
    """Softmax attention of one head's `(T, D)` query block as plain 2-D matrix products, normalization deferred
    after `p @ v`. `v_sw` is the head's values with a column of ones at `dv` (zero-padded after it): the product
    `exp(s - max) @ v_sw` gives the softmax denominators in that column, with no pass of its own over the scores.

    On XLA:CPU a 2-D `dot` runs faster than the same product written with a batch axis of size 1
    (`(1, T, D) x (1, S, D)`); scaling q instead of the scores and the ones column each save a pass over the
    `(T, S)` block (measured in `docs/benchmarks.md`).
    """
    q_td = q_td * jnp.asarray(1.0 / math.sqrt(q_td.shape[-1]), q_td.dtype)
    s_ts = jnp.dot(q_td, k_sd.T, preferred_element_type=jnp.float32)
    e = jnp.exp(s_ts - lax.stop_gradient(jnp.max(s_ts, axis=-1, keepdims=True)))
    o = jnp.dot(e.astype(v_sw.dtype), v_sw, preferred_element_type=jnp.float32)
    return (o[:, :dv] / o[:, dv : dv + 1]).astype(v_sw.dtype)


def balanced_chunk(tokens: int, most: int) -> int:
    """Queries per block: the fewest blocks of at most `most` queries, of equal size rounded up to a multiple of 8
    (or `tokens` when one block holds them). The queries are padded to whole blocks, so blocks of `most` would pad
    Flux's 1024 image + 128 text tokens to 2048 (1.8x the work of the block products); 2 blocks of 576 pad none.
    Counts that `most` divides (the UNets' 4096 / 1024 tokens) keep blocks of `most`."""
    if tokens <= most:
        return tokens
    blocks = -(-tokens // most)
    return -(-tokens // (8 * blocks)) * 8


def _attend_chunked(q_btnd, k_bsnd, v_bsnd, chunk):
    """One (batch, head) at a time, queries in blocks of `chunk`: a block's scores are `chunk * S` floats."""
    b, t, n, _ = q_btnd.shape
    chunk = balanced_chunk(t, chunk)
    q_ntd, k_nsd, v_nsd = _fold_heads(q_btnd), _fold_heads(k_bsnd), _fold_heads(v_bsnd)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    if pad:  # padded query rows are computed and dropped
        q_ntd = jnp.pad(q_ntd, ((0, 0), (0, pad), (0, 0)))
    q_nctd = q_ntd.reshape(b * n, n_chunks, chunk, -1)
    dv = v_nsd.shape[-1]
    width = -(-(dv + 1) // 8) * 8  # values, the ones column, zeros to a multiple of 8
    ones = jnp.ones(v_nsd.shape[:2] + (1,), v_nsd.dtype)
    v_nsw = jnp.pad(jnp.concatenate([v_nsd, ones], axis=-1), ((0, 0), (0, 0), (0, width - dv - 1)))

    def one_head(args):
        q_ctd, k_sd, v_sw = args
        return lax.map(lambda q_td: _softmax_block(q_td, k_sd, v_sw, dv), q_ctd)

    out_nctd = lax.map(one_head, (q_nctd, k_nsd, v_nsw))
    out_ntd = out_nctd.reshape(b * n, n_chunks * chunk, -1)[:, :t]
    return jnp.transpose(out_ntd.reshape(b, n, t, -1), (0, 2, 1, 3))


def _attend_flash(q_btnd, k_bsnd, v_bsnd, block):
    """Online softmax over key blocks of `block`, all heads at once."""
    b, t, n, d = q_btnd.shape
    s = k_bsnd.shape[1]
    q_ntd = _fold_heads(q_btnd).astype(jnp.float32) * (1.0 / math.sqrt(d))
    k_nsd, v_nsd = _fold_heads(k_bsnd), _fold_heads(v_bsnd)
    n_blocks = -(-s // block)
    pad = n_blocks * block - s
    valid = None
    if pad:  # padded keys get -inf scores
        k_nsd = jnp.pad(k_nsd, ((0, 0), (0, pad), (0, 0)))
        v_nsd = jnp.pad(v_nsd, ((0, 0), (0, pad), (0, 0)))
        valid = (jnp.arange(n_blocks * block) < s).reshape(n_blocks, block)
    k_cnsd = jnp.moveaxis(k_nsd.reshape(b * n, n_blocks, block, d), 1, 0)
    v_cnsd = jnp.moveaxis(v_nsd.reshape(b * n, n_blocks, block, -1), 1, 0)

    def step(carry, blk):
        m_nt, l_nt, acc_ntd = carry
        k_sd, v_sd, ok = blk
        sc = jnp.einsum("ntd,nsd->nts", q_ntd, k_sd, preferred_element_type=jnp.float32)
        if ok is not None:
            sc = jnp.where(ok[None, None, :], sc, -jnp.inf)
        m_new = jnp.maximum(m_nt, jnp.max(sc, axis=-1))
        p = jnp.exp(sc - m_new[..., None])
        alpha = jnp.exp(m_nt - m_new)
        acc = acc_ntd * alpha[..., None] + jnp.einsum(
            "nts,nsd->ntd", p.astype(v_sd.dtype), v_sd, preferred_element_type=jnp.float32
        )
        return (m_new, l_nt * alpha + jnp.sum(p, axis=-1), acc), None

    dv = v_bsnd.shape[-1]
    init = (
        jnp.full((b * n, t), -jnp.inf, jnp.float32),
        jnp.zeros((b * n, t), jnp.float32),
        jnp.zeros((b * n, t, dv), jnp.float32),
    )
    (_, l_nt, acc_ntd), _ = lax.scan(step, init, (k_cnsd, v_cnsd, valid))
    out_ntd = (acc_ntd / l_nt[..., None]).astype(v_bsnd.dtype)
    return jnp.transpose(out_ntd.reshape(b, n, t, dv), (0, 2, 1, 3))


def pallas_takes(t: int, s: int, d: int, dv: int) -> bool:
    """Whether the TPU kernel takes these shapes (query and key lengths, head widths)."""
    return t % PALLAS_BLOCK == 0 and s % PALLAS_BLOCK == 0 and all(w <= 128 or w % 128 == 0 for w in (d, dv))


def _attend_pallas(q_btc, k_bsc, v_bsc, heads):
    """The Pallas TPU flash-attention kernel on `(B, T, H*D)` inputs (heads split to the kernel's `(B, H, T, D)`)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    b, t, _ = q_btc.shape
    s = k_bsc.shape[1]
    dtype = jnp.promote_types(q_btc.dtype, v_bsc.dtype)  # upcast: float32 q and k make the whole kernel float32

    def split(x, n):
        return x.astype(dtype).reshape(b, n, heads, -1).transpose(0, 2, 1, 3)

    q, k, v = split(q_btc, t), split(k_bsc, s), split(v_bsc, s)
    kernel = functools.partial(tpu_flash.flash_attention, sm_scale=1.0 / math.sqrt(q.shape[-1]))
    mesh = _TARGET_MESH.get()
    if mesh is not None and mesh.size > 1:  # a Mosaic kernel is not partitioned by XLA: one call per device
        names = mesh.axis_names
        batch_axis = names[0] if b % mesh.shape[names[0]] == 0 else None
        head_axis = names[1] if len(names) > 1 and heads % mesh.shape[names[1]] == 0 else None
        spec = PartitionSpec(batch_axis, head_axis, None, None)
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    out = kernel(q, k, v)
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1)


def _attend_dot_product(q_btnd, k_bsnd, v_bsnd):
    dtype = v_bsnd.dtype
    d = q_btnd.shape[-1]
    if target_platform() == "gpu" and dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128:
        try:
            return jax.nn.dot_product_attention(q_btnd, k_bsnd, v_bsnd, implementation="cudnn")
        except Exception:  # an unsupported cuDNN version or shape: XLA's lowering below
            pass
    q, k, v = (a.astype(jnp.float32) for a in (q_btnd, k_bsnd, v_bsnd))
    return jax.nn.dot_product_attention(q, k, v, implementation="xla").astype(dtype)


# ------------------------------------------------------------------------------------------------ dispatcher
def attention(
    q_btc: jax.Array,
    k_bsc: jax.Array,
    v_bsc: jax.Array,
    *,
    heads: int,
    implementation: str = "auto",
    split_head_dim: bool = False,
    upcast: bool = False,
    chunk_size: int = 1024,
    block_size: int = 512,
) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v per head on `(B, T, H*D)` inputs -> `(B, T, H*Dv)`; see the module docstring.

    `chunk_size`: queries per block for "chunked" (a block's float32 scores are chunk*S*4 bytes: 16 MiB at
    1024 x 4096). `block_size`: keys per step for "flash".
    """
    if q_btc.ndim != 3 or k_bsc.ndim != 3 or v_bsc.ndim != 3 or k_bsc.shape[:2] != v_bsc.shape[:2]:
        raise ValueError(
            f"attention: expected q (B, T, C), k and v (B, S, C); got {q_btc.shape}, {k_bsc.shape}, {v_bsc.shape}"
        )
    b, t, c = q_btc.shape
    s = k_bsc.shape[1]
    if c % heads or v_bsc.shape[-1] % heads:
        raise ValueError(f"attention: width {c} does not split into {heads} heads")
    implementation = resolve(implementation, t)
    if implementation == "pallas":
        if pallas_takes(t, s, c // heads, v_bsc.shape[-1] // heads):
            if upcast:
                q_btc, k_bsc = q_btc.astype(jnp.float32), k_bsc.astype(jnp.float32)
            return _attend_pallas(q_btc, k_bsc, v_bsc, heads).astype(v_bsc.dtype)
        implementation = "xla"
    if upcast:
        q_btc, k_bsc = q_btc.astype(jnp.float32), k_bsc.astype(jnp.float32)
    if split_head_dim:
        q, k, v = q_btc.reshape(b, t, heads, -1), k_bsc.reshape(b, s, heads, -1), v_bsc.reshape(b, s, heads, -1)
    else:  # heads folded into the batch: (B*H, T, 1, D)

        def fold(x, n):
            return x.reshape(b, n, heads, -1).transpose(0, 2, 1, 3).reshape(b * heads, n, 1, -1)

        q, k, v = fold(q_btc, t), fold(k_bsc, s), fold(v_bsc, s)
    if implementation == "xla":
        out = _attend_xla(q, k, v)
    elif implementation == "deferred":
        out = _attend_deferred(q, k, v)
    elif implementation == "chunked":
        out = _attend_chunked(q, k, v, chunk_size)
    elif implementation == "flash":
        out = _attend_flash(q, k, v, block_size)
    else:
        out = _attend_dot_product(q, k, v)
    out = out.astype(v_bsc.dtype)
    if split_head_dim:
        return out.reshape(b, t, -1)
    return out.reshape(b, heads, t, -1).transpose(0, 2, 1, 3).reshape(b, t, -1)
