"""The server serving a (tiny) Flux.1 dev model: a request that leaves the guidance out gets Flux's defaults (CFG
scale 1, i.e. no true CFG, and distilled guidance 3.5, as Forge has them), start-up compiles the program such a
request runs, and the image equals the library's with the same settings."""

from __future__ import annotations

import flux_reference
import numpy as np
import pytest
import t5_reference
from compile_counter import counting_compiles
from server_helpers import client, decode_png, live_server

from sdjax import cli, metadata

STEPS = 2


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("flux") / "flux-dev"
    flux_reference.flux_pipeline("dev", tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    # On all 8 simulated devices: the progress previews once deadlocked such a program (core/loop.py).
    return cli.load_pipeline(str(folder), "float32")


def test_a1111_txt2img_gets_flux_defaults_and_the_library_image(flux_dev):
    h, w = flux_dev.default_size
    with (
        counting_compiles() as compiles,
        live_server(flux_dev, model_name="flux-tiny", default_steps=STEPS, max_batch=1) as server,
    ):
        warm = len(compiles)
        assert warm > 0
        with client(server.url, timeout=300) as http:
            config = http.get("/v1/config").json()
            r = http.post("/sdapi/v1/txt2img", json={"prompt": "a red fox", "seed": 3})
            assert r.status_code == 200, r.text
            forge = {"prompt": "a red fox", "seed": 3, "distilled_cfg_scale": 5.0}
            r5 = http.post("/sdapi/v1/txt2img", json=forge)
            assert r5.status_code == 200, r5.text
        assert len(compiles) == warm, f"{len(compiles) - warm} compilations while serving"
    assert config["default_guidance_scale"] == 1.0
    pixels, text = decode_png(r.json()["images"][0])
    raw = metadata.parse_parameters(text)
    assert float(raw["CFG scale"]) == 1.0
    assert float(raw["Distilled CFG Scale"]) == flux_dev.distilled_guidance_scale == 3.5
    expected = metadata.generate_images(
        flux_dev,
        metadata.GenerationRequest(
            "a red fox", seed=3, steps=STEPS, guidance_scale=1.0, width=w, height=h, sampler=config["default_sampler"]
        ).images(),
    )[0]
    # The server's program also hands the latents to its progress previews, the library's does not: on 8 devices
    # the two compile differently and a pixel may round the other way (a wrong default moves them by far more).
    np.testing.assert_allclose(pixels, expected, atol=1)
    # Forge's field: the distilled guidance of the request, written back and run
    pixels5, text5 = decode_png(r5.json()["images"][0])
    assert float(metadata.parse_parameters(text5)["Distilled CFG Scale"]) == 5.0
    expected5 = metadata.generate_images(
        flux_dev,
        metadata.GenerationRequest(
            "a red fox", seed=3, steps=STEPS, guidance_scale=1.0, width=w, height=h,
            sampler=config["default_sampler"], distilled_guidance=5.0,
        ).images(),
    )[0]  # fmt: skip
    np.testing.assert_allclose(pixels5, expected5, atol=1)
    assert np.abs(pixels5.astype(int) - pixels.astype(int)).max() > 1  # the guidance reached the model


def test_distilled_cfg_scale_on_a_model_without_it_is_a_422():
    from server_helpers import live_server as fake_server

    with fake_server() as server, client(server.url) as http:
        r = http.post("/sdapi/v1/txt2img", json={"prompt": "a cat", "distilled_cfg_scale": 3.5})
    assert r.status_code == 422, r.text
    assert "distilled_cfg_scale" in r.text
