"""The SD 1.x safety checker: diffusers' `StableDiffusionSafetyChecker` in Flax, with CLIP's image preprocessing.

A CLIP ViT (ViT-L/14 in the released checker) embeds the image; `visual_projection` maps the pooled CLS feature
to `projection_dim`; the cosine similarity to 17 "concept" and 3 "special care" embeddings, minus a per-embedding
threshold (`*_embeds_weights`), gives scores rounded to 3 decimals. An image with any special-care score > 0 has
0.01 added to every concept score; an image with any concept score > 0 is flagged NSFW and blacked out.

Parameter paths mirror the released checkpoints (`vision_model.vision_model.embeddings.class_embedding`,
`visual_projection.weight`, `concept_embeds`, ...); transformers 5 writes the vision tower one level shallower
(`vision_model.embeddings...`), which `convert_safety_checker` also reads.

`preprocess` is transformers' `CLIPImageProcessor` (PIL backend) in numpy/PIL: images -> uint8 (round(x * 255), as
diffusers' `numpy_to_pil`), resize the shortest side to 224 with PIL bicubic (the long side truncated to an int),
center crop 224x224 (offsets floored), scale to [0, 1], normalize with CLIP's mean/std. The model takes the result
as NHWC `pixel_values`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import config_from_dict
from sdjax.models.clip import ACTIVATIONS, CLIPEncoder, _layer_norm
from sdjax.models.convert import convert_state_dict

logger = logging.getLogger(__name__)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
NUM_CONCEPTS, NUM_SPECIAL_CARE = 17, 3

# transformers < 4.30 dumped every generic `PretrainedConfig` attribute into the nested `text_config` /
# `vision_config` of a CLIPConfig (the released SD 1.x `safety_checker/config.json` does). None of them describes
# the vision architecture (they steer generation, labels, serialization), so they are accepted and dropped.
GENERIC_PRETRAINED_KEYS = frozenset(
    {
        "add_cross_attention",
        "architectures",
        "bad_words_ids",
        "begin_suppress_tokens",
        "bos_token_id",
        "chunk_size_feed_forward",
        "cross_attention_hidden_size",
        "decoder_start_token_id",
        "diversity_penalty",
        "do_sample",
        "early_stopping",
        "encoder_no_repeat_ngram_size",
        "eos_token_id",
        "exponential_decay_length_penalty",
        "finetuning_task",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "id2label",
        "is_decoder",
        "is_encoder_decoder",
        "label2id",
        "length_penalty",
        "max_length",
        "min_length",
        "no_repeat_ngram_size",
        "num_beam_groups",
        "num_beams",
        "num_return_sequences",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "pad_token_id",
        "prefix",
        "problem_type",
        "pruned_heads",
        "remove_invalid_values",
        "repetition_penalty",
        "return_dict",
        "return_dict_in_generate",
        "sep_token_id",
        "suppress_tokens",
        "task_specific_params",
        "temperature",
        "tf_legacy_loss",
        "tie_encoder_decoder",
        "tie_word_embeddings",
        "tokenizer_class",
        "top_k",
        "top_p",
        "torchscript",
        "typical_p",
        "use_bfloat16",
        "_attn_implementation_autoset",
    }
)


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """transformers `CLIPVisionConfig` (defaults as in transformers 5; `projection_dim` is unused by the tower)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    dropout: float = 0.0
    initializer_range: float = 0.02
    initializer_factor: float = 1.0

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; known: {sorted(ACTIVATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


@dataclasses.dataclass(frozen=True)
class SafetyCheckerConfig:
    """The `safety_checker/config.json` (a transformers `CLIPConfig`): only the vision tower is built; the
    `text_config` is read past (the checker has no text tower; its concept embeddings are stored weights)."""

    vision_config: CLIPVisionConfig = CLIPVisionConfig()
    projection_dim: int = 512
    logit_scale_init_value: float = 2.6592
    initializer_factor: float = 1.0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config.json") -> SafetyCheckerConfig:
        """Build from a parsed `config.json`. The legacy `vision_config_dict` (transformers < 4.23) overrides
        `vision_config` key by key, as transformers did; unknown architecture keys raise `ConfigError`."""
        raw = dict(raw)
        vision = {**(raw.pop("vision_config", None) or {}), **(raw.pop("vision_config_dict", None) or {})}
        for key in ("text_config", "text_config_dict"):
            raw.pop(key, None)
        vision_config = config_from_dict(
            CLIPVisionConfig, vision, source=f"{source} (vision_config)", ignore=GENERIC_PRETRAINED_KEYS
        )
        config = config_from_dict(cls, raw, source=source, ignore=GENERIC_PRETRAINED_KEYS)
        return dataclasses.replace(config, vision_config=vision_config)


# ------------------------------------------------------------------ preprocessing


def preprocess(images, image_size: int = 224, mean=CLIP_MEAN, std=CLIP_STD) -> np.ndarray:
    """Images -> CLIP `pixel_values` float32 NHWC `(N, image_size, image_size, 3)`.

    `images`: floats in [0, 1] `(N, H, W, 3)` / `(H, W, 3)`, uint8 arrays of the same shapes, or a list of PIL
    images. Matches transformers' `CLIPImageProcessorPil` (what diffusers feeds the checker) to float rounding.
    """
    from PIL import Image

    if isinstance(images, Image.Image):
        images = [images]
    if not isinstance(images, (list, tuple)):
        arr = np.asarray(images)
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim != 4 or arr.shape[-1] != 3:
            raise ValueError(f"images must be (N, H, W, 3) or (H, W, 3), got shape {arr.shape}")
        if arr.dtype != np.uint8:
            arr = np.round(np.clip(arr.astype(np.float32), 0, 1) * 255).astype(np.uint8)
        images = [Image.fromarray(a) for a in arr]
    out = np.empty((len(images), image_size, image_size, 3), np.float32)
    for i, img in enumerate(images):
        img = img.convert("RGB")
        w, h = img.size
        short, long = min(w, h), max(w, h)
        new_short, new_long = image_size, int(image_size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        arr = np.asarray(img.resize((new_w, new_h), resample=Image.BICUBIC))
        top, left = (new_h - image_size) // 2, (new_w - image_size) // 2
        out[i] = arr[top : top + image_size, left : left + image_size].astype(np.float32) / 255.0
    return (out - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


# ------------------------------------------------------------------ model


class CLIPVisionEmbeddings(nn.Module):
    """Non-overlapping patches (a stride-`patch_size` conv, no bias), a learned CLS token, learned positions."""

    config: CLIPVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels_bhwc):
        c = self.config
        if pixels_bhwc.shape[1:] != (c.image_size, c.image_size, c.num_channels):
            raise ValueError(
                f"pixel_values must be (N, {c.image_size}, {c.image_size}, {c.num_channels}) NHWC, "
                f"got {pixels_bhwc.shape}"
            )
        patches = nn.Conv(
            c.hidden_size,
            (c.patch_size, c.patch_size),
            strides=(c.patch_size, c.patch_size),
            padding="VALID",
            use_bias=False,
            dtype=self.dtype,
            name="patch_embedding",
        )(pixels_bhwc)
        batch = patches.shape[0]
        patches_btd = patches.reshape(batch, -1, c.hidden_size)  # row-major grid, as torch's flatten(2)
        cls_d = self.param("class_embedding", nn.initializers.normal(c.hidden_size**-0.5), (c.hidden_size,))
        cls_btd = jnp.broadcast_to(cls_d.astype(patches_btd.dtype), (batch, 1, c.hidden_size))
        x_btd = jnp.concatenate([cls_btd, patches_btd], axis=1).astype(jnp.float32)
        positions_td = nn.Embed(c.num_positions, c.hidden_size, name="position_embedding")(jnp.arange(c.num_positions))
        return x_btd + positions_td[None].astype(jnp.float32)


class CLIPVisionTransformer(nn.Module):
    """transformers' CLIP vision tower: embeddings -> `pre_layrnorm` (sic) -> encoder (no mask) ->
    `post_layernorm` of the CLS token = `pooler_output` `(B, D)`."""

    config: CLIPVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels_bhwc):
        x_btd = CLIPVisionEmbeddings(self.config, self.dtype, name="embeddings")(pixels_bhwc)
        x_btd = _layer_norm(self.config, "pre_layrnorm")(x_btd)
        last_btd = CLIPEncoder(self.config, self.dtype, name="encoder")(x_btd, None)[-1]
        return _layer_norm(self.config, "post_layernorm")(last_btd[:, 0])


class CLIPVisionModel(nn.Module):
    """The `vision_model` wrapper of transformers < 5 (its only child is again `vision_model`)."""

    config: CLIPVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels_bhwc):
        return CLIPVisionTransformer(self.config, self.dtype, name="vision_model")(pixels_bhwc)


@flax.struct.dataclass
class SafetyCheckerOutput:
    """Per image: `image_embeds` `(B, projection_dim)`; `special_scores` `(B, 3)` and `concept_scores` `(B, 17)`
    (cosine minus threshold, rounded to 3 decimals; concept scores include the 0.01 special-care adjustment);
    `has_nsfw_concepts` `(B,)` bool."""

    image_embeds: jax.Array
    special_scores: jax.Array
    concept_scores: jax.Array
    has_nsfw_concepts: jax.Array


def _cosine(a_bp, b_kp):
    # torch.nn.functional.normalize: x / max(||x||, 1e-12)
    a_bp = a_bp / jnp.maximum(jnp.linalg.norm(a_bp, axis=-1, keepdims=True), 1e-12)
    b_kp = b_kp / jnp.maximum(jnp.linalg.norm(b_kp, axis=-1, keepdims=True), 1e-12)
    return a_bp @ b_kp.T


@functools.partial(jax.jit, static_argnums=0)
def _apply(module, params, pixel_values):
    return module.apply({"params": params}, pixel_values)


class StableDiffusionSafetyChecker(nn.Module):
    """diffusers `StableDiffusionSafetyChecker`: `apply({"params": p}, pixel_values (B, S, S, 3) NHWC)
    -> SafetyCheckerOutput`; `check(params, images)` is the whole step a pipeline runs on its decoded images."""

    config: SafetyCheckerConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixel_values_bhwc) -> SafetyCheckerOutput:
        c = self.config
        pooled_bd = CLIPVisionModel(c.vision_config, self.dtype, name="vision_model")(
            jnp.asarray(pixel_values_bhwc, self.dtype)
        )
        embeds_bp = nn.Dense(c.projection_dim, use_bias=False, dtype=self.dtype, name="visual_projection")(pooled_bd)
        ones = nn.initializers.ones
        concept_kp = self.param("concept_embeds", ones, (NUM_CONCEPTS, c.projection_dim))
        special_kp = self.param("special_care_embeds", ones, (NUM_SPECIAL_CARE, c.projection_dim))
        concept_k = self.param("concept_embeds_weights", ones, (NUM_CONCEPTS,))
        special_k = self.param("special_care_embeds_weights", ones, (NUM_SPECIAL_CARE,))

        embeds_bp = embeds_bp.astype(jnp.float32)
        f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
        special_scores = jnp.round(_cosine(embeds_bp, f32(special_kp)) - f32(special_k), 3)
        adjustment_b = jnp.where(jnp.any(special_scores > 0, axis=1), 0.01, 0.0)
        concept_scores = jnp.round(_cosine(embeds_bp, f32(concept_kp)) - f32(concept_k) + adjustment_b[:, None], 3)
        return SafetyCheckerOutput(
            image_embeds=embeds_bp,
            special_scores=special_scores,
            concept_scores=concept_scores,
            has_nsfw_concepts=jnp.any(concept_scores > 0, axis=1),
        )

    def check(self, params, images) -> tuple[np.ndarray, np.ndarray]:
        """Decoded images (floats in [0, 1], `(N, H, W, 3)`) -> `(images with flagged ones black, has_nsfw (N,)
        bool)`. Preprocesses with `preprocess` on the host, runs the jitted checker, returns numpy (a copy)."""
        images = np.array(images, copy=True)
        pixels = preprocess(images, self.config.vision_config.image_size)
        has_nsfw = np.asarray(_apply(self, params, pixels).has_nsfw_concepts, bool)
        if has_nsfw.any():
            images[has_nsfw] = 0
            logger.warning(
                "Potential NSFW content was detected in %d of %d images; they are returned black.",
                int(has_nsfw.sum()),
                len(has_nsfw),
            )
        return images, has_nsfw

    @classmethod
    def init_params_shape(cls, config: SafetyCheckerConfig):
        """The params tree as `jax.ShapeDtypeStruct`s, via `jax.eval_shape` (nothing allocated)."""
        v = config.vision_config
        pixels = jnp.zeros((1, v.image_size, v.image_size, v.num_channels), jnp.float32)
        return jax.eval_shape(lambda: cls(config).init(jax.random.key(0), pixels))["params"]


# transformers 5 drops the inner `vision_model.` of the released checkpoints; both spellings load.
_RENAMES = ((r"^vision_model\.(embeddings|pre_layrnorm|encoder|post_layernorm)\.", r"vision_model.vision_model.\1."),)
_IGNORE = (r"vision_model\.(vision_model\.)?embeddings\.position_ids",)


def convert_safety_checker(
    state_dict: Mapping[str, Any],
    config: SafetyCheckerConfig,
    *,
    cast: Callable[[np.ndarray], Any] | None = None,
    component: str = "safety_checker",
):
    """A diffusers `StableDiffusionSafetyChecker` state dict -> Flax params; raises `WeightLoadError` naming every
    missing, unexpected and mis-shaped key."""
    return convert_state_dict(
        state_dict,
        StableDiffusionSafetyChecker.init_params_shape(config),
        component=component,
        renames=_RENAMES,
        ignore=_IGNORE,
        cast=cast,
    )
