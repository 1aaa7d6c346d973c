"""`sdjax.ops.conv.conv2d`: every implementation equals `lax.conv_general_dilated` (and PyTorch's conv2d) for
the strides/paddings the SD models use; the Flax `Conv2d` module loads diffusers Conv2d weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from sdjax.ops.conv import IMPLEMENTATIONS, Conv2d, conv2d, normalize_padding

# (kernel, stride, padding as passed to conv2d, the same padding as lax pads) — the SD UNet/VAE convs:
# 3x3 pad 1 (resnets, conv_in/out, upsamplers), 3x3 stride 2 pad 1 (UNet Downsample2D), the VAE encoder's
# Downsample2D (pad bottom/right by one, then stride 2 unpadded), 1x1 (shortcuts, proj_in/out, VAE quant convs).
CASES = [
    (3, 1, 1, ((1, 1), (1, 1))),
    (3, 2, 1, ((1, 1), (1, 1))),
    (3, 2, ((0, 1), (0, 1)), ((0, 1), (0, 1))),
    (3, 2, 0, ((0, 0), (0, 0))),
    (1, 1, 0, ((0, 0), (0, 0))),
    (3, 1, (1, 1), ((1, 1), (1, 1))),
]


def _reference(x, k, b, stride, pads):
    y = lax.conv_general_dilated(
        x, k, (stride, stride), pads, dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    return y + b


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("kernel,stride,padding,pads", CASES)
@pytest.mark.parametrize("hw", [(8, 8), (9, 7)])
def test_matches_lax(impl, kernel, stride, padding, pads, hw):
    rng = np.random.default_rng(kernel * 10 + stride)
    x = jnp.asarray(rng.standard_normal((2, *hw, 12), dtype=np.float32))
    k = jnp.asarray(rng.standard_normal((kernel, kernel, 12, 20), dtype=np.float32) / kernel)
    b = jnp.asarray(rng.standard_normal((20,), dtype=np.float32))
    want = _reference(x, k, b, stride, pads)
    got = jax.jit(lambda x, k, b: conv2d(x, k, b, stride=stride, padding=padding, impl=impl))(x, k, b)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_no_bias_and_tuple_stride():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 10, 10, 4), dtype=np.float32))
    k = jnp.asarray(rng.standard_normal((3, 3, 4, 5), dtype=np.float32))
    want = lax.conv_general_dilated(
        x, k, (2, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=lax.Precision.HIGHEST
    )
    for impl in IMPLEMENTATIONS:
        got = conv2d(x, k, None, stride=(2, 1), padding=1, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 6, 6, 8), dtype=np.float32)
    w_oihw = rng.standard_normal((16, 8, 3, 3), dtype=np.float32)
    b = rng.standard_normal((16,), dtype=np.float32)
    for stride, pad in ((1, 1), (2, 1)):
        want = torch.nn.functional.conv2d(
            torch.from_numpy(x).permute(0, 3, 1, 2),
            torch.from_numpy(w_oihw),
            torch.from_numpy(b),
            stride=stride,
            padding=pad,
        ).permute(0, 2, 3, 1)
        for impl in IMPLEMENTATIONS:
            got = conv2d(
                jnp.asarray(x),
                jnp.asarray(w_oihw.transpose(2, 3, 1, 0)),
                jnp.asarray(b),
                stride=stride,
                padding=pad,
                impl=impl,
            )
            np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-4, atol=1e-4)


def test_padding_forms():
    assert normalize_padding(1, (3, 3), (1, 1), (8, 8)) == ((1, 1), (1, 1))
    assert normalize_padding((1, 2), (3, 3), (1, 1), (8, 8)) == ((1, 1), (2, 2))
    assert normalize_padding(((0, 1), (0, 1)), (3, 3), (2, 2), (8, 8)) == ((0, 1), (0, 1))
    assert normalize_padding("VALID", (3, 3), (1, 1), (8, 8)) == ((0, 0), (0, 0))
    assert normalize_padding("SAME", (3, 3), (1, 1), (8, 8)) == ((1, 1), (1, 1))


@pytest.mark.parametrize(
    "bad",
    [
        dict(impl="winograd"),
        dict(padding="FULL"),
        dict(padding=(1, 2, 3)),
        dict(stride=0),
    ],
)
def test_bad_arguments(bad):
    x, k = jnp.zeros((1, 4, 4, 3)), jnp.zeros((3, 3, 3, 2))
    with pytest.raises(ValueError, match="conv2d"):
        conv2d(x, k, **bad)


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"4 channels.*\(3, 3, 3, 2\)"):
        conv2d(jnp.zeros((1, 4, 4, 4)), jnp.zeros((3, 3, 3, 2)))
    with pytest.raises(ValueError, match="bias"):
        conv2d(jnp.zeros((1, 4, 4, 3)), jnp.zeros((3, 3, 3, 2)), jnp.zeros((3,)))


def test_flax_module_params_and_torch_weights():
    """`Conv2d` has nn.Conv's param names and layout (kernel (kh, kw, in, out), bias (out,)), so diffusers'
    `weight (O, I, kh, kw)` -> `kernel (kh, kw, I, O)` converts into it unchanged."""
    import flax.linen as nn

    x = jnp.ones((1, 8, 8, 4))
    for kw in (dict(stride=1, padding=1), dict(stride=2, padding=((0, 1), (0, 1)))):
        ours = Conv2d(6, 3, **kw)
        params = ours.init(jax.random.key(0), x)["params"]
        assert {k: v.shape for k, v in params.items()} == {"kernel": (3, 3, 4, 6), "bias": (6,)}
    ref = nn.Conv(6, (3, 3), padding=((1, 1), (1, 1)))
    ref_params = ref.init(jax.random.key(0), x)["params"]
    assert jax.tree.map(jnp.shape, ref_params) == jax.tree.map(
        jnp.shape, Conv2d(6, 3, padding=1).init(jax.random.key(0), x)["params"]
    )
    rng = np.random.default_rng(3)
    p = {
        "kernel": jnp.asarray(rng.standard_normal((3, 3, 4, 6), dtype=np.float32)),
        "bias": jnp.asarray(rng.standard_normal((6,), dtype=np.float32)),
    }
    xr = jnp.asarray(rng.standard_normal((2, 8, 8, 4), dtype=np.float32))
    np.testing.assert_allclose(
        np.asarray(Conv2d(6, 3, padding=1).apply({"params": p}, xr)),
        np.asarray(ref.apply({"params": p}, xr)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_flax_module_dtype_and_no_bias():
    m = Conv2d(4, 1, use_bias=False, dtype=jnp.bfloat16)
    params = m.init(jax.random.key(0), jnp.ones((1, 4, 4, 3)))["params"]
    assert set(params) == {"kernel"} and params["kernel"].dtype == jnp.float32
    assert m.apply({"params": params}, jnp.ones((1, 4, 4, 3))).dtype == jnp.bfloat16
