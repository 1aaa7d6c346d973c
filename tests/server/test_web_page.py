"""The web page end to end in headless Chromium (Debian's `chromium`, driven by Playwright) against a live server
on 127.0.0.1: fill the form, generate, watch progress, check the gallery, its parameters and the download."""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from fake_pipeline import FakePipeline, expected
from server_helpers import live_server

from sdjax import infotext, metadata

CHROMIUM = os.environ.get("SDJAX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

playwright_api = pytest.importorskip("playwright.sync_api", reason="the test extra installs playwright")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium binary: `apt-get install -y chromium` (Debian) or set SDJAX_CHROMIUM to a Chromium binary",
)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def tiny(sd1_dir):
    """The tiny pipeline, loaded once for the inpainting and ControlNet tests (its text encoder's and VAE's
    programs compiled once for both)."""
    from sdjax import cli

    return cli.load_pipeline(str(sd1_dir), "float32")


@pytest.fixture
def page(browser):
    context = browser.new_context(accept_downloads=True, viewport={"width": 1100, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, errors


def test_generate_from_the_page(page, tmp_path):
    pipe = FakePipeline(delay_s=1.2)  # slow enough to see progress
    with live_server(pipe, model_name="fake-model") as server:
        page.goto(server.url + "/")
        page.wait_for_function("!document.getElementById('generate').disabled")
        assert page.text_content("#model") == "fake-model"
        assert page.eval_on_selector_all("#sampler option", "os => os.map(o => o.value)") == pipe.sampler_names
        assert page.input_value("#sampler") == "euler_a"
        assert page.text_content("#sampler option:checked") == "Euler a"
        assert page.input_value("#width") == "64" and page.input_value("#steps") == "4"
        assert not page.is_visible("#controlnet")  # no ControlNets served: no panel

        page.fill("#prompt", "a lighthouse, at night")
        page.fill("#negative", "fog")
        page.fill("#width", "48")
        page.fill("#height", "32")
        page.fill("#steps", "6")
        page.fill("#guidance", "5.5")
        page.fill("#seed", "77")
        page.fill("#count", "2")
        page.select_option("#sampler", "ddim")
        page.click("#generate")

        # progress: the button is disabled and the bar moves while the batch runs
        assert page.is_disabled("#generate")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('step ')", timeout=10_000)
        assert page.is_visible("#progress")
        page.wait_for_selector("figure.result >> nth=1", timeout=20_000)
        page.wait_for_function("!document.getElementById('generate').disabled")
        assert "2 image(s)" in page.text_content("#status")
        assert not page.is_visible("#progress")

        figures = page.query_selector_all("figure.result")
        assert len(figures) == 2
        for k, fig in enumerate(figures):
            params = fig.query_selector("pre.params").text_content()
            assert params == (
                "a lighthouse, at night\nNegative prompt: fog\nSteps: 6, Sampler: DDIM, CFG scale: 5.5, "
                f"Seed: {77 + k}, Size: 48x32, Model: fake-model"
            )
            link = fig.query_selector("a.download")
            assert link.get_attribute("download") == f"sdjax-{77 + k}.png"
            # the image is displayed at its size
            assert fig.query_selector("img").evaluate("im => [im.naturalWidth, im.naturalHeight]") == [48, 32]

        # the download is the PNG with its parameters chunk and the right pixels
        with page.expect_download() as info:
            figures[1].query_selector("a.download").click()
        path = tmp_path / "download.png"
        info.value.save_as(path)
        text = infotext.read_parameters(path)
        assert metadata.parameters_from_text(text).seed == 78
        from PIL import Image

        with Image.open(path) as im:
            np.testing.assert_array_equal(
                np.asarray(im), expected("a lighthouse, at night", "fog", 78, 0, 5.5, 6, 32, 48, "ddim")
            )
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        if os.environ.get("SDJAX_SCREENSHOT_DIR"):
            shutil.copy(tmp_path / "page.png", Path(os.environ["SDJAX_SCREENSHOT_DIR"]) / "web_page.png")


def test_page_shows_errors_and_recovers(page):
    with live_server(FakePipeline(), model_name="fake-model") as server:
        page.goto(server.url + "/")
        page.wait_for_function("!document.getElementById('generate').disabled")
        page.fill("#prompt", "x")
        # the browser's own form checks: a width that is not a multiple of 8 is refused before sending
        page.fill("#width", "60")
        page.click("#generate")
        assert page.evaluate("document.getElementById('width').validity.stepMismatch")
        assert page.query_selector_all("figure.result") == []
        # a server-side refusal is shown with the field's name
        page.fill("#width", "2048")
        page.evaluate("document.getElementById('width').removeAttribute('max')")
        page.click("#generate")
        page.wait_for_function("document.getElementById('status').classList.contains('error')")
        assert "422" in page.text_content("#status") and "width" in page.text_content("#status")
        page.fill("#width", "64")
        page.click("#generate")
        page.wait_for_selector("figure.result")
        img = page.get_attribute("figure.result img", "src")
        assert infotext.read_parameters(base64.b64decode(img.split(",", 1)[1])).startswith("x\nSteps: 4")


def test_inpaint_from_the_page(page, tmp_path, tiny):
    """Upload an init image, paint a mask over it, set the strength: the page sends an A1111 img2img request with
    that image, the painted mask and the strength, and shows the inpainted result with its parameters."""
    from PIL import Image

    pipe = tiny
    init = np.random.default_rng(0).integers(0, 255, (8, 8, 3), np.uint8)
    Image.fromarray(init).resize((64, 64), Image.NEAREST).save(tmp_path / "init.png")
    with live_server(pipe, model_name="tiny", default_steps=3, warm=False) as server:
        page.goto(server.url + "/")
        page.wait_for_function("!document.getElementById('generate').disabled")
        page.fill("#prompt", "a red hat")
        page.fill("#seed", "3")
        page.set_input_files("#init-image", str(tmp_path / "init.png"))
        page.wait_for_selector("#paint.loaded")
        assert page.input_value("#width") == "64" and page.input_value("#height") == "64"
        # paint a broad stroke across the middle of the displayed mask
        page.eval_on_selector("#brush", "e => { e.value = '64'; }")
        box = page.query_selector("#mask-canvas").bounding_box()
        y = box["y"] + box["height"] / 2
        page.mouse.move(box["x"] + box["width"] * 0.2, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.8, y, steps=8)
        page.mouse.up()
        page.eval_on_selector("#strength", "e => { e.value = '0.5'; e.dispatchEvent(new Event('input')); }")
        assert page.text_content("#strength-value") == "0.5"
        with page.expect_request("**/sdapi/v1/img2img") as sent:
            page.click("#generate")
        body = sent.value.post_data_json
        assert body["denoising_strength"] == 0.5 and body["init_images"][0].startswith("data:image/png;base64,")
        mask = np.asarray(Image.open(__import__("io").BytesIO(base64.b64decode(body["mask"].split(",", 1)[1]))))
        assert mask.shape[:2] == (64, 64)
        painted = mask[..., 0] > 128
        assert painted[32, 20:44].all() and not painted[:8].any()  # the stroke, and untouched rows
        page.wait_for_function(
            "document.querySelector('figure.result') || document.getElementById('status').classList.contains('error')",
            timeout=120_000,
        )
        assert page.query_selector("figure.result"), page.text_content("#status")
        params = page.text_content("figure.result pre.params")
        assert "Denoising strength: 0.5" in params and "Mask blur: 4" in params


def test_controlnet_from_the_page(page, tmp_path, tiny, torch_sd1):
    """With ControlNets served the panel shows them and the preprocessors; a control image is previewed through
    /controlnet/detect (the canny map, recomputed when the module changes), and Generate sends the unit in
    `alwayson_scripts.controlnet.args` of the txt2img request; the result's infotext names it."""
    import io

    from controlnet_cases import torch_controlnet
    from PIL import Image

    from sdjax import preprocess

    nets = tmp_path / "nets"
    torch_controlnet(torch_sd1.unet, 11).save_pretrained(nets / "tiny_canny", safe_serialization=True)
    pixels = np.zeros((64, 64, 3), np.uint8)
    pixels[16:48, 20:40] = 255  # a white box: canny draws its outline
    Image.fromarray(pixels).save(tmp_path / "control.png")
    pipe = tiny
    with live_server(pipe, model_name="tiny", default_steps=2, warm=False, controlnet_dir=str(nets)) as server:
        page.goto(server.url + "/")
        page.wait_for_function("!document.getElementById('generate').disabled")
        page.wait_for_selector("#controlnet", state="visible")
        assert page.eval_on_selector_all("#cn-model option", "os => os.map(o => o.value)") == ["tiny_canny"]
        modules = page.eval_on_selector_all("#cn-module option", "os => os.map(o => o.value)")
        assert {"none", "canny", "invert"} <= set(modules) and page.input_value("#cn-module") == "none"
        assert not page.is_checked("#cn-enabled")

        page.fill("#prompt", "a house")
        page.fill("#seed", "5")
        with page.expect_response("**/controlnet/detect") as first:
            page.set_input_files("#cn-image", str(tmp_path / "control.png"))
        assert first.value.ok and page.is_checked("#cn-enabled")
        with page.expect_response("**/controlnet/detect") as detected:
            page.select_option("#cn-module", "canny")
        assert detected.value.request.post_data_json["controlnet_module"] == "canny"
        page.wait_for_function("(document.getElementById('cn-map').src || '').startsWith('data:image/png')")
        src = page.get_attribute("#cn-map", "src")
        shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))
        np.testing.assert_array_equal(shown, preprocess.canny(pixels))
        assert shown.any()

        page.fill("#cn-weight", "0.7")
        page.fill("#cn-end", "0.5")
        with page.expect_request("**/sdapi/v1/txt2img") as sent:
            page.click("#generate")
        (unit,) = sent.value.post_data_json["alwayson_scripts"]["controlnet"]["args"]
        assert unit["image"].startswith("data:image/png;base64,")
        assert {k: unit[k] for k in ("module", "model", "weight", "guidance_start", "guidance_end", "enabled")} == {
            "module": "canny", "model": "tiny_canny", "weight": 0.7, "guidance_start": 0, "guidance_end": 0.5,
            "enabled": True,
        }  # fmt: skip
        page.wait_for_function(
            "document.querySelector('figure.result') || document.getElementById('status').classList.contains('error')",
            timeout=180_000,
        )
        assert page.query_selector("figure.result"), page.text_content("#status")
        params = page.text_content("figure.result pre.params")
        assert 'ControlNet 0: "Module: canny, Model: tiny_canny, Weight: 0.7, Guidance Start: 0' in params
        assert "Guidance End: 0.5" in params

        # removing the image sends no unit: the request is checked, not run (the browser aborts it, so the server
        # compiles no ControlNet-less program for it; the page reports the failed request and re-enables Generate)
        page.click("#cn-remove")
        assert not page.is_checked("#cn-enabled") and not page.is_visible("#cn-maps")
        page.route("**/sdapi/v1/txt2img", lambda route: route.abort())
        with page.expect_request("**/sdapi/v1/txt2img") as sent:
            page.click("#generate")
        assert "alwayson_scripts" not in sent.value.post_data_json
        page.wait_for_function("!document.getElementById('generate').disabled", timeout=60_000)
