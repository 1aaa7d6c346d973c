"""Text conditioning of Stable Diffusion 1.x / 2.x: one CLIP text encoder (diffusers `StableDiffusionPipeline`).

The UNet's context is the final-layer-normed last hidden state of the prompt `(B, 77, D)` (an earlier layer's with
`clip_skip`, see `families.clip_skip`); the unconditional branch encodes the negative prompt (the empty prompt when
none is given), stacked before the conditional one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from sdjax.families.sd.clip_skip import clip_skip_input, select_layer
from sdjax.models.clip import final_layer_norm
from sdjax.text import prompt_syntax


@dataclasses.dataclass(frozen=True, eq=False)
class SDConditioning:
    """Host side: `tokenize`, `host_inputs`; device side: `encode` (traced inside the generation program)."""

    tokenizer: Any
    text_encoder: Any

    name = "sd"
    components = ("text_encoder",)
    per_image_options = ("clip_skip",)  # lists of one value per image (the generator pads them with the batch)

    def accepts_prompt_syntax(self, syntax: str) -> bool:
        """Both "plain" and "a1111" (weights, BREAK, 75-token chunks: `text.prompt_syntax.a1111_text_inputs`)."""
        return syntax in ("plain", "a1111")

    @property
    def tokenizers(self) -> tuple[Any, ...]:
        return (self.tokenizer,)

    @property
    def ids_suffix(self) -> tuple[int, ...]:
        return (self.tokenizer.model_max_length,)

    def text_inputs(
        self, prompts: Sequence[str], negative_prompts: Sequence[str], *, syntax: str = "plain"
    ) -> dict[str, np.ndarray]:
        """Token ids of the prompts and negative prompts (`ids`, `neg_ids`); with "a1111" also their weights and
        chunk count (`text.prompt_syntax.a1111_text_inputs`)."""
        if syntax == "a1111":
            return prompt_syntax.a1111_text_inputs(self.tokenizers, prompts, negative_prompts, stacked=False)
        return {"ids": self.tokenize(prompts), "neg_ids": self.tokenize(negative_prompts)}

    def tokenize(self, prompts: Sequence[str]) -> np.ndarray:
        """CLIP ids `(N, 77)` int32 (truncated with a warning)."""
        return self.tokenizer(list(prompts))

    def host_inputs(
        self,
        *,
        negative_prompts: Sequence[str],
        height: int,
        width: int,
        task: str,
        clip_skip: int | Sequence[int] = 1,
        **options: Any,
    ) -> dict[str, np.ndarray]:
        """Per-image conditioning beyond the text: `clip_skip` `(N,)` int32."""
        if options:
            raise TypeError(
                f"unexpected conditioning argument(s) {sorted(options)} for an SD 1.x/2.x model "
                f"(SDXL micro-conditioning applies to SDXL models only)"
            )
        layers = self.text_encoder.config.num_hidden_layers
        return {"clip_skip": clip_skip_input(clip_skip, len(negative_prompts), layers)}

    def encode(self, params: dict, inputs: dict, *, cfg: bool) -> tuple[Any, dict]:
        """`inputs["ids"]`, `inputs["neg_ids"]` -> (context `(2B or B, 77, D)`, UNet keyword arguments)."""
        ids = jnp.concatenate([inputs["neg_ids"], inputs["ids"]]) if cfg else inputs["ids"]
        skip = jnp.concatenate([inputs["clip_skip"]] * 2) if cfg else inputs["clip_skip"]
        weighted = "weights" in inputs  # A1111 prompt syntax: 77-token chunks encoded apart, weighted, concatenated
        batch, length = ids.shape
        chunk = self.tokenizer.model_max_length
        if weighted:
            ids, skip = ids.reshape(-1, chunk), jnp.repeat(skip, length // chunk)
        out = self.text_encoder.apply({"params": params["text_encoder"]}, ids)
        earlier = final_layer_norm(
            self.text_encoder.config,
            params["text_encoder"],
            select_layer(out.hidden_states, skip),
            out.last_hidden_state.dtype,
        )
        z = jnp.where((skip == 1)[:, None, None], out.last_hidden_state, earlier)
        if weighted:
            weights = jnp.concatenate([inputs["neg_weights"], inputs["weights"]]) if cfg else inputs["weights"]
            z = prompt_syntax.emphasize(z, weights.reshape(-1, chunk)).reshape(batch, length, -1)
        return z, {}
