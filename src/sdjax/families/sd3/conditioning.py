"""Text conditioning of Stable Diffusion 3 / 3.5 (diffusers `StableDiffusion3Pipeline.encode_prompt`): CLIP-L, CLIP-G
and T5.

- `prompt` goes through CLIP ViT-L (`text_encoder`), `prompt_2` (default: `prompt`) through OpenCLIP bigG
  (`text_encoder_2`), both `CLIPTextModelWithProjection` on 77 tokens without an attention mask. Their penultimate
  hidden states (`hidden_states[-2]`, before the final LayerNorm; diffusers' `clip_skip=None`) are concatenated along
  features (768 + 1280) and padded with zeros to T5's width (`joint_attention_dim`, 4096).
- `prompt_3` (default: `prompt`) goes through T5 v1.1 XXL (`text_encoder_3`), padded to `max_sequence_length` (256)
  and encoded without an attention mask, as diffusers does. Without a T5 (`text_encoder_3=None`, diffusers allows
  it) its part is `max_sequence_length` tokens of zeros, and `prompt_3` is unused.
- The transformer's text stream is [CLIP (77 tokens), T5 (max_sequence_length tokens)] along tokens; its pooled
  input is [CLIP-L `text_embeds`, CLIP-G `text_embeds`] (768 + 1280 = 2048).
- With classifier-free guidance the negative prompts (`negative_prompt_2` / `negative_prompt_3` default to the
  negative prompt, which defaults to "") are encoded the same way and stacked first.
- Skip-layer guidance's per-image inputs travel with the conditioning (the denoiser reads them; see
  `families.sd3.denoiser`): `slg_scale` `(N,)` (0: off) and `slg_timesteps` `(N, 2)`, the model timesteps of the
  first and last step it covers.
- `zero_negative` (per image; ComfyUI's ConditioningZeroOut as the negative): the negative's text states and pooled
  embeddings are zeros (not the empty prompt's encoding), as diffusers' `negative_prompt_embeds` of zeros give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from sdjax.families.flux.conditioning import zero_flags
from sdjax.text.t5_tokenizer import check_max_sequence_length

DEFAULT_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline.__call__'s default

# host_inputs' text options -> (the encoder's ids key, the encoder's name)
TEXT_OPTIONS = {
    "prompt_2": ("ids_2", "text_encoder_2"),
    "negative_prompt_2": ("neg_ids_2", "text_encoder_2"),
    "prompt_3": ("t5_ids", "text_encoder_3"),
    "negative_prompt_3": ("neg_t5_ids", "text_encoder_3"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class SD3Conditioning:
    """Host side: `text_inputs`, `host_inputs`; device side: `encode` (traced inside the generation program).
    `tokenizer_3` / `text_encoder_3` are None for a pipeline without T5; `joint_attention_dim` is the
    transformer's text width (T5's `d_model`)."""

    tokenizer: Any  # CLIP-L
    text_encoder: Any  # CLIPTextModelWithProjection
    tokenizer_2: Any  # CLIP-G (OpenCLIP bigG; pads with "!")
    text_encoder_2: Any  # CLIPTextModelWithProjection
    tokenizer_3: Any  # T5 (sdjax.text.t5_tokenizer.T5Tokenizer) or None
    text_encoder_3: Any  # T5EncoderModel or None
    joint_attention_dim: int
    max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH

    name = "sd3"
    per_image_options = ("zero_negative",)  # (`prompt_2` / `prompt_3` lists are padded by `host_inputs` itself)

    def accepts_prompt_syntax(self, syntax: str) -> bool:
        """Only "plain": A1111's syntax (weights, BREAK, 75-token chunks) is not read for SD 3's three encoders."""
        return syntax == "plain"

    def __post_init__(self):
        check_max_sequence_length(self.max_sequence_length, "SD 3")
        clip = sum(int(e.config.hidden_size) for e in (self.text_encoder, self.text_encoder_2))
        if clip > self.joint_attention_dim:
            raise ValueError(
                f"SD 3: the CLIP states are {clip} wide together, more than the transformer's joint_attention_dim "
                f"{self.joint_attention_dim} they are padded to"
            )
        if self.text_encoder_3 is not None and int(self.text_encoder_3.config.d_model) != self.joint_attention_dim:
            raise ValueError(
                f"SD 3: text_encoder_3 (T5) is {self.text_encoder_3.config.d_model} wide, the transformer's "
                f"joint_attention_dim is {self.joint_attention_dim}"
            )

    @property
    def t5(self) -> bool:
        return self.text_encoder_3 is not None

    @property
    def components(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2", *(("text_encoder_3",) if self.t5 else ()))

    def with_max_sequence_length(self, n: int) -> SD3Conditioning:
        return dataclasses.replace(self, max_sequence_length=int(n))

    def text_inputs(
        self, prompts: Sequence[str], negative_prompts: Sequence[str], *, syntax: str = "plain"
    ) -> dict[str, np.ndarray]:
        """CLIP-L ids `(N, 77)` (`ids`, `neg_ids`), CLIP-G ids (`ids_2`, `neg_ids_2`) and, with T5, T5 ids
        `(N, max_sequence_length)` (`t5_ids`, `neg_t5_ids`): every encoder reads the prompt itself."""
        if syntax != "plain":
            raise ValueError(f"prompt_syntax={syntax!r}: this model's conditioning reads plain prompts only")
        out = {}
        for prefix, texts in (("", prompts), ("neg_", negative_prompts)):
            out[f"{prefix}ids"] = self.tokenizer(list(texts))
            out[f"{prefix}ids_2"] = self.tokenizer_2(list(texts))
            if self.t5:
                out[f"{prefix}t5_ids"] = self.t5_ids(texts)
        return out

    def t5_ids(self, prompts: Sequence[str]) -> np.ndarray:
        return np.asarray(self.tokenizer_3(list(prompts), self.max_sequence_length), np.int32)

    def _ids(self, key: str, texts: list[str]) -> np.ndarray:
        if key.endswith("t5_ids"):
            return self.t5_ids(texts)
        return self.tokenizer_2(texts)

    def host_inputs(
        self,
        *,
        negative_prompts: Sequence[str],
        height: int,
        width: int,
        task: str,
        skip_layer_guidance_scale: float = 0.0,
        skip_layer_guidance_timesteps: tuple[float, float] | None = None,
        zero_negative: bool | Sequence[bool] = False,
        **options: Any,
    ) -> dict[str, np.ndarray]:
        """The ids of `prompt_2` / `negative_prompt_2` (CLIP-G) and `prompt_3` / `negative_prompt_3` (T5), one text
        per image, in place of the (negative) prompt's (`prompt_3` / `negative_prompt_3` are unused without T5), and
        skip-layer guidance's `slg_scale` and `slg_timesteps` (`skip_layer_guidance_timesteps`: the model timesteps
        `(t_first, t_last)` of the first and last step it covers; None: no step), and `zero_neg` `(N,)` bool
        (`zero_negative`: zero negative embeddings)."""
        unknown = sorted(set(options) - set(TEXT_OPTIONS))
        if unknown:
            raise TypeError(f"unexpected conditioning argument(s) {unknown} for an SD 3 model")
        n = len(negative_prompts)
        if not np.isfinite(skip_layer_guidance_scale):
            raise ValueError(f"skip_layer_guidance_scale={skip_layer_guidance_scale!r} must be a finite number")
        span = (-1.0, -1.0) if skip_layer_guidance_timesteps is None else skip_layer_guidance_timesteps
        out = {
            "slg_scale": np.full((n,), skip_layer_guidance_scale, np.float32),
            "slg_timesteps": np.tile(np.asarray(span, np.float32).reshape(1, 2), (n, 1)),
            "zero_neg": zero_flags(zero_negative, n),
        }
        for name, texts in options.items():
            key, encoder = TEXT_OPTIONS[name]
            if texts is None or (encoder == "text_encoder_3" and not self.t5):
                continue
            texts = list(texts) + [""] * (n - len(texts))  # the generator's padding images
            if len(texts) != n:
                raise ValueError(f"{name}: got {len(texts)} texts for {n} images")
            out[key] = self._ids(key, texts)
        return out

    def encode(self, params: dict, inputs: dict, *, cfg: bool) -> dict[str, Any]:
        """-> `{"text": (B', 77 + max_sequence_length, joint_attention_dim), "pooled": (B', 2048)}`, negative
        prompts first with `cfg`."""

        def both(pos, neg):
            return jnp.concatenate([inputs[neg], inputs[pos]]) if cfg else inputs[pos]

        clip_l = self.text_encoder.apply({"params": params["text_encoder"]}, both("ids", "neg_ids"))
        clip_g = self.text_encoder_2.apply({"params": params["text_encoder_2"]}, both("ids_2", "neg_ids_2"))
        clip = jnp.concatenate([clip_l.hidden_states[-2], clip_g.hidden_states[-2]], axis=-1)
        clip = jnp.pad(clip, ((0, 0), (0, 0), (0, self.joint_attention_dim - clip.shape[-1])))
        if self.t5:
            t5 = self.text_encoder_3.apply({"params": params["text_encoder_3"]}, both("t5_ids", "neg_t5_ids"))
        else:
            t5 = jnp.zeros((clip.shape[0], self.max_sequence_length, self.joint_attention_dim), clip.dtype)
        text = jnp.concatenate([clip, t5.astype(clip.dtype)], axis=1)
        pooled = jnp.concatenate([clip_l.text_embeds, clip_g.text_embeds], axis=-1)
        if cfg and "zero_neg" in inputs:  # ConditioningZeroOut: zero negative states and pooled embeddings
            keep = jnp.concatenate([~inputs["zero_neg"], jnp.ones_like(inputs["zero_neg"])])
            text, pooled = text * keep[:, None, None].astype(text.dtype), pooled * keep[:, None].astype(pooled.dtype)
        return {"text": text, "pooled": pooled}
