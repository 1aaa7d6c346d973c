"""`sdjax compile --quantize int8 --quant-compute int8 --calibration FILE` (`aot.compile_for(calibration=)`): the
calibration recorded by `sdjax calibrate` on the embedded model gives the TPU program's int8 products static input
scales. Expected, independently of the compiler's counts: the same int8 products (the same hand-countable layers,
`tests/aot/test_quant_compute_aot.py`), and no per-call `max|x|` reduction over each of their inputs, so fewer
FLOPs and bytes than the program with per-call scales. A calibration recorded for another model, or given without
`--quant-compute`, is refused naming the file and the layer before anything compiles; the placeholder calibration
of cost studies (`Calibration.placeholder_for`) compiles the same program as a real one."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from sdjax import aot, cli, quant
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import params as P
from sdjax.training.export import EMBEDDED_MODEL_DIR

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install 'sdjax[tpu-aot]')"
)
runner = CliRunner()
MODEL = str(EMBEDDED_MODEL_DIR)
ARGS = ["compile", "--target", "v5e-1", "-m", MODEL, "--size", "16", "--batch", "1", "--steps", "2", "--in-process"]
INT8 = ["--quantize", "int8", "--quant-compute", "int8"]


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    pipe, _ = load_pipeline(None, quantize=P.QuantPolicy("int8", components=("unet",), compute="int8"))
    path = tmp_path_factory.mktemp("cal") / quant.CALIBRATION_FILE
    quant.calibrate(pipe, ["a red circle on a blue background"], steps=2).save(path)
    return path


@pytest.fixture(scope="module")
def placeholder():
    """The placeholder calibration of the embedded model's abstract int8-compute params."""
    pipe, params = aot.abstract_pipeline(MODEL, quantize="int8", quant_compute="int8")
    return quant.Calibration.placeholder_for(params, pipe.quantization)


def _costs_of(compile_report):
    """`compile_report()`'s result and the `(flops, bytes accessed)` of each executable it compiled, in order (the
    whole program, then the model call when it is compiled)."""
    costs, real = [], aot._cost
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aot, "_cost", lambda compiled: costs.append(real(compiled)) or costs[-1])
        return compile_report(), costs


@pytest.fixture(scope="module")
def reports(calibration_file):
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'sdjax[tpu-aot]')")
    out = {}
    for name, extra in (("dynamic", []), ("static", ["--calibration", str(calibration_file)])):
        r, costs = _costs_of(lambda extra=extra: runner.invoke(cli.app, [*ARGS, *INT8, *extra, "--json"]))
        assert r.exit_code == 0, r.output
        out[name] = json.loads(r.stdout)
        out[name + "_program_cost"] = costs[0]
    return out


@needs_libtpu
def test_static_scales_drop_the_per_call_reductions(reports, calibration_file):
    dynamic, static = reports["dynamic"], reports["static"]
    assert static["calibration"] == str(calibration_file) and dynamic["calibration"] is None
    assert static["quant_flops"] == dynamic["quant_flops"] > 0  # the same int8 products
    # without the reductions over every compute layer's input: fewer FLOPs and bytes per model call and in all
    assert static["unet_call_flops"] < dynamic["unet_call_flops"]
    assert static["flops"] < dynamic["flops"] and static["bytes_accessed"] < dynamic["bytes_accessed"]
    # ... and nothing else: the difference is a small share of the call (the inputs are read once more, not the
    # weights or the attention)
    assert dynamic["unet_call_flops"] - static["unet_call_flops"] < 0.05 * dynamic["unet_call_flops"]


@needs_libtpu
def test_the_placeholder_compiles_the_program_of_a_real_calibration(reports, placeholder):
    assert set(placeholder.layers) == set(quant.Calibration.load(reports["static"]["calibration"]).layers)
    # the whole program only (`unet_cost=False`): the model call is its loop's body, compiled from the same params
    report, costs = _costs_of(
        lambda: aot.compile_for(
            "v5e-1",
            model=MODEL,
            size=16,
            batch=1,
            steps=2,
            quantize="int8",
            quant_compute="int8",
            calibration=placeholder,
            unet_cost=False,
        )
    )
    assert report.calibration == "placeholder"
    static = reports["static"]
    assert costs == [reports["static_program_cost"]]  # the program's FLOPs and bytes accessed
    for key in ("program_flops", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes"):
        assert getattr(report, key) == static[key], key


def _edited(path, out, change):
    raw = json.loads(path.read_text())
    change(raw)
    out.write_text(json.dumps(raw))
    return out


def test_a_calibration_of_another_model_is_refused_before_the_compile(
    calibration_file, placeholder, tmp_path, monkeypatch
):
    def no_compile(*a, **k):
        raise AssertionError("reached the compiler")

    monkeypatch.setattr(aot, "_compile_with_cost", no_compile)
    monkeypatch.setattr(aot, "topology_devices", lambda target: (None, [_Device()]))
    first = sorted(quant.Calibration.load(calibration_file).layers)[0]
    shaped = _edited(calibration_file, tmp_path / "shaped.json", lambda raw: raw["layers"][first].update(shape=[3, 3]))
    r = runner.invoke(cli.app, [*ARGS, *INT8, "--calibration", str(shaped)])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"layer {first} has kernel shape (3, 3) there" in said and str(shaped) in said
    # the preset of another architecture: the tiny one, refused after 1.0 s of CPU where sd15 takes 2.2 s (its
    # full-size abstract params are built first; `time.process_time()` around each `compile_for`, fresh processes).
    # Either way the compute layers differ; tests/quant/test_calibration.py words each kind of difference
    with pytest.raises(ValueError, match=rf"{calibration_file} was recorded for another model"):
        aot.compile_for("v5e-1", model="tiny", quantize="int8", quant_compute="int8", calibration=calibration_file)
    # the placeholder is for abstract params only: real weights refuse it, and it is never written
    with pytest.raises(ValueError, match="placeholder calibration .* is refused for real weights"):
        load_pipeline(
            None, quantize=P.QuantPolicy("int8", components=("unet",), compute="int8", calibration=placeholder)
        )
    with pytest.raises(ValueError, match="holds no measured ranges"):
        placeholder.save(tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


class _Device:
    coords = (0, 0, 0)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--quantize", "int8"], "give --quant-compute"),
        (["--quantize", "fp8", "--quant-compute", "fp8"], "recorded for int8 products, not --quant-compute fp8"),
    ],
)
def test_cli_refuses_a_calibration_it_cannot_use(calibration_file, flags, said, monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled")

    monkeypatch.setattr(aot, "compile_for", no_compile)
    r = runner.invoke(cli.app, [*ARGS, *flags, "--calibration", str(calibration_file)])
    assert r.exit_code == 2 and "--calibration" in r.output and said in " ".join(r.output.split()), r.output
