"""`CLIPTokenizer.with_added_tokens` against transformers' `CLIPTokenizer.add_tokens` (textual inversion's tokens)."""

from __future__ import annotations

import pytest

from sdjax.text.tokenizer import CLIPTokenizer

transformers = pytest.importorskip("transformers")

TOKENS = ["<cat-toy>", "my-style", "my-style_1", "my-style_2"]
TEXTS = [
    "a photo of <cat-toy> on a beach",
    "x<cat-toy>y, <cat-toy><cat-toy>",
    "A PHOTO OF <CAT-TOY>",
    "my-style_2 then my-style_1 then my-style",
    "mystyle my style my-styles",
]


@pytest.fixture(scope="module")
def pair():
    import reference

    ref = reference.clip_tokenizer()
    ref.add_tokens(TOKENS)
    ours = CLIPTokenizer.default().with_added_tokens(TOKENS)
    return ours, ref


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(pair, text):
    ours, ref = pair
    want = ref(text, padding="max_length", max_length=77, truncation=True).input_ids
    assert ours([text])[0].tolist() == want


def test_new_ids_follow_the_vocabulary_and_the_original_is_unchanged(pair):
    ours, _ = pair
    assert [ours.token_id(t) for t in TOKENS] == [49408, 49409, 49410, 49411]
    assert ours.vocab_size == 49412
    plain = CLIPTokenizer.default()
    assert plain.token_id("<cat-toy>") is None and plain.vocab_size == 49408


def test_expansion_and_repeated_tokens():
    tok = CLIPTokenizer.default().with_added_tokens(["<t>", "<t>_1"], expand={"<t>": "<t> <t>_1"})
    assert tok(["a <t> b"])[0][1:5].tolist() == [tok.encode("a")[0], 49408, 49409, tok.encode("b")[0]]
    with pytest.raises(ValueError, match=r"already in the tokenizer's vocabulary"):
        tok.with_added_tokens(["<t>_1"])
    with pytest.raises(ValueError, match=r"already in the tokenizer's vocabulary"):  # a BPE piece, as diffusers
        CLIPTokenizer.default().with_added_tokens(["tok"])
    with pytest.raises(ValueError, match=r"already in the tokenizer's vocabulary"):
        CLIPTokenizer.default().with_added_tokens(["photo</w>"])
