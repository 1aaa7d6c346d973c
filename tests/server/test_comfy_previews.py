"""ComfyUI's binary latent previews on the websocket (`server.comfy.preview`) and the Flux / SD 3 latent->RGB factors
they (and the A1111 progress image) use.

A plain `websockets` client queues a prompt with ComfyUI's `extra_data.preview_method` and receives, between the
`progress` messages of the sampler, frames of ComfyUI's layout (a big-endian event type 1, format 1, a JPEG) that
decode to the latent preview of the latents the pipeline reported; without the option (ComfyUI's default) or with
"none" no binary frame is sent. The factors are checked against ComfyUI's published numbers by hand."""

from __future__ import annotations

import asyncio
import io
import json
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from fake_pipeline import FakePipeline
from PIL import Image
from server_helpers import client, live_server
from test_comfy_api import default_workflow

from sdjax.server.routes.a1111 import latent_preview

STEPS = 8


@pytest.fixture(scope="module")
def server():
    # 0.3 s a step: each step is seen by the runner's 0.1 s polls and is over the 0.2 s between two frames
    with live_server(FakePipeline(report_latents=True, delay_s=0.3 * STEPS), warm=False, max_batch=1) as s:
        yield s


def _messages(server, extra_data: dict | None, client_id: str = "viewer") -> list:
    """Every websocket message of one prompt, in order: dicts for the JSON ones, bytes for the binary ones."""
    import websockets

    body = {"prompt": default_workflow(steps=STEPS), "client_id": client_id}
    if extra_data is not None:
        body["extra_data"] = extra_data

    async def run() -> list:
        async with websockets.connect(server.url.replace("http://", "ws://") + f"/ws?clientId={client_id}") as ws:
            out = [json.loads(await ws.recv())]
            r = await asyncio.to_thread(client(server.url).post, "/prompt", json=body)
            assert r.status_code == 200, r.text
            while True:
                m = await asyncio.wait_for(ws.recv(), 30)
                out.append(m if isinstance(m, bytes) else json.loads(m))
                if isinstance(m, str) and out[-1]["type"] == "executing" and out[-1]["data"]["node"] is None:
                    return out

    return asyncio.run(run())


def test_previews_are_binary_jpeg_frames_between_progress_messages(server):
    messages = _messages(server, {"preview_method": "auto"})
    kinds = ["binary" if isinstance(m, bytes) else m["type"] for m in messages]
    frames = [m for m in messages if isinstance(m, bytes)]
    assert len(frames) >= 2, kinds
    first_progress, executed = kinds.index("progress"), kinds.index("executed")
    # each frame follows a progress message of the sampler, and all come before the outputs
    for i, kind in enumerate(kinds):
        if kind == "binary":
            assert first_progress < i < executed and kinds[i - 1] == "progress", kinds
    # the frames of one prompt are at least 0.2 s apart: fewer than the steps here (0.3 s each) allow at most
    assert len(frames) <= STEPS
    pipe = server.pipeline
    candidates = [latent_preview(FakePipeline.reported_latents(1, 64, 64, k, STEPS)[0], pipe) for k in range(1, 9)]
    diffs = []
    for data in frames:
        assert struct.unpack(">II", data[:8]) == (1, 1)  # PREVIEW_IMAGE, JPEG
        with Image.open(io.BytesIO(data[8:])) as im:
            assert im.format == "JPEG" and im.size == (8, 8)  # the 64x64 image's latents
            got = np.asarray(im.convert("RGB"), np.int16)
        # a JPEG of the latent preview of the latents the pipeline reported at some step
        diffs.append(min(int(np.abs(got - want).max()) for want in candidates))
    print(f"{len(frames)} frames; max |JPEG - latent preview| {max(diffs)}")
    assert max(diffs) <= 24


@pytest.mark.parametrize("extra", [None, {"preview_method": "none"}, {"preview_method": "default"}])
def test_no_previews_unless_the_prompt_asks(server, extra):
    messages = _messages(server, extra, client_id="quiet")
    assert not [m for m in messages if isinstance(m, bytes)]
    assert [m for m in messages if m["type"] == "progress"]


def test_an_unknown_preview_method_is_refused_by_name(server):
    r = client(server.url).post("/prompt", json={"prompt": default_workflow(), "extra_data": {"preview_method": "x"}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_prompt" and "extra_data.preview_method" in error["message"]


# ---------------------------------------------------------------------------------------------- latent->RGB factors
@pytest.mark.parametrize(
    "family, row, bias",
    [  # channel 13's factors and the biases, as comfy/latent_formats.py publishes them (Flux, SD3)
        ("flux", (-0.1264, -0.0522, -0.1103), (-0.0329, -0.0718, -0.0851)),
        ("sd3", (-0.0069, -0.0030, -0.0810), (0.2394, 0.2135, 0.1925)),
    ],
)
def test_flux_and_sd3_previews_use_comfyuis_factors_and_bias(family, row, bias):
    if family == "flux":
        from sdjax.families.flux.pipeline import FluxPipeline as cls
    else:
        from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline as cls
    assert np.shape(cls.latent_rgb_factors) == (16, 3) and np.shape(cls.latent_rgb_factors_bias) == (3,)
    latents = np.zeros((16, 2, 3), np.float32)
    latents[13, 1, 2] = 2.0  # one channel set at one latent pixel; the others see the bias alone
    preview = latent_preview(latents, cls)
    assert preview.shape == (2, 3, 3) and preview.dtype == np.uint8
    # by hand: RGB = 2 * row + bias in [-1, 1], then (x + 1) * 127.5, truncated as the preview does
    want = [int((2.0 * r + b + 1.0) * 127.5) for r, b in zip(row, bias, strict=True)]
    assert preview[1, 2].tolist() == want
    assert preview[0, 0].tolist() == [int((b + 1.0) * 127.5) for b in bias]
    # a model without a bias (SD 1.x): the map alone
    sd = SimpleNamespace(latent_rgb_factors=((1.0, 0.0, -1.0),) * 4)
    assert latent_preview(np.full((4, 1, 1), 0.25, np.float32), sd)[0, 0].tolist() == [255, 127, 0]
