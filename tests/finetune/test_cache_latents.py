"""Cached latents (`finetune.cache`, `--cache-latents`).

- Exactness: a fine-tune from the cache gives the very losses of a run that encodes in the step. To make the two
  encodings bit-identical the test swaps the VAE for one without noise and rounding (`ExactVAE`: a strided pixel
  subsample as the posterior mean, std 0), in both runs; the cache then differs from the step only in where the
  latents come from, and every flip, caption (with caption dropout), time id, noise draw and timestep must agree.
- The VAE is not in the cached run's compiled step (its frozen params hold no `vae`), and is in the uncached one's.
- What is cached with the real VAE: diffusers' `AutoencoderKL.encode(x).latent_dist` mean + std * eps, times the
  scaling factor, with the cache's eps (the posterior sample, as kohya and diffusers' SDXL example cache it).
- `train lora --cache-latents` trains from the cache too; settings a cache cannot serve are refused before loading.
"""

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import cache as cache_lib
from sdjax.finetune import data as data_lib
from sdjax.finetune import full
from sdjax.finetune import run as run_lib
from sdjax.finetune import step as step_lib
from sdjax.pipelines import load_pipeline


class ExactVAE(nn.Module):
    """An encoder without rounding: the posterior mean is every 8th pixel (4 channels from RGB + R), std 0."""

    config: Any
    dtype: Any = jnp.float32

    def encode(self, x_nchw):
        factor = 2 ** (len(self.config.block_out_channels) - 1)
        z = jnp.concatenate([x_nchw, x_nchw[:, :1]], axis=1)[:, :, ::factor, ::factor].astype(jnp.float32)
        return SimpleNamespace(mean=z, std=jnp.zeros_like(z))

    def __call__(self, x_nchw):
        return self.encode(x_nchw)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("dogs")
    rng = np.random.default_rng(2)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"d{i}.png")
        (root / f"d{i}.txt").write_text(f"a dog, ball, grass, colour {i}")
    return root


def _spy(monkeypatch, exact_vae: bool) -> dict:
    """Record the frozen params handed to the run loop; with `exact_vae` the fine-tune's VAE is `ExactVAE`."""
    seen: dict = {}
    run_loop, models = run_lib.run_loop, full._models

    def spy_loop(cfg, state, frozen, *args, **kwargs):
        seen["frozen"] = sorted(frozen)
        return run_loop(cfg, state, frozen, *args, **kwargs)

    def exact_models(cfg, pipe, dtype):
        m = models(cfg, pipe, dtype)
        return dataclasses.replace(m, vae=ExactVAE(m.vae.config)) if exact_vae else m

    monkeypatch.setattr(run_lib, "run_loop", spy_loop)
    monkeypatch.setattr(full, "_models", exact_models)
    return seen


OPTIONS = dict(steps=3, batch_size=2, resolution=64, lr=1e-3, flip=True, caption_dropout=0.3, shuffle_tags=True, seed=5)


def test_cached_run_repeats_the_encoding_run_exactly(sd1_dir, images, tmp_path, monkeypatch):
    seen = _spy(monkeypatch, exact_vae=True)
    encoded = full.train_finetune(images, tmp_path / "a", model=str(sd1_dir), **OPTIONS)
    assert seen["frozen"] == ["text_encoder", "vae"]
    cached = full.train_finetune(images, tmp_path / "b", model=str(sd1_dir), cache_latents=True, **OPTIONS)
    assert seen["frozen"] == ["text_encoder"]  # no VAE in the compiled step
    print(f"losses: encoded in the step {encoded.losses}, from the cache {cached.losses}")
    assert cached.losses == encoded.losses  # exactly
    for key, value in jax.tree_util.tree_leaves_with_path(encoded.unet):
        np.testing.assert_array_equal(
            np.asarray(value), np.asarray(_at(cached.unet, key)), err_msg=jax.tree_util.keystr(key)
        )
    assert json.loads((tmp_path / "b-run" / "config.json").read_text())["cache_latents"] is True


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_cache_holds_the_posterior_sample(sd1_dir, torch_sd1, images):
    """The real VAE: cache entries are diffusers' posterior mean + std * eps (the cache's eps), scaled."""
    import torch

    pipe, params = load_pipeline(str(sd1_dir))
    cfg = data_lib.DataConfig(resolution=64, bucketing=False, flip=True)
    dataset = data_lib.scan(images, cfg)
    models = step_lib.Models(pipe.generator.models.conditioning, pipe.unet, pipe.vae)
    cache = cache_lib.build(dataset, cfg, models, params["vae"], seed=9)
    assert sorted(cache.latents) == [(i, f) for i in range(3) for f in (False, True)]
    base = jax.random.fold_in(jax.random.PRNGKey(9), cache_lib.SALT)
    for n, (i, flipped) in enumerate(cache_lib.views(dataset, cfg)):
        pixels, time_ids = data_lib.load_example(dataset.items[i], dataclasses.replace(cfg, flip=False), None)
        pixels = pixels[:, :, ::-1] if flipped else pixels
        with torch.no_grad():
            dist = torch_sd1.vae.encode(torch.from_numpy(np.ascontiguousarray(pixels[None]))).latent_dist
        eps = np.asarray(jax.random.normal(jax.random.fold_in(base, n), dist.mean.shape))
        want = (dist.mean.numpy() + dist.std.numpy() * eps) * torch_sd1.vae.config.scaling_factor
        got = cache.latents[(i, flipped)][None]
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= 1e-5, f"view {(i, flipped)}: relative error {err:.2e}"
        assert np.linalg.norm(got - dist.mean.numpy() * torch_sd1.vae.config.scaling_factor) > 1e-3  # not the mean
        np.testing.assert_array_equal(cache.time_ids[(i, flipped)], time_ids)


def test_lora_trains_from_the_cache(sd1_dir, images, tmp_path, monkeypatch):
    seen = _spy(monkeypatch, exact_vae=False)
    out = tmp_path / "dog.safetensors"
    cli = ["train", "lora", "--model", str(sd1_dir), "--data", str(images), "--out", str(out), "--cache-latents"]
    cli += ["--steps", "2", "--rank", "2", "--resolution", "64", "--flip"]
    result = CliRunner().invoke(app, cli)
    assert result.exit_code == 0, result.output + str(result.exception)
    assert seen["frozen"] == ["text_encoder", "unet"]
    rows = [json.loads(line) for line in (tmp_path / "dog-run" / "loss.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)


def test_settings_a_cache_cannot_serve_are_refused(images, tmp_path):
    from sdjax.finetune import train_dreambooth, train_lora, train_textual_inversion

    nowhere = str(tmp_path / "no-model")
    with pytest.raises(ValueError, match="random_crop"):
        train_lora(images, tmp_path / "x.safetensors", model=nowhere, cache_latents=True, random_crop=True)
    with pytest.raises(ValueError, match="DreamBoothConfig runs have no latent cache"):
        train_dreambooth(images, tmp_path / "x.safetensors", model=nowhere, instance_prompt="a", cache_latents=True)
    with pytest.raises(ValueError, match="TextualInversionConfig runs have no latent cache"):
        train_textual_inversion(
            images, tmp_path / "x.safetensors", model=nowhere, token="<d>", init_word="dog", cache_latents=True
        )
    result = CliRunner().invoke(
        app, ["train", "finetune", "--data", str(images), "--out", "o", "--cache-latents", "--random-crop"]
    )
    assert result.exit_code == 2 and "random_crop" in result.output
