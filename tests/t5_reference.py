"""The T5 v1.1 reference for tests: a small real T5 tokenizer folder and a tiny transformers `T5EncoderModel`.

Test-only (sdjax never imports torch or transformers). The Flux and SD 3 pipeline tests use:

- `write_t5_tokenizer(folder) -> folder`: `tokenizer.json` + `tokenizer_config.json` + `special_tokens_map.json`
  laid out as the `tokenizer_2/` folder of black-forest-labs/FLUX.1-dev (`<pad>`=0, `</s>`=1, `<unk>`=2, the
  SentencePiece pieces, then `<extra_id_99>` .. `<extra_id_0>`; a `Precompiled` normalizer, `WhitespaceSplit` +
  `Metaspace` pre-tokenizer, `</s>` appended), which transformers' `T5TokenizerFast.from_pretrained` loads.
  The vocabulary is `T5_VOCAB_SIZE` (~400) pieces: common prompt words, sub-words and single characters, so that
  any ASCII text tokenizes without `<unk>` and a few non-ASCII characters do not.
- `T5_TINY`: the `T5EncoderModel` config of FLUX.1-dev's `text_encoder_2` (gated-gelu, relative attention with 32
  buckets up to distance 128, `tie_word_embeddings: false`) shrunk to d_model 32, 2 layers, 4 heads of 8, and the
  tokenizer's vocabulary.
- `t5_encoder(config=T5_TINY, seed=0)`: that torch model from a fixed seed, layer-norm weights perturbed (ones
  would hide a missing norm); `save_t5_encoder(folder, config=T5_TINY, seed=0) -> folder`: saved with
  `save_pretrained` (`config.json` + `model.safetensors`, which holds `shared.weight` and not its tied copy
  `encoder.embed_tokens.weight`, as the FLUX.1-dev files do).
"""

from __future__ import annotations

import json
import string
import struct
from collections.abc import Mapping
from pathlib import Path

EXTRA_IDS = 100
MODEL_MAX_LENGTH = 512  # FLUX.1-dev's tokenizer_2

_WORDS = """a an the of and with in on at by for to from is are this that it its as photo picture painting
portrait drawing render image art style cat cats dog dogs horse astronaut riding mars moon sky night day sun
city street forest mountain mountains river lake sea ocean beach house castle tree trees flower flowers garden
woman man girl boy child people face eyes hair red green blue yellow black white golden dark light bright
beautiful majestic highly detailed realistic cinematic lighting soft hard big small old new tall young happy
sitting standing jumping running flying walking wearing holding looking stone rock water fire snow rain cloud
clouds sunset sunrise trending artstation digital oil canvas 8k 4k hd ultra sharp focus greg rutkowski
studio ghibli anime cyberpunk fantasy sci fi space stars galaxy planet robot car train boat bridge road""".split()  # noqa: SIM905
_SUBWORDS = "s es ed ing er est ly ness ful less tion ation ment al ic ous ive able un re in dis".split()  # noqa: SIM905
_UNICODE = "éèüñçø東京😀"


def _pieces() -> list[tuple[str, float]]:
    """SentencePiece order: specials, then pieces by decreasing log-probability, then the sentinels reversed."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{w}", -3.0 - i / 50) for i, w in enumerate(_WORDS)]
    pieces += [(w, -7.0 - i / 50) for i, w in enumerate(_SUBWORDS)]
    chars = string.ascii_letters + string.digits + string.punctuation + _UNICODE
    pieces += [(f"▁{c}", -9.0) for c in chars if f"▁{c}" not in {p for p, _ in pieces}]
    pieces += [(c, -10.0) for c in chars if c not in {p for p, _ in pieces}]
    pieces += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(EXTRA_IDS))]
    assert len({p for p, _ in pieces}) == len(pieces), "a piece is listed twice"
    return pieces


T5_VOCAB_SIZE = len(_pieces())

T5_TINY = dict(
    vocab_size=T5_VOCAB_SIZE,
    d_model=32,
    d_kv=8,
    d_ff=37,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
    dropout_rate=0.1,
)

# A few NFKC mappings in SentencePiece's `precompiled_charsmap` format (T5's normalizer is `nmt_nfkc`): the
# full-width ASCII forms, the no-break space, the ellipsis, the fi ligature, a combining accent (a two-codepoint
# grapheme) and a zero-width space that is removed.
_NFKC = {
    **{chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F)},
    "\u00a0": " ",
    "\u2026": "...",
    "\ufb01": "fi",
    "e\u0301": "\u00e9",
    "\u200b": "",
}


def precompiled_charsmap(mapping: Mapping[str, str]) -> bytes:
    """`mapping` (text -> replacement) as SentencePiece's precompiled charsmap: a little-endian u32 byte size,
    a darts double-array trie over the UTF-8 keys (u32 units: label in bits 0-7, has-leaf bit 8, offset from bit
    10; a leaf unit holds bit 31 and the value), then the replacements, each NUL-terminated, which the values
    index. Each node with children gets its own 256-unit block, so no two labels collide."""
    trie: dict = {}
    for key in mapping:
        node = trie
        for byte in key.encode():
            node = node.setdefault(byte, {})
        node[None] = key
    blob, where = b"", {}
    for key in sorted(mapping):
        where[key] = len(blob)
        blob += mapping[key].encode() + b"\0"
    units = [0]

    def place(pos: int, node: dict) -> None:
        labels = [b for b in node if b is not None]
        base = len(units)
        units.extend([0] * (256 if labels else 1))
        units[pos] |= (pos ^ base) << 10 | (1 << 8 if None in node else 0)
        if None in node:
            units[base] = 1 << 31 | where[node[None]]
        for byte in labels:
            units[base ^ byte] = byte
            place(base ^ byte, node[byte])

    place(0, trie)
    return struct.pack("<I", 4 * len(units)) + struct.pack(f"<{len(units)}I", *units) + blob


def write_t5_tokenizer(folder: str | Path) -> Path:
    """Write a T5 v1.1 tokenizer folder (see the module docstring) and return it."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(Unigram(_pieces(), unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Precompiled(precompiled_charsmap(_NFKC))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    specials = ["<pad>", "</s>", "<unk>"] + [f"<extra_id_{i}>" for i in reversed(range(EXTRA_IDS))]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(folder / "tokenizer.json"))

    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    extra = [f"<extra_id_{i}>" for i in range(EXTRA_IDS)]
    config = {
        "add_prefix_space": True,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, **flags} for t in specials},
        "additional_special_tokens": extra,
        "clean_up_tokenization_spaces": True,
        "eos_token": "</s>",
        "extra_ids": EXTRA_IDS,
        "legacy": True,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<pad>",
        "sp_model_kwargs": {},
        "tokenizer_class": "T5Tokenizer",
        "unk_token": "<unk>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special_map = {"additional_special_tokens": extra, "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return folder


def t5_encoder(config: Mapping = T5_TINY, seed: int = 0):
    """transformers `T5EncoderModel(T5Config(**config))` in eval mode from `seed`, layer-norm weights perturbed."""
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    model = T5EncoderModel(T5Config(**config)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def save_t5_encoder(folder: str | Path, config: Mapping = T5_TINY, seed: int = 0) -> Path:
    """`t5_encoder(config, seed)` saved as a transformers folder (`config.json` + `model.safetensors`)."""
    folder = Path(folder)
    t5_encoder(config, seed).save_pretrained(folder, safe_serialization=True)
    return folder
