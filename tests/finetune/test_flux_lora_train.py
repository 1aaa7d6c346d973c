"""Flux.1 LoRA training (`sdjax.finetune.flow`, `flow_models`, `flow_run`) against diffusers 0.42.1 + peft 0.21.2 on
the tiny dev- and schnell-shaped pipelines of tests/flux_reference.py, saved as diffusers folders.

- The step: diffusers' `FluxTransformer2DModel` with the peft LoRA of `train_dreambooth_lora_flux.py`
  (`init_lora_weights="gaussian"`, its default `--lora_layers`, nonzero B factors) computing the script's loss
  (`u` -> index -> timestep and sigma of the scheduler's grid, `x_t = (1 - sigma) x_0 + sigma noise`, 2x2 packing,
  image ids, `timestep / 1000`, dev's guidance 3.5, target `noise - x_0`, `compute_loss_weighting_for_sd3`) on the
  same latents, noise, `u` and text states gives the same loss (<= 1e-5 relative) and LoRA gradients (<= 1e-4
  relative, L2, per tensor).
- The training grid and the timestep densities equal diffusers' `FlowMatchEulerDiscreteScheduler` tables and
  `compute_density_for_timestep_sampling` on the same base draws.
- A run through `train_lora` (the family picked from the model folder) lowers the loss on a fixed batch, writes
  diffusers' LoRA file, which `FluxPipeline.load_lora_weights` and sdjax's `load_lora` read to the same image
  (the Flux pipeline tests' 1e-3), and which moves the image.
- Bad settings fail naming the setting before anything is compiled.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flow_helpers import lora_from_peft, peft_transformer, save_flux, script_loss, tiny_lora_run, worst_grad_error
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import flow, flow_models
from sdjax.models.convert import torch_key_to_path

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("optax")

RANK, ALPHA = 4, 8.0  # alpha / r = 2: a wrong scale fails
SIZE, MAX_SEQ = 32, 16  # 32-pixel images: 16x16 latents (tiny VAE factor 2), 64 image tokens
ATOL = 1e-3  # tests/families/test_flux_pipeline.py


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """kind -> (torch pipeline, folder, sdjax pipeline, params) for "dev" and "schnell"."""
    import t5_reference

    from sdjax.pipelines import load_pipeline

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    out = {}
    for kind in ("dev", "schnell"):
        torch_pipe, folder = save_flux(tmp_path_factory, kind, tok)
        pipe, params = load_pipeline(str(folder))
        out[kind] = (torch_pipe, folder, pipe, params)
    return out


def _batch(seed: int, u: list[float], pipe) -> dict:
    rng = np.random.default_rng(seed)
    n, h = len(u), SIZE // 2
    cfg = pipe.transformer.config
    return {
        "latents": rng.standard_normal((n, 16, h, h)).astype(np.float32),
        "noise": rng.standard_normal((n, 16, h, h)).astype(np.float32),
        "u": np.asarray(u, np.float32),
        "text": rng.standard_normal((n, 7, cfg.joint_attention_dim)).astype(np.float32),
        "pooled": rng.standard_normal((n, cfg.pooled_projection_dim)).astype(np.float32),
    }


def test_grid_and_densities_match_diffusers(monkeypatch):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    for config in (dict(shift=3.0, use_dynamic_shifting=True), dict(shift=1.0), dict(shift=3.0)):
        ref = FlowMatchEulerDiscreteScheduler(**config)
        objective = flow.FlowObjective(shift=config["shift"], use_dynamic_shifting=config.get("use_dynamic_shifting"))
        timesteps, sigmas = flow.training_grid(objective)
        np.testing.assert_array_equal(timesteps, ref.timesteps.numpy())
        np.testing.assert_array_equal(sigmas, ref.sigmas.numpy())
    rng = np.random.default_rng(0)
    uniform, normal = rng.random(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    monkeypatch.setattr(torch, "rand", lambda size, **kw: torch.from_numpy(uniform[: size[0]]))
    monkeypatch.setattr(torch, "normal", lambda mean, std, size, **kw: mean + std * torch.from_numpy(normal[: size[0]]))
    for scheme in flow.WEIGHTING_SCHEMES:
        objective = flow.FlowObjective(weighting_scheme=scheme, logit_mean=0.3, logit_std=1.2, mode_scale=1.29)
        want = compute_density_for_timestep_sampling(scheme, 64, logit_mean=0.3, logit_std=1.2, mode_scale=1.29)
        got = flow.density(objective, jnp.asarray(uniform), jnp.asarray(normal))
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6, atol=1e-7, err_msg=scheme)


@pytest.mark.parametrize(
    ("kind", "scheme", "remat"), [("dev", "none", False), ("schnell", "cosmap", False), ("dev", "sigma_sqrt", True)]
)
def test_step_matches_the_diffusers_script(flux, kind, scheme, remat):
    """(With `remat`: per-block rematerialisation, `--gradient-checkpointing`; the LoRA interceptor must reach the
    rematerialised blocks' layers.)"""
    torch_pipe, _, pipe, params = flux[kind]
    batch = _batch(1, [0.03, 0.71], pipe)  # a low and a high sigma
    targets = flow_models.FLUX_TARGETS
    model = peft_transformer(torch_pipe.transformer, targets, RANK, ALPHA)
    ref = script_loss("flux", model, torch_pipe.scheduler.config, batch, weighting_scheme=scheme)
    ref.backward()

    lora, torch_params = lora_from_peft(params["transformer"], model, targets, RANK)
    assert len(lora["transformer"]) == 2 * 12 + 2 * 3  # double blocks: 12 layers; single blocks: attn.to_q/k/v
    adapter = flow_models.FluxAdapter(pipe.transformer.clone(remat=remat))
    models = flow.FlowModels(adapter, pipe.vae, scale=ALPHA / RANK)
    scheduler = pipe.scheduler
    objective = flow.FlowObjective(
        weighting_scheme=scheme,
        shift=scheduler.shift,
        use_dynamic_shifting=scheduler.use_dynamic_shifting,
        num_train_timesteps=scheduler.num_train_timesteps,
    )
    inputs = {k: jnp.asarray(v) for k, v in batch.items()}

    def loss(lora_t):
        return flow.denoiser_loss(lora_t, params["transformer"], models, objective, inputs)

    value, grads = jax.jit(jax.value_and_grad(loss))(lora["transformer"])
    ref = float(ref.detach())
    rel = abs(float(value) - ref) / abs(ref)
    worst = worst_grad_error(grads, torch_params)
    print(f"{kind}/{scheme}: loss {float(value):.7f} vs {ref:.7f} ({rel:.1e}); worst gradient {worst:.1e}")
    assert rel <= 1e-5


def test_vae_latents_are_the_scripts(flux):
    """`(vae.encode(x).latent_dist - shift_factor) * scaling_factor`: the posterior mean as diffusers' VAE gives it,
    and the sample with the step's noise."""
    from sdjax.core import autoencoder

    torch_pipe, _, pipe, params = flux["dev"]
    x = np.random.default_rng(3).uniform(-1, 1, (2, 3, SIZE, SIZE)).astype(np.float32)
    vae = torch_pipe.vae
    with torch.no_grad():
        dist = vae.encode(torch.from_numpy(x)).latent_dist
    eps = np.random.default_rng(4).standard_normal(dist.mean.shape).astype(np.float32)
    want = ((dist.mean + dist.std * torch.from_numpy(eps)) - vae.config.shift_factor) * vae.config.scaling_factor
    got = autoencoder.encode(pipe.vae, params["vae"], jnp.asarray(x), jnp.asarray(eps), jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ a run
def _images(folder, n: int = 4):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        img = np.zeros((SIZE, SIZE, 3), np.uint8)
        img[...] = (230, 40, 30) if i % 2 == 0 else (200, 60, 40)
        img[8:24, 8:24] = (250, 250, 250)
        Image.fromarray(img).save(folder / f"red{i}.png")
        (folder / f"red{i}.txt").write_text("sks red square")
    return folder


@pytest.fixture(scope="module")
def trained(flux, tmp_path_factory):
    """A 16-update Flux dev LoRA trained through `train_lora` (the family picked from the folder)."""
    _, folder, _, _ = flux["dev"]
    tmp = tmp_path_factory.mktemp("flux-run")
    data = _images(tmp / "data")
    result = tiny_lora_run(
        data, tmp / "sks.safetensors", folder, size=SIZE, steps=16, rank=RANK, alpha=ALPHA, lr=1e-2,
        max_sequence_length=MAX_SEQ, seed=1,
    )  # fmt: skip
    return result, data


def _fixed_batch_losses(pipe, params, loras, data, *, keys=6):
    """The step's loss (VAE sample, noise, u from fixed keys) on the four images for each LoRA of `loras`, one
    array of `keys` draws per LoRA (one compiled loss serves them all)."""
    from PIL import Image

    texts = flow_models.TextStates(pipe.generator.models.conditioning, params)
    pixels = np.stack(
        [np.asarray(Image.open(p), np.float32).transpose(2, 0, 1) / 127.5 - 1 for p in sorted(data.glob("*.png"))]
    )
    batch = {"pixels": pixels, **texts(["sks red square"] * len(pixels))}
    models = flow.FlowModels(flow_models.FluxAdapter(pipe.transformer), pipe.vae, scale=ALPHA / RANK)
    s = pipe.scheduler
    objective = flow.FlowObjective(shift=s.shift, use_dynamic_shifting=s.use_dynamic_shifting)
    loss = jax.jit(flow.make_flow_loss(models, objective))
    frozen = {"transformer": params["transformer"], "vae": params["vae"]}
    return [
        np.asarray([float(loss(lora, frozen, batch, jax.random.PRNGKey(k))) for k in range(keys)]) for lora in loras
    ]


def test_a_short_run_lowers_the_loss_and_writes_diffusers_file(flux, trained):
    from safetensors import safe_open

    result, data = trained
    _, _, pipe, params = flux["dev"]
    assert len(result.losses) == 16 and all(math.isfinite(v) for v in result.losses)
    with safe_open(str(result.out), "np") as f:
        keys, meta = set(f.keys()), f.metadata()
        lora = {"transformer": {}}
        for key in keys:
            module, ab = key.removeprefix("transformer.").rsplit(".lora_", 1)
            path = "/".join(torch_key_to_path(module + ".weight")[:-1]) + "/kernel"
            lora["transformer"].setdefault(path, {})["down" if ab.startswith("A") else "up"] = f.get_tensor(key)
    assert all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert len(keys) == 2 * 30 and '"transformer.lora_alpha": 8.0' in meta["lora_adapter_metadata"]
    fresh = jax.tree_util.tree_map(np.zeros_like, lora)
    before, after = _fixed_batch_losses(pipe, params, [fresh, lora], data)
    print(f"fixed-batch loss {before.mean():.4f} -> {after.mean():.4f} (per key {before} -> {after})")
    assert after.mean() < 0.85 * before.mean() and np.all(after < before)


def test_written_file_gives_diffusers_image(flux, trained):
    """diffusers' `load_lora_weights` of the written file and sdjax's `load_lora` draw the same image."""
    import inject

    from sdjax import rng

    result, _ = trained
    torch_pipe, _, pipe, _ = flux["dev"]
    prompts, seed, steps = ["sks red square", "a blue circle"], 5, 4
    keys = inject.image_keys(seed, len(prompts))
    shape = (16, SIZE // 2, SIZE // 2)
    torch_pipe.load_lora_weights(str(result.out), adapter_name="trained")
    try:
        with inject.prescribed(torch_pipe, latents_noise=inject.stream(keys, rng.LATENTS, shape)), torch.no_grad():
            ref = torch_pipe(
                prompt=prompts,
                height=SIZE,
                width=SIZE,
                num_inference_steps=steps,
                guidance_scale=3.5,
                max_sequence_length=MAX_SEQ,
                output_type="np",
            ).images
    finally:
        torch_pipe.unload_lora_weights()
    kw = dict(steps=steps, guidance_scale=3.5, height=SIZE, width=SIZE, seed=seed, max_sequence_length=MAX_SEQ)
    base = pipe.generate(prompts, output_type="np", **kw)
    name = pipe.load_lora(result.out)
    try:
        assert {f.alpha_over_rank for f in pipe.loaded_loras[name].factors.values()} == {ALPHA / RANK}
        out = pipe.generate(prompts, output_type="np", **kw)
    finally:
        pipe.unload_loras()
    err, moved = float(np.abs(out - ref).max()), float(np.abs(out - base).max())
    print(f"trained LoRA: max |sdjax - diffusers| {err:.2e}; it moves the image by {moved:.2e} ({name})")
    assert err < ATOL and moved > 10 * ATOL


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(rank=0), "rank=0"),
        (dict(lora_layers=["proj_in"]), "'proj_in' names no layer"),
        (dict(lora_layers="attn.to_q, conv_in"), "'conv_in' names no layer"),
        (dict(weighting_scheme="uniform"), "weighting_scheme='uniform'"),
        (dict(logit_std=0.0), "logit_std=0.0"),
        (dict(min_snr_gamma=5.0), "min_snr_gamma=5.0"),
        (dict(prediction_type="v_prediction"), "prediction_type='v_prediction'"),
        (dict(max_sequence_length=0), "max_sequence_length=0"),
        (dict(guidance_scale=float("nan")), "guidance_scale=nan"),
    ],
)
def test_bad_settings_fail_before_compiling(flux, tmp_path, options, named):
    from compile_counter import counting_compiles

    from sdjax.finetune import train_lora

    _, folder, _, _ = flux["dev"]
    data = _images(tmp_path / "data", 1)
    with counting_compiles() as compiles, pytest.raises(ValueError, match=named.replace("(", r"\(")):
        train_lora(data, tmp_path / "x.safetensors", model=str(folder), steps=1, **options)
    assert not compiles and not (tmp_path / "x-run").exists()


def test_flow_options_refused_for_a_unet_model(sd1_dir, tmp_path):
    from sdjax.finetune import train_lora

    data = _images(tmp_path / "data", 1)
    with pytest.raises(ValueError, match="Stable Diffusion 1.x / 2.x model: the flow-matching options"):
        train_lora(data, tmp_path / "x.safetensors", model=str(sd1_dir), weighting_scheme="logit_normal")


# `sdjax train lora` on the schnell folder: bfloat16 compute, per-block checkpointing, LoRA dropout, own targets,
# flips, cached latents, validation images, Prodigy (its state restored by the resume test: tests/finetune/
# test_optimizers.py points here); the same settings as `train_lora` options for the stopped run.
SCHNELL = dict(
    steps=2, rank=2, resolution=SIZE, bucketing=False, mixed_precision="bf16", gradient_checkpointing=True,
    lora_dropout=0.1, lora_layers=["attn.to_q", "proj_mlp"], weighting_scheme="logit_normal", flip=True,
    max_sequence_length=MAX_SEQ, cache_latents=True, validation_prompts=["sks"], optimizer="prodigy", lr=1.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def schnell_cli_run(flux, tmp_path_factory):
    """`sdjax train lora -m <schnell folder>` with `SCHNELL`'s settings: (result, data, out, the command line). Its
    run is the unbroken run `test_a_stopped_run_resumes_exactly` compares with (one compile fewer than a run of its
    own)."""
    _, folder, _, _ = flux["schnell"]
    tmp = tmp_path_factory.mktemp("schnell-cli")
    data, out = _images(tmp / "data", 2), tmp / "s.safetensors"
    cli = ["train", "lora", "-m", str(folder), "--data", str(data), "--out", str(out), "--steps", "2", "--rank", "2"]
    cli += ["--resolution", "32", "--no-bucketing", "--mixed-precision", "bf16", "--gradient-checkpointing"]
    cli += ["--lora-dropout", "0.1", "--lora-layers", "attn.to_q,proj_mlp", "--weighting-scheme", "logit_normal"]
    cli += ["--flip", "--max-sequence-length", str(MAX_SEQ), "--cache-latents", "--validation-prompt", "sks"]
    cli += ["--optimizer", "prodigy", "--lr", "1.0"]
    return CliRunner().invoke(app, cli), data, out, cli


def test_cli_schnell_bf16_checkpointing_dropout_targets_cache(flux, schnell_cli_run):
    """`sdjax train lora -m <schnell folder>`: a flow run picked from the model, bfloat16 compute with float32 LoRA,
    per-block checkpointing, LoRA dropout, own targets, cached latents, validation images, `--optimizer prodigy`;
    the file loads in sdjax's Flux reader."""
    import json

    from sdjax.families.flux.lora import load_flux_lora

    _, _, _, params = flux["schnell"]
    run, _, out, cli = schnell_cli_run
    assert run.exit_code == 0, run.output + str(run.exception)
    assert run.stdout.strip().splitlines()[-1] == str(out)
    lora = load_flux_lora(out, params["transformer"])
    modules = sorted(f.name.removeprefix("transformer.").removesuffix(".lora_A.weight") for f in lora.factors.values())
    assert len(modules) == 6 and all(m.endswith(("attn.to_q", "proj_mlp")) for m in modules)
    assert any(np.abs(f.up).max() > 0 for f in lora.factors.values())  # trained (up starts at zero)
    run_dir = out.parent / "s-run"
    drawn = sorted(p.name for p in (run_dir / "validation").iterdir())
    assert drawn == ["step-000000-0.png", "step-000002-0.png"]
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["weighting_scheme"] == "logit_normal" and saved["lora_layers"] == ["attn.to_q", "proj_mlp"]
    assert {k: saved[k] for k in SCHNELL} == SCHNELL  # the settings the stopped run repeats
    bad = CliRunner().invoke(app, cli[:-2] + ["--lora-layers", "attn.to_q,proj_in", "--no-resume"])
    assert bad.exit_code == 2 and "'proj_in' names no layer" in bad.output


def test_a_stopped_run_resumes_exactly(flux, schnell_cli_run, tmp_path):
    """A run stopped after update 1 and resumed repeats the unbroken run's (`schnell_cli_run`'s) losses and file
    (the draws, LoRA dropout included, are functions of the seed and step; `run_loop`'s checkpoints, Prodigy's state
    among them; the latent cache built again); resuming with another weighting scheme or optimiser is refused."""
    import json

    from safetensors.numpy import load_file

    from sdjax.finetune import train_lora

    _, folder, _, _ = flux["schnell"]
    run, data, whole_out, _ = schnell_cli_run
    assert run.exit_code == 0, run.output + str(run.exception)
    whole = [json.loads(line)["loss"] for line in (whole_out.parent / "s-run" / "loss.jsonl").read_text().splitlines()]
    # without validation images (no resume setting, no draw of the training's; each call would compile them again)
    options = dict(model=str(folder), **{k: v for k, v in SCHNELL.items() if k != "validation_prompts"})
    first = train_lora(data, tmp_path / "cut.safetensors", stop_after=1, **options)
    with pytest.raises(ValueError, match="weighting_scheme: 'logit_normal' -> 'mode'"):
        train_lora(data, tmp_path / "cut.safetensors", **(options | {"weighting_scheme": "mode"}))
    with pytest.raises(ValueError, match="optimizer: 'prodigy' -> 'adamw'"):
        train_lora(data, tmp_path / "cut.safetensors", **(options | {"optimizer": "adamw"}))
    rest = train_lora(data, tmp_path / "cut.safetensors", **options)
    assert rest.start_step == 1 and first.losses + rest.losses == whole and len(whole) == 2
    a, b = load_file(str(whole_out)), load_file(str(tmp_path / "cut.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_transformer_file_with_its_config_folder_trains_as_the_folder(flux, schnell_cli_run, tmp_path):
    """The transformer as one file, as Flux is released (`--model flux1-schnell.safetensors --config <folder>`):
    the folder run's losses and LoRA, bit for bit. Without `--config`, or with a `--t5` for a folder, the command
    stops naming the option before anything loads (no run directory)."""
    import json
    import shutil

    from safetensors.numpy import load_file

    from sdjax.finetune import train_lora

    _, folder, _, _ = flux["schnell"]
    run, data, whole_out, cli = schnell_cli_run
    assert run.exit_code == 0, run.output + str(run.exception)
    whole = [json.loads(line)["loss"] for line in (whole_out.parent / "s-run" / "loss.jsonl").read_text().splitlines()]
    (weights,) = (folder / "transformer").glob("*.safetensors")
    single = tmp_path / "flux1-schnell.safetensors"
    shutil.copy(weights, single)

    model_at = cli.index("-m") + 1
    no_config = cli[:model_at] + [str(single)] + cli[model_at + 1 :]
    no_config[no_config.index("--out") + 1] = str(tmp_path / "refused.safetensors")
    refused = CliRunner().invoke(app, no_config)
    assert refused.exit_code == 2 and "Flux.1 transformer file" in refused.output and "--config" in refused.output
    t5_for_a_folder = CliRunner().invoke(app, [*cli[:-2], "--t5", str(single), "--no-resume"])
    assert t5_for_a_folder.exit_code == 2 and "t5 (--t5)" in t5_for_a_folder.output
    assert not (tmp_path / "refused-run").exists()

    options = {k: v for k, v in SCHNELL.items() if k != "validation_prompts"}  # (as the resume test: no validation)
    got = train_lora(data, tmp_path / "file.safetensors", model=str(single), config=str(folder), **options)
    assert got.losses == whole
    a, b = load_file(str(whole_out)), load_file(str(tmp_path / "file.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
