"""Quantized pipelines (`from_pretrained(..., quantize=)`): the embedded SD model and a tiny Flux, their images
against the unquantized ones, the params' bytes, LoRA on a quantized model, bad values, the CLI option.

Tolerances: with these prompts and seed (float32 compute, 4 steps, 2 images of 64x64, the suite's XLA flags) int8
weights move the embedded model's images by 0.0004 mean / 0.022 max abs (PSNR 57 dB), fp8 by 0.0023 / 0.11 (42 dB)
(8 steps: int8 0.0005 / 0.04, 54 dB; fp8 0.0018 / 0.13, 42 dB); over the 28 held-out prompts
(benchmarks/quant_quality.py) int8 0.001-0.002 mean, fp8 0.004-0.006, bfloat16 compute alone 0.005-0.012. This
tiny model amplifies small weight changes at some seeds (fp8 at seed 3: 0.05 mean, one of the two images drawn
differently), so the tests allow int8 0.01 mean abs / 30 dB and fp8 0.02 / 25 dB.
Against the *same* quantized weights dequantized on the host and run unquantized, the in-program dequantization
must agree to float rounding (the CPU paths differ: the unquantized 3x3 convolutions take Winograd's, the quantized
ones XLA's direct convolution).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import quant
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import params as P

PROMPTS = ["a red circle on a blue background", "a green square"]
KW = dict(steps=4, seed=0, output_type="np")
# mean abs, PSNR floor per scheme (the embedded model, float32, 4 steps)
TOLERANCE = {"int8": (0.01, 30.0), "fp8": (0.02, 25.0)}


def _psnr(a, b):
    return float(10 * np.log10(1.0 / max(np.mean((a - b) ** 2), 1e-12)))


@pytest.fixture(scope="module")
def embedded():
    pipe, params = load_pipeline(None)
    return pipe, params, pipe.generate(PROMPTS, **KW)


@pytest.fixture(scope="module")
def quantized_pipes():
    """scheme -> (pipeline, params, its images of PROMPTS), each loaded and generated once for the module."""
    made = {}

    def get(scheme):
        if scheme not in made:
            pipe, params = load_pipeline(None, quantize=scheme)
            made[scheme] = pipe, params, pipe.generate(PROMPTS, **KW)
        return made[scheme]

    return get


@pytest.fixture(scope="module", params=["int8", "fp8"])
def quantized(request, quantized_pipes):
    return request.param, *quantized_pipes(request.param)


def test_images_stay_close_to_the_unquantized_ones(embedded, quantized):
    _, _, base = embedded
    scheme, pipe, _, out = quantized
    mean_tol, psnr_floor = TOLERANCE[scheme]
    err = np.abs(out - base)
    print(f"{scheme}: mean abs {float(err.mean()):.4f}, max abs {float(err.max()):.4f}, PSNR {_psnr(out, base):.1f} dB")
    assert out.shape == base.shape
    assert float(err.mean()) < mean_tol and _psnr(out, base) > psnr_floor, (float(err.mean()), _psnr(out, base))
    assert float(err.max()) > 0  # the weights did change


def test_in_program_dequantization_equals_dequantized_params(embedded, quantized):
    pipe0, params0, _ = embedded
    _, pipe, params, out = quantized
    host = {k: P.dequantize_tree(v, jnp.float32) if k == "unet" else v for k, v in params.items()}
    ref = pipe0.generate(PROMPTS, params=host, **KW)
    np.testing.assert_allclose(out, ref, atol=2e-3)


def test_params_hold_one_byte_kernels_and_half_the_bf16_bytes(embedded, quantized):
    _, params0, _ = embedded
    scheme, pipe, params, _ = quantized
    kernels = P.quantized_kernels(params["unet"])
    assert len(kernels) >= 30
    qtype = jnp.dtype(quant.SCHEMES[scheme])
    for path, (q, scale) in kernels.items():
        assert q.dtype == qtype and scale.dtype == jnp.float32 and scale.shape == q.shape[-1:], path
        assert q.size >= P.DEFAULT_MIN_SIZE, path
    flat0 = dict(jax.tree_util.tree_leaves_with_path(params0["unet"]))
    flat = dict(jax.tree_util.tree_leaves_with_path(params["unet"]))
    for key, leaf in flat0.items():  # biases, norms, small kernels (conv_in, conv_out): unchanged
        name = "/".join(str(k.key) for k in key)
        if name not in kernels:
            assert flat[key].dtype == leaf.dtype and np.array_equal(flat[key], leaf), name
    assert "conv_in/kernel" not in kernels and "conv_out/kernel" not in kernels
    # the quantized kernels: 1 byte per weight + 4 per output channel, against 2 in bfloat16
    q_bytes = sum(int(q.nbytes) + int(s.nbytes) for q, s in kernels.values())
    bf16_bytes = sum(2 * int(q.size) for q, _ in kernels.values())
    assert 1.9 < bf16_bytes / q_bytes <= 2.0
    # the whole UNet (float32 base): the quantized kernels are most of it
    assert P.nbytes(params["unet"]) < 0.5 * P.nbytes(params0["unet"])
    assert pipe.params is params and pipe.quantization.scheme == scheme
    for other in ("text_encoder", "vae"):
        assert params[other] is params0[other] or not P.has_quantized(params[other])


def _lora_file(tmp_path, params, rank=4, seed=0):
    """A diffusers/PEFT LoRA on three of the embedded UNet's quantized Dense kernels (feed-forward layers)."""
    from safetensors.numpy import save_file

    from sdjax.models.convert import path_to_torch_key

    r = np.random.default_rng(seed)
    paths = sorted(p for p in P.quantized_kernels(params["unet"]) if "/ff/" in p)[:3]
    tensors = {}
    for path in paths:
        q, _ = P.quantized_kernels(params["unet"])[path]
        cin, cout = q.shape
        module = path_to_torch_key(tuple(path.split("/"))).removesuffix(".weight")
        tensors[f"unet.{module}.lora_A.weight"] = (0.3 * r.standard_normal((rank, cin))).astype(np.float32)
        tensors[f"unet.{module}.lora_B.weight"] = (0.3 * r.standard_normal((cout, rank))).astype(np.float32)
    file = tmp_path / "tiny_lora.safetensors"
    save_file(tensors, str(file))
    return file, paths


def test_lora_on_a_quantized_model(tmp_path, quantized_pipes, request):
    """The delta is added in float32 to the dequantized kernel, then quantized again with a new per-channel scale:
    the fused kernel is within half an old step plus half a new step of the unquantized model's fused kernel; the
    LoRA changes the first image; unfusing gives the very base arrays (and the base images) back. On the module's
    int8 pipeline (unfused again at the end), against its images before the LoRA."""
    pipe, params, base_q = quantized_pipes("int8")
    request.addfinalizer(pipe.unfuse_loras)  # the other tests' int8 pipeline, even when an assertion here fails
    ref_pipe, _ = load_pipeline(None)
    file, paths = _lora_file(tmp_path, params)
    pipe.load_lora(file, scale=0.8)
    ref_pipe.load_lora(file, scale=0.8)
    fused = P.quantized_kernels(pipe.params["unet"])
    before = P.quantized_kernels(params["unet"])
    ref_kernels = ref_pipe.params["unet"]
    for path in paths:
        q, scale = fused[path]
        assert q.dtype == jnp.int8
        want = ref_kernels
        for k in path.split("/"):
            want = want[k]
        # dequant(base) + delta, requantized: within half a new step of the float32 sum, and the base's own
        # quantization error (half an old step) away from the unquantized fused kernel
        got = np.asarray(quant.dequantize_kernel(q, scale))
        old_step = np.asarray(before[path][1])
        assert np.all(np.abs(got - np.asarray(want)) <= (np.asarray(scale) + old_step) / 2 * (1 + 1e-4) + 1e-7)
        assert not np.array_equal(np.asarray(q), np.asarray(before[path][0]))
    out = pipe.generate(PROMPTS, **KW)
    assert float(np.abs(out[0] - base_q[0]).max()) > 5e-3  # the LoRA changed the (first) image
    pipe.unfuse_loras()
    for path in paths:
        assert P.quantized_kernels(pipe.params["unet"])[path][0] is before[path][0]
    np.testing.assert_array_equal(pipe.generate(PROMPTS, **KW), base_q)


def test_bad_quantize_value_fails_before_loading(tmp_path):
    from sdjax.pipelines.stable_diffusion import StableDiffusionPipeline

    missing = str(tmp_path / "no-such-model")
    for call in (
        lambda: load_pipeline(missing, quantize="int4"),
        lambda: StableDiffusionPipeline.from_pretrained(missing, quantize="int4"),
        lambda: StableDiffusionPipeline.from_single_file(missing + ".safetensors", quantize="int4"),
    ):
        with pytest.raises(ValueError, match=r"quantize='int4': expected one of \['fp8', 'int8'\]"):
            call()


def test_a_policy_names_components_and_thresholds():
    policy = quant.QuantPolicy("int8", components=("unet", "text_encoder"), min_size=1024, exclude=(r".*/attn2/.*",))
    pipe, params = load_pipeline(None, quantize=policy)
    unet = P.quantized_kernels(params["unet"])
    text = P.quantized_kernels(params["text_encoder"])
    assert text and all(q.size >= 1024 for q, _ in text.values())
    assert unet and not any("/attn2/" in p for p in unet)
    assert "conv_in/kernel" in unet  # 3x3x4x32 = 1,152 weights: above this policy's threshold, not the default
    out = pipe.generate(PROMPTS[:1], **{**KW, "steps": 2})  # finite images: 2 steps run every layer as 4 do
    assert np.isfinite(out).all()
    with pytest.raises(ValueError, match="lack"):
        quant.quantize_pipeline(*load_pipeline(None), quant.QuantPolicy("int8", components=("transformer",)))


def test_cli_generate_takes_quantize(tmp_path):
    from typer.testing import CliRunner

    from sdjax.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["generate", "x", "--quantize", "int4", "-o", str(tmp_path)])
    assert bad.exit_code == 2 and "int4" in bad.output
    ok = runner.invoke(
        app, ["generate", "a red circle", "--quantize", "int8", "--steps", "2", "-q", "-o", str(tmp_path)]
    )
    assert ok.exit_code == 0, ok.output
    assert list(tmp_path.glob("*.png"))
