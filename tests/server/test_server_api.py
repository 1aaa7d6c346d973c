"""Request and response shapes of the OpenAI and AUTOMATIC1111 endpoints and of the service endpoints, against a
live server on 127.0.0.1 over the fake pipeline."""

from __future__ import annotations

import json
import re

import pytest
from fake_pipeline import FakePipeline
from server_helpers import check_image, client, live_server

from sdjax import samplers


@pytest.fixture(scope="module")
def server():
    with live_server(max_batch=4, warm_sizes=((64, 64), (32, 48))) as s:
        yield s


@pytest.fixture
def http(server):
    with client(server.url) as c:
        yield c


def test_openai_minimal_request(http):
    r = http.post("/v1/images/generations", json={"prompt": "a lighthouse at dusk"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"created", "data"} and isinstance(body["created"], int)
    (item,) = body["data"]
    assert set(item) == {"b64_json"}
    check_image(
        item["b64_json"],
        prompt="a lighthouse at dusk",
        width=64,
        height=64,
        steps=4,
        sampler="euler_a",
        model="fake-model",
    )


def test_openai_full_request(http):
    r = http.post(
        "/v1/images/generations",
        json={
            "prompt": "a cat",
            "n": 3,
            "size": "48x32",
            "response_format": "b64_json",
            "model": "dall-e-2",
            "user": "someone",
            "quality": "standard",
            "negative_prompt": "dog",
            "steps": 6,
            "guidance_scale": 3.5,
            "seed": 42,
            "sampler": "ddim",
        },
    )
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 3
    for k, item in enumerate(data):
        check_image(
            item["b64_json"],
            prompt="a cat",
            negative_prompt="dog",
            width=48,
            height=32,
            steps=6,
            guidance_scale=3.5,
            seed=42 + k,
            sampler="ddim",
        )


def test_openai_size_auto(http):
    r = http.post("/v1/images/generations", json={"prompt": "x", "size": "auto", "seed": 3})
    check_image(r.json()["data"][0]["b64_json"], width=64, height=64, seed=3)


def test_openai_random_seed_when_none_given(http):
    seeds = set()
    for _ in range(2):
        r = http.post("/v1/images/generations", json={"prompt": "x"})
        seeds.add(check_image(r.json()["data"][0]["b64_json"]).seed)
    assert len(seeds) == 2


def test_openai_python_client_shape(http):
    """What the `openai` package's `images.generate` sends and reads (`data[i].b64_json`)."""
    r = http.post(
        "/v1/images/generations",
        json={"model": "sdjax", "prompt": "p", "n": 1, "size": "64x64", "response_format": "b64_json"},
        headers={"Authorization": "Bearer sk-anything"},
    )
    assert r.status_code == 200 and r.json()["data"][0]["b64_json"]


def test_a1111_txt2img(http):
    body = {
        "prompt": "a dog",
        "negative_prompt": "cat",
        "steps": 5,
        "cfg_scale": 6,
        "width": 32,
        "height": 48,
        "seed": 7,
        "batch_size": 2,
        "n_iter": 2,
        "sampler_name": "DDIM",
        # fields existing clients send that sdjax ignores
        "styles": [],
        "send_images": True,
        "save_images": False,
        "alwayson_scripts": {},
        "override_settings": {},
        "denoising_strength": 0,
        "enable_hr": False,
        "restore_faces": False,
        "tiling": False,
    }
    r = http.post("/sdapi/v1/txt2img", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"images", "parameters", "info"}
    assert len(out["images"]) == 4
    assert out["parameters"]["prompt"] == "a dog" and out["parameters"]["batch_size"] == 2
    info = json.loads(out["info"])
    assert info["all_seeds"] == [7, 8, 9, 10] and info["seed"] == 7
    assert info["all_prompts"] == ["a dog"] * 4 and info["all_negative_prompts"] == ["cat"] * 4
    assert (info["width"], info["height"], info["steps"], info["cfg_scale"], info["sampler_name"]) == (
        32,
        48,
        5,
        6.0,
        "DDIM",
    )
    assert info["sd_model_name"] == "fake-model" and re.fullmatch(r"\d{14}", info["job_timestamp"])
    for k, (b64, infotext) in enumerate(zip(out["images"], info["infotexts"])):
        p = check_image(
            b64,
            seed=7 + k,
            prompt="a dog",
            negative_prompt="cat",
            width=32,
            height=48,
            sampler="ddim",
            guidance_scale=6.0,
        )
        assert p.infotext() == infotext


def test_a1111_defaults_and_scheduler(http):
    r = http.post("/sdapi/v1/txt2img", json={"prompt": "", "sampler_name": "DPM++ 2M", "scheduler": "Karras"})
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert info["sampler_name"] == "DPM++ 2M" and info["scheduler"] == "Karras"
    assert info["steps"] == 4 and info["width"] == 64
    assert "Sampler: DPM++ 2M, Schedule type: Karras," in info["infotexts"][0]
    check_image(r.json()["images"][0], sampler="dpmpp_2m_karras")
    assert 0 <= info["seed"] < 2**32  # -1: random
    r = http.post("/sdapi/v1/txt2img", json={"prompt": "p", "seed": 1, "send_images": False})
    assert r.json()["images"] == [] and json.loads(r.json()["info"])["all_seeds"] == [1]


def test_both_apis_give_the_same_image_for_the_same_parameters(http):
    a = http.post(
        "/v1/images/generations",
        json={
            "prompt": "same",
            "seed": 9,
            "steps": 3,
            "size": "32x32",
            "guidance_scale": 2,
            "sampler": "Euler a Uniform",
        },  # A1111's "Euler a": its Automatic schedule is Uniform
        # fmt: skip
    ).json()
    b = http.post(
        "/sdapi/v1/txt2img",
        json={
            "prompt": "same",
            "seed": 9,
            "steps": 3,
            "width": 32,
            "height": 32,
            "cfg_scale": 2,
            "sampler_name": "Euler a",
        },
    ).json()
    assert a["data"][0]["b64_json"] == b["images"][0]


def test_service_endpoints(server, http):
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    config = http.get("/v1/config").json()
    assert config["samplers"] == samplers.available()
    assert config["sampler_labels"]["euler_a"] == "Euler a" and config["sampler_labels"]["pndm"] == "PLMS"
    assert (config["default_width"], config["default_height"], config["default_steps"]) == (64, 64, 4)
    assert config["limits"]["max_images"] == 8 and config["batch_sizes"] == [1, 2, 4]
    a1111 = {s["name"]: s for s in http.get("/sdapi/v1/samplers").json()}
    assert a1111["DPM++ 2M"] == {"name": "DPM++ 2M", "aliases": ["k_dpmpp_2m"], "options": {"scheduler": "karras"}}
    assert "DPM fast" not in a1111 and {"Euler a", "UniPC", "LCM", "DPM++ SDE", "TCD"} <= set(a1111)
    assert http.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    assert http.get("/sdapi/v1/sd-models").json()[0]["model_name"] == "fake-model"
    assert http.get("/sdapi/v1/options").json()["sd_model_checkpoint"] == "fake-model"
    progress = http.get("/sdapi/v1/progress").json()
    assert {"progress", "eta_relative", "state", "current_image", "textinfo"} <= set(progress)
    assert http.get("/sdapi/v1/progress", params={"id_task": "nope"}).json()["stage"] == "unknown"
    page = http.get("/")
    assert page.status_code == 200 and "<title>sdjax</title>" in page.text
    assert http.get("/docs").status_code == 200 and "/sdapi/v1/txt2img" in http.get("/openapi.json").text
    # start-up compiled every batch size for each configured size, at the default steps and sampler, through the
    # call that serves requests (with progress and should_stop: the same program)
    assert all(c["progress"] and c["should_stop"] for c in server.pipeline.calls)
    assert sorted(server.warmups) == sorted(
        (b, h, w, 4, "euler_a") for b in (1, 2, 4) for (w, h) in ((64, 64), (32, 48))
    )


def test_metrics(http):
    http.post("/v1/images/generations", json={"prompt": "m", "n": 3})
    text = http.get("/metrics").text
    for name in (
        "sdjax_requests_total",
        "sdjax_request_latency_seconds_bucket",
        "sdjax_queue_depth_images",
        "sdjax_batch_fill_ratio_bucket",
        "sdjax_batch_images_bucket",
        "sdjax_batches_total",
        "sdjax_images_generated_total",
        "sdjax_ready 1.0",
    ):
        assert name in text, name
    assert re.search(r'sdjax_requests_total\{endpoint="/v1/images/generations",status="200"\} [1-9]', text)
    # 3 images padded to a compiled batch of 4
    assert re.search(r'sdjax_batch_fill_ratio_bucket\{le="0.75"\} [1-9]', text)


def test_progress_of_a_task():
    import threading
    import time

    with live_server(FakePipeline(delay_s=1.0), max_batch=1, batch_window_s=0.0) as s, client(s.url) as c:
        results = {}
        threads = [
            threading.Thread(
                target=lambda i=i: results.update(
                    {
                        i: c.post(
                            "/sdapi/v1/txt2img", json={"prompt": f"p{i}", "steps": 10, "force_task_id": f"task-{i}"}
                        )
                    }
                )
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
            time.sleep(0.2)
        seen = set()
        deadline = time.monotonic() + 10
        while len(results) < 2 and time.monotonic() < deadline:
            for i in range(2):
                p = c.get("/sdapi/v1/progress", params={"id_task": f"task-{i}"}).json()
                seen.add((i, p["stage"]))
                if p["stage"] == "denoise":
                    assert 0 <= p["progress"] <= 1 and p["state"]["sampling_steps"] == 10
                if p["stage"] == "queued":
                    assert p["queue_position"] == 0 and p["textinfo"].startswith("queued")
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert (0, "denoise") in seen and (1, "queued") in seen and (1, "denoise") in seen, seen
        assert all(r.status_code == 200 for r in results.values())
        assert c.get("/sdapi/v1/progress", params={"id_task": "task-0"}).json()["stage"] == "unknown"


def test_configured_defaults_are_served_and_compiled_ahead():
    pipe = FakePipeline()
    with (
        live_server(pipe, default_steps=6, default_sampler="DDIM", warm_sizes=((32, 32),), max_batch=2) as s,
        client(s.url) as c,
    ):
        assert sorted(s.warmups) == [(1, 32, 32, 6, "ddim"), (2, 32, 32, 6, "ddim")]
        config = c.get("/v1/config").json()
        assert (config["default_steps"], config["default_sampler"], config["warm_sizes"]) == (6, "ddim", [[32, 32]])
        r = c.post("/v1/images/generations", json={"prompt": "x", "seed": 1})
        check_image(r.json()["data"][0]["b64_json"], steps=6, sampler="ddim", width=64)
        r = c.post("/sdapi/v1/txt2img", json={"prompt": "x", "seed": 1})
        check_image(r.json()["images"][0], steps=6, sampler="ddim", width=64)
