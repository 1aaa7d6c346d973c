"""Saved quantized params in a pipeline folder (`loading.components.save_quantized_components`, `sdjax convert
--quantize`): `from_pretrained(quantize=)` reads `unet/sdjax_quantized.int8.safetensors` instead of the float
weights when it was made as this load would quantize, refuses one made otherwise (naming the file), and a load
without `quantize` never looks at it. On a copy of the embedded model."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from bit_identical import assert_bit_identical
from typer.testing import CliRunner

from sdjax import cli
from sdjax.loading.components import quantized_file, save_quantized_components
from sdjax.models.presets import EMBEDDED_MODEL
from sdjax.pipelines import load_pipeline
from sdjax.quant import QuantPolicy


@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "embedded"
    shutil.copytree(EMBEDDED_MODEL, out)
    return out


def _kernel_dtypes(params):
    """The dtypes of the UNet's quantized kernels."""
    from sdjax.quant.params import quantized_kernels

    kernels = quantized_kernels(params["unet"])
    assert kernels
    return {str(q.dtype) for q, _ in kernels.values()}


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_saved_file_loads_bit_identical_to_quantizing_on_load(folder, scheme):
    pipe, params = load_pipeline(str(folder), quantize=scheme)
    (path,) = save_quantized_components(folder, params, pipe.quantization, dtype=pipe.dtype)
    assert path == folder / "unet" / f"sdjax_quantized.{scheme}.safetensors" == quantized_file(folder, "unet", scheme)
    # without the float UNet weights the load can only have read the saved file
    (folder / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    again, params2 = load_pipeline(str(folder), quantize=scheme)
    assert_bit_identical(params, params2)
    assert again.quantization == pipe.quantization
    assert _kernel_dtypes(params2) == {"int8" if scheme == "int8" else "float8_e4m3fn"}
    # the same program runs on them: the images are the same
    a = pipe.generate("a red circle", steps=2, seed=0, output_type="np")
    b = again.generate("a red circle", steps=2, seed=0, output_type="np")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_compute_policy_and_a_load_without_quantize(folder):
    pipe, params = load_pipeline(str(folder), quantize="int8")
    save_quantized_components(folder, params, pipe.quantization, dtype=pipe.dtype)
    # compute= changes no stored value: the file serves an int8-compute load too
    _, with_compute = load_pipeline(str(folder), quantize=QuantPolicy("int8", components=("unet",), compute="int8"))
    assert_bit_identical(params, with_compute)
    # no quantize: the float weights, as from a folder without the file
    _, plain = load_pipeline(str(folder))
    _, reference = load_pipeline(EMBEDDED_MODEL)
    assert_bit_identical(plain, reference)
    # another scheme has no file here: its kernels are quantized from the float weights as before
    _, fp8 = load_pipeline(str(folder), quantize="fp8")
    assert _kernel_dtypes(fp8) == {"float8_e4m3fn"}


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        (dict(quantize=QuantPolicy("int8", components=("unet",), min_size=4096)), "min_size '16384' there, '4096'"),
        (dict(quantize=QuantPolicy("int8", components=("unet",), exclude=(r".*conv.*",))), "exclude"),
        (dict(quantize="int8", dtype="bfloat16"), "dtype 'float32' there, 'bfloat16' here"),
    ],
)
def test_a_file_made_otherwise_is_refused_naming_it(folder, kwargs, said):
    import jax.numpy as jnp

    pipe, params = load_pipeline(str(folder), quantize="int8")
    (path,) = save_quantized_components(folder, params, pipe.quantization, dtype=pipe.dtype)
    if "dtype" in kwargs:
        kwargs["dtype"] = getattr(jnp, kwargs["dtype"])
    with pytest.raises(ValueError, match="made for another load of unet") as e:
        load_pipeline(str(folder), **kwargs)
    assert str(path) in str(e.value) and said in str(e.value)


def test_a_file_of_another_model_is_refused_naming_it(folder, tmp_path):
    """A file copied from another model: its leaves are checked against this UNet's shapes before any read."""
    from sdjax.quant import save_quantized
    from sdjax.quant.files import read_metadata

    pipe, params = load_pipeline(str(folder), quantize="int8")
    save_quantized_components(folder, params, pipe.quantization, dtype=pipe.dtype)
    path = quantized_file(folder, "unet", "int8")
    made = read_metadata(path)
    unet = dict(params["unet"])
    unet.pop("conv_out")
    save_quantized(
        {"unet": unet},
        path,
        pipe.quantization,
        metadata={k: made[k] for k in ("min_size", "exclude", "dtype", "variant")},
    )
    with pytest.raises(ValueError, match=f"{path}.*another model.*conv_out"):
        load_pipeline(str(folder), quantize="int8")


def test_cli_convert_writes_a_folders_quantized_params(folder):
    runner = CliRunner()
    r = runner.invoke(cli.app, ["convert", str(folder), "--quantize", "int8"])
    assert r.exit_code == 0, r.output
    path = quantized_file(folder, "unet", "int8")
    assert path.is_file() and path.name in r.output
    _, from_file = load_pipeline(str(folder), quantize="int8")
    _, on_load = load_pipeline(EMBEDDED_MODEL, quantize="int8")
    assert_bit_identical(from_file, on_load)
    again = runner.invoke(cli.app, ["convert", str(folder), "--quantize", "int8"])
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert runner.invoke(cli.app, ["convert", str(folder), "--quantize", "int8", "--overwrite"]).exit_code == 0
    no_quantize = runner.invoke(cli.app, ["convert", str(folder)])
    assert no_quantize.exit_code == 2 and "--quantize" in no_quantize.output


def test_cli_convert_of_a_single_file_writes_the_quantized_params_too(tmp_path, monkeypatch):
    """`sdjax convert FILE OUT_DIR --quantize int8`: the folder as before, then its quantized UNet. The conversion
    itself is replaced by a copy of the embedded model (tests/loading/test_single_file.py checks it)."""
    from sdjax.loading import single_file

    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"")

    def convert_to_diffusers(path, out_dir, **kwargs):
        shutil.copytree(EMBEDDED_MODEL, out_dir)
        return out_dir

    monkeypatch.setattr(single_file, "convert_to_diffusers", convert_to_diffusers)
    out = tmp_path / "out"
    r = CliRunner().invoke(cli.app, ["convert", str(checkpoint), str(out), "--quantize", "int8"])
    assert r.exit_code == 0, r.output
    assert "written to" in r.output and quantized_file(out, "unet", "int8").is_file()
    _, from_file = load_pipeline(str(out), quantize="int8")
    _, on_load = load_pipeline(EMBEDDED_MODEL, quantize="int8")
    assert_bit_identical(from_file, on_load)
    missing = CliRunner().invoke(cli.app, ["convert", str(checkpoint)])
    assert missing.exit_code == 2 and "OUT_DIR" in missing.output
