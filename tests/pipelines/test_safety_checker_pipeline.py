"""The SD 1.x safety checker inside the pipeline: loaded from the folder, run after decoding, flags per image,
with `jit=True` (per-device batch > 1) and `jit=False` (an upstream crash), and disabled with safety_checker=None."""

import shutil

import jax
import numpy as np
import pytest
import reference
import torch

from sdjax import StableDiffusionPipeline, replicate, shard

TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}


def _folder_with_checker(base, tmp_path, weight: float):
    """The tiny SD1 folder plus a tiny safety checker whose thresholds flag every image (weight < -1: any cosine
    similarity passes) or none (weight > 1)."""
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker as Torch
    from transformers import CLIPConfig, CLIPImageProcessor

    folder = tmp_path / "with-checker"
    shutil.copytree(base, folder)
    reference.seed_everything(0)
    checker = Torch(
        CLIPConfig(
            text_config={"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1, "num_attention_heads": 4},
            vision_config=TINY_VISION,
            projection_dim=16,
        )
    ).eval()
    with torch.no_grad():
        checker.concept_embeds_weights.fill_(weight)
        checker.special_care_embeds_weights.fill_(weight)
    checker.save_pretrained(folder / "safety_checker", safe_serialization=True)
    CLIPImageProcessor(size={"shortest_edge": 224}, crop_size=224).save_pretrained(folder / "feature_extractor")
    index = (folder / "model_index.json").read_text()
    index = index.replace(
        '"safety_checker": [\n    null,\n    null\n  ]',
        '"safety_checker": [\n    "stable_diffusion",\n    "StableDiffusionSafetyChecker"\n  ]',
    )
    index = index.replace(
        '"feature_extractor": [\n    null,\n    null\n  ]',
        '"feature_extractor": [\n    "transformers",\n    "CLIPImageProcessor"\n  ]',
    )
    assert "StableDiffusionSafetyChecker" in index and "CLIPImageProcessor" in index
    (folder / "model_index.json").write_text(index)
    return folder


@pytest.fixture(scope="module")
def loaded(sd1_dir, tmp_path_factory):
    """The folder whose checker flags every image, loaded with and without its checker; the unchecked image."""
    folder = _folder_with_checker(sd1_dir, tmp_path_factory.mktemp("checker"), -2.0)
    pipe, params = StableDiffusionPipeline.from_pretrained(str(folder))
    assert "safety_checker" in params and pipe.safety_checker is not None
    plain, plain_params = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None)
    assert "safety_checker" not in plain_params
    rng = jax.random.split(jax.random.PRNGKey(0), 8)
    unchecked = plain(plain.prepare_inputs(["a cat"]), plain_params, rng[0], num_inference_steps=2)
    assert unchecked.nsfw_content_detected is None and unchecked.images.max() > 0
    return pipe, params, rng, unchecked


# The second case sets the loaded checker's thresholds to flag nothing (weight 2: no cosine similarity passes) in
# the params, so both cases run the same compiled programs.
@pytest.mark.parametrize("weight,flagged", [(-2.0, True), (2.0, False)])
def test_checker_flags_and_blacks_per_image(loaded, weight, flagged):
    pipe, params, rng, unchecked = loaded
    checker = dict(params["safety_checker"])
    for name in ("concept_embeds_weights", "special_care_embeds_weights"):
        checker[name] = np.full_like(np.asarray(checker[name]), weight)
    params = {**params, "safety_checker": checker}
    ids = shard(pipe.prepare_inputs(["a cat", "a dog"] * 8))  # (8, 2, 77): two images per device
    out = pipe(ids, replicate(params), rng, num_inference_steps=2, jit=True)
    assert out.images.shape == (8, 2, 64, 64, 3)
    assert out.nsfw_content_detected.shape == (8, 2)
    assert out.nsfw_content_detected.all() == flagged and out.nsfw_content_detected.any() == flagged
    assert (out.images.max() == 0) == flagged
    # jit=False with the checker (crashed upstream).
    single = pipe(pipe.prepare_inputs(["a cat"]), params, rng[0], num_inference_steps=2)
    assert single.nsfw_content_detected.shape == (1,) and bool(single.nsfw_content_detected[0]) == flagged
    # Disabled (safety_checker=None, in the fixture): no flags, images as generated.
    if not flagged:
        np.testing.assert_allclose(single.images, unchecked.images, atol=1e-6)
