"""Model switching over a models directory keeps the server's quantization: a server started as `sdjax serve
--quantize int8` (the start-up model loaded with `quantize="int8"`, the switch loader `sdjax serve` passes) serves
a switched-in model with its UNet kernels int8, and its image is the Python API's with `quantize="int8"` on that
model. The loader is asked for the model quantized (`quantize=` the start-up policy, read for that model), so the
model loads straight to int8: a model folder whose UNet is only its saved int8 file (float weights deleted) switches
in, with the params of `load_pipeline(quantize="int8")` on the float weights. A loader without `quantize=` (the
plain `loader(path)` of `create_app`) still gets a quantized model, quantized after it loads. With `--quant-compute
int8 --calibration` of the start-up model, the switched-in model computes in int8 with per-call input scales (the
calibration belongs to the other model: dropped, with a warning naming the file), and switching back applies the
calibration again.

Tiny models: copies of the embedded one, the second with its UNet weights scaled by 1.05, the third the second
with its UNet saved quantized to int8 and its float UNet weights deleted.
"""

from __future__ import annotations

import base64
import io
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from bit_identical import assert_bit_identical
from PIL import Image
from safetensors.numpy import load_file, save_file
from server_helpers import client, live_server

import sdjax
from sdjax import cli, quant
from sdjax.cli.serve import _switch_loader
from sdjax.loading.components import quantized_file, save_quantized_components
from sdjax.loading.files import MissingWeightsError
from sdjax.pipelines import load_pipeline
from sdjax.server import models_api

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
    third = root / "Stable-diffusion" / "third"
    shutil.copytree(root / "Stable-diffusion" / "second", third)
    pipe, params = load_pipeline(str(third), quantize="int8")
    save_quantized_components(third, params, pipe.quantization, dtype=pipe.dtype)
    (third / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    return root


class Recorder:
    """`sdjax serve --models-dir`'s switch loader (at float32, no --vae), recording what it was asked for."""

    def __init__(self):
        self.loader = _switch_loader(SimpleNamespace(dtype="float32"), None)
        self.calls: list[tuple[str, object]] = []

    def __call__(self, path: str, quantize=None):
        self.calls.append((Path(path).name, quantize))
        return self.loader(path, quantize=quantize)


def _serve(pipe, models: Path, loader=None):
    config = dict(models_dir=str(models), model_name="first", checkpoint="first", warm=False, max_batch=1)
    return live_server(pipe, loader=loader or Recorder(), **config)


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
    loader = Recorder()
    with _serve(pipe, models, loader) as s, client(s.url, timeout=600) as c:
        _switch(c, "second")
        served = s.app.state.server.served().pipeline
        got = _pixels(c.post("/sdapi/v1/txt2img", json=request).json()["images"][0])
    assert loader.calls == [("second", quant.QuantPolicy("int8", components=("unet",)))]  # loaded quantized
    assert served is not pipe and served.quantization.scheme == "int8" and served.quantization.compute is None
    second = str(models / "Stable-diffusion" / "second")
    ref, ref_params = load_pipeline(second, quantize="int8")
    kernels = quant.scheme.quantized_kernels(served.params["unet"])
    ref_kernels = quant.scheme.quantized_kernels(ref_params["unet"])
    assert len(kernels) == len(ref_kernels) > 10 and all(q.dtype == np.int8 for q, _ in kernels.values())
    for path, (q, scale) in ref_kernels.items():  # the same int8 values and scales as quantize="int8" on the model
        np.testing.assert_array_equal(np.asarray(kernels[path][0]), np.asarray(q), err_msg=path)
        np.testing.assert_array_equal(np.asarray(kernels[path][1]), np.asarray(scale), err_msg=path)
    # with a progress callback that takes the latents, as the server's: the served program (one compile for both)
    want = ref.generate(request["prompt"], seed=3, steps=STEPS, progress=lambda *a, **k: None)[0]
    want = np.asarray(want, np.int16)
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


def test_a_switched_model_loads_straight_to_int8(models):
    """The third model's folder has no float UNet weights, only its saved int8 UNet: the switch can only read that
    (a full-precision load of it fails), and serves the params of quantizing the second's float weights on load."""
    third = models / "Stable-diffusion" / "third"
    assert quantized_file(third, "unet", "int8").is_file()
    assert not (third / "unet" / "diffusion_pytorch_model.safetensors").exists()
    pipe = cli.load_pipeline(str(models / "Stable-diffusion" / "first"), "float32", quantize="int8")
    loader = Recorder()
    with _serve(pipe, models, loader) as s, client(s.url, timeout=600) as c:
        _switch(c, "third")
        served = s.app.state.server.served().pipeline
    assert loader.calls == [("third", quant.QuantPolicy("int8", components=("unet",)))]
    _, reference = load_pipeline(str(models / "Stable-diffusion" / "second"), quantize="int8")
    assert served.quantization == quant.QuantPolicy("int8", components=("unet",))
    assert_bit_identical(served.params, reference)
    # the same switch through a loader without quantize= would load the float weights first: there are none
    with pytest.raises(MissingWeightsError, match="third/unet: no weight file found"):
        models_api.load_like(
            lambda path: cli.load_pipeline(path, "float32"), str(third), pipe.quantization, "unet", "x"
        )


def test_a_loader_without_quantize_gets_the_model_quantized_after_it_loads(models):
    """`create_app`'s plain `loader(path)`: called with the path only, the model quantized afterwards, to the
    same params."""
    second = str(models / "Stable-diffusion" / "second")
    paths = []

    def loader(path: str):
        paths.append(path)
        return cli.load_pipeline(path, "float32")

    policy = quant.QuantPolicy("int8", components=("unet",))
    got = models_api.load_like(loader, second, policy, "unet", "second")
    assert paths == [second] and got.quantization == policy
    assert_bit_identical(got.params, load_pipeline(second, quantize="int8")[1])


def test_load_policy_reads_the_start_up_policy_for_the_new_model(models):
    """The start-up policy as the load of another model takes it: the start-up denoiser read as this model's,
    components it does not have left out (the text encoder 2 of an SDXL start-up model); a model none of whose
    components is named loads without one. (Its calibration is left out: test_a_calibration_follows_only_its_own_model
    switches to a model the calibration does not fit.)"""
    second = str(models / "Stable-diffusion" / "second")
    policy = quant.QuantPolicy(
        "fp8", components=("transformer", "text_encoder_2", "text_encoder"), min_size=4096, compute="fp8"
    )
    got = models_api.load_policy(second, policy, "transformer")
    assert got == quant.QuantPolicy("fp8", components=("unet", "text_encoder"), min_size=4096, compute="fp8")
    assert models_api.load_policy(second, quant.QuantPolicy("int8", components=("text_encoder_2",)), "unet") is None
    assert models_api.load_policy(second, None, "unet") is None
    # whether the server may pass quantize= at all
    assert models_api.takes_quantize(Recorder()) and models_api.takes_quantize(lambda path, **kw: None)
    assert not models_api.takes_quantize(lambda path: None)
