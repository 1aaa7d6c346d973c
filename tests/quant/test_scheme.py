"""One kernel's quantization (`sdjax.quant.scheme`, qwix's arithmetic) against numpy references, per layer type:
a Dense kernel `(in, out)` and a Conv kernel `(h, w, in, out)`, int8 and fp8 e4m3, one scale per output channel."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sdjax.quant import params as P
from sdjax.quant import scheme as S

SHAPES = {"dense": (96, 40), "conv": (3, 3, 24, 40)}


def _kernel(shape, seed=0):
    r = np.random.default_rng(seed)
    w = r.standard_normal(shape).astype(np.float32) * 0.05
    w[..., 3] *= 20.0  # channels with very different ranges: one scale per channel must follow them
    w[..., 7] = 0.0  # an all-zero channel
    return w


def _ref_int8(w):
    axes = tuple(range(w.ndim - 1))
    absmax = np.abs(w).max(axis=axes)
    scale = absmax / np.float32(127.5)
    scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale).astype(np.float32)
    q = np.clip(np.rint(w / scale), -128, 127).astype(np.int8)
    return q, scale


def _ref_fp8(w):
    axes = tuple(range(w.ndim - 1))
    scale = (np.abs(w).max(axis=axes) / np.float32(448.0)).astype(np.float32)
    scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale).astype(np.float32)
    q = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("layer", sorted(SHAPES))
def test_int8_matches_numpy_and_errs_at_most_half_a_step(layer):
    w = _kernel(SHAPES[layer])
    q, scale = S.quantize_kernel(w, "int8")
    q_ref, scale_ref = _ref_int8(w)
    assert q.dtype == jnp.int8 and q.shape == w.shape and scale.shape == (w.shape[-1],) and scale.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(scale), scale_ref, rtol=1e-6)
    # XLA:CPU divides by multiplying with the reciprocal: values within float rounding of a .5 tie may round the
    # other way than numpy's exact division; every other value matches
    differ = np.asarray(q) != q_ref
    assert np.abs(np.asarray(q, np.int32) - q_ref.astype(np.int32)).max() <= 1
    frac = np.abs(w / scale_ref - np.floor(w / scale_ref) - 0.5)
    assert np.all(frac[differ] < 1e-4), float(frac[differ].max())
    deq = np.asarray(S.dequantize_kernel(q, scale))
    err = np.abs(deq - w)
    # half a step, plus the float rounding of the division (1e-4 of a step)
    assert np.all(err <= scale_ref / 2 * (1 + 1e-4) + 1e-12), float((err / scale_ref).max())
    assert np.all(deq[..., 7] == 0.0)
    assert np.abs(np.asarray(q, np.int32)[..., 3]).max() >= 127  # a channel's largest weight: the end of the range


@pytest.mark.parametrize("layer", sorted(SHAPES))
def test_fp8_matches_numpy_within_e4m3_rounding(layer):
    w = _kernel(SHAPES[layer])
    q, scale = S.quantize_kernel(w, "fp8")
    q_ref, scale_ref = _ref_fp8(w)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (w.shape[-1],)
    np.testing.assert_allclose(np.asarray(scale), scale_ref, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), q_ref.astype(np.float32))
    deq = np.asarray(S.dequantize_kernel(q, scale))
    err = np.abs(deq - w)
    normal = np.abs(w) >= 2.0**-6 * scale_ref  # e4m3's normal range, in units of the channel's scale
    assert np.all(err[normal] <= 2.0**-4 * np.abs(w[normal]) * (1 + 1e-5))  # 3 mantissa bits: half an ulp
    assert np.all(err[~normal] <= np.broadcast_to(2.0**-10 * scale_ref, w.shape)[~normal] * (1 + 1e-5))


def test_dequantize_rounds_to_the_compute_dtype():
    w = _kernel(SHAPES["dense"])
    q, scale = S.quantize_kernel(w, "int8")
    bf = S.dequantize_kernel(q, scale, jnp.bfloat16)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf), np.asarray(S.dequantize_kernel(q, scale)).astype(jnp.bfloat16))


def test_float8_and_bfloat16_inputs_are_quantized_from_their_values():
    w = _kernel(SHAPES["dense"])
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        x = jnp.asarray(w).astype(dtype)
        q, scale = S.quantize_kernel(x, "int8")
        err = np.abs(np.asarray(S.dequantize_kernel(q, scale)) - np.asarray(x, np.float32))
        assert np.all(err <= np.asarray(scale) / 2 * (1 + 1e-4) + 1e-12)


def test_error_stats_against_the_range():
    w = _kernel(SHAPES["conv"])
    stats = S.error_stats(w, *S.quantize_kernel(w, "int8"))
    assert stats["max_err_in_scales"] <= 0.5 + 1e-4
    assert 0 < stats["mean_err_over_range"] < stats["max_err_over_range"] <= 0.5 / 127.5 * (1 + 1e-4)
    assert stats["sqnr_db"] > 30


@pytest.mark.parametrize("bad", ["int4", "INT8", "float8", 8, True, ""])
def test_a_bad_quantize_value_names_the_argument_and_the_choices(bad):
    with pytest.raises(ValueError, match=r"quantize=.*expected one of \['fp8', 'int8'\]"):
        P.check_quantize(bad)
    with pytest.raises(ValueError, match=r"QuantPolicy.scheme="):
        P.QuantPolicy(bad)


def test_a_vector_is_not_a_kernel():
    with pytest.raises(ValueError, match="input and an output axis"):
        S.quantize_kernel(np.ones(8, np.float32), "int8")
