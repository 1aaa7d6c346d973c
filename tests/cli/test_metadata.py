"""The PNG `parameters` chunk in AUTOMATIC1111's format: writing, parsing, round trips, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import sdjax
from sdjax import infotext, metadata, samplers
from sdjax.metadata import GenerationRequest, ImageParameters

PARAMS = ImageParameters(
    prompt="a photo of an astronaut riding a horse",
    negative_prompt="blurry, low quality",
    steps=20,
    sampler="Euler a",
    guidance_scale=7.5,
    seed=1234,
    width=512,
    height=768,
    model="stable-diffusion-v1-5",
)


def test_format_is_automatic1111s():
    assert PARAMS.infotext() == (
        "a photo of an astronaut riding a horse\n"
        "Negative prompt: blurry, low quality\n"
        "Steps: 20, Sampler: Euler a, CFG scale: 7.5, Seed: 1234, Size: 512x768, Model: stable-diffusion-v1-5"
    )


def test_no_negative_prompt_line_when_empty():
    text = infotext.format_parameters(ImageParameters("cat", "", 4, "ddim", 7.0, 0, 64, 64))
    assert text == "cat\nSteps: 4, Sampler: DDIM, CFG scale: 7.0, Seed: 0, Size: 64x64"


def test_parse_a_file_written_by_automatic1111():
    # An infotext as the web UI 1.10 writes it, with fields sdjax does not know.
    text = (
        "masterpiece, (best quality:1.2), 1girl\nNegative prompt: lowres, bad anatomy\n"
        "Steps: 28, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, Seed: 3050862934, "
        "Size: 512x640, Model hash: 6ce0161689, Model: v1-5-pruned-emaonly, "
        'Lora hashes: "lora_a: abc123, lora_b: def456", Version: v1.10.1'
    )
    raw = infotext.parse_parameters(text)
    assert raw["Prompt"] == "masterpiece, (best quality:1.2), 1girl"
    assert raw["Negative prompt"] == "lowres, bad anatomy"
    assert raw["Schedule type"] == "Karras"
    assert raw["Lora hashes"] == "lora_a: abc123, lora_b: def456"
    assert (raw["Size-1"], raw["Size-2"]) == ("512", "640")
    p = metadata.parameters_from_text(text)
    assert (p.steps, p.sampler, p.guidance_scale, p.seed, p.width, p.height, p.model) == (
        28,
        "dpmpp_2m_karras",
        6.5,
        3050862934,
        512,
        640,
        "v1-5-pruned-emaonly",
    )


@pytest.mark.parametrize(
    "prompt,negative",
    [
        ("plain", ""),
        ("two\nlines, with commas: and colons", "neg\nacross lines"),
        ("unicode 猫 ✓ émigré", "ünïcödé"),
        ("", "only a negative prompt"),
    ],
)
def test_round_trip(prompt, negative):
    p = ImageParameters(prompt, negative, 30, "dpmpp_2m_karras", 4.0, 2**32 - 1, 1024, 576, "org/model-name", 3)
    assert metadata.parameters_from_text(p.infotext()) == p


def test_values_with_separators_are_json_quoted():
    p = ImageParameters("x", "", 1, "euler_a", 1.0, 0, 8, 8, model="a, b: c")
    text = p.infotext()
    assert 'Model: "a, b: c"' in text
    assert metadata.parameters_from_text(text).model == "a, b: c"


@pytest.mark.parametrize(
    "spelling,registry,shown",
    [
        ("euler_a", "euler_a", "Euler a"),
        ("Euler a", "euler_a", "Euler a"),
        ("euler-a", "euler_a", "Euler a"),
        ("DPM++ 2M Karras", "dpmpp_2m_karras", "DPM++ 2M Karras"),
        ("dpmpp_2m_sde", "dpmpp_2m_sde", "DPM++ 2M SDE"),
        ("pndm", "pndm", "PLMS"),
        ("ddpm", "ddpm", "DDPM"),
        ("DPM++ SDE", "dpmpp_sde", "DPM++ SDE"),
        ("euler a uniform", "Euler a Uniform", "Euler a Uniform"),
        ("Restart", "Restart", "Restart"),  # A1111 has it, diffusers does not: kept as written
    ],
)
def test_sampler_names(spelling, registry, shown):
    assert infotext.sampler_id(spelling) == registry
    assert infotext.sampler_display_name(spelling) == shown


def test_unknown_sampler_survives_a_round_trip():
    p = ImageParameters("x", "", 1, "Restart", 1.0, 0, 8, 8)
    assert metadata.parameters_from_text(p.infotext()).sampler == "Restart"


@pytest.mark.parametrize(
    "sampler,line",
    [
        ("dpmpp_2m_karras", "Sampler: DPM++ 2M, Schedule type: Karras,"),
        ("DPM++ 2M SDE Heun Exponential", "Sampler: DPM++ 2M SDE Heun, Schedule type: Exponential,"),
        ("euler_a", "Sampler: Euler a, CFG"),
    ],
)
def test_schedule_type_is_written_apart_and_read_back(sampler, line):
    p = ImageParameters("x", "", 1, sampler, 1.0, 0, 8, 8)
    assert line in p.infotext()
    back = metadata.parameters_from_text(p.infotext()).sampler
    assert samplers.get_sampler(back) == samplers.get_sampler(sampler)


def test_missing_fields_are_named():
    with pytest.raises(ValueError, match="Steps"):
        metadata.parameters_from_text("just a prompt")


def test_png_bytes_are_deterministic_and_readable(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    for prompt in ("latin-1 prompt", "not latin-1: 猫"):  # tEXt and iTXt
        p = ImageParameters(prompt, "", 2, "ddim", 7.5, 5, 24, 16)
        a = infotext.png_bytes(pixels, p.infotext())
        assert a == infotext.png_bytes(Image.fromarray(pixels), p.infotext())
        path = tmp_path / "x.png"
        path.write_bytes(a)
        assert infotext.read_parameters(path) == p.infotext() == infotext.read_parameters(a)
        with Image.open(path) as im:  # what AUTOMATIC1111's PNG Info reads
            assert im.info["parameters"] == p.infotext()
            np.testing.assert_array_equal(np.asarray(im), pixels)
    assert infotext.read_parameters(infotext.png_bytes(pixels)) is None


def test_request_gives_each_image_its_own_seed():
    r = GenerationRequest(
        "p",
        "n",
        num_images=3,
        seed=2**32 - 2,
        steps=5,
        guidance_scale=3.0,
        width=64,
        height=32,
        sampler="Euler",
        model="m",
    )
    images = r.images()
    assert [im.seed for im in images] == [2**32 - 2, 2**32 - 1, 0]
    assert {im.image_index for im in images} == {0}
    assert len({im.shape_key for im in images}) == 1 and images[0].shape_key[:4] == (5, 32, 64, "euler")


def test_generate_images_refuses_mixed_shapes():
    a = ImageParameters("p", "", 4, "euler", 7.5, 0, 64, 64)
    b = ImageParameters("p", "", 5, "euler", 7.5, 0, 64, 64)
    with pytest.raises(ValueError, match="share"):
        metadata.generate_images(object(), [a, b])


def test_model_label(tmp_path):
    assert infotext.model_label(None) == "sdjax/embedded"
    assert infotext.model_label("embedded") == "sdjax/embedded"
    assert infotext.model_label(sdjax.EMBEDDED_MODEL) == "sdjax/embedded"
    assert infotext.model_label("org/name") == "org/name"
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert infotext.model_label(str(folder)) == "my-model"


@pytest.mark.parametrize(
    "pair, fallback, expected",
    [
        (("DPM++ 2M", "Automatic"), False, "dpmpp_2m_karras"),  # A1111 1.6+: "Automatic" is Karras for DPM++ 2M
        (("Euler a", "Automatic"), False, "Euler a Uniform"),  # its own (uniform) schedule, named
        (("pndm", "Automatic"), True, "pndm"),  # a registry name the server defaults to
        (("pndm", "Automatic"), False, "sampler"),
        (("nope", "Automatic"), True, "sampler"),
        (("Euler", "Bogus"), False, "schedule"),
        (("Euler a", "Karras"), False, "schedule"),
    ],
)
def test_a1111_sampler_choice_is_one_rule_for_every_face(pair, fallback, expected):
    if expected in ("sampler", "schedule"):
        with pytest.raises(infotext.SamplerChoiceError) as e:
            infotext.a1111_sampler(*pair, registry_fallback=fallback)
        assert e.value.field == expected
    else:
        assert infotext.a1111_sampler(*pair, registry_fallback=fallback) == expected
