"""The server on the embedded model over a models directory: embeddings of `embeddings/` loaded at start-up (those
that do not fit the model skipped), and `override_settings.CLIP_stop_at_last_layers` per request giving the image
of `pipe.generate(..., clip_skip=N)`, in the same batch as a request without it (no split, no compilation)."""

from __future__ import annotations

import base64
import io
import json
import threading

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file
from server_helpers import client, live_server

from sdjax import cli, metadata

STEPS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "Stable-diffusion").mkdir()
    (root / "embeddings").mkdir()
    rng = np.random.default_rng(0)
    for name, shape in (("inky", (2, 64)), ("sdxl-ish", (1, 32))):  # the second is for another text encoder
        tensor = {"emb_params": rng.standard_normal(shape).astype(np.float32)}
        save_file(tensor, str(root / "embeddings" / f"{name}.safetensors"))
    return root


def pixels(b64: str) -> tuple[np.ndarray, str]:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return np.asarray(im.convert("RGB")), im.info["parameters"]


def test_clip_skip_per_request_and_embeddings_from_the_directory(models):
    pipe = cli.load_pipeline(None, "float32")  # the embedded model: 2 text-encoder layers, width 64
    calls = []
    generate_arrays = pipe.generate_arrays

    def recording(*args, **kwargs):
        calls.append((len(args[0]), kwargs.get("clip_skip")))
        return generate_arrays(*args, **kwargs)

    pipe.generate_arrays = recording
    config = dict(model_name="sdjax/embedded", models_dir=str(models), warm=False, max_batch=2, batch_sizes=(2,),
                  batch_window_s=3.0)  # fmt: skip
    skip2 = {"CLIP_stop_at_last_layers": 2}
    requests = [
        {"prompt": "an inky cat", "seed": 4, "steps": STEPS, "override_settings": skip2},
        {"prompt": "a red circle", "seed": 5, "steps": STEPS},
    ]
    out = [None, None]
    with live_server(pipe, **config) as s, client(s.url, timeout=600) as c:
        body = c.get("/sdapi/v1/embeddings").json()
        inky = {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": "sdjax/embedded", "shape": 64, "vectors": 2}
        assert body["loaded"] == {"inky": inky}
        assert list(body["skipped"]) == ["sdxl-ish"] and body["skipped"]["sdxl-ish"]["shape"] == 32

        def post(i):
            out[i] = c.post("/sdapi/v1/txt2img", json=requests[i])

        threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    assert len(calls) == 1 and calls[0][0] == 2 and sorted(calls[0][1]) == [1, 2], calls  # one batch holds both
    (skipped, text), (plain, plain_text) = (pixels(r.json()["images"][0]) for r in out)
    assert "Clip skip: 2" in text and "Clip skip" not in plain_text
    assert json.loads(out[0].json()["info"])["clip_skip"] == 2
    assert metadata.parameters_from_text(text).clip_skip == 2
    pipe.generate_arrays = generate_arrays
    for prompt, seed, clip_skip, got in (("an inky cat", 4, 2, skipped), ("a red circle", 5, 1, plain)):
        want = np.asarray(pipe.generate(prompt, seed=seed, steps=STEPS, clip_skip=clip_skip)[0], np.int16)
        assert np.abs(got.astype(np.int16) - want).max() <= 1, prompt
    # the embedding is a word of the prompt (its own token ids), and CLIP skip changes the image
    assert pipe.text_encoder.config.vocab_size == 49408 + 2
    assert list(pipe.tokenizer(["inky"])[0][1:3]) == [49408, 49409]
    other = np.asarray(pipe.generate("an inky cat", seed=4, steps=STEPS)[0], np.int16)
    assert np.abs(other - skipped.astype(np.int16)).max() > 8
