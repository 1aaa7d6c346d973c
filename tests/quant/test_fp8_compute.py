"""fp8 compute (`QuantPolicy(compute="fp8")`): a Dense layer's product in fp8 x fp8 against a float64 computation
of the same quantized operands, the program holding fp8 products, the embedded model's images against the
weight-only fp8 ones, and bad policies refused."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import quant
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import compute as C
from sdjax.quant import modules as M
from sdjax.quant import params as P

FP8 = jnp.float8_e4m3fn


def _np(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def test_dense_fp8_is_the_product_of_the_quantized_operands():
    rng = np.random.default_rng(0)
    x = jnp.asarray(3.0 * rng.standard_normal((2, 5, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)) / 8, jnp.float32)
    b = jnp.asarray(rng.standard_normal(48), jnp.float32)
    q, scale = quant.scheme.quantize_kernel(w, "fp8")
    y = C.dense_quantized(x, q, scale, b, jnp.float32)

    # independent: the input scale and fp8 rounding by hand, the product in float64
    s = float(np.abs(np.asarray(x)).max()) / 448.0
    qx = _np(jnp.asarray(np.asarray(x) / s, jnp.float32).astype(FP8))
    expected = (qx @ _np(q)) * s * np.asarray(scale, np.float64) + np.asarray(b, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=2e-6, atol=2e-6)
    # and what it approximates: the float product, within fp8's rounding of both operands (2^-4 each)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    rel = np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact)
    assert 1e-4 < rel < 0.06, rel


def test_zero_input_gets_a_unit_scale():
    q, s = C.quantize_input(jnp.zeros((3, 4)))
    assert float(s) == 1.0 and q.dtype == FP8 and not np.any(_np(q))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(96, name="big")(x)  # 64 x 96 = 6144 weights: quantized with min_size 4096
        x = nn.Conv(96, (3,), name="conv")(x)  # a 3-D kernel: weight-only
        return nn.Dense(8, name="small")(jax.nn.gelu(x))  # 96 x 8 = 768: below min_size, untouched


def test_only_fp8_dense_kernels_take_the_fp8_product():
    net = _Net()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 64))
    params = net.init(jax.random.PRNGKey(1), x)["params"]
    policy = P.QuantPolicy("fp8", components=("m",), min_size=4096, compute="fp8")
    qp = P.quantize_tree(params, policy, "m")
    assert qp["big"]["kernel"].dtype == FP8 and qp["conv"]["kernel"].dtype == FP8
    assert qp["small"]["kernel"].dtype == jnp.float32

    fp8 = jax.jit(lambda p, x: M.DequantizingModule(net, jnp.float32, "fp8").apply({"params": p}, x))
    weight_only = jax.jit(lambda p, x: M.DequantizingModule(net, jnp.float32).apply({"params": p}, x))
    # by hand: the big layer's fp8 product, then the dequantized conv and the float small layer
    deq = P.dequantize_tree(qp, jnp.float32)
    h = C.dense_quantized(x, qp["big"]["kernel"], qp["big"]["kernel_scale"], params["big"]["bias"], jnp.float32)
    h = nn.Conv(96, (3,)).apply({"params": deq["conv"]}, h)
    by_hand = nn.Dense(8).apply({"params": deq["small"]}, jax.nn.gelu(h))
    np.testing.assert_allclose(fp8(qp, x), by_hand, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(fp8(qp, x) - weight_only(qp, x)))) > 1e-4  # the input rounding shows

    hlo = jax.jit(fp8).lower(qp, x).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert sum("f8E4M3FN" in line for line in dots) == 1, dots  # one fp8 x fp8 product: the big layer's


def test_the_embedded_model_with_fp8_compute_stays_close_to_weight_only_fp8():
    prompts, kw = ["a red circle on a blue background"], dict(steps=6, seed=0, output_type="np")
    pipe, params = load_pipeline(None, quantize=P.QuantPolicy("fp8", components=("unet",), compute="fp8"))
    assert pipe.quantization.compute == "fp8"
    ref_pipe, _ = load_pipeline(None, quantize="fp8")
    out, ref = pipe.generate(prompts, **kw), ref_pipe.generate(prompts, **kw)
    err = np.abs(out - ref)
    print(f"fp8 compute vs weight-only fp8: mean abs {err.mean():.4f}, max {err.max():.4f}")
    assert out.shape == ref.shape and 0 < float(err.mean()) < 0.02


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(scheme="int8", compute="fp8"), r"compute='fp8' needs scheme='fp8'"),
        (dict(scheme="fp8", compute="int4"), r"QuantPolicy.compute='int4'"),
    ],
)
def test_bad_compute_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        P.QuantPolicy(**kwargs)
