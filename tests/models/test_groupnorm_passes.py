"""`layers.GroupNorm`'s statistics in one pass (E[x], E[x^2]; the default) and in two (the mean, then the mean of
(x - mean)^2; `layers.GROUPNORM_ONE_PASS = False`), against a float64 GroupNorm written here in numpy.

Groups of 40960 float32 values (64 x 64 pixels x 10 channels, as the layers.py docstring's measurement), whose
|mean| is 0, 10 and 100 times their standard deviation. The variance a call used is read back from its output:
with scale 1 and bias 0 the output's standard deviation per group is sqrt(var_true / (var_used + eps)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax.models import layers

GROUPS, CHANNELS, SIDE = 32, 320, 64
EPS = 1e-5
F32 = np.finfo(np.float32).eps


def groupnorm_f64(x, groups, eps, scale, bias):
    """torch.nn.GroupNorm over the last axis, in float64, two passes."""
    x = np.asarray(x, np.float64)
    x_bsgc = x.reshape(x.shape[0], -1, groups, x.shape[-1] // groups)
    mean = x_bsgc.mean(axis=(1, 3), keepdims=True)
    var = np.square(x_bsgc - mean).mean(axis=(1, 3), keepdims=True)
    y = ((x_bsgc - mean) / np.sqrt(var + eps)).reshape(x.shape)
    return y * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)


def grouped_input(mean_over_std: float, seed: int = 0) -> np.ndarray:
    """(1, 64, 64, 320) float32: group g has std in [0.5, 2] and mean +-mean_over_std * std."""
    rng = np.random.default_rng(seed)
    std = rng.uniform(0.5, 2.0, GROUPS)
    mean = rng.choice([-1.0, 1.0], GROUPS) * mean_over_std * std
    z = rng.standard_normal((1, SIDE * SIDE, GROUPS, CHANNELS // GROUPS))
    return (z * std[:, None] + mean[:, None]).reshape(1, SIDE, SIDE, CHANNELS).astype(np.float32)


def run_groupnorm(monkeypatch, one_pass: bool, x, scale=None, bias=None) -> np.ndarray:
    monkeypatch.setattr(layers, "GROUPNORM_ONE_PASS", one_pass)
    scale = np.ones(CHANNELS, np.float32) if scale is None else scale
    bias = np.zeros(CHANNELS, np.float32) if bias is None else bias
    gn = layers.GroupNorm(GROUPS, EPS)
    params = {"params": {"scale": jnp.asarray(scale), "bias": jnp.asarray(bias)}}
    # a new function per call: traced here, after the switch is set
    return np.asarray(jax.jit(lambda p, x: gn.apply(p, x))(params, jnp.asarray(x)), np.float64)


def variance_rel_error(y, y_ref) -> np.ndarray:
    """Per group: (var_true + eps) / (var_used + eps) - 1, from the outputs' standard deviations."""
    std = y.reshape(1, -1, GROUPS, CHANNELS // GROUPS).std(axis=(1, 3))
    std_ref = y_ref.reshape(1, -1, GROUPS, CHANNELS // GROUPS).std(axis=(1, 3))
    return np.square(std_ref / std) - 1.0


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
def test_zero_mean_groups_match_float64_to_float32_rounding(monkeypatch, one_pass):
    x = grouped_input(0.0)
    y_ref = groupnorm_f64(x, GROUPS, EPS, 1.0, 0.0)
    y = run_groupnorm(monkeypatch, one_pass, x)
    # a few float32 roundings of the largest output (|y| < 6 for 1.3M normal samples)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=8 * F32 * np.abs(y_ref).max())
    assert np.abs(variance_rel_error(y, y_ref)).max() < 1e-6


# The layers.py docstring: one pass measured 3e-5 at |mean| = 10 std and 3e-3 at 100 std; a factor 3 allowed.
@pytest.mark.parametrize("mean_over_std,bound", [(10.0, 3 * 3e-5), (100.0, 3 * 3e-3)])
def test_one_pass_variance_error_within_the_stated_bound(monkeypatch, mean_over_std, bound):
    x = grouped_input(mean_over_std)
    y_ref = groupnorm_f64(x, GROUPS, EPS, 1.0, 0.0)
    err = np.abs(variance_rel_error(run_groupnorm(monkeypatch, True, x), y_ref))
    assert err.max() < bound
    # the cancellation is real: the error grows with (mean / std)^2, well above the two-pass form's
    assert err.max() > 1e-6 * (mean_over_std / 10.0) ** 2


@pytest.mark.parametrize("mean_over_std", [10.0, 100.0])
def test_two_pass_variance_does_not_degrade_with_the_mean(monkeypatch, mean_over_std):
    x = grouped_input(mean_over_std)
    y_ref = groupnorm_f64(x, GROUPS, EPS, 1.0, 0.0)
    y = run_groupnorm(monkeypatch, False, x)
    assert np.abs(variance_rel_error(y, y_ref)).max() < 1e-6
    # what is left is the float32 mean's rounding, a few ulp of |x|, over the smallest std (0.5)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=4 * F32 * np.abs(x).max() / 0.5)


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
def test_a_constant_group_gives_the_bias_not_nan(monkeypatch, one_pass):
    c = np.float32(100.1)
    x = grouped_input(0.0)
    x[..., : CHANNELS // GROUPS] = c  # group 0 constant
    # this constant exercises the clamp: E[x^2] - E[x]^2 in float32, reduced as the layer does, is below -eps, so
    # var + eps < 0 without it
    x_bsgc = jnp.asarray(x).reshape(1, -1, GROUPS, CHANNELS // GROUPS)
    unclamped = jnp.mean(jnp.square(x_bsgc), axis=(1, 3)) - jnp.square(jnp.mean(x_bsgc, axis=(1, 3)))
    assert float(unclamped[0, 0]) < -EPS
    rng = np.random.default_rng(1)
    scale = rng.uniform(0.5, 2.0, CHANNELS).astype(np.float32)
    bias = rng.uniform(-1.0, 1.0, CHANNELS).astype(np.float32)
    y = run_groupnorm(monkeypatch, one_pass, x, scale, bias)
    assert np.isfinite(y).all()
    g0 = slice(0, CHANNELS // GROUPS)
    # var 0: output = bias, up to the float32 mean's rounding (|mean - c| <= a few ulp(c)) times scale / sqrt(eps)
    tol = 4 * np.spacing(c) * scale.max() / np.sqrt(EPS)
    np.testing.assert_allclose(y[..., g0], np.broadcast_to(bias[g0], y[..., g0].shape), rtol=0, atol=tol)
    # the other groups are normalised as usual
    y_ref = groupnorm_f64(x, GROUPS, EPS, scale, bias)
    np.testing.assert_allclose(y[..., CHANNELS // GROUPS :], y_ref[..., CHANNELS // GROUPS :], rtol=0, atol=1e-5)


# measured 1.9e-7 and 1.9e-5 of the largest gradient: the variance's error again (3e-3 at 100 std)
@pytest.mark.parametrize("mean_over_std,bound", [(0.0, 1e-6), (10.0, 1e-4)])
def test_gradients_of_both_forms_agree(monkeypatch, mean_over_std, bound):
    """Fine-tuning differentiates GroupNorm: the one-pass form's input gradient is the two-pass form's, up to the
    one-pass variance's error."""
    x = grouped_input(mean_over_std)[:, :16, :16]
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32))
    gn = layers.GroupNorm(GROUPS, EPS)
    params = {"params": {"scale": jnp.ones(CHANNELS), "bias": jnp.zeros(CHANNELS)}}
    grads = []
    for one_pass in (True, False):
        monkeypatch.setattr(layers, "GROUPNORM_ONE_PASS", one_pass)
        grads.append(np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(gn.apply(params, x) * w)))(jnp.asarray(x))))
    np.testing.assert_allclose(grads[0], grads[1], rtol=0, atol=bound * np.abs(grads[1]).max())
