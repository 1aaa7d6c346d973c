"""Locust users for the sdjax server soak (run by benchmarks/soak/run_soak.py; 127.0.0.1 only).

A mix of what a public endpoint meets:
- `valid`: OpenAI and AUTOMATIC1111 txt2img requests with a unique prompt and seed; every image that comes back
  must carry exactly that prompt and seed (else it is counted "mixed"); a valid request that ends in anything but
  200 or an explicit 429 is counted "lost";
- `invalid`: bad fields, a lone surrogate, an unpinned size: must get 422 in the API's error shape;
- `oversized`: a body over the server's limit: 413;
- `slow body`: headers and part of a body, then a byte now and then: the server must cut it off (400/408 or close)
  within its body timeout;
- `disconnect`: a valid request whose client closes the connection at once: nothing to check but that the
  server stays well (its work is cancelled).

Counts and the valid requests' latencies go to the JSON file named by SOAK_RESULT when the run ends.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import os
import random
import socket
import threading
import time

from locust import HttpUser, between, events, task
from PIL import Image

SERVER_BODY_LIMIT = int(os.environ.get("SOAK_BODY_LIMIT", 16 * 1024))
STEPS = int(os.environ.get("SOAK_STEPS", 4))
SLOW_FOR_S = float(os.environ.get("SOAK_SLOW_FOR_S", 8.0))
WORDS = ["red", "blue", "green", "yellow", "circle", "square", "triangle", "small", "big", "left", "right"]

_lock = threading.Lock()
_ids = itertools.count()
_users = itertools.count()
COUNTS = {
    "valid_sent": 0,
    "valid_ok": 0,
    "valid_429": 0,
    "lost": 0,
    "mixed": 0,
    "images_checked": 0,
    "invalid_ok": 0,
    "invalid_wrong": 0,
    "oversized_ok": 0,
    "oversized_wrong": 0,
    "slow_cut": 0,
    "slow_not_cut": 0,
    "disconnects": 0,
}
LATENCIES: list[float] = []
LOST: list[str] = []


def count(key: str, n: int = 1) -> None:
    with _lock:
        COUNTS[key] += n


def parameters_of(b64: str) -> str:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return im.info.get("parameters", "")


def seed_and_prompt(text: str) -> tuple[int | None, str]:
    *lines, last = text.split("\n")
    prompt = "\n".join(line for line in lines if not line.startswith("Negative prompt:"))
    fields = dict(part.split(": ", 1) for part in last.split(", ") if ": " in part)
    return (int(fields["Seed"]) if "Seed" in fields else None), prompt


class Client(HttpUser):
    wait_time = between(0.05, 0.3)

    def on_start(self):
        self.host_port = self.host.removeprefix("http://").split(":")
        # Each user opens with one of the rarer kinds, in turn, so that a short run meets every kind (drawn by the
        # task weights alone, a 20-second run with 8 users missed the weight-1 kinds about once in a hundred).
        first = (self.oversized, self.slow_body, self.invalid, self.disconnect)
        with _lock:
            i = next(_users)
        first[i % len(first)]()

    # ------------------------------------------------------------------ valid
    @task(10)
    def valid(self):
        k = next(_ids)
        prompt = f"a {random.choice(WORDS)} {random.choice(WORDS)} on a {random.choice(WORDS)} background #{k}"
        seed = 1000 * k + random.randrange(1000)
        n = random.choice((1, 1, 2))
        openai = random.random() < 0.5
        if openai:
            path, body, name = "/v1/images/generations", {"prompt": prompt, "seed": seed, "n": n}, "valid openai"
        else:
            path, body, name = "/sdapi/v1/txt2img", {"prompt": prompt, "seed": seed, "batch_size": n}, "valid a1111"
        count("valid_sent")
        t0 = time.perf_counter()
        try:
            with self.client.post(path, json=body, name=name, catch_response=True, timeout=600) as r:
                if r.status_code == 429:
                    count("valid_429")
                    r.success()
                    return
                if r.status_code != 200:
                    count("lost")
                    with _lock:
                        LOST.append(f"{name}: {r.status_code} {r.text[:200]}")
                    r.failure(f"valid request answered {r.status_code}")
                    return
                data = r.json()
                images = [d["b64_json"] for d in data["data"]] if openai else data["images"]
                if len(images) != n:
                    count("mixed")
                    r.failure(f"{len(images)} images for {n}")
                    return
                for i, b64 in enumerate(images):
                    got_seed, got_prompt = seed_and_prompt(parameters_of(b64))
                    if got_seed != seed + i or got_prompt != prompt:
                        count("mixed")
                        r.failure(f"image {i} carries seed {got_seed} / {got_prompt!r}")
                        return
                count("images_checked", n)
                count("valid_ok")
                with _lock:
                    LATENCIES.append(time.perf_counter() - t0)
                r.success()
        except Exception as e:  # a connection error on a valid request is a lost request
            count("lost")
            with _lock:
                LOST.append(f"{name}: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ invalid
    @task(3)
    def invalid(self):
        cases = [
            ("/v1/images/generations", {"prompt": 5}),
            ("/v1/images/generations", {"prompt": "x", "n": 0}),
            ("/v1/images/generations", {"prompt": "x", "size": "64x72"}),  # not pinned
            ("/sdapi/v1/txt2img", {"prompt": "x", "steps": STEPS + 1}),  # not pinned
            ("/sdapi/v1/txt2img", {"prompt": "x", "negative_prompt": "\ud800"}),
            ("/sdapi/v1/txt2img", {"prompt": "x", "override_settings": {"sd_hypernetwork": "x"}}),  # unsupported
        ]
        path, body = random.choice(cases)
        raw = json.dumps(body).encode()
        with self.client.post(path, data=raw, headers={"content-type": "application/json"}, name="invalid",
                              catch_response=True) as r:  # fmt: skip
            shaped = r.status_code == 422 and (
                set(r.json()) == {"error", "detail", "body", "errors"}
                if path.startswith("/sdapi")
                else "error" in r.json()
            )
            count("invalid_ok" if shaped else "invalid_wrong")
            r.success() if shaped else r.failure(f"{r.status_code}: {r.text[:200]}")

    @task(1)
    def oversized(self):
        body = json.dumps({"prompt": "x" * (SERVER_BODY_LIMIT + 100)})
        with self.client.post("/v1/images/generations", data=body, headers={"content-type": "application/json"},
                              name="oversized", catch_response=True) as r:  # fmt: skip
            ok = r.status_code == 413
            count("oversized_ok" if ok else "oversized_wrong")
            r.success() if ok else r.failure(f"{r.status_code}")

    # ------------------------------------------------------------------ raw sockets
    def _raw(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        exc = None
        try:
            fn()
        except Exception as e:
            exc = e
        self.environment.events.request.fire(
            request_type="RAW", name=name, response_time=(time.perf_counter() - t0) * 1000, response_length=0,
            exception=exc, context={},
        )  # fmt: skip

    @task(1)
    def slow_body(self):
        def go():
            body = json.dumps({"prompt": "slow"}).encode()
            head = (
                f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            with socket.create_connection((self.host_port[0], int(self.host_port[1])), timeout=2) as sock:
                sock.sendall(head + body[:2])
                deadline = time.monotonic() + SLOW_FOR_S
                while time.monotonic() < deadline:
                    try:
                        sock.sendall(b" ")
                        data = sock.recv(4096)
                        if data == b"" or data.startswith((b"HTTP/1.1 400", b"HTTP/1.1 408")):
                            count("slow_cut")
                            return
                    except TimeoutError:
                        continue
                    except OSError:
                        count("slow_cut")
                        return
                count("slow_not_cut")
                raise RuntimeError(f"a slow body was not cut off within {SLOW_FOR_S} s")

        self._raw("slow body", go)

    @task(2)
    def disconnect(self):
        def go():
            body = json.dumps({"prompt": f"abandoned {next(_ids)}", "seed": 1}).encode()
            head = (
                f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            with socket.create_connection((self.host_port[0], int(self.host_port[1])), timeout=2) as sock:
                sock.sendall(head + body)
                time.sleep(random.uniform(0.0, 0.5))
            count("disconnects")

        self._raw("disconnect", go)


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@events.quitting.add_listener
def _write_result(environment, **kwargs):
    path = os.environ.get("SOAK_RESULT")
    if not path:
        return
    with _lock:
        result = {
            **COUNTS,
            "valid_p50_s": _percentile(LATENCIES, 0.5),
            "valid_p99_s": _percentile(LATENCIES, 0.99),
            "valid_max_s": max(LATENCIES) if LATENCIES else None,
            "lost_examples": LOST[:10],
        }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
