"""The batcher on its own (no HTTP): grouping by shape, padding, requests spanning batches, cancellation, stop."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from fake_pipeline import FakePipeline, expected

from sdjax.metadata import GenerationRequest
from sdjax.server.batching import Batcher, QueueFull, ShuttingDown, pick_batch_size
from sdjax.server.metrics import Metrics


def images(prompt, n=1, seed=0, size=64, steps=4):
    return GenerationRequest(
        prompt, num_images=n, seed=seed, steps=steps, width=size, height=size, sampler="euler_a"
    ).images()


def check(outcome, params):
    """The job's outcome holds exactly the fake's image for each of `params`, in order."""
    assert outcome.images == list(params) and outcome.stopped is None
    arrays = outcome.arrays
    assert arrays.shape[0] == len(params)
    for a, p in zip(arrays, params):
        np.testing.assert_array_equal(
            a,
            expected(
                p.prompt,
                p.negative_prompt,
                p.seed,
                p.image_index,
                p.guidance_scale,
                p.steps,
                p.height,
                p.width,
                p.sampler,
            ),
        )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def make(pipe=None, **kw) -> Batcher:
    kw.setdefault("max_batch", 4)
    return Batcher(pipe or FakePipeline(), metrics=Metrics(kw["max_batch"]), **kw)


def test_pick_batch_size():
    assert [pick_batch_size(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="exceed"):
        pick_batch_size(9, (1, 2, 4, 8))
    assert make(max_batch=6).batch_sizes == (1, 2, 4, 6)
    assert make(max_batch=8, batch_sizes=(8,)).batch_sizes == (8,)
    with pytest.raises(ValueError, match="1..max_batch"):
        make(max_batch=4, batch_sizes=(2, 16))


def test_shapes_are_never_mixed_and_big_requests_span_batches():
    pipe = FakePipeline(delay_s=0.05)

    async def main():
        b = make(pipe, window_s=0.05)
        await b.start()
        requests = [
            images("a", 3, seed=0),
            images("b", 1, seed=10, size=32),
            images("c", 6, seed=20),
            images("d", 2, seed=30, steps=5),
            images("e", 1, seed=40),
        ]
        jobs = [b.submit(r) for r in requests]
        results = await asyncio.gather(*(j.future for j in jobs))
        await b.stop()
        return requests, results

    requests, results = run(main())
    for r, arrays in zip(requests, results):
        check(arrays, r)
    for call in pipe.calls:
        assert call["n"] <= 4 and call["pad_to"] in (1, 2, 4)
    shapes = [(c["steps"], c["height"]) for c in pipe.calls]
    assert sum(c["n"] for c in pipe.calls) == 13
    # FIFO: the first batch is the oldest request's shape, filled with later requests of that shape
    assert pipe.calls[0]["prompts"] == ["a", "a", "a", "c"] and shapes[0] == (4, 64)
    assert (4, 32) in shapes and (5, 64) in shapes


def test_queue_bound_and_cancel():
    async def main():
        b = make(FakePipeline(delay_s=0.2), max_queue_images=5, window_s=0.0)
        await b.start()
        first = b.submit(images("a", 4))
        await asyncio.sleep(0.05)  # "a" is running
        second = b.submit(images("b", 4))
        with pytest.raises(QueueFull) as e:
            b.submit(images("c", 2))
        assert e.value.retry_after >= 1
        b.cancel(second, "timeout")  # e.g. its request timed out
        assert b.queued_images == 0
        third = b.submit(images("c", 2))
        check(await first.future, images("a", 4))
        check(await third.future, images("c", 2))
        assert second.future.cancelled()
        await b.stop()
        with pytest.raises(ShuttingDown):
            b.submit(images("d"))

    run(main())


def test_stop_during_warmup_is_quiet_and_stops_the_warmup_run(caplog):
    pipe = FakePipeline(delay_s=4.0)  # 4 steps of 1 s

    async def main():
        b = make(pipe, warm_shapes=[(4, 64, 64, "euler_a")])
        await b.start()
        while not pipe.calls:
            await asyncio.sleep(0.01)
        assert not b.ready
        job = b.submit(images("queued behind the warm-up"))
        t0 = time.monotonic()
        await b.stop(timeout_s=0.2)
        return job, time.monotonic() - t0

    job, took = run(main())
    assert isinstance(job.future.exception(), ShuttingDown)
    # the warm-up run is the served call (progress and should_stop given) and stops at its next step
    assert pipe.calls[0]["should_stop"] and pipe.calls[0]["progress"]
    assert pipe.calls[0]["stopped"] and pipe.calls[0]["steps_run"] < 4 and took < 2.5, (pipe.calls[0], took)
    assert "Traceback" not in caplog.text and "cannot schedule" not in caplog.text


def test_a_failing_batch_fails_only_its_requests():
    async def main():
        b = make(FakePipeline(fail_prompt="boom"), window_s=0.05)
        await b.start()
        bad, good, other = (
            b.submit(images("boom")),
            b.submit(images("ok", 2)),
            b.submit(images("other shape", size=32)),
        )
        results = await asyncio.gather(bad.future, good.future, other.future, return_exceptions=True)
        await b.stop()
        return results

    bad, good, other = run(main())
    assert isinstance(bad, RuntimeError) and isinstance(good, RuntimeError)  # same batch
    check(other, images("other shape", size=32))
