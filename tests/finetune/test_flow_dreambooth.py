"""Flux / SD 3 LoRA runs with text-encoder LoRA and DreamBooth prior preservation (`finetune.flow_run`), on the tiny
pipelines of tests/flux_reference.py and tests/sd3_reference.py saved as diffusers folders.

- `sdjax train lora -m <flux|sd3> --train-text-encoder --instance-prompt ... --class-prompt ... --class-data EMPTY`:
  the class images are drawn by sdjax first; the file holds `text_encoder.` (SD 3: and `text_encoder_2.`) keys in
  diffusers' layout, which diffusers' `load_lora_weights` (peft) reads: its CLIP outputs move, and equal those of
  sdjax's own loader (`pipe.load_lora`, what `sdjax generate --lora` runs) to 1e-5.
- Rows (`flow_run.row_batches`, what each process of a multi-host run builds): a process's rows of the
  [instance; class] batch open only their own images and equal those rows of the whole batch, and the step's loss
  on the rows put together equals the loss on the whole batch.
- Bad settings fail naming the setting (and its flag) before anything is compiled.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flow_helpers import dev_and_sd3_pipelines
from PIL import Image
from typer.testing import CliRunner

from sdjax.finetune import data as data_lib
from sdjax.finetune import flow, flow_models, flow_run

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("optax")

SIZE, MAX_SEQ = 32, 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (torch pipeline, folder, sdjax pipeline, params) for Flux dev and SD 3."""
    return dev_and_sd3_pipelines(tmp_path_factory, MAX_SEQ)


def _images(folder, n: int, colour=(230, 40, 30)):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        img = np.zeros((SIZE, SIZE, 3), np.uint8)
        img[...] = colour
        img[4 + i : 20 + i, 8:24] = (250, 250, 250)
        Image.fromarray(img).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"caption {i}")
    return folder


def _clip_torch(torch_pipe, family: str, ids: dict) -> list[np.ndarray]:
    """CLIP outputs the transformer reads: Flux's CLIP-L pooled output; SD 3's penultimate states and
    `text_embeds` of CLIP-L and CLIP-G."""
    with torch.no_grad():
        if family == "flux":
            return [torch_pipe.text_encoder(torch.from_numpy(ids["ids"]).long()).pooler_output.numpy()]
        outs = []
        for encoder, key in ((torch_pipe.text_encoder, "ids"), (torch_pipe.text_encoder_2, "ids_2")):
            o = encoder(torch.from_numpy(ids[key]).long(), output_hidden_states=True)
            outs += [o.hidden_states[-2].numpy(), o[0].numpy()]
        return outs


def _clip_sdjax(pipe, family: str, ids: dict) -> list[np.ndarray]:
    cond = pipe.generator.models.conditioning
    if family == "flux":
        return [np.asarray(cond.text_encoder.apply({"params": pipe.params["text_encoder"]}, ids["ids"]).pooler_output)]
    outs = []
    for encoder, c, key in (
        (cond.text_encoder, "text_encoder", "ids"),
        (cond.text_encoder_2, "text_encoder_2", "ids_2"),
    ):
        o = encoder.apply({"params": pipe.params[c]}, ids[key])
        outs += [np.asarray(o.hidden_states[-2]), np.asarray(o.text_embeds)]
    return outs


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_cli_dreambooth_with_text_encoder_lora(models, tmp_path, family):
    import json

    from safetensors import safe_open

    from sdjax.cli import app

    torch_pipe, folder, pipe, _ = models[family]
    data, classes, out = _images(tmp_path / "sks", 2), tmp_path / "class", tmp_path / "sks.safetensors"
    if family == "flux":  # `train lora` with the DreamBooth options, and `train dreambooth` (one resolution)
        cli = ["train", "lora", "-m", str(folder), "--data", str(data), "--no-bucketing"]
    else:
        cli = ["train", "dreambooth", "-m", str(folder), "--instance-data", str(data)]
    cli += ["--out", str(out), "--steps", "2", "--rank", "2"]
    cli += ["--resolution", str(SIZE), "--train-text-encoder", "--instance-prompt", "a sks square"]
    cli += ["--class-prompt", "a square", "--class-data", str(classes), "--num-class-images", "2", "--class-steps", "2"]
    cli += ["--prior-loss-weight", "0.5", "--max-sequence-length", str(MAX_SEQ), "--lr", "3e-2"]
    cli += ["--text-encoder-lr", "1e-2"]  # the text encoders' LoRA at its own rate (its own optimiser state)
    run = CliRunner().invoke(app, cli)
    assert run.exit_code == 0, run.output + str(run.exception)
    assert sorted(p.name for p in classes.iterdir()) == ["sdjax-class-00000.png", "sdjax-class-00001.png"]
    encoders = ("text_encoder",) if family == "flux" else ("text_encoder", "text_encoder_2")
    with safe_open(str(out), "np") as f:
        keys, meta = set(f.keys()), json.loads(f.metadata()["lora_adapter_metadata"])
    for c in encoders:
        layer = f"{c}.text_model.encoder.layers.0.self_attn.q_proj"
        assert {f"{layer}.lora_A.weight", f"{layer}.lora_B.weight"} <= keys, sorted(keys)[:4]
        assert meta[f"{c}.target_modules"] == ["k_proj", "out_proj", "q_proj", "v_proj"] and meta[f"{c}.r"] == 2
    saved = json.loads((tmp_path / "sks-run" / "config.json").read_text())
    assert saved["train_text_encoder"] and saved["class_prompt"] == "a square" and saved["prior_loss_weight"] == 0.5
    assert saved["text_encoder_lr"] == 1e-2

    ids = pipe.generator.models.conditioning.text_inputs(["a sks square"], [""])
    before = _clip_torch(torch_pipe, family, ids)
    torch_pipe.load_lora_weights(str(out), adapter_name="sks")
    try:
        theirs = _clip_torch(torch_pipe, family, ids)
    finally:
        torch_pipe.unload_lora_weights()
    pipe.load_lora(out)
    try:
        ours = _clip_sdjax(pipe, family, ids)
    finally:
        pipe.unload_loras()
    for b, t, o in zip(before, theirs, ours, strict=True):
        moved, err = float(np.abs(t - b).max()), float(np.abs(o - t).max() / np.abs(t).max())
        print(f"{family}: diffusers' CLIP output moved by {moved:.2e}; sdjax vs diffusers {err:.1e} (relative max)")
        assert moved > 1e-3 and err <= 1e-5


def _counted(monkeypatch) -> list[str]:
    """Every decode of a training example (`data.crop_example`), by file name (folder/name)."""
    opened: list[str] = []
    crop = data_lib.crop_example

    def counted(item, *args):
        opened.append(f"{item.path.parent.name}/{item.path.name}")
        return crop(item, *args)

    monkeypatch.setattr(data_lib, "crop_example", counted)
    return opened


def test_a_process_rows_are_its_rows_of_the_whole_batch(models, tmp_path, monkeypatch):
    _, folder, pipe, params = models["flux"]
    cfg = flow_run.FlowLoraTrainConfig(
        data=str(_images(tmp_path / "inst", 3)), out=str(tmp_path / "x.safetensors"), model=str(folder),
        batch_size=2, resolution=SIZE, bucketing=False, flip=True, instance_prompt="a sks square",
        class_prompt="a square", class_data=str(_images(tmp_path / "cls", 3, (40, 200, 30))), train_text_encoder=True,
    )  # fmt: skip
    data_cfg = cfg.data_config(SIZE)
    samplers = [
        data_lib.Sampler(flow_run._with_prompt(data_lib.scan(d, data_cfg), p), data_cfg, 2, cfg.seed + i)
        for i, (d, p) in enumerate(((cfg.data, "a sks square"), (cfg.class_data, "a square")))
    ]
    adapter = flow_models.FluxAdapter(pipe.transformer)
    text = flow_models.TextInputs(flow_models.TextStates(pipe.generator.models.conditioning, params), adapter)
    batches, frozen = flow_run.row_batches(cfg, None, {"vae": params["vae"]}, samplers, text, print)
    opened = _counted(monkeypatch)
    for micro in range(3):
        whole = batches.load(micro, None)
        everything, opened[:] = list(opened), []
        parts = [batches.load(micro, rows) for rows in ([0, 1], [2, 3])]
        assert [o.split("/")[0] for o in opened] == ["inst", "inst", "cls", "cls"] and opened == everything
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
        opened[:] = []
        one = batches.load(micro, [1, 2])
        assert opened == everything[1:3] and np.array_equal(one["pixels"], whole["pixels"][1:3])
        opened[:] = []
    assert sorted(whole) == ["ids", "pixels", "t5"] and batches.size == 4

    # the step's loss on the rows put together is the loss on the whole batch (instance and class halves pair)
    models_ = flow.FlowModels(adapter, pipe.vae, conditioning=pipe.generator.models.conditioning)
    objective = flow.FlowObjective(prior_loss_weight=0.5, shift=3.0, use_dynamic_shifting=True)
    loss = jax.jit(flow.make_flow_loss(models_, objective))
    lora = flow_models.init_lora(jax.random.PRNGKey(0), params["transformer"], ("attn.to_q",), 2)
    lora |= flow_models.init_text_lora(jax.random.PRNGKey(0), params, adapter.text_encoders, 2)
    frozen = {c: params[c] for c in ("transformer", "vae", "text_encoder")}
    joined = {k: np.concatenate([p[k] for p in parts]) for k in whole}
    a, b = (
        float(loss(lora, frozen, whole, jax.random.PRNGKey(1))),
        float(loss(lora, frozen, joined, jax.random.PRNGKey(1))),
    )
    assert a == b and np.isfinite(a)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(class_prompt="a dog", bucketing=False), "needs class_data (--class-data)"),
        (dict(with_prior_preservation=True, class_data="C", bucketing=False), "needs a class_prompt (--class-prompt)"),
        (dict(class_prompt="a dog", class_data="C"), "bucketing with prior preservation .* --no-bucketing"),
        (dict(class_prompt="a", class_data="C", bucketing=False, prior_loss_weight=-1.0), "prior_loss_weight=-1.0"),
        (dict(class_prompt="a", class_data="C", bucketing=False, num_class_images=0), "num_class_images=0"),
        (dict(with_prior_preservation=False, class_prompt="a dog"), "class_prompt .* is for prior preservation"),
        (dict(instance_prompt=" "), "instance_prompt=' ' (--instance-prompt) is empty"),
        (dict(train_text_encoder="yes"), "train_text_encoder='yes' (--train-text-encoder)"),
        (dict(conv_rank=4), "conv_rank=4 (--conv-rank): flow-matching LoRA training"),  # LoCon: UNet models only
    ],
)
def test_bad_settings_fail_before_compiling(models, tmp_path, options, named):
    from compile_counter import counting_compiles

    from sdjax.finetune import train_lora

    _, folder, _, _ = models["flux"]
    data = _images(tmp_path / "data", 1)
    if "class_data" in options:
        options = {**options, "class_data": str(tmp_path / "class")}
    with (
        counting_compiles() as compiles,
        pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")),
    ):
        train_lora(data, tmp_path / "x.safetensors", model=str(folder), steps=1, **options)
    assert not compiles and not (tmp_path / "x-run").exists() and not (tmp_path / "class").exists()


def test_text_encoder_lora_needs_the_clip_params(models):
    """A pipeline part that cannot take the text-encoder LoRA (no CLIP params) is refused naming the flag."""
    _, _, _, params = models["sd3"]
    with pytest.raises(ValueError, match=r"train_text_encoder \(--train-text-encoder\): .* no text_encoder_2"):
        flow_models.init_text_lora(
            jax.random.PRNGKey(0), {**params, "text_encoder_2": None}, ("text_encoder", "text_encoder_2"), 2
        )


def test_locon_refused_for_flow_models_by_the_cli(models, tmp_path):
    """`--conv-rank` / `--conv-alpha` (LoCon) reach the flow trainer for an SD 3 model (`train lora` and `train
    dreambooth`) and are refused by name before anything is loaded."""
    from sdjax.cli import app

    _, folder, _, _ = models["sd3"]
    data = _images(tmp_path / "data", 1)
    out = ["--out", str(tmp_path / "x.safetensors"), "-m", str(folder)]
    run = CliRunner().invoke(app, ["train", "lora", "--data", str(data), *out, "--conv-rank", "2"])
    assert run.exit_code == 2 and "conv_rank=2 (--conv-rank): flow-matching" in run.output, run.output
    dreambooth = ["train", "dreambooth", "--instance-data", str(data), "--instance-prompt", "sks", *out]
    run = CliRunner().invoke(app, [*dreambooth, "--conv-rank", "2", "--conv-alpha", "1"])
    assert run.exit_code == 2 and "conv_rank=2 (--conv-rank): flow-matching" in run.output, run.output
    assert not (tmp_path / "x-run").exists()


def test_dreambooth_options_refused_for_a_unet_model(sd1_dir, tmp_path):
    from sdjax.cli import app

    data = _images(tmp_path / "data", 1)
    cli = ["train", "lora", "-m", str(sd1_dir), "--data", str(data), "--out", str(tmp_path / "x.safetensors")]
    run = CliRunner().invoke(app, [*cli, "--class-prompt", "a dog", "--class-data", str(tmp_path / "c")])
    assert run.exit_code == 2, run.output
    assert "['class_data', 'class_prompt']" in run.output and "sdjax train dreambooth" in run.output
