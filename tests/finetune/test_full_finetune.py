"""`sdjax train finetune` (`finetune.full`): a full UNet fine-tune on the tiny SD 1.x model.

- One step against PyTorch: diffusers' `UNet2DConditionModel` with every parameter trainable and
  `train_text_to_image.py`'s loss (plain MSE; Min-SNR-gamma with v-prediction) on the same latents, noise,
  timesteps and hidden states gives the same loss and the same gradient of every UNet tensor (named by diffusers).
- The written diffusers folder loads in diffusers and in sdjax and gives the trained UNet's output; the other
  components are the base model's files; the A1111 single file loads in both too.
- A run stopped after update 2 and resumed repeats the unbroken run's losses and writes the same UNet (bf16 compute
  with a float32 master copy, gradient checkpointing, accumulation, EMA, Min-SNR, noise offset, flips, cosine
  schedule with warm-up, through the CLI). The file test reads that same run's folder and single file (one run,
  one compile of its step, for both tests).
- Bad settings fail before anything is loaded, naming the setting or folder.
"""

import copy
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from finetune_helpers import ddpm_forward, min_snr_loss, parity_batch
from PIL import Image
from safetensors.numpy import load_file
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import full
from sdjax.finetune import step as step_lib
from sdjax.models.convert import params_to_state_dict
from sdjax.pipelines import load_pipeline

GAMMA = 5.0


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    return load_pipeline(str(sd1_dir))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("cats")
    rng = np.random.default_rng(1)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"c{i}.png")
        (root / f"c{i}.txt").write_text(f"a cat, pose {i}")
    return root


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


# ------------------------------------------------------------------------------------------------ (a) one step
PARITY = (("epsilon", None), ("v_prediction", GAMMA))  # train_text_to_image.py without and with --snr_gamma


def _diffusers_full_step(torch_sd1, prediction_type, gamma, batch):
    """diffusers' UNet, every parameter trainable, and `train_text_to_image.py`'s loss -> (loss, gradients)."""
    import torch

    unet = copy.deepcopy(torch_sd1.unet).train()
    unet.requires_grad_(True)
    context = torch.from_numpy(batch["context"])
    pred, target, sched, t = ddpm_forward(unet, torch_sd1.scheduler.config, prediction_type, batch, context)
    if gamma is None:
        ref = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="mean")
    else:
        ref = min_snr_loss(pred, target, sched, t, prediction_type, gamma)
    ref.backward()
    return float(ref.detach()), {n: p.grad.numpy() for n, p in unet.named_parameters()}


def test_full_step_matches_diffusers(sd1, torch_sd1):
    """Epsilon (plain MSE) and v-prediction with Min-SNR-gamma: both losses and gradients from one compiled program
    (the UNet's forward pass is the same; one compile instead of one per objective: 34.4 -> 28.1 s of CPU time for
    this test's process, `/usr/bin/time pytest tests/finetune/test_full_finetune.py::test_full_step_matches_diffusers`,
    paired runs on a loaded 2-core machine; 33.5 -> 32.0 in a noisier pair)."""
    pipe, params = sd1
    batch = parity_batch(3, [37, 811])  # SNR above and below gamma
    models = step_lib.Models(None, pipe.unet, pipe.vae)
    objectives = [step_lib.Objective(prediction_type=p, min_snr_gamma=g) for p, g in PARITY]
    ac = jnp.asarray(pipe.scheduler.alphas_cumprod)
    inputs = {k: jnp.asarray(v) for k, v in batch.items()} | {"unet_kwargs": {}, "perturbation": None}

    def losses(master):
        return [jax.value_and_grad(lambda m, o=o: full.unet_params_loss(m, models, o, ac, inputs))(master) for o in
                objectives]  # fmt: skip

    results = jax.jit(losses)(params["unet"])
    for (prediction_type, gamma), (value, grads) in zip(PARITY, results, strict=True):
        ref, ref_grads = _diffusers_full_step(torch_sd1, prediction_type, gamma, batch)
        _check_full_step(prediction_type, value, grads, ref, ref_grads)


def _check_full_step(prediction_type, value, grads, ref: float, ref_grads: dict) -> None:
    loss_rel = abs(float(value) - ref) / abs(ref)
    ours = params_to_state_dict(grads)  # diffusers' names and layouts
    assert ours.keys() == ref_grads.keys()
    # Biases that only shift a channel before a one-channel GroupNorm group have a zero gradient in exact
    # arithmetic; both sides give rounding noise there (below 1e-6 of the whole gradient's norm), compared absolutely.
    total = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in ref_grads.values()))
    zero = [k for k, g in ref_grads.items() if np.linalg.norm(g) <= 1e-6 * total]
    assert all(np.linalg.norm(ours[k]) <= 1e-6 * total for k in zero)
    errors = {k: _rel(ours[k], ref_grads[k]) for k in ref_grads if k not in zero}
    worst = max(errors, key=errors.get)
    print(
        f"{prediction_type}: loss {float(value):.8f} vs {ref:.8f} (relative {loss_rel:.2e}); {len(errors)} "
        f"gradient tensors, worst {worst} {errors[worst]:.2e}, median {np.median(list(errors.values())):.2e} "
        f"({len(zero)} zero in exact arithmetic)"
    )
    assert loss_rel <= 1e-5, prediction_type
    for name in (  # representative leaves: convolutions, attention, norms, time embedding, the output
        "conv_in.weight",
        "time_embedding.linear_1.weight",
        "down_blocks.0.resnets.0.conv1.weight",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight",
        "up_blocks.1.attentions.1.transformer_blocks.0.ff.net.0.proj.weight",
        "mid_block.attentions.0.proj_in.weight",
        "up_blocks.0.resnets.0.norm1.weight",
        "conv_out.bias",
    ):
        assert errors[name] <= 1e-4, f"{prediction_type} {name}: gradient relative error {errors[name]:.2e}"
    assert errors[worst] <= 1e-4, prediction_type


# ------------------------------------------------------------------------------------------------ (b) the files
OPTIONS = dict(
    steps=4,
    batch_size=2,
    accumulation=2,
    resolution=64,
    lr=1e-3,
    warmup=1,
    lr_schedule="cosine",
    min_snr_gamma=5.0,
    noise_offset=0.05,
    flip=True,
    save_every=2,
    ema_decay=0.5,
    gradient_checkpointing=True,
    tensorboard=True,
    mixed_precision="bf16",  # bfloat16 compute; the master copy and what is written stay float32
)


@pytest.fixture(scope="module")
def cli_run(sd1_dir, images, tmp_path_factory):
    """`sdjax train finetune` with OPTIONS and an A1111 single file, through the CLI: (the trainer's
    `FinetuneResult`, the CLI's result, the folder holding `ft/`, `ft.safetensors` and `ft-run/`). The resume test
    and the file test both read this one run."""
    folder = tmp_path_factory.mktemp("finetune-cli")
    out = folder / "ft"
    cli = ["train", "finetune", "--model", str(sd1_dir), "--data", str(images), "--out", str(out)]
    cli += ["--single-file", str(folder / "ft.safetensors")]
    for key, value in OPTIONS.items():
        flag = "--" + key.replace("_", "-")
        cli += [flag] if value is True else [flag, str(value)]
    results = []
    train = full.train_finetune

    def recorded(*args, **kwargs):
        results.append(train(*args, **kwargs))
        return results[-1]

    with pytest.MonkeyPatch.context() as mp:  # the CLI imports `train_finetune` from `full` when it runs
        mp.setattr(full, "train_finetune", recorded)
        result = CliRunner().invoke(app, cli)
    assert result.exit_code == 0, result.output + str(result.exception)
    assert len(results) == 1
    return results[0], result, folder


@functools.partial(jax.jit, static_argnums=0)
def _apply(module, unet_params, x, t, ctx):
    return module.apply({"params": unet_params}, x, t, ctx)


def _unet_output(module, unet_params, seed=0):
    """The UNet's output on fixed inputs: one compiled forward for every call (modules of equal configs are equal,
    so the loaded pipelines' UNets reuse it), not a dispatch and compile per operation."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    ctx = rng.standard_normal((2, 9, 32)).astype(np.float32)
    t = np.asarray([10, 700], np.int32)
    return x, t, ctx, np.asarray(_apply(module, unet_params, x, t, ctx))


def test_written_folder_and_single_file_load_in_diffusers_and_sdjax(sd1_dir, sd1, cli_run):
    import diffusers
    import torch

    from sdjax.loading.single_file import load_single_file

    result, _, folder = cli_run  # bfloat16 compute; the master copy and what is written stay float32
    out, single = folder / "ft", folder / "ft.safetensors"
    trained = result.unet
    pipe, base = sd1
    kernel = np.asarray(trained["conv_in"]["kernel"])
    assert kernel.dtype == np.float32 and np.any(kernel != kernel.astype(jnp.bfloat16).astype(np.float32))
    assert _rel(kernel, np.asarray(base["unet"]["conv_in"]["kernel"])) > 1e-4  # it trained
    assert (result.run_dir / "loss.jsonl").is_file() and result.run_dir == folder / "ft-run"

    x, t, ctx, want = _unet_output(pipe.unet, trained)
    # sdjax reads the folder back: the trained params exactly, hence the trained output
    loaded_pipe, loaded = load_pipeline(str(out))
    np.testing.assert_array_equal(_unet_output(loaded_pipe.unet, loaded["unet"])[3], want)
    # diffusers reads it: the same UNet output (float32)
    torch_unet = diffusers.UNet2DConditionModel.from_pretrained(out / "unet").eval()
    with torch.no_grad():
        got = torch_unet(torch.from_numpy(x), torch.from_numpy(t).long(), torch.from_numpy(ctx)).sample.numpy()
    print(f"diffusers UNet from the folder vs the trained params: relative error {_rel(got, want):.2e}")
    assert _rel(got, want) <= 1e-5
    for component in ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        assert (out / component).read_bytes() == (sd1_dir / component).read_bytes(), component
    assert json.loads((out / "unet/config.json").read_text()) == json.loads((sd1_dir / "unet/config.json").read_text())

    # the A1111 single file: sdjax reads the trained UNet; diffusers' from_single_file the folder's weights
    _, from_file, _ = load_single_file(single, config=str(out))
    np.testing.assert_array_equal(_unet_output(pipe.unet, from_file["unet"])[3], want)
    file_pipe = diffusers.StableDiffusionPipeline.from_single_file(str(single), config=str(out), local_files_only=True)
    folder_pipe = diffusers.StableDiffusionPipeline.from_pretrained(out, local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        want_sd = getattr(folder_pipe, name).state_dict()
        got_sd = getattr(file_pipe, name).state_dict()
        for key, value in want_sd.items():
            if key.endswith("position_ids"):
                continue
            np.testing.assert_array_equal(got_sd[key].numpy(), value.numpy(), err_msg=f"{name}.{key}")


# ------------------------------------------------------------------------------------------------ (c) resuming
def read_scalars(folder) -> list[dict]:
    """The scalar events of every TensorBoard event file in `folder` (TFRecord framing: u64 length, u32 CRC,
    data, u32 CRC; tensorboardX's `Event` protobuf), in file order."""
    import struct

    from tensorboardX.proto import event_pb2

    rows = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 16 + length
            for v in event.summary.value:
                rows.append({"file": path.name, "step": event.step, "tag": v.tag, "value": v.simple_value})
    return rows


def test_cli_run_then_resume_repeats_the_losses(sd1_dir, images, cli_run, tmp_path):
    _, result, folder = cli_run
    out = folder / "ft"
    assert result.stdout.strip().splitlines()[-1] == str(out)
    run = folder / "ft-run"
    rows = [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "8"]
    written = load_file(str(out / "unet" / full.WEIGHTS))
    assert all(v.dtype == np.float32 for v in written.values())
    board = read_scalars(run / "tensorboard")  # the loss log's values, as float32
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr")):
        assert [(e["step"], e["value"]) for e in board if e["tag"] == tag] == [
            (r["step"], pytest.approx(r[key], rel=1e-7)) for r in rows
        ]

    resumed_run = tmp_path / "resumed-run"
    shutil.copytree(run, resumed_run)
    shutil.rmtree(resumed_run / "checkpoints" / "8")
    resumed = full.train_finetune(images, tmp_path / "resumed", model=str(sd1_dir), run_dir=str(resumed_run), **OPTIONS)
    assert resumed.start_step == 2
    assert resumed.losses == [rows[2]["loss"], rows[3]["loss"]]  # exactly
    resumed_board = [e for e in read_scalars(resumed_run / "tensorboard") if e["tag"] == "train/loss"]
    assert len({e["file"] for e in resumed_board}) == 2  # the resumed run's own file (it purges steps 2 and 3)
    assert [e["step"] for e in resumed_board if e["file"] != board[0]["file"]] == [2, 3]
    again = load_file(str(tmp_path / "resumed" / "unet" / full.WEIGHTS))
    assert again.keys() == written.keys()
    for key in written:
        np.testing.assert_array_equal(again[key], written[key], err_msg=key)


# ------------------------------------------------------------------------------------------------ (d) bad input
def test_bad_settings_fail_before_loading(images, tmp_path):
    nowhere = str(tmp_path / "no-model")  # never loaded: every error comes first
    with pytest.raises(ValueError, match="lr=0"):
        full.train_finetune(images, tmp_path / "o", model=nowhere, lr=0.0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"{empty} holds no images"):
        full.train_finetune(empty, tmp_path / "o", model=nowhere)
    with pytest.raises(ValueError, match="diffusers folder"):
        full.train_finetune(images, tmp_path / "o.safetensors", model=nowhere)
    with pytest.raises(ValueError, match="single_file"):
        full.train_finetune(images, tmp_path / "o", model=nowhere, single_file=str(tmp_path / "o.ckpt"))
    with pytest.raises(ValueError, match="batch_size"):
        full.train_finetune(images, tmp_path / "o", model=nowhere, batch_size=0)
    with pytest.raises(TypeError, match="conv_rank"):  # LoCon is a LoRA setting: no such option here
        full.train_finetune(images, tmp_path / "o", model=nowhere, conv_rank=4)
    with pytest.raises(ValueError, match="random_crop"):
        full.train_finetune(images, tmp_path / "o", model=nowhere, cache_latents=True, random_crop=True)
    runner = CliRunner()
    result = runner.invoke(app, ["train", "finetune", "--data", str(images), "--out", "o", "--learning-rate", "-1"])
    assert result.exit_code == 2 and "lr=-1.0 must be a positive number" in result.output
    result = runner.invoke(app, ["train", "finetune", "--data", str(empty), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "holds no images" in result.output
    result = runner.invoke(app, ["train", "finetune", "--data", str(images), "--out", "o", "--conv-rank", "4"])
    assert result.exit_code == 2 and "--conv-rank" in result.output
    assert not (tmp_path / "o").exists() and not (tmp_path / "o-run").exists()


# ------------------------------------------------------------------------------------------------ SD 2 / SDXL files
@pytest.mark.parametrize("kind", ["sd2", "sdxl"])
def test_single_files_of_sd2_and_sdxl(kind, sd2_dir, sdxl_dir, tmp_path):
    """`finetune.ldm_file` on SD 2.x (OpenCLIP: fused q/k/v, `cond_stage_model.model.`) and SDXL (two encoders,
    transposed `text_projection`): diffusers' `from_single_file` reads the folder's weights, sdjax its params."""
    import diffusers

    from sdjax.finetune import ldm_file
    from sdjax.loading.components import load_pipeline_components
    from sdjax.loading.single_file import load_single_file

    folder = {"sd2": sd2_dir, "sdxl": sdxl_dir}[kind]
    components, params, _ = load_pipeline_components(folder)
    path = ldm_file.write(tmp_path / f"{kind}.safetensors", components, params, "epsilon")
    _, got, index = load_single_file(path, config=str(folder))
    assert index["_single_file"]["architecture"] == {"sd2": "sd2", "sdxl": "sdxl-base"}[kind]
    for name in ("unet", "vae", *[c for c in ("text_encoder", "text_encoder_2") if c in components]):
        got_sd = params_to_state_dict(got[name])
        for key, value in params_to_state_dict(params[name]).items():
            np.testing.assert_array_equal(got_sd[key], value, err_msg=f"{name}.{key}")
    cls = diffusers.StableDiffusionXLPipeline if kind == "sdxl" else diffusers.StableDiffusionPipeline
    want = cls.from_pretrained(folder, local_files_only=True)
    from_file = cls.from_single_file(str(path), config=str(folder), local_files_only=True)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if getattr(want, name, None) is None:
            continue
        got_sd = getattr(from_file, name).state_dict()
        for key, value in getattr(want, name).state_dict().items():
            if not key.endswith("position_ids"):
                np.testing.assert_array_equal(got_sd[key].numpy(), value.numpy(), err_msg=f"{name}.{key}")


def test_sdxl_finetune_from_cached_latents(sdxl_dir, images, tmp_path):
    """SDXL: two text encoders, the pooled embedding and the micro-conditioning in the step, latents from the cache;
    the written folder loads in sdjax with the trained UNet. Without gradient clipping (a global norm over every
    UNet weight, about a quarter of this run's CPU time, in compiling): the SD 1.x run clips, test_optimizers.py
    checks it."""
    result = full.train_finetune(
        images,
        tmp_path / "xl",
        model=str(sdxl_dir),
        steps=1,
        resolution=64,
        lr=1e-3,
        cache_latents=True,
        max_grad_norm=None,
    )
    assert len(result.losses) == 1 and np.isfinite(result.losses[0])
    pipe, loaded = load_pipeline(str(tmp_path / "xl"))
    assert type(pipe).__name__ == "StableDiffusionXLPipeline"
    want = params_to_state_dict(result.unet)
    got = params_to_state_dict(loaded["unet"])
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    base = load_file(str(sdxl_dir / "unet" / full.WEIGHTS))
    assert not np.array_equal(base["conv_in.weight"], want["conv_in.weight"])  # it trained
