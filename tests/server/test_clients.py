"""The real clients, unmodified, against a live server on 127.0.0.1: the `openai` package (images.generate with
b64_json and url, errors as its exceptions, the API key) and `webuiapi` (txt2img, interrupt, skip, progress,
schedulers, png-info, options and model switching, basic auth, ControlNet detect, the informational GETs), and
the `openai` client's image streaming. img2img comes with the generation core."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import numpy as np
import pytest
from fake_pipeline import FakePipeline
from PIL import Image
from server_helpers import check_image, live_server

from sdjax import infotext, metadata, preprocess
from sdjax.samplers import a1111

openai = pytest.importorskip("openai", reason="the test extra installs openai")
webuiapi = pytest.importorskip("webuiapi", reason="the test extra installs webuiapi")

KEY = "sk-sdjax-test"


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.fixture(scope="module")
def server():
    pipe = FakePipeline(delay_s=0.5, report_latents=True)
    with live_server(pipe, api_key=KEY, api_auth=(("user", "pass"),), max_batch=2, warm=False) as s:
        yield s


def test_openai_images_generate(server):
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    result = api.images.generate(
        model="sdjax", prompt="a lighthouse", n=2, size="64x64", response_format="b64_json", extra_body={"seed": 21}
    )
    for k, image in enumerate(result.data):
        check_image(image.b64_json, prompt="a lighthouse", seed=21 + k)
    result = api.images.generate(prompt="a lighthouse", size="64x64", response_format="url", extra_body={"seed": 21})
    png = httpx.get(result.data[0].url).content
    assert metadata.parameters_from_text(infotext.read_parameters(png)).seed == 21


def test_openai_errors_are_its_exceptions(server):
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError) as e:
        api.images.generate(prompt="x", size="65x64")
    assert e.value.status_code == 422 and e.value.body["param"] == "size"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0).images.generate(prompt="x")


def webui(server) -> webuiapi.WebUIApi:
    host, port = host_port(server.url)
    return webuiapi.WebUIApi(host=host, port=port, username="user", password="pass", sampler="Euler a", steps=4)


def test_webuiapi_txt2img(server):
    api = webui(server)
    result = api.txt2img(prompt="a fox", negative_prompt="blur", seed=7, width=64, height=64, batch_size=2, cfg_scale=6)
    assert len(result.images) == 2 and result.info["all_seeds"] == [7, 8]
    params = metadata.parameters_from_text(result.images[1].info["parameters"])
    # "Euler a" with A1111's Automatic schedule is Euler a over uniform sigmas, written as two infotext fields
    assert (params.prompt, params.negative_prompt, params.seed) == ("a fox", "blur", 8)
    assert params.sampler == "Euler a Uniform" and "Schedule type: Uniform" in result.images[1].info["parameters"]
    info = api.png_info(result.images[0])
    assert info.parameters["Seed"] == "7" and "Seed: 7" in info.info


def test_webuiapi_schedulers_samplers_options(server):
    api = webui(server)
    assert sorted(api.util_get_scheduler_names()) == sorted(s["name"] for s in a1111.a1111_schedulers())
    assert "Euler a" in api.util_get_sampler_names()
    assert api.util_get_current_model() == "fake-model"
    result = api.txt2img(prompt="k", seed=1, width=64, height=64, sampler_name="DPM++ 2M", scheduler="Karras")
    assert metadata.parameters_from_text(result.images[0].info["parameters"]).sampler == "dpmpp_2m_karras"


@pytest.mark.parametrize("action", ["interrupt", "skip"])
def test_webuiapi_interrupt_and_skip(server, action):
    api = webui(server)
    out = {}
    t = threading.Thread(
        target=lambda: out.update(
            r=api.txt2img(prompt=f"to {action}", seed=30, width=64, height=64, n_iter=3, steps=10)
        )
    )
    t.start()
    deadline = time.monotonic() + 10
    while api.get_progress()["state"]["sampling_step"] < 2:  # the first batch (of 2 images) is running
        assert time.monotonic() < deadline
        time.sleep(0.02)
    getattr(api, action)()
    t.join(20)
    result = out["r"]
    if action == "interrupt":  # the request ends with the running batch's images, decoded from its latents
        assert result.info["all_seeds"] == [30, 31] and result.info["stopped"] == "interrupt"
        assert len(result.images) == 2 and result.image.size == (64, 64)  # A1111's partly denoised images
    else:  # the running batch (seeds 30, 31) is dropped; the last image is made
        assert result.info["all_seeds"] == [32] and result.info["stopped"] == "skip"
        check_image(webuiapi.raw_b64_img(result.images[0]), seed=32)


def test_webuiapi_without_credentials_fails_cleanly(server):
    host, port = host_port(server.url)
    api = webuiapi.WebUIApi(host=host, port=port)
    with pytest.raises(RuntimeError) as e:
        api.txt2img(prompt="x", width=64, height=64)
    assert e.value.args[0] == 401 and "Incorrect username or password" in e.value.args[1]


def test_webuiapi_controlnet_detect_and_version(server):
    """`controlnet_detect()` sends its images as `controlnet_images`; `controlnet_version()` reads
    `/controlnet/version`'s `version` (sd-webui-controlnet's API version)."""
    api = webui(server)
    assert api.controlnet_version() == 2
    pixels = np.random.default_rng(3).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    r = api.controlnet_detect([Image.fromarray(pixels)], module="invert")
    assert r.info == "Success" and len(r.images) == 1
    np.testing.assert_array_equal(np.asarray(r.image.convert("RGB")), preprocess.invert(pixels))


def test_webuiapi_informational_calls(server):
    api = webui(server)
    assert api.get_cmd_flags()["api"] is True
    assert [u["name"] for u in api.get_upscalers()] == ["Lanczos", "Nearest"]
    assert "Latent" in [m["name"] for m in api.get_latent_upscale_modes()]
    assert api.get_scripts() == {"txt2img": [], "img2img": []}
    assert set(api.get_memory()) == {"ram", "cuda"} and api.get_prompt_styles() == []
    with pytest.raises(RuntimeError) as e:
        api.txt2img(prompt="x", width=64, height=64, script_name="x/y/z plot")
    assert e.value.args[0] == 422 and "script_name" in e.value.args[1]


def test_openai_image_streaming():
    """`images.generate(stream=True, partial_images=2)`: two partial images (the fake's decode of the latents at
    1/3 and 2/3 of the steps or later), then one completed image per image, as the client's stream yields them."""
    pytest.importorskip("openai.types.image_gen_stream_event", reason="an openai client with image streaming")
    pipe = FakePipeline(delay_s=2.0, report_latents=True)
    with live_server(pipe, warm=False, max_batch=2) as s:
        api = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        stream = api.images.generate(
            prompt="a harbour", n=2, size="64x32", stream=True, partial_images=2, extra_body={"seed": 5, "steps": 10}
        )
        events = list(stream)
        assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"] * 2
        assert [e.partial_image_index for e in events[:2]] == [0, 1]
        assert all(e.size == "64x32" and e.output_format == "png" for e in events)
        for k, e in enumerate(events[2:]):
            check_image(e.b64_json, prompt="a harbour", seed=5 + k, width=64, height=32)
        decoded = {k: pipe.decode_latents(FakePipeline.reported_latents(1, 32, 64, k, 10))[0] for k in range(1, 11)}
        steps = []
        for e in events[:2]:
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(e.b64_json))))
            steps.append(next(step for step, want in decoded.items() if np.array_equal(pixels, want)))
        assert 4 <= steps[0] < steps[1] and steps[1] >= 7  # at 1/3 and 2/3 of the 10 steps or later
        with pytest.raises(openai.UnprocessableEntityError) as e:
            list(api.images.generate(prompt="x", stream=True, response_format="url"))
        assert e.value.body["param"] == "response_format"
