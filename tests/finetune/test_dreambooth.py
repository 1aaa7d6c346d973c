"""`sdjax train dreambooth`: one prior-preservation step against diffusers' UNet + a peft LoRA computing
`train_dreambooth_lora.py`'s loss on the same [instance; class] batch, class images drawn only when missing (and
reused by a second run), and bad settings refused before anything is loaded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from finetune_helpers import lora_from_peft, parity_batch, peft_forward, worst_grad_error
from PIL import Image
from safetensors.numpy import load_file
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import dreambooth, train_dreambooth
from sdjax.finetune import step as step_lib
from sdjax.pipelines import load_pipeline

RANK, ALPHA, PRIOR_WEIGHT = 4, 8.0, 0.5


def _diffusers_dreambooth_step(torch_unet, scheduler_config, prediction_type, batch):
    """diffusers' train_dreambooth_lora.py loss (chunk the prediction and target in two, instance MSE +
    prior_loss_weight * class MSE) with a peft LoRA whose up weights are nonzero -> (loss, LoRA parameters)."""
    import torch

    unet, model_pred, target, _, _ = peft_forward(torch_unet, scheduler_config, prediction_type, batch, RANK, ALPHA)
    model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
    target, target_prior = torch.chunk(target, 2, dim=0)
    loss = torch.nn.functional.mse_loss(model_pred.float(), target.float(), reduction="mean")
    prior_loss = torch.nn.functional.mse_loss(model_pred_prior.float(), target_prior.float(), reduction="mean")
    loss = loss + PRIOR_WEIGHT * prior_loss
    loss.backward()
    return float(loss.detach()), {n: p for n, p in unet.named_parameters() if "lora_" in n}


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    """The tiny SD 1.x pipeline, loaded once for the module (no test changes it)."""
    return load_pipeline(str(sd1_dir))


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_prior_preservation_step_matches_diffusers(sd1, torch_sd1, prediction_type):
    pipe, params = sd1
    batch = parity_batch(3, [37, 811, 500, 120])  # 2 instance examples, then 2 class examples
    ref_loss, tensors = _diffusers_dreambooth_step(torch_sd1.unet, torch_sd1.scheduler.config, prediction_type, batch)
    lora = lora_from_peft(params, tensors, RANK)
    assert len(lora["unet"]) * 2 == len(tensors)
    models = step_lib.Models(None, pipe.unet, pipe.vae, unet_scale=ALPHA / RANK)
    ac = jnp.asarray(pipe.scheduler.alphas_cumprod)
    inputs = {k: jnp.asarray(v) for k, v in batch.items()} | {"unet_kwargs": {}, "perturbation": None}

    def loss_with(objective):
        return lambda lora_unet: step_lib.unet_loss(lora_unet, params["unet"], models, objective, ac, inputs)

    def losses(lora_unet):  # one program: the prior-preservation loss and its gradient, and the plain loss
        prior = loss_with(step_lib.Objective(prediction_type=prediction_type, prior_loss_weight=PRIOR_WEIGHT))
        plain = loss_with(step_lib.Objective(prediction_type=prediction_type))  # the mean over all 4: not it
        return *jax.value_and_grad(prior)(lora_unet), plain(lora_unet)

    value, grads, plain = jax.jit(losses)(lora["unet"])
    loss_rel = abs(float(value) - ref_loss) / abs(ref_loss)
    assert abs(float(plain) - ref_loss) / ref_loss > 1e-3
    worst = worst_grad_error(grads, tensors)
    print(f"{prediction_type}: loss relative error {loss_rel:.2e}, worst of {2 * len(grads)} gradients {worst:.2e}")
    assert loss_rel <= 1e-5


def _images(folder, n, seed):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text("a caption DreamBooth does not read")


def test_class_images_drawn_when_missing_then_reused(sd1_dir, sd1, tmp_path):
    instance, classes = tmp_path / "sks", tmp_path / "dog"
    _images(instance, 2, 0)
    _images(classes, 1, 1)  # one class image of the user's: two of three are missing
    options = dict(
        model=str(sd1_dir),
        instance_prompt="a photo of sks dog",
        with_prior_preservation=True,
        class_data=str(classes),
        class_prompt="a photo of dog",
        num_class_images=3,
        class_steps=2,
        steps=2,
        rank=2,
        resolution=64,
        lr=1e-3,
    )
    result = train_dreambooth(instance, tmp_path / "sks.safetensors", **options)
    drawn = sorted(p.name for p in classes.glob(dreambooth.CLASS_PREFIX + "*"))
    assert drawn == ["sdjax-class-00000.png", "sdjax-class-00001.png"]
    assert len(dreambooth.class_images(classes)) == 3
    pixels = [np.asarray(Image.open(classes / name)) for name in drawn]
    assert all(p.shape == (64, 64, 3) for p in pixels) and not np.array_equal(*pixels)  # seeds 0 and 1
    # drawn in one batch of `sample_batch_size` (4: two kept), each the image its seed gives alone
    pipe, _ = sd1
    for seed, got in enumerate(pixels):
        alone = np.asarray(pipe.generate("a photo of dog", seed=seed, steps=2, height=64, width=64)[0])
        assert np.abs(got.astype(int) - alone).max() <= 1, seed
    with pytest.raises(ValueError, match=r"seed=\[1, 2\]: expected one int, or a list of one int per image \(3\)"):
        pipe.generate("a photo of dog", num_images=3, seed=[1, 2])
    assert len(result.losses) == 2 and all(np.isfinite(result.losses))
    trained = load_file(str(result.out))
    assert any(k.startswith("lora_unet_") and k.endswith("lora_up.weight") for k in trained)

    # the batch: the instance examples with the instance prompt, then the class examples with the class prompt
    cfg = dreambooth.DreamBoothConfig(data=str(instance), out="x.safetensors", **options)
    data_cfg = cfg.data_config(64)
    samplers = [
        dreambooth.data_lib.Sampler(
            dreambooth._with_prompt(dreambooth.data_lib.scan(folder, data_cfg), prompt), data_cfg, 1, 0
        )
        for folder, prompt in ((instance, cfg.instance_prompt), (classes, cfg.class_prompt))
    ]
    batch = dreambooth._batch(samplers, pipe.generator.models.conditioning, 0, 1)
    ids = np.asarray(pipe.generator.models.conditioning.tokenize([cfg.instance_prompt, cfg.class_prompt]))
    assert batch["pixels"].shape == (2, 3, 64, 64) and np.array_equal(batch["ids"], ids)

    # a second run (the CLI, prior preservation implied by --class-prompt) draws nothing
    stamps = {p: p.stat().st_mtime_ns for p in classes.iterdir()}
    cli = ["train", "dreambooth", "-m", str(sd1_dir), "--instance-data", str(instance)]
    cli += ["--instance-prompt", "a photo of sks dog", "--class-data", str(classes), "--class-prompt", "a photo of dog"]
    cli += ["--num-class-images", "3", "--steps", "1", "--rank", "2", "--resolution", "64"]
    cli += ["--out", str(tmp_path / "again.safetensors")]
    run = CliRunner().invoke(app, cli)
    assert run.exit_code == 0, run.output + str(run.exception)
    assert run.stdout.strip().splitlines()[-1] == str(tmp_path / "again.safetensors")
    assert {p: p.stat().st_mtime_ns for p in classes.iterdir()} == stamps

    # resuming the first run with another prior weight is refused
    with pytest.raises(ValueError, match="prior_loss_weight: 1.0 -> 2.0"):
        train_dreambooth(instance, tmp_path / "sks.safetensors", **(options | {"prior_loss_weight": 2.0}))


def test_a_process_rows_of_the_instance_and_class_batch(sd1, tmp_path):
    """`_batch(..., rows)` (what one process of several builds: `run.RowBatches`) equals those rows of the whole
    [instance; class] micro-batch, opening only the images of those rows: instance rows from the instance images,
    class rows from the class images, none of a part without rows."""
    instance, classes = tmp_path / "sks", tmp_path / "dog"
    _images(instance, 3, 0)
    _images(classes, 3, 1)
    pipe, _ = sd1
    conditioning = pipe.generator.models.conditioning
    data_cfg = dreambooth.data_lib.DataConfig(resolution=64, bucketing=False, flip=True, random_crop=True)
    samplers = [
        dreambooth.data_lib.Sampler(
            dreambooth._with_prompt(dreambooth.data_lib.scan(folder, data_cfg), prompt), data_cfg, 2, seed
        )
        for folder, prompt, seed in ((instance, "a photo of sks dog", 0), (classes, "a photo of dog", 1))
    ]
    opened: list[str] = []
    crop = dreambooth.data_lib.crop_example

    def counted(item, *args):
        opened.append(item.path.parent.name)
        return crop(item, *args)

    batches = dreambooth._row_batches(samplers, conditioning, 1)
    assert batches.size == 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dreambooth.data_lib, "crop_example", counted)
        for micro in range(3):
            whole = batches(micro)
            for rows in ([0, 1], [2, 3], [1, 2], [3]):
                opened.clear()
                part = batches.load(micro, rows)
                assert opened == ["sks" if r < 2 else "dog" for r in rows]
                for key in ("pixels", "time_ids", "ids", "clip_skip"):
                    np.testing.assert_array_equal(part[key], whole[key][rows], err_msg=f"{key} rows {rows}")
    assert dreambooth.data_lib.part_rows([1, 2, 3], [2, 2]) == [[1], [0, 1]]
    assert dreambooth.data_lib.part_rows([0, 1], [2, 2]) == [[0, 1], []]
    assert dreambooth.data_lib.part_rows(None, [2, 2]) == [None, None]
    with pytest.raises(IndexError, match=r"rows \[4\] of a micro-batch of 4 examples"):
        dreambooth.data_lib.part_rows([0, 4], [2, 2])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(class_prompt=None), "needs a class_prompt"),
        (dict(num_class_images=0), "num_class_images=0 must be at least 1"),
        (dict(min_snr_gamma=5.0), "min_snr_gamma with prior preservation"),
        (dict(class_data=None), "needs a class_data folder"),
        (dict(bucketing=True), "bucketing with prior preservation"),
        (dict(instance_prompt=" "), "instance_prompt is empty"),
        (dict(conv_rank=0), r"conv_rank=0 \(--conv-rank\)"),  # LoCon: `train lora`'s settings
    ],
)
def test_bad_settings_fail_before_loading(tmp_path, change, message):
    _images(tmp_path / "sks", 1, 0)
    options = dict(
        model=str(tmp_path / "no-such-model"),  # reached only if the check let the settings through
        instance_prompt="a photo of sks dog",
        with_prior_preservation=True,
        class_data=str(tmp_path / "dog"),
        class_prompt="a photo of dog",
        num_class_images=4,
    )
    with pytest.raises(ValueError, match=message):
        train_dreambooth(tmp_path / "sks", tmp_path / "x.safetensors", **(options | change))
    assert not (tmp_path / "dog").exists() and not (tmp_path / "x-run").exists()


def test_cli_refuses_prior_preservation_without_class_prompt(tmp_path):
    _images(tmp_path / "sks", 1, 0)
    cli = ["train", "dreambooth", "--instance-data", str(tmp_path / "sks"), "--instance-prompt", "sks dog"]
    cli += [
        "--with-prior-preservation",
        "--class-data",
        str(tmp_path / "dog"),
        "--out",
        str(tmp_path / "x.safetensors"),
    ]
    run = CliRunner().invoke(app, cli)
    assert run.exit_code == 2 and "needs a class_prompt" in run.output
    cli += ["--class-prompt", "a dog", "--num-class-images", "0"]
    run = CliRunner().invoke(app, cli)
    assert run.exit_code == 2 and "num_class_images=0" in run.output
