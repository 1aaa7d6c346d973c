"""Bad requests of every kind, overload, timeouts and pipeline failures: each gets its status and a message naming
the field, and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from fake_pipeline import FakePipeline
from server_helpers import check_image, client, live_server

OPENAI = "/v1/images/generations"
A1111 = "/sdapi/v1/txt2img"
OPTIONS = "/sdapi/v1/options"


@pytest.fixture(scope="module")
def server():
    with live_server(
        max_batch=4,
        max_body_bytes=4096,
        limits=__import__("sdjax.server", fromlist=["Limits"]).Limits(max_images=8, max_steps=50, max_size=256),
    ) as s:
        yield s


@pytest.fixture
def http(server):
    with client(server.url) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None, words: str = "") -> dict:
    """`r` is an error in its API's shape: OpenAI's `{"error": {message, type, param, code}}` (returned as is), or
    on /sdapi/* AUTOMATIC1111's `{error, detail, body, errors}` (returned as `{"message": detail, ...}`); the
    message names `param` and holds `words`."""
    assert r.status_code == status, r.text
    assert r.headers["x-request-id"]
    body = r.json()
    if r.request.url.path.startswith("/sdapi/"):
        assert set(body) == {"error", "detail", "body", "errors"}, body
        assert isinstance(body["error"], str) and body["body"] == "" and body["errors"] == body["detail"]
        error = {"message": body["detail"], "kind": body["error"]}
    else:
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error
    if param not in (None, "body"):
        assert param in error["message"]
    return error


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({}, "prompt", "required"),
        ({"negative_prompt": "x"}, "prompt", "required"),
        ({"prompt": ""}, "prompt", "at least 1"),
        ({"prompt": 5}, "prompt", "string"),
        ({"prompt": "x", "n": 1000}, "n", "at most 8"),
        ({"prompt": "x", "n": 0}, "n", "greater than"),
        ({"prompt": "x", "n": 1.5}, "n", "integer"),
        ({"prompt": "x", "size": "65x64"}, "size", "multiple of 8"),
        ({"prompt": "x", "size": "big"}, "size", "WIDTHxHEIGHT"),
        ({"prompt": "x", "size": "1024x1024"}, "size", "outside"),
        ({"prompt": "x", "steps": -3}, "steps", "greater than"),
        ({"prompt": "x", "steps": 0}, "steps", "greater than"),
        ({"prompt": "x", "steps": 500}, "steps", "at most 50"),
        ({"prompt": "x", "sampler": "no-such-sampler"}, "sampler", "unknown sampler"),
        ({"prompt": "x", "guidance_scale": -1}, "guidance_scale", "greater than"),
        ({"prompt": "x", "guidance_scale": 1000}, "guidance_scale", "at most"),
        ({"prompt": "x", "seed": 2**40}, "seed", "less than"),
        ({"prompt": "x", "response_format": "png"}, "response_format", "b64_json"),
    ],
)
def test_openai_bad_fields(http, body, param, words):
    assert_error(http.post(OPENAI, json=body), 422, param, words)


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({}, "prompt", "required"),
        ({"prompt": "x", "batch_size": 100}, "batch_size", "at most 8"),
        ({"prompt": "x", "batch_size": 4, "n_iter": 3}, "batch_size", "at most 8"),
        ({"prompt": "x", "width": 65}, "width", "multiple of 8"),
        ({"prompt": "x", "height": 0}, "height", "greater than"),
        ({"prompt": "x", "width": 512}, "width", "outside"),
        ({"prompt": "x", "steps": -1}, "steps", "greater than"),
        ({"prompt": "x", "sampler_name": "Nope a"}, "sampler_name", "unknown A1111 sampler"),
        ({"prompt": "x", "cfg_scale": "high"}, "cfg_scale", "number"),
        ({"prompt": "x", "seed": -5}, "seed", "greater than"),
        ({"prompt": "x", "initial_noise_multiplier": 2}, "initial_noise_multiplier", "only 1 is supported"),
        ({"prompt": "x", "subseed_strength": 0.5}, "subseed_strength", "not supported"),
    ],
)
def test_a1111_bad_fields(http, body, param, words):
    assert_error(http.post(A1111, json=body), 422, param, words)


def test_only_served_sizes():
    from sdjax.server import Limits

    with live_server(limits=Limits(sizes=((64, 64), (32, 48)))) as s, client(s.url) as c:
        assert c.post(OPENAI, json={"prompt": "x", "size": "32x48"}).status_code == 200
        e = assert_error(c.post(OPENAI, json={"prompt": "x", "size": "48x32"}), 422, "size", "not served")
        assert "64x64, 32x48" in e["message"]
        assert_error(c.post(A1111, json={"prompt": "x", "width": 40}), 422, "width", "not served")


def test_model_specific_size_rule_is_reported(server):
    with live_server(FakePipeline(multiple=16)) as s, client(s.url) as c:
        assert_error(c.post(OPENAI, json={"prompt": "x", "size": "40x48"}), 422, "size", "multiple of 16")


@pytest.mark.parametrize("path", [OPENAI, A1111])
def test_malformed_and_non_object_json(http, path):
    for raw in (b"{not json", b'{"prompt": "x",}', b""):
        e = assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 422, "body")
        assert "json" in e["message"].lower() or "required" in e["message"].lower()
    assert http.post(path, json=["prompt"]).status_code == 422
    assert http.post(path, json="prompt").status_code == 422


def test_oversized_body(http):
    big = {"prompt": "x" * 10_000}
    assert_error(http.post(OPENAI, json=big), 413, "body", "exceeds 4096 bytes")

    def chunks():  # no Content-Length: the limit applies to what arrives
        for _ in range(10):
            yield b" " * 1000

    # (txt2img carries control images: it has the image endpoints' limit; options has the small one)
    assert_error(http.post(OPTIONS, content=chunks(), headers={"content-type": "application/json"}), 413, "body")
    assert http.post(OPENAI, json={"prompt": "still fine"}).status_code == 200


def test_wrong_method_and_path(http):
    assert http.get(OPENAI).status_code == 405
    assert http.post("/v1/nope", json={}).status_code == 404
    assert http.get("/health").status_code == 200


def test_queue_full_answers_429_with_retry_after():
    pipe = FakePipeline(delay_s=0.4)
    with live_server(pipe, max_batch=2, max_queue_images=3, batch_window_s=0.0) as s:

        def post(i):
            with client(s.url) as c:
                return c.post(OPENAI, json={"prompt": f"p{i}", "n": 2, "seed": i})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(post, range(8)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:
                for item in r.json()["data"]:
                    check_image(item["b64_json"])
        with client(s.url) as c:
            assert 'sdjax_rejected_total{reason="queue_full"}' in c.get("/metrics").text
            assert c.post(OPENAI, json={"prompt": "after"}).status_code == 200


def test_timeout_answers_504_and_the_server_recovers():
    pipe = FakePipeline(delay_s=0.6)
    with live_server(pipe, request_timeout_s=0.2, max_batch=1, batch_window_s=0.0) as s, client(s.url) as c:
        t0 = time.monotonic()
        r = c.post(OPENAI, json={"prompt": "slow"})
        assert r.status_code == 504 and time.monotonic() - t0 < 0.6
        assert "timeout" in r.json()["error"]["message"]
        pipe.delay_s = 0.0
        time.sleep(0.6)  # the running batch finishes; its result is dropped
        assert c.post(OPENAI, json={"prompt": "fast"}).status_code == 200
        assert c.get("/health").json()["status"] == "ok"
        assert 'sdjax_rejected_total{reason="timeout"} 1.0' in c.get("/metrics").text


def test_pipeline_failure_answers_500_without_internals_and_the_server_keeps_serving(caplog):
    """Issue 19, finding 5: a 500 showed the exception text. Now it names a request id, under which the traceback
    is logged."""
    pipe = FakePipeline(fail_prompt="boom")
    with live_server(pipe) as s, client(s.url) as c:
        for path, body in ((OPENAI, {"prompt": "boom"}), (A1111, {"prompt": "boom"})):
            r = c.post(path, json=body)
            error = assert_error(r, 500, None, "request id")
            request_id = r.headers["x-request-id"]
            assert request_id in error["message"]
            assert "told to fail" not in r.text and "RuntimeError" not in r.text and "Traceback" not in r.text
            assert any(request_id in rec.getMessage() and "told to fail" in rec.getMessage() for rec in caplog.records)
        assert r.json()["error"] == "HTTPException"  # AUTOMATIC1111's shape names the exception kind
        check_image(c.post(OPENAI, json={"prompt": "fine", "seed": 1}).json()["data"][0]["b64_json"], seed=1)
        assert "sdjax_batch_errors_total 2.0" in c.get("/metrics").text
        # a client's own request id is kept when it is plain, replaced when it is not
        assert c.get("/health", headers={"X-Request-ID": "abc-123"}).headers["x-request-id"] == "abc-123"
        assert c.get("/health", headers={"X-Request-ID": "a b\tc"}).headers["x-request-id"] != "a b\tc"
