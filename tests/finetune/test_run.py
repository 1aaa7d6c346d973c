"""`sdjax train lora` end to end on a tiny SD 1.x model, and resuming from an orbax checkpoint: a run stopped
half-way and resumed gives the very losses and LoRA of the unbroken run (data parallel over 2 devices, gradient
accumulation, bfloat16 compute, the text encoder trained too, every loss option on); SDXL's step."""

import json
import shutil

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import train_lora

OPTIONS = dict(
    steps=4,
    rank=2,
    alpha=4.0,
    batch_size=2,
    accumulation=2,
    resolution=64,
    train_text_encoder=True,
    min_snr_gamma=5.0,
    noise_offset=0.05,
    input_perturbation=0.1,
    lr=1e-3,
    lr_schedule="cosine",
    warmup=1,
    flip=True,
    caption_dropout=0.2,
    save_every=2,
    mixed_precision="bf16",  # bfloat16 compute, float32 LoRA and optimiser
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


def test_cli_run_then_resume_repeats_the_losses(sd1_dir, images, tmp_path):
    out = tmp_path / "star.safetensors"
    cli = ["train", "lora", "--model", str(sd1_dir), "--data", str(images), "--out", str(out), "--peft"]
    result = CliRunner().invoke(app, cli + _cli_args(OPTIONS))
    assert result.exit_code == 0, result.output + str(result.exception)
    assert result.stdout.strip().splitlines()[-1] == str(out)
    assert "skipped" in result.output and "broken.png" in result.output
    run = tmp_path / "star-run"
    rows = [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] == pytest.approx(1e-3)  # warm-up, then cosine
    assert json.loads((run / "config.json").read_text())["rank"] == 2
    assert (run / "loss.png").is_file() and (run / "pytorch_lora_weights.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "8"]  # micro-steps
    trained = load_file(str(out))
    assert any(k.startswith("lora_te_") for k in trained) and all(v.dtype == np.float32 for v in trained.values())
    assert any(np.abs(v).max() > 0 for k, v in trained.items() if k.endswith("lora_up.weight"))

    # stopped after update 2: its checkpoint is the latest; resuming runs updates 2 and 3 again
    resumed_run = tmp_path / "resumed-run"
    shutil.copytree(run, resumed_run)
    shutil.rmtree(resumed_run / "checkpoints" / "8")
    resumed = train_lora(
        images, tmp_path / "resumed.safetensors", model=str(sd1_dir), run_dir=str(resumed_run), **OPTIONS
    )
    assert resumed.start_step == 2
    assert resumed.losses == [rows[2]["loss"], rows[3]["loss"]]  # exactly
    again = load_file(str(tmp_path / "resumed.safetensors"))
    assert again.keys() == trained.keys()
    for key in trained:
        np.testing.assert_array_equal(again[key], trained[key], err_msg=key)
    resumed_rows = [json.loads(line) for line in (resumed_run / "loss.jsonl").read_text().splitlines()]
    assert resumed_rows == [{**r, "seconds": s["seconds"]} for r, s in zip(rows, resumed_rows)]


def test_bad_settings_fail_before_loading(images, tmp_path):
    with pytest.raises(ValueError, match="rank"):
        train_lora(images, tmp_path / "x.safetensors", rank=0)
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
    `lora_te1_` / `lora_te2_` names are checked in test_files.py.)"""
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
