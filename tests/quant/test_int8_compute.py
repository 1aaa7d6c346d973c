"""int8 compute (`QuantPolicy("int8", compute="int8")`): a Dense layer's int8 x int8 product against a float64
computation of the same quantized operands, static input ranges, the program holding int8 products for exactly the
selected layers (a test net, and the embedded UNet's Dense layers; its convolutions: test_conv_compute.py), the
embedded model's images against weight-only int8.

Measured (the embedded model, 1 prompt, 6 steps, seed 0, float32, the suite's XLA flags): int8 compute of the Dense
layers moved the image by 0.0024 mean / 0.11 max abs from weight-only int8 (0.0033 / 0.15 at 4 steps); with the
convolutions computing in int8 too (the default since) by 0.0027 / 0.15; the test allows 0.02 mean, the bound the
fp8 compute test uses."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compute_helpers import dense_operands, images_against_weight_only, net_by_hand, quantized_net

from sdjax import quant
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import compute as C
from sdjax.quant import modules as M
from sdjax.quant import params as P


def _int8_reference(x, q, scale, b, amax=None):
    """The int8 layer in float64: input scale and rounding by hand (numpy's round-half-even, as XLA's), integer
    products summed exactly in float64 (|sum| < 2^53), scaled after."""
    x = np.asarray(x, np.float64)
    s = (np.abs(x).max() if amax is None else amax) / 127.0
    qx = np.clip(np.round(np.asarray(np.asarray(x, np.float32) / np.float32(s), np.float64)), -127, 127)
    acc = qx @ np.asarray(q, np.float64)
    return acc * s * np.asarray(scale, np.float64) + np.asarray(b, np.float64)


def test_dense_int8_is_the_product_of_the_quantized_operands():
    x, w, b, q, scale = dense_operands("int8")
    assert q.dtype == jnp.int8
    y = C.dense_quantized(x, q, scale, b, jnp.float32)
    expected = _int8_reference(x, q, scale, b)
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=1e-6, atol=1e-5)
    # and what it approximates: the float product, within int8's rounding of both operands
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    rel = np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact)
    assert 1e-4 < rel < 0.03, rel


def test_int8_accumulates_in_int32_without_rounding():
    """A long contraction whose float32 sum would round: the int32 accumulator gives the exact integer sum."""
    k = 4096
    x = jnp.full((1, k), 127.0, jnp.float32)  # s_x = 1: q_x = 127 everywhere
    q = jnp.full((k, 1), -128, jnp.int8).at[0, 0].set(127)  # sum = 127 * (127 - 128 * 4095)
    y = C.dense_quantized(x, q, jnp.ones((1,)), None, jnp.float32)
    exact = 127 * (127 - 128 * (k - 1))
    assert float(y[0, 0]) == float(np.float32(exact))
    hlo = jax.jit(lambda x, q: C.dense_quantized(x, q, jnp.ones((1,)), None, jnp.float32)).lower(x, q).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "xi8>" in dots[0] and "xi32>" in dots[0], dots


def test_a_static_range_scales_and_saturates():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 16)) / 4, jnp.float32)
    b = jnp.zeros(16, jnp.float32)
    q, scale = quant.scheme.quantize_kernel(w, "int8")
    amax = 0.5 * float(jnp.max(jnp.abs(x)))  # half the true range: the large inputs saturate at +-127
    y = C.dense_quantized(x, q, scale, b, jnp.float32, amax=amax)
    np.testing.assert_allclose(np.asarray(y, np.float64), _int8_reference(x, q, scale, b, amax), rtol=1e-6, atol=1e-5)
    qx, s = C.quantize_input(x, "int8", amax)
    assert float(s) == pytest.approx(amax / 127) and int(jnp.max(qx)) == 127 and int(jnp.min(qx)) == -127
    assert not np.allclose(y, C.dense_quantized(x, q, scale, b, jnp.float32), atol=1e-3)  # differs from dynamic
    q0, s0 = C.quantize_input(jnp.zeros((2, 3)), "int8")
    assert float(s0) == 1.0 and q0.dtype == jnp.int8 and not np.any(np.asarray(q0))


def _int8_dots(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines() if "dot_general" in line and "xi8>" in line]


def test_only_int8_dense_kernels_take_the_int8_product():
    net, x, params, qp = quantized_net("int8")
    assert qp["big"]["kernel"].dtype == jnp.int8 and qp["conv"]["kernel"].dtype == jnp.int8
    assert qp["small"]["kernel"].dtype == jnp.float32

    def run(compute, **kw):
        return jax.jit(lambda p, x: M.DequantizingModule(net, jnp.float32, compute, **kw).apply({"params": p}, x))

    # by hand: the big layer's int8 product, then the dequantized conv and the float small layer
    np.testing.assert_allclose(run("int8")(qp, x), net_by_hand(x, params, qp), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(run("int8")(qp, x) - run(None)(qp, x)))) > 1e-4  # the input rounding shows
    # a static range for the layer by its module path
    amax = 0.8 * float(jnp.max(jnp.abs(x)))
    by_hand = net_by_hand(x, params, qp, amax)
    np.testing.assert_allclose(run("int8", amax={"big": amax})(qp, x), by_hand, rtol=1e-5, atol=1e-5)

    assert len(_int8_dots(run("int8").lower(qp, x).as_text())) == 1  # the big layer's
    assert not _int8_dots(run(None).lower(qp, x).as_text())
    # its FLOPs, for a roofline at the int8 rate: 2 * tokens * in * out; a loop body counts once
    looped = lambda p, x: jax.lax.fori_loop(0, 3, lambda i, y: y + run("int8")(p, x), jnp.zeros((2, 7, 8)))
    flops = C.quantized_flops(jax.make_jaxpr(looped)(qp, x))
    assert flops == {"int8": 2.0 * 2 * 7 * 64 * 96, "fp8": 0.0}
    assert C.quantized_flops(jax.make_jaxpr(run(None))(qp, x)) == {"int8": 0.0, "fp8": 0.0}


def test_the_embedded_unet_has_an_int8_dot_for_each_selected_dense_layer():
    """Lowered (not compiled): one int8 x int8 dot per 2-D int8 kernel of the UNet, none for anything else (the
    convolutions computing in int8 too are counted in test_conv_compute.py; here they are kept weight-only)."""
    policy = P.QuantPolicy("int8", components=("unet",), compute="int8", compute_convs=False)
    pipe, params = load_pipeline(None, quantize=policy)
    unet, cfg = pipe.unet, pipe.unet.config
    assert isinstance(unet, M.DequantizingModule) and unet.compute == "int8"
    selected = C.compute_kernels(params["unet"], "int8", convs=False)
    convs = [p for p, (q, _) in P.quantized_kernels(params["unet"]).items() if q.ndim == 4]
    assert len(selected) >= 10 and convs and all(q.ndim == 2 for q, _ in selected.values())
    x = jax.ShapeDtypeStruct((2, cfg.in_channels, cfg.sample_size, cfg.sample_size), jnp.float32)
    t = jax.ShapeDtypeStruct((2,), jnp.float32)
    ctx = jax.ShapeDtypeStruct((2, 77, cfg.cross_attention_dim), jnp.float32)
    hlo = jax.jit(lambda p, x, t, c: unet.apply({"params": p}, x, t, c)).lower(params["unet"], x, t, ctx).as_text()
    dots = _int8_dots(hlo)
    assert len(dots) == len(selected), (len(dots), len(selected))
    assert all("xi32>" in line for line in dots)

    # their FLOPs from the jaxpr (abstract params, as an AOT compile has them) against 2 * tokens * in * out of each
    # selected layer, with the tokens seen by an interceptor on the float model
    expected = []

    def count(next_fun, args, kwargs, context):
        m = context.module
        if isinstance(m, nn.Dense) and context.method_name == "__call__" and "/".join(m.path) + "/kernel" in selected:
            (x,) = args
            expected.append(2.0 * np.prod(x.shape[:-1]) * x.shape[-1] * m.features)
        return next_fun(*args, **kwargs)

    float_params = P.dequantize_tree(params["unet"], jnp.float32)
    with nn.intercept_methods(count):
        jax.eval_shape(lambda p, x, t, c: unet.module.apply({"params": p}, x, t, c), float_params, x, t, ctx)
    assert len(expected) == len(selected)
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params["unet"])
    jaxpr = jax.make_jaxpr(lambda p, x, t, c: unet.apply({"params": p}, x, t, c))(abstract, x, t, ctx)
    assert C.quantized_flops(jaxpr) == {"int8": sum(expected), "fp8": 0.0}


def test_the_embedded_model_with_int8_compute_stays_close_to_weight_only_int8():
    _, out, ref = images_against_weight_only("int8")
    err = np.abs(out - ref)
    assert out.shape == ref.shape and 0 < float(err.mean()) < 0.02


# (bad compute policies, int8's among them: test_fp8_compute.test_bad_compute_is_refused)
