"""Multi-head scaled dot-product attention, softmax(q k^T / sqrt(d)) v, with lowerings chosen for speed.

`attention(q_btc, k_bsc, v_bsc, heads=)` takes projected inputs `(B, T, H*D)`, `(B, S, H*D)`, `(B, S, H*Dv)`
and returns `(B, T, H*Dv)` (diffusers `Attention` between `to_q/k/v` and `to_out`). The implementations
compute the same function (scores and softmax in float32); they differ in memory traffic:

- "xla": the whole `(B, H, T, S)` score tensor, a float32 softmax, then `p @ v`. At SD 1.5's 64x64 latents
  (T = S = 4096, B*H = 16) the scores are 1 GiB: every pass over them (scale, max, exp, sum, divide, p @ v)
  streams that through memory, which dominates the UNet step on CPU.
- "deferred": the same, but the softmax normalization is applied after `p @ v` (`(exp(s - max) @ v) / sum`),
  dividing a `(B, H, T, Dv)` tensor instead of the scores: one pass over the scores fewer. The same
  numbers up to float rounding (flash attention does the same).
- "chunked": "deferred" on blocks of `chunk` queries (`lax.map`), so each block's scores stay in cache;
  memory O(B*H*chunk*S). The default, and the CPU-fast choice for long sequences.
- "dot_product": `jax.nn.dot_product_attention(implementation="xla")` (XLA's own lowering; on GPU callers
  may prefer cuDNN through `sdjax.models.layers`).
- "auto": "chunked" when T*S is large (>= 1M score entries per head), else "deferred".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("auto", "xla", "deferred", "chunked", "flash", "dot_product")
CHUNKED_MIN_SCORES = 1 << 20  # T*S per head from which "auto" picks "chunked"


def _split_heads(x_btc, heads):
    b, t, c = x_btc.shape
    if c % heads:
        raise ValueError(f"attention: width {c} does not split into {heads} heads")
    return x_btc.reshape(b, t, heads, c // heads)


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


def _deferred_ntd(q_ntd, k_nsd, v_nsd):
    """`_attend_deferred` on head-folded `(N, T, D)` blocks (scores `(N, T, S)`)."""
    s = jnp.einsum("ntd,nsd->nts", q_ntd, k_nsd, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(q_ntd.shape[-1]))
    e = jnp.exp(s - lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    o = jnp.einsum("nts,nsd->ntd", e.astype(v_nsd.dtype), v_nsd, preferred_element_type=jnp.float32)
    return (o / jnp.sum(e, axis=-1, keepdims=True)).astype(v_nsd.dtype)


def _attend_chunked(q_btnd, k_bsnd, v_bsnd, chunk):
    """One (batch, head) at a time, queries in blocks of `chunk`: a block's scores are `chunk * S` floats."""
    b, t, n, _ = q_btnd.shape
    q_ntd, k_nsd, v_nsd = _fold_heads(q_btnd), _fold_heads(k_bsnd), _fold_heads(v_bsnd)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    if pad:  # padded query rows are computed and dropped
        q_ntd = jnp.pad(q_ntd, ((0, 0), (0, pad), (0, 0)))
    q_nctd = q_ntd.reshape(b * n, n_chunks, chunk, -1)

    def one_head(args):
        q_ctd, k_sd, v_sd = args
        return lax.map(lambda q_td: _deferred_ntd(q_td[None], k_sd[None], v_sd[None])[0], q_ctd)

    out_nctd = lax.map(one_head, (q_nctd, k_nsd, v_nsd))
    out_ntd = out_nctd.reshape(b * n, n_chunks * chunk, -1)[:, :t]
    return jnp.transpose(out_ntd.reshape(b, n, t, -1), (0, 2, 1, 3))


def chunked(q_btnd: jax.Array, k_bsnd: jax.Array, v_bsnd: jax.Array, chunk: int = 1024) -> jax.Array:
    """Query-chunked attention on `(B, T, N, D)` q and `(B, S, N, D)` k, v (what `sdjax.models.layers` uses)."""
    return _attend_chunked(q_btnd, k_bsnd, v_bsnd, chunk)


def _attend_flash(q_btnd, k_bsnd, v_bsnd, block):
    """Online softmax over key blocks of `block` (Dao et al. 2022, "FlashAttention"), all heads at once."""
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
    blocks = (k_cnsd, v_cnsd, valid)
    (_, l_nt, acc_ntd), _ = lax.scan(step, init, blocks)
    out_ntd = (acc_ntd / l_nt[..., None]).astype(v_bsnd.dtype)
    return jnp.transpose(out_ntd.reshape(b, n, t, dv), (0, 2, 1, 3))


def _attend_dot_product(q_btnd, k_bsnd, v_bsnd):
    dtype = v_bsnd.dtype
    q, k, v = (a.astype(jnp.float32) for a in (q_btnd, k_bsnd, v_bsnd))
    return jax.nn.dot_product_attention(q, k, v, implementation="xla").astype(dtype)


def attention(
    q_btc: jax.Array,
    k_bsc: jax.Array,
    v_bsc: jax.Array,
    *,
    heads: int,
    impl: str = "auto",
    chunk: int = 1024,
    block: int = 512,
) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v per head on `(B, T, H*D)` inputs -> `(B, T, H*Dv)`; see the module docstring.

    `chunk`: queries per block for "chunked" (a block's float32 scores are chunk*S*4 bytes: 16 MiB at 1024 x
    4096). `block`: keys per step for "flash".
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention: unknown impl {impl!r}; choose one of {IMPLEMENTATIONS}")
    if q_btc.ndim != 3 or k_bsc.ndim != 3 or v_bsc.ndim != 3 or k_bsc.shape[:2] != v_bsc.shape[:2]:
        raise ValueError(
            f"attention: expected q (B, T, C), k and v (B, S, C); got {q_btc.shape}, {k_bsc.shape}, {v_bsc.shape}"
        )
    q, k, v = _split_heads(q_btc, heads), _split_heads(k_bsc, heads), _split_heads(v_bsc, heads)
    if impl == "auto":
        impl = "chunked" if q.shape[1] * k.shape[1] >= CHUNKED_MIN_SCORES else "deferred"
    if impl == "xla":
        out = _attend_xla(q, k, v)
    elif impl == "deferred":
        out = _attend_deferred(q, k, v)
    elif impl == "chunked":
        out = _attend_chunked(q, k, v, chunk)
    elif impl == "flash":
        out = _attend_flash(q, k, v, block)
    else:
        out = _attend_dot_product(q, k, v)
    b, t = q_btc.shape[:2]
    return out.reshape(b, t, -1)
