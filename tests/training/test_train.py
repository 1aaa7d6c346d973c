"""Training smoke tests on the tiny preset: losses are finite and fall on a fixed batch, and a complete run
writes a folder the sdjax pipeline loads (sampling from a trained folder is `tests/evaluation/test_quality.py`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdjax.models.clip import CLIPTextModel
from sdjax.models.unet import UNet2DConditionModel
from sdjax.text.tokenizer import CLIPTokenizer
from sdjax.training import data, train

TINY = train.PRESETS["tiny"]


def _fit(loss_fn, params, batch, steps=6, lr=3e-3):
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One complete `python -m sdjax.training --preset tiny` run: (output folder, log text). Its exported weights
    are also the starting point of the fixed-batch fit (no second UNet init to compile)."""
    from sdjax.training.__main__ import main

    tmp = tmp_path_factory.mktemp("tiny-run")
    out = tmp / "tiny-sd"
    assert main(["--preset", "tiny", "--out", str(out), "--log", str(tmp / "log.txt")]) == 0
    return out, (tmp / "log.txt").read_text()


def test_diffusion_loss_is_finite_and_falls_on_a_fixed_batch(tiny_run):
    from sdjax import StableDiffusionPipeline

    text_config, unet_config, _ = train.model_configs(TINY)
    tokenizer = CLIPTokenizer.default()
    key = jax.random.key(0)
    ids = tokenizer([data.caption(s) for s in data.held_out_scenes(1)[:4]])
    latents = jax.random.normal(key, (4, 4, 16, 16))
    used = train.caption_vocabulary_ids(tokenizer)
    assert {tokenizer.encode("triangle")[0], tokenizer.bos_token_id, tokenizer.eos_token_id} <= set(used.tolist())
    # Rows of words the captions never use start at zero.
    emb = train.init_text_params(text_config, key, used)["text_model"]["embeddings"]["token_embedding"]["embedding"]
    assert float(jnp.abs(emb[tokenizer.encode("dog")[0]]).sum()) == 0.0
    # The fit starts from the tiny run's exported text encoder and UNet (the preset's architecture, a few steps
    # away from their initialisation).
    _, loaded = StableDiffusionPipeline.from_pretrained(str(tiny_run[0]))
    params = {"text_encoder": loaded["text_encoder"], "unet": loaded["unet"]}
    alphas = jnp.asarray(train.training_alphas_cumprod(TINY.scheduler))
    loss_fn = train.diffusion_loss_fn(CLIPTextModel(text_config), UNet2DConditionModel(unet_config), alphas, 5.0)
    losses = _fit(loss_fn, params, (latents, ids, jax.random.key(1)))
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses


class _Text:
    def apply(self, variables, ids):
        return type("Out", (), {"last_hidden_state": jnp.zeros(ids.shape + (4,))})()


class _PerfectUNet:
    """With x0 = 0 the noisy latent is sqrt(1 - ab) * noise, so the exact targets are computable from it."""

    def __init__(self, alphas, prediction_type):
        self.alphas, self.prediction_type = alphas, prediction_type

    def apply(self, variables, noisy, t, context):
        ab = self.alphas[t.astype(jnp.int32)][:, None, None, None]
        noise = noisy / jnp.sqrt(1.0 - ab)
        return jnp.sqrt(ab) * noise if self.prediction_type == "v_prediction" else noise


def test_loss_targets_are_epsilon_and_v():
    alphas = jnp.asarray(train.training_alphas_cumprod(train.SCHEDULER))
    zeros, ids, key = jnp.zeros((8, 4, 4, 4)), jnp.zeros((8, 77), jnp.int32), jax.random.key(0)
    for kind, other in (("epsilon", "v_prediction"), ("v_prediction", "epsilon")):
        exact = train.diffusion_loss_fn(_Text(), _PerfectUNet(alphas, kind), alphas, 5.0, kind)
        wrong = train.diffusion_loss_fn(_Text(), _PerfectUNet(alphas, other), alphas, 5.0, kind)
        assert float(exact({"text_encoder": {}, "unet": {}}, zeros, ids, key)) < 1e-10, kind
        assert float(wrong({"text_encoder": {}, "unet": {}}, zeros, ids, key)) > 1e-3, kind


def test_timestep_sampling_moves_the_given_share_below_the_cut():
    key, n = jax.random.key(3), 40000
    uniform = np.asarray(train.sample_timesteps(key, n, 1000))
    assert uniform.min() >= 0 and uniform.max() == 999
    assert abs(float(np.mean(uniform < 500)) - 0.5) < 0.01
    # Share s below 500, the rest uniform: P(t < 500) = s + (1 - s) / 2 and P(t >= 500) = (1 - s) / 2.
    mixed = np.asarray(train.sample_timesteps(key, n, 1000, 0.5, 500))
    assert mixed.min() >= 0 and mixed.max() == 999
    assert abs(float(np.mean(mixed < 500)) - 0.75) < 0.01
    # Below the cut the draws stay uniform: t < 250 holds half of those below 500.
    assert abs(float(np.mean(mixed < 250)) / float(np.mean(mixed < 500)) - 0.5) < 0.02
    only_low = np.asarray(train.sample_timesteps(key, n, 1000, 1.0, 300))
    assert only_low.max() == 299
    window = np.asarray(train.sample_timesteps(key, n, 1000, 1.0, 500, 100))
    assert window.min() == 100 and window.max() == 499
    with pytest.raises(ValueError, match="low_start=500"):
        train.sample_timesteps(key, 4, 1000, 0.5, 500, 500)


def test_training_schedule_matches_the_exported_scheduler():
    ab = train.training_alphas_cumprod(train.SCHEDULER)
    assert ab.shape == (1000,)
    # DDPM's linear betas, 1e-4 to 0.02: alpha-bar is the running product of (1 - beta).
    betas = np.linspace(1e-4, 0.02, 1000)
    np.testing.assert_allclose(ab, np.cumprod(1 - betas), rtol=1e-5)
    assert np.sqrt(ab[-1]) < 0.01  # at t=999 the noise keeps < 1% of the image (SD's scaled_linear keeps 6.8%)
    # The schedule the model learns is the one the exported scheduler samples with.
    from sdjax.samplers import get_sampler

    np.testing.assert_allclose(ab, get_sampler(dict(train.SCHEDULER)).alphas_cumprod, rtol=1e-5)


def test_tiny_run_writes_a_pipeline_that_sdjax_loads(tiny_run):
    from sdjax import StableDiffusionPipeline

    out, log = tiny_run
    assert "vae step" in log and "diffusion step" in log and "nan" not in log.lower()
    for sub in (
        "model_index.json",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/vocab.json",
        "scheduler/scheduler_config.json",
    ):
        assert (out / sub).is_file(), sub
    pipe, _ = StableDiffusionPipeline.from_pretrained(str(out))
    assert pipe.default_size == (64, 64)
    assert pipe.vae.config.scaling_factor != 1.0  # measured on the encoded training images


def test_presets_are_real_configs():
    for name, cfg in train.PRESETS.items():
        text_config, unet_config, vae_config = train.model_configs(cfg)
        assert text_config.vocab_size == 49408, name  # CLIP's real vocabulary
        assert unet_config.cross_attention_dim == text_config.hidden_size, name
        assert unet_config.in_channels == vae_config.latent_channels, name
        factor = 2 ** (len(vae_config.block_out_channels) - 1)
        assert unet_config.sample_size * factor == data.IMAGE_SIZE, name
        assert dataclasses.replace(cfg).seed == cfg.seed


def test_min_snr_v_weight_clips_the_x0_weight_and_keeps_high_noise():
    ab = train.training_alphas_cumprod(train.SCHEDULER).astype(np.float64)
    snr = ab / (1 - ab)
    w = np.asarray(train.min_snr_v_weight(jnp.asarray(snr), 5.0), np.float64)
    # A v error is an x0 error times sqrt(snr + 1): the weight on x0 is min(snr, gamma) + 1 (Min-SNR-gamma).
    np.testing.assert_allclose(w * (snr + 1), np.minimum(snr, 5.0) + 1, rtol=1e-5)
    assert w[-1] > 0.99  # t = 999: almost pure noise, full weight (the layout is decided there)
    assert abs(w[0] - 6.0 / (snr[0] + 1)) < 1e-6 and w[0] < 0.01  # t = 0: clipped at gamma + 1 on x0
    assert np.all(np.diff(w) >= -1e-7)  # never falls as noise grows


@pytest.mark.all_devices
def test_data_parallel_splits_the_batch_over_devices_that_divide_it():
    n = jax.device_count()  # 8 simulated CPU devices in the test suite (tests/conftest.py)
    replicated, split = train.data_parallel(4 * n, min_per_device=4)
    assert split.mesh.size == n and replicated.spec == jax.sharding.PartitionSpec()
    x = jax.device_put(np.zeros((4 * n, 3)), split)
    assert {s.data.shape for s in x.addressable_shards} == {(4, 3)}
    assert train.data_parallel(4 * n, min_per_device=8)[1].mesh.size == n // 2  # 8 examples each
    assert train.data_parallel(n + 1, 1)[1].mesh.size == max(d for d in range(1, n + 1) if (n + 1) % d == 0)
    assert train.data_parallel(8)[1].mesh.size == 1  # fewer than 16 each: not split (the VAE stage)
    assert train.data_parallel(1)[1].mesh.size == 1


@pytest.mark.parametrize(
    "extra,word",
    [
        (["--log", "{tmp}/missing/log.txt"], "--log"),
        (["--log", "{tmp}"], "--log"),
        (["--steps", "0"], "--steps"),
        (["--vae-from", "{tmp}"], "--vae-from"),
        (["--checkpoint-every", "-1"], "--checkpoint-every"),
        (["--out", "{tmp}/a-file"], "--out"),
    ],
)
def test_bad_arguments_are_named_before_anything_runs(extra, word, tmp_path, capsys):
    """`python -m sdjax.training` names the bad argument and exits with status 2 (no traceback, nothing written)."""
    from sdjax.training.__main__ import main

    (tmp_path / "a-file").write_text("")
    args = ["--preset", "tiny", "--out", str(tmp_path / "out"), *[a.format(tmp=tmp_path) for a in extra]]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert word in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
