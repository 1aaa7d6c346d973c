"""ComfyUI workflows on the embedded model: txt2img (with CLIPSetLastLayer and a LoRA), img2img, inpainting with
VAEEncodeForInpaint and ControlNet. Each image equals the Python API's (`pipe.generate`) for ComfyUI's meaning of
the workflow's settings, written independently of the planner:

- KSampler `steps` s with `denoise` d on an image: ComfyUI runs the last s steps of an int(s / d)-step schedule,
  which is diffusers' rule with `steps=int(s / d)` and `strength=s / int(s / d)`;
- VAEEncodeForInpaint: the masked pixels are grey (0.5) before encoding; sdjax pastes the original back outside the
  mask (A1111's overlay; `paste_back=True`);
- LoraLoader: `strength_clip` weighs the LoRA's text-encoder layers, `strength_model` its UNet layers;
- CLIPSetLastLayer -N is clip skip N; ControlNetApplyAdvanced's strength / start / end are diffusers' scale and
  guidance window.
"""

from __future__ import annotations

import copy
import io
import time

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file
from server_helpers import client, live_server

import sdjax
from sdjax import cli

STEPS = 3


def _quiet(*args, **kwargs):
    """A progress callback as the server's (the same compiled program variant)."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy_models")
    (root / "Stable-diffusion").mkdir()
    (root / "Lora").mkdir()
    rng = np.random.default_rng(0)
    layer = "lora_te_text_model_encoder_layers_1_mlp_fc1"  # a text-encoder layer only: strength_clip counts
    lora = {
        f"{layer}.lora_down.weight": rng.standard_normal((4, 64)).astype(np.float32),
        f"{layer}.lora_up.weight": rng.standard_normal((256, 4)).astype(np.float32),
        f"{layer}.alpha": np.asarray(2.0, np.float32),
    }
    save_file(lora, str(root / "Lora" / "fc.safetensors"))
    return root


@pytest.fixture(scope="module")
def served(dirs):
    import jax

    pipe = cli.load_pipeline(None, "float32")
    # One device, as a user's CPU: with the suite's 8 simulated devices a loaded 2-core machine can miss XLA's 40 s
    # all-reduce rendezvous in the hires fix's second pass (the A1111 endpoint too) and abort the process.
    pipe.devices = jax.devices()[:1]
    config = dict(model_name="embedded", warm=False, max_batch=1, models_dir=str(dirs))
    with live_server(pipe, **config) as s, client(s.url, timeout=120) as c:
        yield pipe, s, c


def picture(seed=0) -> Image.Image:
    a = np.random.default_rng(seed).integers(0, 255, (8, 8, 3), np.uint8)
    return Image.fromarray(a).resize((64, 64), Image.NEAREST)


def upload(c, name: str, im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    r = c.post("/upload/image", files={"image": (name, buf.getvalue(), "image/png")}, data={"overwrite": "true"})
    assert r.status_code == 200, r.text
    return r.json()["name"]


def run(c, prompt: dict, output: str = "9") -> np.ndarray:
    r = c.post("/prompt", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    prompt_id = r.json()["prompt_id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        entry = c.get(f"/history/{prompt_id}").json().get(prompt_id)
        if entry:
            assert entry["status"]["status_str"] == "success", entry["status"]
            (image,) = entry["outputs"][output]["images"]
            with Image.open(io.BytesIO(c.get("/view", params=image).content)) as im:
                return np.asarray(im.convert("RGB"))
        time.sleep(0.05)
    raise AssertionError("the prompt did not finish")


def close(got, want, atol=2) -> None:
    diff = np.abs(np.asarray(got, np.int16) - np.asarray(want, np.int16)).max()
    assert diff <= atol, diff


def base(seed=5, cfg=7.0) -> dict:
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "embedded"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler",
              "inputs": {"seed": seed, "steps": STEPS, "cfg": cfg, "sampler_name": "euler", "scheduler": "normal",
                         "denoise": 1.0, "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                         "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "t", "images": ["8", 0]}},
    }  # fmt: skip


def generate(pipe, **kwargs) -> np.ndarray:
    settings = dict(negative_prompt="blurry", seed=5, steps=STEPS, guidance_scale=7.0, sampler="Euler Normal")
    return np.asarray(pipe.generate("a red circle", **{**settings, **kwargs}, progress=_quiet)[0])


def test_txt2img_clip_skip_and_lora(served, dirs):
    pipe, _, c = served
    info = c.get("/object_info/LoraLoader").json()["LoraLoader"]["input"]["required"]
    assert info["lora_name"][0] == ["fc.safetensors"]  # the models directory's Lora/, as ComfyUI lists its loras
    close(run(c, base()), generate(pipe))
    skip = base()
    skip["10"] = {"class_type": "CLIPSetLastLayer", "inputs": {"clip": ["4", 1], "stop_at_clip_layer": -2}}
    skip["6"]["inputs"]["clip"] = skip["7"]["inputs"]["clip"] = ["10", 0]
    close(run(c, skip), generate(pipe, clip_skip=2))
    lora = base()
    lora["11"] = {"class_type": "LoraLoader", "inputs": {"model": ["4", 0], "clip": ["4", 1],
                                                         "lora_name": "fc.safetensors", "strength_model": 0.5,
                                                         "strength_clip": 0.8}}  # fmt: skip
    lora["3"]["inputs"]["model"] = ["11", 0]
    lora["6"]["inputs"]["clip"] = lora["7"]["inputs"]["clip"] = ["11", 1]
    got = run(c, lora)
    from sdjax.pipelines import load_pipeline

    ref, _ = load_pipeline(sdjax.EMBEDDED_MODEL)
    ref.devices = pipe.devices
    ref.load_lora(dirs / "Lora" / "fc.safetensors", scale=0.8)
    close(got, generate(ref))
    assert np.abs(got.astype(int) - generate(pipe).astype(int)).max() > 5  # the LoRA matters
    bad = copy.deepcopy(lora)
    bad["11"]["inputs"]["lora_name"] = "nope.safetensors"
    r = c.post("/prompt", json={"prompt": bad})
    assert r.status_code == 400 and "nope" in r.json()["node_errors"]["11"]["errors"][0]["message"]


def test_img2img_and_inpaint(served):
    pipe, _, c = served
    init = picture(1)
    name = upload(c, "init.png", init)
    wf = base()
    wf["12"] = {"class_type": "LoadImage", "inputs": {"image": name}}
    wf["13"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["12", 0], "vae": ["4", 2]}}
    wf["3"]["inputs"].update(latent_image=["13", 0], denoise=0.6)
    total = int(STEPS / 0.6)
    close(run(c, wf), generate(pipe, image=init, steps=total, strength=STEPS / total))

    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 8:40] = 255
    rgba = init.convert("RGBA")
    rgba.putalpha(Image.fromarray(255 - mask))  # LoadImage's MASK is 1 - alpha
    masked = upload(c, "masked.png", rgba)
    inpaint = base()
    inpaint["12"] = {"class_type": "LoadImage", "inputs": {"image": masked}}
    inputs = {"pixels": ["12", 0], "vae": ["4", 2], "mask": ["12", 1], "grow_mask_by": 0}
    inpaint["13"] = {"class_type": "VAEEncodeForInpaint", "inputs": inputs}
    inpaint["3"]["inputs"].update(latent_image=["13", 0], denoise=0.75)
    grey = np.asarray(init).copy()
    grey[mask > 0] = 128
    total = int(STEPS / 0.75)
    want = generate(pipe, image=Image.fromarray(grey), mask_image=Image.fromarray(mask), steps=total,
                    strength=STEPS / total, paste_back=True)  # fmt: skip
    got = run(c, inpaint)
    close(got, want)
    np.testing.assert_array_equal(got[mask == 0], np.asarray(init)[mask == 0])  # pasted back outside the mask


def test_hires_fix_equals_the_a1111_request(served):
    """KSampler -> LatentUpscaleBy (bilinear) -> KSampler (steps, denoise) is A1111's hires fix with the "Latent"
    upscaler, `hr_second_pass_steps` and `denoising_strength`: the image of that /sdapi/v1/txt2img request."""
    pipe, _, c = served
    wf = base()
    wf["10"] = {"class_type": "LatentUpscaleBy",
                "inputs": {"samples": ["3", 0], "upscale_method": "bilinear", "scale_by": 2.0}}  # fmt: skip
    wf["11"] = {"class_type": "KSampler", "inputs": {**wf["3"]["inputs"], "latent_image": ["10", 0], "steps": 2,
                                                      "denoise": 0.5, "scheduler": "karras"}}  # fmt: skip
    wf["8"]["inputs"]["samples"] = ["11", 0]
    got = run(c, wf)
    assert got.shape == (128, 128, 3)
    body = {"prompt": "a red circle", "negative_prompt": "blurry", "seed": 5, "steps": STEPS, "cfg_scale": 7.0,
            "width": 64, "height": 64, "sampler_name": "Euler", "scheduler": "Normal", "enable_hr": True,
            "hr_scale": 2, "hr_upscaler": "Latent", "hr_second_pass_steps": 2, "denoising_strength": 0.5,
            "hr_sampler_name": "Euler Karras"}  # fmt: skip
    r = c.post("/sdapi/v1/txt2img", json=body)
    assert r.status_code == 200, r.text
    import base64

    with Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))) as im:
        close(got, np.asarray(im.convert("RGB")), atol=0)


@pytest.fixture(scope="module")
def sd1(sd1_dir, torch_sd1, tmp_path_factory):
    """The tiny SD 1.x model (its VAE downsamples 8x, as ControlNets need) with a ControlNet made from its UNet."""
    from controlnet_cases import torch_controlnet

    nets = tmp_path_factory.mktemp("comfy_controlnets")
    torch_controlnet(torch_sd1.unet, 11).save_pretrained(nets / "tiny_canny", safe_serialization=True)
    pipe = cli.load_pipeline(str(sd1_dir), "float32")
    server = live_server(pipe, model_name="tiny", warm=False, max_batch=1, controlnet_dir=str(nets))
    with server as s, client(s.url, timeout=120) as c:
        yield pipe, nets, c


def test_controlnet(sd1):
    pipe, nets, c = sd1
    hint = ((np.random.default_rng(4).random((64, 64, 3)) > 0.5) * 255).astype(np.uint8)
    name = upload(c, "hint.png", Image.fromarray(hint))
    wf = base()
    wf["4"]["inputs"]["ckpt_name"] = "tiny"
    wf["14"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": "tiny_canny"}}
    wf["12"] = {"class_type": "LoadImage", "inputs": {"image": name}}
    wf["15"] = {"class_type": "ControlNetApplyAdvanced",
                "inputs": {"positive": ["6", 0], "negative": ["7", 0], "control_net": ["14", 0], "image": ["12", 0],
                           "strength": 0.7, "start_percent": 0.0, "end_percent": 0.8}}  # fmt: skip
    wf["3"]["inputs"].update(positive=["15", 0], negative=["15", 1])
    got = run(c, wf)
    want = generate(pipe, controlnet=str(nets / "tiny_canny"), control_image=hint, controlnet_conditioning_scale=0.7,
                    control_guidance_end=0.8, height=64, width=64)  # fmt: skip
    close(got, want)
    assert np.abs(got.astype(int) - generate(pipe, height=64, width=64).astype(int)).max() > 5  # the net matters
    bad = copy.deepcopy(wf)
    bad["14"]["inputs"]["control_net_name"] = "nope"
    r = c.post("/prompt", json={"prompt": bad})
    assert r.status_code == 400 and "tiny_canny" in r.json()["node_errors"]["14"]["errors"][0]["message"]
