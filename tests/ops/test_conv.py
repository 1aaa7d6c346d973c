"""`sdjax.ops.conv`: the Conv module is flax's nn.Conv with the same params, and Winograd's F(2x2, 3x3) computes the
same convolution as XLA's and as PyTorch's conv2d (independent references), at even and odd sizes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax.ops import conv as ops_conv


def _rand(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize(
    "kernel, stride, padding", [(3, 1, 1), (3, 2, 1), (1, 1, 0), (3, 2, ((0, 1), (0, 1))), (3, 1, 0)]
)
def test_module_is_flax_conv(kernel, stride, padding):
    """Same param tree and initial values as nn.Conv for the same key, and the same outputs."""
    pad = ((padding, padding), (padding, padding)) if isinstance(padding, int) else padding
    ours = ops_conv.Conv(8, (kernel, kernel), strides=(stride, stride), padding=pad)
    theirs = nn.Conv(8, (kernel, kernel), strides=(stride, stride), padding=pad)
    x = _rand((2, 9, 11, 5), 0)
    p_ours, p_theirs = ours.init(jax.random.key(3), x), theirs.init(jax.random.key(3), x)
    assert jax.tree_util.tree_structure(p_ours) == jax.tree_util.tree_structure(p_theirs)
    for a, b in zip(jax.tree_util.tree_leaves(p_ours), jax.tree_util.tree_leaves(p_theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    p = {"params": {"kernel": _rand((kernel, kernel, 5, 8), 1, 0.2), "bias": _rand((8,), 2)}}
    np.testing.assert_allclose(ours.apply(p, x), theirs.apply(p, x), rtol=1e-6, atol=1e-6)


def test_winograd_kernel_is_g_g_gt():
    """The kernel transform (written as additions) is Lavin & Gray's `G g G^T` per (Cin, Cout) pair, positions
    row-major, computed here with float64 matrix products."""
    k = _rand((3, 3, 5, 7), 4)
    g = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    want = np.einsum("ai,ijcd,bj->abcd", g, k.astype(np.float64), g).reshape(16, 5, 7)
    np.testing.assert_allclose(np.asarray(ops_conv.winograd_kernel(jnp.asarray(k))), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 6, 8, 3), (1, 7, 5, 2), (1, 1, 1, 4)])
def test_winograd_input_is_bt_d_b_of_every_tile(shape):
    """The input transform is `B^T d B` of each 4x4 tile (stride 2) of the input padded by one (odd sizes padded
    further), computed here tile by tile with float64 matrix products."""
    x = _rand(shape, 5)
    n, h, w, c = shape
    th, tw = -(-h // 2), -(-w // 2)
    bt = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 2 * th + 1 - h), (1, 2 * tw + 1 - w), (0, 0)))
    want = np.empty((4, 4, n, th, tw, c))
    for i in range(th):
        for j in range(tw):
            tile = xp[:, 2 * i : 2 * i + 4, 2 * j : 2 * j + 4]  # (n, 4, 4, c)
            want[:, :, :, i, j] = np.einsum("ar,nrsc,bs->abnc", bt, tile, bt)
    got = np.asarray(jax.jit(ops_conv.winograd_input)(jnp.asarray(x)))
    np.testing.assert_allclose(got, want.reshape(16, n * th * tw, c), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 8, 8, 16), (1, 7, 5, 3), (3, 1, 1, 4), (1, 2, 9, 6)])
def test_winograd_equals_torch_conv2d(shape):
    torch = pytest.importorskip("torch")
    x, k = _rand(shape, 0), _rand((3, 3, shape[-1], 12), 1, 1 / np.sqrt(9 * shape[-1]))
    got = np.asarray(jax.jit(ops_conv.conv3x3_winograd)(x, ops_conv.winograd_kernel(jnp.asarray(k))))
    ref = torch.nn.functional.conv2d(
        torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(k).permute(3, 2, 0, 1), padding=1
    )
    ref = ref.permute(0, 2, 3, 1).numpy()
    assert got.shape == ref.shape
    # float32 rounding only (additions in the transforms): within a few ulps of the output scale
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()


def test_prepare_adds_leaves_by_the_rule_and_the_module_uses_them():
    c = ops_conv.WINOGRAD_MIN_CHANNELS
    params = {
        "big": {"kernel": _rand((3, 3, c, 4), 0, 0.02), "bias": _rand((4,), 1)},
        "narrow": {"kernel": _rand((3, 3, c - 1, 4), 0), "bias": _rand((4,), 1)},
        "pointwise": {"kernel": _rand((1, 1, c, 4), 0)},
        "half": {"kernel": jnp.asarray(_rand((3, 3, c, 4), 0), jnp.bfloat16)},
    }
    prepared = ops_conv.prepare(params)
    assert set(prepared["big"]) == {"kernel", "bias", "winograd"}
    for name in ("narrow", "pointwise", "half"):
        assert "winograd" not in prepared[name], name
    np.testing.assert_allclose(
        prepared["big"]["winograd"], ops_conv.winograd_kernel(jnp.asarray(params["big"]["kernel"])), rtol=0, atol=0
    )

    module = ops_conv.Conv(4, (3, 3), padding=((1, 1), (1, 1)))
    x = _rand((1, 6, 6, c), 2)
    direct = module.apply({"params": params["big"]}, x)
    # The module takes the leaf when there is one: a deliberately wrong leaf changes the output...
    wrong = {**prepared["big"], "winograd": prepared["big"]["winograd"] * 2}
    doubled = jax.jit(module.apply)({"params": wrong}, x) - params["big"]["bias"]
    np.testing.assert_allclose(doubled, 2 * (direct - params["big"]["bias"]), rtol=1e-4, atol=1e-5)
    # ...and the right one gives the direct convolution's numbers.
    np.testing.assert_allclose(jax.jit(module.apply)({"params": prepared["big"]}, x), direct, rtol=1e-5, atol=1e-5)
    # A stride-2 module ignores the leaf.
    down = ops_conv.Conv(4, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    np.testing.assert_array_equal(down.apply({"params": wrong}, x), down.apply({"params": params["big"]}, x))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"\(3, 3, Cin, Cout\)"):
        ops_conv.winograd_kernel(jnp.zeros((1, 1, 4, 4)))
    with pytest.raises(ValueError, match="does not fit"):
        ops_conv.conv3x3_winograd(jnp.zeros((1, 4, 4, 8)), jnp.zeros((16, 4, 4)))


def test_cpu_lowering_replaces_the_prepared_convolutions():
    """On CPU a prepared 3x3 conv lowers without a convolution op (the Winograd branch is the one kept)."""
    c = ops_conv.WINOGRAD_MIN_CHANNELS
    module = ops_conv.Conv(4, (3, 3), padding=((1, 1), (1, 1)))
    params = {"kernel": jnp.zeros((3, 3, c, 4)), "bias": jnp.zeros((4,))}
    x = jnp.zeros((1, 4, 4, c))
    plain = jax.jit(module.apply).lower({"params": params}, x).as_text()
    prepared = jax.jit(lambda p, x: module.apply({"params": ops_conv.prepare(p)}, x)).lower(params, x).as_text()
    assert "convolution" in plain and "convolution" not in prepared


def test_unet_and_vae_with_winograd_everywhere_match_direct(sd1_dir, monkeypatch):
    """The tiny SD 1.x UNet and VAE decoder with every 3x3 conv on Winograd (threshold 1) give the numbers of XLA's
    convolution (whose agreement with diffusers the model parity tests check)."""
    from sdjax.core import autoencoder
    from sdjax.loading.components import load_pipeline_components

    components, params, _ = load_pipeline_components(sd1_dir)
    unet, vae = components["unet"], components["vae"]
    x = jnp.asarray(_rand((2, 4, 8, 8), 0))
    context = jnp.asarray(_rand((2, 77, unet.config.cross_attention_dim), 1))
    t = jnp.asarray([10.0, 500.0])

    def run(p):
        noise = unet.apply({"params": ops_conv.prepare(p["unet"])}, x, t, context)
        return noise, autoencoder.decode(vae, p["vae"], x[:1], jnp.float32)

    monkeypatch.setattr(ops_conv, "WINOGRAD_MIN_CHANNELS", 10**9)
    direct = jax.jit(lambda p: run(p))(params)  # a new function each time: jit caches traces per function
    monkeypatch.setattr(ops_conv, "WINOGRAD_MIN_CHANNELS", 1)
    winograd = jax.jit(lambda p: run(p))(params)
    for got, want in zip(winograd, direct, strict=True):
        err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
        assert 0 < err <= 1e-5  # > 0: the other path really ran


@pytest.mark.parametrize("shape", [(2, 4, 4, 8), (1, 3, 5, 3), (1, 1, 1, 4)])
def test_subpixel_upsampled_conv_equals_torch_interpolate_then_conv2d(shape):
    """The 2x2 sub-pixel conv of the input gives PyTorch's nearest 2x `interpolate` followed by the 3x3 conv."""
    torch = pytest.importorskip("torch")
    x, k = _rand(shape, 0), _rand((3, 3, shape[-1], 6), 1, 1 / np.sqrt(9 * shape[-1]))
    got = np.asarray(jax.jit(ops_conv.conv3x3_upsampled)(x, ops_conv.subpixel_kernel(jnp.asarray(k))))
    up = torch.nn.functional.interpolate(torch.from_numpy(x).permute(0, 3, 1, 2), scale_factor=2.0, mode="nearest")
    ref = torch.nn.functional.conv2d(up, torch.from_numpy(k).permute(3, 2, 0, 1), padding=1)
    ref = ref.permute(0, 2, 3, 1).numpy()
    assert got.shape == ref.shape == (shape[0], 2 * shape[1], 2 * shape[2], 6)
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()


def test_subpixel_kernel_taps_are_sums_of_kernel_rows_and_columns():
    """Row phase 0 reads (k0, k1 + k2), phase 1 (k0 + k1, k2); the same over columns; channels are 4 o + 2 a + b."""
    k = _rand((3, 3, 2, 3), 5).astype(np.float64)
    taps = [np.array([[1, 0, 0], [0, 1, 1]]), np.array([[1, 1, 0], [0, 0, 1]])]  # (tap, kernel row), per phase
    u = np.asarray(ops_conv.subpixel_kernel(jnp.asarray(k, jnp.float32)))
    assert u.shape == (2, 2, 2, 12)
    for a in range(2):
        for b in range(2):
            want = np.einsum("ri,ijcd,sj->rscd", taps[a], k, taps[b])
            np.testing.assert_allclose(u[..., 2 * a + b :: 4], want, rtol=1e-6, atol=1e-6)


def test_upsampler_module_takes_the_subpixel_path_on_cpu_and_prepare_adds_its_leaf():
    """`Conv(upsample2x=True)` is nn.Conv of the 2x upsampled input; on CPU it lowers to the 2x2 sub-pixel conv (with
    or without the leaf); `prepare` puts a `subpixel` leaf (not a Winograd one) under `upsamplers_*` keys."""
    c = ops_conv.WINOGRAD_MIN_CHANNELS
    params = {"kernel": _rand((3, 3, c, 4), 0, 0.02), "bias": _rand((4,), 1)}
    tree = {"up_blocks_0": {"upsamplers_0": {"conv": params}}, "conv": params}
    prepared = ops_conv.prepare(tree)
    assert set(prepared["up_blocks_0"]["upsamplers_0"]["conv"]) == {"kernel", "bias", "subpixel"}
    assert set(prepared["conv"]) == {"kernel", "bias", "winograd"}

    module = ops_conv.Conv(4, (3, 3), padding=((1, 1), (1, 1)), upsample2x=True)
    x = _rand((1, 3, 4, c), 2)
    up = np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)
    want = nn.Conv(4, (3, 3), padding=((1, 1), (1, 1))).apply({"params": params}, up)
    leaf = prepared["up_blocks_0"]["upsamplers_0"]["conv"]
    for p in (params, leaf):
        lowered = jax.jit(module.apply).lower({"params": p}, x).as_text()
        assert f"tensor<2x2x{c}x16xf32>" in lowered  # the sub-pixel kernel, not the 3x3 one, is convolved
        np.testing.assert_allclose(jax.jit(module.apply)({"params": p}, x), want, rtol=1e-5, atol=1e-5)
    # the leaf is the one used: a wrong leaf changes the output
    wrong = {**leaf, "subpixel": leaf["subpixel"] * 0}
    np.testing.assert_allclose(module.apply({"params": wrong}, x), np.broadcast_to(params["bias"], want.shape))


def test_winograd_is_not_taken_above_its_pixel_limit(monkeypatch):
    """A prepared 3x3 conv runs Winograd's path up to `WINOGRAD_MAX_PIXELS` pixels per image and XLA's above."""
    c = ops_conv.WINOGRAD_MIN_CHANNELS
    module = ops_conv.Conv(4, (3, 3), padding=((1, 1), (1, 1)))
    params = ops_conv.prepare({"kernel": jnp.zeros((3, 3, c, 4)), "bias": jnp.zeros((4,))})
    monkeypatch.setattr(ops_conv, "WINOGRAD_MAX_PIXELS", 16)
    small = jax.jit(module.apply).lower({"params": params}, jnp.zeros((1, 4, 4, c))).as_text()
    large = jax.jit(module.apply).lower({"params": params}, jnp.zeros((1, 4, 5, c))).as_text()
    assert "convolution" not in small and "convolution" in large
