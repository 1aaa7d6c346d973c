"""Model switching over a models directory keeps the server's quantization: a server started as `sdjax serve
--quantize int8` (the start-up model loaded with `quantize="int8"`, the switch loader as `sdjax serve` passes it,
in full precision) serves a switched-in model with its UNet kernels int8, and its image is the Python API's with
`quantize="int8"` on that model. With `--quant-compute int8 --calibration` of the start-up model, the switched-in
model computes in int8 with per-call input scales (the calibration belongs to the other model: dropped, with a
warning naming the file), and switching back applies the calibration again.

Two tiny models: copies of the embedded one, the second with its UNet weights scaled by 1.05.
"""

from __future__ import annotations

import base64
import io
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file
from server_helpers import client, live_server

import sdjax
from sdjax import cli, quant
from sdjax.pipelines import load_pipeline

STEPS = 2
OPTIONS = "/sdapi/v1/options"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for name in ("first", "second"):
        shutil.copytree(Path(sdjax.EMBEDDED_MODEL), root / "Stable-diffusion" / name)
    weights = root / "Stable-diffusion" / "second" / "unet" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    save_file({k: (1.05 * v).astype(v.dtype) for k, v in state.items()}, str(weights))
    return root


def _loader(path: str):
    return cli.load_pipeline(path, "float32")  # what `sdjax serve --models-dir` switches with


def _serve(pipe, models: Path):
    config = dict(models_dir=str(models), model_name="first", checkpoint="first", warm=False, max_batch=1)
    return live_server(pipe, loader=_loader, **config)


def _pixels(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return np.asarray(im.convert("RGB"))


def _switch(c, name: str) -> None:
    r = c.post(OPTIONS, json={"sd_model_checkpoint": name})
    assert r.status_code == 200, r.text
    assert c.get(OPTIONS).json()["sd_model_checkpoint"] == name


def test_a_switched_model_is_quantized_like_the_first(models):
    pipe = cli.load_pipeline(str(models / "Stable-diffusion" / "first"), "float32", quantize="int8")
    request = {"prompt": "a red circle on a blue background", "seed": 3, "steps": STEPS}
    with _serve(pipe, models) as s, client(s.url, timeout=600) as c:
        _switch(c, "second")
        served = s.app.state.server.served().pipeline
        got = _pixels(c.post("/sdapi/v1/txt2img", json=request).json()["images"][0])
    assert served is not pipe and served.quantization.scheme == "int8" and served.quantization.compute is None
    second = str(models / "Stable-diffusion" / "second")
    ref, ref_params = load_pipeline(second, quantize="int8")
    kernels = quant.scheme.quantized_kernels(served.params["unet"])
    ref_kernels = quant.scheme.quantized_kernels(ref_params["unet"])
    assert len(kernels) == len(ref_kernels) > 10 and all(q.dtype == np.int8 for q, _ in kernels.values())
    for path, (q, scale) in ref_kernels.items():  # the same int8 values and scales as quantize="int8" on the model
        np.testing.assert_array_equal(np.asarray(kernels[path][0]), np.asarray(q), err_msg=path)
        np.testing.assert_array_equal(np.asarray(kernels[path][1]), np.asarray(scale), err_msg=path)
    want = np.asarray(ref.generate(request["prompt"], seed=3, steps=STEPS)[0], np.int16)
    assert int(np.abs(got.astype(np.int16) - want).max()) <= 1
    # ... which is not the unquantized model's image
    plain = np.asarray(load_pipeline(second)[0].generate(request["prompt"], seed=3, steps=STEPS)[0], np.int16)
    assert int(np.abs(plain - want).max()) > 1


def test_a_calibration_follows_only_its_own_model(models, tmp_path, caplog):
    first = str(models / "Stable-diffusion" / "first")
    policy = quant.QuantPolicy("int8", components=("unet",), compute="int8")
    pipe, _ = load_pipeline(first, quantize=policy)
    path = tmp_path / quant.CALIBRATION_FILE
    quant.calibrate(pipe, ["a green square"], steps=1).save(path)
    quant.use_calibration(pipe, path)  # as `sdjax serve --quantize int8 --quant-compute int8 --calibration FILE`
    caplog.set_level(logging.WARNING, logger="sdjax.server")
    with _serve(pipe, models) as s, client(s.url, timeout=600) as c:
        _switch(c, "second")
        second = s.app.state.server.served().pipeline
        _switch(c, "first")
        back = s.app.state.server.served().pipeline
    assert second.quantization.compute == "int8" and second.quantization.calibration is None
    assert second.unet.compute == "int8" and not second.unet.amax  # per-call input scales
    dropped = [r.getMessage() for r in caplog.records if "not applied to second" in r.getMessage()]
    assert len(dropped) == 1 and f"calibration file {path}" in dropped[0] and "other weights" in dropped[0], dropped
    assert back is not pipe and back.quantization.calibration is not None  # its own model: applied again
    assert back.unet.amax == quant.Calibration.load(path).amax_for("unet")
