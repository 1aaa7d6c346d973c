"""The CLI and the server on a real (tiny) pipeline: the diffusers folder of tests/conftest.py's `sd1_dir`, and
the embedded model.

Checks what the fake cannot: the real pipeline's `validate`, tokenizer and `generate_arrays` behind both adapters;
images from the CLI, from a batched server request and from a direct call agree; metadata is read back; start-up
compiles exactly the program requests run; an image's bytes do not depend on its batch-mates or position.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
from compile_counter import counting_compiles
from PIL import Image
from server_helpers import client, live_server
from typer.testing import CliRunner

from sdjax import cli, infotext, metadata

STEPS = 3


@pytest.fixture(scope="module")
def pipe(sd1_dir):
    return cli.load_pipeline(str(sd1_dir), "float32")


def as_the_server_calls(*args, **kwargs) -> None:
    """A progress callback that takes the latents, as the server's do: a direct call then runs the program a
    server's batch of that size runs (one compile for both), not a second one without host callbacks."""


def direct(pipe, prompt: str, seed: int, sampler: str = "pndm") -> np.ndarray:
    h, w = pipe.default_size
    request = metadata.GenerationRequest(
        prompt, num_images=1, seed=seed, steps=STEPS, width=w, height=h, sampler=sampler
    )
    return metadata.generate_images(pipe, request.images(), progress=as_the_server_calls)[0]


def pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"))


def test_cli_generate_on_the_tiny_model(sd1_dir, pipe, tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(cli.generate, "load_pipeline", lambda model, dtype: loads.append((model, dtype.value)) or pipe)
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
        p = metadata.parameters_from_text(infotext.read_parameters(path))
        assert p == metadata.ImageParameters("a red square", "", STEPS, "pndm", 7.5, 5 + k, w, h, model=sd1_dir.name)
        assert f"Sampler: PLMS, CFG scale: 7.5, Seed: {5 + k}, Size: {w}x{h}" in infotext.read_parameters(path)
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
                # issue 19, finding 1: text the real tokenizer refuses fails alone, not the batch it would join
                bad = b'{"prompt": "a dog", "negative_prompt": "\\ud800", "steps": %d}' % STEPS
                return await asyncio.gather(
                    c.post("/v1/images/generations", json={"prompt": "a cat", "seed": 1, "steps": STEPS, "n": 2}),
                    c.post(
                        "/sdapi/v1/txt2img", json={"prompt": "a dog", "seed": 9, "steps": STEPS, "sampler_name": "PLMS"}
                    ),
                    c.post("/sdapi/v1/txt2img", content=bad, headers={"content-type": "application/json"}),
                )

        openai, a1111, refused = asyncio.run(send())
        assert refused.status_code == 422 and "negative_prompt" in refused.json()["detail"], refused.text
        assert openai.status_code == 200 and a1111.status_code == 200, (openai.text, a1111.text)
        got = [base64.b64decode(d["b64_json"]) for d in openai.json()["data"]] + [
            base64.b64decode(a1111.json()["images"][0])
        ]
        want = [("a cat", 1), ("a cat", 2), ("a dog", 9)]
        for png, (prompt, seed) in zip(got, want):
            p = metadata.parameters_from_text(infotext.read_parameters(png))
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
        # A1111's "Euler a" (Automatic schedule) is Euler a over uniform sigmas: "Euler a Uniform" to the library
        assert metadata.parameters_from_text(infotext.read_parameters(png)).sampler == "Euler a Uniform"
        np.testing.assert_allclose(pixels(png), direct(pipe, "a dog", 9, "Euler a Uniform"), atol=2)


def test_warm_start_compiles_what_requests_run(pipe):
    """Issue 19, finding 3: warm-up compiled the program without progress reporting while requests ran the one
    with it (30-53 s first requests after a warm start). Now no request of a warmed shape compiles anything."""
    with (
        counting_compiles() as compiles,
        live_server(pipe, max_batch=2, model_name="tiny", default_steps=STEPS, default_sampler="DDIM") as s,
    ):
        warm_compiles = len(compiles)
        assert warm_compiles > 0  # start-up compiled (batch 1 and 2)
        with client(s.url, timeout=600) as c:
            for body in ({"prompt": "a cat", "seed": 3}, {"prompt": "two", "seed": 4, "batch_size": 2}):
                assert c.post("/sdapi/v1/txt2img", json=body).status_code == 200
        assert len(compiles) == warm_compiles, f"{len(compiles) - warm_compiles} compilations while serving"


class SlowPipeline:
    """The real pipeline, held at a denoising step until the server acts on it, so that a request can be
    interrupted (or a partial image taken) mid-way without racing the clock; keeps the latents each step reports.

    The step whose count reaches `hold_at` of the total reports its progress (and latents) to the server, then
    waits for `release`: set by the test, or by the server asking this pipeline for a partial image. The hold is
    short (`HOLD_S`): a program held in its host callback keeps the other simulated devices waiting in a collective,
    which XLA aborts after 40 s; a server that never acts on the held step fails the run, and the test, first."""

    HOLD_S = 20.0

    def __init__(self, pipe, hold_at: float):
        self.pipe, self.reported, self.hold_at = pipe, [], hold_at
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def generate_arrays(self, *args, progress=None, should_stop=None, **kwargs):
        def held(stage, step, total, latents=None):
            if latents is not None:
                self.reported.append(np.asarray(latents))
            progress(stage, step, total, **({} if latents is None else {"latents": latents}))
            if latents is not None and step >= self.hold_at * total and not self.release.wait(self.HOLD_S):
                raise TimeoutError(f"the server did not act on step {step}/{total} within {self.HOLD_S:g} s")

        return self.pipe.generate_arrays(*args, progress=held, should_stop=should_stop, **kwargs)

    def decode_latents(self, latents, params=None):
        """`server.partial`'s decode asks the pipeline first: the server wants the held step's image, so the run
        may go on (the decode waits for the devices the running program holds)."""
        from sdjax.server import partial

        self.release.set()
        return partial.decode_latents(self.pipe, latents, params)


def test_an_interrupted_request_answers_with_its_partly_denoised_image(pipe):
    """AUTOMATIC1111's interrupt answers with the partly denoised image (webuiapi's `result.image`): here the VAE
    decode of the latents of the last step before the interrupt, which is the pipeline's own decode."""
    from sdjax.server import partial

    h, w = pipe.default_size
    slow = SlowPipeline(pipe, hold_at=0.0)  # held at its first step until the interrupt is in
    with live_server(slow, max_batch=1, model_name="tiny", warm=False) as s, client(s.url, timeout=600) as c:
        body = {"prompt": "a dog", "seed": 9, "steps": 8}
        out = {}
        t = threading.Thread(target=lambda: out.update(r=c.post("/sdapi/v1/txt2img", json=body)))
        t.start()
        deadline = time.monotonic() + 300  # the first request compiles
        while not slow.reported:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with client(s.url) as other:
            assert other.post("/sdapi/v1/interrupt").json()["interrupted"]
        slow.release.set()
        t.join(60)
        r = out["r"]
        assert r.status_code == 200 and json.loads(r.json()["info"])["stopped"] == "interrupt", r.text
        (image,) = r.json()["images"]
        assert len(slow.reported) == 1  # the held first step, then the interrupt
        np.testing.assert_array_equal(
            pixels(base64.b64decode(image)), partial.decode_latents(pipe, slow.reported[-1])[0]
        )
        assert np.abs(pixels(base64.b64decode(image)).astype(int) - direct(pipe, "a dog", 9)).max() > 20
    # ... and that decode is the pipeline's: the final latents decode to its image
    args = (["a cat"], [""], [3], [0], [7.5])
    kw = dict(steps=STEPS, height=h, width=w, sampler="pndm", progress=as_the_server_calls)  # direct()'s program
    latents = pipe.generate_arrays(*args, output="latents", **kw)
    np.testing.assert_allclose(partial.decode_latents(pipe, latents), pipe.generate_arrays(*args, **kw), atol=1)


def test_openai_streaming_decodes_partial_images_while_the_batch_runs(pipe):
    """`stream: true` with `partial_images`: the partial image is the VAE decode of the latents of a step (run
    beside the running program), the completed one the pipeline's image."""
    from sdjax.server import partial

    # held half way until the server decodes the partial image: the stream polls the running batch every 50 ms,
    # and timed steps (0.3 s, then 1 s) twice ended the batch before a poll saw it half done on a loaded CI machine
    slow = SlowPipeline(pipe, hold_at=0.5)
    with live_server(slow, max_batch=1, model_name="tiny", warm=False) as s, client(s.url, timeout=600) as c:
        body = {"prompt": "a cat", "seed": 3, "steps": STEPS, "sampler": "pndm", "stream": True, "partial_images": 1}
        r = c.post("/v1/images/generations", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [json.loads(line[len("data: ") :]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    partly = pixels(base64.b64decode(events[0]["b64_json"]))
    assert any(np.array_equal(partly, partial.decode_latents(pipe, x[:1])[0]) for x in slow.reported)
    np.testing.assert_allclose(pixels(base64.b64decode(events[1]["b64_json"])), direct(pipe, "a cat", 3), atol=2)


@pytest.fixture(scope="module")
def embedded():
    return cli.load_pipeline(None, "float32")


def test_an_image_does_not_depend_on_its_batch_mates_or_position(embedded):
    """The promise, narrowed to what holds (measured on the embedded model: another compiled batch size can move
    a pixel by 1/255, see sdjax.server.batching): within one compiled batch size, the same request gives the same
    bytes whatever its batch-mates and its position among them."""
    target = {"prompt": "a red circle on a blue background", "seed": 11, "steps": STEPS}
    mates_a = [{"prompt": p, "seed": 100 + i, "steps": STEPS} for i, p in enumerate(["a green square", "a b", "c"])]
    mates_b = [{"prompt": p, "seed": 200 + i, "steps": STEPS} for i, p in enumerate(["x", "a yellow triangle", "z"])]
    config = dict(max_batch=4, batch_sizes=(4,), batch_window_s=2.0, model_name="embedded", warm=False)
    with live_server(embedded, **config) as s:

        async def round_of(bodies):
            async with httpx.AsyncClient(base_url=s.url, timeout=600) as c:
                sends = []
                for body in bodies:  # in this order: the batch takes requests as they arrive
                    sends.append(asyncio.ensure_future(c.post("/sdapi/v1/txt2img", json=body)))
                    await asyncio.sleep(0.1)
                return [r.json()["images"][0] for r in await asyncio.gather(*sends)]

        first = asyncio.run(round_of([target, *mates_a]))[0]
        last = asyncio.run(round_of([*mates_b, target]))[-1]
        with client(s.url) as c:
            assert 'sdjax_batch_fill_ratio_bucket{le="1.0"} 2.0' in c.get("/metrics").text  # two full batches of 4
    assert first == last
