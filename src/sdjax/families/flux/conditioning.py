"""Text conditioning of Flux.1 (diffusers `FluxPipeline.encode_prompt`): CLIP-L's pooled output and T5's hidden
states.

- `prompt` goes through CLIP-L (`text_encoder`, 77 tokens, no attention mask): its `pooler_output` (the final
  layer-normed state at the end-of-text token, not projected) is the transformer's `pooled_projections`.
- `prompt_2` (default: `prompt`) goes through T5 v1.1 XXL (`text_encoder_2`), padded to `max_sequence_length`
  (256 for schnell, 512 for dev) and encoded without an attention mask, as diffusers does: padding tokens are
  attended to. Its last hidden state is the transformer's text stream; the text tokens' position ids are zeros.
- With true classifier-free guidance (`true_cfg_scale > 1` and a negative prompt) the negative prompts are
  encoded the same way and stacked first.
- `guidance` (dev's distilled guidance scale, per image) travels with the conditioning: the transformer embeds it.
- `zero_negative` (per image; ComfyUI's ConditioningZeroOut as the negative): the negative's T5 states and pooled
  output are zeros (not the empty prompt's encoding), as diffusers' `negative_prompt_embeds` of zeros give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from sdjax.text.t5_tokenizer import MAX_SEQUENCE_LENGTH, check_max_sequence_length


@dataclasses.dataclass(frozen=True, eq=False)
class FluxConditioning:
    """Host side: `text_inputs`, `host_inputs`; device side: `encode` (traced inside the generation program)."""

    tokenizer: Any  # CLIP
    text_encoder: Any  # CLIPTextModel
    tokenizer_2: Any  # T5 (sdjax.text.t5_tokenizer.T5Tokenizer)
    text_encoder_2: Any  # T5EncoderModel
    max_sequence_length: int = MAX_SEQUENCE_LENGTH

    name = "flux"
    components = ("text_encoder", "text_encoder_2")
    # lists of one value per image (the generator pads them with the batch)
    per_image_options = ("guidance", "zero_negative")

    def accepts_prompt_syntax(self, syntax: str) -> bool:
        """Only "plain": A1111's syntax (weights, BREAK, 75-token chunks) is not read for Flux's T5 stream."""
        return syntax == "plain"

    def __post_init__(self):
        check_max_sequence_length(self.max_sequence_length, "Flux")

    def with_max_sequence_length(self, n: int) -> FluxConditioning:
        return dataclasses.replace(self, max_sequence_length=int(n))

    def text_inputs(
        self, prompts: Sequence[str], negative_prompts: Sequence[str], *, syntax: str = "plain"
    ) -> dict[str, np.ndarray]:
        """CLIP ids `(N, 77)` (`ids`, `neg_ids`) and T5 ids `(N, max_sequence_length)` (`t5_ids`, `neg_t5_ids`)."""
        if syntax != "plain":
            raise ValueError(f"prompt_syntax={syntax!r}: this model's conditioning reads plain prompts only")
        return {
            "ids": self.tokenizer(list(prompts)),
            "neg_ids": self.tokenizer(list(negative_prompts)),
            "t5_ids": self.t5_ids(prompts),
            "neg_t5_ids": self.t5_ids(negative_prompts),
        }

    def t5_ids(self, prompts: Sequence[str]) -> np.ndarray:
        return np.asarray(self.tokenizer_2(list(prompts), self.max_sequence_length), np.int32)

    def host_inputs(
        self,
        *,
        negative_prompts: Sequence[str],
        height: int,
        width: int,
        task: str,
        guidance: float | Sequence[float] = 3.5,
        prompt_2: Sequence[str] | None = None,
        negative_prompt_2: Sequence[str] | None = None,
        zero_negative: bool | Sequence[bool] = False,
        **options: Any,
    ) -> dict[str, np.ndarray]:
        """`guidance` `(N,)` (dev's embedded guidance scale; ignored by schnell's transformer), `zero_neg` `(N,)` bool
        (`zero_negative`: zero negative embeddings) and, with `prompt_2` / `negative_prompt_2` (one per image), the
        T5 ids of those texts instead of the prompts'."""
        if options:
            raise TypeError(f"unexpected conditioning argument(s) {sorted(options)} for a Flux model")
        n = len(negative_prompts)
        g = np.broadcast_to(np.asarray(guidance, np.float32).reshape(-1), (n,)) if np.ndim(guidance) == 0 else None
        if g is None:
            g = np.asarray(guidance, np.float32).reshape(-1)
            if g.shape != (n,):
                raise ValueError(f"guidance: got {g.shape[0]} values for {n} images")
        out = {"embedded_guidance": np.ascontiguousarray(g), "zero_neg": zero_flags(zero_negative, n)}
        for key, texts in (("t5_ids", prompt_2), ("neg_t5_ids", negative_prompt_2)):
            if texts is not None:
                texts = list(texts) + [""] * (n - len(texts))  # the generator's padding images
                if len(texts) != n:
                    raise ValueError(f"{key.replace('t5_ids', 'prompt_2')}: got {len(texts)} texts for {n} images")
                out[key] = self.t5_ids(texts)
        return out

    def encode(self, params: dict, inputs: dict, *, cfg: bool) -> dict[str, Any]:
        """-> `{"text": T5 states (B', L, D), "pooled": CLIP pooled (B', 768), "guidance": (B',)}`, negative
        prompts first with `cfg`."""

        def both(pos, neg):
            return jnp.concatenate([inputs[neg], inputs[pos]]) if cfg else inputs[pos]

        clip = self.text_encoder.apply({"params": params["text_encoder"]}, both("ids", "neg_ids"))
        t5 = self.text_encoder_2.apply({"params": params["text_encoder_2"]}, both("t5_ids", "neg_t5_ids"))
        g = inputs["embedded_guidance"]
        text, pooled = t5, clip.pooler_output
        if cfg and "zero_neg" in inputs:  # ConditioningZeroOut: zero negative states and pooled output
            keep = jnp.concatenate([~inputs["zero_neg"], jnp.ones_like(inputs["zero_neg"])])
            text, pooled = text * keep[:, None, None].astype(text.dtype), pooled * keep[:, None].astype(pooled.dtype)
        return {
            "text": text,
            "pooled": pooled,
            "guidance": jnp.concatenate([g, g]) if cfg else g,
        }


def zero_flags(value: bool | Sequence[bool], n: int) -> np.ndarray:
    """`zero_negative` (one bool, or one per image) -> `(n,)` bool."""
    flags = np.asarray(value, bool).reshape(-1)
    if flags.shape[0] == 1:
        flags = np.repeat(flags, n)
    if flags.shape != (n,):
        raise ValueError(f"zero_negative: got {flags.shape[0]} values for {n} images")
    return flags
