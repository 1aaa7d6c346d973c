"""The server on the embedded model over a models directory:

- embeddings of `embeddings/` loaded at start-up (one made for another text encoder skipped);
- `override_settings.CLIP_stop_at_last_layers` per request gives the image of `pipe.generate(..., clip_skip=N)`,
  in the same batch as a request without it;
- `<lora:name:w>` in the prompt and `override_settings.sd_vae` (files of `Lora/` and `VAE/`) give the Python API's
  image with that LoRA loaded at that weight and that VAE; another weight compiles nothing.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from compile_counter import counting_compiles
from PIL import Image
from safetensors.numpy import load_file, save_file
from server_helpers import client, live_server

import sdjax
from sdjax import cli, metadata

STEPS = 2
A1111 = "/sdapi/v1/txt2img"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "Stable-diffusion").mkdir()
    (root / "embeddings").mkdir()
    rng = np.random.default_rng(0)
    for name, shape in (("inky", (2, 64)), ("sdxl-ish", (1, 32))):  # the second is for another text encoder
        tensor = {"emb_params": rng.standard_normal(shape).astype(np.float32)}
        save_file(tensor, str(root / "embeddings" / f"{name}.safetensors"))
    (root / "Lora").mkdir()
    layer = "lora_te_text_model_encoder_layers_1_mlp_fc1"  # kohya's name of a text-encoder layer
    lora = {
        f"{layer}.lora_down.weight": rng.standard_normal((4, 64)).astype(np.float32),
        f"{layer}.lora_up.weight": rng.standard_normal((256, 4)).astype(np.float32),
        f"{layer}.alpha": np.asarray(2.0, np.float32),
    }
    save_file(lora, str(root / "Lora" / "fc.safetensors"))
    shutil.copytree(Path(sdjax.EMBEDDED_MODEL) / "vae", root / "VAE" / "shift")
    weights = root / "VAE" / "shift" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state["decoder.conv_out.bias"] = state["decoder.conv_out.bias"] + 0.2
    save_file(state, str(weights))
    return root


def pixels(b64: str) -> tuple[np.ndarray, str]:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return np.asarray(im.convert("RGB")), im.info["parameters"]


def close(got: np.ndarray, want) -> bool:
    return int(np.abs(got.astype(np.int16) - np.asarray(want, np.int16)).max()) <= 1


def as_the_server_calls(*args, **kwargs) -> None:
    """A progress callback that takes the latents, as the server's does: the library's calls below run the
    server's compiled program, not a second one without host callbacks."""


def test_model_settings_and_networks_per_request(models):
    pipe = cli.load_pipeline(None, "float32")  # the embedded model: 2 text-encoder layers, width 64
    calls = []
    generate_arrays = pipe.generate_arrays

    def recording(*args, **kwargs):
        calls.append((len(args[0]), kwargs.get("clip_skip"), kwargs.get("params") is not None))
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
        inky = {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": None, "shape": 64, "vectors": 2}
        assert body["loaded"] == {"inky": inky}
        assert list(body["skipped"]) == ["sdxl-ish"] and body["skipped"]["sdxl-ish"]["shape"] == 32

        def post(i):
            out[i] = c.post(A1111, json=requests[i])

        threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        s.app.state.batcher.window_s = 0.0
        tagged = c.post(A1111, json={"prompt": "a red circle <lora:fc:0.8>", "seed": 6, "steps": STEPS,
                                     "override_settings": {"sd_vae": "shift"}})  # fmt: skip
        with counting_compiles() as compiles:
            # A1111's <lora:name:te:unet>: this LoRA touches only the text encoder, so only its 0.3 counts
            reweighted = c.post(A1111, json={"prompt": "a red circle <lora:fc:0.3:2>", "seed": 6, "steps": STEPS})
    pipe.generate_arrays = generate_arrays

    # CLIP skip: one batch holds both values
    assert sorted(calls[0][1]) == [1, 2] and calls[0][0] == 2, calls
    (skipped, text), (plain, plain_text) = (pixels(r.json()["images"][0]) for r in out)
    assert "Clip skip: 2" in text and "Clip skip" not in plain_text
    assert json.loads(out[0].json()["info"])["clip_skip"] == 2
    assert metadata.parameters_from_text(text).clip_skip == 2
    # A1111's "TI hashes": the embeddings the prompt uses, by the SHA-256 of their files
    ti = hashlib.sha256((models / "embeddings" / "inky.safetensors").read_bytes()).hexdigest()[:12]
    assert f'TI hashes: "inky: {ti}"' in text and "TI hashes" not in plain_text
    assert metadata.parameters_from_text(text).ti_hashes == f"inky: {ti}"
    assert close(
        skipped, pipe.generate("an inky cat", seed=4, steps=STEPS, clip_skip=2, progress=as_the_server_calls)[0]
    )
    assert close(plain, pipe.generate("a red circle", seed=5, steps=STEPS, progress=as_the_server_calls)[0])
    # the embedding is a word of the prompt (its own token ids), and CLIP skip changes the image
    assert pipe.text_encoder.config.vocab_size == 49408 + 2
    assert list(pipe.tokenizer(["inky"])[0][1:3]) == [49408, 49409]
    assert not close(skipped, pipe.generate("an inky cat", seed=4, steps=STEPS, progress=as_the_server_calls)[0])

    # <lora:...> and sd_vae: params of their own for that batch, the program unchanged
    assert [c[2] for c in calls[1:]] == [True, True] and compiles == [], (calls, compiles)
    got, text = pixels(tagged.json()["images"][0])
    assert text.startswith("a red circle <lora:fc:0.8>\n") and "VAE: shift" in text
    data = (models / "Lora" / "fc.safetensors").read_bytes()
    addnet = hashlib.sha256(data[8 + int.from_bytes(data[:8], "little") :]).hexdigest()[:12]
    assert f'Lora hashes: "fc: {addnet}"' in text
    assert json.loads(tagged.json()["info"])["sd_vae_name"] == "shift"
    from sdjax.pipelines import load_pipeline

    ref, _ = load_pipeline(sdjax.EMBEDDED_MODEL, vae=str(models / "VAE" / "shift"))
    ref.load_lora(models / "Lora" / "fc.safetensors", scale=0.8)
    want = ref.generate("a red circle", seed=6, steps=STEPS, progress=as_the_server_calls)[0]
    assert close(got, want)
    # the LoRA and VAE matter
    assert not close(got, pipe.generate("a red circle", seed=6, steps=STEPS, progress=as_the_server_calls)[0])
    pipe.load_lora(models / "Lora" / "fc.safetensors", scale=0.3)
    assert close(
        pixels(reweighted.json()["images"][0])[0],
        pipe.generate("a red circle", seed=6, steps=STEPS, progress=as_the_server_calls)[0],
    )
