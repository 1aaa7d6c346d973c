"""`POST /controlnet/detect` (sd-webui-controlnet's preprocessor API, the web page's map preview) against
`sdjax.preprocess` and OpenCV computed here; the 422s naming the body's key; the same reading of a txt2img unit's
`processor_res` / `threshold_a` / `threshold_b`; and, without a browser, the web page's ControlNet wiring (every
element its script names exists, the endpoints it calls)."""

from __future__ import annotations

import base64
import io
import re
from html.parser import HTMLParser

import cv2
import numpy as np
import pytest
from PIL import Image
from server_helpers import client, live_server
from test_server_errors import assert_error

from sdjax import preprocess
from sdjax.server import controlnet as controlnet_api
from sdjax.server.schemas import FieldError, Limits

DETECT = "/controlnet/detect"


def _png_b64(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _decode(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        assert im.format == "PNG"
        return np.asarray(im)


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    """Smoothed noise with a bright square: edges at every threshold, and at the square's border."""
    r = np.random.default_rng(7)
    x = cv2.GaussianBlur(r.integers(0, 256, (48, 80, 3)).astype(np.uint8), (0, 0), 1.5)
    x[12:36, 20:44] = 230
    return x


@pytest.fixture(scope="module")
def c():
    with live_server(warm=False, limits=Limits(max_images=3)) as s, client(s.url) as http:
        yield http


def test_detect_is_sdjax_canny(c, image):
    r = c.post(DETECT, json={"controlnet_module": "canny", "controlnet_input_images": [_png_b64(image)]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"images", "info"} and body["info"] == "Success" and len(body["images"]) == 1
    got = _decode(body["images"][0])
    np.testing.assert_array_equal(got, preprocess.canny(image))
    # (the map is not trivial: the square's border and some noise edges, not everything)
    assert 0.02 < (got[..., 0] == 255).mean() < 0.5
    # the sliders are canny's thresholds; a data: URL is an image too; one map per image, in order
    lo_hi = {"controlnet_threshold_a": 20, "controlnet_threshold_b": 60}
    urls = ["data:image/png;base64," + _png_b64(image), _png_b64(255 - image)]
    r = c.post(DETECT, json={"controlnet_module": "canny", "controlnet_input_images": urls, **lo_hi})
    maps = [_decode(b) for b in r.json()["images"]]
    np.testing.assert_array_equal(maps[0], cv2.Canny(image, 20.0, 60.0)[..., None].repeat(3, axis=2))
    np.testing.assert_array_equal(maps[1], preprocess.canny(255 - image, 20, 60))
    assert (maps[0] != got).any()  # lower thresholds: more edges


def test_detect_processor_res_and_other_modules(c, image):
    # processor_res: the short side (48) becomes 96 by bicubic enlarging, then canny at that size
    body = {"controlnet_module": "canny", "controlnet_input_images": [_png_b64(image)], "controlnet_processor_res": 96}
    got = _decode(c.post(DETECT, json=body).json()["images"][0])
    big = cv2.resize(image, (160, 96), interpolation=cv2.INTER_CUBIC)
    np.testing.assert_array_equal(got, cv2.Canny(big, 100.0, 200.0)[..., None].repeat(3, axis=2))
    # threshold's slider is its level; invert ignores processor_res and sliders (the extension's rule)
    level = {"controlnet_threshold_a": 150, "controlnet_threshold_b": 64}
    got = _decode(c.post(DETECT, json={**body, "controlnet_module": "threshold", **level}).json()["images"][0])
    small = cv2.resize(image, (160, 96), interpolation=cv2.INTER_CUBIC)
    np.testing.assert_array_equal(got, np.where(small.min(axis=2, keepdims=True) > 150, 255, 0).repeat(3, axis=2))
    got = _decode(c.post(DETECT, json={**body, "controlnet_module": "invert", **level}).json()["images"][0])
    np.testing.assert_array_equal(got, 255 - image)
    # a passthrough module (sdjax has no annotator for it) returns the given map; the UI label resolves too
    got = _decode(c.post(DETECT, json={**body, "controlnet_module": "depth_midas"}).json()["images"][0])
    np.testing.assert_array_equal(got, image)


@pytest.mark.parametrize(
    "change,field,words",
    [
        ({"controlnet_module": "bogus"}, "controlnet_module", "unknown controlnet preprocessor"),
        ({"controlnet_input_images": []}, "controlnet_input_images", "no image"),
        ({"controlnet_input_images": ["x"] * 4}, "controlnet_input_images", "at most 3"),
        ({"controlnet_input_images": ["not base64!"]}, "controlnet_input_images[0]", "base64"),
        ({"controlnet_input_images": "abc"}, "controlnet_input_images", "list"),
        ({"controlnet_processor_res": 0}, "controlnet_processor_res", "-1"),
        ({"controlnet_processor_res": 64.5}, "controlnet_processor_res", "integer"),
        ({"controlnet_input_images": [], "controlnet_images": ["x"] * 4}, "controlnet_images", "at most 3"),
        ({"controlnet_images": ["x"]}, "controlnet_images", "not both"),
        ({"controlnet_threshold_a": "low"}, "controlnet_threshold_a", "number"),
        ({"controlnet_threshold_b": "inf"}, "controlnet_threshold_b", "finite"),
        ({"controlnet_threshold_b": [1]}, "controlnet_threshold_b", "number"),
        ({"controlnet_threshold_a": 250, "controlnet_threshold_b": 50}, "controlnet_threshold_a", "low <= high"),
        ({"controlnet_threshold_a": 12.5}, "controlnet_threshold_a", "whole number"),
    ],
)
def test_detect_bad_input_is_named(c, image, change, field, words):
    body = {"controlnet_module": "canny", "controlnet_input_images": [_png_b64(image)], **change}
    assert_error(c.post(DETECT, json=body), 422, field, words)


def test_a_unit_reads_the_options_as_detect_does(image):
    """A txt2img unit's map: the same function with the unit's keys (and errors named inside the unit)."""
    nets = {"net": "/nets/net"}
    raw = {"image": _png_b64(image), "model": "net", "module": "canny", "threshold_a": 20, "threshold_b": 60}
    unit = controlnet_api._unit(raw, 0, nets, Limits(), (64, 64))
    assert unit.module == "canny"
    np.testing.assert_array_equal(unit.image, preprocess.canny(image, 20, 60))
    unit = controlnet_api._unit({**raw, "module": "canny", "processor_res": 24}, 0, nets, Limits(), (64, 64))
    small = cv2.resize(image, (40, 24), interpolation=cv2.INTER_AREA)  # shrinking: area averaging
    np.testing.assert_array_equal(unit.image, preprocess.canny(small, 20, 60))
    with pytest.raises(FieldError) as e:
        controlnet_api._unit({**raw, "threshold_b": "x"}, 1, nets, Limits(), (64, 64))
    assert e.value.field == "alwayson_scripts.controlnet.args[1].threshold_b"


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: dict[str, str] = {}
        self.script = ""
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self._in_script = tag == "script"
        for k, v in attrs:
            if k == "id":
                assert v not in self.ids, f"duplicate id {v!r}"
                self.ids[v] = tag

    def handle_data(self, data):
        if self._in_script:
            self.script += data


def test_page_wiring(c):
    page = _Ids()
    page.feed(c.get("/").text)
    # every element the script looks up exists (a typo would be a null at run time, in a browser only)
    used = set(re.findall(r'\$\("([\w-]+)"\)', page.script)) | set(
        re.findall(r'getElementById\("([\w-]+)"\)', page.script)
    )
    assert used and used <= set(page.ids), sorted(used - set(page.ids))
    # the ControlNet panel: image, module and model selects, weight and window, the preview
    for name, tag in [("controlnet", "fieldset"), ("cn-image", "input"), ("cn-module", "select"),
                      ("cn-model", "select"), ("cn-weight", "input"), ("cn-start", "input"), ("cn-end", "input"),
                      ("cn-map", "img"), ("cn-preview", "button")]:  # fmt: skip
        assert page.ids.get(name) == tag, name
        assert name in used, f"{name} is not used by the script"
    for url in ("/controlnet/model_list", "/controlnet/module_list", DETECT):
        assert f'"{url}"' in page.script, url
    assert re.search(r"alwayson_scripts\s*=", page.script) and "controlnet: { args: [" in page.script
    for key in ("controlnet_module", "controlnet_input_images", "guidance_start", "guidance_end", "weight"):
        assert key in page.script, key
    # the listings the panel reads: no --controlnet-dir, no nets (the panel stays hidden)
    assert c.get("/controlnet/model_list").json() == {"model_list": []}
    assert "canny" in c.get("/controlnet/module_list").json()["module_list"]
