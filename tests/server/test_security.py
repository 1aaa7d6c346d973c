"""Issue 19, finding 5: no API key, no CORS option. `api_key` (OpenAI's Bearer) and `api_auth` (AUTOMATIC1111's
basic auth) are compared in constant time; CORS answers only the configured origins; the server binds to
127.0.0.1 unless told otherwise."""

from __future__ import annotations

import hmac
import inspect

import httpx
import pytest
from server_helpers import check_image, client, live_server
from test_server_errors import assert_error

from sdjax import cli
from sdjax.server import Auth, serve

OPENAI = "/v1/images/generations"
A1111 = "/sdapi/v1/txt2img"
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def locked():
    with live_server(api_key=KEY, api_auth=(("alice", "wonder:land"), ("bob", "builder")), warm=False) as s:
        yield s


def test_credentials_are_required(locked):
    with client(locked.url) as c:
        r = c.post(OPENAI, json={"prompt": "x"})
        assert_error(r, 401, "authorization", "Bearer")
        assert r.headers["www-authenticate"] == 'Basic realm="sdjax"'
        assert_error(
            c.post(OPENAI, json={"prompt": "x"}, headers={"Authorization": "Bearer sk-wrong"}), 401, "authorization"
        )
        e = assert_error(c.post(A1111, json={"prompt": "x"}), 401, None, "Incorrect username or password")
        assert e["kind"] == "HTTPException"
        assert_error(c.post(A1111, json={"prompt": "x"}, auth=("alice", "wrong")), 401, None)
        assert_error(c.post(A1111, json={"prompt": "x"}, auth=("mallory", "builder")), 401, None)
        assert c.get("/metrics").status_code == 401 and c.get("/v1/config").status_code == 401
        assert c.get("/sdapi/v1/options").status_code == 401


def test_good_credentials_pass(locked):
    with client(locked.url) as c:
        r = c.post(OPENAI, json={"prompt": "key", "seed": 1}, headers={"Authorization": f"Bearer {KEY}"})
        check_image(r.json()["data"][0]["b64_json"], seed=1)
        r = c.post(A1111, json={"prompt": "basic", "seed": 2}, auth=("alice", "wonder:land"))  # ':' in a password
        check_image(r.json()["images"][0], seed=2)
        assert c.post(A1111, json={"prompt": "b", "seed": 3}, auth=("bob", "builder")).status_code == 200
        assert c.get("/sdapi/v1/options", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_public_paths(locked):
    with client(locked.url) as c:
        for path in ("/", "/health", "/health/live", "/health/ready", "/openapi.json"):
            assert c.get(path).status_code == 200, path


def test_comparisons_are_constant_time(monkeypatch):
    """Every pair is compared, user and password, with hmac.compare_digest, whichever matches."""
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    auth = Auth(api_key="k", users=(("u1", "p1"), ("u2", "p2"), ("u3", "p3")))
    basic = "Basic " + __import__("base64").b64encode(b"u1:p1").decode()
    assert auth.allows(basic)
    assert len(calls) == 6  # 3 pairs x (user, password), no early exit on the first match
    calls.clear()
    assert auth.allows("Bearer k") and calls == [(b"k", b"k")]
    assert not auth.allows("Bearer k2") and not auth.allows("Basic !!!") and not auth.allows(None)
    assert not auth.allows("Basic " + __import__("base64").b64encode(b"u1").decode())
    with pytest.raises(ValueError, match="user:password"):
        Auth.parse_user("nopassword")


def test_cors_only_for_the_configured_origins():
    with live_server(cors_origins=("http://allowed.test",), warm=False) as s, client(s.url) as c:
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        ok = c.options(OPENAI, headers={"Origin": "http://allowed.test", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://allowed.test"
        bad = c.options(OPENAI, headers={"Origin": "http://evil.test", **preflight})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        r = c.post(OPENAI, json={"prompt": "x"}, headers={"Origin": "http://allowed.test"})
        assert r.headers["access-control-allow-origin"] == "http://allowed.test"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    with live_server(warm=False) as s, client(s.url) as c:
        r = c.post(OPENAI, json={"prompt": "x"}, headers={"Origin": "http://allowed.test"})
        assert "access-control-allow-origin" not in r.headers


def test_localhost_by_default():
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    help_text = __import__("typer.testing", fromlist=["CliRunner"]).CliRunner().invoke(cli.app, ["serve", "--help"])
    assert "127.0.0.1" in help_text.stdout


def test_the_web_page_works_with_basic_auth(locked):
    """The page is public; its API calls carry the browser's basic-auth credentials (the 401 challenge is Basic)."""
    with httpx.Client(base_url=locked.url, auth=("bob", "builder")) as c:
        assert c.get("/").status_code == 200 and c.get("/v1/config").status_code == 200
