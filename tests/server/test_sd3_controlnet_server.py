"""SD 3 / 3.5 ControlNets on the server (FastAPI's TestClient): a tiny SD 3 model served with a `--controlnet-dir` that
holds a tiny random diffusers `SD3ControlNetModel` folder (the parity tests' InstantX-like net) and an SD 1.x
`ControlNetModel` folder (`controlnet_cases.torch_controlnet`). The ComfyUI helpers are the ComfyUI tests' own.

- An A1111 `alwayson_scripts.controlnet` unit and ComfyUI's ControlNetLoader + ControlNetApplyAdvanced give the
  Python API's image (`pipe.generate(controlnet=FOLDER, control_image=MAP, ...)`) for the same seed, steps, CFG
  scale, sampler, net weight and guidance window; both faces run the one compiled program the Python API runs.
- What the library refuses is refused before anything is queued, naming the unit (422) or the node (ComfyUI's
  node_errors): an SD 1.x net on the SD 3 model and the SD 3 net on an SD 1.x model (the net's family), an SD 3 net
  with an init image (SD 3 ControlNets are text-to-image only) and an output larger than the net's position table.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import sd3_reference
import t5_reference
from controlnet_cases import one_torch_thread, torch_controlnet
from PIL import Image
from sd3_controlnet_builders import NETS, pipeline_net
from test_comfy_families import refused, run
from test_comfy_real import upload
from test_server_errors import assert_error

from sdjax import cli, infotext

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

A1111 = "/sdapi/v1/txt2img"
STEPS = 4
SIZE = 32  # the net's position table (pos_embed_max_size 12, patch 2, VAE factor 2) covers at most 48 pixels
# the net acts at steps 1 and 2 of 4 (diffusers' `controlnet_keep`), so the window is tested too
SETTINGS = dict(prompt="a house", negative="blurry", seed=5, cfg=5.0, weight=0.7, start=0.25, end=0.75)


def _quiet(*args, **kwargs):
    """A progress callback taking the latents, as the server's: the same compiled program variant."""


def _app(pipe, model_name: str, nets: Path):
    from sdjax.server import ServerConfig, build_asgi

    config = ServerConfig(model_name=model_name, warm=False, max_batch=1, controlnet_dir=str(nets))
    return build_asgi(pipe, config)


@pytest.fixture(scope="module")
def nets(tmp_path_factory, torch_sd1):
    """`sd3_canny`: an SD 3 net that fits the tiny SD 3 transformer; `sd15_canny`: a net of the tiny SD 1.x UNet."""
    root = tmp_path_factory.mktemp("controlnets")
    with one_torch_thread():
        net = pipeline_net(NETS["instantx"], 20)
        net.save_pretrained(root / "sd3_canny", safe_serialization=True)
        torch_controlnet(torch_sd1.unet, 11).save_pretrained(root / "sd15_canny", safe_serialization=True)
    return root


@pytest.fixture(scope="module")
def sd3(tmp_path_factory, nets):
    import jax
    from fastapi.testclient import TestClient

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("models") / "sd3-tiny"
    with one_torch_thread():
        sd3_reference.sd3_pipeline(tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    pipe = cli.load_pipeline(str(folder), "float32")
    pipe.devices = jax.devices()[:1]  # one device, as the ComfyUI family tests
    with TestClient(_app(pipe, "sd3-tiny", nets)) as c:
        yield pipe, c


@pytest.fixture(scope="module")
def control_map():
    """A random black-and-white map, 40x36 (the faces and the library resize it to the output size)."""
    return ((np.random.default_rng(4).random((36, 40, 3)) > 0.5) * 255).astype(np.uint8)


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _library(pipe, nets: Path, control_map, *, with_net: bool = True) -> np.ndarray:
    s = SETTINGS
    control = (
        dict(
            controlnet=str(nets / "sd3_canny"),
            control_image=control_map,
            controlnet_conditioning_scale=s["weight"],
            control_guidance_start=s["start"],
            control_guidance_end=s["end"],
        )
        if with_net
        else {}
    )
    images = pipe.generate(
        s["prompt"], negative_prompt=s["negative"], seed=s["seed"], steps=STEPS, guidance_scale=s["cfg"],
        height=SIZE, width=SIZE, sampler="Euler Simple", progress=_quiet, **control,
    )  # fmt: skip
    return np.asarray(images[0], np.int16)


def _a1111_body(b64: str, size: int = SIZE, **unit) -> dict:
    s = SETTINGS
    unit = {"image": b64, "model": "sd3_canny", "weight": s["weight"], "guidance_start": s["start"],
            "guidance_end": s["end"], **unit}  # fmt: skip
    return {
        "prompt": s["prompt"], "negative_prompt": s["negative"], "seed": s["seed"], "steps": STEPS,
        "cfg_scale": s["cfg"], "width": size, "height": size, "sampler_name": "Euler", "scheduler": "Simple",
        "alwayson_scripts": {"controlnet": {"args": [unit]}},
    }  # fmt: skip


def _decoded(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), np.int16)


def test_a1111_unit_gives_the_python_api_image(sd3, nets, control_map):
    pipe, c = sd3
    assert c.get("/controlnet/model_list").json() == {"model_list": ["sd15_canny", "sd3_canny"]}
    b64 = base64.b64encode(_png(control_map)).decode()
    r = c.post(A1111, json=_a1111_body(b64))
    assert r.status_code == 200, r.text
    (text,) = json.loads(r.json()["info"])["infotexts"]
    unit = "Module: none, Model: sd3_canny, Weight: 0.7, Guidance Start: 0.25, Guidance End: 0.75"
    assert f'ControlNet 0: "{unit}"' in text
    assert infotext.parse_parameters(text)["Sampler"] == "Euler"
    got, want = _decoded(r.json()["images"][0]), _library(pipe, nets, control_map)
    assert np.abs(got - want).max() <= 1
    plain = _library(pipe, nets, control_map, with_net=False)
    assert np.abs(want - plain).max() > 10  # the net moved the image: the comparison above is about it


# ------------------------------------------------------------------------------------------------ ComfyUI
def _workflow(image: str, net: str = "sd3_canny", ckpt: str = "sd3-tiny", size: int = SIZE) -> dict:
    """An SD 3 ControlNet workflow in API format: the checkpoint's parts, both prompts through one
    ControlNetApplyAdvanced, euler + simple (sdjax's "Euler Simple")."""
    s = SETTINGS
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": s["prompt"], "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": s["negative"], "clip": ["4", 1]}},
        "14": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": net}},
        "12": {"class_type": "LoadImage", "inputs": {"image": image}},
        "15": {"class_type": "ControlNetApplyAdvanced",
               "inputs": {"positive": ["6", 0], "negative": ["7", 0], "control_net": ["14", 0], "image": ["12", 0],
                          "strength": s["weight"], "start_percent": s["start"], "end_percent": s["end"]}},
        "3": {"class_type": "KSampler",
              "inputs": {"seed": s["seed"], "steps": STEPS, "cfg": s["cfg"], "sampler_name": "euler",
                         "scheduler": "simple", "denoise": 1.0, "model": ["4", 0], "positive": ["15", 0],
                         "negative": ["15", 1], "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "cn", "images": ["8", 0]}},
    }  # fmt: skip


def test_comfy_controlnet_gives_the_python_api_image(sd3, nets, control_map):
    pipe, c = sd3
    info = c.get("/object_info/ControlNetLoader").json()["ControlNetLoader"]["input"]["required"]
    assert "sd3_canny" in info["control_net_name"][0]
    got = run(c, _workflow(upload(c, "sd3-hint.png", Image.fromarray(control_map)))).astype(np.int16)
    assert np.abs(got - _library(pipe, nets, control_map)).max() <= 1


# ------------------------------------------------------------------------------------------------ refusals
def test_a1111_refuses_what_the_sd3_net_cannot_run(sd3, control_map):
    pipe, c = sd3
    before = pipe.generator.cache.stats.compiles
    b64 = base64.b64encode(_png(control_map)).decode()
    field = "alwayson_scripts.controlnet.args[0].model"
    message = assert_error(c.post(A1111, json=_a1111_body(b64, model="sd15_canny")), 422, field, "sd15_canny")
    assert "Stable Diffusion 3 / 3.5" in message["message"] and "ControlNetModel" in message["message"]
    # a disabled unit first: the error names the enabled unit's own index
    body = _a1111_body(b64, model="sd15_canny")
    body["alwayson_scripts"]["controlnet"]["args"].insert(0, {"enabled": False, "model": "sd3_canny"})
    assert_error(c.post(A1111, json=body), 422, "alwayson_scripts.controlnet.args[1].model", "sd15_canny")
    img2img = {**_a1111_body(b64), "init_images": [b64], "denoising_strength": 0.5}
    assert_error(c.post("/sdapi/v1/img2img", json=img2img), 422, field, "text-to-image only")
    assert_error(c.post(A1111, json=_a1111_body(b64, size=64)), 422, field, "pos_embed_max_size=12")
    assert pipe.generator.cache.stats.compiles == before  # refused before anything ran


def test_comfy_refuses_what_the_sd3_net_cannot_run(sd3, control_map):
    pipe, c = sd3
    before = pipe.generator.cache.stats.compiles
    image = upload(c, "sd3-refused.png", Image.fromarray(control_map))
    refused(c, _workflow(image, net="sd15_canny"), "15", "control_net", "ControlNetModel", "Stable Diffusion 3 / 3.5")
    refused(c, _workflow(image, size=64), "3", "positive", "pos_embed_max_size=12", "sd3_canny")
    img2img = _workflow(image)
    img2img["13"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["12", 0], "vae": ["4", 2]}}
    img2img["3"]["inputs"].update(latent_image=["13", 0], denoise=0.5)
    refused(c, img2img, "3", "positive", "text-to-image only")
    assert pipe.generator.cache.stats.compiles == before


def test_sd3_net_is_refused_by_an_sd_model(sd1_dir, nets, control_map):
    """The SD 3 net named on a server serving SD 1.x: 422 naming the unit, a node error naming the apply node."""
    from fastapi.testclient import TestClient

    pipe = cli.load_pipeline(str(sd1_dir), "float32")
    with TestClient(_app(pipe, "tiny", nets)) as c:
        b64 = base64.b64encode(_png(control_map)).decode()
        body = {**_a1111_body(b64, size=64), "sampler_name": "DDIM", "scheduler": "Automatic"}
        error = assert_error(c.post(A1111, json=body), 422, "alwayson_scripts.controlnet.args[0].model", "sd3_canny")
        assert "SD3ControlNetModel (a Stable Diffusion 3 / 3.5 ControlNet)" in error["message"]
        workflow = _workflow(upload(c, "sd-refused.png", Image.fromarray(control_map)), ckpt="tiny", size=64)
        workflow["5"]["class_type"] = "EmptyLatentImage"
        refused(c, workflow, "15", "control_net", "SD3ControlNetModel (a Stable Diffusion 3 / 3.5 ControlNet)")
