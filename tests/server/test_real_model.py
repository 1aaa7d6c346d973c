"""The CLI and the server on a real (tiny) pipeline: the diffusers folder of tests/conftest.py's `sd1_dir`.

Checks what the fake cannot: the real pipeline's `validate`, `warmup` and `generate_arrays` behind both adapters;
images from the CLI, from a batched server request and from a direct call agree; metadata is read back.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image
from server_helpers import client, live_server
from typer.testing import CliRunner

from sdjax import cli, metadata

STEPS = 3


@pytest.fixture(scope="module")
def pipe(sd1_dir):
    return cli.load_pipeline(str(sd1_dir), "float32")


def direct(pipe, prompt: str, seed: int, sampler: str = "pndm") -> np.ndarray:
    h, w = pipe.default_size
    request = metadata.GenerationRequest(
        prompt, num_images=1, seed=seed, steps=STEPS, width=w, height=h, sampler=sampler
    )
    return metadata.generate_images(pipe, request.images())[0]


def pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"))


def test_cli_generate_on_the_tiny_model(sd1_dir, pipe, tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(cli, "load_pipeline", lambda model, dtype: loads.append((model, dtype.value)) or pipe)
    args = [
        "generate",
        "a red square",
        "--model",
        str(sd1_dir),
        "--steps",
        str(STEPS),
        "--seed",
        "5",
        "-N",
        "2",
        "--sampler",
        "PLMS",
        "--out",
        str(tmp_path),
    ]
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    assert "Denoising" in r.stderr and "compile" in r.stderr
    assert loads == [(str(sd1_dir), "float32")]  # the module's pipeline: its compiled executables are reused
    first = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in first] == ["00000-5.png", "00001-6.png"]
    h, w = pipe.default_size
    for k, path in enumerate(first):
        p = metadata.parameters_from_text(metadata.read_parameters(path))
        assert p == metadata.ImageParameters("a red square", "", STEPS, "pndm", 7.5, 5 + k, w, h, model=sd1_dir.name)
        assert f"Sampler: PLMS, CFG scale: 7.5, Seed: {5 + k}, Size: {w}x{h}" in metadata.read_parameters(path)
        # the CLI's image is the pipeline's for that seed alone (it does not depend on the batch)
        np.testing.assert_allclose(pixels(path.read_bytes()), direct(pipe, "a red square", 5 + k), atol=2)
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    again = sorted(tmp_path.glob("*.png"))[2:]
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in first]  # same settings, same bytes


def test_server_batches_real_requests(pipe):
    h, w = pipe.default_size
    # No start-up compilation (it would be for the default 50 steps); the shape below is the CLI test's.
    with live_server(pipe, max_batch=4, batch_sizes=(4,), batch_window_s=1.0, model_name="tiny", warm=False) as s:

        async def send():
            async with httpx.AsyncClient(base_url=s.url, timeout=600) as c:
                return await asyncio.gather(
                    c.post("/v1/images/generations", json={"prompt": "a cat", "seed": 1, "steps": STEPS, "n": 2}),
                    c.post(
                        "/sdapi/v1/txt2img", json={"prompt": "a dog", "seed": 9, "steps": STEPS, "sampler_name": "PLMS"}
                    ),
                )

        openai, a1111 = asyncio.run(send())
        assert openai.status_code == 200 and a1111.status_code == 200, (openai.text, a1111.text)
        got = [base64.b64decode(d["b64_json"]) for d in openai.json()["data"]] + [
            base64.b64decode(a1111.json()["images"][0])
        ]
        want = [("a cat", 1), ("a cat", 2), ("a dog", 9)]
        for png, (prompt, seed) in zip(got, want):
            p = metadata.parameters_from_text(metadata.read_parameters(png))
            assert (p.prompt, p.seed, p.steps, p.width, p.height, p.model, p.sampler) == (
                prompt,
                seed,
                STEPS,
                w,
                h,
                "tiny",
                "pndm",
            )
            np.testing.assert_allclose(pixels(png), direct(pipe, prompt, seed), atol=2)
        assert json.loads(a1111.json()["info"])["sampler_name"] == "PLMS"
        with client(s.url) as c:
            metrics = c.get("/metrics").text
            assert "sdjax_batch_images_bucket" in metrics
            # both requests shared one batch of the compiled size 4
            assert 'sdjax_batch_fill_ratio_bucket{le="0.75"} 1.0' in metrics
            r = c.post("/v1/images/generations", json={"prompt": "x", "size": "72x64"})
            assert r.status_code == 422 and r.json()["error"]["param"] == "size"
            assert c.get("/health").json()["status"] == "ok"


def test_another_sampler_than_the_models(pipe):
    with live_server(pipe, max_batch=1, model_name="tiny", warm=False) as s, client(s.url, timeout=600) as c:
        r = c.post("/sdapi/v1/txt2img", json={"prompt": "a dog", "seed": 9, "steps": STEPS, "sampler_name": "Euler a"})
        assert r.status_code == 200, r.text
        png = base64.b64decode(r.json()["images"][0])
        assert metadata.parameters_from_text(metadata.read_parameters(png)).sampler == "euler_a"
        np.testing.assert_allclose(pixels(png), direct(pipe, "a dog", 9, "euler_a"), atol=2)
