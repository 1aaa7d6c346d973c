"""The family conditioning options of a request in the PNG infotext (`infotext.CONDITIONING_KEYS`): the texts of the
encoders that read their own (`prompt_2`, `prompt_3` and their negatives: Flux's T5, SD 3's CLIP-G and T5, as
ComfyUI's CLIPTextEncodeFlux / CLIPTextEncodeSD3 give them) and `zero_negative` (ConditioningZeroOut as the
negative). Written as `Prompt 2: "..."`, ..., `Zero negative: True`, read back to the same request; a tiny Flux dev
image regenerated from its PNG's parameters is the same image, and it needs those fields."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from sdjax import cli, infotext, metadata

TEXTS = (
    ("prompt_2", 'a red fox, deep snow: "dawn"\nsecond line'),
    ("prompt_3", ""),  # an empty text: that encoder reads the empty prompt, not the main one
    ("negative_prompt_2", "blurry"),
    ("negative_prompt_3", "Negative prompt: not a marker"),
    ("zero_negative", True),
)


def test_conditioning_round_trip():
    r = metadata.GenerationRequest("a fox", negative_prompt="", steps=4, sampler="euler", seed=3, width=32,
                                   height=32, guidance_scale=2.0, conditioning=TEXTS)  # fmt: skip
    (im,) = r.images()
    text = im.infotext()
    *_, params = text.split("\n")
    assert params.endswith(
        'Prompt 2: "a red fox, deep snow: \\"dawn\\"\\nsecond line", Prompt 3: "", Negative prompt 2: "blurry", '
        'Negative prompt 3: "Negative prompt: not a marker", Zero negative: True'
    )
    raw = infotext.parse_parameters(text)
    assert raw["Prompt"] == "a fox" and raw["Negative prompt"] == ""  # the texts stay out of the prompts
    assert raw["Prompt 3"] == "" and raw["Zero negative"] == "True"
    back = metadata.parameters_from_text(text)
    assert back.conditioning == TEXTS and back == im
    # each option alone, and none (no key written); a false flag is the default and not written
    for option in TEXTS:
        (one,) = dataclasses.replace(r, conditioning=(option,)).images()
        assert metadata.parameters_from_text(one.infotext()) == one
    (off,) = dataclasses.replace(r, conditioning=(("zero_negative", False),)).images()
    assert "Zero negative" not in off.infotext()
    assert metadata.parameters_from_text(off.infotext()).conditioning == ()
    # the written order is the keys' (the planner builds its options in that order)
    (shuffled,) = dataclasses.replace(r, conditioning=TEXTS[::-1]).images()
    assert shuffled.infotext() == text


def test_negative_switch_round_trip():
    """A negative handed over at a step (ComfyUI's ConditioningSetTimestepRange pair) is written as `Negative switch
    at step`, `Negative prompt after switch` and the options with " after switch", and read back."""
    switch = metadata.NegativeSwitch(3, "", (("negative_prompt_2", "a, b"), ("zero_negative", True)))
    r = metadata.GenerationRequest("a fox", negative_prompt="blurry", steps=6, sampler="euler", seed=3, width=32,
                                   height=32, guidance_scale=4.5, negative_switch=switch)  # fmt: skip
    (im,) = r.images()
    text = im.infotext()
    assert text.endswith('Negative switch at step: 3, Negative prompt after switch: "", Negative prompt 2 after '
                         'switch: "a, b", Zero negative after switch: True')  # fmt: skip
    back = metadata.parameters_from_text(text)
    assert back == im and back.negative_switch == switch and back.negative_prompt == "blurry"
    (other,) = dataclasses.replace(r, negative_switch=metadata.NegativeSwitch(2, "")).images()
    assert other.shape_key != im.shape_key  # (the step is part of what a batch shares)


def test_conditioning_fields_refuse_what_they_cannot_write():
    with pytest.raises(ValueError, match="no infotext key"):
        infotext.conditioning_fields((("guidance_2", 1.0),))
    with pytest.raises(ValueError, match="Zero negative"):
        metadata.parameters_from_text("p\nSteps: 4, Sampler: Euler, CFG scale: 7, Seed: 1, Size: 8x8, Zero negative: 1")


def test_every_option_the_comfy_planner_writes_has_a_key():
    from sdjax.server.comfy.inputs import ENCODER_OPTIONS

    names = {n for family in ENCODER_OPTIONS.values() for n in family.values()}
    names |= {f"negative_{n}" for n in names} | {"zero_negative"}
    assert names <= set(infotext.CONDITIONING_KEYS)


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    import flux_reference
    import jax
    import t5_reference

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("flux") / "flux-dev"
    flux_reference.flux_pipeline("dev", tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    pipe = cli.load_pipeline(str(folder), "float32")
    pipe.devices = jax.devices()[:1]
    return pipe


def test_flux_image_regenerates_from_its_png(flux_dev, tmp_path):
    """generate -> PNG -> `sdjax pnginfo` / `parameters_from_text` -> generate gives the same image; the T5 text
    and the zero negative it carries change the image (so the round trip needs them)."""
    import numpy as np

    pipe = flux_dev
    h, w = pipe.default_size
    r = metadata.GenerationRequest("a red fox", negative_prompt="", seed=3, steps=2, guidance_scale=2.0, width=w,
                                   height=h, sampler="Euler Simple",
                                   conditioning=(("prompt_2", "a red fox in deep snow, at dawn"),
                                                 ("zero_negative", True)))  # fmt: skip
    (im,) = r.images()
    first = metadata.generate_images(pipe, [im])
    path = tmp_path / "fox.png"
    path.write_bytes(infotext.png_bytes(first[0], im.infotext()))
    shown = CliRunner().invoke(cli.app, ["pnginfo", "--json", str(path)])
    assert shown.exit_code == 0, shown.stdout
    fields = json.loads(shown.stdout)
    assert fields["Prompt 2"] == "a red fox in deep snow, at dawn" and fields["Zero negative"] == "True"
    back = metadata.parameters_from_text(infotext.read_parameters(path))
    assert back == im
    again = metadata.generate_images(pipe, [back])
    np.testing.assert_array_equal(again, first)
    plain = metadata.generate_images(pipe, [dataclasses.replace(back, conditioning=())])
    assert np.abs(plain.astype(int) - first.astype(int)).max() > 1
