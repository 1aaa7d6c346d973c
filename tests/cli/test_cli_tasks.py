"""`sdjax generate` with --image, --mask, --outpaint and --hires-* on the tiny SD 1.x model: the files carry
A1111's fields, read back to the same parameters, and reproduce through the Python API."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from sdjax import StableDiffusionPipeline, cli, infotext, metadata, policy
from sdjax.core import images as image_lib

runner = CliRunner()


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))[0]


@pytest.fixture
def tiny(sd, monkeypatch, sd1_dir):
    monkeypatch.setattr(cli.generate, "load_pipeline", lambda model, dtype: sd)
    return str(sd1_dir)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-inputs")
    r = np.random.default_rng(0)
    Image.fromarray(r.integers(0, 255, (8, 8, 3), np.uint8)).resize((64, 64), Image.NEAREST).save(d / "in.png")
    m = np.zeros((64, 64), np.uint8)
    m[20:44, 16:48] = 255
    Image.fromarray(m).save(d / "mask.png")
    Image.new("L", (32, 32), 255).save(d / "small_mask.png")
    return d


def _generate(*args):
    return runner.invoke(cli.app, ["generate", "a cat", "--steps", "4", "--quiet", *args])


def test_img2img_file_reproduces_through_the_api(tiny, files, tmp_path, sd):
    r = _generate("-m", tiny, "--image", str(files / "in.png"), "--strength", "0.5", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    path = tmp_path / r.output.split()[0].split("/")[-1]
    text = infotext.read_parameters(path)
    assert "Denoising strength: 0.5" in text and "Size: 64x64" in text
    params = metadata.parameters_from_text(text)
    assert (params.denoising_strength, params.task) == (0.5, "txt2img")  # the init image is not in the file
    # A1111's rule: int(0.999 * ... ) -> 4 * 0.5 = 2 steps + 1 from step 1 of 4
    assert policy.a1111_start_step(4, 0.5) == 1
    again = metadata.generate_images(
        sd, [metadata.ImageParameters(**{**params.__dict__, "init_image": Image.open(files / "in.png")})]
    )
    np.testing.assert_array_equal(again[0], np.asarray(Image.open(path)))


def test_inpaint_keeps_unmasked_pixels_and_records_the_mask_settings(tiny, files, tmp_path):
    r = _generate(
        "-m",
        tiny,
        "--image",
        str(files / "in.png"),
        "--mask",
        str(files / "mask.png"),
        "--mask-blur",
        "0",
        "--strength",
        "1.0",
        "--out",
        str(tmp_path),
    )
    assert r.exit_code == 0, r.output
    path = tmp_path / r.output.split()[0].split("/")[-1]
    out = np.asarray(Image.open(path))
    keep = np.asarray(Image.open(files / "mask.png")) == 0
    np.testing.assert_array_equal(out[keep], np.asarray(Image.open(files / "in.png"))[keep])  # A1111's overlay
    params = metadata.parameters_from_text(infotext.read_parameters(path))
    assert params.denoising_strength == 1.0 and params.mask_blur == 0


def test_outpaint_extends_the_canvas(tiny, files, tmp_path):
    r = _generate(
        "-m",
        tiny,
        "--image",
        str(files / "in.png"),
        "--outpaint",
        "16,0,16,0",
        "--strength",
        "1",
        "--out",
        str(tmp_path),
    )
    assert r.exit_code == 0, r.output
    out = np.asarray(Image.open(tmp_path / r.output.split()[0].split("/")[-1]))
    assert out.shape == (64, 96, 3)
    # The original sits at x 16..80; away from the 8-pixel overlap and the mask's 4-pixel blur it is kept exactly.
    inner = np.asarray(Image.open(files / "in.png"))[:, 20:44]
    np.testing.assert_array_equal(out[:, 36:60], inner)


def test_outpaint_canvas_by_hand():
    img = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(2, 2, 3) * 20)
    canvas, mask = image_lib.outpaint_canvas(img, 1, 0, 0, 2, overlap=0)
    c, m = np.asarray(canvas), np.asarray(mask)
    assert c.shape == (4, 3, 3) and (c[:2, 1:] == np.asarray(img)).all() and (c[:, 0] == c[:, 1]).all()
    assert (m[:2, 1:] == 0).all() and (m[2:] == 255).all() and (m[:, 0] == 255).all()


def test_hires_fix_doubles_the_size_and_records_it(tiny, tmp_path):
    r = _generate(
        "-m",
        tiny,
        "--width",
        "32",
        "--height",
        "32",
        "--hires-scale",
        "2",
        "--hires-steps",
        "2",
        "--out",
        str(tmp_path),
    )
    assert r.exit_code == 0, r.output
    path = tmp_path / r.output.split()[0].split("/")[-1]
    assert Image.open(path).size == (64, 64)
    params = metadata.parameters_from_text(infotext.read_parameters(path))
    assert params.hires is not None and (params.hires.scale, params.hires.steps, params.hires.upscaler) == (
        2,
        2,
        "latent",
    )
    assert "Hires upscaler: Latent" in infotext.read_parameters(path)


@pytest.mark.parametrize(
    "args,hint",
    [
        (["--mask", "MASK"], "needs --image"),
        (["--image", "IMAGE", "--mask", "SMALL"], "the mask is 32x32 but the image is 64x64"),
        (["--image", "IMAGE", "--outpaint", "1,2,3"], "not four comma-separated ints"),
        (["--image", "IMAGE", "--hires-scale", "2"], "text-to-image option"),
        (["--image", "IMAGE", "--width", "64"], "give both --width and --height"),
    ],
)
def test_bad_task_options_are_named(tiny, files, args, hint):
    subst = {"MASK": str(files / "mask.png"), "IMAGE": str(files / "in.png"), "SMALL": str(files / "small_mask.png")}
    r = _generate("-m", tiny, *[subst.get(a, a) for a in args])
    assert r.exit_code == 2 and hint in r.output, r.output
