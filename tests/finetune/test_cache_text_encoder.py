"""Cached text-encoder outputs (`cache_text_encoder_outputs`, `--cache-text-encoder-outputs`; `cache.TextEncoderCache`).

- SD 1.x: one LoRA step's loss and LoRA gradients from a batch of cached text states equal those of the step that
  runs the text encoder on the batch's ids, on the same examples (caption dropout, shuffled tags, clip skip 2) and
  key, to float32 rounding; the cached step's frozen params hold no text encoder. Both runs take their latents from
  a latent cache (the same draws; no VAE compiled into either step).
- SDXL: the cached batch gives the step the context, the pooled `text_embeds` and the per-view `time_ids` that
  encoding its ids gives (text encoders only: no UNet compiled).
- Refused before any model loads: with a text-encoder LoRA, for DreamBooth (its batches are its own), on the CLI.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import data as data_lib
from sdjax.finetune import run as run_lib
from sdjax.finetune import step as step_lib
from sdjax.pipelines import load_pipeline

OPTIONS = dict(batch_size=2, resolution=64, rank=2, seed=3, caption_dropout=0.3, shuffle_tags=True, clip_skip=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("cats")
    rng = np.random.default_rng(4)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"c{i}.png")
        (root / f"c{i}.txt").write_text(f"a cat, sofa, window, colour {i}")
    return root


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    return load_pipeline(str(sd1_dir))


def _cached_run(pipe, params, images, tmp_path, **options):
    """What `train_lora` builds with `cache_text_encoder_outputs=True`: (conditioning models, the step's frozen
    params, initial state, batches, objective, sampler, every frozen param the uncached run's step gets)."""
    cfg = run_lib.LoraTrainConfig(
        data=str(images), out=str(tmp_path / "x.safetensors"), cache_text_encoder_outputs=True, **OPTIONS, **options
    )
    cfg.check()
    data_cfg = cfg.data_config(64)
    dataset = data_lib.with_buckets(data_lib.scan(cfg.data, data_cfg), data_cfg)
    sampler = data_lib.Sampler(dataset, data_cfg, cfg.batch_size, cfg.seed)
    objective = run_lib._objective(cfg, pipe)
    every, state, _, _ = run_lib._lora_step(cfg, pipe, params, jnp.float32, objective)
    models = step_lib.Models(pipe.generator.models.conditioning, pipe.unet, pipe.vae, jnp.float32)
    batches, frozen = run_lib._batches(cfg, models, every, sampler, lambda s: None)
    return models, frozen, state, batches, objective, sampler, every


def _encoded_batch(models, sampler, micro: int, latents=None) -> dict:
    """Micro-batch `micro` as the uncached step gets it: token ids at clip skip 2 (and the cached latents)."""
    loaded = sampler.load(micro)
    if latents is not None:
        loaded = {**loaded, "latents": latents}
        del loaded["pixels"]
    return run_lib._inputs(models.conditioning, loaded, OPTIONS["clip_skip"])


def test_cached_text_states_give_the_encoded_step(sd1, images, tmp_path):
    pipe, params = sd1
    models, frozen, state, batches, objective, sampler, every = _cached_run(
        pipe, params, images, tmp_path, cache_latents=True
    )
    assert sorted(frozen) == ["unet"]  # neither the text encoder nor (with the latent cache) the VAE
    from_cache = batches(0)
    assert sorted(from_cache) == ["context", "latents", "time_ids"]
    assert from_cache["context"].shape == (2, 77, 32) and from_cache["context"].dtype == np.float32
    encoded = _encoded_batch(models, sampler, 0, from_cache["latents"])
    loss_fn = jax.value_and_grad(step_lib.make_loss(models, objective, pipe.scheduler.alphas_cumprod))
    key = jax.random.fold_in(jax.random.PRNGKey(7), 0)  # a step's key at update 0
    loss_b, grads_b = jax.jit(loss_fn)(state["lora"], frozen, from_cache, key)
    uncached = {c: every[c] for c in ("unet", "text_encoder")}  # the uncached step's (with cached latents)
    loss_a, grads_a = jax.jit(loss_fn)(state["lora"], uncached, encoded, key)
    loss_rel = abs(float(loss_b) - float(loss_a)) / abs(float(loss_a))
    worst = max(
        float(jnp.abs(a - b).max() / jnp.abs(a).max())
        for a, b in zip(jax.tree_util.tree_leaves(grads_a), jax.tree_util.tree_leaves(grads_b), strict=True)
        if float(jnp.abs(a).max()) > 0
    )
    print(
        f"cached text states: loss {float(loss_b):.8f} vs {float(loss_a):.8f} (relative {loss_rel:.1e}), "
        f"LoRA gradients {worst:.1e} of each tensor's largest"
    )
    assert loss_rel <= 1e-6 and worst <= 1e-4


def test_sdxl_cached_batch_gives_the_encoded_conditioning(sdxl_dir, images, tmp_path):
    pipe, params = load_pipeline(str(sdxl_dir))
    models, frozen, _, batches, _, sampler, every = _cached_run(pipe, params, images, tmp_path)
    assert sorted(frozen) == ["unet", "vae"]
    text = jax.jit(lambda frozen, batch: step_lib.batch_text({}, frozen, models, batch))  # the step's text part
    for micro in (0, 1):
        from_cache, encoded = batches(micro), _encoded_batch(models, sampler, micro)
        np.testing.assert_array_equal(encoded["pixels"], from_cache["pixels"])
        encoded.pop("pixels"), from_cache.pop("pixels")
        context_a, kw_a = text({c: every[c] for c in models.conditioning.components}, encoded)
        context_b, kw_b = text({}, from_cache)
        assert sorted(kw_b) == ["text_embeds", "time_ids"] and kw_b["text_embeds"].shape == kw_a["text_embeds"].shape
        np.testing.assert_allclose(np.asarray(context_b), np.asarray(context_a), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            np.asarray(kw_b["text_embeds"]), np.asarray(kw_a["text_embeds"]), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_array_equal(np.asarray(kw_b["time_ids"]), np.asarray(kw_a["time_ids"]))


def test_refused_before_loading(images, tmp_path):
    from sdjax.finetune import train_dreambooth, train_lora

    nowhere = str(tmp_path / "no-model")
    flag = r"cache_text_encoder_outputs=True \(--cache-text-encoder-outputs\)"
    with pytest.raises(ValueError, match=flag + r" with train_text_encoder=True \(--train-text-encoder\)"):
        train_lora(
            images, tmp_path / "x.safetensors", model=nowhere, cache_text_encoder_outputs=True, train_text_encoder=True
        )
    with pytest.raises(ValueError, match=flag + ": DreamBoothConfig runs have no text-encoder cache"):
        train_dreambooth(
            images, tmp_path / "x.safetensors", model=nowhere, instance_prompt="a", cache_text_encoder_outputs=True
        )
    cli = ["train", "lora", "--data", str(images), "--out", str(tmp_path / "x.safetensors"), "--model", nowhere]
    result = CliRunner().invoke(app, [*cli, "--cache-text-encoder-outputs", "--train-text-encoder"])
    assert result.exit_code == 2 and "--cache-text-encoder-outputs" in result.output
