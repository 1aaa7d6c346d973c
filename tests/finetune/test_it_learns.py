"""Training learns: a LoRA trained on the tiny random SD 1.x model for 100 updates on four images of one solid
saturated colour (captioned "sks") (a) lowers the diffusion loss on a fixed batch, judged with the same noise and
timesteps before and after, and (b) makes the model's samples for "sks" move towards what it was shown.

Both judgements use the LoRA as written to the kohya file and read back by sdjax's inference loader
(`loading.lora.load_lora` + `apply_loras`), not the trainer's own state, and a loss evaluated by `step.make_loss` on
a batch built here (the four images, 8 fixed keys: 32 noise / timestep draws, none of them the training draws).

(b) is judged in latent space: the tiny test model's VAE is random, and its decoder maps very different latents to
nearly the same flat colour (mean RGB 0.627 / 0.621 / 0.509 for the base model's and the LoRA's samples alike,
against the images' 0.90 / 0.12 / 0.12), so a colour distance of decoded images cannot show anything on this model.
What the LoRA learns is the distribution of the images' latents (the VAE encoder's, which is what the UNet is
trained on): the final latents of the trained model's samples (`output_type="latent"`, 20 PNDM steps, the
pipeline's guidance, samples 0-2 of seed 0) are closer (L2) to the mean latent of the training images than the
base model's samples of the same seed.

Measured (2 CPU cores, rank 8, lr 1e-2, batch 4, 100 updates, about 30 s): fixed-batch loss, mean of 8 keys,
1.071 -> 0.572 (ratio 0.53; every key lower, the least by 0.36); training loss, mean of the first 10 updates 1.062,
of the last 10 0.581 (ratio 0.55); latent distance to the images' mean latent, base -> LoRA, samples 0/1/2:
160.6 -> 110.5, 187.0 -> 135.0, 182.6 -> 130.6 (ratios 0.69, 0.72, 0.71). The thresholds leave margin: loss ratios
below 0.75 (fixed batch) and 0.8 (training curve), each key's loss lower, the latent distance ratio below 0.85 for
every sample.
"""

import numpy as np
import pytest
from PIL import Image

from sdjax.finetune import train_lora

COLOUR = (230, 30, 30)  # saturated red: nothing like the base model's samples
SEEDS = 3


@pytest.fixture(scope="module")
def red_images(tmp_path_factory):
    root = tmp_path_factory.mktemp("red")
    rng = np.random.default_rng(0)
    for i in range(4):
        pixels = np.clip(np.asarray(COLOUR)[None, None] + rng.normal(0.0, 4.0, (64, 64, 3)), 0, 255)
        Image.fromarray(pixels.astype(np.uint8)).save(root / f"red{i}.png")
        (root / f"red{i}.txt").write_text("sks")
    return root


def _fixed_batch(folder, conditioning) -> dict:
    pixels = [np.asarray(Image.open(folder / f"red{i}.png"), np.float32) / 127.5 - 1.0 for i in range(4)]
    return {
        "pixels": np.stack(pixels).transpose(0, 3, 1, 2),
        "ids": np.asarray(conditioning.tokenize(["sks"] * 4), np.int32),
        "clip_skip": np.ones((4,), np.int32),
        "time_ids": np.zeros((4, 6), np.float32),
    }


def test_lora_lowers_the_loss_and_moves_samples_towards_the_data(sd1_dir, red_images, tmp_path):
    import jax
    import jax.numpy as jnp

    from sdjax.core import autoencoder
    from sdjax.finetune import step as step_lib
    from sdjax.loading import lora as loading_lora
    from sdjax.pipelines import load_pipeline

    out = tmp_path / "red.safetensors"
    result = train_lora(
        red_images, out, model=str(sd1_dir), steps=100, rank=8, lr=1e-2, batch_size=4, resolution=64, devices=1
    )
    first, last = float(np.mean(result.losses[:10])), float(np.mean(result.losses[-10:]))
    assert last < 0.8 * first, (first, last)

    pipe, base = load_pipeline(str(sd1_dir))
    lora = loading_lora.load_lora(out, base, unet_config=pipe.unet.config)
    trained = loading_lora.apply_loras(base, [(lora, 1.0)])
    conditioning = pipe.generator.models.conditioning
    models = step_lib.Models(conditioning, pipe.unet, pipe.vae)
    loss = jax.jit(step_lib.make_loss(models, step_lib.Objective("epsilon"), pipe.scheduler.alphas_cumprod))
    batch = _fixed_batch(red_images, conditioning)
    components = ("unet", "vae", *conditioning.components)

    def losses(params) -> np.ndarray:
        frozen = {c: params[c] for c in components}
        return np.asarray([float(loss({}, frozen, batch, jax.random.PRNGKey(1000 + k))) for k in range(8)])

    before, after = losses(base), losses(trained)
    assert np.all(after < before), (before, after)
    assert after.mean() < 0.75 * before.mean(), (before.mean(), after.mean())

    pixels = jnp.asarray(batch["pixels"])
    factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    eps = jnp.zeros((4, pipe.vae.config.latent_channels, 64 // factor, 64 // factor))  # the posterior mean
    target = np.asarray(autoencoder.encode(pipe.vae, base["vae"], pixels, eps, jnp.float32)).mean(axis=0)

    def distances(params) -> np.ndarray:
        latents = pipe.generate(
            "sks", num_images=SEEDS, seed=0, steps=20, height=64, width=64, output_type="latent", params=params
        )
        return np.linalg.norm(np.asarray(latents).reshape(SEEDS, -1) - target.reshape(1, -1), axis=1)

    d_base, d_lora = distances(base), distances(trained)
    assert np.all(d_lora < 0.85 * d_base), (d_base, d_lora)
