"""Guidance-distilled UNets (LCM checkpoints, `time_cond_proj_dim`): the guidance scale enters as diffusers'
guidance embedding and no unconditional branch runs; images match diffusers' StableDiffusionPipeline with
LCMScheduler on such a tiny model."""

import json

import numpy as np
import pytest
import torch

from sdjax.families.sd.guidance_embedding import guidance_embedding


@pytest.mark.parametrize("dim", [32, 33])
def test_embedding_matches_diffusers(dim):
    from diffusers import StableDiffusionPipeline

    w = np.array([0.0, 1.5, 7.0], np.float32)
    ref = StableDiffusionPipeline.get_guidance_scale_embedding(None, torch.from_numpy(w - 1), embedding_dim=dim)
    # sin/cos of arguments up to 6000 rad in float32: one ulp of a frequency (XLA's exp vs torch's) moves them 1e-4
    np.testing.assert_allclose(np.asarray(guidance_embedding(w, dim)), ref.numpy(), atol=5e-4)


@pytest.fixture(scope="module")
def lcm_pair(tmp_path_factory):
    import reference
    from diffusers import LCMScheduler, StableDiffusionPipeline

    base = reference.sd_pipeline("sd1")
    unet = reference.unet({**reference.UNET_SD1, "time_cond_proj_dim": 32}, seed=5)
    sched = LCMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    pipe = StableDiffusionPipeline(**{**base.components, "unet": unet, "scheduler": sched})
    path = tmp_path_factory.mktemp("lcm")
    pipe.save_pretrained(path, safe_serialization=True)
    return pipe, path


def test_lcm_unet_images_match_diffusers(lcm_pair):
    from sdjax import StableDiffusionPipeline

    torch_pipe, path = lcm_pair
    pipe, _ = StableDiffusionPipeline.from_pretrained(str(path))
    latents = np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32)
    prompts = ["a red circle", "a blue square"]
    # LCM's multistep sampling draws fresh noise between steps (its own generator): one step compares exactly
    with torch.no_grad():
        ref = torch_pipe(
            prompts, num_inference_steps=1, guidance_scale=4.0, latents=torch.from_numpy(latents),
            output_type="np", height=64, width=64,
        ).images  # fmt: skip
    ours = np.asarray(
        pipe.generate(prompts, steps=1, guidance_scale=4.0, noise=latents, output_type="np", height=64, width=64)
    )
    err = np.abs(ours - ref).max()
    assert err < 1e-3, err
    # several steps with a deterministic sampler on the same distilled UNet
    from diffusers import EulerDiscreteScheduler

    saved = torch_pipe.scheduler
    # from the config on disk, as sdjax swaps (an in-memory config drops the keys left at their defaults)
    on_disk = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    torch_pipe.scheduler = EulerDiscreteScheduler.from_config(on_disk)
    try:
        with torch.no_grad():
            ref3 = torch_pipe(
                prompts, num_inference_steps=3, guidance_scale=4.0, latents=torch.from_numpy(latents),
                output_type="np", height=64, width=64,
            ).images  # fmt: skip
    finally:
        torch_pipe.scheduler = saved
    ours3 = np.asarray(
        pipe.generate(
            prompts, steps=3, guidance_scale=4.0, noise=latents, output_type="np", height=64, width=64, sampler="euler"
        )
    )
    assert np.abs(ours3 - ref3).max() < 1e-3
    other = np.asarray(
        pipe.generate(prompts, steps=1, guidance_scale=1.5, noise=latents, output_type="np", height=64, width=64)
    )
    assert np.abs(other - ours).max() > 10 * err  # the guidance reaches the UNet through the embedding
