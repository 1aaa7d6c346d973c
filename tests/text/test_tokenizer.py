"""sdjax's CLIP tokenizer against transformers' `CLIPTokenizer` (5.x, tokenizers-backed): ids must be identical."""

import json
import shutil
import warnings

import numpy as np
import pytest
import reference

from sdjax.text.tokenizer import CLIPTokenizer, PromptTruncatedWarning

PADS = ["<|endoftext|>", "!"]

PROMPTS = [
    "a photo of an astronaut riding a horse on mars",
    "",
    " ",
    "A PHOTO OF A CAT, Trending On ArtStation",
    "café naïve résumé Ångström façade",
    "cafe\u0301 (combining accent) vs café",
    "emoji 😀🐱‍👤👍🏽 and ❤️ hearts",
    "&amp; &lt;b&gt; &quot;quoted&quot; &#39; &nbsp;",
    "東京の夜景、美しい。中文测试 한국어",
    "Привет мир, مرحبا, नमस्ते",
    "wow!!! really?! ... --- ((masterpiece)), [best quality:1.2] {x|y} <lora:abc:0.5>",
    "numbers 1234567890 3.14159 1e-5 1,000,000 ５６ ½",
    "tabs\tand\nnewlines\r\n\n  repeated   spaces\u00a0nbsp\u2003em-space",
    "it's they're we've I'm you'll he'd DON'T IT'S",
    "a <|endoftext|> in the middle and <|startoftext|> too",
    "upper-case <|ENDOFTEXT|> is plain text here",
    "!",
    "!!! hello!!",
    "ﬁnancial ﬂow ＡＢＣ full-width",
    "zero\u200bwidth\u200djoiner and \x00 control \x7f chars",
    "a " * 75,  # exactly 75 tokens: fits without truncation
    "a " * 76,  # one too many
    "an extremely detailed oil painting of a lighthouse on a cliff at sunset, " * 6,
]


def _hf_ids(tok, texts):
    return np.asarray(tok(texts, padding="max_length", max_length=77, truncation=True).input_ids, np.int32)


@pytest.mark.parametrize("pad", PADS)
def test_default_matches_transformers(pad):
    ours = CLIPTokenizer.default(pad_token=pad)
    theirs = reference.clip_tokenizer(pad_token=pad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTruncatedWarning)
        got = ours(PROMPTS)
    assert got.dtype == np.int32 and got.shape == (len(PROMPTS), 77)
    want = _hf_ids(theirs, PROMPTS)
    for text, g, w in zip(PROMPTS, got, want, strict=True):
        assert g.tolist() == w.tolist(), f"ids differ for {text!r}"
    assert ours.pad_token_id == theirs.pad_token_id == (0 if pad == "!" else 49407)
    assert (ours.bos_token_id, ours.eos_token_id) == (49406, 49407)


def test_single_string_and_list():
    tok = CLIPTokenizer.default()
    one = tok("a photo of a cat")
    assert one.shape == (1, 77)
    np.testing.assert_array_equal(one[0, :7], [49406, 320, 1125, 539, 320, 2368, 49407])
    assert (one[0, 7:] == 49407).all()
    np.testing.assert_array_equal(tok(["a photo of a cat", "a photo of a cat"]), np.repeat(one, 2, axis=0))
    assert tok([]).shape == (0, 77)


def test_pad_bang_is_a_special_token_like_transformers():
    """SDXL's tokenizer_2 pads with "!", which transformers registers as special: "!!" is two id-0 tokens."""
    plain, bang = CLIPTokenizer.default(), CLIPTokenizer.default(pad_token="!")
    assert plain.encode("wow!!") == [2781, 748]
    assert bang.encode("wow!!") == [2781, 0, 0]
    assert bang("")[0, :3].tolist() == [49406, 49407, 0]


def test_truncation_keeps_eos_last_and_warns_with_dropped_text():
    tok = CLIPTokenizer.default()
    text = "red " * 74 + "blue green"
    with pytest.warns(PromptTruncatedWarning, match=r"76 tokens.*dropped: 'green'"):
        ids = tok([text])
    assert ids[0, -1] == 49407 and ids[0, 0] == 49406
    assert tok.decode(ids[0]) == "red " * 74 + "blue"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok(["a " * 75])  # 75 tokens fit: no warning


def test_rejects_non_strings():
    tok = CLIPTokenizer.default()
    with pytest.raises(TypeError, match="list of str"):
        tok([1, 2])
    with pytest.raises(TypeError):
        tok(None)


def _write_folder(path, pad, style):
    """Tokenizer folders as real checkpoints ship them.

    legacy: vocab.json + merges.txt, serialized AddedTokens with normalized=true (SD 1.5, SDXL);
    decoder: an `added_tokens_decoder` in tokenizer_config.json (transformers 4.3x saves);
    v5: what transformers 5 `save_pretrained` writes (tokenizer.json + tokenizer_config.json).
    """
    path.mkdir()
    if style == "v5":
        reference.clip_tokenizer(pad_token=pad).save_pretrained(str(path))
        return path
    shutil.copy(reference.ASSETS / "vocab.json", path)
    shutil.copy(reference.ASSETS / "merges.txt", path)

    def serialized(content, normalized=True):
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": normalized,
            "rstrip": False,
            "single_word": False,
        }

    config = {
        "add_prefix_space": False,
        "do_lower_case": True,
        "errors": "replace",
        "model_max_length": 77,
        "pad_token": pad,
        "tokenizer_class": "CLIPTokenizer",
    }
    if style == "legacy":
        config.update(
            bos_token=serialized("<|startoftext|>"),
            eos_token=serialized("<|endoftext|>"),
            unk_token=serialized("<|endoftext|>"),
        )
        special_map = {
            k: {kk: vv for kk, vv in v.items() if kk != "__type"}
            for k, v in config.items()
            if k.endswith("_token") and isinstance(v, dict)
        }
        (path / "special_tokens_map.json").write_text(json.dumps({**special_map, "pad_token": pad}))
    else:
        decoder = {
            "49406": {**serialized("<|startoftext|>"), "special": True},
            "49407": {**serialized("<|endoftext|>", normalized=False), "special": True},
        }
        if pad == "!":
            decoder["0"] = {**serialized("!", normalized=False), "special": True}
        for v in decoder.values():
            v.pop("__type")
        config.update(
            added_tokens_decoder=decoder,
            bos_token="<|startoftext|>",
            eos_token="<|endoftext|>",
            unk_token="<|endoftext|>",
        )
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("style", ["legacy", "decoder", "v5"])
@pytest.mark.parametrize("pad", PADS)
def test_from_folder_matches_transformers_from_pretrained(tmp_path, pad, style):
    from transformers import CLIPTokenizer as HFTokenizer

    folder = _write_folder(tmp_path / "tokenizer", pad, style)
    ours, theirs = CLIPTokenizer.from_folder(folder), HFTokenizer.from_pretrained(str(folder))
    # Special-token strings in odd case depend on each token's `normalized` flag, which differs between styles.
    texts = PROMPTS + ["<|STARTOFTEXT|> x <|EndOfText|> y", "<|endoftext|>!<|startoftext|>"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTruncatedWarning)
        got = ours(texts)
    want = _hf_ids(theirs, texts)
    for text, g, w in zip(texts, got, want, strict=True):
        assert g.tolist() == w.tolist(), f"ids differ for {text!r} ({style}, pad {pad!r})"
    assert ours.model_max_length == theirs.model_max_length == 77


def test_from_folder_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        CLIPTokenizer.from_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        CLIPTokenizer.from_folder(tmp_path / "nope")


def test_vocab_files_are_read_again_when_they_change(tmp_path):
    """The read `vocab.json` + `merges.txt` are kept per file version (every pipeline builds a tokenizer from the
    same files): a rewritten vocabulary is read again, not served from the kept copy."""
    import os

    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    shutil.copy(reference.ASSETS / "merges.txt", merges)
    table = json.loads((reference.ASSETS / "vocab.json").read_text(encoding="utf-8"))
    vocab.write_text(json.dumps(table), encoding="utf-8")
    before = CLIPTokenizer.from_files(vocab, merges)
    assert CLIPTokenizer.from_files(vocab, merges)._backend.token_to_id("cat</w>") == table["cat</w>"]
    table["cat</w>"], table["dog</w>"] = table["dog</w>"], table["cat</w>"]  # two ids swapped, same size
    vocab.write_text(json.dumps(table), encoding="utf-8")
    os.utime(vocab, ns=(os.stat(vocab).st_atime_ns, os.stat(vocab).st_mtime_ns + 10**9))
    after = CLIPTokenizer.from_files(vocab, merges)
    assert after(["a cat"])[0][2] == before(["a dog"])[0][2] == table["cat</w>"]
