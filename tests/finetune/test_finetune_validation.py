"""Validation images (`validation_prompts`, `validation_every`): written to `validation/step-NNNNNN-i.png` before the
first update, every N updates and at the end; the step-0 images are the base pipeline's images of the same prompt
and seed (a fresh LoRA's up factors are zero; a textual-inversion run's rows are the init word's), and the last
ones are what `generate` draws with the written file loaded through sdjax's inference loaders. With `tensorboard`
the same images are on the board (`validation/i` at the update count), pixel for pixel, and a resumed run's board
keeps the images of the update it resumes at (a model-free run of `run_loop`)."""

import io

import numpy as np
import pytest
from finetune_helpers import board_events, board_images
from PIL import Image
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import train_lora, train_textual_inversion, validation

PROMPTS = ("sks", "a red square")
GEN = dict(seed=7, steps=3, height=64, width=64)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation-images")
    rng = np.random.default_rng(5)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"v{i}.png")
        (root / f"v{i}.txt").write_text("sks")
    return root


def _png(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def test_lora_validation_images(sd1_dir, images, tmp_path):
    from sdjax.pipelines import load_pipeline

    out = tmp_path / "val.safetensors"
    train_lora(
        images,
        out,
        model=str(sd1_dir),
        steps=3,
        rank=4,
        lr=3e-2,
        batch_size=2,
        resolution=64,
        validation_prompts=PROMPTS,
        validation_every=2,
        validation_seed=GEN["seed"],
        validation_steps=GEN["steps"],
        tensorboard=True,
    )
    folder = tmp_path / "val-run" / "validation"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"step-{s:06d}-{i}.png" for s in (0, 2, 3) for i in range(2)]

    # the board: each drawn update's images, tagged by prompt, at the update count, equal to the PNG files
    board = board_images(tmp_path / "val-run" / "tensorboard")
    assert [(e["step"], e["tag"]) for e in board] == [(s, f"validation/{i}") for s in (0, 2, 3) for i in range(2)]
    for e in board:
        assert e["image"].mode == "RGB" and e["image"].size == (64, 64)
        png = _png(folder / f"step-{e['step']:06d}-{e['tag'].split('/')[1]}.png")
        np.testing.assert_array_equal(np.asarray(e["image"]), png, err_msg=str(e))

    # the grid: a row per drawn update (0, 2, 3), a column per prompt, the images as they are; no partial file left
    grid, margin = _png(tmp_path / "val-run" / validation.GRID), validation.LABEL_WIDTH
    assert grid.shape == (3 * 64, margin + 2 * 64, 3)
    for r, step in enumerate((0, 2, 3)):
        for i in range(2):
            cell = grid[r * 64 : (r + 1) * 64, margin + i * 64 : margin + (i + 1) * 64]
            np.testing.assert_array_equal(cell, _png(folder / f"step-{step:06d}-{i}.png"))
        assert (grid[r * 64 : (r + 1) * 64, :margin] < 128).any()  # the row's label
    assert sorted(p.name for p in (tmp_path / "val-run").glob("*validation-grid*")) == [validation.GRID]

    pipe, _ = load_pipeline(str(sd1_dir))
    for i, prompt in enumerate(PROMPTS):
        base = np.asarray(pipe.generate(prompt, **GEN)[0])
        np.testing.assert_array_equal(_png(folder / f"step-000000-{i}.png"), base, err_msg=prompt)
    pipe.load_lora(out)
    for i, prompt in enumerate(PROMPTS):
        with_lora = np.asarray(pipe.generate(prompt, **GEN)[0]).astype(int)
        last = _png(folder / f"step-000003-{i}.png").astype(int)
        assert np.abs(last - with_lora).max() <= 1, prompt  # the training merge vs the inference loader's fusion
        assert not np.array_equal(last, _png(folder / f"step-000000-{i}.png")), prompt


def test_textual_inversion_validation_images(sd1_dir, images, tmp_path):
    from sdjax.pipelines import load_pipeline

    out = tmp_path / "ti-emb.safetensors"
    train_textual_inversion(
        images,
        out,
        model=str(sd1_dir),
        token="<v>",
        init_word="red",
        steps=1,
        resolution=64,
        validation_prompts=["a photo of <v>"],
        validation_seed=GEN["seed"],
        validation_steps=GEN["steps"],
        ema_decay=0.5,
    )
    folder = tmp_path / "ti-emb-run" / "validation"
    assert sorted(p.name for p in folder.iterdir()) == ["step-000000-0.png", "step-000001-0.png"]
    pipe, _ = load_pipeline(str(sd1_dir))
    pipe.load_textual_inversion(tmp_path / "ti-emb-run" / "init.safetensors", token="<v>")
    base = np.asarray(pipe.generate("a photo of <v>", **GEN)[0])
    np.testing.assert_array_equal(_png(folder / "step-000000-0.png"), base)


def test_bad_validation_settings_fail_before_loading(images, tmp_path):
    no_model = str(tmp_path / "no-model")
    with pytest.raises(ValueError, match="validation_every"):
        train_lora(images, tmp_path / "x.safetensors", model=no_model, validation_every=5)
    with pytest.raises(ValueError, match="validation_every"):
        train_lora(images, tmp_path / "x.safetensors", model=no_model, validation_prompts=["a"], validation_every=-1)
    with pytest.raises(ValueError, match="validation_steps"):
        train_lora(images, tmp_path / "x.safetensors", model=no_model, validation_prompts=["a"], validation_steps=0)
    cli = ["train", "lora", "--data", str(images), "--out", str(tmp_path / "x.safetensors")]
    result = CliRunner().invoke(app, [*cli, "--validation-every", "10"])
    assert result.exit_code == 2 and "--validation-prompt" in result.output
    result = CliRunner().invoke(app, [*cli, "--ema-decay", "1"])
    assert result.exit_code == 2 and "--ema-decay" in result.output


def _shown_images(folder) -> list[tuple[int, str, int]]:
    """(step, tag, the image's first pixel value) of the board's images as TensorBoard shows them: the files in name
    order, each file's purge step (its SessionLog START event) dropping the earlier files' events from that step on."""
    from tensorboardX.proto.event_pb2 import SessionLog

    shown: list[tuple[int, str, int]] = []
    for _, e in board_events(folder):
        if e.HasField("session_log") and e.session_log.status == SessionLog.START:
            shown = [s for s in shown if s[0] < e.step]
        for v in e.summary.value:
            if v.HasField("image"):
                pixels = np.asarray(Image.open(io.BytesIO(v.image.encoded_image_string)))
                shown.append((e.step, v.tag, int(pixels[0, 0, 0])))
    return shown


def test_resumed_board_keeps_the_images_of_its_first_update(tmp_path):
    """`run_loop` with a stand-in trainer (no model: one value that each update raises by 1, images filled with
    10 x value + prompt index), stopped after update 2 and resumed: the resumed file's purge from update 2 on drops
    update 2's images, which the resumed run does not draw again, so it puts the earlier run's files back; TensorBoard
    then shows every drawn update's images once, at the right steps."""
    import jax
    import jax.numpy as jnp

    from sdjax.finetune import run as run_lib
    from sdjax.parallel.sharding import make_mesh

    cfg = run_lib.LoraTrainConfig(
        data=str(tmp_path),
        out=str(tmp_path / "x.safetensors"),
        steps=4,
        save_every=1,
        tensorboard=True,
        validation_prompts=("a", "b"),
        validation_every=2,
    )

    def validate(values, update):
        paths = [validation.image_path(cfg.run_path, update, i) for i in range(2)]
        for i, path in enumerate(paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), 10 * int(values["x"]) + i, np.uint8)).save(path)
        return paths

    step = jax.jit(lambda state, frozen, batch, key: ({"lora": {"x": state["lora"]["x"] + batch["x"].sum()}}, 0.5))
    loop = dict(
        mesh=make_mesh(devices=jax.devices()[:1]),
        schedule=lambda u: 1e-4,
        finish=lambda state: None,
        validate=validate,
    )
    batches = lambda micro: {"x": np.ones((1,), np.float32)}
    state = {"lora": {"x": jnp.zeros((), jnp.float32)}}
    run_lib.run_loop(cfg, state, {}, step, batches, stop_after=2, **loop)
    _, start, end = run_lib.run_loop(cfg, state, {}, step, batches, **loop)
    assert (start, end) == (2, 4)

    board = cfg.run_path / "tensorboard"
    first, resumed = sorted(p.name for p in board.iterdir())
    by_file = [(e["file"], e["step"], e["tag"]) for e in board_images(board)]
    assert by_file == [(first, s, f"validation/{i}") for s in (0, 2) for i in range(2)] + [
        (resumed, s, f"validation/{i}") for s in (2, 4) for i in range(2)
    ]
    assert _shown_images(board) == [(s, f"validation/{i}", 10 * s + i) for s in (0, 2, 4) for i in range(2)]
