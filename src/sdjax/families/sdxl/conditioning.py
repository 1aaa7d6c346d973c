"""Text and micro-conditioning of Stable Diffusion XL (diffusers `StableDiffusionXLPipeline` and, for the
refiner, `StableDiffusionXLImg2ImgPipeline`).

- Ids are `(N, E, 77)`, one row per text encoder: E = 2 for the base model (CLIP ViT-L, then OpenCLIP bigG whose
  tokenizer pads with "!"), E = 1 for the refiner (OpenCLIP bigG only).
- The UNet context is the penultimate hidden state of each encoder (before the final layer norm), concatenated
  along features; the pooled, projected embedding of the last encoder enters through the UNet's added embedding
  together with the micro-conditioning `time_ids`.
- `time_ids` as diffusers builds them: (orig_h, orig_w, crop_top, crop_left, target_h, target_w), or with
  `requires_aesthetics_score` (the refiner) (orig_h, orig_w, crop_top, crop_left, aesthetic_score). The negative
  ids follow each diffusers pipeline's own rules, kept here as they are (`negative_time_ids`).
- With `force_zeros_for_empty_prompt`, an empty negative prompt gives zero unconditional embeddings.
- `clip_skip` N > 1 takes `hidden_states[-(N + 1)]` of each encoder instead (see `families.clip_skip`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from sdjax.families.sd.clip_skip import clip_skip_input, select_layer
from sdjax.text import prompt_syntax

Pair = tuple[int, int]
OPTIONS = (
    "original_size",
    "crops_coords_top_left",
    "target_size",
    "negative_original_size",
    "negative_crops_coords_top_left",
    "negative_target_size",
    "aesthetic_score",
    "negative_aesthetic_score",
)


def _pair(name: str, value: Any) -> Pair:
    try:
        a, b = value
        return int(a), int(b)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of ints (height, width) / (top, left), got {value!r}") from None


def negative_time_ids(
    task: str,
    aesthetic: bool,
    *,
    original_size: Pair,
    crops: Pair,
    target_size: Pair,
    negative_original_size: Pair | None,
    negative_crops: Pair | None,
    negative_target_size: Pair | None,
    negative_aesthetic_score: float,
) -> tuple[float, ...]:
    """The unconditional branch's time ids by diffusers' rules: the text-to-image pipeline reuses the positive ids
    unless both a negative original and target size are given; the image-to-image and inpainting pipelines take
    each negative size (default: the positive one) but the positive crop; the aesthetic variant takes the
    negative crop (default (0, 0)) and the negative aesthetic score."""
    if aesthetic:
        return (*(negative_original_size or original_size), *(negative_crops or (0, 0)), negative_aesthetic_score)
    if task == "txt2img":
        if negative_original_size is not None and negative_target_size is not None:
            return (*negative_original_size, *(negative_crops or (0, 0)), *negative_target_size)
        return (*original_size, *crops, *target_size)
    return (*(negative_original_size or original_size), *crops, *(negative_target_size or target_size))


@dataclasses.dataclass(frozen=True, eq=False)
class SDXLConditioning:
    """Host side: `tokenize`, `host_inputs`; device side: `encode`. `text_encoder`/`tokenizer` are None for the
    refiner."""

    tokenizer: Any
    tokenizer_2: Any
    text_encoder: Any
    text_encoder_2: Any
    force_zeros_for_empty_prompt: bool = True
    requires_aesthetics_score: bool = False

    name = "sdxl"
    per_image_options = ("clip_skip",)  # lists of one value per image (the generator pads them with the batch)

    def accepts_prompt_syntax(self, syntax: str) -> bool:
        """Both "plain" and "a1111" (weights, BREAK, 75-token chunks: `text.prompt_syntax.a1111_text_inputs`)."""
        return syntax in ("plain", "a1111")

    @property
    def _pairs(self) -> list[tuple[str, Any, Any]]:
        pairs = [
            ("text_encoder", self.tokenizer, self.text_encoder),
            ("text_encoder_2", self.tokenizer_2, self.text_encoder_2),
        ]
        return [p for p in pairs if p[2] is not None]

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self._pairs)

    @property
    def tokenizers(self) -> tuple[Any, ...]:
        return tuple(tok for _, tok, _ in self._pairs)

    @property
    def ids_suffix(self) -> tuple[int, ...]:
        return (len(self._pairs), self.tokenizer_2.model_max_length)

    def text_inputs(
        self, prompts: Sequence[str], negative_prompts: Sequence[str], *, syntax: str = "plain"
    ) -> dict[str, np.ndarray]:
        """Token ids of the prompts and negative prompts (`ids`, `neg_ids`); with "a1111" also their weights and
        chunk count (`text.prompt_syntax.a1111_text_inputs`)."""
        if syntax == "a1111":
            return prompt_syntax.a1111_text_inputs(self.tokenizers, prompts, negative_prompts, stacked=True)
        return {"ids": self.tokenize(prompts), "neg_ids": self.tokenize(negative_prompts)}

    def tokenize(self, prompts: Sequence[str]) -> np.ndarray:
        """Ids `(N, E, 77)` int32, one row per text encoder."""
        return np.stack([tok(list(prompts)) for _, tok, _ in self._pairs], axis=1)

    def host_inputs(
        self,
        *,
        negative_prompts: Sequence[str | None],
        height: int,
        width: int,
        task: str,
        original_size=None,
        crops_coords_top_left=(0, 0),
        target_size=None,
        negative_original_size=None,
        negative_crops_coords_top_left=None,
        negative_target_size=None,
        aesthetic_score: float = 6.0,
        negative_aesthetic_score: float = 2.5,
        clip_skip: int | Sequence[int] = 1,
    ) -> dict[str, np.ndarray]:
        """`time_ids`, `neg_time_ids` `(N, 6 or 5)` float32, `zero_neg` `(N,)` bool and `clip_skip` `(N,)` int32
        for a batch (a negative prompt of None is "none given": zero embeddings under
        `force_zeros_for_empty_prompt`, as diffusers)."""
        size = (height, width)
        original = _pair("original_size", original_size or size)
        target = _pair("target_size", target_size or size)
        crops = _pair("crops_coords_top_left", crops_coords_top_left)
        neg = {
            k: None if v is None else _pair(k, v)
            for k, v in (
                ("negative_original_size", negative_original_size),
                ("negative_crops", negative_crops_coords_top_left),
                ("negative_target_size", negative_target_size),
            )
        }
        for name, v in (("aesthetic_score", aesthetic_score), ("negative_aesthetic_score", negative_aesthetic_score)):
            if not np.isfinite(v):
                raise ValueError(f"{name}={v!r} must be a finite number")
        aesthetic = self.requires_aesthetics_score
        pos = (*original, *crops, float(aesthetic_score)) if aesthetic else (*original, *crops, *target)
        negative = negative_time_ids(
            task,
            aesthetic,
            original_size=original,
            crops=crops,
            target_size=target,
            negative_aesthetic_score=float(negative_aesthetic_score),
            **neg,
        )
        n = len(negative_prompts)
        layers = min(encoder.config.num_hidden_layers for _, _, encoder in self._pairs)
        return {
            "clip_skip": clip_skip_input(clip_skip, n, layers),
            "time_ids": np.tile(np.asarray(pos, np.float32), (n, 1)),
            "neg_time_ids": np.tile(np.asarray(negative, np.float32), (n, 1)),
            "zero_neg": np.asarray([p is None and self.force_zeros_for_empty_prompt for p in negative_prompts]),
        }

    def encode(self, params: dict, inputs: dict, *, cfg: bool) -> tuple[Any, dict]:
        """-> (context `(2B or B, 77, sum of widths)`, `{"text_embeds", "time_ids"}`)."""
        ids = jnp.concatenate([inputs["neg_ids"], inputs["ids"]]) if cfg else inputs["ids"]
        hidden, pooled = [], None
        skip = jnp.concatenate([inputs["clip_skip"]] * 2) if cfg else inputs["clip_skip"]
        weighted = "weights" in inputs  # A1111 prompt syntax: 77-token chunks encoded apart, weighted, concatenated
        if weighted:
            weights = jnp.concatenate([inputs["neg_weights"], inputs["weights"]]) if cfg else inputs["weights"]
        for k, (name, tok, encoder) in enumerate(self._pairs):
            ids_k, skip_k = ids[:, k], skip
            if weighted:
                batch, length = ids_k.shape
                chunk = tok.model_max_length
                ids_k, skip_k = ids_k.reshape(-1, chunk), jnp.repeat(skip, length // chunk)
            out = encoder.apply({"params": params[name]}, ids_k)
            layer = select_layer(out.hidden_states, skip_k, offset=1)
            if not weighted:
                hidden.append(layer)
                pooled = out.text_embeds
                continue
            z = prompt_syntax.emphasize(layer, weights.reshape(-1, chunk))
            hidden.append(z.reshape(batch, length, -1))
            if out.text_embeds is not None:
                pooled = out.text_embeds.reshape(batch, length // chunk, -1)[:, 0]  # the first chunk's, as A1111
        context = jnp.concatenate(hidden, axis=-1)
        time_ids = inputs["time_ids"]
        if cfg:
            batch = inputs["ids"].shape[0]
            keep = jnp.concatenate([~inputs["zero_neg"], jnp.ones((batch,), bool)])
            context = context * keep[:, None, None].astype(context.dtype)
            pooled = pooled * keep[:, None].astype(pooled.dtype)
            time_ids = jnp.concatenate([inputs["neg_time_ids"], time_ids])
        return context, {"text_embeds": pooled, "time_ids": time_ids.astype(jnp.float32)}
