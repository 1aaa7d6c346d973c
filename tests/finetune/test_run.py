"""`sdjax train lora` end to end on a tiny SD 1.x model, and resuming from an orbax checkpoint: a run stopped
half-way and resumed gives the very losses and LoRA of the unbroken run (data parallel over 2 devices, gradient
accumulation, bfloat16 compute, the text encoder trained too, LoCon (`--conv-rank`: the ResNet blocks' and samplers'
layers, written as sd-scripts writes them), every loss option on, the EMA restored too); SDXL's step.

`ema_decay`: the same run keeps an EMA of the LoRA, which equals diffusers' `EMAModel` stepped by hand over the run's
per-update LoRAs (read back from the orbax checkpoints); the written file holds the EMA values. (One run serves the
CLI, resume and EMA checks: each whole run compiles its train step, most of its time.)"""

import functools
import json
import shutil

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import load_file
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import loop as loop_lib
from sdjax.finetune import lora as lora_lib
from sdjax.finetune import train_lora

DECAY = 0.3  # below diffusers' warm-up (1 + s) / (10 + s) from the 4th update: both regimes in 4 updates
OPTIONS = dict(
    steps=4,
    rank=2,
    alpha=4.0,
    conv_rank=3,  # LoCon: the ResNet blocks' and samplers' layers too (their 3x3 convs at rank 3, alpha 1.5)
    conv_alpha=1.5,
    batch_size=2,
    accumulation=2,
    resolution=64,
    train_text_encoder=True,
    text_encoder_lr=5e-4,  # the text encoders' LoRA at its own rate: its own optimiser state, resumed too
    min_snr_gamma=5.0,
    noise_offset=0.05,
    input_perturbation=0.1,
    lr=1e-3,
    lr_schedule="cosine",
    warmup=1,
    flip=True,
    caption_dropout=0.2,
    save_every=1,
    mixed_precision="bf16",  # bfloat16 compute, float32 LoRA and optimiser
    ema_decay=DECAY,
)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("stars")
    rng = np.random.default_rng(0)
    (root / "2_star").mkdir()
    for i in range(3):
        folder = root if i < 2 else root / "2_star"
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(folder / f"s{i}.png")
        (folder / f"s{i}.txt").write_text(f"a star, colour {i}")
    (root / "broken.png").write_bytes(b"not a png")
    return root


def _cli_args(options: dict) -> list[str]:
    args = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        else:
            args += [flag, str(value)]
    return args


@pytest.fixture(scope="module")
def cli_run(sd1_dir, images, tmp_path_factory):
    """The CLI run of `OPTIONS` (every checkpoint kept), and the same run stopped after update 2 (its later
    checkpoints removed) and resumed: (CLI result, out, run folder, resumed result, resumed out, resumed folder)."""
    tmp = tmp_path_factory.mktemp("cli-run")
    out = tmp / "star.safetensors"
    cli = ["train", "lora", "--model", str(sd1_dir), "--data", str(images), "--out", str(out), "--peft"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop_lib, "_checkpoints", functools.partial(loop_lib._checkpoints, keep=None))  # keep all
        result = CliRunner().invoke(app, cli + _cli_args(OPTIONS))
    assert result.exit_code == 0, result.output + str(result.exception)
    run = tmp / "star-run"
    # stopped after update 2: its checkpoint is the latest; resuming runs updates 2 and 3 again
    resumed_run = tmp / "resumed-run"
    shutil.copytree(run, resumed_run)
    for micro in (6, 8):
        shutil.rmtree(resumed_run / "checkpoints" / str(micro))
    resumed_out = tmp / "resumed.safetensors"
    resumed = train_lora(images, resumed_out, model=str(sd1_dir), run_dir=str(resumed_run), **OPTIONS)
    return result, out, run, resumed, resumed_out, resumed_run


def test_cli_run_then_resume_repeats_the_losses(cli_run):
    result, out, run, resumed, resumed_out, resumed_run = cli_run
    assert result.stdout.strip().splitlines()[-1] == str(out)
    assert "skipped" in result.output and "broken.png" in result.output
    rows = [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] == pytest.approx(1e-3)  # warm-up, then cosine
    config = json.loads((run / "config.json").read_text())
    assert (config["rank"], config["conv_rank"], config["conv_alpha"]) == (2, 3, 1.5)
    assert (run / "loss.png").is_file() and (run / "pytorch_lora_weights.safetensors").is_file()
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [2, 4, 6, 8]  # micro-steps
    trained = load_file(str(out))
    assert any(k.startswith("lora_te_") for k in trained) and all(v.dtype == np.float32 for v in trained.values())
    assert any(np.abs(v).max() > 0 for k, v in trained.items() if k.endswith("lora_up.weight"))
    conv = "lora_unet_up_blocks_0_upsamplers_0_conv"  # LoCon, as sd-scripts writes it (shapes, alpha, network args)
    assert trained[f"{conv}.lora_down.weight"].shape == (3, 64, 3, 3) and trained[f"{conv}.alpha"] == 1.5
    up = trained[f"{conv}.lora_up.weight"]
    assert up.shape == (64, 3, 1, 1) and np.abs(up).max() > 0
    assert trained["lora_unet_mid_block_resnets_0_time_emb_proj.alpha"] == 4.0
    with safe_open(str(out), "np") as f:
        assert json.loads(f.metadata()["ss_network_args"]) == {"conv_dim": "3", "conv_alpha": "1.5"}

    # resumed from update 2's checkpoint: the LoRA, the optimiser and the EMA restored
    assert resumed.start_step == 2
    assert resumed.losses == [rows[2]["loss"], rows[3]["loss"]]  # exactly
    again = load_file(str(resumed_out))
    assert again.keys() == trained.keys()
    for key in trained:
        np.testing.assert_array_equal(again[key], trained[key], err_msg=key)
    resumed_rows = [json.loads(line) for line in (resumed_run / "loss.jsonl").read_text().splitlines()]
    assert resumed_rows == [{**r, "seconds": s["seconds"]} for r, s in zip(rows, resumed_rows)]


def _flat(lora: dict) -> dict[str, np.ndarray]:
    return {f"{c}/{k}/{f}": np.asarray(v[f]) for c, layers in lora.items() for k, v in layers.items() for f in v}


def _diffusers_ema(per_update: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """diffusers' EMAModel (decay DECAY, its defaults otherwise) stepped once per update with that update's LoRA."""
    import torch
    from diffusers.training_utils import EMAModel

    names = sorted(per_update[0])
    params = [torch.nn.Parameter(torch.from_numpy(per_update[0][n].copy())) for n in names]
    ema = EMAModel(params, decay=DECAY)
    for values in per_update:
        with torch.no_grad():
            for p, n in zip(params, names):
                p.copy_(torch.tensor(values[n]))
        ema.step(params)
    return {n: s.detach().numpy() for n, s in zip(names, ema.shadow_params)}


def test_ema_is_diffusers_ema(cli_run):
    """The EMA after each update (every update's checkpoint of `cli_run`) against diffusers' EMAModel over the
    updates so far; the written file holds the EMA values, not the last update's. (Its resume: `cli_run`'s.)"""
    import orbax.checkpoint as ocp

    _, out, run, *_ = cli_run
    saved = [ocp.StandardCheckpointer().restore((run / "checkpoints" / str(2 * u) / "default").absolute()) for u in
             range(1, 5)]  # fmt: skip
    per_update = [_flat(s["lora"]) for s in saved]
    up = "unet/" + next(iter(saved[0]["lora"]["unet"])) + "/up"
    assert np.array_equal(per_update[0][up], 0 * per_update[0][up])  # update 0: the warm-up's lr 0
    assert not np.allclose(per_update[1][up], 0)

    for u in range(4):
        reference = _diffusers_ema(per_update[: u + 1])
        ours = _flat(saved[u]["ema"])
        assert ours.keys() == reference.keys()
        for name in reference:
            np.testing.assert_allclose(ours[name], reference[name], rtol=2e-6, atol=1e-8, err_msg=f"{u + 1}: {name}")
    first = _flat(saved[0]["ema"])  # the first update copies the values (decay 0)
    assert all(np.array_equal(first[n], per_update[0][n]) for n in first)

    written = load_file(str(out))  # the EMA values, not the last update's
    expected = lora_lib.kohya_state_dict(saved[-1]["ema"], OPTIONS["alpha"], conv_alpha=OPTIONS["conv_alpha"])
    raw = lora_lib.kohya_state_dict(saved[-1]["lora"], OPTIONS["alpha"], conv_alpha=OPTIONS["conv_alpha"])
    assert written.keys() == expected.keys()
    for key in written:
        np.testing.assert_array_equal(written[key], expected[key], err_msg=key)
    assert any(not np.array_equal(written[k], raw[k]) for k in written if k.endswith("lora_up.weight"))


def test_bad_settings_fail_before_loading(images, tmp_path):
    with pytest.raises(ValueError, match="rank"):
        train_lora(images, tmp_path / "x.safetensors", rank=0)
    for conv, named in [  # LoCon's settings (the embedded model is never loaded)
        (dict(conv_rank=0), "conv_rank=0 (--conv-rank) must be a positive integer"),
        (dict(conv_rank=-1), "conv_rank=-1 (--conv-rank)"),
        (dict(conv_rank=2.5), "conv_rank=2.5 (--conv-rank)"),
        (dict(conv_rank=True), "conv_rank=True (--conv-rank)"),
        (dict(conv_alpha=2.0), "conv_alpha=2.0 (--conv-alpha) .* needs conv_rank (--conv-rank)"),
        (dict(conv_rank=2, conv_alpha=0.0), "conv_alpha=0.0 (--conv-alpha) must be a positive number"),
    ]:
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
            train_lora(images, tmp_path / "x.safetensors", **conv)
    cli = ["train", "lora", "--data", str(images), "--out", str(tmp_path / "x.safetensors")]
    result = CliRunner().invoke(app, [*cli, "--conv-rank", "0"])
    assert result.exit_code == 2 and "conv_rank=0 (--conv-rank)" in result.output
    result = CliRunner().invoke(app, [*cli, "--conv-alpha", "4"])
    assert result.exit_code == 2 and "needs conv_rank (--conv-rank)" in result.output
    assert CliRunner().invoke(app, [*cli, "--conv-rank", "two"]).exit_code == 2
    assert not (tmp_path / "x-run").exists()
    with pytest.raises(ValueError, match="broken.png"):  # the data is checked before any model is loaded
        train_lora(images, tmp_path / "x.safetensors", model=str(tmp_path / "no-model"), on_bad_image="error")
    with pytest.raises(ValueError, match="safetensors"):
        train_lora(images, tmp_path / "x.ckpt")
    result = CliRunner().invoke(app, ["train", "lora", "--data", str(tmp_path / "none"), "--out", "x.safetensors"])
    assert result.exit_code == 2 and "none does not exist" in result.output
    result = CliRunner().invoke(
        app, ["train", "lora", "--data", str(images), "--out", "x.safetensors", "--resolution", "100", "--no-bucketing"]
    )
    assert result.exit_code == 2 and "multiple of 8" in result.output


def test_sdxl_with_checkpointing_trains_and_loads_back(sdxl_dir, images, tmp_path):
    """SDXL's two text encoders, pooled embedding and micro-conditioning in the step; `jax.checkpoint` on the UNet;
    the kohya file (SGM names) loads back into sdjax. (The text-encoder LoRA step is the SD 1.x run's; SDXL's
    `lora_te1_` / `lora_te2_` names are checked in test_files.py. Gradient clipping too is the SD 1.x run's, and
    test_optimizers.py checks it: off here, a part of this step's compile saved.)"""
    import warnings

    from sdjax.loading import lora as loading_lora
    from sdjax.pipelines import load_pipeline

    out = tmp_path / "xl.safetensors"
    result = train_lora(
        images,
        out,
        model=str(sdxl_dir),
        steps=1,
        rank=2,
        lr=1e-2,
        resolution=64,
        gradient_checkpointing=True,
        max_grad_norm=None,
    )
    assert len(result.losses) == 1 and all(np.isfinite(result.losses))
    tensors = load_file(str(out))
    assert all(v.dtype == np.float32 for v in tensors.values())
    assert any(k.startswith("lora_unet_input_blocks_") for k in tensors)
    assert any(np.abs(v).max() > 0 for k, v in tensors.items() if k.endswith("lora_up.weight"))
    pipe, params = load_pipeline(str(sdxl_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("error", loading_lora.UnmatchedLoraKeysWarning)
        loaded = loading_lora.load_lora(out, params, unet_config=pipe.unet.config)
    assert loaded.components == ("unet",)
    assert len(loaded.factors) * 3 == len(tensors)
