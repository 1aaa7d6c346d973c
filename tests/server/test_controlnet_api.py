"""sd-webui-controlnet's API on the A1111 endpoints, on the tiny real model with a tiny ControlNet: the listings,
a txt2img unit giving the Python API's image with the same net and map, the infotext field, and 422s naming the
unit's key for what sdjax cannot honour."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from controlnet_cases import torch_controlnet
from PIL import Image
from server_helpers import client, live_server
from test_server_errors import assert_error

from sdjax import cli, infotext, preprocess

A1111 = "/sdapi/v1/txt2img"


@pytest.fixture(scope="module")
def setup(sd1_dir, torch_sd1, tmp_path_factory):
    root = tmp_path_factory.mktemp("controlnets")
    torch_controlnet(torch_sd1.unet, 11).save_pretrained(root / "tiny_canny", safe_serialization=True)
    (root / "not-a-net").mkdir()
    (root / "control_v11p_sd15_depth.safetensors").write_bytes(b"")  # single files are listed by their stem
    pipe = cli.load_pipeline(str(sd1_dir), "float32")
    pixels = ((np.random.default_rng(4).random((64, 64, 3)) > 0.5) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    server = live_server(pipe, max_batch=2, model_name="tiny", warm=False, controlnet_dir=str(root))
    with server as s, client(s.url, timeout=600) as c:
        yield pipe, root, pixels, base64.b64encode(buf.getvalue()).decode(), c


def _body(image_b64, **unit):
    return {
        "prompt": "a house", "seed": 5, "steps": 2, "width": 64, "height": 64, "cfg_scale": 7.5, "sampler_name": "DDIM",
        "alwayson_scripts": {"controlnet": {"args": [{"image": image_b64, "model": "tiny_canny [0123abcd]",
                                                      "module": "invert", "weight": 0.7, **unit}]}},
    }  # fmt: skip


def test_listings(setup):
    *_, c = setup
    assert c.get("/controlnet/model_list").json() == {"model_list": ["control_v11p_sd15_depth", "tiny_canny"]}
    modules = c.get("/controlnet/module_list").json()["module_list"]
    assert {"none", "canny", "invert", "depth"} <= set(modules)


def test_unit_gives_the_api_image(setup):
    pipe, root, pixels, b64, c = setup
    r = c.post(A1111, json=_body(b64))
    assert r.status_code == 200, r.text
    png = base64.b64decode(r.json()["images"][0])
    text = infotext.read_parameters(png)
    assert 'ControlNet 0: "Module: invert, Model: tiny_canny, Weight: 0.7, Guidance Start: 0.0' in text
    # A no-op progress callback taking the latents, as the server's: the same compiled program (no second compile).
    ref = pipe.generate(
        "a house", seed=5, steps=2, height=64, width=64, guidance_scale=7.5, sampler="DDIM",
        controlnet=str(root / "tiny_canny"), control_image=preprocess.invert(pixels),
        controlnet_conditioning_scale=0.7, progress=lambda stage, step, total, latents=None: None,
    )[0]  # fmt: skip
    ours = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), np.int16)
    assert np.abs(ours - np.asarray(ref, np.int16)).max() <= 1
    off = c.post(A1111, json=_body(b64, enabled=False)).json()["images"][0]
    plain = np.asarray(Image.open(io.BytesIO(base64.b64decode(off))).convert("RGB"), np.int16)
    assert np.abs(plain - ours).max() > 5  # a disabled unit is no unit


@pytest.mark.parametrize(
    "unit,field,words",
    [
        ({"model": "other"}, "alwayson_scripts.controlnet.args[0].model", "unknown controlnet"),
        ({"model": "../not-a-net"}, "alwayson_scripts.controlnet.args[0].model", "unknown controlnet"),
        ({"module": "bogus"}, "alwayson_scripts.controlnet.args[0].module", "bogus"),
        (
            {"control_mode": "My prompt is more important"},
            "alwayson_scripts.controlnet.args[0].control_mode",
            "balanced",
        ),
        ({"resize_mode": "Resize Somehow"}, "alwayson_scripts.controlnet.args[0].resize_mode", "resize and fill"),
        ({"resize_mode": 7}, "alwayson_scripts.controlnet.args[0].resize_mode", "just resize"),
        ({"hr_option": "Mid res only"}, "alwayson_scripts.controlnet.args[0].hr_option", "low res only"),
        ({"resize_mode": [1]}, "alwayson_scripts.controlnet.args[0].resize_mode", "just resize"),  # no 500
        ({"control_mode": {}}, "alwayson_scripts.controlnet.args[0].control_mode", "balanced"),
        ({"weight": "heavy"}, "alwayson_scripts.controlnet.args[0].weight", "number"),
        ({"image": "not base64!"}, "alwayson_scripts.controlnet.args[0].image", "base64"),
        ({"frobnicate": 1}, "alwayson_scripts.controlnet.args[0]", "unknown key"),
    ],
)
def test_bad_units_are_named(setup, unit, field, words):
    *_, b64, c = setup
    assert_error(c.post(A1111, json=_body(b64, **unit)), 422, field, words)


def test_other_scripts_are_refused(setup):
    *_, b64, c = setup
    body = {"prompt": "x", "alwayson_scripts": {"ADetailer": {"args": []}}}
    assert_error(c.post(A1111, json=body), 422, "alwayson_scripts", "not supported")


def test_webuiapi_controlnet_unit(setup):
    """webuiapi's own `ControlNetUnit` as it sends it: `hr_option` ("Both") and its default resize mode "Resize and
    Fill" (the extension's outer fit: a 64x32 map on a 64x64 image is centred on its median border colour)."""
    webuiapi = pytest.importorskip("webuiapi", reason="the test extra installs webuiapi")
    pipe, root, pixels, _, c = setup
    wide = pixels[16:48]  # 64 wide, 32 high
    host, port = str(c.base_url).removeprefix("http://").rstrip("/").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port))
    unit = webuiapi.ControlNetUnit(image=Image.fromarray(wide), module="invert", model="tiny_canny", weight=0.7)
    assert unit.to_dict()["resize_mode"] == "Resize and Fill" and unit.to_dict()["hr_option"] == "Both"
    result = api.txt2img(
        prompt="a house", seed=5, steps=2, width=64, height=64, cfg_scale=7.5, sampler_name="DDIM",
        controlnet_units=[unit], alwayson_scripts={},  # (webuiapi adds the units to its default dict otherwise)
    )  # fmt: skip
    inverted = preprocess.invert(wide)
    border = np.concatenate([inverted[0], inverted[-1], inverted[:, 0], inverted[:, -1]])
    filled = np.tile(np.median(border, axis=0).astype(np.uint8), (64, 64, 1))
    filled[16:48] = inverted  # the extension's outer fit: scale 1, 16 rows of border colour above and below
    ref = pipe.generate(
        "a house", seed=5, steps=2, height=64, width=64, guidance_scale=7.5, sampler="DDIM",
        controlnet=str(root / "tiny_canny"), control_image=filled, controlnet_conditioning_scale=0.7,
        progress=lambda stage, step, total, latents=None: None,
    )[0]  # fmt: skip
    ours = np.asarray(result.image.convert("RGB"), np.int16)
    assert np.abs(ours - np.asarray(ref, np.int16)).max() <= 1
    stretched = pipe.generate(
        "a house", seed=5, steps=2, height=64, width=64, guidance_scale=7.5, sampler="DDIM",
        controlnet=str(root / "tiny_canny"), control_image=inverted, controlnet_conditioning_scale=0.7,
        progress=lambda stage, step, total, latents=None: None,
    )[0]  # fmt: skip
    assert np.abs(ours - np.asarray(stretched, np.int16)).max() > 5  # not the map stretched to the image
