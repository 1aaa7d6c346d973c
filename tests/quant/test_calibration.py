"""Calibrated (static) input ranges for quantized compute: the recorder against ranges computed by hand, a
calibration of the embedded model (every compute layer recorded, the file's round trip, its static scales in the
program), and calibrations of other models and broken files refused with the file and the layer named.

Measured (the embedded model, calibrated on 2 prompts x 4 steps, 1 prompt, 4 steps, seed 0, float32, the suite's
XLA flags): static input scales move the image by 0.0027 mean / 0.058 max abs from per-call ones; the test allows
0.02 mean."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import quant
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import calibration as CAL
from sdjax.quant import compute as C
from sdjax.quant import modules as M
from sdjax.quant import params as P

PROMPTS = ["a red circle on a blue background", "a green square"]
KW = dict(steps=4, seed=0, output_type="np")


def _policy(**kw):
    return P.QuantPolicy("int8", components=("unet",), compute="int8", **kw)


class _Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(96, name="a")(x)
        return nn.Dense(64, name="b")(jnp.tanh(h))


def test_the_recorder_sees_each_layers_input_range():
    net = _Two()
    x = 2.5 * jax.random.normal(jax.random.PRNGKey(0), (3, 64))
    params = net.init(jax.random.PRNGKey(1), x)["params"]
    qp = P.quantize_tree(params, _policy(min_size=4096), "unet")
    seen = {}
    module = M.DequantizingModule(net, jnp.float32, "int8", observe=lambda path, amax: seen.update({path: amax}))
    jax.jit(lambda p, x: module.apply({"params": p}, x))(qp, x)
    jax.effects_barrier()
    # by hand: layer a's input is x; layer b's is tanh of a's int8 product
    h = C.dense_quantized(x, qp["a"]["kernel"], qp["a"]["kernel_scale"], qp["a"]["bias"], jnp.float32)
    assert set(seen) == {"a", "b"}
    assert float(seen["a"]) == pytest.approx(float(np.abs(np.asarray(x)).max()), rel=1e-6)
    assert float(seen["b"]) == pytest.approx(float(np.abs(np.tanh(np.asarray(h))).max()), rel=1e-6)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    pipe, params = load_pipeline(None, quantize=_policy())
    dynamic = pipe.generate(PROMPTS[:1], **KW)
    calibration = quant.calibrate(pipe, PROMPTS, steps=4)
    path = tmp_path_factory.mktemp("cal") / quant.CALIBRATION_FILE
    calibration.save(path)
    return pipe, params, dynamic, calibration, path


def test_every_compute_layer_is_recorded_and_the_file_round_trips(calibrated):
    pipe, params, _, calibration, path = calibrated
    selected = C.compute_kernels(params["unet"], "int8", "unet")
    assert sorted(calibration.layers) == sorted(selected) and len(selected) >= 10
    for name, rec in calibration.layers.items():
        assert rec.shape == selected[name][0].shape and rec.amax is not None and 0 < rec.amax < 1e4, name
    # amax_for: module paths (what the interceptor looks up) that are the params' layer paths
    for module_path in calibration.amax_for("unet"):
        node = params["unet"]
        for key in module_path.split("/"):
            node = node[key]
        assert node["kernel"].dtype == jnp.int8 and node["kernel"].ndim in (2, 4)  # Dense layers and convs
    loaded = quant.Calibration.load(path)
    assert loaded.layers == calibration.layers and loaded.compute == "int8" and loaded.source == str(path)
    assert loaded.prompts == tuple(PROMPTS) and loaded.steps == 4
    raw = json.loads(path.read_text())
    assert raw["format"] == CAL.FORMAT and all(len(r["sha256"]) == 64 for r in raw["layers"].values())
    assert raw["version"] == 2 and raw["convs"] is True  # the 2-D convs are compute layers too
    assert sum(len(rec.shape) == 4 for rec in calibration.layers.values()) == 21
    assert pipe.quantization.calibration is None  # the pass left the pipeline as it was


def test_static_scales_from_the_file_drive_the_program(calibrated):
    _, _, dynamic, _, path = calibrated
    pipe, _ = load_pipeline(None, quantize=_policy(calibration=str(path)))
    assert pipe.quantization.calibration.source == str(path)
    assert pipe.unet.amax == pipe.quantization.calibration.amax_for("unet")
    static = pipe.generate(PROMPTS[:1], **KW)
    err = np.abs(static - dynamic)
    print(f"static vs dynamic int8 input scales: mean abs {err.mean():.4f}, max {err.max():.4f}")
    assert 0 < float(err.mean()) < 0.02  # other scales, a close image


def _edit(path, out, change):
    raw = json.loads(path.read_text())
    change(raw)
    out.write_text(json.dumps(raw))
    return out


def test_a_calibration_for_another_model_is_refused(calibrated, tmp_path):
    pipe, _, _, calibration, path = calibrated
    first = sorted(calibration.layers)[0]

    # more compute layers (a lower size threshold): the file lacks the first of them
    with pytest.raises(ValueError, match=rf"calibration file {path} was recorded for another model: it has no layer"):
        load_pipeline(None, quantize=_policy(min_size=1024, calibration=path))
    # a layer of another shape
    shaped = _edit(path, tmp_path / "shaped.json", lambda raw: raw["layers"][first].update(shape=[3, 3]))
    with pytest.raises(ValueError, match=rf"{shaped}.*layer {first} has kernel shape \(3, 3\) there"):
        quant.use_calibration(pipe, shaped)
    # a layer this model does not have
    extra = _edit(
        path, tmp_path / "extra.json", lambda raw: raw["layers"].update({"unet/extra/kernel": raw["layers"][first]})
    )
    with pytest.raises(ValueError, match=r"its layer unet/extra/kernel .* is not a int8 compute layer"):
        quant.use_calibration(pipe, extra)
    assert pipe.quantization.calibration is None  # refused before anything changed

    # the same architecture with other weights
    other, params = load_pipeline(None)
    node = params["unet"]
    for key in first.split("/")[1:-1]:
        node = node[key]
    node["kernel"] = node["kernel"] * 1.01
    with pytest.raises(ValueError, match=rf"{path} was recorded for other weights: layer {first} "):
        quant.quantize_pipeline(other, params, _policy(calibration=path))
    # abstract params (an AOT compile): paths and shapes are checked, there are no weights to hash
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), pipe.params)
    calibration.check(abstract, pipe.quantization)
    with pytest.raises(ValueError, match=rf"{shaped}.*layer {first} has kernel shape"):
        quant.Calibration.load(shaped).check(abstract, pipe.quantization)
    # another compute mode
    with pytest.raises(ValueError, match=rf"{path} was recorded for compute='int8'.*compute='fp8'"):
        P.QuantPolicy("fp8", compute="fp8", calibration=path)


def test_a_version_1_file_holds_dense_layers_only(calibrated, tmp_path):
    """Files written before convolutions computed in 8 bits: read as `convs=False`, refused by a policy whose convs
    compute in 8 bits (with what to do), accepted by one whose do not."""
    _, _, _, calibration, path = calibrated

    def to_v1(raw):
        raw["version"] = 1
        del raw["convs"]
        raw["layers"] = {k: v for k, v in raw["layers"].items() if len(v["shape"]) == 2}

    v1 = _edit(path, tmp_path / "v1.json", to_v1)
    assert quant.Calibration.load(v1).convs is False
    with pytest.raises(ValueError, match=rf"{v1} was recorded with compute_convs=False \(Dense layers only\).*"
                                         r"calibrate again"):  # fmt: skip
        load_pipeline(None, quantize=_policy(calibration=v1))
    pipe, _ = load_pipeline(None, quantize=_policy(compute_convs=False, calibration=v1))
    assert pipe.unet.convs is False and set(pipe.unet.amax) < set(calibration.amax_for("unet"))


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "is not JSON"),
        ('{"format": "something else"}', "is not an sdjax calibration"),
        ('{"format": "sdjax.quant.calibration", "version": 99}', "version 99"),
        ('{"format": "sdjax.quant.calibration", "version": 1, "compute": "int8"}', "lacks the field 'layers'"),
        (
            '{"format": "sdjax.quant.calibration", "version": 1, "compute": "int8", '
            '"layers": {"unet/a/kernel": {"shape": [2, 2], "sha256": "0", "amax": -1}}}',
            r"layer unet/a/kernel: 'amax' is -1",
        ),
    ],
)
def test_a_broken_file_is_refused_by_name(tmp_path, content, message):
    path = tmp_path / "cal.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"calibration file {path}.*{message}"):
        P.QuantPolicy("int8", compute="int8", calibration=path)


def test_bad_calibration_arguments_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"calibration file .*nope.json does not exist"):
        P.QuantPolicy("int8", compute="int8", calibration=tmp_path / "nope.json")
    empty = quant.Calibration("int8", {})
    with pytest.raises(ValueError, match="calibration needs compute="):
        P.QuantPolicy("int8", calibration=empty)
    with pytest.raises(TypeError, match=r"QuantPolicy.calibration=3"):
        P.QuantPolicy("int8", compute="int8", calibration=3)
    pipe, _ = load_pipeline(None, quantize="int8")
    with pytest.raises(ValueError, match="calibrate\\(pipe\\): the pipeline has no quantized compute"):
        quant.calibrate(pipe, PROMPTS)
    with pytest.raises(ValueError, match=r"calibrate\(steps=0\)"):
        quant.calibrate(load_pipeline(None, quantize=_policy())[0], PROMPTS, steps=0)


def test_cli_calibrate_writes_a_file_the_policy_loads(tmp_path):
    from typer.testing import CliRunner

    from sdjax.cli import app

    runner = CliRunner()
    no_prompt = runner.invoke(app, ["calibrate", "-o", str(tmp_path / "c.json")])
    assert no_prompt.exit_code == 2 and "--prompt" in no_prompt.output
    no_output = runner.invoke(app, ["calibrate", "-p", "a red circle"])  # the embedded model: no folder to write to
    assert no_output.exit_code == 2 and "-o FILE" in no_output.output
    out = tmp_path / "cal.json"
    ok = runner.invoke(app, ["calibrate", "-p", "a red circle", "-p", "a green square", "--steps", "1", "-o", str(out)])
    assert ok.exit_code == 0, ok.output
    calibration = quant.Calibration.load(out)
    assert calibration.steps == 1 and calibration.prompts == ("a red circle", "a green square")
    assert calibration.layers and all(rec.amax is not None for rec in calibration.layers.values())
    load_pipeline(None, quantize=_policy(calibration=out))  # checked against the same model: accepted
