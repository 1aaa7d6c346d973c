"""T5's SentencePiece (Unigram) tokenizer on the `tokenizers` library, with the ids of transformers' `T5TokenizerFast`.

The tokenizer of T5 v1.1 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer"): the `tokenizer_2/` folder of Flux.1 and the `tokenizer_3/` folder of SD 3. sdjax reads its
`tokenizer.json` and builds the pipeline transformers 5's `T5Tokenizer` (`T5TokenizerFast` is the same class)
builds, whatever else the file says:

1. special and added tokens found in the raw text (`</s>`, `<pad>`, `<unk>`, `<extra_id_0>` .. `<extra_id_99>`)
   become their ids;
2. normalize with the file's SentencePiece `Precompiled` charsmap (T5's `nmt_nfkc`: NFKC-like folding), when the
   file has one; other normalizers in the file are not applied (transformers drops them too);
3. split at whitespace (`WhitespaceSplit`: runs of any Unicode whitespace, leading and trailing ones dropped), then
   `Metaspace`: each word gets the `▁` prefix;
4. the Unigram model (Viterbi over the pieces' log-probabilities; unknown characters -> `<unk>`, no byte fallback);
5. at most `max_length - 1` tokens, then `</s>`, then `<pad>` (id 0) up to `max_length`, as
   `tokenizer(texts, padding="max_length", max_length=L, truncation=True)` gives.

Diffusers' `FluxPipeline` and `StableDiffusion3Pipeline` tokenize with `max_length=max_sequence_length` (512 or 256)
and log the text they cut; sdjax warns with `PromptTruncatedWarning` (as the CLIP tokenizer does), naming it.
"""

from __future__ import annotations

import base64
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import Unigram

from sdjax.text.tokenizer import PromptTruncatedWarning

_SPECIAL_NAMES = ("eos_token", "unk_token", "pad_token")
_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
_NO_LIMIT = 10_000  # transformers writes 1e30 (`VERY_LARGE_INTEGER`) for "no model_max_length"


def _added_token(spec: str | Mapping[str, Any]) -> AddedToken:
    """A special `tokenizers.AddedToken` from a config value: a plain string (transformers: special, not
    normalized) or a serialized AddedToken dict (its flags kept)."""
    if isinstance(spec, str):
        return AddedToken(spec, special=True, normalized=False)
    if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
        raise ValueError(f"not a token: {spec!r}")
    flags = {k: bool(spec[k]) for k in _FLAGS if k in spec}
    flags.setdefault("special", True)
    return AddedToken(spec["content"], **flags)


def _content(spec: str | Mapping[str, Any]) -> str:
    return spec if isinstance(spec, str) else spec["content"]


class T5Tokenizer:
    """Text -> T5 ids `(N, max_length)` int32, identical to transformers' `T5TokenizerFast` (module docstring).

    Build with `T5Tokenizer.from_folder(path)` (a folder with `tokenizer.json`, e.g. Flux's `tokenizer_2/`).
    `pad_token_id`, `eos_token_id`, `unk_token_id` and `model_max_length` are plain attributes.
    """

    def __init__(
        self,
        pieces: Sequence[tuple[str, float]],
        *,
        unk_id: int = 2,
        precompiled_charsmap: bytes | None = None,
        special_tokens: Mapping[str, str | Mapping[str, Any]] | None = None,
        added_tokens: Sequence[str | Mapping[str, Any]] = (),
        model_max_length: int = 512,
    ):
        """`pieces`: the Unigram vocabulary `[(piece, log_prob), ...]` in id order. `special_tokens` maps
        transformers' names (`eos_token`, `unk_token`, `pad_token`) to a string or a serialized AddedToken; missing
        names take T5's defaults. `added_tokens`: further special tokens matched in the raw text (the sentinels
        `<extra_id_N>`), in the order transformers adds them; one not among `pieces` gets the next free id."""
        if model_max_length < 1:
            raise ValueError(f"model_max_length must be at least 1 (room for </s>), got {model_max_length}")
        pieces = [(str(p), float(s)) for p, s in pieces]
        if not 0 <= unk_id < len(pieces):
            raise ValueError(f"unk_id={unk_id} is not an id of the {len(pieces)} pieces")
        backend = Tokenizer(Unigram(pieces, unk_id=unk_id, byte_fallback=False))
        if precompiled_charsmap is not None:
            backend.normalizer = normalizers.Precompiled(precompiled_charsmap)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.WhitespaceSplit(),
                pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
            ]
        )
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        specials = {**_DEFAULTS, **{k: v for k, v in (special_tokens or {}).items() if v is not None}}
        backend.add_tokens([_added_token(t) for t in added_tokens])
        backend.add_tokens([_added_token(specials[k]) for k in _SPECIAL_NAMES])
        self.special_tokens = {k: _content(specials[k]) for k in _SPECIAL_NAMES}
        ids = {k: backend.token_to_id(t) for k, t in self.special_tokens.items()}  # added above: never None
        self._backend = backend
        self.model_max_length = int(model_max_length)
        self.eos_token_id: int = ids["eos_token"]
        self.unk_token_id: int = ids["unk_token"]
        self.pad_token_id: int = ids["pad_token"]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_folder(cls, path: str | Path, *, model_max_length: int | None = None) -> T5Tokenizer:
        """A T5 tokenizer folder: `tokenizer.json` (a Unigram model) with, when present, `tokenizer_config.json`
        and `special_tokens_map.json` for the special tokens, the sentinels (`additional_special_tokens` /
        `extra_special_tokens`, else `extra_ids` of them, 100 by default) and `model_max_length` (512 if absent).
        A folder with only SentencePiece's `spiece.model` is refused (sdjax does not convert it)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer folder not found: {path}")
        tok_json = _read_json(path / "tokenizer.json")
        if tok_json is None:
            present = sorted(p.name for p in path.iterdir())
            raise FileNotFoundError(
                f"{path}: no tokenizer.json (files present: {present}); sdjax reads T5 tokenizers from "
                f"tokenizer.json only (transformers' save_pretrained writes it)"
            )
        model = tok_json.get("model") or {}
        vocab = model.get("vocab")
        if model.get("type") not in (None, "Unigram") or not isinstance(vocab, list):
            raise ValueError(
                f"{path / 'tokenizer.json'}: not a T5 (Unigram) tokenizer (model type {model.get('type')!r})"
            )
        config = _read_json(path / "tokenizer_config.json") or {}
        stm = _read_json(path / "special_tokens_map.json") or {}

        specials = {k: stm[k] for k in _SPECIAL_NAMES if stm.get(k) is not None}
        specials.update({k: config[k] for k in _SPECIAL_NAMES if config.get(k) is not None})
        if "added_tokens_decoder" in config:
            declared = [t for _, t in sorted((int(i), t) for i, t in config["added_tokens_decoder"].items())]
        else:
            declared = sorted(tok_json.get("added_tokens", []), key=lambda t: t["id"])
        by_content = {_content(t): t for t in declared}
        specials = {k: by_content.get(_content(v), v) for k, v in specials.items()}
        extra = (  # transformers 4 writes `additional_special_tokens`, transformers 5 `extra_special_tokens`
            config.get("additional_special_tokens")
            or config.get("extra_special_tokens")
            or stm.get("additional_special_tokens")
            or []
        )
        extra = [by_content.get(_content(t), t) for t in extra]
        if not any("<extra_id_" in _content(t) for t in extra):
            extra += [f"<extra_id_{i}>" for i in range(int(config.get("extra_ids", 100)))]
        named = {_content(v) for v in specials.values()}
        added = [t for t in declared if _content(t) not in named] + [t for t in extra if _content(t) not in named]

        length = model_max_length or config.get("model_max_length") or 512
        if not isinstance(length, int) or length > _NO_LIMIT:
            length = 512
        try:
            return cls(
                [tuple(p) for p in vocab],
                unk_id=2 if model.get("unk_id") is None else int(model["unk_id"]),
                precompiled_charsmap=_charsmap(tok_json.get("normalizer")),
                special_tokens=specials,
                added_tokens=added,
                model_max_length=length,
            )
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        """Pieces plus added tokens (32100 for T5 v1.1; its text encoder's embedding has 32128 rows)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        """The id of one piece or added token (None if absent)."""
        return self._backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """The ids of `text` alone: no `</s>`, no truncation, no padding."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens dropped."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def __call__(self, texts: str | Sequence[str], max_length: int | None = None) -> np.ndarray:
        """Tokenize: int32 `(N, max_length)` (default `model_max_length`), `[tokens..., </s>, <pad>...]`. A prompt
        longer than `max_length - 1` tokens is cut (`</s>` stays last) with a `PromptTruncatedWarning` naming the
        dropped text."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"texts must be a str or a list of str, got {type(texts).__name__}")
        length = self.model_max_length if max_length is None else max_length
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"max_length must be a positive int (room for </s>), got {max_length!r}")
        room = length - 1
        out = np.full((len(texts), length), self.pad_token_id, np.int32)
        for row, (text, enc) in enumerate(
            zip(texts, self._backend.encode_batch(list(texts), add_special_tokens=False), strict=True)
        ):
            ids = enc.ids
            if len(ids) > room:
                warnings.warn(
                    f"prompt {_short(text)} has {len(ids)} tokens; T5 reads {room} here (max_length={length}), so "
                    f"{len(ids) - room} tokens were dropped: {self.decode(ids[room:])!r}",
                    PromptTruncatedWarning,
                    stacklevel=2,
                )
                ids = ids[:room]
            out[row, : len(ids)] = ids
            out[row, len(ids)] = self.eos_token_id
        return out

    def __repr__(self) -> str:
        return f"T5Tokenizer(vocab_size={self.vocab_size}, model_max_length={self.model_max_length})"


def _charsmap(normalizer: Mapping[str, Any] | None) -> bytes | None:
    """The SentencePiece charsmap of a `tokenizer.json` normalizer (alone or inside a `Sequence`), else None."""
    if not normalizer:
        return None
    parts = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    for part in parts:
        if part.get("type") == "Precompiled" and part.get("precompiled_charsmap"):
            return base64.b64decode(part["precompiled_charsmap"])
    return None


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


MAX_SEQUENCE_LENGTH = 512  # diffusers' Flux and SD 3 pipelines: "max_sequence_length cannot be greater than 512"


def check_max_sequence_length(n: Any, model: str) -> int:
    """`n` as the T5 token count of `model`'s prompts ("Flux", "SD 3"): an int in [1, 512]."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 1 <= n <= MAX_SEQUENCE_LENGTH:
        raise ValueError(f"max_sequence_length={n!r} must be an int in [1, {MAX_SEQUENCE_LENGTH}] ({model}: T5 tokens)")
    return int(n)
