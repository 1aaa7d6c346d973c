"""ComfyUI's API on sdjax over the fake pipeline (`server.comfy`): the default txt2img workflow in API format through
the real `comfy-api-simplified` client and a plain `websockets` client (ComfyUI's message sequence), the error
shapes of bad workflows, /upload/image and /view (traversal refused), /queue, /interrupt, /history and the
introspection routes. Each image equals what the pipeline gives when called directly with the settings the
workflow names (ComfyUI's "euler" + "normal" is sdjax's "Euler Normal"; the seed is taken modulo 2**32)."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import time

import numpy as np
import pytest
from fake_pipeline import FakePipeline
from PIL import Image
from server_helpers import client, live_server

SEED = 156680208700286  # the default workflow's


def default_workflow(ckpt="fake-model", size=64, steps=4, seed=SEED, sampler="euler", scheduler="normal") -> dict:
    """ComfyUI's default workflow, exported in API format (sizes and steps made small)."""
    return {
        "3": {"class_type": "KSampler", "_meta": {"title": "KSampler"},
              "inputs": {"seed": seed, "steps": steps, "cfg": 8, "sampler_name": sampler, "scheduler": scheduler,
                         "denoise": 1, "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                         "latent_image": ["5", 0]}},
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode",
              "inputs": {"text": "beautiful scenery nature glass bottle landscape, purple galaxy bottle,",
                         "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "text, watermark", "clip": ["4", 1]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "_meta": {"title": "Save Image"},
              "inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}},
    }  # fmt: skip


def with_titles(wf: dict) -> dict:
    """The `_meta.title` ComfyUI's export writes on every node (comfy-api-simplified finds nodes by it)."""
    return {nid: {"_meta": {"title": node["class_type"]}, **node} for nid, node in wf.items()}


def direct(pipe, wf: dict) -> np.ndarray:
    k = wf["3"]["inputs"]
    size = wf["5"]["inputs"]
    (image,) = FakePipeline.generate(
        pipe,
        wf["6"]["inputs"]["text"],
        negative_prompt=wf["7"]["inputs"]["text"],
        seed=k["seed"] % 2**32,
        steps=k["steps"],
        guidance_scale=k["cfg"],
        height=size["height"],
        width=size["width"],
        sampler="Euler Normal",
    )
    return np.asarray(image)


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def server():
    with live_server(FakePipeline(), warm=False, max_batch=2) as s:
        yield s


def wait_history(c, prompt_id: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = c.get(f"/history/{prompt_id}").json()
        if h:
            return h[prompt_id]
        time.sleep(0.05)
    raise AssertionError(f"prompt {prompt_id} did not finish")


def test_default_workflow_through_comfy_api_simplified(server):
    from comfy_api_simplified import ComfyApiWrapper, ComfyWorkflowWrapper

    wf = default_workflow()
    api = ComfyApiWrapper(server.url)
    workflow = ComfyWorkflowWrapper(with_titles(copy.deepcopy(wf)))
    workflow.set_node_param("KSampler", "seed", 7)
    results = api.queue_and_wait_images(workflow, "Save Image")
    assert len(results) == 1
    ((name, data),) = results.items()
    assert name.startswith("ComfyUI_") and name.endswith("_.png")
    wf["3"]["inputs"]["seed"] = 7
    np.testing.assert_array_equal(pixels(data), direct(server.pipeline, wf))
    with Image.open(io.BytesIO(data)) as im:  # ComfyUI's prompt chunk, and sdjax's infotext
        assert json.loads(im.info["prompt"])["3"]["inputs"]["seed"] == 7
        assert "Seed: 7" in im.info["parameters"] and "Sampler: Euler" in im.info["parameters"]
    assert "KSampler" in api.get_object_info("KSampler")
    assert api.get_system_stats()["devices"]
    assert api.get_queue() == {"queue_running": [], "queue_pending": []}


def test_websocket_messages_follow_comfyui(server):
    import websockets

    wf = default_workflow(seed=2**32 + 5)  # above 32 bits: taken modulo 2**32

    async def run() -> tuple[list[dict], str]:
        ws_url = server.url.replace("http://", "ws://") + "/ws?clientId=abc"
        async with websockets.connect(ws_url) as ws:
            hello = json.loads(await ws.recv())
            r = await asyncio.to_thread(client(server.url).post, "/prompt", json={"prompt": wf, "client_id": "abc"})
            assert r.status_code == 200, r.text
            prompt_id = r.json()["prompt_id"]
            assert r.json()["node_errors"] == {}
            messages = [hello]
            while True:
                out = await asyncio.wait_for(ws.recv(), 20)
                assert isinstance(out, str)  # no binary frames
                m = json.loads(out)
                messages.append(m)
                if m["type"] == "executing" and m["data"]["node"] is None:
                    return messages, prompt_id

    messages, prompt_id = asyncio.run(run())
    kinds = [m["type"] for m in messages]
    assert kinds[0] == "status" and messages[0]["data"]["sid"] == "abc"
    run = [m for m in messages if m["type"] != "status"]
    assert [m["type"] for m in run[:2]] == ["execution_start", "execution_cached"]
    executing = [m["data"]["node"] for m in run if m["type"] == "executing"]
    assert executing[-1] is None and executing.index("3") < executing.index("9")
    assert set(executing[:-1]) == set(wf)
    progress = [m["data"] for m in run if m["type"] == "progress"]
    assert progress and progress[-1]["max"] == 4 and progress[-1]["node"] == "3"
    (executed,) = [m["data"] for m in run if m["type"] == "executed"]
    assert executed["node"] == "9" and executed["prompt_id"] == prompt_id
    assert kinds[-2:] == ["execution_success", "executing"]
    image = executed["output"]["images"][0]
    c = client(server.url)
    r = c.get("/view", params=image)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    wf["3"]["inputs"]["seed"] = 5
    np.testing.assert_array_equal(pixels(r.content), direct(server.pipeline, wf))
    entry = wait_history(c, prompt_id)
    assert entry["status"]["status_str"] == "success" and entry["outputs"]["9"]["images"] == [image]


def _errors(c, prompt) -> dict:
    r = c.post("/prompt", json={"prompt": prompt})
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error", "node_errors"} and set(body["error"]) == {"type", "message", "details", "extra_info"}
    return body


def test_bad_workflows_answer_comfyui_errors(server):
    c = client(server.url)
    wf = default_workflow()
    unknown = {**wf, "10": {"class_type": "UpscaleModelLoader", "inputs": {"model_name": "x"}}}
    body = _errors(c, unknown)
    assert body["error"]["type"] == "invalid_prompt" and "UpscaleModelLoader" in body["error"]["message"]
    assert body["node_errors"]["10"]["errors"][0]["type"] == "node_not_supported"

    bad_link = copy.deepcopy(wf)
    bad_link["8"]["inputs"]["samples"] = ["42", 0]
    body = _errors(c, bad_link)
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["8"]["errors"][0]["type"] == "bad_linked_input"
    assert body["node_errors"]["8"]["dependent_outputs"] == ["9"]

    mismatch = copy.deepcopy(wf)
    mismatch["8"]["inputs"]["samples"] = ["4", 0]  # a MODEL where a LATENT goes
    assert _errors(c, mismatch)["node_errors"]["8"]["errors"][0]["type"] == "return_type_mismatch"

    sampler = default_workflow(sampler="dpm_adaptive")
    err = _errors(c, sampler)["node_errors"]["3"]["errors"][0]
    assert err["type"] == "value_not_in_list" and "dpm_adaptive" in err["message"]
    assert err["extra_info"]["input_name"] == "sampler_name"
    assert "bogus" in _errors(c, default_workflow(scheduler="bogus"))["node_errors"]["3"]["errors"][0]["message"]

    missing = copy.deepcopy(wf)
    del missing["3"]["inputs"]["steps"]
    err = _errors(c, missing)["node_errors"]["3"]["errors"][0]
    assert err["type"] == "required_input_missing" and err["details"] == "steps"

    cycle = copy.deepcopy(wf)
    cycle["6"]["inputs"]["clip"] = ["6", 0]
    cycle["6"]["class_type"] = "CLIPSetLastLayer"
    cycle["6"]["inputs"]["stop_at_clip_layer"] = -1
    assert _errors(c, cycle)["error"]["type"] == "prompt_outputs_failed_validation"

    assert (
        "fake-model"
        in _errors(c, default_workflow(ckpt="sdxl.safetensors"))["node_errors"]["4"]["errors"][0]["message"]
    )
    too_big = copy.deepcopy(wf)
    too_big["3"]["inputs"]["steps"] = 151  # the server's limit
    assert _errors(c, too_big)["node_errors"]["3"]["errors"][0]["details"] == "steps"
    two_pass = copy.deepcopy(wf)  # a hires pass must share the first pass's seed (sdjax draws its noise from it)
    two_pass["10"] = {"class_type": "KSampler", "inputs": {**wf["3"]["inputs"], "latent_image": ["3", 0], "seed": 1}}
    two_pass["8"]["inputs"]["samples"] = ["10", 0]
    err = _errors(c, two_pass)["node_errors"]["10"]["errors"][0]
    assert err["type"] == "node_not_supported" and err["extra_info"]["input_name"] == "seed"
    two_pass["10"]["inputs"]["seed"] = SEED  # ... and its images are not kept: decoding them is refused
    two_pass["11"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}}
    two_pass["12"] = {"class_type": "PreviewImage", "inputs": {"images": ["11", 0]}}
    assert _errors(c, two_pass)["node_errors"]["11"]["errors"][0]["type"] == "node_not_supported"
    three = copy.deepcopy(two_pass)
    del three["11"], three["12"]
    three["13"] = {"class_type": "KSampler", "inputs": {**wf["3"]["inputs"], "latent_image": ["10", 0]}}
    three["8"]["inputs"]["samples"] = ["13", 0]
    assert _errors(c, three)["node_errors"]["13"]["errors"][0]["type"] == "node_not_supported"
    assert (
        _errors(c, {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x"}}})["error"]["type"]
        == "prompt_no_outputs"
    )
    for raw in (b"{not json", b"[]", b'{"prompt": 3}'):
        r = c.post("/prompt", content=raw)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_prompt"
    assert server.pipeline.calls == [] or all(call["prompts"] for call in server.pipeline.calls)


def test_upload_view_and_load_image(server):
    c = client(server.url)
    buf = io.BytesIO()
    Image.new("RGBA", (64, 64), (10, 20, 30, 255)).save(buf, format="PNG")
    r = c.post("/upload/image", files={"image": ("pic.png", buf.getvalue(), "image/png")}, data={"subfolder": "a"})
    assert r.status_code == 200 and r.json() == {"name": "pic.png", "subfolder": "a", "type": "input"}
    r = c.post("/upload/image", files={"image": ("pic.png", buf.getvalue(), "image/png")}, data={"subfolder": "a"})
    assert r.json()["name"] == "pic (1).png"  # no overwrite: renamed, as ComfyUI does
    assert c.get("/view", params={"filename": "pic.png", "subfolder": "a", "type": "input"}).content == buf.getvalue()
    for name, sub in (("../../etc/passwd", ""), ("pic.png", "../.."), ("pic.png", "/abs"), ("a\\..\\b.png", "")):
        r = c.post("/upload/image", files={"image": (name, buf.getvalue(), "image/png")}, data={"subfolder": sub})
        assert r.status_code == 400, (name, sub, r.text)
    r = c.post("/upload/image", files={"image": ("x.png", b"not an image", "image/png")})
    assert r.status_code == 400
    escapes = ({"filename": "../secret", "type": "input"}, {"filename": "pic.png", "subfolder": "..", "type": "input"},
               {"filename": "pic.png", "type": "elsewhere"})  # fmt: skip
    for params in escapes:
        assert c.get("/view", params=params).status_code == 400
    assert c.get("/view", params={"filename": "nope.png"}).status_code == 404
    info = c.get("/object_info/LoadImage").json()["LoadImage"]["input"]["required"]["image"][0]
    assert "a/pic.png" in info
    # SaveImage of a loaded image: no generation, the image comes back
    wf = {"1": {"class_type": "LoadImage", "inputs": {"image": "a/pic.png"}},
          "2": {"class_type": "ImageScale", "inputs": {"image": ["1", 0], "upscale_method": "nearest-exact",
                                                          "width": 32, "height": 16, "crop": "disabled"}},
          "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "sub/out"}}}  # fmt: skip
    r = c.post("/prompt", json={"prompt": wf})
    assert r.status_code == 200, r.text
    (image,) = wait_history(c, r.json()["prompt_id"])["outputs"]["3"]["images"]
    assert image["subfolder"] == "sub" and image["type"] == "output"
    out = pixels(c.get("/view", params=image).content)
    assert out.shape == (16, 32, 3) and (out == (10, 20, 30)).all()
    missing = {**wf, "1": {"class_type": "LoadImage", "inputs": {"image": "nope.png"}}}
    assert _errors(c, missing)["node_errors"]["1"]["errors"][0]["type"] == "value_not_in_list"


def test_queue_interrupt_and_history():
    with live_server(FakePipeline(delay_s=1.0), warm=False, max_batch=1) as s:
        c = client(s.url)
        first = c.post("/prompt", json={"prompt": default_workflow(steps=20)}).json()["prompt_id"]
        second = c.post("/prompt", json={"prompt": default_workflow(steps=20, seed=1)}).json()["prompt_id"]
        deadline = time.monotonic() + 10
        while not c.get("/queue").json()["queue_running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        q = c.get("/queue").json()
        assert [e[1] for e in q["queue_running"]] == [first] and [e[1] for e in q["queue_pending"]] == [second]
        assert c.get("/prompt").json() == {"exec_info": {"queue_remaining": 2}}
        assert c.post("/queue", json={"delete": [second]}).status_code == 200
        assert c.post("/interrupt").status_code == 200
        h1, h2 = wait_history(c, first), wait_history(c, second)
        assert h1["status"]["status_str"] == "error" and h1["status"]["messages"][0][0] == "execution_interrupted"
        assert h2["status"]["status_str"] == "error" and h1["outputs"] == {} and h2["outputs"] == {}
        assert c.get("/queue").json() == {"queue_running": [], "queue_pending": []}
        assert set(c.get("/history").json()) == {first, second}
        assert len(c.get("/history", params={"max_items": 1}).json()) == 1  # the one that finished last
        c.post("/history", json={"delete": [first]})
        assert c.get(f"/history/{first}").json() == {}
        assert max(call["steps_run"] for call in s.pipeline.calls) < 20  # the interrupt stopped the run


def test_introspection(server):
    c = client(server.url)
    info = c.get("/object_info").json()
    for node in ("KSampler", "KSamplerAdvanced", "LoraLoader", "VAEEncodeForInpaint", "ControlNetApplyAdvanced"):
        assert node in info
    ks = info["KSampler"]["input"]["required"]
    assert "dpmpp_2m" in ks["sampler_name"][0] and "karras" in ks["scheduler"][0]
    assert info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0] == ["fake-model"]
    assert info["CheckpointLoaderSimple"]["output"] == ["MODEL", "CLIP", "VAE"]
    assert c.get("/object_info/Nope").json() == {}
    assert c.get("/embeddings").json() == []
    assert c.get("/models/checkpoints").json() == ["fake-model"]
    assert c.get("/api/object_info/KSampler").status_code == 200  # ComfyUI's /api prefix
    assert c.post("/free", json={"unload_models": True}).status_code == 200


def test_credentials_guard_http_and_websocket():
    import websockets

    with live_server(FakePipeline(), warm=False, api_key="sesame") as s:
        assert client(s.url).get("/object_info/KSampler").status_code == 401
        assert client(s.url).post("/prompt", json={"prompt": default_workflow()}).status_code == 401
        ws_url = s.url.replace("http://", "ws://") + "/ws?clientId=k"

        async def connect(headers=None) -> str:
            async with websockets.connect(ws_url, additional_headers=headers) as ws:
                return json.loads(await ws.recv())["type"]

        with pytest.raises(websockets.exceptions.InvalidStatus):
            asyncio.run(connect())
        assert asyncio.run(connect({"Authorization": "Bearer sesame"})) == "status"


def test_advanced_sampler_batches_and_latent_sizes(server):
    c = client(server.url)
    wf = default_workflow(seed=11)
    k = wf["3"]["inputs"]
    wf["3"] = {"class_type": "KSamplerAdvanced",
               "inputs": {**{n: k[n] for n in ("model", "steps", "cfg", "sampler_name", "scheduler", "positive",
                                               "negative", "latent_image")},
                          "add_noise": "enable", "noise_seed": 11, "start_at_step": 0, "end_at_step": 10000,
                          "return_with_leftover_noise": "disable"}}  # fmt: skip
    wf["5"]["inputs"].update(width=32, height=32, batch_size=2)
    wf["10"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["5", 0], "upscale_method": "bislerp",
                                                            "scale_by": 2.0}}  # fmt: skip
    wf["3"]["inputs"]["latent_image"] = ["10", 0]
    r = c.post("/prompt", json={"prompt": wf})
    assert r.status_code == 200, r.text
    images = wait_history(c, r.json()["prompt_id"])["outputs"]["9"]["images"]
    assert len(images) == 2
    for i, image in enumerate(images):  # image i of a batch: seed + i, at the upscaled size
        want = default_workflow(seed=11 + i)
        np.testing.assert_array_equal(pixels(c.get("/view", params=image).content), direct(server.pipeline, want))
    for change, name in (({"end_at_step": 2}, "end_at_step"), ({"add_noise": "disable"}, "add_noise"),
                         ({"start_at_step": 1}, "start_at_step")):  # fmt: skip
        bad = copy.deepcopy(wf)
        bad["3"]["inputs"].update(change)
        err = _errors(c, bad)["node_errors"]["3"]["errors"][0]
        assert err["type"] == "node_not_supported" and err["extra_info"]["input_name"] == name
    decoded = copy.deepcopy(wf)  # a sampled latent upscaled and decoded without a second pass: not served
    decoded["11"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["3", 0], "upscale_method": "bilinear",
                                                                 "scale_by": 2.0}}  # fmt: skip
    decoded["8"]["inputs"]["samples"] = ["11", 0]
    assert _errors(c, decoded)["node_errors"]["8"]["errors"][0]["type"] == "node_not_supported"
    decoded["11"]["inputs"]["upscale_method"] = "bislerp"  # a hires pass upscales bilinear or nearest only
    decoded["12"] = {"class_type": "KSamplerAdvanced", "inputs": {**wf["3"]["inputs"], "latent_image": ["11", 0]}}
    decoded["8"]["inputs"]["samples"] = ["12", 0]
    assert _errors(c, decoded)["node_errors"]["11"]["errors"][0]["extra_info"]["input_name"] == "upscale_method"


def test_mutated_workflows_never_answer_5xx(server, caplog):
    """/prompt is left out of the published schema (a graph's validity is no OpenAPI constraint): fuzzed here with
    the default workflow's values, links and class types replaced at random."""
    import random

    rng = random.Random(0)
    values = [None, -1, 0, 1, 2**70, 1.5, float("inf"), float("nan"), "x", "", "../a", [], [1], ["4"], ["4", 9],
              ["9", 0], ["3", 0], {}, True, "euler", 16384, "a" * 500]  # fmt: skip
    classes = ["KSampler", "LoadImage", "SaveImage", "LatentUpscaleBy", "ImageScale", "VAEEncode", "Nope"]
    c = client(server.url)
    codes = {}
    for _ in range(150):
        wf = default_workflow()
        for _ in range(rng.randint(1, 3)):
            node = wf[rng.choice(list(wf))]
            where = rng.choice([*node["inputs"], "class_type", "inputs"]) if isinstance(node["inputs"], dict) else "x"
            if where == "class_type":
                node["class_type"] = rng.choice(classes)
            elif where == "inputs":
                node["inputs"] = rng.choice(values)
            elif isinstance(node["inputs"], dict):
                node["inputs"][where] = rng.choice(values)
        r = c.post("/prompt", content=json.dumps({"prompt": wf}))  # Infinity and NaN as Python writes them
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400), (r.status_code, r.text)
    for raw in (b"[" * 30000, b"\xff\xfe", b"null", b'{"prompt": {"1": 5}}'):
        for path in ("/prompt", "/queue", "/interrupt", "/history"):
            assert c.post(path, content=raw).status_code < 500
    assert codes[400] > 100, codes
    assert not [r for r in caplog.records if "request failed" in r.getMessage()]


def test_upload_mask_and_execution_error():
    with live_server(FakePipeline(fail_prompt="boom"), warm=False) as s:
        c = client(s.url)
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (200, 100, 50)).save(buf, format="PNG")
        assert c.post("/upload/image", files={"image": ("base.png", buf.getvalue(), "image/png")}).status_code == 200
        mask = Image.new("RGBA", (8, 8), (0, 0, 0, 255))
        mask.putpixel((1, 2), (0, 0, 0, 0))
        buf = io.BytesIO()
        mask.save(buf, format="PNG")
        ref = json.dumps({"filename": "base.png", "subfolder": "", "type": "input"})
        r = c.post("/upload/mask", files={"image": ("m.png", buf.getvalue(), "image/png")}, data={"original_ref": ref})
        assert r.status_code == 200, r.text
        with Image.open(io.BytesIO(c.get("/view", params={**r.json(), "filename": r.json()["name"]}).content)) as im:
            rgba = np.asarray(im)
        assert rgba[2, 1, 3] == 0 and rgba[0, 0, 3] == 255 and tuple(rgba[0, 0, :3]) == (200, 100, 50)
        r = c.post("/upload/mask", files={"image": ("m.png", buf.getvalue(), "image/png")}, data={"original_ref": "{}"})
        assert r.status_code == 400

        wf = default_workflow()
        wf["6"]["inputs"]["text"] = "boom"  # the fake pipeline fails this batch

        async def run() -> list[dict]:
            import websockets

            async with websockets.connect(s.url.replace("http://", "ws://") + "/ws?clientId=e") as ws:
                await ws.recv()
                r = await asyncio.to_thread(c.post, "/prompt", json={"prompt": wf, "client_id": "e"})
                assert r.status_code == 200
                out = []
                while not out or out[-1]["type"] != "execution_error":
                    out.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
                return out

        messages = asyncio.run(run())
        error = messages[-1]["data"]
        assert error["node_id"] == "3" and error["node_type"] == "KSampler" and error["exception_message"]
        entry = wait_history(c, error["prompt_id"])
        assert entry["status"]["status_str"] == "error" and entry["status"]["messages"][0][0] == "execution_error"


def _images_counted(c) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("sdjax_images_generated_total "):
            return float(line.split()[1])
    raise AssertionError("no sdjax_images_generated_total in /metrics")


def test_workflow_images_are_counted_once_in_the_metrics(server):
    """A workflow's generated images count in `sdjax_images_generated_total` as the other APIs' do: a batch of 2
    shown by both a SaveImage and a PreviewImage is 2 images, not 4 (the soak found ComfyUI's were not counted)."""
    wf = default_workflow(seed=11)
    wf["5"]["inputs"]["batch_size"] = 2
    wf["10"] = {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}}
    with client(server.url) as c:
        before = _images_counted(c)
        r = c.post("/prompt", json={"prompt": wf})
        assert r.status_code == 200, r.text
        entry = wait_history(c, r.json()["prompt_id"])
        assert entry["status"]["status_str"] == "success"
        assert len(entry["outputs"]["9"]["images"]) == len(entry["outputs"]["10"]["images"]) == 2
        assert _images_counted(c) - before == 2
