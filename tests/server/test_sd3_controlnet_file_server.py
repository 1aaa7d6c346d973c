"""SD 3.5 ControlNet single files (Stability AI's layout: `sd3.5_large_controlnet_canny.safetensors`) wherever sdjax
takes a ControlNet: the server's `--controlnet-dir` (A1111 units, ComfyUI's ControlNetLoader) and `sdjax generate
--controlnet FILE`.

A tiny SD 3 model whose transformer has heads 64 wide (as every SD 3 / 3.5 MMDiT; a Stability file does not store
its head count) and a tiny random SD 3.5-large-like `SD3ControlNetModel` (single blocks, no text, the transformer's
patch embedding), saved both as a diffusers folder and as Stability's single file
(`tests/sd3_controlnet_builders.write_sai_file`, the inverse of diffusers' conversion script). The folder
stays outside the served folder, which holds the file, an SD 1.x ControlNet single file (original layout) and a
Flux ControlNet file:
- the A1111 unit and the ComfyUI workflow naming the file give the Python API's image with the folder net (the same
  program: equal to 1 level of 255), which the net visibly moves;
- `sdjax generate --controlnet FILE` gives it too (its own pipeline and compile: equal here, a few levels allowed);
- the SD 1.x file and the Flux file are refused before anything runs, naming the unit and what the file is.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import sd3_reference
import t5_reference
from controlnet_cases import one_torch_thread
from PIL import Image
from sd3_controlnet_builders import NETS, pipeline_net, randomized, write_sai_file
from test_comfy_real import upload
from test_sd3_controlnet_server import SETTINGS, STEPS, _a1111_body, _app, _decoded, _png, _quiet, _workflow
from test_server_errors import assert_error

from sdjax import cli

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loading"))
from ldm_fixtures import controlnet_to_original
from test_comfy_families import run

A1111 = "/sdapi/v1/txt2img"
SIZE = 32
WIDE = {"attention_head_dim": 64, "num_attention_heads": 2}  # heads 64 wide, width 128
TRANSFORMER = {**sd3_reference.TRANSFORMER, **WIDE, "caption_projection_dim": 128}
# NETS["sd35-large"] at that width, with the config Stability's file infers (diffusers' converter's choices)
NET = {k: v for k, v in NETS["sd35-large"].items() if k != "sample_size"}
NET.update(WIDE, caption_projection_dim=NET["pooled_projection_dim"])
# An SD 1.x-like ControlNet (768-wide text, 8 heads: what the original layout's shapes tell), tiny.
SD_NET = dict(
    block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=768, attention_head_dim=8,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
)  # fmt: skip


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """The served folder (`sd35_canny.safetensors`, `sd15_canny.safetensors`, `flux_canny.safetensors`) and the SD 3
    net's diffusers folder."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("controlnets")
    folder = tmp_path_factory.mktemp("sd35-controlnet-folder")
    with one_torch_thread():
        net = pipeline_net(NET, 21)
        net.save_pretrained(folder, safe_serialization=True)
        write_sai_file(net, root / "sd35_canny.safetensors")
        sd_net = diffusers.ControlNetModel(**SD_NET)
        state = {k: v.detach().clone() for k, v in sd_net.state_dict().items()}
        save_file(controlnet_to_original(state, dict(sd_net.config)), str(root / "sd15_canny.safetensors"))
        torch.manual_seed(6)
        flux = diffusers.FluxControlNetModel(
            patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
        )  # fmt: skip
        save_file({k: v.contiguous() for k, v in flux.state_dict().items()}, str(root / "flux_canny.safetensors"))
    return root, folder


@pytest.fixture(scope="module")
def sd3(tmp_path_factory, nets):
    import jax
    from fastapi.testclient import TestClient

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("models") / "sd3-tiny"
    with one_torch_thread():
        components = sd3_reference.sd3_pipeline(tokenizer_dir=tok).components
        torch.manual_seed(12)
        components["transformer"] = randomized(diffusers.SD3Transformer2DModel(**TRANSFORMER), 12)
        diffusers.StableDiffusion3Pipeline(**components).save_pretrained(folder, safe_serialization=True)
    pipe = cli.load_pipeline(str(folder), "float32")
    pipe.devices = jax.devices()[:1]  # one device, as the ComfyUI family tests
    with TestClient(_app(pipe, "sd3-tiny", nets[0])) as c:
        yield pipe, c, folder


@pytest.fixture(scope="module")
def control_map():
    return ((np.random.default_rng(4).random((36, 40, 3)) > 0.5) * 255).astype(np.uint8)


def _library(pipe, controlnet, control_map) -> np.ndarray:
    s = SETTINGS
    control = {}
    if controlnet is not None:
        control = dict(
            controlnet=str(controlnet), control_image=control_map, controlnet_conditioning_scale=s["weight"],
            control_guidance_start=s["start"], control_guidance_end=s["end"],
        )  # fmt: skip
    images = pipe.generate(
        s["prompt"], negative_prompt=s["negative"], seed=s["seed"], steps=STEPS, guidance_scale=s["cfg"],
        height=SIZE, width=SIZE, sampler="Euler Simple", progress=_quiet, **control,
    )  # fmt: skip
    return np.asarray(images[0], np.int16)


@pytest.fixture(scope="module")
def folder_image(sd3, nets, control_map):
    """The Python API's image with the SD 3 net's diffusers folder."""
    return _library(sd3[0], nets[1], control_map)


def test_a1111_unit_with_the_file_gives_the_folder_nets_image(sd3, nets, control_map, folder_image):
    pipe, c, _ = sd3
    names = ["flux_canny", "sd15_canny", "sd35_canny"]
    assert c.get("/controlnet/model_list").json() == {"model_list": names}
    b64 = base64.b64encode(_png(control_map)).decode()
    r = c.post(A1111, json=_a1111_body(b64, model="sd35_canny"))
    assert r.status_code == 200, r.text
    assert "Model: sd35_canny" in json.loads(r.json()["info"])["infotexts"][0]
    got = _decoded(r.json()["images"][0])
    assert np.abs(got - folder_image).max() <= 1
    plain = _library(pipe, None, control_map)
    assert np.abs(folder_image - plain).max() > 10  # the net moved the image: the comparison is about it


def test_comfy_controlnet_loader_takes_the_file(sd3, control_map, folder_image):
    _, c, _ = sd3
    image = upload(c, "sd35-hint.png", Image.fromarray(control_map))
    got = run(c, _workflow(image, net="sd35_canny.safetensors")).astype(np.int16)
    assert np.abs(got - folder_image).max() <= 1


def test_other_files_are_refused_naming_the_unit(sd3, control_map):
    pipe, c, _ = sd3
    before = pipe.generator.cache.stats.compiles
    b64 = base64.b64encode(_png(control_map)).decode()
    field = "alwayson_scripts.controlnet.args[0].model"
    error = assert_error(c.post(A1111, json=_a1111_body(b64, model="sd15_canny")), 422, field, "sd15_canny")
    assert "ControlNetModel" in error["message"] and "Stable Diffusion 3 / 3.5" in error["message"]
    error = assert_error(c.post(A1111, json=_a1111_body(b64, model="flux_canny")), 422, field, "flux_canny")
    assert "a Flux.1 ControlNet" in error["message"] and "flux_canny.safetensors" in error["message"]
    assert pipe.generator.cache.stats.compiles == before  # refused before anything ran


def test_cli_generate_with_the_file(sd3, nets, control_map, folder_image, tmp_path):
    """`sdjax generate --controlnet FILE`: the Python API's image (its own compile, which may round differently);
    a Flux file fails naming it."""
    from typer.testing import CliRunner

    from sdjax.cli import app

    _, _, model = sd3
    s = SETTINGS
    Image.fromarray(control_map).save(tmp_path / "control.png")
    args = ["generate", s["prompt"], "-m", str(model), "--negative-prompt", s["negative"]]
    args += ["--control-image", str(tmp_path / "control.png"), "--control-scale", str(s["weight"])]
    args += ["--control-start", str(s["start"]), "--control-end", str(s["end"]), "--steps", str(STEPS)]
    args += ["--guidance-scale", str(s["cfg"]), "--seed", str(s["seed"]), "--width", str(SIZE)]
    args += ["--height", str(SIZE), "--sampler", "Euler", "--schedule", "Simple"]
    bad = CliRunner().invoke(app, [*args, "--controlnet", str(nets[0] / "flux_canny.safetensors"), "-o", str(tmp_path)])
    assert bad.exit_code == 1 and "flux_canny.safetensors" in bad.output and "Flux.1 ControlNet" in bad.output
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [*args, "--controlnet", str(nets[0] / "sd35_canny.safetensors"), "-o", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    (png,) = sorted(out.glob("*.png"))
    got = np.asarray(Image.open(png).convert("RGB"), np.int16)
    err = np.abs(got - folder_image)
    print(f"CLI vs Python API: max {err.max()}, mean {err.mean():.3f}")
    assert err.mean() <= 2 and err.max() <= 5
