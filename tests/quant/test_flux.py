"""A quantized tiny Flux (tests/flux_reference.py: two double- and two single-stream blocks, inner width 32):
`FluxPipeline.from_pretrained(..., quantize=QuantPolicy(...))` with a threshold low enough for its small kernels,
the transformer only. Random weights amplify nothing in particular, so the image error measures the weights'
rounding directly: int8 moves the images by 4.3e-4 mean / 2.5e-3 max abs, fp8 by 2.6e-3 / 1.5e-2 (measured; the
test allows 2e-3 and 1e-2 mean abs); the
in-program dequantization equals the same weights dequantized on the host to float rounding. int8 compute with a
calibration (2 prompts, 2 steps) moves them by 7.2e-4 mean / 4.2e-3 max abs (the test allows 4e-3)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import flux_reference
import jax.numpy as jnp
import t5_reference

from sdjax import quant
from sdjax.quant import params as P

SIZE, STEPS, MAX_SEQ = 32, 4, 24
KW = dict(steps=STEPS, guidance_scale=3.5, height=SIZE, width=SIZE, seed=5, max_sequence_length=MAX_SEQ)
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
TOLERANCE = {"int8": 2e-3, "fp8": 1e-2}  # mean abs image difference


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("tiny-flux-dev")
    flux_reference.flux_pipeline("dev", seed=0, tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def unquantized(flux_folder):
    from sdjax.families.flux.pipeline import FluxPipeline

    pipe0, params0 = FluxPipeline.from_pretrained(str(flux_folder))
    return pipe0, params0, pipe0.generate(PROMPTS, output_type="np", **KW)


@pytest.fixture(scope="module")
def quantized(flux_folder):
    """scheme -> (pipeline, params), loaded once per scheme."""
    from sdjax.families.flux.pipeline import FluxPipeline

    cache = {}

    def get(scheme):
        if scheme not in cache:
            policy = quant.QuantPolicy(scheme, components=("transformer",), min_size=512)
            cache[scheme] = FluxPipeline.from_pretrained(str(flux_folder), quantize=policy)
        return cache[scheme]

    return get


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantized_flux_images(unquantized, quantized, scheme):
    pipe0, params0, base = unquantized
    pipe, params = quantized(scheme)
    kernels = P.quantized_kernels(params["transformer"])
    assert len(kernels) >= 20 and all(q.dtype == jnp.dtype(quant.SCHEMES[scheme]) for q, _ in kernels.values())
    assert P.nbytes(params["transformer"]) < 0.45 * P.nbytes(params0["transformer"])
    assert not P.has_quantized(params["text_encoder_2"])
    out = pipe.generate(PROMPTS, output_type="np", **KW)
    err = np.abs(out - base)
    print(f"{scheme}: mean abs {float(err.mean()):.2e}, max abs {float(err.max()):.2e}")
    assert 0 < float(err.mean()) < TOLERANCE[scheme], float(err.mean())
    host = {k: P.dequantize_tree(v, jnp.float32) if k == "transformer" else v for k, v in params.items()}
    np.testing.assert_allclose(pipe0.generate(PROMPTS, output_type="np", params=host, **KW), out, atol=1e-4)


def test_lora_on_a_quantized_flux(quantized, tmp_path):
    """Flux's LoRA path (`families.flux.lora`) takes quantized kernels (it refuses `keep_fp8` kernels, which have
    no scale): the touched kernels are requantized, the image changes, unloading gives the base image back."""
    from safetensors.numpy import save_file

    pipe, params = quantized("int8")
    r = np.random.default_rng(0)
    tensors = {}
    for module in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k"):
        tensors[f"transformer.{module}.lora_A.weight"] = (0.5 * r.standard_normal((4, 32))).astype(np.float32)
        tensors[f"transformer.{module}.lora_B.weight"] = (0.5 * r.standard_normal((32, 4))).astype(np.float32)
    save_file(tensors, str(tmp_path / "lora.safetensors"))
    kw = dict(KW, seed=9)
    base = pipe.generate(PROMPTS, output_type="np", **kw)
    pipe.load_lora(tmp_path / "lora.safetensors", scale=0.7)
    fused = P.quantized_kernels(pipe.params["transformer"])
    path = "transformer_blocks_0/attn/to_q/kernel"
    assert fused[path][0].dtype == jnp.int8
    assert not np.array_equal(
        np.asarray(fused[path][0]), np.asarray(P.quantized_kernels(params["transformer"])[path][0])
    )
    out = pipe.generate(PROMPTS, output_type="np", **kw)
    pipe.unload_loras()
    again = pipe.generate(PROMPTS, output_type="np", **kw)
    assert float(np.abs(out - base).max()) > 5e-3
    assert float(np.abs(again - base).max()) == 0.0


def test_int8_compute_and_calibration_on_flux(unquantized, flux_folder):
    """The transformer family: every int8 Dense layer of the tiny Flux is recorded by a calibration pass and its
    static range drives the program; the image stays within the int8 weight-only tolerance of the float one."""
    from sdjax.families.flux.pipeline import FluxPipeline
    from sdjax.quant import compute as C

    _, _, base = unquantized
    policy = quant.QuantPolicy("int8", components=("transformer",), min_size=512, compute="int8")
    pipe, params = FluxPipeline.from_pretrained(str(flux_folder), quantize=policy)
    calibration = quant.calibrate(pipe, PROMPTS, steps=2, **{k: v for k, v in KW.items() if k != "steps"})
    selected = C.compute_kernels(params["transformer"], "int8", "transformer")
    assert len(selected) >= 20 and sorted(calibration.layers) == sorted(selected)
    assert all(rec.amax is not None and rec.amax > 0 for rec in calibration.layers.values())
    quant.use_calibration(pipe, calibration)
    out = pipe.generate(PROMPTS, output_type="np", **KW)
    err = np.abs(out - base)
    print(f"int8 compute, calibrated: mean abs {float(err.mean()):.2e}, max abs {float(err.max()):.2e}")
    assert 0 < float(err.mean()) < 2 * TOLERANCE["int8"], float(err.mean())
