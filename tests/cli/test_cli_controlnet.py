"""`sdjax generate --controlnet`: the image equals the Python API's with the same net, map and seed, the infotext
carries the "ControlNet 0" field, and bad options name the option before anything loads."""

import numpy as np
import pytest
from controlnet_cases import torch_controlnet
from PIL import Image
from typer.testing import CliRunner

from sdjax import StableDiffusionPipeline, cli, infotext, preprocess

runner = CliRunner()


@pytest.fixture(scope="module")
def net_dir(torch_sd1, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-cn")
    torch_controlnet(torch_sd1.unet, 7).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    rng = np.random.default_rng(3)
    pixels = (rng.random((64, 64, 3)) > 0.5).astype(np.uint8) * 255
    path = tmp_path_factory.mktemp("cli-cn-img") / "edges.png"
    Image.fromarray(pixels).save(path)
    return path, pixels


def test_cli_controlnet_image_matches_the_api(sd1_dir, net_dir, picture, tmp_path, monkeypatch):
    path, pixels = picture
    loaded = []  # the pipeline the CLI loads, reused below for the API's image (its compiled programs too)

    def load_pipeline(*args, **kwargs):
        loaded.append(real_load(*args, **kwargs))
        return loaded[-1]

    real_load = cli.load_pipeline
    monkeypatch.setattr(cli.generate, "load_pipeline", load_pipeline)
    args = ["generate", "a house", "-m", str(sd1_dir), "--steps", "2", "-W", "64", "-H", "64", "--seed", "5"]
    args += ["--controlnet", str(net_dir), "--control-image", str(path), "--control-preprocess", "invert"]
    r = runner.invoke(cli.app, [*args, "--control-scale", "0.7", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    (png,) = tmp_path.glob("*.png")
    text = infotext.read_parameters(png.read_bytes())
    assert f'ControlNet 0: "Module: invert, Model: {net_dir.name}, Weight: 0.7, Guidance Start: 0.0' in text
    (pipe,) = loaded
    assert isinstance(pipe, StableDiffusionPipeline)
    # A no-op progress callback as the CLI's progress bars: the program the CLI compiled.
    ref = pipe.generate(
        "a house", seed=5, steps=2, height=64, width=64, guidance_scale=7.5, controlnet=str(net_dir),
        control_image=preprocess.invert(pixels), controlnet_conditioning_scale=0.7, output_type="np",
        progress=lambda stage, step, total: None,
    )  # fmt: skip
    ours = np.asarray(Image.open(png), np.float32) / 255
    assert np.abs(ours - np.asarray(ref)[0]).max() <= 1 / 255 + 1e-6
    plain = pipe.generate("a house", seed=5, steps=2, height=64, width=64, guidance_scale=7.5, output_type="np")
    assert np.abs(ours - np.asarray(plain)[0]).max() > 5 / 255  # the net changed the image


@pytest.mark.parametrize(
    "extra,hint",
    [
        (["--control-image", "IMG"], "--controlnet"),
        (["--controlnet", "a", "--controlnet", "b", "--control-image", "IMG"], "--control-image"),
        (["--controlnet", "a", "--control-image", "IMG", "--control-preprocess", "bogus"], "--control-preprocess"),
        (["--controlnet", "a", "--control-image", "missing.png"], "--control-image"),
        (["--controlnet", "a", "--control-image", "IMG", "--control-start", "0.8", "--control-end", "0.2"],
         "--control-start"),
        (["--controlnet", "a", "--controlnet", "b", "--control-image", "IMG", "--control-image", "IMG",
          "--control-scale", "1", "--control-scale", "2", "--control-scale", "3"], "--control-scale"),
    ],
)  # fmt: skip
def test_bad_control_options_are_named(extra, hint, picture, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("loaded a model before checking the options")

    monkeypatch.setattr(cli.generate, "load_pipeline", no_load)
    extra = [str(picture[0]) if x == "IMG" else str(tmp_path / x) if x == "missing.png" else x for x in extra]
    r = runner.invoke(cli.app, ["generate", "x", "-o", str(tmp_path), *extra])
    assert r.exit_code == 2 and hint in r.output, r.output
