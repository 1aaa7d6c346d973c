"""Image-to-image, inpainting and the hires fix over HTTP, on the tiny SD 1.x model: A1111's `/sdapi/v1/img2img`
and txt2img's `enable_hr` (through the real `webuiapi` client), OpenAI's `/v1/images/edits` and `/variations`
(through the real `openai` client). Each server image equals the same request run directly
(`metadata.generate_images`), and bad input gets a 422 naming the field, never a 500."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from server_helpers import client, live_server

from sdjax import cli, metadata
from sdjax.pipelines.recipes import Hires

STEPS = 3


@pytest.fixture(scope="module")
def pipe(sd1_dir):
    return cli.load_pipeline(str(sd1_dir), "float32")


@pytest.fixture(scope="module")
def server(pipe):
    with live_server(pipe, model_name="tiny", default_steps=STEPS, warm=False, max_batch=2) as s:
        yield s


def _picture(size=64, seed=0, mode="RGB"):
    a = np.random.default_rng(seed).integers(0, 255, (size // 8, size // 8, 3), np.uint8)
    im = Image.fromarray(a).resize((size, size), Image.NEAREST)
    return im.convert(mode)


def _mask(size=64):
    m = np.zeros((size, size), np.uint8)
    m[16:48, 8:40] = 255
    return Image.fromarray(m)


def _b64(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _pixels(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return np.asarray(im.convert("RGB"))


def _direct(pipe, **fields) -> np.ndarray:
    h, w = pipe.default_size
    request = metadata.GenerationRequest(
        **{
            "num_images": 1,
            "steps": STEPS,
            "width": w,
            "height": h,
            "sampler": pipe.default_sampler,
            "model": "tiny",
            **fields,
        }
    )
    # The server reports progress with previews, a program variant of its own: run the same one.
    return metadata.generate_images(pipe, request.images(), progress=lambda *args, **kwargs: None)[0]


def test_webuiapi_img2img_and_inpainting(server, pipe):
    import webuiapi

    host, port = server.url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), steps=STEPS, sampler=None)
    image = _picture()
    r = api.img2img(images=[image], prompt="a cat", seed=4, denoising_strength=0.6, steps=STEPS, width=64, height=64)
    got = np.asarray(r.image.convert("RGB"))
    # webuiapi sends cfg_scale 7.0 by default
    expected = _direct(pipe, prompt="a cat", seed=4, init_image=image, denoising_strength=0.6, guidance_scale=7.0)
    np.testing.assert_array_equal(got, expected)
    assert json.loads(r.json["info"])["infotexts"][0].count("Denoising strength: 0.6") == 1
    # webuiapi's inpainting defaults: inpainting_fill=0 (fill), inpaint_full_res=True with padding 0, mask_blur=4
    r = api.img2img(
        images=[image],
        mask_image=_mask(),
        prompt="a dog",
        seed=5,
        denoising_strength=0.8,
        steps=STEPS,
        width=64,
        height=64,
    )
    expected = _direct(
        pipe,
        prompt="a dog",
        seed=5,
        init_image=image,
        mask_image=_mask(),
        denoising_strength=0.8,
        mask_blur=4.0,
        inpaint_full_res_padding=0,
        inpainting_fill="fill",
        guidance_scale=7.0,
    )
    np.testing.assert_array_equal(np.asarray(r.image.convert("RGB")), expected)


def test_txt2img_hires_fix(server, pipe):
    with client(server.url, timeout=120) as c:
        r = c.post(
            "/sdapi/v1/txt2img",
            json={
                "prompt": "a boat",
                "seed": 2,
                "steps": STEPS,
                "width": 32,
                "height": 32,
                "enable_hr": True,
                "hr_scale": 2,
                "hr_upscaler": "Latent",
                "hr_second_pass_steps": 2,
                "denoising_strength": 0.5,
            },
        )
    assert r.status_code == 200, r.text
    got = _pixels(r.json()["images"][0])
    assert got.shape == (64, 64, 3)
    hires = Hires(scale=2, upscaler="latent", steps=2, strength=0.5)
    np.testing.assert_array_equal(got, _direct(pipe, prompt="a boat", seed=2, width=32, height=32, hires=hires))
    assert "Hires upscaler: Latent" in json.loads(r.json()["info"])["infotexts"][0]


def test_openai_edits_and_variations(server, pipe):
    import openai

    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    rgba = _picture(mode="RGBA")
    alpha = np.full((64, 64), 255, np.uint8)
    alpha[16:48, 8:40] = 0  # transparent: repaint
    rgba.putalpha(Image.fromarray(alpha))
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    out = api.images.edit(
        image=("in.png", buf.getvalue(), "image/png"), prompt="a red hat", n=1, extra_body={"seed": 6, "steps": STEPS}
    )
    got = _pixels(out.data[0].b64_json)
    mask = Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8))
    expected = _direct(
        pipe,
        prompt="a red hat",
        seed=6,
        init_image=rgba.convert("RGB"),
        mask_image=mask,
        denoising_strength=1.0,
        mask_blur=0.0,
    )
    np.testing.assert_array_equal(got, expected)
    keep = alpha == 255
    np.testing.assert_array_equal(got[keep], np.asarray(rgba.convert("RGB"))[keep])  # pasted back
    var = api.images.create_variation(image=("in.png", buf.getvalue(), "image/png"), n=2, extra_body={"seed": 1})
    assert len(var.data) == 2 and _pixels(var.data[0].b64_json).shape == (64, 64, 3)


@pytest.mark.parametrize(
    "payload,field",
    [
        ({"init_images": ["not base64!"]}, "init_images[0]"),
        ({"init_images": [base64.b64encode(b"hello").decode()]}, "init_images[0]"),
        ({"init_images": ["IMG"], "mask": "SMALL"}, "mask"),
        ({"init_images": ["IMG"], "denoising_strength": 1.5}, "denoising_strength"),
        ({"init_images": ["IMG"], "resize_mode": 3}, "resize_mode"),
        ({"init_images": ["IMG"], "mask": "BLACK"}, "mask"),
    ],
)
def test_bad_img2img_input_is_named(server, payload, field):
    subst = {"IMG": _b64(_picture()), "SMALL": _b64(_mask(32)), "BLACK": _b64(Image.new("L", (64, 64)))}
    body = {
        "prompt": "x",
        "steps": STEPS,
        **{k: ([subst.get(x, x) for x in v] if isinstance(v, list) else subst.get(v, v)) for k, v in payload.items()},
    }
    with client(server.url) as c:
        r = c.post("/sdapi/v1/img2img", json=body)
    assert r.status_code == 422, r.text
    assert field in json.dumps(r.json()), r.text


def test_bad_hires_and_edit_input_is_named(server):
    with client(server.url) as c:
        r = c.post("/sdapi/v1/txt2img", json={"prompt": "x", "enable_hr": True, "hr_upscaler": "ESRGAN_4x"})
        assert r.status_code == 422 and "hr_upscaler" in r.text
        opaque = io.BytesIO()
        _picture().save(opaque, format="PNG")
        r = c.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", opaque.getvalue())})
        assert r.status_code == 422 and "alpha" in r.json()["error"]["message"], r.text
        r = c.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", b"not an image")})
        assert r.status_code == 422 and r.json()["error"]["param"] == "image", r.text


def test_pinned_server_compiles_nothing_for_guidance_below_one(pipe):
    """`--pin` warms both programs (guidance above 1, and at most 1 where the unconditional half is skipped), and
    `max_programs` bounds the cache; /metrics reports it."""
    with live_server(pipe, model_name="tiny", default_steps=STEPS, pin=True, max_batch=1, max_programs=4) as s:
        cache = pipe.generator.cache
        assert cache.max_entries == 4
        before = cache.stats.compiles
        with client(s.url, timeout=120) as c:
            for g in (7.5, 1.0, 0.0):
                r = c.post("/sdapi/v1/txt2img", json={"prompt": "x", "steps": STEPS, "cfg_scale": g, "seed": 1})
                assert r.status_code == 200, r.text
            text = c.get("/metrics").text
        assert cache.stats.compiles == before  # no request compiled
        assert 'sdjax_program_cache{event="compiles"}' in text and "sdjax_compiled_programs" in text
