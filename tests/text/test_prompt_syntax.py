"""AUTOMATIC1111 prompt syntax: the parser against hand-computed weights (A1111's algorithm: round brackets x1.1,
square /1.1, explicit weights, unbalanced brackets to the end, escapes, BREAK, equal neighbours merged), the
chunking (75 tokens, comma backtrack, BREAK, padding), and whole images against diffusers fed with contexts
computed independently in PyTorch from the same chunks and weights."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from sdjax.text import prompt_syntax as ps
from sdjax.text.tokenizer import CLIPTokenizer

R = 1.1
S = 1 / 1.1


@pytest.mark.parametrize(
    "text,expected",
    [
        ("normal text", [("normal text", 1.0)]),
        ("an (important) word", [("an ", 1.0), ("important", R), (" word", 1.0)]),
        ("(unbalanced", [("unbalanced", R)]),
        ("\\(literal\\]", [("(literal]", 1.0)]),
        ("(unnecessary)(parens)", [("unnecessaryparens", R)]),
        (
            "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
            [
                # "(((house:1.3))" closes two of its three brackets: the third stays open to the end (x1.1)
                ("a ", 1.0),
                ("house", 1.3 * R * R),
                (" ", R),
                ("on", S * R),
                (" a ", R),
                ("hill", 0.5 * R),
                (", sun, ", R),
                ("sky", R * R * R * R),
                (".", R),
            ],
        ),
        ("[[a]] (b:0.5) c", [("a", S * S), (" ", 1.0), ("b", 0.5), (" c", 1.0)]),
        ("a BREAK b", [("a", 1.0), ("BREAK", -1.0), ("b", 1.0)]),
        ("(a BREAK b:1.5)", [("a", 1.5), ("BREAK", -1.0 * 1.5), ("b", 1.5)]),
        ("a: b", [("a: b", 1.0)]),
        ("", [("", 1.0)]),
        ("\\\\ x", [("\\ x", 1.0)]),
    ],
)
def test_parse_attention(text, expected):
    got = ps.parse_attention(text)
    assert [t for t, _ in got] == [t for t, _ in expected]
    np.testing.assert_allclose([w for _, w in got], [w for _, w in expected], rtol=1e-12)


def test_networks_are_taken_out():
    text, nets = ps.extract_networks("a cat <lora:detail:0.7>, <lora:style:1:0.5> <hypernet:x>")
    assert text == "a cat , " + " "
    assert [(n.kind, n.name, n.weight) for n in nets] == [
        ("lora", "detail", 0.7),
        ("lora", "style", 1.0),
        ("hypernet", "x", 1.0),
    ]
    with pytest.raises(ValueError, match="<lora:bad:heavy>"):
        ps.extract_networks("<lora:bad:heavy>")


@pytest.mark.parametrize(
    "tag, scale",
    [  # AUTOMATIC1111's reading: te = 1st value (default 1), unet = 2nd value (default te); te=/unet= by name
        ("<lora:n>", 1.0),
        ("<lora:n:0.7>", 0.7),
        ("<lora:n:0.5:1>", (0.5, 1.0)),
        ("<lora:n:0:0.8>", (0.0, 0.8)),
        ("<lora:n:unet=0.3>", (1.0, 0.3)),
        ("<lora:n:te=0.2>", 0.2),
        ("<lora:n:unet=1:te=0>", (0.0, 1.0)),
        ("<lora:n:0.6:unet=0.6>", 0.6),
    ],
)
def test_lora_tags_give_text_encoder_and_unet_multipliers(tag, scale):
    (net,) = ps.extract_networks(f"a cat {tag}")[1]
    assert net.lora_scale == scale


@pytest.mark.parametrize(
    "tag, message",
    [
        ("<lora:n:1:dyn=4>", "dyn="),
        ("<lora:n:1:0.5:0.2>", "3 values"),
        ("<lora:n:unet=much>", "<lora:n:unet=much>"),
        ("<lora:n:0.5:x>", "<lora:n:0.5:x>"),
    ],
)
def test_bad_lora_tags_name_what_is_wrong(tag, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ps.extract_networks(tag)


@pytest.fixture(scope="module")
def tok():
    return CLIPTokenizer.default()


def test_short_prompt_is_the_plain_tokenization(tok):
    ids, weights = ps.tokenize(tok, ["a photo of a cat", ""])
    np.testing.assert_array_equal(ids, tok(["a photo of a cat", ""]))
    assert np.all(weights == 1.0)
    sd2 = CLIPTokenizer.default(pad_token="!")  # SD 2.x: after the first EOS, the pad token
    np.testing.assert_array_equal(ps.tokenize(sd2, ["a photo"])[0], sd2(["a photo"]))


def test_weights_follow_tokens(tok):
    ids, weights = ps.tokenize(tok, ["a (red:1.5) [cat]"])
    a, red, cat = (tok.encode(w)[0] for w in ("a", "red", "cat"))
    assert ids[0, :5].tolist() == [tok.bos_token_id, a, red, cat, tok.eos_token_id]
    np.testing.assert_allclose(weights[0, :5], [1.0, 1.0, 1.5, 1 / 1.1, 1.0], rtol=1e-6)


def test_long_prompts_chunk_by_75_with_comma_backtrack_and_break(tok):
    word = tok.encode("cat")[0]
    comma = tok.token_id(",</w>")
    # 200 words: 75 + 75 + 50 tokens, three chunks, each [BOS] + 75 + [EOS]
    ids, _ = ps.tokenize(tok, [" ".join(["cat"] * 200)])
    assert ids.shape == (1, 3 * 77)
    chunks = ids.reshape(3, 77)
    assert (chunks[:, 0] == tok.bos_token_id).all() and (chunks[:, 76] == tok.eos_token_id).all()
    assert (
        (chunks[0, 1:76] == word).all()
        and (chunks[2, 1:51] == word).all()
        and (chunks[2, 51:] == tok.eos_token_id).all()
    )
    # a comma at token 70: the 5 tokens after it move to the next chunk when the chunk fills
    text = " ".join(["cat"] * 69) + " , " + " ".join(["cat"] * 10)
    ids, _ = ps.tokenize(tok, [text])
    chunks = ids.reshape(-1, 77)
    assert chunks.shape[0] == 2
    assert chunks[0, 70] == comma and (chunks[0, 71:] == tok.eos_token_id).all()
    assert (chunks[1, 1:11] == word).all() and chunks[1, 11] == tok.eos_token_id
    # a comma more than 20 tokens back: no backtrack
    text = " ".join(["cat"] * 40) + " , " + " ".join(["cat"] * 40)
    chunks = ps.tokenize(tok, [text])[0].reshape(-1, 77)
    assert (chunks[0, 1:76] != tok.eos_token_id).all() and chunks[0, 41] == comma
    # BREAK starts a chunk; the batch is padded with empty chunks [BOS] + [EOS] * 76
    ids, weights = ps.tokenize(tok, ["a BREAK b", "c"])
    assert ids.shape == (2, 154)
    assert ids[1, 77] == tok.bos_token_id and (ids[1, 78:] == tok.eos_token_id).all() and (weights[1] == 1).all()
    with pytest.raises(ValueError, match="chunks"):
        ps.tokenize(tok, [" ".join(["cat"] * 100)], chunks=1)


def _torch_context(encoder, ids, weights, *, hidden=None):
    """A1111's per-chunk encoding in PyTorch: encode each 77-token chunk, scale by the weights, restore the mean."""
    out, pooled = [], None
    for k in range(ids.shape[1] // 77):
        chunk = torch.from_numpy(ids[:, k * 77 : (k + 1) * 77].astype(np.int64))
        with torch.no_grad():
            res = encoder(chunk, output_hidden_states=True)
        z = (res.last_hidden_state if hidden is None else res.hidden_states[hidden]).double()
        w = torch.from_numpy(weights[:, k * 77 : (k + 1) * 77]).double()
        before = z.mean(dim=(1, 2), keepdim=True)
        z = z * w[:, :, None]
        z = z * (before / z.mean(dim=(1, 2), keepdim=True))
        out.append(z.float())
        if k == 0 and hasattr(res, "text_embeds"):
            pooled = res.text_embeds
    return torch.cat(out, dim=1), pooled


LONG = "a (photo:1.3) of an [astronaut], riding a ((horse)) on the moon BREAK " + ", ".join(["a tiny star"] * 15)
NEG = "(blurry:1.2), low quality"


def test_sd_images_match_diffusers_with_a1111_contexts(torch_sd1, sd1_dir):
    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    tok = pipe.tokenizer
    ids, w = ps.tokenize(tok, [LONG, NEG])
    assert ids.shape[1] == 2 * 77
    cond, _ = _torch_context(torch_sd1.text_encoder, ids[:1], w[:1])
    uncond, _ = _torch_context(torch_sd1.text_encoder, ids[1:], w[1:])
    latents = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    with torch.no_grad():
        ref = torch_sd1(
            prompt_embeds=cond, negative_prompt_embeds=uncond, num_inference_steps=2, guidance_scale=6.0,
            latents=torch.from_numpy(latents), output_type="np", height=64, width=64,
        ).images  # fmt: skip
    ours = pipe.generate(
        LONG, NEG, steps=2, guidance_scale=6.0, noise=latents, output_type="np", height=64, width=64,
        prompt_syntax="a1111",
    )  # fmt: skip
    err = np.abs(np.asarray(ours) - ref).max()
    assert err < 1e-3, err
    plain = pipe.generate(LONG, NEG, steps=2, guidance_scale=6.0, noise=latents, output_type="np", height=64, width=64)
    assert np.abs(np.asarray(plain) - ref).max() > 10 * err  # the syntax changes the image


def test_sdxl_images_match_diffusers_with_a1111_contexts(torch_sdxl, sdxl_dir):
    from sdjax import StableDiffusionXLPipeline

    pipe, _ = StableDiffusionXLPipeline.from_pretrained(str(sdxl_dir))
    tok1, tok2 = pipe.tokenizer, pipe.tokenizer_2
    ids1, w = ps.tokenize(tok1, [LONG, NEG])
    ids2, _ = ps.tokenize(tok2, [LONG, NEG])
    parts = {}
    for row, name in ((slice(0, 1), "cond"), (slice(1, 2), "uncond")):
        z1, _ = _torch_context(torch_sdxl.text_encoder, ids1[row], w[row], hidden=-2)
        z2, pooled = _torch_context(torch_sdxl.text_encoder_2, ids2[row], w[row], hidden=-2)
        parts[name] = (torch.cat([z1, z2], dim=-1), pooled)
    h = w_ = 64
    latents = np.random.default_rng(1).standard_normal((1, 4, h // 8, w_ // 8)).astype(np.float32)
    with torch.no_grad():
        ref = torch_sdxl(
            prompt_embeds=parts["cond"][0], pooled_prompt_embeds=parts["cond"][1],
            negative_prompt_embeds=parts["uncond"][0], negative_pooled_prompt_embeds=parts["uncond"][1],
            num_inference_steps=2, guidance_scale=5.0, latents=torch.from_numpy(latents), output_type="np",
            height=h, width=w_,
        ).images  # fmt: skip
    ours = pipe.generate(
        LONG, NEG, steps=2, guidance_scale=5.0, noise=latents, output_type="np", height=h, width=w_,
        prompt_syntax="a1111",
    )  # fmt: skip
    err = np.abs(np.asarray(ours) - ref).max()
    assert err < 1e-3, err


def test_bad_prompt_syntax_is_named(sd1_dir):
    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    with pytest.raises(ValueError, match="prompt_syntax"):
        pipe.generate("x", steps=1, prompt_syntax="comfy")
    with pytest.raises(ValueError, match="lora:detail"):
        pipe.generate("x <lora:detail:0.5>", steps=1, prompt_syntax="a1111")


def test_changes_reading(tok):
    assert not ps.changes_reading("a photo of a cat, 4k", tok)
    for text in ("a (cat)", "a [cat]", "a \\(cat", "a BREAK b", "x <lora:a:1>", " ".join(["cat"] * 76)):
        assert ps.changes_reading(text, tok), text
    assert not ps.changes_reading(" ".join(["cat"] * 75), tok)
    # where it does not change the reading, the ids are the plain tokenization's (so batches may be shared)
    np.testing.assert_array_equal(ps.tokenize(tok, ["a photo of a cat, 4k"])[0], tok(["a photo of a cat, 4k"]))
