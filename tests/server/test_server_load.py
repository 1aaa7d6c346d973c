"""Bounded load on 127.0.0.1: concurrent requests from several clients are batched, each gets exactly its own
images or a 429, none is lost; and SIGTERM lets in-flight requests finish."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
from fake_pipeline import FakePipeline
from server_helpers import check_image, client, live_server

OPENAI = "/v1/images/generations"
A1111 = "/sdapi/v1/txt2img"
SRC = Path(__file__).resolve().parents[2] / "src"


def request_for(client_id: int, i: int) -> tuple[str, dict, dict]:
    """Request `i` of client `client_id`: its endpoint, body and the parameters its images must carry."""
    prompt = f"client {client_id} request {i}"
    n = 1 + (i % 3)
    seed = 1000 * client_id + 10 * i
    size = (64, 64) if i % 4 else (32, 32)  # two shapes: batches must never mix them
    if i % 2:
        return (
            OPENAI,
            {"prompt": prompt, "n": n, "seed": seed, "size": f"{size[0]}x{size[1]}"},
            dict(prompt=prompt, n=n, seed=seed, width=size[0]),
        )
    return (
        A1111,
        {"prompt": prompt, "batch_size": n, "seed": seed, "width": size[0], "height": size[1]},
        dict(prompt=prompt, n=n, seed=seed, width=size[0]),
    )


async def one_client(url: str, client_id: int, count: int) -> list[tuple[dict, httpx.Response]]:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as c:

        async def go(i):
            path, body, want = request_for(client_id, i)
            return want, await c.post(path, json=body)

        return await asyncio.gather(*(go(i) for i in range(count)))


def images_of(r: httpx.Response) -> list[str]:
    body = r.json()
    return [d["b64_json"] for d in body["data"]] if "data" in body else body["images"]


def test_64_concurrent_requests_from_4_clients():
    pipe = FakePipeline(delay_s=0.04)
    with live_server(pipe, max_batch=8, max_queue_images=40, batch_window_s=0.02, warm_sizes=((64, 64), (32, 32))) as s:

        async def main():
            return await asyncio.gather(*(one_client(s.url, k, 16) for k in range(4)))

        t0 = time.monotonic()
        results = [x for per_client in asyncio.run(main()) for x in per_client]
        elapsed = time.monotonic() - t0
        assert len(results) == 64
        codes = [r.status_code for _, r in results]
        assert set(codes) <= {200, 429}, codes
        ok = [(want, r) for want, r in results if r.status_code == 200]
        assert len(ok) >= 16, codes
        returned = 0
        for want, r in ok:  # each request got exactly its own images, in order
            images = images_of(r)
            assert len(images) == want["n"]
            for k, b64 in enumerate(images):
                check_image(b64, prompt=want["prompt"], seed=want["seed"] + k, width=want["width"])
            returned += len(images)
        for _, r in results:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1

        calls = pipe.calls[len(s.warmups) :]  # after the start-up compilations
        assert sum(c["n"] for c in calls) == returned  # nothing generated that was not returned, nothing lost
        assert all(c["n"] <= 8 and c["pad_to"] in (1, 2, 4, 8) and c["pad_to"] >= c["n"] for c in calls)
        assert pipe.max_concurrent == 1  # one worker thread owns the pipeline
        shared = [c for c in calls if len(set(c["prompts"])) > 1]
        assert shared, "no batch combined requests"
        assert max(c["n"] for c in calls) == 8
        assert len(calls) < len(ok), (len(calls), len(ok))

        with client(s.url) as c:
            assert c.get("/health").json() == {"status": "ok", "model": "fake-model", "queue_depth": 0, "busy": False}
            check_image(images_of(c.post(OPENAI, json={"prompt": "after", "seed": 5}))[0], seed=5)
            metrics = c.get("/metrics").text
        fill_sum = _metric(metrics, "sdjax_batch_fill_ratio_sum")
        fill_count = _metric(metrics, "sdjax_batch_fill_ratio_count")
        assert fill_count == len(calls) + 1
        assert fill_sum / fill_count > 0.5, "batches were mostly empty"
        assert _metric(metrics, "sdjax_images_generated_total") == returned + 1
        assert _metric(metrics, "sdjax_queue_depth_images") == 0
        print(
            f"64 requests in {elapsed:.2f} s: {len(ok)} answered, {codes.count(429)} x 429, "
            f"{len(calls)} batches, mean fill {fill_sum / fill_count:.2f}"
        )


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


SERVER_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {src!r}]
    from fake_pipeline import FakePipeline
    from sdjax.server import ServerConfig, serve
    serve(FakePipeline(delay_s=1.0), ServerConfig(model_name="fake", max_batch=2, batch_window_s=0.0),
          host="127.0.0.1", port={port}, log_level="warning")
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_finishes_in_flight_requests():
    port = free_port()
    script = SERVER_SCRIPT.format(tests=str(Path(__file__).parent), src=str(SRC), port=port)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        results: dict[int, httpx.Response | Exception] = {}

        def post(i):
            try:
                results[i] = httpx.post(url + OPENAI, json={"prompt": f"in flight {i}", "seed": i}, timeout=30)
            except Exception as e:
                results[i] = e

        threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while _metric(httpx.get(url + "/metrics").text, "sdjax_requests_in_flight") < 4:  # 3 + this one
            assert time.monotonic() < deadline, "the requests did not reach the server"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # all three are queued or running (1 s per batch of 2)
        for t in threads:
            t.join(timeout=30)
        for i in range(3):
            r = results[i]
            assert isinstance(r, httpx.Response) and r.status_code == 200, r
            check_image(r.json()["data"][0]["b64_json"], seed=i, prompt=f"in flight {i}")
        # uvicorn re-raises the signal once shut down, so the exit status is the signal's (as without a handler)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM), proc.stdout.read()
        output = proc.stdout.read()
        assert "Traceback" not in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
