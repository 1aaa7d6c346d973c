"""Quantized ControlNets (weight-only): `load_controlnet(..., quantize=)` equals quantizing the loaded params, from
a folder and from one file; a pipeline loaded with `quantize=` quantizes the nets it loads by path as its UNet;
the quantized net's image equals the one of its own weights dequantized on the host (the in-program
dequantization) and stays near the float net's; params holding several nets, compute policies and bad values.

The tiny SD 1.x UNet of tests/reference.py and a ControlNet made from it (tests/controlnet_cases.py): its down
blocks' 3x3 convolutions and attention projections are the kernels of at least `DEFAULT_MIN_SIZE` weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from controlnet_cases import control_images, torch_controlnet

from sdjax import StableDiffusionControlNetPipeline, quant
from sdjax.loading.controlnet import load_controlnet
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import params as P

KW = dict(seed=3, steps=2, height=64, width=64, output_type="np")


@pytest.fixture(scope="module")
def net_dir(torch_sd1, tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant-cn")
    torch_controlnet(torch_sd1.unet, 7).save_pretrained(folder, safe_serialization=True)
    return folder


def _same_tree(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_load_controlnet_quantized_equals_quantizing_after(net_dir, scheme):
    module, float_params = load_controlnet(net_dir)
    after = P.quantize_tree(float_params, P.QuantPolicy(scheme, components=("controlnet",)), "controlnet")
    kernels = P.quantized_kernels(after)
    assert len(kernels) >= 4 and all(q.dtype == jnp.dtype(quant.SCHEMES[scheme]) for q, _ in kernels.values())
    q_module, folder_params = load_controlnet(net_dir, quantize=scheme)
    assert q_module.config == module.config
    _same_tree(folder_params, after)  # quantized tensor by tensor while converting: the same values
    file = net_dir / "diffusion_pytorch_model.safetensors"  # the diffusers layout in one file, its config beside
    _, file_params = load_controlnet(file, config=net_dir, quantize=scheme)
    _same_tree(file_params, after)


@pytest.fixture(scope="module")
def quantized_pipe(sd1_dir):
    pipe, _ = load_pipeline(str(sd1_dir), quantize="int8")
    return pipe


def test_a_quantized_pipeline_quantizes_the_controlnet_it_loads(quantized_pipe, net_dir):
    """The net given by path follows the UNet (int8, weight-only); its image equals the one of its quantized
    weights dequantized on the host and given as float params (the dequantization inside the program), and differs
    from the float net's by the quantization only."""
    pipe = quantized_pipe
    image = control_images(5)[0]
    by_path = pipe.generate("a cat", controlnet=str(net_dir), control_image=image, **KW)
    (module, params), *_ = (v for k, v in pipe._controlnet_cache.items() if k[0] == str(net_dir))
    _same_tree(params, load_controlnet(net_dir, quantize="int8")[1])
    host = P.dequantize_tree(params, jnp.float32)
    dequantized = pipe.generate("a cat", controlnet=(module, host), control_image=image, **KW)
    np.testing.assert_allclose(by_path, dequantized, atol=2e-5)
    _, float_params = load_controlnet(net_dir)
    float_net = pipe.generate("a cat", controlnet=(module, float_params), control_image=image, **KW)
    plain = pipe.generate("a cat", **KW)
    err, effect = float(np.abs(by_path - float_net).mean()), float(np.abs(float_net - plain).mean())
    print(f"int8 ControlNet against float: mean abs {err:.5f}; the net's own effect {effect:.4f}")
    assert 0 < err < 0.01
    assert effect > 10 * err  # the net acts, far beyond its quantization error


def test_legacy_controlnet_pipeline_loads_the_net_quantized(sd1_dir, net_dir):
    _, params = StableDiffusionControlNetPipeline.from_pretrained(str(sd1_dir), controlnet=str(net_dir), quantize="fp8")
    _same_tree(params["controlnet"], load_controlnet(net_dir, quantize="fp8")[1])
    assert P.quantized_kernels(params["unet"])


def test_quantize_pipeline_quantizes_every_net_in_params(quantized_pipe, net_dir):
    """Several nets under params["controlnet"] (a list): each tree is quantized; the UNet's already quantized
    kernels are kept; a compute policy cannot name the nets (they run weight-only)."""
    pipe = quantized_pipe
    _, tree = load_controlnet(net_dir)
    params = {**pipe.params, "controlnet": [tree, tree]}
    policy = P.QuantPolicy("int8", components=("unet", "controlnet"))
    out = P.quantize_params(params, policy)
    assert isinstance(out["controlnet"], list) and len(out["controlnet"]) == 2
    for net in out["controlnet"]:
        _same_tree(net, load_controlnet(net_dir, quantize="int8")[1])
    assert out["unet"] is not params["unet"] and not P.has_quantized(params["controlnet"][0])
    _same_tree(out["unet"], params["unet"])
    with pytest.raises(ValueError, match="ControlNets run weight-only"):
        P.QuantPolicy("int8", components=("unet", "controlnet"), compute="int8")


def test_a_folders_own_controlnet_follows_the_unet(sd1_dir, net_dir):
    """`quantize_pipeline` (what `from_pretrained(quantize=)` calls after loading) quantizes the params' own
    ControlNet as the UNet, with the policy's `min_size`; a policy that leaves the UNet float leaves the net too."""
    _, tree = load_controlnet(net_dir)
    pipe, params = load_pipeline(str(sd1_dir))
    policy = P.QuantPolicy("int8", components=("unet",), min_size=4096)
    _, out = quant.quantize_pipeline(pipe, {**params, "controlnet": tree}, policy)
    want = P.quantize_tree(tree, P.QuantPolicy("int8", components=("controlnet",), min_size=4096), "controlnet")
    _same_tree(out["controlnet"], want)
    pipe, params = load_pipeline(str(sd1_dir))
    text_only = P.QuantPolicy("int8", components=("text_encoder",), min_size=64)
    _, out = quant.quantize_pipeline(pipe, {**params, "controlnet": tree}, text_only)
    assert out["controlnet"] is tree and P.has_quantized(out["text_encoder"])


@pytest.mark.parametrize(
    "quantize,match",
    [
        ("int4", r"quantize='int4'"),
        (P.QuantPolicy("int8", components=("unet",)), r"components=\('unet',\).*'controlnet'"),
    ],
)
def test_bad_quantize_is_named_before_loading(quantize, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load_controlnet(tmp_path / "no-such-net", quantize=quantize)


def test_controlnet_policy_follows_the_denoiser():
    follow = P.controlnet_policy(P.QuantPolicy("fp8", min_size=99, exclude=("x",)), "unet")
    assert follow == P.QuantPolicy("fp8", components=("controlnet",), min_size=99, exclude=("x",))
    assert P.controlnet_policy(P.QuantPolicy("int8", components=("text_encoder",)), "unet") is None
    assert P.controlnet_policy(None, "unet") is None
    compute = P.QuantPolicy("int8", components=("transformer",), compute="int8")
    assert P.controlnet_policy(compute, "transformer").compute is None
