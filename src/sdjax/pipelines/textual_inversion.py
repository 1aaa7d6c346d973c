"""Textual inversion on a pipeline: `load_textual_inversion(path, token=None)`.

The embedding's tokens are added to the tokenizer (a new tokenizer object: `CLIPTokenizer.with_added_tokens`),
its vectors appended to the text encoder's token-embedding table in `pipe.params`, and the text encoder's config
grows by as many rows (`vocab_size`); the token is then a word of any prompt or negative prompt. SDXL embeddings
(`clip_l`, `clip_g`) go into both encoders (the refiner, which has only the second, takes `clip_g`).

The embedding table changes shape, so the next generation compiles anew (the compiled programs are dropped); LoRA
switching afterwards still never recompiles. Explicit `params=` from before the load no longer fit the model: use
`pipe.params`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sdjax.loading import textual_inversion as ti

# text-encoder component -> its tokenizer attribute
_TOKENIZERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}


class TextualInversionMixin:
    """The textual-inversion method of `DiffusionPipeline` (see the module docstring)."""

    def load_textual_inversion(
        self, path: str | Path, token: str | None = None, *, allow_pickle: bool = False
    ) -> list[str]:
        """Load an embedding file (A1111 `emb_params`, SDXL `clip_l`/`clip_g`, diffusers `{token: tensor}`);
        returns the tokens added (`token`, `token_1`, ... for a multi-vector embedding). `token` overrides the
        trigger word (default: the file's stem, or the diffusers file's key). `.pt` / `.bin` pickles need
        `allow_pickle=True` (a restricted unpickler that runs no code reads them)."""
        embedding = ti.read_embedding(path, token=token, allow_pickle=allow_pickle)
        components = [c for c in _TOKENIZERS if getattr(self, c, None) is not None]
        if components == ["text_encoder_2"] and set(embedding.vectors) == {"text_encoder", "text_encoder_2"}:
            embedding = dataclasses.replace(embedding, vectors={"text_encoder_2": embedding.vectors["text_encoder_2"]})
        ti.check_fits(embedding, {c: getattr(self, c).config.hidden_size for c in components})
        params = self.params
        if params is None:
            raise ValueError("no params: load the pipeline with from_pretrained before loading embeddings")
        updates: dict[str, tuple] = {}
        expand = {embedding.token: " ".join(embedding.tokens)} if embedding.num_vectors > 1 else None
        for component, rows in embedding.vectors.items():
            encoder, tokenizer = getattr(self, component), getattr(self, _TOKENIZERS[component])
            if tokenizer.vocab_size != encoder.config.vocab_size:
                raise ti.TextualInversionError(
                    f"{embedding.source}: {_TOKENIZERS[component]} has {tokenizer.vocab_size} tokens but "
                    f"{component} has {encoder.config.vocab_size} token embeddings; cannot append new tokens"
                )
            try:
                grown = tokenizer.with_added_tokens(embedding.tokens, expand=expand)
            except ValueError as e:
                raise ti.TextualInversionError(f"{embedding.source}: {e}; pass another token=") from e
            config = dataclasses.replace(encoder.config, vocab_size=encoder.config.vocab_size + len(rows))
            updates[component] = (grown, encoder.clone(config=config), rows)
        grow = {c: rows for c, (_, _, rows) in updates.items()}
        self._replace_text_params(lambda p: {**p, **{c: ti.add_to_encoder(p[c], r) for c, r in grow.items()}})
        for component, (tokenizer, encoder, _) in updates.items():
            setattr(self, _TOKENIZERS[component], tokenizer)
            setattr(self, component, encoder)
        gen = self.generator
        gen.models = dataclasses.replace(gen.models, conditioning=self._conditioning())
        gen.cache.clear()
        gen._pmapped.clear()
        return embedding.tokens

    def _replace_text_params(self, fn) -> None:
        """`pipe.params = fn(pipe.params)`, and the same for the LoRA base params (see `pipelines.lora`)."""
        state = getattr(self, "_lora_state", None)
        current = self.params
        new = fn(current)
        if state is not None and current is state.current:
            state.base = new if state.base is current else fn(state.base)
            state.current = new
        self.params = new
