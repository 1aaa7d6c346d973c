"""CLIP's byte-level BPE tokenizer on the `tokenizers` library, with the ids of transformers' `CLIPTokenizer`.

The pipeline is the one transformers 5 builds (it always rebuilds it from the vocabulary and merges, whatever
`tokenizer.json` says), and sdjax's ids equal transformers' `tokenizer(texts, padding="max_length",
max_length=77, truncation=True).input_ids`:

1. special tokens found in the raw text (`<|startoftext|>`, `<|endoftext|>`, and the pad token) become their ids;
2. normalize: Unicode NFC, every run of whitespace -> one space, lower case;
3. split with CLIP's regex (`'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+`, so each digit
   is its own word), then GPT-2's byte-to-unicode mapping;
4. BPE with the suffix `</w>` on the last symbol of each word;
5. `<|startoftext|>` + at most `model_max_length - 2` tokens + `<|endoftext|>`, padded with the pad token.

Differences from OpenAI's original `clip.simple_tokenizer` (kept because the SD checkpoints were used through
transformers): no `ftfy.fix_text` and no `html.unescape` (so `&amp;` is three tokens `&`, `amp`, `;`), and
whitespace is not stripped by a separate step (the regex drops it anyway).

The pad token matters beyond padding: transformers registers it as a special token, so SDXL's `tokenizer_2`,
which pads with `!` (id 0), also turns every `!` in a prompt into a separate id 0 instead of merging runs such as
`!!` into one BPE token. sdjax reproduces that. Whether a special token also matches after normalization (e.g.
upper-case `<|ENDOFTEXT|>`) follows the token's `normalized` flag as transformers resolves it from
`tokenizer_config.json` / `special_tokens_map.json` / `tokenizer.json`.
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "clip_tokenizer"

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# The order in which transformers (re-)registers named special tokens; a later one sets the flags of a token
# that several names share (SD 1.x: eos, unk and pad are all `<|endoftext|>`).
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_DEFAULTS = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class PromptTruncatedWarning(UserWarning):
    """A prompt had more tokens than the text encoder reads; the message names the dropped text."""


def _added_token(spec: str | Mapping[str, Any], *, special: bool = True) -> AddedToken:
    """A `tokenizers.AddedToken` from a config value: a plain string (transformers: special, not normalized) or
    a serialized AddedToken dict (its flags kept)."""
    if isinstance(spec, str):
        return AddedToken(spec, special=special, normalized=False)
    if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
        raise ValueError(f"not a token: {spec!r}")
    flags = {k: bool(spec[k]) for k in _FLAGS if k in spec}
    flags.setdefault("special", special)
    return AddedToken(spec["content"], **flags)


class CLIPTokenizer:
    """Text -> CLIP ids `(N, model_max_length)` int32, identical to transformers' `CLIPTokenizer`.

    Build with `CLIPTokenizer.default()` (the vocabulary shipped with sdjax), `from_folder(path)` (a diffusers
    `tokenizer/` folder: `vocab.json` + `merges.txt`, or `tokenizer.json`), or `from_files(vocab, merges)`.
    """

    def __init__(
        self,
        vocab: Mapping[str, int],
        merges: Sequence[tuple[str, str]],
        *,
        special_tokens: Mapping[str, str | Mapping[str, Any]] | None = None,
        added_tokens: Mapping[int, str | Mapping[str, Any]] | None = None,
        model_max_length: int = 77,
    ):
        """`special_tokens` maps transformers' names (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ...) to
        a string or a serialized AddedToken; missing names take CLIP's defaults. `added_tokens` (id -> token) are
        extra tokens a `tokenizer.json`/`added_tokens_decoder` declares."""
        if model_max_length < 2:
            raise ValueError(f"model_max_length must be at least 2 (BOS and EOS), got {model_max_length}")
        specials = {**_DEFAULTS, **{k: v for k, v in (special_tokens or {}).items() if v is not None}}
        unk = specials["unk_token"]
        backend = Tokenizer(
            BPE(
                vocab=dict(vocab),
                merges=list(merges),
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="</w>",
                fuse_unk=False,
                unk_token=unk if isinstance(unk, str) else unk["content"],
            )
        )
        backend.normalizer = normalizers.Sequence(
            [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
        )
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
        backend.decoder = decoders.ByteLevel()
        # transformers: declared added tokens first (by id), then every named special token again, in
        # `_SPECIAL_NAMES` order; re-adding a token updates its flags, so the last name wins.
        for _, spec in sorted((added_tokens or {}).items()):
            backend.add_tokens([_added_token(spec, special=False)])
        named = [_added_token(specials[k]) for k in _SPECIAL_NAMES if k in specials]
        backend.add_tokens(named)
        for token in named:
            if backend.token_to_id(token.content) is None:
                raise ValueError(f"special token {token.content!r} is not in the vocabulary")
        self._backend = backend
        self.model_max_length = int(model_max_length)
        self.special_tokens = {k: (v if isinstance(v, str) else v["content"]) for k, v in specials.items()}
        self.bos_token_id = backend.token_to_id(self.special_tokens["bos_token"])
        self.eos_token_id = backend.token_to_id(self.special_tokens["eos_token"])
        self.pad_token_id = backend.token_to_id(self.special_tokens["pad_token"])
        self._expand: dict[str, str] = {}  # prompt text replacements (multi-vector textual inversion)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_files(cls, vocab_file: str | Path, merges_file: str | Path, **kwargs) -> CLIPTokenizer:
        """From `vocab.json` and `merges.txt` (read by `tokenizers`' own reader, as transformers does)."""
        for f in (vocab_file, merges_file):
            if not Path(f).is_file():
                raise FileNotFoundError(f"tokenizer file not found: {f}")
        vocab, merges = _read_bpe(Path(vocab_file), Path(merges_file))
        return cls(vocab, merges, **kwargs)

    @classmethod
    def default(cls, pad_token: str = EOS, model_max_length: int = 77) -> CLIPTokenizer:
        """CLIP's vocabulary shipped with sdjax (`assets/clip_tokenizer`): `pad_token="<|endoftext|>"` for SD
        1.x/2.x and SDXL's `tokenizer`, `pad_token="!"` for SDXL's `tokenizer_2`."""
        return cls.from_files(
            ASSETS / "vocab.json",
            ASSETS / "merges.txt",
            special_tokens={"pad_token": pad_token},
            model_max_length=model_max_length,
        )

    @classmethod
    def from_folder(cls, path: str | Path, *, model_max_length: int | None = None) -> CLIPTokenizer:
        """A tokenizer folder: `tokenizer.json` (transformers 5 `save_pretrained`) or `vocab.json` +
        `merges.txt` (real SD checkpoints), with `tokenizer_config.json` and `special_tokens_map.json` for the
        special tokens (SDXL's `tokenizer_2` pads with `!`) and `model_max_length` (77 if absent)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer folder not found: {path}")
        config = _read_json(path / "tokenizer_config.json") or {}
        tok_json = _read_json(path / "tokenizer.json")
        if tok_json is not None:
            model = tok_json.get("model") or {}
            if model.get("type") not in (None, "BPE") or not isinstance(model.get("vocab"), dict):
                raise ValueError(f"{path / 'tokenizer.json'}: not a BPE tokenizer (model type {model.get('type')!r})")
            vocab = model["vocab"]
            merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            vocab, merges = _read_bpe(path / "vocab.json", path / "merges.txt")
        else:
            raise FileNotFoundError(f"{path}: no tokenizer.json, nor vocab.json + merges.txt")

        # Which flags each named special token gets, in transformers' precedence order.
        specials = {k: config[k] for k in _SPECIAL_NAMES if config.get(k) is not None}
        if "added_tokens_decoder" in config:
            added = {int(i): t for i, t in config["added_tokens_decoder"].items()}
        else:
            stm = _read_json(path / "special_tokens_map.json") or {}
            specials.update({k: stm[k] for k in _SPECIAL_NAMES if stm.get(k) is not None})
            added = {t["id"]: t for t in (tok_json or {}).get("added_tokens", [])}
        by_content = {(t if isinstance(t, str) else t["content"]): t for t in added.values()}
        for name, spec in specials.items():
            content = spec if isinstance(spec, str) else spec["content"]
            if content in by_content:
                specials[name] = by_content[content]
        length = model_max_length or config.get("model_max_length") or 77
        if not isinstance(length, int) or length > 10_000:  # transformers writes 1e30 for "no limit"
            length = 77
        try:
            return cls(vocab, merges, special_tokens=specials, added_tokens=added, model_max_length=length)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    def with_added_tokens(self, tokens: Sequence[str], *, expand: Mapping[str, str] | None = None) -> CLIPTokenizer:
        """A copy with `tokens` appended to the vocabulary (ids `vocab_size`, `vocab_size + 1`, ... in order), as
        transformers' `add_tokens` adds them (not special, matched on the normalized text, anywhere in it), and with
        `expand`: text replacements made in each prompt before tokenizing (diffusers' multi-vector textual
        inversion turns `<tok>` into `<tok> <tok>_1 <tok>_2`). This tokenizer is left as it is."""
        taken = [t for t in tokens if self._backend.token_to_id(t) is not None]
        if taken or len(set(tokens)) != len(tokens):
            raise ValueError(f"token(s) {taken or list(tokens)} already in the tokenizer's vocabulary (or repeated)")
        new = copy.copy(self)
        new._backend = Tokenizer.from_str(self._backend.to_str())
        start = new.vocab_size
        new._backend.add_tokens([AddedToken(t, special=False, normalized=True) for t in tokens])
        got = [new._backend.token_to_id(t) for t in tokens]
        if got != list(range(start, start + len(tokens))):  # pragma: no cover - tokenizers' own contract
            raise RuntimeError(f"added tokens got ids {got}, expected {start}..")
        new._expand = {**self._expand, **(expand or {})}
        return new

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry or added token (None if absent)."""
        return self._backend.token_to_id(token)

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def _expanded(self, text: str) -> str:
        for token, replacement in self._expand.items():
            if token in text:
                text = text.replace(token, replacement)
        return text

    def encode(self, text: str) -> list[int]:
        """The ids of `text` alone: no BOS/EOS, no truncation, no padding."""
        return self._backend.encode(self._expanded(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens dropped (word ends `</w>` become spaces)."""
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=True)
        return " ".join(text.replace("</w>", " ").split())

    def __call__(self, texts: str | Sequence[str]) -> np.ndarray:
        """Tokenize: int32 `(N, model_max_length)`, `[BOS, tokens..., EOS, pad...]`. A prompt longer than
        `model_max_length - 2` tokens is cut (EOS stays last) with a `PromptTruncatedWarning` naming the dropped
        text."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"texts must be a str or a list of str, got {type(texts).__name__}")
        room = self.model_max_length - 2
        out = np.full((len(texts), self.model_max_length), self.pad_token_id, np.int32)
        texts = [self._expanded(t) for t in texts]
        for row, (text, enc) in enumerate(
            zip(texts, self._backend.encode_batch(list(texts), add_special_tokens=False), strict=True)
        ):
            ids = enc.ids
            if len(ids) > room:
                warnings.warn(
                    f"prompt {_short(text)} has {len(ids)} tokens; CLIP reads {room}, so this part was dropped: "
                    f"{self.decode(ids[room:])!r}",
                    PromptTruncatedWarning,
                    stacklevel=2,
                )
                ids = ids[:room]
            out[row, 0] = self.bos_token_id
            out[row, 1 : len(ids) + 1] = ids
            out[row, len(ids) + 1] = self.eos_token_id
        return out

    def __repr__(self) -> str:
        return (
            f"CLIPTokenizer(vocab_size={self.vocab_size}, model_max_length={self.model_max_length}, "
            f"pad_token={self.special_tokens['pad_token']!r})"
        )


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _read_bpe(vocab_file: Path, merges_file: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """`vocab.json` + `merges.txt` through `tokenizers`' reader, kept per file version: every pipeline (and each
    of SDXL's two encoders) builds a tokenizer from the same 49k-entry files, whose reading is most of that build.
    The callers copy what they keep (`BPE(vocab=dict(...), merges=list(...))`)."""
    return _read_bpe_version(*(_version(f) for f in (vocab_file, merges_file)))


def _version(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _read_bpe_version(vocab: tuple[str, int, int], merges: tuple[str, int, int]):
    return BPE.read_file(vocab[0], merges[0])
