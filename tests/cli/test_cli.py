"""`sdjax generate`, `sdjax pnginfo` and the help of every command, on the fake pipeline (in process)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from fake_pipeline import FakePipeline, expected
from PIL import Image
from typer.testing import CliRunner

from sdjax import cli, infotext, metadata

runner = CliRunner()


@pytest.fixture
def fake(monkeypatch):
    pipe = FakePipeline()
    loads = []

    def load(model, dtype):
        loads.append((model, getattr(dtype, "value", dtype)))
        return pipe

    monkeypatch.setattr(cli.generate, "load_pipeline", load)
    pipe.loads = loads
    return pipe


def run(*args: str):
    result = runner.invoke(cli.app, list(args))
    return result


def test_generate_writes_pngs_with_parameters(fake, tmp_path):
    out = tmp_path / "out"
    r = run(
        "generate",
        "a red fox",
        "--negative-prompt",
        "blurry",
        "--steps",
        "3",
        "--guidance-scale",
        "5",
        "--width",
        "48",
        "--height",
        "32",
        "--seed",
        "11",
        "--num-images",
        "3",
        "--sampler",
        "ddim",
        "--dtype",
        "bfloat16",
        "--model",
        "org/some-model",
        "--out",
        str(out),
        "--batch-size",
        "2",
    )
    assert r.exit_code == 0, r.output
    assert fake.loads == [("org/some-model", "bfloat16")]
    paths = sorted(out.glob("*.png"))
    assert [p.name for p in paths] == ["00000-11.png", "00001-12.png", "00002-13.png"]
    assert all(str(p) in r.stdout for p in paths)
    for k, path in enumerate(paths):
        text = infotext.read_parameters(path)
        assert text == (
            "a red fox\nNegative prompt: blurry\nSteps: 3, Sampler: DDIM, CFG scale: 5.0, "
            f"Seed: {11 + k}, Size: 48x32, Model: org/some-model"
        )
        with Image.open(path) as im:
            np.testing.assert_array_equal(
                np.asarray(im), expected("a red fox", "blurry", 11 + k, 0, 5.0, 3, 32, 48, "ddim")
            )
    # batches of 2, the last padded to the same compiled size
    assert [(c["n"], c["pad_to"]) for c in fake.calls] == [(2, 2), (1, 2)]
    # progress and the timing summary go to stderr
    assert "Denoising" in r.stderr and "total" in r.stderr and "compile" in r.stderr


def test_defaults_come_from_the_pipeline(fake, tmp_path):
    r = run("generate", "cat", "-o", str(tmp_path))
    assert r.exit_code == 0, r.output
    (path,) = tmp_path.glob("*.png")
    p = metadata.parameters_from_text(infotext.read_parameters(path))
    assert (p.steps, p.sampler, p.width, p.height, p.seed, p.guidance_scale, p.model) == (
        FakePipeline.default_steps,
        "euler_a",
        64,
        64,
        0,
        7.5,
        "sdjax/embedded",
    )
    assert fake.loads == [(None, "float32")]


def test_same_seed_same_bytes_and_numbering_continues(fake, tmp_path):
    args = ("generate", "a lighthouse", "--seed", "3", "-N", "2", "-o", str(tmp_path), "--quiet")
    assert run(*args).exit_code == 0
    assert run(*args).exit_code == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["00000-3.png", "00001-4.png", "00002-3.png", "00003-4.png"]
    assert (tmp_path / "00000-3.png").read_bytes() == (tmp_path / "00002-3.png").read_bytes()
    assert (tmp_path / "00001-4.png").read_bytes() == (tmp_path / "00003-4.png").read_bytes()
    assert (tmp_path / "00000-3.png").read_bytes() != (tmp_path / "00001-4.png").read_bytes()


def test_a_seed_from_a_file_reproduces_that_image_alone(fake, tmp_path):
    assert run("generate", "moon", "--seed", "100", "-N", "4", "-o", str(tmp_path / "a"), "-q").exit_code == 0
    assert run("generate", "moon", "--seed", "102", "-o", str(tmp_path / "b"), "-q").exit_code == 0
    assert (tmp_path / "a" / "00002-102.png").read_bytes() == (tmp_path / "b" / "00000-102.png").read_bytes()


def test_grid(fake, tmp_path):
    r = run("generate", "tiles", "-N", "3", "--grid", "-o", str(tmp_path), "-q")
    assert r.exit_code == 0, r.output
    with Image.open(tmp_path / "grid-00000.png") as grid:
        assert grid.size == (128, 128)  # 2x2 cells of 64x64, one left empty
        arr = np.asarray(grid)
        np.testing.assert_array_equal(arr[64:, :64], expected("tiles", "", 2, 0, 7.5, 4, 64, 64, "euler_a"))
        assert not arr[64:, 64:].any()
        assert grid.info["parameters"].endswith("Seed: 0, Size: 64x64, Model: sdjax/embedded")


def test_pnginfo(fake, tmp_path):
    run("generate", "two\nlines", "-n", "neg", "-o", str(tmp_path), "-q")
    (path,) = tmp_path.glob("*.png")
    r = run("pnginfo", str(path))
    assert r.exit_code == 0
    assert r.stdout.startswith("two\nlines\nNegative prompt: neg\nSteps: 4")
    r = run("pnginfo", "--json", str(path))
    fields = json.loads(r.stdout)
    assert fields["Prompt"] == "two\nlines" and fields["Seed"] == "0" and fields["Size-1"] == "64"
    bare = tmp_path / "bare.png"
    Image.new("RGB", (8, 8)).save(bare)
    r = run("pnginfo", str(bare))
    assert r.exit_code == 1 and "no parameters" in r.stderr


def test_pnginfo_on_files_it_cannot_read(fake, tmp_path):
    """A truncated PNG or a file that is no image: one line naming the file and why, exit 1, and the other files
    are still read (no traceback)."""
    run("generate", "kept", "-o", str(tmp_path), "-q")
    (good,) = tmp_path.glob("*.png")
    truncated, text = tmp_path / "truncated.png", tmp_path / "notes.png"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    text.write_text("not a picture\n")
    r = run("pnginfo", str(truncated), str(text), str(good))
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"{truncated}: truncated or corrupt image")
    assert lines[1] == f"{text}: not an image (pnginfo reads PNG files)"
    assert "kept" in r.stdout  # the readable file is still printed


@pytest.mark.parametrize(
    "args,hint",
    [
        (("--sampler", "bogus"), "--sampler"),
        (("--width", "60"), "--width"),
        (("--width", "4"), "--width"),
        (("--steps", "0"), "--steps"),
        (("--seed", "-2"), "--seed"),
        (("--dtype", "float64"), "--dtype"),
        (("--num-images", "0"), "--num-images"),
        (("--schedule", "Bogus"), "--schedule"),
        (("--sampler", "Euler a", "--schedule", "Karras"), "--schedule"),  # Euler a has no Karras variant
        (("--sampler", "Restart", "--schedule", "Karras"), "--sampler"),  # A1111 has it, diffusers does not
    ],
)
def test_bad_options_name_the_option(fake, tmp_path, args, hint):
    r = run("generate", "x", "-o", str(tmp_path), *args)
    assert r.exit_code == 2, r.output
    assert hint in r.output
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "sampler,schedule,registry,line",
    [
        ("DPM++ 2M", "Automatic", "dpmpp_2m_karras", "Sampler: DPM++ 2M, Schedule type: Karras"),
        ("Euler a", "automatic", "Euler a Uniform", "Sampler: Euler a, Schedule type: Uniform"),
        ("DPM++ 2M SDE", "SGM Uniform", "DPM++ 2M SDE SGM Uniform", "Schedule type: SGM Uniform"),
    ],
)
def test_schedule_gives_the_a1111_sampler(fake, tmp_path, sampler, schedule, registry, line):
    r = run("generate", "x", "-o", str(tmp_path), "--steps", "2", "--sampler", sampler, "--schedule", schedule)
    assert r.exit_code == 0, r.output
    (path,) = tmp_path.glob("*.png")
    text = infotext.read_parameters(path.read_bytes())
    assert line in text and metadata.parameters_from_text(text).sampler == registry
    assert fake.calls[-1]["sampler"] == registry


def test_load_failure_is_a_message_not_a_traceback(monkeypatch, tmp_path):
    def fail(model, dtype):
        raise FileNotFoundError(f"{model}: no model_index.json")

    monkeypatch.setattr(cli.generate, "load_pipeline", fail)
    r = run("generate", "x", "--model", "/nowhere", "-o", str(tmp_path))
    assert r.exit_code == 1
    assert "could not load /nowhere" in r.output and "Traceback" not in r.output


def test_help_is_complete():
    r = run("--help")
    assert r.exit_code == 0
    for command in ("generate", "serve", "pnginfo"):
        assert command in r.stdout
    options = {
        "generate": [
            "--negative-prompt",
            "--model",
            "--sampler",
            "--steps",
            "--guidance-scale",
            "--width",
            "--height",
            "--seed",
            "--num-images",
            "--batch-size",
            "--dtype",
            "--out",
            "--grid",
            "--quiet",
        ],
        "serve": [
            "--model",
            "--host",
            "--port",
            "--dtype",
            "--max-batch",
            "--batch-sizes",
            "--batch-window-ms",
            "--max-queue",
            "--request-timeout",
            "--warm-size",
            "--steps",
            "--sampler",
            "--no-warm",
            "--only-warm-sizes",
            "--max-size",
            "--max-steps",
            "--max-images",
            "--max-body-kb",
            "--no-progress",
            "--log-level",
        ],
        "pnginfo": ["--json"],
    }
    for command, names in options.items():
        r = run(command, "--help")
        assert r.exit_code == 0
        for name in names:
            assert name in r.stdout, (command, name)
    group = typer.main.get_command(cli.app)
    for name, command in group.commands.items():
        assert command.help, name
        for param in command.params:
            assert getattr(param, "help", None), (name, param.name)  # every option and argument is explained
    assert run("--version").stdout.startswith("sdjax ")


def test_prompt_syntax_option(fake, tmp_path):
    assert run("generate", "(x:1.2)", "-o", str(tmp_path), "--steps", "1").exit_code == 0
    r = run("generate", "(x:1.2)", "-o", str(tmp_path), "--steps", "1", "--prompt-syntax", "a1111")
    assert r.exit_code == 0, r.output
    assert fake.prompt_syntaxes[-2:] == [None, "a1111"]
    r = run("generate", "x", "-o", str(tmp_path), "--prompt-syntax", "comfy")
    assert r.exit_code == 2 and "--prompt-syntax" in r.output


def test_a_bad_device_count_is_named_before_the_model_loads(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("SDJAX_DEVICES", "none")
    r = run("generate", "x", "-o", str(tmp_path), "--steps", "1")
    assert r.exit_code == 2 and "SDJAX_DEVICES='none'" in r.output, r.output
    assert fake.loads == [] and not list(tmp_path.glob("*.png"))
