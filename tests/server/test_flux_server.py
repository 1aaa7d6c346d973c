"""The server serving a (tiny) Flux.1 dev model: a request that leaves the guidance out gets Flux's defaults (CFG
scale 1, i.e. no true CFG, and distilled guidance 3.5, as Forge has them), start-up compiles the program such a
request runs, and the image equals the library's with the same settings; a `<lora:name:w>` tag loads a Flux LoRA
of the models directory's `Lora/` (it failed on every Flux model: the server called the SD reader)."""

from __future__ import annotations

import flux_reference
import jax
import numpy as np
import pytest
import t5_reference
from compile_counter import counting_compiles
from server_helpers import client, decode_png, live_server

from sdjax import cli, infotext, metadata

STEPS = 2


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("flux") / "flux-dev"
    flux_reference.flux_pipeline("dev", tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    pipe = cli.load_pipeline(str(folder), "float32")
    # One device, as a user's CPU: on the suite's 8 simulated devices this test takes about 6 minutes on 2 cores
    # (it did hang there until core/loop.py handed previews over in pieces; tests/core/test_generator.py covers that).
    pipe.devices = jax.devices()[:1]
    return pipe


@pytest.fixture(scope="module")
def models_dir(flux_dev, tmp_path_factory):
    """A models directory whose Lora/ holds a PEFT Flux LoRA on the first double block's attention."""
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("models")
    (root / "Stable-diffusion").mkdir()  # what makes a folder an A1111 models directory
    (root / "Lora").mkdir()
    rng = np.random.default_rng(4)
    tensors = {}
    for proj in ("to_q", "to_k", "to_v"):
        inn, out = flux_dev.params["transformer"]["transformer_blocks_0"]["attn"][proj]["kernel"].shape
        key = f"transformer.transformer_blocks.0.attn.{proj}"
        tensors[f"{key}.lora_A.weight"] = rng.standard_normal((4, inn)).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = rng.standard_normal((out, 4)).astype(np.float32) * 0.5
    save_file(tensors, str(root / "Lora" / "fx.safetensors"))
    return root


def as_the_server_calls(*args, **kwargs) -> None:
    """A progress callback that takes the latents, as the server's does (the same compiled program)."""


def test_a1111_txt2img_gets_flux_defaults_and_the_library_image(flux_dev, models_dir):
    h, w = flux_dev.default_size
    serve = dict(model_name="flux-tiny", default_steps=STEPS, max_batch=1, models_dir=str(models_dir))
    with counting_compiles() as compiles, live_server(flux_dev, **serve) as server:
        warm = len(compiles)  # (none when another pipeline of the model in this process compiled them:
        assert len(flux_dev.generator.cache) > 0  # the warm-up's programs are shared, `core.cache.compile_shared`)
        with client(server.url, timeout=300) as http:
            config = http.get("/v1/config").json()
            r = http.post("/sdapi/v1/txt2img", json={"prompt": "a red fox", "seed": 3})
            assert r.status_code == 200, r.text
            forge = {"prompt": "a red fox", "seed": 3, "distilled_cfg_scale": 5.0}
            r5 = http.post("/sdapi/v1/txt2img", json=forge)
            assert r5.status_code == 200, r5.text
            assert len(compiles) == warm, f"{len(compiles) - warm} compilations while serving"
            # (a LoRA tag fuses the LoRA into a copy of the params: a small program per kernel shape compiles once)
            tagged = http.post("/sdapi/v1/txt2img", json={"prompt": "a red fox <lora:fx:0.8>", "seed": 3})
            assert tagged.status_code == 200, tagged.text
    assert config["default_guidance_scale"] == 1.0
    pixels, text = decode_png(r.json()["images"][0])
    raw = infotext.parse_parameters(text)
    assert float(raw["CFG scale"]) == 1.0
    assert float(raw["Distilled CFG Scale"]) == flux_dev.distilled_guidance_scale == 3.5
    # The library's calls take a progress callback that takes the latents, as the server's does: they run the
    # server's compiled program (without one the library compiles a second program, whose pixels may round the
    # other way by 1; a wrong default moves them by far more).
    expected = metadata.generate_images(
        flux_dev,
        metadata.GenerationRequest(
            "a red fox", seed=3, steps=STEPS, guidance_scale=1.0, width=w, height=h, sampler=config["default_sampler"]
        ).images(),
        progress=as_the_server_calls,
    )[0]
    np.testing.assert_allclose(pixels, expected, atol=1)
    # Forge's field: the distilled guidance of the request, written back and run
    pixels5, text5 = decode_png(r5.json()["images"][0])
    assert float(infotext.parse_parameters(text5)["Distilled CFG Scale"]) == 5.0
    expected5 = metadata.generate_images(
        flux_dev,
        metadata.GenerationRequest(
            "a red fox", seed=3, steps=STEPS, guidance_scale=1.0, width=w, height=h,
            sampler=config["default_sampler"], distilled_guidance=5.0,
        ).images(),
        progress=as_the_server_calls,
    )[0]  # fmt: skip
    np.testing.assert_allclose(pixels5, expected5, atol=1)
    assert np.abs(pixels5.astype(int) - pixels.astype(int)).max() > 1  # the guidance reached the model
    # the tag: the LoRA loaded by the Python API at the same weight gives the same image, and it changes the image
    flux_dev.load_lora(models_dir / "Lora" / "fx.safetensors", scale=0.8)
    try:
        with_lora = metadata.generate_images(
            flux_dev,
            metadata.GenerationRequest(
                "a red fox", seed=3, steps=STEPS, guidance_scale=1.0, width=w, height=h,
                sampler=config["default_sampler"],
            ).images(),
            progress=as_the_server_calls,
        )[0]  # fmt: skip
    finally:
        flux_dev.unload_loras()
    tagged_pixels, tagged_text = decode_png(tagged.json()["images"][0])
    np.testing.assert_allclose(tagged_pixels, with_lora, atol=1)
    assert np.abs(tagged_pixels.astype(int) - pixels.astype(int)).max() > 1
    assert "Lora hashes" in tagged_text


def test_distilled_cfg_scale_on_a_model_without_it_is_a_422():
    from server_helpers import live_server as fake_server

    with fake_server() as server, client(server.url) as http:
        r = http.post("/sdapi/v1/txt2img", json={"prompt": "a cat", "distilled_cfg_scale": 3.5})
    assert r.status_code == 422, r.text
    assert "distilled_cfg_scale" in r.text
