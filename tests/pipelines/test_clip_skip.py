"""CLIP skip (A1111 semantics) against diffusers' `clip_skip` (its count is A1111's minus one).

diffusers 0.42 skips layers for the prompt only; A1111 (and sdjax) encode the negative prompt the same way, so the
negative reference is diffusers' encoding of the negative text as a prompt. diffusers' SD 1.x/2.x path reads
`text_encoder.text_model.final_layer_norm`, which transformers 5's `CLIPTextModel` no longer has (its final layer
norm sits on the model itself): the test gives the reference that attribute while it runs (`text_model_alias`).

Tolerances (float32): text embeddings 1e-5 absolute (measured ~1e-6), images 1e-3.
"""

from __future__ import annotations

import contextlib
import types

import jax
import numpy as np
import pytest
from compile_counter import counting_compiles

torch = pytest.importorskip("torch")

ATOL = 1e-5
PROMPT, NEGATIVE = "a photo of an astronaut riding a horse", "blurry, low quality"


@contextlib.contextmanager
def text_model_alias(*encoders):
    """transformers 5: give each `CLIPTextModel` the `text_model.final_layer_norm` diffusers reads."""
    patched = [e for e in encoders if e is not None and not hasattr(e, "text_model")]
    for e in patched:
        e.text_model = types.SimpleNamespace(final_layer_norm=e.final_layer_norm)
    try:
        yield
    finally:
        for e in patched:
            del e.text_model


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    pipe.devices = jax.devices()[:1]
    return pipe


@pytest.fixture(scope="module")
def sdxl(sdxl_dir):
    from sdjax import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(str(sdxl_dir))[0]


def encode(pipe, prompts, negatives, clip_skip):
    """sdjax's (context, added) for a batch, through the conditioning's host and device halves."""
    cond = pipe.generator.models.conditioning
    inputs = {
        "ids": cond.tokenize(prompts),
        "neg_ids": cond.tokenize(negatives),
        **cond.host_inputs(negative_prompts=negatives, height=64, width=64, task="txt2img", clip_skip=clip_skip),
    }
    return cond.encode(pipe.params, inputs, cfg=True)


def diffusers_embeds(torch_pipe, text, clip_skip):
    """diffusers' prompt embedding (and SDXL's pooled one) of `text` for A1111's `clip_skip`."""
    skip = None if clip_skip == 1 else clip_skip - 1
    with torch.no_grad(), text_model_alias(torch_pipe.text_encoder):
        out = torch_pipe.encode_prompt(
            text, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False, clip_skip=skip
        )
    return out[0].numpy(), (out[2].numpy() if len(out) > 2 else None)


@pytest.mark.parametrize("kind,clip_skip", [("sd1", 1), ("sd1", 2), ("sd1", 4), ("sd2", 2)])
def test_sd_matches_diffusers(kind, clip_skip, request):
    from sdjax import StableDiffusionPipeline

    torch_pipe = request.getfixturevalue(f"torch_{kind}")
    if kind == "sd1":
        pipe = request.getfixturevalue("sd1")
    else:
        pipe = StableDiffusionPipeline.from_pretrained(str(request.getfixturevalue(f"{kind}_dir")))[0]
    context, _ = encode(pipe, [PROMPT], [NEGATIVE], clip_skip)
    pos, _ = diffusers_embeds(torch_pipe, PROMPT, clip_skip)
    neg, _ = diffusers_embeds(torch_pipe, NEGATIVE, clip_skip)
    np.testing.assert_allclose(np.asarray(context), np.concatenate([neg, pos]), atol=ATOL)
    if clip_skip > 1:  # not trivially the last layer
        last, _ = diffusers_embeds(torch_pipe, PROMPT, 1)
        assert np.abs(last - pos).max() > 1e-2


@pytest.mark.parametrize("clip_skip", [1, 3])
def test_sdxl_matches_diffusers(sdxl, torch_sdxl, clip_skip):
    context, added = encode(sdxl, [PROMPT], [NEGATIVE], clip_skip)
    pos, pooled = diffusers_embeds(torch_sdxl, PROMPT, clip_skip)
    neg, neg_pooled = diffusers_embeds(torch_sdxl, NEGATIVE, clip_skip)
    np.testing.assert_allclose(np.asarray(context), np.concatenate([neg, pos]), atol=ATOL)
    # The pooled embedding stays the last layer's.
    np.testing.assert_allclose(np.asarray(added["text_embeds"]), np.concatenate([neg_pooled, pooled]), atol=ATOL)
    if clip_skip > 1:
        default, _ = diffusers_embeds(torch_sdxl, PROMPT, 1)
        assert np.abs(default - pos).max() > 1e-2


def test_one_batch_mixes_clip_skips(sd1):
    mixed, _ = encode(sd1, [PROMPT, "a red circle"], ["", "green"], [2, 1])
    first, _ = encode(sd1, [PROMPT], [""], 2)
    second, _ = encode(sd1, ["a red circle"], ["green"], 1)
    mixed = np.asarray(mixed)  # (neg 0, neg 1, pos 0, pos 1)
    np.testing.assert_array_equal(mixed[[0, 2]], np.asarray(first))
    np.testing.assert_array_equal(mixed[[1, 3]], np.asarray(second))


def test_images_match_diffusers_and_clip_skip_never_recompiles(sd1, torch_sd1):

    latents = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    kw = dict(steps=2, height=64, width=64, output_type="np", noise=latents, negative_prompt=NEGATIVE)
    default = sd1.generate(PROMPT, **kw)  # compiles
    with counting_compiles() as compiles:
        skipped = {n: sd1.generate(PROMPT, clip_skip=n, **kw) for n in (2, 3)}
    assert compiles == [], f"{len(compiles)} compilations for another clip_skip"
    pos, _ = diffusers_embeds(torch_sd1, PROMPT, 2)
    neg, _ = diffusers_embeds(torch_sd1, NEGATIVE, 2)
    with torch.no_grad():
        ref = torch_sd1(
            prompt_embeds=torch.from_numpy(pos),
            negative_prompt_embeds=torch.from_numpy(neg),
            num_inference_steps=2,
            latents=torch.from_numpy(latents),
            output_type="np",
            height=64,
            width=64,
        ).images
    err = np.abs(skipped[2] - ref).max()
    assert err < 1e-3, f"images: max abs error {err:.2e}"
    assert np.abs(skipped[2] - default).max() > 1e-2 and np.abs(skipped[3] - skipped[2]).max() > 1e-2


@pytest.mark.parametrize("bad", [0, -1, 6, 2.0, "2", True, [1, 2]])
def test_bad_clip_skip_names_the_argument(sd1, bad):
    with pytest.raises(ValueError, match=r"clip_skip"):
        sd1.generate(PROMPT, clip_skip=bad, steps=2, height=64, width=64)
