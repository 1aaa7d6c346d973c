"""Issue 19, findings 2 and 4: a 504 did not cancel the running batch, work went on for clients that disconnected,
SIGTERM waited 307 s, /health said "ok" throughout. Now a request nobody waits for stops its batch within one
denoising step (batch-mates go on), interrupt/skip act on the running batch, SIGTERM drains for a bounded time, and
readiness fails while the worker is stuck.

The fake pipeline sleeps `delay_s / steps` per step and polls `should_stop()` before each step, as the generation
core will; its call records say how many steps ran and whether it stopped.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from fake_pipeline import FakePipeline, FakePipelineWithoutStop
from server_helpers import SpawnedServer, check_image, client, decode_png, live_server

from sdjax import metadata

OPENAI = "/v1/images/generations"
A1111 = "/sdapi/v1/txt2img"


def wait_until(predicate, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.01)


def calls_with(pipe, prompt: str) -> list[dict]:
    return [c for c in pipe.calls if prompt in c["prompts"]]


def test_a_504_stops_the_running_batch_within_one_step():
    pipe = FakePipeline(delay_s=3.0)  # 30 steps of 0.1 s
    with live_server(pipe, warm=False, request_timeout_s=0.4, max_batch=1, batch_window_s=0.0) as s, client(s.url) as c:
        t0 = time.monotonic()
        r = c.post(OPENAI, json={"prompt": "slow", "steps": 30})
        assert r.status_code == 504 and "cancelled" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 1.0
        wait_until(lambda: "ended" in calls_with(pipe, "slow")[0] and s.batcher.current is None, what="the batch end")
        (call,) = calls_with(pipe, "slow")
        # stopped at the step after the timeout: 0.4 s = 4 steps, one more step at most, plus scheduling slack
        assert call["stopped"] and call["steps_run"] <= 7, call
        assert call["ended"] - call["started"] < 0.8
        metrics = c.get("/metrics").text
        assert 'sdjax_cancelled_total{reason="timeout"} 1.0' in metrics and "sdjax_stopped_batches_total 1.0" in metrics
        pipe.delay_s = 0.0
        assert c.post(OPENAI, json={"prompt": "next", "steps": 2}).status_code == 200


def test_a_disconnected_client_stops_its_batch():
    pipe = FakePipeline(delay_s=3.0)
    with live_server(pipe, warm=False, max_batch=1, batch_window_s=0.0) as s:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(s.url + OPENAI, json={"prompt": "abandoned", "steps": 30}, timeout=0.4)
        wait_until(lambda: calls_with(pipe, "abandoned") and "ended" in calls_with(pipe, "abandoned")[0])
        (call,) = calls_with(pipe, "abandoned")
        assert call["stopped"] and call["steps_run"] <= 7, call
        with client(s.url) as c:
            assert 'sdjax_cancelled_total{reason="disconnect"} 1.0' in c.get("/metrics").text
            assert c.get("/health/ready").status_code == 200


def test_batch_mates_of_a_cancelled_request_finish():
    pipe = FakePipeline(delay_s=1.0)  # 10 steps of 0.1 s
    with live_server(pipe, warm=False, max_batch=4, batch_window_s=0.3) as s:
        result = {}

        def patient():
            with client(s.url) as c:
                result["r"] = c.post(OPENAI, json={"prompt": "patient", "seed": 3, "steps": 10})

        t = threading.Thread(target=patient)
        t.start()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + OPENAI, json={"prompt": "impatient", "steps": 10}, timeout=0.6)
        t.join(10)
        check_image(result["r"].json()["data"][0]["b64_json"], prompt="patient", seed=3)
        (call,) = calls_with(pipe, "patient")
        assert call["prompts"] == ["patient", "impatient"] or call["prompts"] == ["impatient", "patient"]
        assert not call["stopped"] and call["steps_run"] == 10


def test_queued_images_of_a_cancelled_request_never_run():
    """Without should_stop (the pipelines before the generation core) a running batch runs to its end; the rest of
    the request's images are dropped from the queue."""
    pipe = FakePipelineWithoutStop(delay_s=0.6)
    with live_server(pipe, warm=False, request_timeout_s=0.3, max_batch=1, batch_window_s=0.0) as s, client(s.url) as c:
        r = c.post(A1111, json={"prompt": "three", "batch_size": 3, "steps": 6})
        assert r.status_code == 504
        time.sleep(1.0)
        calls = calls_with(pipe, "three")
        assert len(calls) == 1 and not calls[0]["should_stop"] and calls[0]["steps_run"] == 6
        assert c.get("/health/ready").status_code == 200 and s.batcher.queued_images == 0


def _a1111_in_thread(url: str, body: dict, out: dict):
    def go():
        with client(url) as c:
            out["r"] = c.post(A1111, json=body)

    t = threading.Thread(target=go)
    t.start()
    return t


def test_interrupt_ends_the_request_with_the_images_made_so_far():
    pipe = FakePipeline(delay_s=1.0)  # 10 steps of 0.1 s per batch
    with live_server(pipe, warm=False, max_batch=1, batch_window_s=0.0) as s, client(s.url) as c:
        out = {}
        t = _a1111_in_thread(s.url, {"prompt": "long", "batch_size": 3, "seed": 40, "steps": 10}, out)
        wait_until(lambda: len(calls_with(pipe, "long")) == 2, what="the second batch")
        time.sleep(0.2)
        r = c.post("/sdapi/v1/interrupt")
        assert r.status_code == 200 and len(r.json()["interrupted"]) == 1
        t.join(10)
        body = out["r"].json()
        info = json.loads(body["info"])
        assert out["r"].status_code == 200 and info["stopped"] == "interrupt"
        assert info["all_seeds"] == [40] and len(body["images"]) == 1
        check_image(body["images"][0], seed=40, prompt="long")
        calls = calls_with(pipe, "long")
        assert len(calls) == 2 and calls[1]["stopped"] and calls[1]["steps_run"] < 10  # no third batch


def test_interrupt_answers_with_the_running_batch_decoded_from_its_latents():
    """AUTOMATIC1111's interrupt ends the request with the partly denoised images of the running batch: the
    pipeline's VAE decode of the latents of the last step before the interrupt (here the fake's)."""
    pipe = FakePipeline(delay_s=1.0, report_latents=True)  # 10 steps of 0.1 s per batch
    with live_server(pipe, warm=False, max_batch=2, batch_window_s=0.0) as s, client(s.url) as c:
        out = {}
        body = {"prompt": "partly", "batch_size": 2, "n_iter": 2, "seed": 50, "steps": 10, "width": 64, "height": 32}
        t = _a1111_in_thread(s.url, body, out)
        wait_until(lambda: calls_with(pipe, "partly") and calls_with(pipe, "partly")[0]["steps_run"] >= 3,
                   what="step 3 of the first batch")  # fmt: skip
        assert c.post("/sdapi/v1/interrupt").json()["interrupted"]
        t.join(10)
        body = out["r"].json()
        info = json.loads(body["info"])
        assert out["r"].status_code == 200 and info["stopped"] == "interrupt"
        assert info["all_seeds"] == [50, 51] and len(body["images"]) == 2  # the second batch never ran
        (call,) = calls_with(pipe, "partly")
        assert call["stopped"] and 3 <= call["steps_run"] < 10
        want = pipe.decode_latents(FakePipeline.reported_latents(2, 32, 64, call["steps_run"], 10))
        for k, image in enumerate(body["images"]):
            pixels, text = decode_png(image)
            np.testing.assert_array_equal(pixels, want[k])
            assert metadata.parameters_from_text(text).seed == 50 + k


def test_skip_drops_the_running_batch_and_goes_on():
    pipe = FakePipeline(delay_s=1.0)
    with live_server(pipe, warm=False, max_batch=1, batch_window_s=0.0) as s, client(s.url) as c:
        out = {}
        t = _a1111_in_thread(s.url, {"prompt": "skippy", "batch_size": 3, "seed": 50, "steps": 10}, out)
        wait_until(lambda: len(calls_with(pipe, "skippy")) == 2, what="the second batch")
        time.sleep(0.2)
        assert c.post("/sdapi/v1/skip").json() == {"skipped": True}
        t.join(10)
        body = out["r"].json()
        info = json.loads(body["info"])
        assert info["stopped"] == "skip" and info["all_seeds"] == [50, 52]
        for b64, seed in zip(body["images"], (50, 52)):
            check_image(b64, seed=seed)
        calls = calls_with(pipe, "skippy")
        assert [c_["stopped"] for c_ in calls] == [False, True, False]
        assert c.post("/sdapi/v1/skip").json() == {"skipped": False}  # nothing running


def test_readiness_fails_while_the_worker_is_stuck():
    pipe = FakePipeline(delay_s=2.0)  # one step of 2 s: no sign of life meanwhile
    with live_server(pipe, stuck_after_s=0.5, max_batch=1, batch_window_s=0.0, warm=False) as s, client(s.url) as c:
        out = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(s.url + OPENAI, json={"prompt": "x", "steps": 1})))
        t.start()
        wait_until(lambda: s.batcher.current is not None)
        time.sleep(0.8)
        ready = c.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["status"].startswith("stuck"), ready.json()
        assert c.get("/health").status_code == 503
        assert c.get("/health/live").json() == {"status": "alive"}
        t.join(10)
        assert out["r"].status_code == 200 and c.get("/health/ready").status_code == 200


def test_readiness_fails_while_warming():
    pipe = FakePipeline(delay_s=1.5)
    config = dict(max_batch=1, warm_sizes=((64, 64),), default_steps=3)
    from server_helpers import LiveServer

    from sdjax.server import ServerConfig

    server = LiveServer(pipe, ServerConfig(model_name="m", **config))
    server.thread.start()
    try:
        wait_until(lambda: server.server.started and pipe.calls, what="warm-up")
        port = server.server.servers[0].sockets[0].getsockname()[1]
        with client(f"http://127.0.0.1:{port}") as c:
            r = c.get("/health/ready")
            assert r.status_code == 503 and r.json()["status"] == "warming"
            assert c.get("/health/live").status_code == 200
            wait_until(lambda: server.batcher.ready, what="ready")
            assert c.get("/health/ready").status_code == 200
    finally:
        server.server.should_exit = True
        server.thread.join(10)


def test_sigterm_drains_for_a_bounded_time_then_cancels():
    """A batch of 60 steps of 1 s is running; SIGTERM with --shutdown-timeout 1: the request is answered 503
    after about 1 s, the batch stops at its next step, the process exits within seconds (was 307 s)."""
    with SpawnedServer("FakePipeline(delay_s=60.0)", "shutdown_timeout_s=1.0, max_batch=1, warm=False") as server:
        out = {}

        def post():
            try:
                out["r"] = httpx.post(server.url + OPENAI, json={"prompt": "endless", "steps": 60}, timeout=60)
            except httpx.HTTPError as e:
                out["r"] = e

        t = threading.Thread(target=post)
        t.start()
        wait_until(lambda: httpx.get(server.url + "/health").json()["busy"], what="the batch to start")
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        status = server.proc.wait(timeout=20)
        took = time.monotonic() - t0
        t.join(10)
        output = server.proc.stdout.read()
        assert status in (0, -signal.SIGTERM), output
        assert took < 6.0, (took, output)
        r = out["r"]
        assert isinstance(r, httpx.Response) and r.status_code == 503, r
        assert "shutting" in r.json()["error"]["message"] or "stopped" in r.json()["error"]["message"]
        assert "Traceback" not in output, output


def test_the_latent_preview_in_progress():
    pipe = FakePipeline(delay_s=2.0, report_latents=True)
    with live_server(pipe, warm=False, max_batch=1, batch_window_s=0.0) as s, client(s.url) as c:
        out = {}
        t = _a1111_in_thread(s.url, {"prompt": "p", "steps": 10, "width": 64, "height": 48, "force_task_id": "t1"}, out)
        wait_until(lambda: s.batcher.current is not None and s.batcher.current.latents is not None)
        p = c.get("/sdapi/v1/progress", params={"id_task": "t1"}).json()
        pixels, _ = decode_png(p["current_image"])
        assert pixels.shape == (6, 8, 3)  # the latent grid (1/8 of 48x64), no VAE decode
        # the fake's first latent channel ramps left to right: the preview's red channel does too
        assert (pixels[0, :, 0][1:] >= pixels[0, :, 0][:-1]).all() and pixels[0, -1, 0] > pixels[0, 0, 0]
        assert c.get("/sdapi/v1/progress", params={"skip_current_image": True}).json()["current_image"] is None
        t.join(10)
        assert out["r"].status_code == 200


def test_no_preview_without_latents():
    pipe = FakePipeline(delay_s=1.0)
    with live_server(pipe, warm=False, max_batch=1, batch_window_s=0.0) as s, client(s.url) as c:
        out = {}
        t = _a1111_in_thread(s.url, {"prompt": "p", "steps": 10}, out)
        wait_until(lambda: s.batcher.current is not None and s.batcher.current.step > 0)
        p = c.get("/sdapi/v1/progress").json()
        assert p["current_image"] is None and p["progress"] > 0
        t.join(10)
        assert metadata.parameters_from_text(decode_png(out["r"].json()["images"][0])[1]).prompt == "p"
