"""Issue 19, findings 5 and 6: endpoints clients call that were missing (`/sdapi/v1/schedulers`, `POST
/sdapi/v1/options`, `/sdapi/v1/png-info`, OpenAI `response_format: "url"`), `override_settings` silently ignored,
`/docs` loading its assets from a CDN."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
import zlib
from pathlib import Path

import pytest
from fake_pipeline import FakePipeline
from PIL import Image
from server_helpers import check_image, client, decode_png, live_server
from test_server_errors import assert_error

from sdjax import infotext
from sdjax.samplers import a1111
from sdjax.server import Limits, schemas
from sdjax.server.schemas import FieldError, decode_image

OPENAI = "/v1/images/generations"
A1111 = "/sdapi/v1/txt2img"


@pytest.fixture(scope="module")
def server():
    with live_server(warm=False, file_ttl_s=1.0, max_files=3, limits=Limits(max_image_pixels=128 * 128)) as s:
        yield s


@pytest.fixture
def http(server):
    with client(server.url) as c:
        yield c


def png_b64(size=(16, 16), text: str | None = None, fmt="PNG") -> str:
    image = Image.new("RGB", size, (10, 200, 30))
    buf = io.BytesIO()
    if text is not None:
        buf.write(infotext.png_bytes(image, text))
    else:
        image.save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def test_schedulers(http):
    items = http.get("/sdapi/v1/schedulers").json()
    assert items[0] == {"name": "automatic", "label": "Automatic", "aliases": None, "default_rho": -1.0,
                        "need_inner_model": False}  # fmt: skip
    assert [i["name"] for i in items] == [s["name"] for s in a1111.a1111_schedulers()]
    assert {"automatic", "karras", "exponential", "sgm_uniform", "beta"} <= {i["name"] for i in items}
    assert "polyexponential" not in {i["name"] for i in items}  # no diffusers equivalent: not offered
    assert all(set(i) == {"name", "label", "aliases", "default_rho", "need_inner_model"} for i in items)


def test_scheduler_field(http):
    r = http.post(A1111, json={"prompt": "x", "seed": 1, "sampler_name": "DPM++ 2M", "scheduler": "karras"})
    check_image(r.json()["images"][0], sampler="dpmpp_2m_karras")
    r = http.post(A1111, json={"prompt": "x", "seed": 1, "sampler_name": "DPM++ 2M", "scheduler": "Automatic"})
    check_image(r.json()["images"][0], sampler="dpmpp_2m_karras")  # A1111's Automatic for DPM++ 2M is Karras
    assert_error(http.post(A1111, json={"prompt": "x", "scheduler": "Bogus"}), 422, "scheduler", "unknown schedule")
    assert_error(http.post(A1111, json={"prompt": "x", "sampler_name": "Restart"}), 422, "sampler_name", "no diffusers")
    e = assert_error(http.post(A1111, json={"prompt": "x", "sampler_name": "Euler a", "scheduler": "Karras"}), 422,
                     "scheduler", "does not have")  # fmt: skip
    assert "Euler a" in e["message"]


def test_override_settings_honoured_or_refused(http):
    ok = {"sd_model_checkpoint": "fake-model", "CLIP_stop_at_last_layers": 1, "samples_format": "PNG", "sd_vae": "None"}
    assert http.post(A1111, json={"prompt": "x", "override_settings": ok}).status_code == 200
    assert http.post(A1111, json={"prompt": "x", "override_settings": {}}).status_code == 200
    for settings, key, words in (
        ({"CLIP_stop_at_last_layers": 2}, "override_settings.CLIP_stop_at_last_layers", "no CLIP text encoder"),
        ({"CLIP_stop_at_last_layers": "2"}, "override_settings.CLIP_stop_at_last_layers", "not an int"),
        ({"sd_vae": "other.safetensors"}, "override_settings.sd_vae", "no VAE/ folder"),
        ({"sd_model_checkpoint": "other"}, "override_settings.sd_model_checkpoint", "cannot be honoured"),
        ({"enable_pnginfo": False}, "override_settings.enable_pnginfo", "not supported"),
        ({"samples_format": "jpg"}, "override_settings.samples_format", "png"),
    ):
        assert_error(http.post(A1111, json={"prompt": "x", "override_settings": settings}), 422, key, words)


def test_options_without_a_models_directory(http):
    assert http.get("/sdapi/v1/options").json()["sd_model_checkpoint"] == "fake-model"
    assert http.post("/sdapi/v1/options", json={"sd_model_checkpoint": "fake-model"}).status_code == 200
    assert_error(http.post("/sdapi/v1/options", json={"sd_model_checkpoint": "other"}), 422, "sd_model_checkpoint",
                 "--models-dir")  # fmt: skip
    assert_error(
        http.post("/sdapi/v1/options", json={"show_progressbar": True}), 422, "show_progressbar", "not supported"
    )


def test_switching_models(tmp_path):
    for name, size in (("small", 32), ("wide", 48)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text("{}")
        (tmp_path / name / "size").write_text(str(size))
    (tmp_path / "not-a-model").mkdir()
    loads = []
    release = threading.Event()

    def loader(path: str):
        loads.append(path)
        release.wait(10)
        size = int((tmp_path / Path(path).name / "size").read_text())
        return FakePipeline(size=(size, size))

    config = dict(loader=loader, models_dir=str(tmp_path), model_name="start", max_batch=1)
    with live_server(FakePipeline(), **config) as s, client(s.url) as c:
        assert [m["title"] for m in c.get("/sdapi/v1/sd-models").json()] == ["small", "wide"]
        for bad in ("../small", "/etc", "not-a-model", "small/../wide", ""):
            assert_error(c.post("/sdapi/v1/options", json={"sd_model_checkpoint": bad}), 422, "sd_model_checkpoint")
        out = {}
        t = threading.Thread(
            target=lambda: out.update(r=c.post("/sdapi/v1/options", json={"sd_model_checkpoint": "wide"}))
        )
        t.start()
        time.sleep(0.3)
        with client(s.url) as c2:
            ready = c2.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "switching model"
        release.set()
        t.join(10)
        assert out["r"].status_code == 200 and loads == [str(tmp_path / "wide")]
        assert c.get("/sdapi/v1/options").json()["sd_model_checkpoint"] == "wide"
        assert c.get("/health/ready").status_code == 200
        r = c.post(A1111, json={"prompt": "after", "seed": 1})
        check_image(r.json()["images"][0], model="wide", width=48, height=48)
        assert json.loads(r.json()["info"])["sd_model_name"] == "wide"
        # the new model was compiled at start-up's shapes for its own default size
        assert s.app.state.box["served"].pipeline.calls[0]["height"] == 48


def test_png_info(http):
    r = http.post(A1111, json={"prompt": "a red circle\non two lines", "negative_prompt": "blue", "seed": 5})
    png = r.json()["images"][0]
    info = http.post("/sdapi/v1/png-info", json={"image": png}).json()
    assert info["info"] == json.loads(r.json()["info"])["infotexts"][0]
    assert info["parameters"]["Prompt"] == "a red circle\non two lines" and info["parameters"]["Seed"] == "5"
    assert info["items"] == {}
    data_url = "data:image/png;base64," + png
    assert http.post("/sdapi/v1/png-info", json={"image": data_url}).json()["info"] == info["info"]
    assert http.post("/sdapi/v1/png-info", json={"image": png_b64()}).json() == {
        "info": "",
        "items": {},
        "parameters": {},
    }
    assert_error(http.post("/sdapi/v1/png-info", json={"image": "not base64!"}), 422, "image", "base64")
    assert_error(
        http.post("/sdapi/v1/png-info", json={"image": png_b64((200, 200))}), 422, "image", "exceeds the limit"
    )


def test_decode_image_limits():
    limits = Limits(max_image_pixels=64 * 64, max_image_bytes=10_000)
    assert decode_image(png_b64((64, 64)), field="init_images.0", limits=limits).size == (64, 64)
    assert decode_image(png_b64((8, 8), fmt="JPEG"), field="f", limits=limits).format == "JPEG"
    assert decode_image("data:image/webp;base64," + png_b64((8, 8), fmt="WEBP"), field="f", limits=limits).size == (
        8,
        8,
    )
    cases = [
        (png_b64((65, 64)), "exceeds the limit of 4096"),
        (png_b64((8, 8), fmt="GIF"), "not a PNG, JPEG, WEBP image"),
        (base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode(), "not a PNG"),
        ("data:image/png,rawdata", "data URL"),
        ("A" * 20_000, "over 10000 bytes"),
        ("", "expected a base64"),
    ]
    for data, words in cases:
        with pytest.raises(FieldError, match=re.escape(words)) as e:
            decode_image(data, field="init_images.0", limits=limits)
        assert e.value.field == "init_images.0" and e.value.status == 422
    # a pixel bomb: a valid PNG header claiming 50000 x 50000 pixels is refused before any pixel is decoded
    header = Image.new("1", (1, 1))
    buf = io.BytesIO()
    header.save(buf, format="PNG")
    raw = bytearray(buf.getvalue())
    raw[16:24] = (50000).to_bytes(4, "big") * 2  # IHDR width and height
    raw[29:33] = zlib.crc32(bytes(raw[12:29])).to_bytes(4, "big")  # the chunk's CRC over its type and data
    with pytest.raises(FieldError, match="pixels"):
        decode_image(base64.b64encode(bytes(raw)).decode(), field="image", limits=limits)


def test_response_format_url(server, http):
    r = http.post(OPENAI, json={"prompt": "linked", "seed": 8, "n": 2, "response_format": "url"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert all(set(d) == {"url"} for d in data)
    urls = [d["url"] for d in data]
    assert all(u.startswith(server.url + "/v1/files/img-") for u in urls) and len(set(urls)) == 2
    b64 = http.post(OPENAI, json={"prompt": "linked", "seed": 8, "n": 2}).json()["data"]
    for url, item in zip(urls, b64):
        got = http.get(url)
        assert got.status_code == 200 and got.headers["content-type"] == "image/png"
        assert got.content == base64.b64decode(item["b64_json"])  # the same image, byte for byte
    time.sleep(1.2)  # file_ttl_s=1
    assert_error(http.get(urls[0]), 404, "file_id", "expire")


def test_the_file_store_is_bounded(http):
    urls = [
        http.post(OPENAI, json={"prompt": f"p{i}", "response_format": "url"}).json()["data"][0]["url"] for i in range(4)
    ]
    assert http.get(urls[0]).status_code == 404  # max_files=3: the oldest went first
    assert all(http.get(u).status_code == 200 for u in urls[1:])
    assert http.get("/v1/files/img-guess").status_code == 404


def test_docs_are_served_from_local_assets(http):
    pytest.importorskip("swagger_ui_bundle", reason="the serve extra installs swagger-ui-bundle")
    page = http.get("/docs")
    assert page.status_code == 200
    assert "http://" not in page.text and "https://" not in page.text and "cdn" not in page.text.lower()
    for asset in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        got = http.get(asset)
        assert got.status_code == 200 and len(got.content) > 100, asset
    assert "/sdapi/v1/txt2img" in http.get("/openapi.json").text


def test_docs_off_when_asked():
    with live_server(docs=False, warm=False) as s, client(s.url) as c:
        assert c.get("/docs").status_code == 404 and c.get("/openapi.json").status_code == 200


def test_samplers_and_progress_shapes(http):
    names = [s["name"] for s in http.get("/sdapi/v1/samplers").json()]
    assert names == [s["name"] for s in a1111.a1111_samplers()] and {"Euler a", "DPM++ 2M", "DDIM"} <= set(names)
    p = http.get("/sdapi/v1/progress").json()
    assert p["current_image"] is None and p["state"]["skipped"] is False
    _, text = decode_png(http.post(A1111, json={"prompt": "x"}).json()["images"][0])
    assert "Steps: 4" in text


def test_a1111_requests_read_a1111_prompt_syntax(server, http):
    before = len(server.pipeline.prompt_syntaxes)
    assert http.post(A1111, json={"prompt": "(x:1.2)", "seed": 1}).status_code == 200
    assert http.post("/v1/images/generations", json={"prompt": "(x:1.2)", "size": "64x64"}).status_code == 200
    assert server.pipeline.prompt_syntaxes[before:] == ["a1111", None]
    assert_error(http.post(A1111, json={"prompt": "a <lora:x:0.5>"}), 422, "prompt", "<lora:x")
    assert_error(
        http.post(A1111, json={"prompt": "a", "negative_prompt": "<lora:y:bad>"}),
        422,
        "negative_prompt",
        "not a number",
    )


def test_a1111_informational_endpoints(http):
    """The GET endpoints A1111 clients call at start-up, in A1111's shapes, listing only what sdjax has."""
    flags = http.get("/sdapi/v1/cmd-flags").json()
    assert flags["api"] is True and flags["nowebui"] is False and flags["api_auth"] is None
    assert flags["no_half"] is True  # the fake serves float32
    assert not any("dir" in k for k in flags)  # the server's layout is not disclosed
    assert http.get("/sdapi/v1/upscalers").json() == [
        {"name": n, "model_name": None, "model_path": None, "model_url": None, "scale": None}
        for n in ("Lanczos", "Nearest")
    ]
    modes = [m["name"] for m in http.get("/sdapi/v1/latent-upscale-modes").json()]
    assert modes == ["Latent", "Latent (nearest)", "Latent (nearest-exact)"]
    pipe = FakePipeline()
    for name in [*modes, "Lanczos", "Nearest"]:  # each is an hr_upscaler the server takes
        body = schemas.A1111Txt2ImgRequest(prompt="x", enable_hr=True, hr_upscaler=name)
        schemas.resolve_a1111(body, pipe, Limits(), schemas.Defaults.of(pipe), "fake")
    assert http.get("/sdapi/v1/scripts").json() == {"txt2img": [], "img2img": []}  # no --controlnet-dir here
    memory = http.get("/sdapi/v1/memory").json()
    assert memory["ram"]["used"] > 0 and memory["ram"]["total"] > memory["ram"]["used"]
    assert memory["ram"]["free"] == memory["ram"]["total"] - memory["ram"]["used"]
    assert memory["cuda"] == {"error": "unavailable"}  # the CPU reports no device memory
    assert http.get("/sdapi/v1/prompt-styles").json() == []


def test_scripts_list_controlnet_where_it_is_served(tmp_path):
    with live_server(warm=False, controlnet_dir=str(tmp_path), api_auth=(("u", "p"),)) as s, client(s.url) as c:
        c.auth = ("u", "p")
        assert c.get("/sdapi/v1/scripts").json() == {"txt2img": ["controlnet"], "img2img": ["controlnet"]}
        assert c.get("/sdapi/v1/cmd-flags").json()["api_auth"] == "***"  # never the credentials


def test_script_name_is_refused_unless_empty(http):
    body = {"prompt": "x", "seed": 3, "init_images": [png_b64((64, 64))]}
    for path in (A1111, "/sdapi/v1/img2img"):
        assert_error(http.post(path, json={**body, "script_name": "x/y/z plot"}), 422, "script_name", "no selectable")
    pipe = FakePipeline()  # (the fake has no img2img: the empty names are resolved, not run)
    for empty in (None, "", " "):
        assert http.post(A1111, json={**body, "script_name": empty, "script_args": []}).status_code == 200
        request = schemas.A1111Img2ImgRequest(**body, script_name=empty)
        schemas.resolve_a1111_img2img(request, pipe, Limits(), schemas.Defaults.of(pipe), "fake")
