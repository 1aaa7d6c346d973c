"""Issue 19, finding 5: a newline in a prompt injected lines into the PNG infotext. Prompts keep AUTOMATIC1111's
multi-line layout, but no prompt text can add a negative prompt, a parameters line or a hidden line break; what is
read back tokenizes exactly as what was asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_helpers import client, decode_png, live_server

from sdjax import infotext, metadata
from sdjax.pipelines.auto import EMBEDDED_MODEL
from sdjax.text.tokenizer import CLIPTokenizer

INJECTING_PROMPT = (
    "a cat\nNegative prompt: a dog\r\nSteps: 99, Sampler: DDIM, CFG scale: 1, Seed: 5, Size: 8x8\u2028"
    "Model: evil\rNegative prompt: injected"
)
INJECTING_NEGATIVE = "blurry\nNegative prompt: x\u2029Steps: 1, Sampler: Euler, CFG scale: 2, Seed: 9, Size: 16x16"


@pytest.fixture(scope="module")
def tokenizer():
    return CLIPTokenizer.from_folder(Path(EMBEDDED_MODEL) / "tokenizer")


def check_structure(text: str, params: metadata.ImageParameters) -> None:
    """One parameters line (the last) with the real values, one negative-prompt marker, no hidden line breaks."""
    lines = text.split("\n")
    assert text.splitlines() == lines  # no \r, U+2028 and the like: every reader sees the same lines
    assert sum(line.startswith("Negative prompt:") for line in lines) == (1 if params.negative_prompt else 0)
    raw = infotext.parse_parameters(text)
    assert (raw["Steps"], raw["Seed"], raw["Size-1"], raw["Size-2"]) == (
        str(params.steps),
        str(params.seed),
        str(params.width),
        str(params.height),
    )
    assert raw.get("Model", "") == params.model


def test_prompt_text_cannot_inject_infotext_lines(tokenizer):
    params = metadata.ImageParameters(
        INJECTING_PROMPT, INJECTING_NEGATIVE, 4, "euler_a", 7.5, 3, 64, 64, model='m,od"el\u2028x'
    )
    text = params.infotext()
    check_structure(text, params)
    back = metadata.parameters_from_text(text)
    assert (back.steps, back.seed, back.sampler, back.guidance_scale, back.width, back.model) == (
        4,
        3,
        "euler_a",
        7.5,
        64,
        'm,od"el\u2028x',
    )
    # the prompts read back are the ones asked for, token for token (CLIP collapses whitespace, lower-cases)
    assert (tokenizer([back.prompt]) == tokenizer([INJECTING_PROMPT])).all()
    assert (tokenizer([back.negative_prompt]) == tokenizer([INJECTING_NEGATIVE])).all()
    assert "injected" in back.prompt and "a dog" in back.prompt and "x" in back.negative_prompt


def test_plain_multiline_prompts_are_kept():
    params = metadata.ImageParameters("line one\nline two", "neg one\nneg two", 4, "ddim", 7.5, 1, 64, 64)
    text = params.infotext()
    assert text.startswith("line one\nline two\nNegative prompt: neg one\nneg two\nSteps: 4,")  # A1111's layout
    back = metadata.parameters_from_text(text)
    assert (back.prompt, back.negative_prompt) == ("line one\nline two", "neg one\nneg two")


def test_server_pngs_carry_escaped_infotext():
    with live_server() as s, client(s.url) as c:
        r = c.post(
            "/sdapi/v1/txt2img",
            json={"prompt": INJECTING_PROMPT, "negative_prompt": INJECTING_NEGATIVE, "seed": 11, "steps": 3},
        )
        assert r.status_code == 200, r.text
        _, text = decode_png(r.json()["images"][0])
        params = metadata.parameters_from_text(text)
        check_structure(text, params)
        assert (params.seed, params.steps) == (11, 3)


@pytest.mark.parametrize(
    "model, name",
    [
        ("/nets/sd35_canny.safetensors", "sd35_canny"),  # a file: its stem, as the server lists it
        ("/nets/control_v11p_sd15_canny.pth", "control_v11p_sd15_canny"),
        ("/nets/tiny_canny", "tiny_canny"),  # a diffusers folder: its name
        ("/nets/canny.v1.1", "canny.v1.1"),  # a folder with dots keeps them
        ("lllyasviel/sd-controlnet-canny", "sd-controlnet-canny"),
    ],
)
def test_controlnet_unit_names_the_net_as_served(tmp_path, model, name):
    """A ControlNet file's unit wrote `Model: sd35_canny.safetensors`, a name no server lists (files are served by
    their stem), so pasting the infotext back failed with "unknown ControlNet"."""
    from sdjax.server.controlnet import list_controlnets

    unit = metadata.ControlUnit(model=model, module="canny")
    assert f"Model: {name}," in unit.infotext()
    if model.endswith(".safetensors"):
        (tmp_path / Path(model).name).write_bytes(b"")
        assert name in list_controlnets(str(tmp_path))
