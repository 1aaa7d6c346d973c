"""The server serving a (tiny) SD 3 model: a request that leaves the guidance out gets the family's defaults (CFG 7,
as `StableDiffusion3Pipeline`), start-up compiles what such a request runs, the A1111 and OpenAI endpoints give the
library's image for the same settings, and the infotext says what ran."""

from __future__ import annotations

import numpy as np
import pytest
import sd3_reference
import t5_reference
from compile_counter import counting_compiles
from server_helpers import client, decode_png, live_server

from sdjax import cli, infotext, metadata
from sdjax.families import FAMILIES

STEPS = 2


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("sd3") / "sd3-tiny"
    sd3_reference.sd3_pipeline(tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    return cli.load_pipeline(str(folder), "float32")


def _library(pipe, prompt: str, negative: str, seed: int, sampler: str, guidance: float) -> np.ndarray:
    h, w = pipe.default_size
    request = metadata.GenerationRequest(
        prompt, negative_prompt=negative, seed=seed, steps=STEPS, guidance_scale=guidance, width=w, height=h,
        sampler=sampler,
    )  # fmt: skip
    return metadata.generate_images(pipe, request.images())[0]


def test_a1111_and_openai_give_the_library_image_with_sd3_defaults(sd3):
    h, w = sd3.default_size
    with (
        counting_compiles() as compiles,
        live_server(sd3, model_name="sd3-tiny", default_steps=STEPS, max_batch=1) as server,
    ):
        warm = len(compiles)  # (none when another pipeline of the model in this process compiled them:
        assert len(sd3.generator.cache) > 0  # the warm-up's programs are shared, `core.cache.compile_shared`)
        with client(server.url, timeout=300) as http:
            config = http.get("/v1/config").json()
            body = {"prompt": "a red fox", "negative_prompt": "blurry", "seed": 3}
            r = http.post("/sdapi/v1/txt2img", json=body)
            assert r.status_code == 200, r.text
            o = http.post("/v1/images/generations", json={"prompt": "a red fox", "size": f"{w}x{h}", "seed": 3})
            assert o.status_code == 200, o.text
        assert len(compiles) == warm, f"{len(compiles) - warm} compilations while serving"
    assert config["default_guidance_scale"] == 7.0 == FAMILIES["sd3"].defaults.guidance_scale
    pixels, text = decode_png(r.json()["images"][0])
    raw = infotext.parse_parameters(text)
    assert float(raw["CFG scale"]) == 7.0 and raw["Sampler"] and int(raw["Steps"]) == STEPS
    assert raw["Negative prompt"] == "blurry"
    sampler = config["default_sampler"]
    # (the server's program also feeds its progress previews: a pixel may round the other way, as for Flux)
    np.testing.assert_allclose(pixels, _library(sd3, "a red fox", "blurry", 3, sampler, 7.0), atol=1)
    openai_pixels, _ = decode_png(o.json()["data"][0]["b64_json"])
    np.testing.assert_allclose(openai_pixels, _library(sd3, "a red fox", "", 3, sampler, 7.0), atol=1)
    assert np.abs(openai_pixels.astype(int) - pixels.astype(int)).max() > 1  # the negative prompt reached the model
