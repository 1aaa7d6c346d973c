"""`models.convert.contiguous`, the tiled copy casts make of transposed kernels: the same bits as numpy's plain
`np.ascontiguousarray(x, dtype)` for every float16 and bfloat16 bit pattern (subnormals, infinities, quiet and
signalling NaNs) and for float32 ones, in every layout the converter hands over; aligned so that the CPU backend
adopts the buffer; and a load through `make_cast` gives the params the old cast gave."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sdjax.loading.components import make_cast
from sdjax.models.convert import ALIGN, BLOCKS, _to_flax_layout, contiguous, convert_state_dict

# PyTorch-layout shapes: conv (O, I, H, W) and linear (out, in), both sides of the blocks, odd remainders.
SHAPES = [(1100, 37, 3, 3), (300, 129, 1, 1), (130, 140, 2, 3), (64, 300, 3, 3), (389, 258), (529, 1000), (7, 500)]


def every_pattern(shape, dtype) -> np.ndarray:
    """An array of `shape` cycling through all 65536 bit patterns of a 16-bit `dtype` (or random float32 bits
    with NaNs, infinities and subnormals mixed in)."""
    n = int(np.prod(shape))
    if np.dtype(dtype).itemsize == 2:
        return np.resize(np.arange(65536, dtype=np.uint16), n).view(dtype).reshape(shape)
    bits = np.random.default_rng(0).integers(0, 2**32, n, dtype=np.uint32)
    bits[::7] &= 0x807FFFFF  # subnormals and zeros
    bits[1::11] |= 0x7F800000  # infinities and NaNs
    return bits.view(np.float32).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))
    )


@pytest.mark.parametrize("source", [np.float16, ml_dtypes.bfloat16, np.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("target", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["to-fp32", "to-bf16", "to-fp16"])
@np.errstate(over="ignore", invalid="ignore")  # float32 -> float16 overflows, NaN -> bfloat16: both copies warn
def test_the_tiled_copy_has_the_bits_of_numpys_copy(source, target):
    for shape in SHAPES:
        raw = every_pattern(shape, source)
        for view in (_to_flax_layout("kernel", raw), raw, raw[..., ::-1] if raw.ndim == 2 else raw[:, :, ::-1]):
            got = contiguous(view, target)
            assert got.flags.c_contiguous and got.ctypes.data % ALIGN == 0
            assert same_bits(got, np.ascontiguousarray(view, dtype=target)), (shape, view.strides)


def test_the_big_kernels_take_the_tiled_path(monkeypatch):
    """The copy goes block by block for the transposed kernels only (the path is what this file is about)."""
    calls = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, **k: calls.append(dst.shape) or real(dst, src, **k))
    contiguous(_to_flax_layout("kernel", np.zeros((1100, 40, 3, 3), np.float16)), np.float32)
    rows, cols = BLOCKS[4]
    assert len(calls) == -(-40 // rows) * -(-1100 // cols) and calls[0] == (3, 3, rows, cols)
    calls.clear()
    contiguous(np.zeros((300, 600), np.float16).T, np.float32)
    rows, cols = BLOCKS[2]
    assert len(calls) == -(-600 // rows) * -(-300 // cols) and calls[0] == (rows, cols)
    calls.clear()
    contiguous(np.zeros((300, 260), np.float16), np.float32)  # already contiguous: one plain copy
    assert calls == [(300, 260)]


def test_the_cpu_backend_adopts_the_buffer_and_keeps_it_alive():
    x = _to_flax_layout("kernel", every_pattern((300, 200), np.float16))
    host = contiguous(x, np.float32)
    pointer = host.ctypes.data
    array = jax.device_put(host)
    if jax.devices()[0].platform == "cpu":
        assert array.unsafe_buffer_pointer() == pointer, "copied instead of adopted"
    del host
    gc.collect()
    junk = [np.full((300, 200), 7.0, np.float32) for _ in range(20)]  # reuse freed memory, if any was freed
    assert same_bits(np.asarray(array), np.ascontiguousarray(x, np.float32))
    del junk


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@np.errstate(invalid="ignore")
def test_a_conversion_through_make_cast_gives_the_old_params(dtype):
    """`convert_state_dict` with `make_cast` (threads, tiles, aligned buffers) against the old cast, one tensor at a
    time in this thread: `jax.device_put(np.ascontiguousarray(layout view, dtype))`."""
    rng = np.random.default_rng(1)
    sd = {
        "conv.weight": every_pattern((260, 257, 3, 3), np.float16),
        "proj.weight": every_pattern((300, 520), np.float16),
        "proj.bias": rng.standard_normal(300).astype(np.float16),
        "norm.weight": every_pattern((520,), np.float16),
        "emb.weight": every_pattern((10, 520), np.float16),
        "ids": np.arange(77, dtype=np.int32)[None],
    }
    expected = {
        "conv": {"kernel": jax.ShapeDtypeStruct((3, 3, 257, 260), jnp.float32)},
        "proj": {"kernel": jax.ShapeDtypeStruct((520, 300), jnp.float32), "bias": jax.ShapeDtypeStruct((300,), "f4")},
        "norm": {"scale": jax.ShapeDtypeStruct((520,), jnp.float32)},
        "emb": {"embedding": jax.ShapeDtypeStruct((10, 520), jnp.float32)},
        "ids": jax.ShapeDtypeStruct((1, 77), jnp.int32),
    }
    got = convert_state_dict(sd, expected, component="c", cast=make_cast(dtype))
    old = convert_state_dict(sd, expected, component="c")  # layout views, not cast
    for path, view in jax.tree_util.tree_flatten_with_path(old)[0]:
        target = dtype if np.issubdtype(view.dtype, np.floating) else view.dtype
        want = np.asarray(jax.device_put(np.ascontiguousarray(view, dtype=target)))
        leaf = np.asarray(got[path[0].key] if len(path) == 1 else got[path[0].key][path[1].key])
        assert same_bits(leaf, want), jax.tree_util.keystr(path)
