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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

MAX_SEQUENCE_LENGTH = 512  # T5's position buckets are relative, but Flux was trained with at most 512 tokens


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
    per_image_options = ("guidance",)  # lists of one value per image (the generator pads them with the batch)

    def accepts_prompt_syntax(self, syntax: str) -> bool:
        """Only "plain": A1111's syntax (weights, BREAK, 75-token chunks) is not read for Flux's T5 stream."""
        return syntax == "plain"

    def __post_init__(self):
        check_max_sequence_length(self.max_sequence_length)

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
        **options: Any,
    ) -> dict[str, np.ndarray]:
        """`guidance` `(N,)` (dev's embedded guidance scale; ignored by schnell's transformer) and, with
        `prompt_2` / `negative_prompt_2` (one per image), the T5 ids of those texts instead of the prompts'."""
        if options:
            raise TypeError(f"unexpected conditioning argument(s) {sorted(options)} for a Flux model")
        n = len(negative_prompts)
        g = np.broadcast_to(np.asarray(guidance, np.float32).reshape(-1), (n,)) if np.ndim(guidance) == 0 else None
        if g is None:
            g = np.asarray(guidance, np.float32).reshape(-1)
            if g.shape != (n,):
                raise ValueError(f"guidance: got {g.shape[0]} values for {n} images")
        out = {"embedded_guidance": np.ascontiguousarray(g)}
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
        return {
            "text": t5,
            "pooled": clip.pooler_output,
            "guidance": jnp.concatenate([g, g]) if cfg else g,
        }


def check_max_sequence_length(n: Any) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 1 <= n <= MAX_SEQUENCE_LENGTH:
        raise ValueError(f"max_sequence_length={n!r} must be an int in [1, {MAX_SEQUENCE_LENGTH}] (Flux: T5 tokens)")
    return int(n)
