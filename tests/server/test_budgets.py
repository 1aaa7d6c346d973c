"""Issue 19, findings 2 and 3: one request could hold the worker for hours; every new size, steps or sampler
compiled while all others waited (`--only-warm-sizes` pinned sizes only); warm-up compiled another program
variant than the one served. Now a request's cost (pixels x steps x images) and the queue's are bounded, `pin`
serves exactly the warmed sizes x steps x samplers, and warm-up runs the served call itself."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fake_pipeline import FakePipeline
from server_helpers import check_image, client, live_server
from test_server_errors import assert_error

from sdjax.server import Limits

OPENAI = "/v1/images/generations"
A1111 = "/sdapi/v1/txt2img"


def test_a_request_over_its_budget_is_refused_naming_the_limit():
    budget = 64 * 64 * 4 * 2  # two 64x64 images at 4 steps
    with live_server(limits=Limits(max_cost=budget), warm=False) as s, client(s.url) as c:
        assert c.post(OPENAI, json={"prompt": "x", "n": 2}).status_code == 200
        e = assert_error(c.post(OPENAI, json={"prompt": "x", "n": 3}), 422, None, "max_request_cost")
        assert "64x64 pixels x 4 steps x 3 images = 49152 pixel-steps" in e["message"]
        assert_error(c.post(OPENAI, json={"prompt": "x", "steps": 9}), 422, None, "max_request_cost")
        assert_error(c.post(A1111, json={"prompt": "x", "batch_size": 2, "n_iter": 2}), 422, None, "max_request_cost")
        assert 'sdjax_rejected_total{reason="over_budget"} 3.0' in c.get("/metrics").text


def test_the_queue_budget():
    pipe = FakePipeline(delay_s=1.0)
    budget = 64 * 64 * 4 * 3  # three 64x64 images at 4 steps, queued at once
    with live_server(pipe, max_queue_cost=budget, max_batch=1, batch_window_s=0.0, warm=False) as s:
        with client(s.url) as c:
            e = assert_error(c.post(OPENAI, json={"prompt": "x", "n": 4}), 422, None, "max_queue_cost")
            assert "could never run" in e["message"]

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                first = asyncio.ensure_future(c.post(OPENAI, json={"prompt": "first", "seed": 1}))
                await asyncio.sleep(0.3)  # running: not counted in the queue any more
                second = asyncio.ensure_future(c.post(OPENAI, json={"prompt": "second", "n": 2, "seed": 2}))
                await asyncio.sleep(0.1)
                third = await c.post(OPENAI, json={"prompt": "third", "n": 2})  # 2 + 2 queued > 3
                return await first, await second, third

        first, second, third = asyncio.run(main())
    assert first.status_code == 200 and second.status_code == 200
    assert third.status_code == 429 and "max_queue_cost" in third.json()["error"]["message"]
    assert int(third.headers["Retry-After"]) >= 1


def test_pinned_shapes_are_warmed_and_nothing_else_is_served():
    pipe = FakePipeline()
    config = dict(
        pin=True,
        warm_sizes=((64, 64), (32, 48)),
        warm_steps=(4, 6),
        warm_samplers=("Euler a", "ddim"),
        max_batch=2,
    )
    with live_server(pipe, **config) as s, client(s.url) as c:
        warmed = {(h, w, st, smp) for (_, h, w, st, smp) in s.warmups}
        assert warmed == {
            (h, w, st, smp) for w, h in ((64, 64), (32, 48)) for st in (4, 6) for smp in ("euler_a", "ddim")
        }
        assert sorted({b for (b, *_) in s.warmups}) == [1, 2]
        served_before = len(pipe.calls)
        assert_error(c.post(OPENAI, json={"prompt": "x", "size": "32x32"}), 422, "size", "not served")
        assert_error(c.post(OPENAI, json={"prompt": "x", "steps": 5}), 422, "steps", "compiled ahead: 4, 6")
        assert_error(c.post(OPENAI, json={"prompt": "x", "sampler": "lms"}), 422, "sampler", "Euler a, DDIM")
        assert_error(c.post(A1111, json={"prompt": "x", "steps": 5}), 422, "steps", "not served")
        assert_error(c.post(A1111, json={"prompt": "x", "sampler_name": "LMS"}), 422, "sampler_name", "not served")
        r = c.post(
            A1111, json={"prompt": "ok", "seed": 4, "steps": 6, "width": 32, "height": 48, "sampler_name": "DDIM"}
        )
        check_image(r.json()["images"][0], seed=4, steps=6, width=32, height=48, sampler="ddim")
        check_image(c.post(OPENAI, json={"prompt": "ok", "seed": 5}).json()["data"][0]["b64_json"], steps=4)
        # every call after start-up was of a warmed shape and batch size: nothing compiled while serving
        for call in pipe.calls[served_before:]:
            assert (call["height"], call["width"], call["steps"], call["sampler"]) in warmed
            assert call["pad_to"] in (1, 2)
        assert c.get("/v1/config").json()["pinned"] is True


@pytest.mark.parametrize("progress", [True, False])
def test_warm_up_runs_the_served_call(progress):
    """The warm-up is the served call (progress and should_stop as when serving), so it compiles the program that
    requests run (the issue measured 30-53 s first requests after a warm start of the other variant)."""
    pipe = FakePipeline()
    with live_server(pipe, progress=progress, max_batch=2) as s, client(s.url) as c:
        assert len(s.warmups) == 2
        c.post(OPENAI, json={"prompt": "served"})
        flags = {(call["progress"], call["should_stop"]) for call in pipe.calls}
        assert flags == {(progress, True)}, flags
