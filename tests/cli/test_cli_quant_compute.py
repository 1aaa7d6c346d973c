"""`sdjax generate` / `sdjax serve` with `--quantize int8 --quant-compute int8 [--calibration FILE]`: the same
pipeline as `load_pipeline(quantize=QuantPolicy("int8", components=("unet",), compute="int8", calibration=...))`,
on the embedded model; bad combinations and files refused, naming the option or file, before anything loads."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from sdjax import cli, quant
from sdjax.models.presets import EMBEDDED_MODEL
from sdjax.pipelines import load_pipeline

runner = CliRunner()
PROMPT = "a red circle"


def _api_pipeline(**policy):
    pipe, _ = load_pipeline(EMBEDDED_MODEL, quantize=quant.QuantPolicy("int8", components=("unet",), **policy))
    return pipe


def _image(pipe) -> np.ndarray:
    return np.asarray(pipe.generate(PROMPT, steps=3, seed=3, output_type="pil")[0])


def _api_image(**policy) -> np.ndarray:
    return _image(_api_pipeline(**policy))


@pytest.fixture(scope="module")
def int8_compute():
    """The Python API's int8-compute pipeline and its image, the reference of every test here that needs them."""
    pipe = _api_pipeline(compute="int8")
    return pipe, _image(pipe)


def _same_pipeline(pipe, want) -> None:
    """`pipe` computes what `want` does, without compiling either: the same quantization policy (a calibration by
    its recorded ranges: `Calibration` compares by identity) and the same params, leaf for leaf."""
    policy, want_policy = pipe.quantization, want.quantization
    assert dataclasses.replace(policy, calibration=None) == dataclasses.replace(want_policy, calibration=None)
    cal, want_cal = policy.calibration, want_policy.calibration
    assert (cal is None) == (want_cal is None)
    if cal is not None:
        assert (cal.compute, cal.layers, cal.convs, cal.source) == (
            want_cal.compute,
            want_cal.layers,
            want_cal.convs,
            want_cal.source,
        )
    leaves, want_leaves = jax.tree_util.tree_flatten(pipe.params), jax.tree_util.tree_flatten(want.params)
    assert leaves[1] == want_leaves[1]
    for a, b in zip(leaves[0], want_leaves[0], strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def _cli_image(tmp_path, *flags, loaded=None) -> np.ndarray:
    """The image `sdjax generate ... flags` writes; `loaded` (a list) receives the pipeline the command built."""
    if loaded is not None:
        real = cli.generate.load_pipeline

        def keep(*a, **k):
            loaded.append(real(*a, **k))
            return loaded[-1]

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cli.generate, "load_pipeline", keep)
            return _cli_image(tmp_path, *flags)
    r = runner.invoke(
        cli.app, ["generate", PROMPT, "--steps", "3", "--seed", "3", "--quiet", "--out", str(tmp_path), *flags]
    )
    assert r.exit_code == 0, r.output
    (path,) = tmp_path.glob("*.png")
    with Image.open(path) as im:
        return np.asarray(im)


def test_generate_int8_compute_writes_the_python_apis_image(tmp_path, int8_compute):
    written = _cli_image(tmp_path, "--quantize", "int8", "--quant-compute", "int8")
    np.testing.assert_array_equal(written, int8_compute[1])
    # and not the weight-only one: the option reached the program
    assert np.abs(written.astype(int) - _api_image()).max() > 0


def test_generate_with_a_calibration_writes_the_python_apis_image(tmp_path, int8_compute):
    pipe, per_call = int8_compute  # calibrate leaves the pipeline's policy as it was (its programs are dropped)
    path = tmp_path / quant.CALIBRATION_FILE
    quant.calibrate(pipe, ["a blue square", "a green triangle"], steps=2).save(path)
    flags = ["--quantize", "int8", "--quant-compute", "int8", "--calibration", str(path)]
    loaded = []
    written = _cli_image(tmp_path / "out", *flags, loaded=loaded)
    (cli_pipe,) = loaded
    # the CLI wrote its pipeline's image (the program it compiled, run again) ...
    np.testing.assert_array_equal(written, _image(cli_pipe))
    # ... and its pipeline is the Python API's: the same policy, calibration ranges and params (so the same image)
    _same_pipeline(cli_pipe, _api_pipeline(compute="int8", calibration=str(path)))
    assert np.abs(written.astype(int) - per_call).max() > 0  # static scales: another image


def _calibration_file(tmp_path, compute="int8", layers=None, name="cal.json"):
    path = tmp_path / name
    raw = {"format": "sdjax.quant.calibration", "version": 1, "compute": compute, "prompts": [], "steps": 1}
    raw["layers"] = layers or {"unet/x/kernel": {"shape": [4, 4], "sha256": "0" * 64, "amax": 1.0}}
    path.write_text(json.dumps(raw))
    return path


def _bad_cases(tmp_path):
    not_a_calibration = tmp_path / "other.json"
    not_a_calibration.write_text("{}")
    fp8 = _calibration_file(tmp_path, compute="fp8", name="fp8.json")
    return [
        (["--quant-compute", "int8"], "--quant-compute", "give --quantize int8 (no --quantize was given)"),
        (["--quantize", "fp8", "--quant-compute", "int8"], "--quant-compute", "(--quantize fp8 was given)"),
        (["--quantize", "int8", "--calibration", str(fp8)], "--calibration", "give --quant-compute"),
        (
            ["--quantize", "int8", "--quant-compute", "int8", "--calibration", str(not_a_calibration)],
            "--calibration",
            "is not an sdjax calibration",
        ),
        (
            ["--quantize", "int8", "--quant-compute", "int8", "--calibration", str(fp8)],
            "--calibration",
            "recorded for fp8 products, not --quant-compute int8",
        ),
    ]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_combinations_and_files_are_refused_before_loading(tmp_path, monkeypatch, command):
    def no_load(*a, **k):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(cli.generate, "load_pipeline", no_load)
    monkeypatch.setattr(cli.serve, "load_pipeline", no_load)
    for flags, option, said in _bad_cases(tmp_path):
        args = ["generate", PROMPT, "--out", str(tmp_path / "out")] if command == "generate" else ["serve"]
        r = runner.invoke(cli.app, [*args, *flags])
        text = " ".join(r.output.split())
        assert r.exit_code == 2, (flags, r.output)
        assert option in text and said in text, (flags, text)
    assert not (tmp_path / "out").exists()


def test_a_calibration_of_another_model_is_refused_naming_the_file(tmp_path):
    path = _calibration_file(tmp_path)
    flags = ["--quantize", "int8", "--quant-compute", "int8", "--calibration", str(path)]
    r = runner.invoke(cli.app, ["generate", PROMPT, "--out", str(tmp_path / "out"), *flags])
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "could not load" in text and str(path) in text and "another model" in text


def test_serve_loads_the_int8_compute_pipeline(tmp_path, monkeypatch, int8_compute):
    from sdjax import server

    served = []
    monkeypatch.setattr(server, "serve", lambda pipe, config, **kw: served.append(pipe))
    r = runner.invoke(cli.app, ["serve", "--quantize", "int8", "--quant-compute", "int8", "--no-warm"])
    assert r.exit_code == 0, r.output
    (pipe,) = served
    want = quant.QuantPolicy("int8", components=("unet",), compute="int8")
    assert pipe.quantization == want
    # the same params as the Python API's int8-compute pipeline, so its image (compared without another compile)
    _same_pipeline(pipe, int8_compute[0])
