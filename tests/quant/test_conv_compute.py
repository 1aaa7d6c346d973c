"""8-bit compute for convolutions (`QuantPolicy(compute="int8" | "fp8")`, `compute_convs=True`, the default): a conv's
int8 x int8 (int32 accumulation) and fp8 x fp8 (float32 accumulation) product against a float64 computation of the
same quantized operands, for every window the models use (3x3 same, stride 2, 1x1, the upsamplers' conv of the 2x
input, flax's strided VALID patch embedding); their FLOP count against XLA's own; one int8 convolution per selected
conv layer in the embedded UNet's program (and none with `compute_convs=False`), and the count an AOT compile uses
against a hand count of the UNet's Dense and conv layers.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compute_helpers import as_float64, layer_flops_by_hand

from sdjax import quant
from sdjax.ops import conv as ops_conv
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import compute as C
from sdjax.quant import modules as M
from sdjax.quant import params as P

# (name, kernel size, conv_quantized options, numpy reference's (stride, padding, upsample))
WINDOWS = [
    ("3x3 same", 3, dict(padding=((1, 1), (1, 1))), (1, 1, False)),
    ("3x3 stride 2", 3, dict(strides=(2, 2), padding=((1, 1), (1, 1))), (2, 1, False)),
    ("1x1", 1, dict(), (1, 0, False)),
    ("3x3 of the 2x upsampled input", 3, dict(padding=((1, 1), (1, 1)), upsample2x=True), (1, 1, True)),
]


def _quantized_input(x: np.ndarray, mode: str, amax: float | None = None) -> tuple[np.ndarray, float]:
    """The input's per-tensor quantization by hand -> (quantized values as float64, scale)."""
    s = float(np.abs(x).max() if amax is None else amax) / (127.0 if mode == "int8" else 448.0)
    y = np.asarray(x, np.float32) / np.float32(s)
    if mode == "int8":
        return np.clip(np.round(y.astype(np.float64)), -127, 127), s
    return as_float64(jnp.asarray(np.clip(y, -448, 448)).astype(jnp.float8_e4m3fn)), s


def _conv_reference(x, q, scale, b, mode, stride=1, pad=1, upsample=False, amax=None) -> np.ndarray:
    """The conv of the quantized operands in float64: input quantized per tensor, the stored kernel, products summed
    tap by tap (exact for int8: integers below 2^53), then scaled by `s_x * scale` and the bias added."""
    qx, s = _quantized_input(np.asarray(x, np.float32), mode, amax)
    if upsample:
        qx = qx.repeat(2, axis=1).repeat(2, axis=2)
    w = as_float64(q)
    kh, kw = w.shape[:2]
    xp = np.pad(qx, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    ho, wo = (xp.shape[1] - kh) // stride + 1, (xp.shape[2] - kw) // stride + 1
    acc = np.zeros((qx.shape[0], ho, wo, w.shape[-1]))
    for i in range(kh):
        for j in range(kw):
            acc += xp[:, i : i + stride * ho : stride, j : j + stride * wo : stride, :] @ w[i, j]
    return acc * s * np.asarray(scale, np.float64) + np.asarray(b, np.float64)


def _operands(kernel: int, mode: str, cin: int = 24, cout: int = 40):
    rng = np.random.default_rng(kernel)
    x = jnp.asarray(2.0 * rng.standard_normal((2, 9, 7, cin)), jnp.float32)  # odd sizes: the windows' edges
    w = jnp.asarray(rng.standard_normal((kernel, kernel, cin, cout)) / 10, jnp.float32)
    b = jnp.asarray(rng.standard_normal(cout), jnp.float32)
    q, scale = quant.scheme.quantize_kernel(w, mode)
    return x, w, b, q, scale


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("name, kernel, options, ref", WINDOWS, ids=[w[0] for w in WINDOWS])
def test_conv_is_the_product_of_the_quantized_operands(mode, name, kernel, options, ref):
    x, w, b, q, scale = _operands(kernel, mode)
    y = C.conv_quantized(x, q, scale, b, jnp.float32, **options)
    expected = _conv_reference(x, q, scale, b, mode, *ref)
    assert y.shape == expected.shape, (name, y.shape, expected.shape)
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=1e-6, atol=2e-6)
    # a static range: the same reference with that range (inputs beyond it saturate)
    amax = 0.6 * float(jnp.max(jnp.abs(x)))
    static = C.conv_quantized(x, q, scale, b, jnp.float32, amax, **options)
    np.testing.assert_allclose(np.asarray(static, np.float64), _conv_reference(x, q, scale, b, mode, *ref, amax=amax),
                               rtol=1e-6, atol=2e-6)  # fmt: skip
    # what it approximates: the float conv of the upsampled input, within 8-bit rounding of both operands
    xf = ops_conv.upsample2x_nearest(x) if options.get("upsample2x") else x
    exact = ops_conv.conv2d(xf, w, stride=ref[0], padding=((ref[1],) * 2,) * 2) + b
    rel = float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))
    assert 1e-4 < rel < (0.03 if mode == "int8" else 0.06), rel


def test_an_int8_conv_is_one_int8_convolution_accumulated_in_int32():
    x, _, b, q, scale = _operands(3, "int8")
    run = jax.jit(lambda x, q, s, b: C.conv_quantized(x, q, s, b, jnp.float32, padding=((1, 1), (1, 1))))
    lowered = [line for line in run.lower(x, q, scale, b).as_text().splitlines() if "stablehlo.convolution" in line]
    assert len(lowered) == 1 and "x24xi8>" in lowered[0] and "x40xi8>" in lowered[0] and "x40xi32>" in lowered[0]
    compiled = [line for line in run.lower(x, q, scale, b).compile().as_text().splitlines() if "convolution(" in line]
    assert len(compiled) == 1 and compiled[0].split("=")[1].strip().startswith("s32["), compiled  # XLA:CPU runs it
    # a sum that float32 would round: 3x3x1280 taps of 127 x -128 (|sum| > 2^24) come out exact
    big_x = jnp.full((1, 3, 3, 1280), 127.0, jnp.float32)  # s_x = 1
    big_q = jnp.full((3, 3, 1280, 1), -128, jnp.int8).at[1, 1, 0, 0].set(127)
    y = C.conv_quantized(big_x, big_q, jnp.ones((1,)), None, jnp.float32, padding=((1, 1), (1, 1)))
    assert float(y[0, 1, 1, 0]) == float(np.float32(127 * (127 - 128 * (9 * 1280 - 1))))


@pytest.mark.parametrize(
    "shape, kernel, options",
    [
        ((2, 16, 16, 8), 3, dict(padding=((1, 1), (1, 1)))),
        ((2, 16, 16, 8), 3, dict(strides=(2, 2), padding=((1, 1), (1, 1)))),
        ((1, 8, 8, 8), 3, dict(padding=((1, 1), (1, 1)), upsample2x=True)),
        ((2, 9, 9, 8), 1, dict()),
        ((1, 16, 16, 8), 2, dict(strides=(2, 2), padding="VALID")),
    ],
)
def test_conv_flops_are_counted_as_xla_counts_them(shape, kernel, options):
    """`quantized_flops` of an int8 conv equals XLA's cost analysis of the same float conv (2 per multiply-add that
    reads input, not padding)."""
    q = jax.ShapeDtypeStruct((kernel, kernel, shape[-1], 16), jnp.int8)
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    int8 = jax.make_jaxpr(lambda x, q: C.conv_quantized(x, q, jnp.ones(16), None, jnp.float32, **options))(x, q)

    def float_conv(x, w):
        x = ops_conv.upsample2x_nearest(x) if options.get("upsample2x") else x
        window = {k: v for k, v in options.items() if k != "upsample2x"}
        return jax.lax.conv_general_dilated(x, w, window.get("strides", (1, 1)), window.get("padding", "VALID"),
                                            dimension_numbers=C.NHWC)  # fmt: skip

    w = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    cost = jax.jit(float_conv).lower(x, w).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert C.quantized_flops(int8) == {"int8": pytest.approx(cost["flops"], rel=1e-9), "fp8": 0.0}


class _PatchNet(nn.Module):
    """SD 3's patch embedding: a flax Conv, 2x2 stride 2 VALID."""

    @nn.compact
    def __call__(self, x):
        return nn.Conv(64, (2, 2), strides=(2, 2), padding="VALID", name="proj")(x)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_flax_conv_computes_quantized_too(mode):
    net = _PatchNet()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 48))
    params = net.init(jax.random.PRNGKey(1), x)["params"]
    qp = P.quantize_tree(params, P.QuantPolicy(mode, components=("m",), min_size=4096, compute=mode), "m")
    node = qp["proj"]
    apply = jax.jit(lambda p, x: M.DequantizingModule(net, jnp.float32, mode).apply({"params": p}, x))
    ref = _conv_reference(x, node["kernel"], node["kernel_scale"], node["bias"], mode, stride=2, pad=0)
    np.testing.assert_allclose(np.asarray(apply(qp, x), np.float64), ref, rtol=1e-6, atol=2e-6)
    qtype = "xi8>" if mode == "int8" else "xf8E4M3FN>"
    convs = [line for line in apply.lower(qp, x).as_text().splitlines() if "stablehlo.convolution" in line]
    assert len(convs) == 1 and convs[0].count(qtype) == 2, convs


def _unet_program(policy):
    pipe, params = load_pipeline(None, quantize=policy)
    unet, cfg = pipe.unet, pipe.unet.config
    x = jax.ShapeDtypeStruct((2, cfg.in_channels, cfg.sample_size, cfg.sample_size), jnp.float32)
    t = jax.ShapeDtypeStruct((2,), jnp.float32)
    ctx = jax.ShapeDtypeStruct((2, 77, cfg.cross_attention_dim), jnp.float32)
    return unet, params["unet"], (x, t, ctx)


def _int8_convs(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines() if "stablehlo.convolution" in line and "xi8>" in line]


def test_the_embedded_unet_has_one_int8_conv_per_selected_conv_layer():
    policy = P.QuantPolicy("int8", components=("unet",), compute="int8")
    unet, params, args = _unet_program(policy)
    convs = {p: q.shape for p, (q, _) in C.compute_kernels(params, "int8").items() if q.ndim == 4}
    dense = {p: q.shape for p, (q, _) in C.compute_kernels(params, "int8").items() if q.ndim == 2}
    # the rule: every 4-D kernel of >= 16,384 weights (the 3x3 convs of the resnets, down- and upsamplers); the first
    # and last conv (3x3x4x32) and the transformers' 1x1 proj_in/proj_out stay float
    assert len(convs) == 21 and not any(k.endswith(("conv_in/kernel", "conv_out/kernel")) for k in convs), convs
    run = jax.jit(lambda p, *a: unet.apply({"params": p}, *a))
    lowered = run.lower(params, *args).as_text()
    int8 = _int8_convs(lowered)
    assert len(int8) == len(convs) and all("xi32>" in line for line in int8)
    dots = [line for line in lowered.splitlines() if "dot_general" in line and "xi8>" in line]
    assert len(dots) == len(dense)

    # their FLOPs, as the AOT compile counts them (abstract params), against a hand count of every selected layer
    selected = C.compute_kernels(params, "int8")
    expected = layer_flops_by_hand(unet.module, P.dequantize_tree(params, jnp.float32), args, selected)
    assert len(expected) == len(convs) + len(dense)
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    assert C.quantized_flops(jax.make_jaxpr(run)(abstract, *args)) == {"int8": sum(expected), "fp8": 0.0}


def test_compute_convs_false_keeps_the_convs_weight_only():
    policy = P.QuantPolicy("int8", components=("unet",), compute="int8", compute_convs=False)
    unet, params, args = _unet_program(policy)
    assert unet.convs is False and C.compute_kernels(params, "int8", convs=False)
    assert not _int8_convs(jax.jit(lambda p, *a: unet.apply({"params": p}, *a)).lower(params, *args).as_text())
    with pytest.raises(TypeError, match="compute_convs=1"):
        P.QuantPolicy("int8", compute="int8", compute_convs=1)


@pytest.mark.slow
def test_the_embedded_model_with_int8_convs_against_float32():
    """The shape evaluation's 28 held-out prompts, 4 steps, seed 0: the images with the UNet's Dense layers and convs
    in int8 against the float32 ones, and the shape/colour scores against float32's. Measured: mean abs 0.0073, max
    0.47 with the suite's XLA flags (8 steps: 0.0233, max 0.91, every attribute's score within 1 image of float32's;
    without the flags, docs/benchmarks.md: 8 steps 0.0217, 4 / 20 steps 0.0076 / 0.0063; Dense layers only, 8 steps:
    0.0111); the test allows 0.01 mean at 4 steps (0.03 at 8 steps before) and 2 images per attribute."""
    from sdjax.evaluation.shapes import held_out_prompts, score

    prompts, scenes = held_out_prompts(2)
    kw = dict(steps=4, seed=0, output_type="np")
    policy = P.QuantPolicy("int8", components=("unet",), compute="int8")
    out = np.asarray(load_pipeline(None, quantize=policy)[0].generate(prompts, **kw), np.float32)
    ref = np.asarray(load_pipeline(None)[0].generate(prompts, **kw), np.float32)
    err = np.abs(out - ref)
    print(f"int8 Dense + conv compute vs float32, 4 steps: mean abs {err.mean():.4f}, max {err.max():.3f}")
    assert 0 < float(err.mean()) < 0.01

    def scores(images):
        return score([(255 * np.clip(x, 0, 1)).round().astype(np.uint8) for x in images], scenes)

    got, want = scores(out), scores(ref)
    for attribute in ("colour", "background", "shape", "position", "size", "all"):
        assert abs(got[attribute] - want[attribute]) <= 2 / len(prompts) + 1e-9, (attribute, got, want)
