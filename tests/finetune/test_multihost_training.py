"""`sdjax train lora` over two processes (`jax.distributed`, gloo collectives on CPU, 2 devices each) against one
process with 4 devices: the same global batch split over 4 devices either way, so the same losses and the same
LoRA; each process opens only the images of its own rows of every batch; only process 0 writes the outputs. Plus
what several processes refuse."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from sdjax.finetune import data as data_lib
from sdjax.finetune import distributed

STEPS, BATCH = 2, 4
ARGS = [
    "--steps",
    str(STEPS),
    "--rank",
    "2",
    "--batch-size",
    str(BATCH),
    "--resolution",
    "64",
    "--lr",
    "1e-3",
    "--seed",
    "3",
]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    rng = np.random.default_rng(1)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"s{i}.png")
        (root / f"s{i}.txt").write_text(f"a shape, colour {i}")
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `sdjax train lora` with every decode of a training example (`data.crop_example`: the sampler's, a latent cache's)
# written to the file $SDJAX_TEST_LOADS, one image name a line, in call order
_COUNTED_CLI = """
import os, sys
from sdjax.finetune import data
crop = data.crop_example
def counted(item, *args):
    with open(os.environ["SDJAX_TEST_LOADS"], "a") as f:
        f.write(item.path.name + "\\n")
    return crop(item, *args)
data.crop_example = counted
from sdjax.cli import main
sys.exit(main())
"""


def _train(devices: int, argv: list[str], loads) -> subprocess.Popen:
    flags = f"--xla_force_host_platform_device_count={devices} {os.environ.get('SDJAX_TEST_COMPILE_FLAGS', '')}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu", "SDJAX_TEST_LOADS": str(loads)}
    cmd = [sys.executable, "-c", _COUNTED_CLI, "train", "lora", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
        outs.append(out)
    return outs


def _losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "loss.jsonl").read_text().splitlines()]


def _loads(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("cached", [False, True], ids=["images", "cache-latents"])
def test_two_processes_train_as_one_process_with_their_devices(sd1_dir, images, tmp_path, cached):
    common = ["--model", str(sd1_dir), "--data", str(images), *ARGS, *(["--cache-latents"] if cached else [])]
    one = _train(4, [*common, "--out", str(tmp_path / "one.safetensors")], tmp_path / "loads-one.txt")
    _wait([one])

    port = str(_free_port())
    two = [
        _train(
            2,
            [
                *common,
                "--out",
                str(tmp_path / "two.safetensors"),
                *("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)),
            ],
            tmp_path / f"loads-{i}.txt",
        )
        for i in range(2)
    ]
    _wait(two)

    # what each process decoded: with images, rows [2p, 2p + 2) of each of the one-process run's batches (process
    # p's two devices hold the batch's p-th half); with a latent cache, every image once, while the cache is built
    loaded = _loads(tmp_path / "loads-one.txt")
    names = sorted(p.name for p in images.glob("*.png"))
    if cached:
        assert loaded == names
        expected = [names, names]
    else:
        assert len(loaded) == STEPS * BATCH and sorted(loaded[:BATCH]) == names
        half = BATCH // 2
        expected = [
            [loaded[s * BATCH + r] for s in range(STEPS) for r in range(p * half, p * half + half)] for p in (0, 1)
        ]
    for p in (0, 1):
        print(f"process {p} decoded {_loads(tmp_path / f'loads-{p}.txt')}")
        assert _loads(tmp_path / f"loads-{p}.txt") == expected[p], p

    ref, got = _losses(tmp_path / "one-run"), _losses(tmp_path / "two-run")
    print(f"losses: one process {ref}, two processes {got}")
    assert len(got) == 2 and np.allclose(got, ref, rtol=1e-5, atol=0)
    a, b = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "two.safetensors"))
    assert a.keys() == b.keys() and any(np.abs(v).max() > 0 for k, v in b.items() if "lora_up" in k)
    # Adam divides each gradient by its own running size, so an element whose gradient is only summation noise
    # (the two runs add the devices' gradients in another order) can move by up to lr either way: compare whole
    # tensors (relative L2), not elements
    worst = max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(a[k]), 1e-12)) for k in a)
    print(f"LoRA tensors: worst relative L2 difference {worst:.2e}")
    assert worst < 1e-3, worst
    # one writer: the loss log has each update once, and the checkpoints are one set (orbax, written together)
    assert sorted(p.name for p in (tmp_path / "two-run" / "checkpoints").iterdir()) == ["2"]


def test_a_process_rows_are_those_rows_of_the_whole_batch(images):
    """`Sampler.load(step, rows)` (what one process of several opens) equals those rows of the whole batch: the
    same images, crops, flips and captions."""
    cfg = data_lib.DataConfig(resolution=64, flip=True, caption_dropout=0.3, shuffle_tags=True)
    sampler = data_lib.Sampler(data_lib.scan(images, cfg), cfg, 4, seed=3)
    for step in range(4):
        whole = sampler.load(step)
        for rows in ([0, 1], [2, 3], [3]):
            part = sampler.load(step, rows)
            np.testing.assert_array_equal(part["pixels"], whole["pixels"][rows])
            np.testing.assert_array_equal(part["time_ids"], whole["time_ids"][rows])
            assert part["captions"] == [whole["captions"][r] for r in rows]
            assert part["paths"] == [whole["paths"][r] for r in rows]
            assert sampler.plan(step, rows) == [sampler.plan(step)[r] for r in rows]
    with pytest.raises(IndexError, match=r"rows \[4\] of a micro-batch of 4 examples"):
        sampler.load(0, [1, 4])


def test_several_processes_refuse_validation_images(monkeypatch):
    monkeypatch.setattr(distributed, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="validation images are not supported .* over 2 processes"):
        distributed.check_supported(validation=True)
    distributed.check_supported(validation=False)


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(coordinator="127.0.0.1:1"), "go together"),
        (dict(coordinator="127.0.0.1:1", num_processes=2, process_id=2), r"process id 2 must lie in \[0, 2\)"),
    ],
)
def test_bad_host_settings_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        distributed.initialize(**args)
