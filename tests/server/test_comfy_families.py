"""ComfyUI's own Flux.1 and SD 3.5 workflows on an sdjax server serving such a (tiny) model: the model's parts loaded
by UNETLoader, DualCLIPLoader / TripleCLIPLoader and VAELoader (`comfy.loaders`), EmptySD3LatentImage, FluxGuidance
and a KSampler, run over HTTP (POST /prompt, /history, /view). Each image equals the library's
(`metadata.generate_images`) for the settings the workflow names: ComfyUI's "euler" + "simple" is sdjax's "Euler
Simple", FluxGuidance is Flux dev's distilled guidance, KSampler's cfg the (true) CFG scale. Loaders that do not name
the served model's parts are refused before anything runs, in ComfyUI's error shape naming the node and input."""

from __future__ import annotations

import copy
import io
import time

import flux_reference
import numpy as np
import pytest
import sd3_reference
import t5_reference
from PIL import Image
from server_helpers import client, live_server

from sdjax import cli, metadata

STEPS = 2


def _quiet(*args, **kwargs):
    """A progress callback as the server's (the same compiled program variant)."""


def _saved(tmp_path_factory, name: str, make):
    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("models") / name
    make(tok).save_pretrained(folder, safe_serialization=True)
    return folder


def _served(folder):
    import jax

    pipe = cli.load_pipeline(str(folder), "float32")
    pipe.devices = jax.devices()[:1]  # one device, as test_comfy_real (and a user's CPU)
    return pipe


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    return _saved(tmp_path_factory, "flux1-dev", lambda tok: flux_reference.flux_pipeline("dev", tokenizer_dir=tok))


@pytest.fixture(scope="module")
def flux(flux_folder):
    pipe = _served(flux_folder)
    with live_server(pipe, model_name="flux1-dev", warm=False, max_batch=1) as s, client(s.url, timeout=300) as c:
        yield pipe, c


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    pipe = _served(_saved(tmp_path_factory, "sd3.5-tiny", lambda tok: sd3_reference.sd3_pipeline(tokenizer_dir=tok)))
    with live_server(pipe, model_name="sd3.5-tiny", warm=False, max_batch=1) as s, client(s.url, timeout=300) as c:
        yield pipe, c


def run(c, prompt: dict, output: str = "9") -> np.ndarray:
    """POST /prompt, poll /history, GET /view: the output's one image."""
    r = c.post("/prompt", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    prompt_id = r.json()["prompt_id"]
    deadline = time.monotonic() + 300  # the first prompt of a shape compiles (warm=False)
    while time.monotonic() < deadline:
        entry = c.get(f"/history/{prompt_id}").json().get(prompt_id)
        if entry:
            assert entry["status"]["status_str"] == "success", entry["status"]
            (image,) = entry["outputs"][output]["images"]
            with Image.open(io.BytesIO(c.get("/view", params=image).content)) as im:
                return np.asarray(im.convert("RGB"))
        time.sleep(0.05)
    raise AssertionError("the prompt did not finish")


def library(pipe, prompt: str, negative: str, *, seed: int, cfg: float, size: int, sampler: str, **kw) -> np.ndarray:
    request = metadata.GenerationRequest(prompt, negative_prompt=negative, seed=seed, steps=STEPS, guidance_scale=cfg,
                                         width=size, height=size, sampler=sampler, **kw)  # fmt: skip
    return metadata.generate_images(pipe, request.images(), progress=_quiet)[0]


def close(got, want, atol=1) -> int:
    diff = int(np.abs(np.asarray(got, np.int16) - np.asarray(want, np.int16)).max())
    assert diff <= atol, diff
    return diff


def refused(c, wf: dict, node: str, input_name: str, *words: str) -> dict:
    r = c.post("/prompt", json={"prompt": wf})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation", body
    (error,) = body["node_errors"][node]["errors"]
    assert body["node_errors"][node]["class_type"] == wf[node]["class_type"]
    assert error["extra_info"].get("input_name") == input_name, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def flux_workflow(seed=5, guidance=5.0, size=64) -> dict:
    """ComfyUI's flux_dev example (the KSampler variant) in API format: the model, its text encoders and its VAE
    loaded apart, FluxGuidance on the prompt, cfg 1 (no true CFG) with euler + simple."""
    return {
        "12": {"class_type": "UNETLoader", "inputs": {"unet_name": "flux1-dev.safetensors", "weight_dtype": "default"}},
        "11": {"class_type": "DualCLIPLoader",
               "inputs": {"clip_name1": "t5xxl_fp16.safetensors", "clip_name2": "clip_l.safetensors", "type": "flux"}},
        "10": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox in the snow", "clip": ["11", 0]}},
        "33": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["11", 0]}},
        "26": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["6", 0], "guidance": guidance}},
        "27": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "3": {"class_type": "KSampler",
              "inputs": {"seed": seed, "steps": STEPS, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                         "denoise": 1.0, "model": ["12", 0], "positive": ["26", 0], "negative": ["33", 0],
                         "latent_image": ["27", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["10", 0]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "flux", "images": ["8", 0]}},
    }  # fmt: skip


def test_flux_dev_workflow_gives_the_library_image(flux):
    pipe, c = flux
    info = c.get("/object_info").json()
    assert "flux1-dev" in info["UNETLoader"]["input"]["required"]["unet_name"][0]
    assert info["UNETLoader"]["input"]["required"]["weight_dtype"][0] == ["default"]  # float32 weights served
    dual = info["DualCLIPLoader"]["input"]["required"]
    assert dual["type"][0] == ["flux"] and info["CLIPLoader"]["input"]["required"]["type"][0] == []
    assert dual["clip_name1"][0][:2] == ["clip_l.safetensors", "t5xxl_fp16.safetensors"]
    assert "clip_g.safetensors" not in dual["clip_name1"][0]
    assert info["VAELoader"]["input"]["required"]["vae_name"][0] == ["ae.safetensors"]
    assert info["EmptySD3LatentImage"]["input"]["required"]["width"][1]["step"] == 16
    assert c.get("/models/text_encoders").json() == dual["clip_name1"][0]

    got = run(c, flux_workflow())
    want = library(pipe, "a red fox in the snow", "", seed=5, cfg=1.0, size=64, sampler="Euler Simple",
                   distilled_guidance=5.0)  # fmt: skip
    print("flux max |server - library|:", close(got, want))
    default = library(pipe, "a red fox in the snow", "", seed=5, cfg=1.0, size=64, sampler="Euler Simple")
    assert np.abs(got.astype(int) - default.astype(int)).max() > 1  # FluxGuidance reached the model
    # the same workflow with the model's parts named through a checkpoint loader's outputs gives the same image
    ckpt = flux_workflow()
    ckpt["4"] = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "flux1-dev"}}
    ckpt["3"]["inputs"]["model"], ckpt["8"]["inputs"]["vae"] = ["4", 0], ["4", 2]
    ckpt["6"]["inputs"]["clip"] = ckpt["33"]["inputs"]["clip"] = ["4", 1]
    close(run(c, ckpt), got, atol=0)


def flux_custom_workflow(seed=5, guidance=5.0, size=64) -> dict:
    """ComfyUI's flux_dev example as shipped: RandomNoise + BasicGuider + KSamplerSelect + BasicScheduler +
    SamplerCustomAdvanced, with ModelSamplingFlux at the latent's size."""
    wf = flux_workflow(seed, guidance, size)
    for nid in ("3", "33"):
        del wf[nid]
    wf.update({
        "30": {"class_type": "ModelSamplingFlux", "inputs": {"model": ["12", 0], "max_shift": 1.15, "base_shift": 0.5,
                                                             "width": size, "height": size}},
        "22": {"class_type": "BasicGuider", "inputs": {"model": ["30", 0], "conditioning": ["26", 0]}},
        "25": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "16": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "17": {"class_type": "BasicScheduler", "inputs": {"model": ["30", 0], "scheduler": "simple", "steps": STEPS,
                                                          "denoise": 1.0}},
        "13": {"class_type": "SamplerCustomAdvanced",
               "inputs": {"noise": ["25", 0], "guider": ["22", 0], "sampler": ["16", 0], "sigmas": ["17", 0],
                          "latent_image": ["27", 0]}},
    })  # fmt: skip
    wf["8"]["inputs"]["samples"] = ["13", 0]
    return wf


def test_flux_dev_example_with_sampler_custom_advanced(flux):
    pipe, c = flux
    got = run(c, flux_custom_workflow())
    want = library(pipe, "a red fox in the snow", "", seed=5, cfg=1.0, size=64, sampler="Euler Simple",
                   distilled_guidance=5.0)  # fmt: skip
    print("flux (SamplerCustomAdvanced) max |server - library|:", close(got, want))
    denoised = flux_custom_workflow()
    denoised["8"]["inputs"]["samples"] = ["13", 1]  # denoised_output: the same final latent
    close(run(c, denoised), got, atol=0)
    bad = flux_custom_workflow()
    bad["30"]["inputs"].update(width=1024, height=1024)  # a shift for another size than the latent's
    refused(c, bad, "30", "width", "1024x1024", "64x64")
    bad = flux_custom_workflow()
    bad["30"]["inputs"]["max_shift"] = 2.0
    refused(c, bad, "30", "max_shift", "1.15")
    bad = flux_custom_workflow()
    bad["16"]["inputs"]["sampler_name"] = "dpm_fast"
    refused(c, bad, "16", "sampler_name", "dpm_fast")


def test_flux_loaders_that_do_not_name_the_served_parts_are_refused(flux):
    _, c = flux
    wf = flux_workflow()
    bad = copy.deepcopy(wf)
    bad["11"]["inputs"]["type"] = "sdxl"
    refused(c, bad, "11", "type", "'sdxl'", "Stable Diffusion XL", "Flux.1", "'flux'")
    bad = copy.deepcopy(wf)
    bad["12"]["inputs"]["unet_name"] = "sd3.5_large.safetensors"
    refused(c, bad, "12", "unet_name", "sd3.5_large.safetensors", "flux1-dev")
    bad = copy.deepcopy(wf)
    bad["12"]["inputs"]["weight_dtype"] = "fp8_e4m3fn"
    refused(c, bad, "12", "weight_dtype", "float8_e4m3fn", "float32", "['default']")
    bad = copy.deepcopy(wf)
    bad["11"]["inputs"]["clip_name1"] = "clip_g.safetensors"
    refused(c, bad, "11", "clip_name1", "clip_g.safetensors", "t5xxl_fp16.safetensors")
    bad = copy.deepcopy(wf)
    bad["11"]["inputs"]["clip_name1"] = "clip_l.safetensors"  # clip_l twice, no T5
    refused(c, bad, "11", "clip_name2", "clip_l", "once")
    bad = copy.deepcopy(wf)
    bad["11"] = {"class_type": "TripleCLIPLoader", "inputs": {"clip_name1": "clip_l.safetensors",
                 "clip_name2": "clip_g.safetensors", "clip_name3": "t5xxl_fp16.safetensors"}}  # fmt: skip
    refused(c, bad, "11", "clip_name1", "Stable Diffusion 3", "Flux.1", "DualCLIPLoader with type 'flux'")
    bad = copy.deepcopy(wf)
    bad["10"]["inputs"]["vae_name"] = "sdxl_vae.safetensors"
    refused(c, bad, "10", "vae_name", "no VAE/ folder", "ae.safetensors")


def sd3_workflow(clip: dict, seed=3, size=32) -> dict:
    """An SD 3.5 workflow as people load it: the diffusion model and the three text encoders loaded apart, the VAE
    from the checkpoint loader, EmptySD3LatentImage, a KSampler with a negative prompt and cfg."""
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd3.5-tiny.safetensors"}},
        "12": {"class_type": "UNETLoader", "inputs": {"unet_name": "sd3.5-tiny", "weight_dtype": "default"}},
        "43": clip,
        "16": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dusk", "clip": ["43", 0]}},
        "40": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["43", 0]}},
        "53": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "3": {"class_type": "KSampler",
              "inputs": {"seed": seed, "steps": STEPS, "cfg": 4.5, "sampler_name": "euler", "scheduler": "simple",
                         "denoise": 1.0, "model": ["12", 0], "positive": ["16", 0], "negative": ["40", 0],
                         "latent_image": ["53", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "sd3", "images": ["8", 0]}},
    }  # fmt: skip


TRIPLE = {"class_type": "TripleCLIPLoader", "inputs": {"clip_name1": "clip_l.safetensors",
          "clip_name2": "clip_g.safetensors", "clip_name3": "t5xxl_fp8_e4m3fn_scaled.safetensors"}}  # fmt: skip


def test_sd35_workflow_gives_the_library_image(sd3):
    pipe, c = sd3
    info = c.get("/object_info").json()
    names = info["TripleCLIPLoader"]["input"]["required"]["clip_name3"][0]
    assert names[:2] == ["clip_l.safetensors", "clip_g.safetensors"] and "t5xxl_fp16.safetensors" in names
    assert info["DualCLIPLoader"]["input"]["required"]["type"][0] == ["sd3"]
    assert info["CLIPLoader"]["input"]["required"]["type"][0] == ["sd3"]
    assert info["VAELoader"]["input"]["required"]["vae_name"][0] == []
    got = run(c, sd3_workflow(TRIPLE))
    want = library(pipe, "a lighthouse at dusk", "blurry", seed=3, cfg=4.5, size=32, sampler="Euler Simple")
    print("sd3 max |server - library|:", close(got, want))
    # the encoders in another order (ComfyUI tells them apart by their weights) are the same CLIP
    shuffled = copy.deepcopy(TRIPLE)
    shuffled["inputs"].update(clip_name1="t5xxl_fp16.safetensors", clip_name3="clip_l.safetensors")
    close(run(c, sd3_workflow(shuffled)), got, atol=0)
    # ModelSamplingSD3 at the model's shift + CFGGuider + SamplerCustomAdvanced: the same generation
    custom = sd3_workflow(TRIPLE)
    del custom["3"]
    custom.update({
        "60": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["12", 0], "shift": 3.0}},
        "61": {"class_type": "CFGGuider", "inputs": {"model": ["60", 0], "positive": ["16", 0],
                                                     "negative": ["40", 0], "cfg": 4.5}},
        "62": {"class_type": "RandomNoise", "inputs": {"noise_seed": 3}},
        "63": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "64": {"class_type": "BasicScheduler", "inputs": {"model": ["60", 0], "scheduler": "simple", "steps": STEPS,
                                                          "denoise": 1.0}},
        "65": {"class_type": "SamplerCustomAdvanced",
               "inputs": {"noise": ["62", 0], "guider": ["61", 0], "sampler": ["63", 0], "sigmas": ["64", 0],
                          "latent_image": ["53", 0]}},
    })  # fmt: skip
    custom["8"]["inputs"]["samples"] = ["65", 0]
    close(run(c, custom), got, atol=0)
    custom["60"]["inputs"]["shift"] = 6.0
    refused(c, custom, "60", "shift", "3.0")


def test_sd35_loaders_of_another_family_or_fewer_encoders_are_refused(sd3):
    _, c = sd3
    dual = {"class_type": "DualCLIPLoader", "inputs": {"clip_name1": "clip_l.safetensors",
            "clip_name2": "t5xxl_fp16.safetensors", "type": "flux"}}  # fmt: skip
    refused(c, sd3_workflow(dual), "43", "type", "'flux'", "Flux.1", "Stable Diffusion 3", "TripleCLIPLoader")
    dual["inputs"].update(type="sd3", clip_name2="clip_g.safetensors")  # SD 3 without its T5: not served
    refused(c, sd3_workflow(dual), "43", "clip_name1", "missing: ['t5xxl']", "TripleCLIPLoader")
    single = {"class_type": "CLIPLoader", "inputs": {"clip_name": "t5xxl_fp16.safetensors", "type": "sd3"}}
    refused(c, sd3_workflow(single), "43", "clip_name", "missing: ['clip_l', 'clip_g']")
    bad = sd3_workflow(TRIPLE)
    bad["12"]["inputs"]["unet_name"] = "flux1-dev.safetensors"
    refused(c, bad, "12", "unet_name", "flux1-dev.safetensors", "sd3.5-tiny")


def test_loaders_on_a_model_without_those_parts():
    """On a 4-channel model of no Flux/SD 3 family (the fake): EmptySD3LatentImage and the CLIP loaders are refused
    by name, UNETLoader of the served model and EmptyLatentImage run."""
    from test_comfy_api import default_workflow

    with live_server(warm=False) as s, client(s.url) as c:
        info = c.get("/object_info").json()
        assert info["UNETLoader"]["input"]["required"]["unet_name"][0] == ["fake-model"]
        assert info["DualCLIPLoader"]["input"]["required"]["clip_name1"][0] == []
        wf = default_workflow()
        wf["12"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "fake-model", "weight_dtype": "default"}}
        wf["3"]["inputs"]["model"] = ["12", 0]
        assert run(c, wf).shape == (64, 64, 3)
        sd3 = copy.deepcopy(wf)
        sd3["5"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
        r = c.post("/prompt", json={"prompt": sd3})
        assert r.status_code == 400
        (error,) = r.json()["node_errors"]["5"]["errors"]
        assert error["type"] == "node_not_supported" and "EmptySD3LatentImage" in error["message"]
        assert "4 channels" in error["message"]
        clip = copy.deepcopy(wf)
        clip["11"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": "clip_l.safetensors",
                      "type": "stable_diffusion"}}  # fmt: skip
        clip["6"]["inputs"]["clip"] = clip["7"]["inputs"]["clip"] = ["11", 0]
        refused(c, clip, "11", "type", "'stable_diffusion'", "no family sdjax knows", "CheckpointLoaderSimple")


def test_sd1_clip_loader_and_unet_loader_are_the_checkpoints_parts():
    """On an SD 1.x model (the embedded one): CLIPLoader `stable_diffusion` with clip_l and UNETLoader are the
    checkpoint loader's CLIP and MODEL; EmptySD3LatentImage is refused (4 latent channels)."""
    import jax
    from test_comfy_api import default_workflow

    pipe = cli.load_pipeline(None, "float32")
    pipe.devices = jax.devices()[:1]
    with live_server(pipe, model_name="embedded", warm=False, max_batch=1) as s, client(s.url, timeout=300) as c:
        assert c.get("/object_info/CLIPLoader").json()["CLIPLoader"]["input"]["required"]["clip_name"][0] == [
            "clip_l.safetensors"
        ]
        wf = default_workflow(ckpt="embedded", steps=STEPS)
        want = run(c, wf)
        wf["11"] = {
            "class_type": "CLIPLoader",
            "inputs": {"clip_name": "clip_l.safetensors", "type": "stable_diffusion"},
        }
        wf["12"] = {"class_type": "UNETLoader", "inputs": {"unet_name": "embedded", "weight_dtype": "default"}}
        wf["6"]["inputs"]["clip"] = wf["7"]["inputs"]["clip"] = ["11", 0]
        wf["3"]["inputs"]["model"] = ["12", 0]
        close(run(c, wf), want, atol=0)
        bad = copy.deepcopy(wf)
        bad["11"]["inputs"]["type"] = "sd3"
        refused(c, bad, "11", "type", "'sd3'", "Stable Diffusion 3", "Stable Diffusion 1.x", "'stable_diffusion'")
        bad = copy.deepcopy(wf)
        bad["5"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
        r = c.post("/prompt", json={"prompt": bad})
        assert r.status_code == 400 and "4 channels" in r.json()["node_errors"]["5"]["errors"][0]["message"]


def test_weight_dtype_follows_the_served_storage(flux_folder):
    """UNETLoader's fp8 weight_dtype values: accepted on a model served with float8 e4m3 weights (`--quantize fp8`),
    refused on the others (planned without a server: nothing runs)."""
    pytest.importorskip("qwix")
    from sdjax import quant
    from sdjax.server.comfy import graph, nodes
    from sdjax.server.comfy.loaders import weight_dtypes
    from sdjax.server.schemas import Limits

    pipe = cli.load_pipeline(str(flux_folder), "float32")
    policy = quant.QuantPolicy("fp8", components=("transformer",), min_size=512)  # the tiny model's kernels
    pipe, _ = quant.quantize_pipeline(pipe, pipe.params, policy)
    assert weight_dtypes(pipe) == ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast"]

    def plan(dtype: str):
        wf = flux_workflow()
        wf["12"]["inputs"]["weight_dtype"] = dtype
        ctx = nodes.Context(pipe, Limits(), ("flux1-dev",), "flux1-dev", lambda name: None)
        return nodes.plan(graph.parse({"prompt": wf}), ctx)

    for dtype in ("fp8_e4m3fn", "fp8_e4m3fn_fast"):
        (stage,) = plan(dtype).stages
        assert stage.request.distilled_guidance == 5.0 and stage.request.sampler == "Euler Simple"
    with pytest.raises(graph.PromptError) as e:
        plan("fp8_e5m2")
    (error,) = e.value.node_errors["12"]["errors"]
    assert error["extra_info"]["input_name"] == "weight_dtype" and "float8_e4m3fn" in error["message"]
