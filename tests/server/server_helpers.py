"""Helpers of the server tests: a live sdjax server on 127.0.0.1 (uvicorn in a thread, a free port) over the fake
pipeline, and checks that an image is exactly the fake's image for the parameters it carries."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from fake_pipeline import FakePipeline

from sdjax import metadata


class LiveServer:
    def __init__(self, pipeline, config, loader=None):
        import uvicorn

        from sdjax import server

        self.pipeline = pipeline
        self.config = config
        self.app = server.build_asgi(pipeline, config, **({"loader": loader} if loader is not None else {}))
        if hasattr(server, "uvicorn_config"):  # the guarded protocol and limits that serve() uses
            uv_config = server.uvicorn_config(self.app, config, host="127.0.0.1", port=0, log_level="warning")
        else:  # (servers before issue 19, to show which tests fail there)
            uv_config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
        self.server = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def batcher(self):
        return self.app.state.batcher

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        while not self.batcher.ready:
            time.sleep(0.01)
        # the start-up compilations, as (batch, height, width, steps, sampler), in the order run
        self.warmups = [
            (c["pad_to"], c["height"], c["width"], c["steps"], c["sampler"])
            for c in getattr(self.pipeline, "calls", [])
        ]
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def live_server(pipeline=None, loader=None, **config):
    from sdjax.server import ServerConfig

    config.setdefault("model_name", "fake-model")
    with LiveServer(pipeline or FakePipeline(), ServerConfig(**config), loader=loader) as server:
        yield server


def decode_png(b64: str) -> tuple[np.ndarray, str | None]:
    """base64 PNG -> (pixels, `parameters` text)."""
    data = base64.b64decode(b64)
    with Image.open(__import__("io").BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")), im.info.get("parameters")


def expected_for(params: metadata.ImageParameters) -> np.ndarray:
    from fake_pipeline import expected

    return expected(
        params.prompt,
        params.negative_prompt,
        params.seed,
        params.image_index,
        params.guidance_scale,
        params.steps,
        params.height,
        params.width,
        params.sampler,
    )


def check_image(b64: str, **want) -> metadata.ImageParameters:
    """The PNG carries its parameters, and its pixels are the fake's image for exactly those parameters."""
    pixels, text = decode_png(b64)
    assert text, "the PNG has no parameters chunk"
    params = metadata.parameters_from_text(text)
    for k, v in want.items():
        assert getattr(params, k) == v, (k, getattr(params, k), v, text)
    np.testing.assert_array_equal(pixels, expected_for(params))
    return params


def client(url: str, timeout: float = 30.0) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SRC = Path(__file__).resolve().parents[2] / "src"


class SpawnedServer:
    """`sdjax.server.serve` in a subprocess on 127.0.0.1, so that its signals, exit and open descriptors are its
    own. `pipeline` and `config` are Python expressions (names from fake_pipeline and sdjax.server in scope)."""

    def __init__(self, pipeline: str = "FakePipeline()", config: str = "", ready_timeout_s: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.script = textwrap.dedent(f"""
            import sys
            sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(SRC)!r}]
            from fake_pipeline import *
            from sdjax.server import Limits, ServerConfig, serve
            serve({pipeline}, ServerConfig(model_name="fake", {config}), host="127.0.0.1", port={self.port},
                  log_level="warning")
        """)
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the server did not start:\n{self.proc.stdout.read()}")
            time.sleep(0.1)

    def open_descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc):
        self.kill()
