"""Quantizing while loading single files (issues 37 and 34): SD 1.x/2.x/XL original-layout files, Flux files with
separate `t5=` / `clip_l=` files, SD 3 / 3.5 files (bundled or separate text encoders).

For each path, `quantize=` must give params bit for bit equal to the old way (the same file loaded in full precision,
then `quantize_pipeline` with the same policy), and each selected kernel must be quantized as it is converted: the
probe of tests/quant/test_quant_load.py wraps `scheme.quantize_kernel` and sees every quantized kernel pass through
it during the load, with never more float kernels given to it alive at a time than threads casting
(`models.convert.CAST_WORKERS`; the old way holds them all).
The files are the tiny random models the single-file tests write (tests/loading/ldm_fixtures.py for SD, the SD 3
writer of tests/families/test_sd3_weights.py, the Flux folder of test_quant_load.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("loading", "families")]

import test_quant_load
import test_sd3_weights
from ldm_fixtures import pipeline_to_original, save_original
from test_quant_load import AliveProbe, assert_bit_identical

from sdjax import quant
from sdjax.models import convert
from sdjax.quant import params as P

# The fixtures of the tiny Flux folder (with its transformer as one file) and of the SD 3 folders and files.
flux_file = test_quant_load.flux_file
sd3_models = test_sd3_weights.models

# The tiny models' kernels are small: a threshold that selects some of the text encoders' and skips others.
TEXT_POLICY = dict(min_size=256)


def _quantized(params, policy, some=True):
    """Every quantized kernel of the policy's components -> the number; each component must hold some (unless
    `some` is false), and no other component any (so a comparison means something)."""
    n = 0
    for component in policy.components:
        kernels = P.quantized_kernels(params[component])
        assert kernels or not some, component
        for path, (q, scale) in kernels.items():
            assert q.dtype == quant.SCHEMES[policy.scheme] and scale.shape == q.shape[-1:], (component, path)
        n += len(kernels)
    assert {c for c in params if P.has_quantized(params[c])} == (set(policy.components) if n else set())
    return n


def _check_new_equals_old(load, quantize, monkeypatch, resolved=None, some=True):
    """`load(quantize=...)` against `quantize_pipeline(*load(), quantize)`: bit-identical params, the same policy,
    each kernel quantized while loading (the probe)."""
    old_pipe, old_params = quant.quantize_pipeline(*load(), quantize)
    probe = AliveProbe(monkeypatch)
    pipe, params = load(quantize=quantize)
    n = _quantized(params, pipe.quantization, some)
    assert probe.calls == n and (n > 1 or not some)
    assert (1 <= probe.max_alive <= convert.CAST_WORKERS) if n else probe.max_alive == 0
    assert_bit_identical(params, old_params)
    assert pipe.quantization == old_pipe.quantization == (resolved or pipe.quantization)
    return pipe, params


# ---------------------------------------------------------------------------------------------- SD 1.x/2.x/XL files
@pytest.fixture(scope="module")
def sd_files(torch_sd1, torch_sd2, torch_sdxl, sd1_dir, sd2_dir, sdxl_dir, tmp_path_factory):
    """kind -> (original-layout float32 file of the tiny pipeline, its diffusers folder for the configs)."""
    root = tmp_path_factory.mktemp("quant-single-files")
    out = {}
    for kind, pipe, folder in (
        ("sd1", torch_sd1, sd1_dir),
        ("sd2", torch_sd2, sd2_dir),
        ("sdxl", torch_sdxl, sdxl_dir),
    ):
        out[kind] = save_original(pipeline_to_original(pipe, kind), root / f"{kind}.safetensors"), folder
    return out


SD_CASES = {
    "sd1-int8": ("sd1", "int8"),
    "sd1-fp8": ("sd1", "fp8"),
    "sd1-policy": (
        "sd1",
        quant.QuantPolicy(
            "int8", components=("unet", "text_encoder"), exclude=(r".*/attn1/to_q/kernel",), **TEXT_POLICY
        ),
    ),
    "sd2-int8": ("sd2", "int8"),
    "sdxl-policy": (
        "sdxl",
        quant.QuantPolicy("fp8", components=("unet", "text_encoder", "text_encoder_2"), **TEXT_POLICY),
    ),
}


@pytest.mark.parametrize("case", SD_CASES)
def test_sd_single_file_quantize_equals_quantize_after_loading(sd_files, case, monkeypatch):
    from sdjax.pipelines.stable_diffusion import StableDiffusionPipeline
    from sdjax.pipelines.stable_diffusion_xl import StableDiffusionXLPipeline

    kind, quantize = SD_CASES[case]
    path, folder = sd_files[kind]
    cls = StableDiffusionXLPipeline if kind == "sdxl" else StableDiffusionPipeline

    def load(**kw):
        return cls.from_single_file(str(path), config=str(folder), **kw)

    want = quant.QuantPolicy(quantize, components=("unet",)) if isinstance(quantize, str) else quantize
    pipe, params = _check_new_equals_old(load, quantize, monkeypatch, resolved=want)
    assert type(pipe.denoiser.unet).__name__ == "DequantizingModule"
    if case == "sd1-policy":  # the exclusion held while loading
        unet = P.quantized_kernels(params["unet"])
        assert not any(k.endswith("attn1/to_q/kernel") for k in unet)
        assert any(k.endswith("attn2/to_q/kernel") for k in unet)


def test_load_pipeline_of_a_file_quantizes_while_loading(sd_files, monkeypatch):
    """`sdjax.load_pipeline(file, quantize=)` (what `sdjax generate|serve --quantize` call) takes the same path."""
    from sdjax import load_pipeline

    path, folder = sd_files["sdxl"]
    _check_new_equals_old(
        lambda **kw: load_pipeline(str(path), config=str(folder), **kw),
        "int8",
        monkeypatch,
        resolved=quant.QuantPolicy("int8", components=("unet",)),
    )


def test_a_policy_for_a_component_the_file_lacks_fails_before_loading(sd_files, monkeypatch):
    from sdjax.loading import single_file
    from sdjax.pipelines.stable_diffusion import StableDiffusionPipeline

    def never(*a, **k):
        raise AssertionError("a weight was converted")

    monkeypatch.setattr(single_file, "load_component", never)
    path, folder = sd_files["sd1"]
    bad = quant.QuantPolicy("int8", components=("unet", "text_encoder_2"))
    with pytest.raises(ValueError, match=r"quantize: .*\['text_encoder_2'\].*sd1\.safetensors"):
        StableDiffusionPipeline.from_single_file(str(path), config=str(folder), quantize=bad)
    left_out = quant.QuantPolicy("int8", components=("unet", "text_encoder"))
    with pytest.raises(ValueError, match=r"quantize: .*\['text_encoder'\]"):
        single_file.load_single_file(str(path), config=str(folder), overrides={"text_encoder": None}, quantize=left_out)
    with pytest.raises(ValueError, match="quantize='int4'"):
        single_file.load_single_file(str(path), config=str(folder), quantize="int4")
    with pytest.raises(ValueError, match="quantize= is not accepted"):
        single_file.convert_to_diffusers(str(path), folder.parent / "never-written", quantize="int8")


# ---------------------------------------------------------------------------------------------- Flux files
FLUX_POLICY = quant.QuantPolicy("int8", components=("transformer", "text_encoder", "text_encoder_2"), min_size=512)


@pytest.mark.parametrize("separate", [True, False], ids=["t5-clip-files", "encoders-from-folder"])
def test_flux_text_encoders_are_quantized_while_loading(flux_file, separate, monkeypatch):
    """A policy naming the text encoders: from `t5=` / `clip_l=` files, or from the config folder."""
    from sdjax.families.flux.pipeline import FluxPipeline

    folder, path = flux_file
    files = {"t5": str(folder / "text_encoder_2" / "model.safetensors")} if separate else {}
    if separate:
        files["clip_l"] = str(folder / "text_encoder" / "model.safetensors")

    def load(**kw):
        return FluxPipeline.from_single_file(str(path), config=str(folder), **files, **kw)

    pipe, _ = _check_new_equals_old(load, FLUX_POLICY, monkeypatch)
    assert {type(m).__name__ for m in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2)} == {
        "DequantizingModule"
    }


# ---------------------------------------------------------------------------------------------- SD 3 files
SD3_POLICY = quant.QuantPolicy(
    "fp8", components=("transformer", "text_encoder", "text_encoder_2", "text_encoder_3"), min_size=512
)
SD3_INT8 = quant.QuantPolicy("int8", components=("transformer",), min_size=512)


@pytest.mark.parametrize(
    "case, quantize",
    [
        ("all", "int8"),  # the default threshold: the tiny MMDiT has no kernel that large (nothing quantized)
        ("all", SD3_INT8),
        ("all", SD3_POLICY),
        ("mmdit-files", SD3_POLICY),
        ("mmdit-folder", SD3_POLICY),
    ],
    ids=["bundled-int8", "bundled-transformer", "bundled-policy", "separate-files-policy", "encoders-from-folder"],
)
def test_sd3_single_file_quantize_equals_quantize_after_loading(sd3_models, case, quantize, monkeypatch):
    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline

    folders, files = sd3_models
    path = files["all"] if case == "all" else files["mmdit"]
    extra = {k: str(files[k]) for k in ("clip_l", "clip_g", "t5")} if case == "mmdit-files" else {}

    def load(**kw):
        return StableDiffusion3Pipeline.from_single_file(str(path), config=str(folders[0]), **extra, **kw)

    want = quant.QuantPolicy("int8", components=("transformer",)) if quantize == "int8" else quantize
    pipe, _ = _check_new_equals_old(load, quantize, monkeypatch, resolved=want, some=quantize != "int8")
    assert type(pipe.denoiser.transformer).__name__ == "DequantizingModule"
    if quantize is SD3_POLICY:
        encoders = (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3)
        assert {type(m).__name__ for m in encoders} == {"DequantizingModule"}


def test_cli_generate_quantizes_a_single_file_while_loading(sd_files, tmp_path, monkeypatch):
    """`sdjax generate --model file --config folder --quantize int8` loads through `load_pipeline(file, quantize=)`:
    every quantized kernel passes the per-tensor hook with at most one float kernel alive per cast thread, and the
    images are written."""
    from typer.testing import CliRunner

    from sdjax.cli import app

    path, folder = sd_files["sd1"]
    probe = AliveProbe(monkeypatch)
    args = ["generate", "a red circle", "-m", str(path), "--config", str(folder), "--quantize", "int8"]
    ok = CliRunner().invoke(app, [*args, "--steps", "1", "-H", "32", "-W", "32", "-q", "-o", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert list(tmp_path.glob("*.png"))
    assert probe.calls > 1 and 1 <= probe.max_alive <= convert.CAST_WORKERS
