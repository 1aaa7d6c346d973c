"""The SD 1.x safety checker against diffusers' `StableDiffusionSafetyChecker` (tiny CLIP vision tower) and CLIP
preprocessing against transformers' `CLIPImageProcessorPil`.

Tolerances (float32, CPU): pixel_values atol 1e-5 (measured 0.0), image_embeds atol 1e-5 (measured 4e-6 on values
up to 13); the NSFW flags and blacked-out images must be identical.
"""

import dataclasses

import jax
import numpy as np
import pytest
import reference

from sdjax.models.convert import WeightLoadError
from sdjax.models.safety_checker import (
    SafetyCheckerConfig,
    StableDiffusionSafetyChecker,
    convert_safety_checker,
    preprocess,
)

ATOL = 1e-5

TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=224,
    patch_size=32,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)


def _images(shape=(6, 96, 128, 3), seed=0):
    """Smooth random images (a few blurred blobs), floats in [0, 1]."""
    rng = np.random.default_rng(seed)
    n, h, w, _ = shape
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    out = np.zeros(shape, np.float32)
    for i in range(n):
        for _ in range(4):
            cy, cx, r = rng.uniform(0, 1, 3)
            out[i] += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (0.05 + 0.2 * r))[..., None] * rng.uniform(0, 1, 3)
    out += 0.05 * rng.standard_normal(shape)
    return np.clip(out / out.max(), 0, 1).astype(np.float32)


def _to_pil(images):
    from PIL import Image

    return [Image.fromarray(a) for a in np.round(images * 255).astype(np.uint8)]


def _hf_pixels(images):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    pixels = CLIPImageProcessorPil()(_to_pil(images), return_tensors="np")["pixel_values"]
    return pixels.transpose(0, 2, 3, 1)  # NCHW -> NHWC


@pytest.mark.parametrize("hw", [(512, 512), (480, 640), (700, 300), (100, 150), (224, 224)])
def test_preprocess_matches_transformers(hw):
    images = _images((2, *hw, 3), seed=hw[0])
    got = preprocess(images)
    assert got.shape == (2, 224, 224, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got, _hf_pixels(images), atol=ATOL, rtol=0)
    np.testing.assert_allclose(preprocess(_to_pil(images)), got, atol=0, rtol=0)  # PIL input, same numbers


def _torch_checker(seed=0):
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker as Torch
    from transformers import CLIPConfig

    reference.seed_everything(seed)
    model = Torch(
        CLIPConfig(
            text_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4),
            vision_config=TINY_VISION,
            projection_dim=16,
        )
    ).eval()
    reference.perturb_norms(model, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.concept_embeds.copy_(torch.randn(model.concept_embeds.shape, generator=g))
        model.special_care_embeds.copy_(torch.randn(model.special_care_embeds.shape, generator=g))
    return model


def _torch_embeds(model, pixels_nhwc):
    import torch

    with torch.no_grad():
        pooled = model.vision_model(torch.from_numpy(pixels_nhwc.transpose(0, 3, 1, 2).copy()))[1]
        return model.visual_projection(pooled).numpy()


def _cos(a, b):
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return a @ b.T


def _set_concepts(model, embeds):
    """Concept embeddings and thresholds that flag some images and not others, each score at least 2e-3 from 0
    (away from the rounding to 3 decimals): image 1 is special-care, image 3 matches concept 0, and concept 1
    flags image 1 only through the special-care +0.01."""
    import torch

    centered = embeds - embeds.mean(0)
    with torch.no_grad():
        model.special_care_embeds[0] = torch.from_numpy(centered[1])
        model.concept_embeds[0] = torch.from_numpy(centered[3])
        model.concept_embeds[1] = torch.from_numpy(centered[1] + 0.3 * centered[2])
    special = _cos(embeds, model.special_care_embeds.detach().numpy())
    concept = _cos(embeds, model.concept_embeds.detach().numpy())

    def between_first_and_second(column):
        top = np.sort(column)[::-1]
        assert top[0] - top[1] > 0.02, "no clear winner"
        return (top[0] + top[1]) / 2

    special_w = np.full(3, 2.0, np.float32)
    special_w[0] = between_first_and_second(special[:, 0])
    concept_w = np.full(17, 2.0, np.float32)
    concept_w[0] = between_first_and_second(concept[:, 0])
    concept_w[1] = concept[1, 1] + 0.005  # image 1: -0.005 + 0.01 adjustment > 0
    assert np.argmax(special[:, 0]) == 1 and np.argmax(concept[:, 0]) == 3 and np.argmax(concept[:, 1]) == 1
    assert (np.delete(concept[:, 1], 1) < concept_w[1] - 2e-3).all()
    with torch.no_grad():
        model.special_care_embeds_weights.copy_(torch.from_numpy(special_w))
        model.concept_embeds_weights.copy_(torch.from_numpy(concept_w))
    return {1, 3}


def test_parity_with_diffusers():
    import torch

    model = _torch_checker()
    images = _images()
    pixels = _hf_pixels(images)
    flagged = _set_concepts(model, _torch_embeds(model, pixels))

    config = SafetyCheckerConfig.from_dict(model.config.to_dict(), source="tiny")
    params = convert_safety_checker(reference.state_dict_numpy(model), config)
    checker = StableDiffusionSafetyChecker(config)

    out = checker.apply({"params": params}, preprocess(images))
    np.testing.assert_allclose(out.image_embeds, _torch_embeds(model, pixels), atol=ATOL, rtol=0)

    want_images, want_nsfw = model(
        clip_input=torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy()), images=images.copy()
    )
    got_images, got_nsfw = checker.check(params, images)
    assert got_nsfw.tolist() == list(want_nsfw) == [i in flagged for i in range(len(images))]
    np.testing.assert_array_equal(got_images, want_images)
    assert (got_images[sorted(flagged)] == 0).all() and not (images[sorted(flagged)] == 0).all()


def test_both_checkpoint_spellings_convert_and_bad_keys_are_named():
    model = _torch_checker()
    config = SafetyCheckerConfig.from_dict(model.config.to_dict(), source="tiny")
    v5 = reference.state_dict_numpy(model)
    assert "vision_model.embeddings.class_embedding" in v5
    legacy = {k.replace("vision_model.", "vision_model.vision_model.", 1): v for k, v in v5.items()}
    legacy["vision_model.vision_model.embeddings.position_ids"] = np.arange(50)[None]
    a, b = convert_safety_checker(v5, config), convert_safety_checker(legacy, config)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)

    bad = dict(legacy)
    del bad["concept_embeds"]
    bad["vision_model.vision_model.embeddings.patch_embedding.weight"] = np.zeros((32, 3, 16, 16), np.float32)
    with pytest.raises(WeightLoadError) as info:
        convert_safety_checker(bad, config)
    assert info.value.missing == ["concept_embeds"]
    assert info.value.misshaped[0].startswith("vision_model.vision_model.embeddings.patch_embedding.weight")


# The released `safety_checker/config.json` of SD 1.x (CompVis/stable-diffusion-safety-checker), abridged only in
# the generic keys repeated in text_config.
_GENERIC = {
    "add_cross_attention": False,
    "architectures": None,
    "bad_words_ids": None,
    "bos_token_id": None,
    "chunk_size_feed_forward": 0,
    "cross_attention_hidden_size": None,
    "decoder_start_token_id": None,
    "diversity_penalty": 0.0,
    "do_sample": False,
    "early_stopping": False,
    "encoder_no_repeat_ngram_size": 0,
    "eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "finetuning_task": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "is_decoder": False,
    "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "length_penalty": 1.0,
    "max_length": 20,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "num_beam_groups": 1,
    "num_beams": 1,
    "num_return_sequences": 1,
    "output_attentions": False,
    "output_hidden_states": False,
    "output_scores": False,
    "pad_token_id": None,
    "prefix": None,
    "problem_type": None,
    "pruned_heads": {},
    "remove_invalid_values": False,
    "repetition_penalty": 1.0,
    "return_dict": True,
    "return_dict_in_generate": False,
    "sep_token_id": None,
    "task_specific_params": None,
    "temperature": 1.0,
    "tf_legacy_loss": False,
    "tie_encoder_decoder": False,
    "tie_word_embeddings": True,
    "tokenizer_class": None,
    "top_k": 50,
    "top_p": 1.0,
    "torch_dtype": None,
    "torchscript": False,
    "transformers_version": "4.22.0.dev0",
    "typical_p": 1.0,
    "use_bfloat16": False,
}
REAL_CONFIG = {
    "_name_or_path": "CompVis/stable-diffusion-safety-checker",
    "architectures": ["StableDiffusionSafetyChecker"],
    "initializer_factor": 1.0,
    "logit_scale_init_value": 2.6592,
    "model_type": "clip",
    "projection_dim": 768,
    "torch_dtype": "float32",
    "transformers_version": None,
    "text_config": {**_GENERIC, "hidden_size": 768, "model_type": "clip_text_model", "vocab_size": 49408},
    "text_config_dict": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
    },
    "vision_config": {
        **_GENERIC,
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "hidden_act": "quick_gelu",
        "hidden_size": 1024,
        "image_size": 224,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "layer_norm_eps": 1e-05,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 24,
        "patch_size": 14,
    },
    "vision_config_dict": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
    },
}


def test_released_config_and_full_size_key_set():
    """The released config builds ViT-L/14; every key of the full-size diffusers model converts (no memory)."""
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker as Torch
    from transformers import CLIPConfig

    config = SafetyCheckerConfig.from_dict(REAL_CONFIG, source="safety_checker/config.json")
    v = config.vision_config
    assert (v.hidden_size, v.num_hidden_layers, v.patch_size, config.projection_dim) == (1024, 24, 14, 768)
    with torch.device("meta"):
        model = Torch(CLIPConfig(vision_config=dataclasses.asdict(v), projection_dim=768))
    state = {
        k.replace("vision_model.", "vision_model.vision_model.", 1): np.broadcast_to(np.float32(0), t.shape)
        for k, t in model.state_dict().items()
    }
    params = convert_safety_checker(state, config)
    assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)) == sum(
        t.numel() for t in model.state_dict().values()
    )

    from sdjax.config import ConfigError

    with pytest.raises(ConfigError, match="use_rope"):
        SafetyCheckerConfig.from_dict({**REAL_CONFIG, "vision_config_dict": {"use_rope": True}}, source="x")
