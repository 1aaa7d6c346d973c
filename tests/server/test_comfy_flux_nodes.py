"""The conditioning and custom sampling nodes of ComfyUI's Flux.1 and SD 3.5 workflows on sdjax (`server.comfy`):
ConditioningZeroOut, CLIPTextEncodeFlux, CLIPTextEncodeSD3, ConditioningCombine, SamplerCustom and SplitSigmas.

Zero conditioning is checked against PyTorch diffusers given zero negative embeddings (`negative_prompt_embeds` and
the pooled ones set to zeros, with sdjax's noise: tests/inject.py), then each workflow's image against the sdjax
pipeline's Python API with the texts, guidance and `zero_negative` the nodes mean. What a node cannot mean on sdjax
(ConditioningCombine of two prompts, decoding SplitSigmas' high half, empty_padding "none" with a text left
out) is refused in ComfyUI's error shape, naming the node and input."""

from __future__ import annotations

import copy
import dataclasses
import io

import flux_reference
import inject
import numpy as np
import pytest
import sd3_reference
import t5_reference
import torch
from server_helpers import client, live_server
from test_comfy_families import TRIPLE, close, flux_workflow, refused, run, sd3_workflow

from sdjax import cli, rng
from sdjax.server.comfy import graph, nodes
from sdjax.server.schemas import Limits

SIZE = 32
STEPS = 2


def _models(tmp_path_factory, name: str, make):
    """(diffusers pipeline, the sdjax pipeline loaded from its saved folder) of a tiny model."""
    import jax

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    torch_pipe = make(tok)
    folder = tmp_path_factory.mktemp("models") / name
    torch_pipe.save_pretrained(folder, safe_serialization=True)
    pipe = cli.load_pipeline(str(folder), "float32")
    pipe.devices = jax.devices()[:1]
    return torch_pipe, pipe


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    torch_pipe, pipe = _models(
        tmp_path_factory, "flux1-dev", lambda t: flux_reference.flux_pipeline("dev", tokenizer_dir=t)
    )
    with live_server(pipe, model_name="flux1-dev", warm=False, max_batch=1) as s, client(s.url, timeout=300) as c:
        yield torch_pipe, pipe, c


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    torch_pipe, pipe = _models(tmp_path_factory, "sd3.5-tiny", lambda t: sd3_reference.sd3_pipeline(tokenizer_dir=t))
    with live_server(pipe, model_name="sd3.5-tiny", warm=False, max_batch=1) as s, client(s.url, timeout=300) as c:
        yield torch_pipe, pipe, c


def _diffusers(torch_pipe, seed: int, n: int, **kwargs) -> np.ndarray:
    keys = inject.image_keys(seed, n)
    noise = inject.stream(keys, rng.LATENTS, (16, SIZE // 2, SIZE // 2))  # the tiny VAEs downsample by 2
    with inject.prescribed(torch_pipe, latents_noise=noise), torch.no_grad():
        out = torch_pipe(height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="np", **kwargs)
    return out.images


def _uint8(images) -> np.ndarray:
    return np.clip(np.round(np.asarray(images) * 255), 0, 255).astype(np.uint8)


def plan(pipe, wf: dict, name: str):
    ctx = nodes.Context(pipe, Limits(), (name,), name, lambda _: None)
    return nodes.plan(graph.parse({"prompt": wf}), ctx)


# ---------------------------------------------------------------------------------------------- zero conditioning
def test_zero_negative_is_diffusers_with_zero_negative_embeddings(flux, sd3):
    """`zero_negative` (what ConditioningZeroOut as the negative means) equals diffusers given zero negative
    embeddings and pooled embeddings, and differs from the empty negative prompt."""
    prompts = ["a red fox in the snow", "a lighthouse at dusk"]
    torch_flux, pipe, _ = flux
    seq = pipe.max_sequence_length
    embeds, pooled, _ids = torch_flux.encode_prompt(prompts, None, max_sequence_length=seq)
    ref = _diffusers(torch_flux, 4, 2, prompt=prompts, max_sequence_length=seq, guidance_scale=3.0,
                     true_cfg_scale=3.5, negative_prompt_embeds=torch.zeros_like(embeds),
                     negative_pooled_prompt_embeds=torch.zeros_like(pooled))  # fmt: skip
    kwargs = dict(seed=4, steps=STEPS, height=SIZE, width=SIZE, guidance_scale=3.0, true_cfg_scale=3.5)
    out = pipe.generate(prompts, negative_prompt="", zero_negative=True, output_type="np", **kwargs)
    err = float(np.abs(out - ref).max())
    print(f"flux zero negative: max |sdjax - diffusers| {err:.2e}")
    assert err < 1e-3
    empty = pipe.generate(prompts, negative_prompt="", output_type="np", **kwargs)
    assert float(np.abs(out - empty).max()) > 1e-2  # zero conditioning is not the empty prompt's

    torch_sd3, pipe, _ = sd3
    seq = pipe.max_sequence_length
    embeds, _, pooled, _ = torch_sd3.encode_prompt(prompts, None, None, do_classifier_free_guidance=False,
                                                   max_sequence_length=seq)  # fmt: skip
    ref = _diffusers(torch_sd3, 6, 2, prompt=prompts, max_sequence_length=seq, guidance_scale=4.5,
                     negative_prompt_embeds=torch.zeros_like(embeds),
                     negative_pooled_prompt_embeds=torch.zeros_like(pooled))  # fmt: skip
    kwargs = dict(seed=6, steps=STEPS, height=SIZE, width=SIZE, guidance_scale=4.5, output_type="np")
    out = pipe.generate(prompts, negative_prompt="", zero_negative=[True, True], **kwargs)
    err = float(np.abs(out - ref).max())
    print(f"sd3 zero negative: max |sdjax - diffusers| {err:.2e}")
    assert err < 1e-3
    mixed = pipe.generate(prompts, negative_prompt="", zero_negative=[False, True], **kwargs)
    empty = pipe.generate(prompts, negative_prompt="", **kwargs)
    np.testing.assert_allclose(mixed[0], empty[0], atol=1e-6)  # per image: the first keeps the empty prompt
    np.testing.assert_allclose(mixed[1], out[1], atol=1e-6)
    assert float(np.abs(out[0] - empty[0]).max()) > 1e-2


def flux_zero_workflow(cfg: float, negative: str = "zero") -> dict:
    """ComfyUI's Flux example with CLIPTextEncodeFlux (its own T5 text and guidance) and ConditioningZeroOut as the
    KSampler's negative."""
    wf = flux_workflow(seed=9, size=SIZE)
    del wf["26"]
    wf["6"] = {"class_type": "CLIPTextEncodeFlux",
               "inputs": {"clip": ["11", 0], "clip_l": "a red fox", "t5xxl": "a red fox in deep snow, at dawn",
                          "guidance": 4.0}}  # fmt: skip
    wf["34"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["6", 0]}}
    wf["3"]["inputs"].update(positive=["6", 0], negative=["34", 0] if negative == "zero" else ["33", 0], cfg=cfg)
    return wf


def test_flux_text_encode_and_zero_out(flux):
    _, pipe, c = flux
    kwargs = dict(seed=9, steps=STEPS, height=SIZE, width=SIZE, sampler="Euler Simple", guidance_scale=4.0,
                  prompt_2="a red fox in deep snow, at dawn", output_type="np")  # fmt: skip
    # cfg 1: the negative is never evaluated (as ComfyUI), so ConditioningZeroOut changes nothing
    want = _uint8(pipe.generate("a red fox", **kwargs))[0]
    got = run(c, flux_zero_workflow(1.0))
    print("flux CLIPTextEncodeFlux max |server - generate|:", close(got, want))
    (stage,) = plan(pipe, flux_zero_workflow(1.0), "flux1-dev").stages
    assert stage.request.conditioning == (("prompt_2", "a red fox in deep snow, at dawn"),)
    assert stage.request.distilled_guidance == 4.0
    # cfg 2: true CFG against zero embeddings (not against the empty prompt)
    zero = _uint8(pipe.generate("a red fox", negative_prompt="", true_cfg_scale=2.0, zero_negative=True, **kwargs))
    got = run(c, flux_zero_workflow(2.0))
    print("flux ConditioningZeroOut cfg 2 max |server - generate|:", close(got, zero[0]))
    empty = run(c, flux_zero_workflow(2.0, negative="empty"))
    assert np.abs(got.astype(int) - empty.astype(int)).max() > 1
    # CLIPTextEncodeFlux with one text for both encoders is CLIPTextEncode + FluxGuidance
    same = flux_zero_workflow(1.0)
    same["6"]["inputs"]["t5xxl"] = "a red fox"
    plain = flux_workflow(seed=9, size=SIZE)
    plain["6"]["inputs"]["text"], plain["26"]["inputs"]["guidance"] = "a red fox", 4.0
    assert plan(pipe, same, "flux1-dev").stages[0].request == plan(pipe, plain, "flux1-dev").stages[0].request


def test_flux_refusals(flux):
    _, _, c = flux
    bad = flux_zero_workflow(2.0)
    bad["3"]["inputs"]["positive"], bad["3"]["inputs"]["negative"] = ["34", 0], ["6", 0]
    refused(c, bad, "3", "positive", "ConditioningZeroOut", "negative prompt only")
    bad = flux_zero_workflow(1.0)
    bad["6"] = {"class_type": "CLIPTextEncodeSD3", "inputs": {"clip": ["11", 0], "clip_l": "a", "clip_g": "b",
                "t5xxl": "c", "empty_padding": "none"}}  # fmt: skip
    refused(c, bad, "6", "clip", "CLIPTextEncodeSD3", "Flux.1", "CLIPTextEncode")
    bad = flux_zero_workflow(1.0)
    bad["35"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["6", 0],
                 "conditioning_2": ["33", 0]}}  # fmt: skip
    bad["3"]["inputs"]["positive"] = ["35", 0]
    refused(c, bad, "35", "conditioning_2", "averages", "one conditioning")


# ---------------------------------------------------------------------------------------------- SD 3.5
def sd3_text_workflow(padding: str = "empty_prompt", t5: str = "a tall lighthouse on a cliff, dusk") -> dict:
    """SD 3.5 with CLIPTextEncodeSD3 (a text per encoder), ConditioningZeroOut as the negative, and SamplerCustom +
    KSamplerSelect + BasicScheduler."""
    wf = sd3_workflow(TRIPLE, seed=3, size=SIZE)
    del wf["3"]
    wf.update({
        "16": {"class_type": "CLIPTextEncodeSD3",
               "inputs": {"clip": ["43", 0], "clip_l": "a lighthouse", "clip_g": "a lighthouse at dusk", "t5xxl": t5,
                          "empty_padding": padding}},
        "41": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["40", 0]}},
        "63": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "64": {"class_type": "BasicScheduler", "inputs": {"model": ["12", 0], "scheduler": "simple", "steps": STEPS,
                                                          "denoise": 1.0}},
        "65": {"class_type": "SamplerCustom",
               "inputs": {"model": ["12", 0], "add_noise": True, "noise_seed": 3, "cfg": 4.5, "positive": ["16", 0],
                          "negative": ["41", 0], "sampler": ["63", 0], "sigmas": ["64", 0],
                          "latent_image": ["53", 0]}},
    })  # fmt: skip
    wf["8"]["inputs"]["samples"] = ["65", 0]
    return wf


def test_sd3_text_encode_zero_out_and_sampler_custom(sd3):
    _, pipe, c = sd3
    want = pipe.generate("a lighthouse", prompt_2="a lighthouse at dusk", prompt_3="a tall lighthouse on a cliff, dusk",
                         negative_prompt="", zero_negative=True, seed=3, steps=STEPS, height=SIZE, width=SIZE,
                         guidance_scale=4.5, sampler="Euler Simple", output_type="np")  # fmt: skip
    got = run(c, sd3_text_workflow())
    print("sd3 CLIPTextEncodeSD3 + ZeroOut + SamplerCustom max |server - generate|:", close(got, _uint8(want)[0]))
    # denoised_output is output; ConditioningCombine of a conditioning with itself is that conditioning
    wf = sd3_text_workflow()
    wf["66"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["16", 0],
                "conditioning_2": ["16", 0]}}  # fmt: skip
    wf["65"]["inputs"]["positive"] = ["66", 0]
    wf["8"]["inputs"]["samples"] = ["65", 1]
    close(run(c, wf), got, atol=0)
    # empty_padding "none" with texts everywhere is "empty_prompt"; an empty CLIP-G text beside CLIP-L's is padded
    # with the empty prompt by ComfyUI either way
    none = plan(pipe, sd3_text_workflow("none"), "sd3.5-tiny").stages[0].request
    assert none == plan(pipe, sd3_text_workflow(), "sd3.5-tiny").stages[0].request
    assert dict(none.conditioning) == {"prompt_2": "a lighthouse at dusk", "prompt_3": "a tall lighthouse on a cliff, "
                                       "dusk", "zero_negative": True}  # fmt: skip
    wf = sd3_text_workflow("none")
    wf["16"]["inputs"]["clip_g"] = ""
    assert dict(plan(pipe, wf, "sd3.5-tiny").stages[0].request.conditioning)["prompt_2"] == ""


def test_sd3_refusals(sd3):
    _, _, c = sd3
    refused(c, sd3_text_workflow("none", t5=""), "16", "t5xxl", "empty_padding 'none'", "'empty_prompt'")
    both = sd3_text_workflow("none")
    both["16"]["inputs"].update(clip_l="", clip_g="")
    refused(c, both, "16", "clip_l", "both CLIP texts")
    bad = sd3_text_workflow()
    bad["65"]["inputs"]["add_noise"] = False
    refused(c, bad, "65", "add_noise", "leftover noise")
    bad = sd3_text_workflow()
    bad["16"] = {"class_type": "CLIPTextEncodeFlux", "inputs": {"clip": ["43", 0], "clip_l": "a", "t5xxl": "b",
                 "guidance": 3.5}}  # fmt: skip
    refused(c, bad, "16", "clip", "CLIPTextEncodeFlux", "Stable Diffusion 3")
    # SplitSigmas: high_sigmas leave noise for a second sampler (decoding it is refused: tests/server/
    # test_comfy_two_stage.py runs the two stages); low_sigmas need an image latent
    split = sd3_text_workflow()
    split["67"] = {"class_type": "SplitSigmas", "inputs": {"sigmas": ["64", 0], "step": 1}}
    split["65"]["inputs"]["sigmas"] = ["67", 0]
    refused(c, split, "8", "samples", "leftover noise", "one generation")
    split["65"]["inputs"]["sigmas"] = ["67", 1]
    refused(c, split, "67", "step", "image latent")


def test_zero_out_at_cfg_above_one_on_other_families_and_split_sigmas_img2img():
    """Planned over the fake pipeline (a 4-channel model of no Flux / SD 3 family): ConditioningZeroOut as the
    negative at cfg 1 is the plain generation (ComfyUI never evaluates it), at cfg > 1 it is refused; SplitSigmas'
    low_sigmas from step k on an encoded image are KSamplerAdvanced's start_at_step k."""
    from fake_pipeline import FakePipeline
    from test_comfy_api import default_workflow

    from sdjax.policy import a1111_start_step

    pipe = FakePipeline()
    wf = default_workflow(steps=4)
    wf["70"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["7", 0]}}
    wf["3"]["inputs"].update(negative=["70", 0], cfg=1.0)
    (stage,) = plan(pipe, wf, "fake-model").stages
    plain = default_workflow(steps=4)
    plain["3"]["inputs"]["cfg"] = 1.0
    want = plan(pipe, plain, "fake-model").stages[0].request
    assert stage.request == dataclasses.replace(want, negative_prompt="")
    wf["3"]["inputs"]["cfg"] = 7.0
    with pytest.raises(graph.PromptError) as e:
        plan(pipe, wf, "fake-model")
    (error,) = e.value.node_errors["3"]["errors"]
    assert error["extra_info"]["input_name"] == "negative" and "Flux.1 and SD 3" in error["message"]

    image = np.zeros((64, 64, 3), np.uint8)
    image[16:48] = 200
    uploads = {"in.png": _png(image)}
    common = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "fake-model"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "10": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
        "11": {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["4", 2]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "x", "images": ["8", 0]}},
    }
    advanced = copy.deepcopy(common)
    advanced["3"] = {"class_type": "KSamplerAdvanced",
                     "inputs": {"model": ["4", 0], "add_noise": "enable", "noise_seed": 5, "steps": 8, "cfg": 6.0,
                                "sampler_name": "euler", "scheduler": "normal", "positive": ["6", 0],
                                "negative": ["7", 0], "latent_image": ["11", 0], "start_at_step": 3,
                                "end_at_step": 10000, "return_with_leftover_noise": "disable"}}  # fmt: skip
    custom = copy.deepcopy(common)
    custom.update({
        "20": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "21": {"class_type": "BasicScheduler", "inputs": {"model": ["4", 0], "scheduler": "normal", "steps": 8,
                                                          "denoise": 1.0}},
        "22": {"class_type": "SplitSigmas", "inputs": {"sigmas": ["21", 0], "step": 3}},
        "3": {"class_type": "SamplerCustom",
              "inputs": {"model": ["4", 0], "add_noise": True, "noise_seed": 5, "cfg": 6.0, "positive": ["6", 0],
                         "negative": ["7", 0], "sampler": ["20", 0], "sigmas": ["22", 1], "latent_image": ["11", 0]}},
    })  # fmt: skip

    def request(wf):
        ctx = nodes.Context(pipe, Limits(), ("fake-model",), "fake-model", uploads.get)
        (stage,) = nodes.plan(graph.parse({"prompt": wf}), ctx).stages
        return stage.request

    a, b = request(advanced), request(custom)
    assert a == b and (a.steps, a.init_image.size) == (8, (64, 64))
    assert a1111_start_step(b.steps, b.denoising_strength) == 3  # the image is noised to step 3's sigma


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def test_object_info_of_the_new_nodes():
    """`/object_info`'s entries of the nodes, in ComfyUI's shape (inputs, defaults, output names)."""
    from sdjax.server.comfy import defs

    info = {name: defs.object_info(defs.NODES[name], {}) for name in (
        "SamplerCustom", "SplitSigmas", "CLIPTextEncodeFlux", "CLIPTextEncodeSD3", "ConditioningZeroOut",
        "ConditioningCombine")}  # fmt: skip
    custom = info["SamplerCustom"]
    assert custom["input"]["required"]["add_noise"] == ["BOOLEAN", {"default": True}]
    assert custom["input_order"]["required"] == ["model", "add_noise", "noise_seed", "cfg", "positive", "negative",
                                                 "sampler", "sigmas", "latent_image"]  # fmt: skip
    assert custom["output_name"] == ["output", "denoised_output"]
    assert info["SplitSigmas"]["output_name"] == ["high_sigmas", "low_sigmas"]
    assert info["SplitSigmas"]["input"]["required"]["step"][1]["default"] == 0
    assert info["CLIPTextEncodeFlux"]["input"]["required"]["guidance"][1]["default"] == 3.5
    assert info["CLIPTextEncodeSD3"]["input"]["required"]["empty_padding"] == [["none", "empty_prompt"]]
    assert info["ConditioningCombine"]["input_order"]["required"] == ["conditioning_1", "conditioning_2"]
    assert info["ConditioningZeroOut"]["output"] == ["CONDITIONING"]
