"""LyCORIS LoHa and LoKr layers -> their weight deltas as exact low-rank pairs (`loading.lora` reads the files).

A LyCORIS file names its layers as kohya's LoRA files do (`lora_unet_<module>`, `lora_te_`, SDXL `lora_te1_` /
`lora_te2_`) and stores, per adapted Linear or Conv layer of PyTorch weight shape `(out, in[, kh, kw])`, with
`K = in * kh * kw` and an optional `alpha`:

- LoHa (LyCORIS `loha`; Hadamard product of two low-rank matrices, as in FedPara): `hada_w1_a (out, r)`,
  `hada_w1_b (r, K)`, `hada_w2_a (out, r)`, `hada_w2_b (r, K)`; the delta is
  `(w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r`, `r = hada_w1_b.shape[0]`, reshaped to the weight's shape.
  With a Tucker core for a kh x kw conv (`hada_t1`, `hada_t2` `(r, r, kh, kw)`, then `hada_w*_a (r, out)`,
  `hada_w*_b (r, in)`) each factor is `einsum("ijhw,jq,ip->pqhw", t, w_b, w_a)`, `(out, in, kh, kw)`.
- LoKr (LyCORIS `lokr`; Kronecker product): `lokr_w1 (a, b)` or `lokr_w1_a (a, r) @ lokr_w1_b (r, b)`, and
  `lokr_w2 (c, d[, kh, kw])` or `lokr_w2_a (c, r) @ lokr_w2_b (r, d * kh * kw)` or a Tucker core `lokr_t2
  (r, r, kh, kw)` with `lokr_w2_a (r, c)`, `lokr_w2_b (r, d)`; `out = a * c`, `in = b * d`. The delta is
  `kron(w1, w2) * alpha / r`, reshaped to the weight's shape, where `r` is `lokr_w2_b.shape[0]` when w2 is
  factored, else `lokr_w1_b.shape[0]` when w1 is; when both are full matrices the factor is 1 (the file's alpha
  is then ignored). No alpha: a factor of 1.

The rules are those of AUTOMATIC1111 (`extensions-builtin/Lora/network_hada.py`, `network_lokr.py`,
`lyco_helpers.py`, `network.py`'s `calc_scale`) and ComfyUI (`comfy/weight_adapter/loha.py`, `lokr.py`), which
agree with LyCORIS' own modules (`lycoris/modules/loha.py`, `lokr.py`).

`read_layer` checks a layer against the weight it adapts from the tensors' shapes and keeps the file's (small)
factors; `Layer.pair()` builds the delta (before the `alpha / r` factor) as `up (out, R) @ down (R, K)` when it is
applied, so `loading.lora` fuses it as a LoRA's factors and holds one layer's pair at a time. The pair is exact,
not an approximation: LoHa's Hadamard product of two
rank-r1/r2 products is the product of their column-wise (Khatri-Rao) products, rank r1 * r2; LoKr's Kronecker
product of `U1 V1` and `U2 V2` is `kron(U1, U2) @ kron(V1, V2)` (a full matrix `w` is `I @ w` or `w @ I`); where
that rank is not below `min(out, K)` (or with a Tucker core) the dense delta is stored as `I @ delta` or
`delta @ I`, rank `min(out, K)`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

LOHA_ROLES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
LOKR_ROLES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
# Key suffix -> role, for `loading.lora`'s key grouping.
SUFFIXES = tuple((f".{role}", role) for role in LOHA_ROLES + LOKR_ROLES)
MARKER = re.compile(r"\.(hada|lokr)_")  # any LoHa / LoKr key, known or not


class LayerError(ValueError):
    """A LoHa / LoKr layer whose tensors do not fit together (the message names the roles, not the file)."""


class Misfit(ValueError):
    """A LoHa / LoKr layer whose delta has another shape than the model's weight."""


def kind(roles: Mapping[str, str] | set[str]) -> str | None:
    """The kind of a layer from its roles: "LoHa", "LoKr" or None (a LoRA); LayerError when it mixes them."""
    loha = any(r in roles for r in LOHA_ROLES)
    lokr = any(r in roles for r in LOKR_ROLES)
    if loha and lokr:
        raise LayerError("has both LoHa (hada_*) and LoKr (lokr_*) tensors")
    return "LoHa" if loha else "LoKr" if lokr else None


def torch_shape(kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The PyTorch weight shape `(out, in[, kh, kw])` of a Flax kernel (Dense `(in, out)`, Conv `(kh, kw, in, out)`)."""
    if len(kernel_shape) == 2:
        return (kernel_shape[1], kernel_shape[0])
    kh, kw, cin, cout = kernel_shape
    return (cout, cin, kh, kw)


@dataclasses.dataclass(frozen=True)
class Layer:
    """A checked LoHa or LoKr layer: its float32 tensors by role (the file's factors, small), the PyTorch shape
    `(out, in[, kh, kw])` of the weight it adapts, and `alpha / r` (1 without alpha or, for LoKr, without a
    factored w1 / w2). `pair()` builds the delta's exact low-rank pair when it is applied; it is not kept."""

    kind: str  # "LoHa" or "LoKr"
    tensors: Mapping[str, np.ndarray]
    weight_shape: tuple[int, ...]
    alpha_over_rank: float

    def pair(self) -> tuple[np.ndarray, np.ndarray]:
        """`(up (out, R), down (R, in * kh * kw))` float32 whose product is the delta before `alpha / r`."""
        return _loha_pair(self.tensors) if self.kind == "LoHa" else _lokr_pair(self.tensors)


def read_layer(tensors: Mapping[str, Any], keys: Mapping[str, str], weight_shape: tuple[int, ...]) -> Layer:
    """Check a LoHa or LoKr layer (`keys`: role -> key in `tensors`; roles `LOHA_ROLES` / `LOKR_ROLES` and
    "alpha") against a weight of PyTorch shape `weight_shape`, from the tensors' shapes (nothing is multiplied).
    Raises LayerError (tensors that do not fit together) or Misfit (a delta of another size than the weight)."""
    t = {role: np.asarray(tensors[key], np.float32) for role, key in keys.items()}
    alpha = float(t.pop("alpha").reshape(())) if "alpha" in t else None
    layer_kind = kind(t)
    (out, k), rank = (_loha_shape if layer_kind == "LoHa" else _lokr_shape)(t, tuple(weight_shape))
    if (out, k) != (weight_shape[0], int(np.prod(weight_shape[1:]))):
        raise Misfit(f"delta ({out}, {k}) (out, in * kh * kw)")
    alpha_over_rank = 1.0 if alpha is None or rank is None else alpha / rank
    return Layer(layer_kind, t, tuple(weight_shape), alpha_over_rank)


def _require(t: Mapping[str, np.ndarray], roles: tuple[str, ...]) -> None:
    missing = [r for r in roles if r not in t]
    if missing:
        raise LayerError(f"lacks {', '.join(missing)} (has {', '.join(sorted(t))})")


def _tucker_shape(t: Mapping[str, np.ndarray], core: str, a: str, b: str, weight_shape) -> tuple[int, int]:
    """`(out, in * kh * kw)` of a Tucker-decomposed conv factor: core `(r1, r2, kh, kw)`, `a (r1, out)`,
    `b (r2, in)`."""
    c, w_a, w_b = t[core], t[a], t[b]
    if c.ndim != 4 or w_a.ndim != 2 or w_b.ndim != 2 or (w_a.shape[0], w_b.shape[0]) != c.shape[:2]:
        shapes = f"{tuple(c.shape)}, {tuple(w_a.shape)}, {tuple(w_b.shape)}"
        raise LayerError(f"has a Tucker core {core} that does not fit {a}, {b}: {shapes}")
    if len(weight_shape) == 4 and c.shape[2:] != weight_shape[2:]:
        raise Misfit(f"Tucker core {core} {c.shape[2]}x{c.shape[3]} (kh x kw)")
    return w_a.shape[1], w_b.shape[1] * c.shape[2] * c.shape[3]


def _tucker(core: np.ndarray, w_a: np.ndarray, w_b: np.ndarray) -> np.ndarray:
    """`(out, in * kh * kw)`: `einsum("ijhw,jq,ip->pqhw", core, w_b, w_a)` flattened (A1111's `make_weight_cp`,
    ComfyUI's einsum)."""
    w = np.einsum("ijhw,jq,ip->pqhw", core, w_b, w_a)
    return w.reshape(w.shape[0], -1)


def _product(t: Mapping[str, np.ndarray], a: str, b: str) -> tuple[np.ndarray, np.ndarray]:
    """A stored low-rank pair `a @ b`, flattened to `(m, r)`, `(r, n)` (A1111's `rebuild_conventional`)."""
    w_a, w_b = t[a].reshape(t[a].shape[0], -1), t[b].reshape(t[b].shape[0], -1)
    if w_a.shape[1] != w_b.shape[0]:
        raise LayerError(f"has factors that do not multiply: {a} {tuple(t[a].shape)} @ {b} {tuple(t[b].shape)}")
    return w_a, w_b


def _dense(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A dense `(m, n)` matrix as an exact pair: `I @ w` or `w @ I`, whichever has the smaller rank."""
    w = w.reshape(w.shape[0], -1)
    m, n = w.shape
    return (np.eye(m, dtype=np.float32), w) if m <= n else (w, np.eye(n, dtype=np.float32))


# ------------------------------------------------------------------------------------------------ LoHa
def _loha_shape(t: Mapping[str, np.ndarray], weight_shape) -> tuple[tuple[int, int], int]:
    _require(t, LOHA_ROLES[:4])
    if "hada_t1" in t or "hada_t2" in t:
        _require(t, LOHA_ROLES[4:])
        s1 = _tucker_shape(t, "hada_t1", "hada_w1_a", "hada_w1_b", weight_shape)
        s2 = _tucker_shape(t, "hada_t2", "hada_w2_a", "hada_w2_b", weight_shape)
    else:
        a1, b1 = _product(t, "hada_w1_a", "hada_w1_b")
        a2, b2 = _product(t, "hada_w2_a", "hada_w2_b")
        s1, s2 = (a1.shape[0], b1.shape[1]), (a2.shape[0], b2.shape[1])
    if s1 != s2:
        raise LayerError(f"has two products of different shapes: {s1} vs {s2}")
    return s1, t["hada_w1_b"].shape[0]


def _loha_pair(t: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    if "hada_t1" in t:
        w1 = _tucker(t["hada_t1"], t["hada_w1_a"], t["hada_w1_b"])
        return _dense(w1 * _tucker(t["hada_t2"], t["hada_w2_a"], t["hada_w2_b"]))
    (a1, b1), (a2, b2) = _product(t, "hada_w1_a", "hada_w1_b"), _product(t, "hada_w2_a", "hada_w2_b")
    (out, r1), (r2, k) = a1.shape, b2.shape
    if r1 * r2 >= min(out, k):
        return _dense((a1 @ b1) * (a2 @ b2))
    # (A1 B1) * (A2 B2) = sum over (i, j) of (A1[:, i] * A2[:, j]) outer (B1[i] * B2[j]): rank r1 * r2
    return (a1[:, :, None] * a2[:, None, :]).reshape(out, r1 * r2), (b1[:, None] * b2[None]).reshape(r1 * r2, k)


# ------------------------------------------------------------------------------------------------ LoKr
def _lokr_shape(t: Mapping[str, np.ndarray], weight_shape) -> tuple[tuple[int, int], int | None]:
    """`(out, in * kh * kw)` of `kron(w1, w2)` and the rank alpha divides by: w2's when it is factored, else
    w1's; None (a factor of 1) when both are full."""
    rank = None
    if "lokr_w1" in t:
        w1 = t["lokr_w1"].reshape(t["lokr_w1"].shape[0], -1).shape
    else:
        _require(t, ("lokr_w1_a", "lokr_w1_b"))
        a, b = _product(t, "lokr_w1_a", "lokr_w1_b")
        w1, rank = (a.shape[0], b.shape[1]), t["lokr_w1_b"].shape[0]
    if "lokr_w2" in t:
        w2 = t["lokr_w2"].reshape(t["lokr_w2"].shape[0], -1).shape
    else:
        _require(t, ("lokr_w2_a", "lokr_w2_b"))
        if "lokr_t2" in t:
            w2 = _tucker_shape(t, "lokr_t2", "lokr_w2_a", "lokr_w2_b", weight_shape)
        else:
            a, b = _product(t, "lokr_w2_a", "lokr_w2_b")
            w2 = (a.shape[0], b.shape[1])
        rank = t["lokr_w2_b"].shape[0]
    return (w1[0] * w2[0], w1[1] * w2[1]), rank


def _lokr_pair(t: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """`kron(w1, w2)` as `kron(u1, u2) @ kron(v1, v2)` for `w1 = u1 @ v1`, `w2 = u2 @ v2` (a full matrix `w` as
    `I @ w` or `w @ I`), or dense when that rank is not below `min(out, K)`."""
    u1, v1 = _dense(t["lokr_w1"]) if "lokr_w1" in t else _product(t, "lokr_w1_a", "lokr_w1_b")
    if "lokr_w2" in t:
        u2, v2 = _dense(t["lokr_w2"])
    elif "lokr_t2" in t:
        u2, v2 = _dense(_tucker(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"]))
    else:
        u2, v2 = _product(t, "lokr_w2_a", "lokr_w2_b")
    out, k = u1.shape[0] * u2.shape[0], v1.shape[1] * v2.shape[1]
    if u1.shape[1] * u2.shape[1] >= min(out, k):
        return _dense(np.kron(u1 @ v1, u2 @ v2))
    return np.kron(u1, u2), np.kron(v1, v2)
