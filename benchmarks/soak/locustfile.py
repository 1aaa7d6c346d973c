"""Locust users for the sdjax server soak (run by benchmarks/soak/run_soak.py; 127.0.0.1 only).

A mix of what a public endpoint meets:
- `valid`: OpenAI and AUTOMATIC1111 txt2img requests with a unique prompt and seed; every image that comes back
  must carry exactly that prompt and seed (else it is counted "mixed"); a valid request that ends in anything but
  200 or an explicit 429 is counted "lost";
- `comfy`: ComfyUI's default txt2img workflow (API format) with a unique prompt and seed on `POST /prompt`, followed
  in turn over the user's websocket (`/ws?clientId=`, one per user and kept open, as ComfyUI's front end keeps its
  own; until `execution_success` or `executing` with `node: null`) or by polling `GET /history/{prompt_id}`; a
  websocket the server closes (the user never closes its own before the end) is counted "comfy_ws_dropped" and a
  prompt it was following is followed through /history instead; every output image is fetched through `GET /view`
  and must carry that workflow's prompt and seed (sdjax's `parameters` infotext, image i with seed + i, and
  ComfyUI's `prompt` chunk: the workflow itself) in the number asked, else "comfy_mixed"; a workflow that ends in
  anything but success or an explicit 429 is "comfy_lost". Its sampler/scheduler pair (SOAK_COMFY_SAMPLER,
  SOAK_COMFY_SCHEDULER) must map onto the server's pinned sampler;
- `invalid`: bad fields, a lone surrogate, an unpinned size: must get 422 in the API's error shape; and bad
  workflows on `/prompt` (an unknown class_type, an unpinned size or sampler, a sampler sdjax lacks, no nodes, a
  body that is not JSON): 400 in ComfyUI's shape (`error` + `node_errors`, naming the node);
- `oversized`: a body over the server's limit: 413;
- `slow body`: headers and part of a body, then a byte now and then: the server must cut it off (400/408 or close)
  within its body timeout;
- `disconnect`: a valid request whose client closes the connection at once: nothing to check but that the
  server stays well (its work is cancelled).

Counts and the valid requests' and workflows' latencies go to the JSON file named by SOAK_RESULT when the run ends.
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
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

SERVER_BODY_LIMIT = int(os.environ.get("SOAK_BODY_LIMIT", 16 * 1024))
STEPS = int(os.environ.get("SOAK_STEPS", 4))
SLOW_FOR_S = float(os.environ.get("SOAK_SLOW_FOR_S", 8.0))
SIZE = int(os.environ.get("SOAK_SIZE", 64))
COMFY_SAMPLER = os.environ.get("SOAK_COMFY_SAMPLER", "dpmpp_2m")
COMFY_SCHEDULER = os.environ.get("SOAK_COMFY_SCHEDULER", "karras")
COMFY_WAIT_S = float(os.environ.get("SOAK_COMFY_WAIT_S", 600.0))  # a workflow's bound, as the valid requests'
WORDS = ["red", "blue", "green", "yellow", "circle", "square", "triangle", "small", "big", "left", "right"]

_lock = threading.Lock()
_ids = itertools.count()
_users = itertools.count()
_comfy_turns = itertools.count()  # even: follow over the websocket, odd: poll /history
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
    "comfy_sent": 0,
    "comfy_ok": 0,  # = comfy_ws + comfy_poll: ended in success, every image checked
    "comfy_ws": 0,  # ... its end seen on the websocket
    "comfy_poll": 0,  # ... its end found polling /history (also after a dropped websocket)
    "comfy_ws_dropped": 0,  # websockets the server closed (while a prompt ran, or idle between prompts)
    "comfy_429": 0,
    "comfy_lost": 0,
    "comfy_mixed": 0,
    "comfy_images_checked": 0,
}
LATENCIES: list[float] = []
COMFY_LATENCIES: list[float] = []
LOST: list[str] = []
MIXED: list[str] = []
WS_DROPPED: list[str] = []


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


def comfy_workflow(ckpt: str, prompt: str, seed: int, batch: int, size: int = SIZE) -> dict:
    """ComfyUI's default txt2img workflow in API format, at the pinned size, steps and sampler."""
    return {
        "3": {"class_type": "KSampler",
              "inputs": {"seed": seed, "steps": STEPS, "cfg": 7.5, "sampler_name": COMFY_SAMPLER,
                         "scheduler": COMFY_SCHEDULER, "denoise": 1, "model": ["4", 0], "positive": ["6", 0],
                         "negative": ["7", 0], "latent_image": ["5", 0]}},
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": batch}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "text, watermark", "clip": ["4", 1]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "soak", "images": ["8", 0]}},
    }  # fmt: skip


class Lost(Exception):
    """A valid workflow that did not end in success (nor in an explicit 429)."""


class Mixed(Exception):
    """A workflow answered with another request's images, prompt or messages, or the wrong number of images."""


class Client(HttpUser):
    wait_time = between(0.05, 0.3)

    def on_start(self):
        self.host_port = self.host.removeprefix("http://").split(":")
        # the checkpoint's name as a ComfyUI client finds it
        with self.client.get("/models/checkpoints", name="comfy models", catch_response=True) as r:
            names = r.json() if r.status_code == 200 else []
            self.ckpt = names[0] if names else "model"
            r.success() if names else r.failure(f"{r.status_code}: {r.text[:200]}")
        # Each user opens with one of the rarer kinds, in turn, so that a short run meets every kind (drawn by the
        # task weights alone, a 20-second run with 8 users missed the weight-1 kinds about once in a hundred); the
        # first two users open with a workflow, one followed over the websocket, one by polling.
        first = (self.comfy, self.oversized, self.slow_body, self.invalid, self.disconnect)
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

    # ------------------------------------------------------------------ ComfyUI
    # Each user keeps one websocket for its session, as ComfyUI's own front end does (its clientId on every prompt
    # it follows there). Should the server close it, while a prompt runs or between prompts, that is counted
    # (comfy_ws_dropped, a failed check in run_soak.py), a prompt it was following is followed to its end through
    # /history (so lost and mixed keep their meaning), and the next turn opens a new websocket.
    @task(4)
    def comfy(self):
        k = next(_ids)
        prompt = f"a {random.choice(WORDS)} {random.choice(WORDS)} on a {random.choice(WORDS)} background #{k}"
        seed = 1000 * k + random.randrange(1000)
        n = random.choice((1, 1, 2))
        via_ws = next(_comfy_turns) % 2 == 0
        name = "comfy workflow ws" if via_ws else "comfy workflow poll"
        count("comfy_sent")
        t0 = time.perf_counter()
        exc: BaseException | None = None
        try:
            images, route = self._comfy_run(comfy_workflow(self.ckpt, prompt, seed, n), via_ws)
            if images is None:  # refused with 429
                count("comfy_429")
                return
            if len(images) != n:
                raise Mixed(f"{len(images)} images for {n}")
            for i, ref in enumerate(images):
                self._comfy_check(ref, i, prompt, seed)
            count("comfy_images_checked", n)
            count("comfy_ok")
            count(route)
            with _lock:
                COMFY_LATENCIES.append(time.perf_counter() - t0)
        except Mixed as e:
            exc = e
            count("comfy_mixed")
            with _lock:
                MIXED.append(f"{name} {prompt!r} seed {seed}: {e}")
        except Exception as e:  # Lost, or a connection error, a timeout, a malformed answer: a lost workflow
            exc = e
            count("comfy_lost")
            with _lock:
                LOST.append(f"{name} {prompt!r} seed {seed}: {type(e).__name__}: {e}")
        finally:  # the whole workflow, POST to the last image checked, as one row of locust's table
            self.environment.events.request.fire(
                request_type="COMFY", name=name, response_time=(time.perf_counter() - t0) * 1000,
                response_length=0, exception=exc, context={},
            )  # fmt: skip

    def on_stop(self):
        if getattr(self, "ws", None) is not None:
            self.ws.close()
            self.ws = None

    def _websocket(self):
        """This user's websocket, opened (and greeted: then the server has registered it) when there is none."""
        if getattr(self, "ws", None) is None:
            host, port = self.host_port
            self.ws_id = f"soak-{next(_ids)}-{random.randrange(1 << 30):x}"
            self.ws_prompts: set[str] = set()  # the prompts queued under ws_id
            ws = ws_connect(f"ws://{host}:{port}/ws?clientId={self.ws_id}", open_timeout=30, close_timeout=2,
                            max_queue=None, proxy=None)  # fmt: skip
            try:
                hello = json.loads(ws.recv(timeout=30))
                if hello.get("type") != "status" or hello["data"].get("sid") != self.ws_id:
                    raise Mixed(f"the websocket greeted {self.ws_id} with {hello!r}")
            except BaseException:
                ws.close()
                raise
            self.ws, self.ws_opened = ws, time.monotonic()
        return self.ws

    def _ws_message(self, raw, current: str | None) -> tuple[str, dict] | None:
        """A message of `current` as (type, data); None for status and this websocket's earlier prompts; Mixed for
        any other prompt's."""
        if isinstance(raw, bytes):
            return None  # sdjax sends no binary frames; ComfyUI's previews would be ignored alike
        m = json.loads(raw)
        kind, data = m.get("type"), m.get("data") or {}
        if kind == "status":
            return None
        pid = data.get("prompt_id")
        if pid == current and pid is not None:
            return kind, data
        if pid in self.ws_prompts:
            return None  # the tail of an earlier prompt (its `executing` null after execution_success)
        raise Mixed(f"the websocket of {self.ws_id} sent {kind} of prompt {pid!r}, queued under another client id")

    def _ws_dropped(self, e: Exception, prompt_id: str | None) -> None:
        count("comfy_ws_dropped")
        with _lock:
            WS_DROPPED.append(
                f"{self.ws_id}: found closed {time.monotonic() - self.ws_opened:.1f} s after it opened, "
                + (f"following prompt {prompt_id}" if prompt_id else "between prompts")
                + f" ({type(e).__name__}: {e})"
            )
        self.ws.close()
        self.ws = None

    def _comfy_run(self, workflow: dict, via_ws: bool) -> tuple[list[dict] | None, str]:
        """Queue `workflow` and follow it to its end: its output images (`{filename, subfolder, type}`), or None
        for an explicit 429; and the counter of the route that saw the end (comfy_ws, comfy_poll)."""
        deadline = time.monotonic() + COMFY_WAIT_S
        # Every prompt names its client id, a polled one an id no websocket uses (as comfy-api-simplified does), so
        # a websocket gets only its own prompts' messages (ComfyUI broadcasts those of a prompt without client_id).
        body: dict = {"prompt": workflow, "client_id": f"soak-poll-{next(_ids)}-{random.randrange(1 << 30):x}"}
        if via_ws:
            ws = self._websocket()
            try:  # what came since this websocket's last prompt: none of it may belong to another client's
                while True:
                    self._ws_message(ws.recv(timeout=0), None)
            except TimeoutError:
                pass
            except ConnectionClosed as e:
                self._ws_dropped(e, None)
                ws = self._websocket()
            body["client_id"] = self.ws_id
        with self.client.post("/prompt", json=body, name="comfy prompt", catch_response=True, timeout=600) as r:
            if r.status_code == 429:
                r.success()
                return None, "comfy_429"
            if r.status_code != 200:
                r.failure(f"a valid workflow answered {r.status_code}")
                raise Lost(f"POST /prompt answered {r.status_code}: {r.text[:300]}")
            answer = r.json()
            r.success()
        prompt_id = answer["prompt_id"]
        if answer.get("node_errors"):
            raise Lost(f"POST /prompt answered node errors {answer['node_errors']!r}")
        if via_ws:
            self.ws_prompts.add(prompt_id)
            try:
                return self._comfy_follow(ws, prompt_id, deadline), "comfy_ws"
            except ConnectionClosed as e:
                self._ws_dropped(e, prompt_id)
        return self._comfy_poll(prompt_id, workflow, deadline), "comfy_poll"

    def _comfy_follow(self, ws, prompt_id: str, deadline: float) -> list[dict]:
        images: list[dict] = []
        success = False
        while True:
            try:
                raw = ws.recv(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise Lost(f"{prompt_id}: no end on the websocket within {COMFY_WAIT_S} s") from None
            got = self._ws_message(raw, prompt_id)
            if got is None:
                continue
            kind, data = got
            if kind == "executed" and data.get("node") == "9":
                images += data["output"]["images"]
            elif kind in ("execution_error", "execution_interrupted"):
                raise Lost(f"{prompt_id}: {kind} {json.dumps(data)[:300]}")
            elif kind == "execution_success":
                success = True
            if kind == "execution_success" or (kind == "executing" and data.get("node") is None):
                if not success:
                    raise Lost(f"{prompt_id}: ended without execution_success")
                return images

    def _comfy_poll(self, prompt_id: str, workflow: dict, deadline: float) -> list[dict]:
        while time.monotonic() < deadline:
            with self.client.get(f"/history/{prompt_id}", name="comfy history", catch_response=True) as r:
                if r.status_code != 200:
                    r.failure(f"{r.status_code}")
                    raise Lost(f"GET /history/{prompt_id} answered {r.status_code}: {r.text[:300]}")
                r.success()
                got = r.json()
            if got:
                if set(got) != {prompt_id}:
                    raise Mixed(f"GET /history/{prompt_id} answered entries {sorted(got)}")
                entry = got[prompt_id]
                if entry["prompt"][1] != prompt_id or entry["prompt"][2] != workflow:
                    raise Mixed(f"{prompt_id}: the history entry holds another prompt: {entry['prompt'][:3]!r}")
                if entry["status"]["status_str"] != "success":
                    raise Lost(f"{prompt_id}: history status {json.dumps(entry['status'])[:300]}")
                return entry["outputs"].get("9", {}).get("images", [])
            time.sleep(0.2)
        raise Lost(f"{prompt_id}: not in /history within {COMFY_WAIT_S} s")

    def _comfy_check(self, ref: dict, i: int, prompt: str, seed: int) -> None:
        """Image i of a workflow, fetched through /view, carries its prompt and seed + i (sdjax's infotext) and
        the workflow itself (ComfyUI's `prompt` chunk)."""
        params = {"filename": ref["filename"], "subfolder": ref["subfolder"], "type": ref["type"]}
        with self.client.get("/view", params=params, name="comfy view", catch_response=True) as r:
            if r.status_code != 200 or r.headers.get("content-type") != "image/png":
                r.failure(f"{r.status_code}")
                raise Lost(f"GET /view {params} answered {r.status_code}: {r.text[:200]}")
            r.success()
            data = r.content
        with Image.open(io.BytesIO(data)) as im:
            info = dict(im.info)
        got_seed, got_prompt = seed_and_prompt(info.get("parameters", ""))
        if got_seed != seed + i or got_prompt != prompt:
            raise Mixed(f"{params['filename']} (image {i}) carries seed {got_seed} / {got_prompt!r}")
        try:
            wf = json.loads(info["prompt"])
            chunk = wf["6"]["inputs"]["text"], wf["3"]["inputs"]["seed"]
        except (KeyError, TypeError, ValueError) as e:
            raise Mixed(f"{params['filename']}: no workflow in its prompt chunk ({type(e).__name__}: {e})") from None
        if chunk != (prompt, seed):
            raise Mixed(f"{params['filename']}: its prompt chunk holds {chunk!r}")

    # ------------------------------------------------------------------ invalid
    @task(3)
    def invalid(self):
        if random.random() < 0.4:
            return self._invalid_comfy()
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

    def _invalid_comfy(self):
        """A bad workflow: 400 in ComfyUI's shape, naming the node at fault (None: no node to name)."""
        wf = comfy_workflow(self.ckpt, "x", 1, 1)
        unknown = {**wf, "9": {"class_type": "NoSuchNode", "inputs": {"images": ["8", 0]}}}
        unpinned_size = {**wf, "5": {**wf["5"], "inputs": {**wf["5"]["inputs"], "width": SIZE + 8}}}
        no_sampler = {**wf, "3": {**wf["3"], "inputs": {**wf["3"]["inputs"], "sampler_name": "dpm_fast"}}}
        unpinned_sampler = {**wf, "3": {**wf["3"], "inputs": {**wf["3"]["inputs"], "scheduler": "exponential"}}}
        cases = [  # (raw body, error type, node named in node_errors)
            (json.dumps({"prompt": unknown}), "invalid_prompt", "9"),
            (json.dumps({"prompt": unpinned_size}), "prompt_outputs_failed_validation", "5"),
            (json.dumps({"prompt": no_sampler}), "prompt_outputs_failed_validation", "3"),
            (json.dumps({"prompt": unpinned_sampler}), "prompt_outputs_failed_validation", "3"),
            (json.dumps({"prompt": {}}), "invalid_prompt", None),
            ('{"prompt": {"3": ', "invalid_prompt", None),
        ]
        raw, kind, node = random.choice(cases)
        with self.client.post("/prompt", data=raw.encode(), headers={"content-type": "application/json"},
                              name="invalid comfy", catch_response=True) as r:  # fmt: skip
            try:
                body = r.json()
                shaped = (
                    r.status_code == 400
                    and set(body) == {"error", "node_errors"}
                    and set(body["error"]) == {"type", "message", "details", "extra_info"}
                    and body["error"]["type"] == kind
                    and (node in body["node_errors"] if node else body["node_errors"] == {})
                )
            except (ValueError, TypeError, KeyError):
                shaped = False
            count("invalid_ok" if shaped else "invalid_wrong")
            r.success() if shaped else r.failure(f"{r.status_code}: {r.text[:300]}")

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
            "comfy_p50_s": _percentile(COMFY_LATENCIES, 0.5),
            "comfy_p99_s": _percentile(COMFY_LATENCIES, 0.99),
            "comfy_max_s": max(COMFY_LATENCIES) if COMFY_LATENCIES else None,
            "lost_examples": LOST[:10],
            "mixed_examples": MIXED[:10],
            "ws_dropped_examples": WS_DROPPED[:10],
        }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
