"""AUTOMATIC1111's prompt syntax: emphasis, BREAK, prompts longer than 75 tokens, extra-network tags.

What a prompt means there (A1111 1.10, `modules/prompt_parser.py` and `sd_hijack_clip.py`; re-implemented from
its documented behaviour):

- Emphasis: `(text)` multiplies the weight of its tokens by 1.1, `[text]` divides it by 1.1, `(text:1.3)` sets
  the factor 1.3; brackets nest (factors multiply); a bracket left open applies to the end of the prompt; `\\(`,
  `\\)`, `\\[`, `\\]`, `\\\\` are literal characters. Neighbouring pieces of equal weight merge.
- `BREAK` (upper case, a word of its own) ends the current chunk.
- Chunks: the prompt's tokens go in chunks of 75; each chunk becomes `[BOS] + 75 tokens (padded with EOS) + [EOS]`
  and is encoded on its own; the contexts are concatenated along the sequence (77, 154, ... tokens). When a chunk
  is full and a comma lies within the last 20 tokens, the text after that comma moves to the next chunk.
- Weights: each chunk's encoder output `z` (B, 77, D) is multiplied by the token weights, then rescaled so that
  its mean is the mean before the multiplication ("Original" emphasis). sdjax takes that mean per prompt (A1111
  takes it over the batch, so there an image depends on its batch-mates: identical with batch size 1).
- Prompt and negative prompt are padded to the same number of chunks with empty chunks (`[BOS] + [EOS] * 76`),
  A1111's "pad prompt/negative prompt to be same length" option (with it off A1111 runs the UNet twice with
  contexts of different lengths, which a batched program cannot); prompts of one batch likewise.
- `<lora:name:weight>` (or `<lora:name:te:unet>`) and other `<kind:name:args>` tags are taken out of the text
  (`extract_networks`).

Tokens after the first EOS of a chunk are the tokenizer's pad token (EOS for SD 1.x / SDXL's first encoder, "!"
for SD 2.x / SDXL's second), as both A1111 and diffusers feed them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

CHUNK = 75  # tokens per chunk, between BOS and EOS
COMMA_BACKTRACK = 20  # A1111's comma_padding_backtrack default
ROUND = 1.1
SQUARE = 1 / 1.1

_ATTENTION = re.compile(
    r"""
    \\\(|\\\)|\\\[|\\\]|\\\\|\\     # escapes
    |\(|\[                          # openers
    |:\s*([+-]?[.\d]+)\s*\)         # (text:weight)
    |\)|\]                          # closers
    |[^\\()\[\]:]+                  # plain text
    |:                              # a lone colon
    """,
    re.X,
)
_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.S)
_NETWORK = re.compile(r"<(\w+):([^>]+)>")


@dataclasses.dataclass(frozen=True)
class Network:
    """An extra-network tag `<kind:name:weight...>` (kind "lora", "hypernet", ...)."""

    kind: str
    name: str
    args: tuple[str, ...]

    @property
    def weight(self) -> float:
        """The first argument after the name as a number (A1111's `te` multiplier), 1.0 when absent."""
        return float(self.args[0]) if self.args else 1.0

    @property
    def lora_scale(self) -> float | tuple[float, float]:
        """A LoRA tag's multipliers as AUTOMATIC1111 reads them: `<lora:name:te:unet>`, positional or named
        (`te=`, `unet=`); te defaults to 1 and unet to te. One number when both are equal, else (te, unet).
        Raises ValueError for a non-number, an unknown name (DyLoRA's `dyn=` is not supported) or extra values."""
        positional = [a for a in self.args if "=" not in a]
        named = dict(a.split("=", 1) for a in self.args if "=" in a)
        unknown = sorted(set(named) - {"te", "unet"})
        if unknown or len(positional) > 2:
            what = f"{unknown[0]}=" if unknown else f"{len(positional)} values"
            raise ValueError(f"prompt tag <{self.kind}:{self.name}:...>: {what} is not supported (te, unet)")
        try:
            te = float(named.get("te", positional[0] if positional else 1.0))
            unet = float(named.get("unet", positional[1] if len(positional) > 1 else te))
        except ValueError:
            tag = ":".join((self.kind, self.name, *self.args))
            raise ValueError(f"prompt tag '<{tag}>': a weight is not a number") from None
        return te if te == unet else (te, unet)


def extract_networks(prompt: str) -> tuple[str, list[Network]]:
    """`prompt` without its `<kind:name:args>` tags, and the tags. Raises ValueError naming a tag whose weight is
    not a number."""
    found = []

    def take(m: re.Match) -> str:
        name, *args = m.group(2).split(":")
        net = Network(m.group(1), name, tuple(args))
        if net.kind == "lora":
            net.lora_scale  # noqa: B018 (validates; its errors name the tag)
        else:
            try:
                net.weight  # noqa: B018 (validates)
            except ValueError:
                raise ValueError(f"prompt tag {m.group(0)!r}: a weight is not a number") from None
        found.append(net)
        return ""

    return _NETWORK.sub(take, prompt), found


def parse_attention(text: str) -> list[tuple[str, float]]:
    """(text, weight) pieces of a prompt; `("BREAK", -1.0)` marks a BREAK. An empty prompt is `[("", 1.0)]`."""
    pieces: list[list] = []
    rounds: list[int] = []
    squares: list[int] = []

    def scale_from(start: int, factor: float) -> None:
        for piece in pieces[start:]:
            piece[1] *= factor

    for m in _ATTENTION.finditer(text):
        token, weight = m.group(0), m.group(1)
        if token.startswith("\\"):
            pieces.append([token[1:], 1.0])
        elif token == "(":
            rounds.append(len(pieces))
        elif token == "[":
            squares.append(len(pieces))
        elif weight is not None and rounds:
            scale_from(rounds.pop(), float(weight))
        elif token == ")" and rounds:
            scale_from(rounds.pop(), ROUND)
        elif token == "]" and squares:
            scale_from(squares.pop(), SQUARE)
        else:
            for i, part in enumerate(_BREAK.split(token)):
                if i:
                    pieces.append(["BREAK", -1.0])
                pieces.append([part, 1.0])
    for start in rounds:
        scale_from(start, ROUND)
    for start in squares:
        scale_from(start, SQUARE)
    if not pieces:
        pieces = [["", 1.0]]
    merged = [pieces[0]]
    for piece in pieces[1:]:
        if piece[1] == merged[-1][1]:
            merged[-1][0] += piece[0]
        else:
            merged.append(piece)
    return [(t, float(w)) for t, w in merged]


def chunk_tokens(tokenizer, text: str) -> list[tuple[list[int], list[float]]]:
    """A prompt's chunks: (75 token ids, 75 weights) each, before BOS/EOS are added (padded with EOS, weight 1)."""
    comma = tokenizer.token_id(",</w>")
    chunks: list[tuple[list[int], list[float]]] = []
    tokens: list[int] = []
    weights: list[float] = []
    last_comma = -1

    def close() -> None:
        nonlocal tokens, weights, last_comma
        pad = CHUNK - len(tokens)
        chunks.append((tokens + [tokenizer.eos_token_id] * pad, weights + [1.0] * pad))
        tokens, weights, last_comma = [], [], -1

    for piece, weight in parse_attention(text):
        if piece == "BREAK" and weight == -1.0:
            close()
            continue
        for token in tokenizer.encode(piece):
            if token == comma:
                last_comma = len(tokens)
            elif len(tokens) == CHUNK and last_comma != -1 and len(tokens) - last_comma <= COMMA_BACKTRACK:
                cut = last_comma + 1
                moved, moved_w = tokens[cut:], weights[cut:]
                tokens, weights = tokens[:cut], weights[:cut]
                close()
                tokens, weights = moved, moved_w
            if len(tokens) == CHUNK:
                close()
            tokens.append(token)
            weights.append(weight)
    if tokens or not chunks:
        close()
    return chunks


def _rows(tokenizer, chunks, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` chunks of one prompt (empty chunks appended) -> ids, weights `(count * 77,)`."""
    n = CHUNK + 2
    ids = np.full((count, n), tokenizer.eos_token_id, np.int32)
    weights = np.ones((count, n), np.float32)
    ids[:, 0] = tokenizer.bos_token_id
    for i, (tokens, w) in enumerate(chunks):
        ids[i, 1 : CHUNK + 1] = tokens
        weights[i, 1 : CHUNK + 1] = w
    pad = tokenizer.pad_token_id
    if pad != tokenizer.eos_token_id:  # after a chunk's first EOS: the pad token
        for row in ids:
            first = int(np.argmax(row == tokenizer.eos_token_id))
            row[first + 1 :] = pad
    return ids.reshape(-1), weights.reshape(-1)


def tokenize(tokenizer, prompts: Sequence[str], chunks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Prompts -> ids `(N, K * 77)` int32 and weights `(N, K * 77)` float32, K = `chunks` or the longest
    prompt's chunk count. Raises ValueError if a prompt needs more than `chunks`."""
    if tokenizer.model_max_length != CHUNK + 2:
        raise ValueError(f"A1111 prompt syntax needs 77-token CLIP tokenizers, got {tokenizer.model_max_length}")
    split = [chunk_tokens(tokenizer, p) for p in prompts]
    count = chunks or max(len(c) for c in split)
    if max(len(c) for c in split) > count:
        raise ValueError(f"a prompt needs {max(len(c) for c in split)} chunks of 75 tokens; {count} allowed")
    rows = [_rows(tokenizer, c, count) for c in split]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def changes_reading(text: str, tokenizer=None) -> bool:
    """Whether A1111's syntax reads `text` differently from plain tokenization: brackets, escapes, `BREAK`, a tag,
    or (with a tokenizer) more than 75 tokens. Prompts for which it does not can share batches with plain ones."""
    if any(c in text for c in "()[]\\<") or _BREAK.search(text):
        return True
    return tokenizer is not None and len(tokenizer.encode(text)) > CHUNK


def chunk_count(tokenizer, prompts: Sequence[str]) -> int:
    """The number of 75-token chunks the longest of `prompts` takes."""
    return max(len(chunk_tokens(tokenizer, p)) for p in prompts)


def emphasize(z, weights):
    """A1111's "Original" emphasis on one chunk: `z` `(B, 77, D)` times the token weights `(B, 77)`, rescaled to
    its former mean (per prompt)."""
    import jax.numpy as jnp

    z = z.astype(jnp.float32)
    before = jnp.mean(z, axis=(1, 2), keepdims=True)
    z = z * weights[:, :, None]
    after = jnp.mean(z, axis=(1, 2), keepdims=True)
    return z * (before / after)


def a1111_text_inputs(
    tokenizers: Sequence, prompts: Sequence[str], negative_prompts: Sequence[str], *, stacked: bool
) -> dict[str, np.ndarray | int]:
    """Ids and token weights of prompts read with AUTOMATIC1111's syntax, for a conditioning with these tokenizers
    (one per text encoder; `stacked`: ids `(N, E, 77)`, else `(N, 77)`), prompt and negative prompt padded to one
    chunk count (`chunks`; 0 when nothing is weighted or chunked: the plain program's inputs). `<lora:...>` tags must
    have been taken out by the caller."""
    for text in (*prompts, *negative_prompts):
        _, tags = extract_networks(text)
        if tags:
            raise ValueError(
                f"prompt tag <{tags[0].kind}:{tags[0].name}:...> was not resolved: load the LoRA and leave the tag out"
            )
    count = max(chunk_count(tokenizers[0], [*prompts, *negative_prompts]), 1)
    ids, weights = [], []
    for texts in (prompts, negative_prompts):
        per = [tokenize(tok, texts, count) for tok in tokenizers]
        ids.append(np.stack([p[0] for p in per], axis=1) if stacked else per[0][0])
        weights.append(per[0][1])
    if count == 1 and all((w == 1.0).all() for w in weights):  # nothing weighted: the plain program, same numbers
        return {"ids": ids[0], "neg_ids": ids[1], "chunks": 0}
    return {"ids": ids[0], "neg_ids": ids[1], "weights": weights[0], "neg_weights": weights[1], "chunks": count}
