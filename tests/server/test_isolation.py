"""Issue 19, finding 1: a lone surrogate ("\\ud800", valid JSON) in an A1111 prompt or in any negative prompt
raised inside the tokenizer, and every request batched with it got a 500. Every request is now validated and
tokenized alone before it joins a batch: the bad one gets 422 naming its field, its batch-mates their images."""

from __future__ import annotations

import asyncio
import json

import httpx
from fake_pipeline import FakePipeline
from server_helpers import check_image, live_server
from test_server_errors import assert_error

OPENAI = "/v1/images/generations"
A1111 = "/sdapi/v1/txt2img"

BAD = [
    (A1111, {"prompt": "a \ud800 cat"}, "prompt"),
    (A1111, {"prompt": "ok", "negative_prompt": "x\udfff"}, "negative_prompt"),
    (OPENAI, {"prompt": "ok", "negative_prompt": "\ud800"}, "negative_prompt"),
    (OPENAI, {"prompt": "\udbff tail"}, "prompt"),
]
GOOD = [
    (A1111, {"prompt": "good one", "seed": 1, "batch_size": 2}),
    (OPENAI, {"prompt": "good two", "seed": 2}),
    (A1111, {"prompt": "good three", "negative_prompt": "fine \u00e9\u4e2d\U0001f600", "seed": 3}),
]


def raw(body: dict) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate becomes the JSON escape "\ud800"


def test_a_request_the_tokenizer_refuses_fails_alone():
    pipe = FakePipeline(delay_s=0.2)
    with live_server(pipe, max_batch=8, batch_window_s=0.5, warm=False) as s:

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                sends = [
                    c.post(path, content=raw(body), headers={"content-type": "application/json"})
                    for path, body, *_ in BAD + GOOD
                ]
                return await asyncio.gather(*sends)

        responses = asyncio.run(main())
    for (_, _, field), r in zip(BAD, responses[: len(BAD)]):
        error = assert_error(r, 422, field, "")
        assert "surrogate" in error["message"] or "unicode" in error["message"].lower(), error
    for (_, body), r in zip(GOOD, responses[len(BAD) :]):
        assert r.status_code == 200, r.text
        items = r.json()["images"] if "images" in r.json() else [d["b64_json"] for d in r.json()["data"]]
        for k, b64 in enumerate(items):
            check_image(
                b64, prompt=body["prompt"], seed=body["seed"] + k, negative_prompt=body.get("negative_prompt", "")
            )
    # the good requests met in one batch, and no bad text ever reached the pipeline
    assert any({"good one", "good two"} <= set(c["prompts"]) for c in pipe.calls), [c["prompts"] for c in pipe.calls]
    seen = [p for c in pipe.calls for p in c["prompts"]]
    assert all(p in ("good one", "good two", "good three") for p in seen), seen
