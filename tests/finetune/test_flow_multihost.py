"""A Flux LoRA run with text-encoder LoRA and prior preservation over two processes (`jax.distributed`, gloo on CPU,
2 devices each) against one process with 4 devices (tests/finetune/test_multihost_training.py's pattern): the same
global [instance; class] batch split over 4 devices either way, so the same losses and LoRA; each process decodes
only the images of its own rows of every batch (process 0 the instance half, process 1 the class half)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from flow_helpers import save_flux
from PIL import Image
from safetensors.numpy import load_file

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("optax")

STEPS, BATCH, SIZE = 2, 2, 32
# `sdjax train lora` with every decode of a training example (`data.crop_example`) written to $SDJAX_TEST_LOADS
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


def _wait(procs: list[subprocess.Popen]) -> None:
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            assert p.returncode == 0, out[-3000:]
    finally:  # a failed process leaves no other waiting at the coordinator
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loads(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    import t5_reference

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    return save_flux(tmp_path_factory, "dev", tok)[1]


def _folder(root, prefix: str, colour) -> str:
    root.mkdir(parents=True)
    rng = np.random.default_rng(len(prefix))
    for i in range(3):
        img = np.zeros((SIZE, SIZE, 3), np.uint8) + np.asarray(colour, np.uint8)
        img[8:24, 8:24] = rng.integers(0, 255, (16, 16, 3), np.uint8)
        Image.fromarray(img).save(root / f"{prefix}{i}.png")
    return str(root)


def test_two_processes_train_a_flow_dreambooth_lora_as_one(flux_dev, tmp_path):
    data, classes = _folder(tmp_path / "inst", "i", (200, 40, 30)), _folder(tmp_path / "cls", "c", (40, 200, 30))
    common = ["--model", str(flux_dev), "--data", data, "--steps", str(STEPS), "--rank", "2", "--lr", "1e-2"]
    common += ["--batch-size", str(BATCH), "--resolution", str(SIZE), "--no-bucketing", "--max-sequence-length", "16"]
    common += ["--train-text-encoder", "--instance-prompt", "a sks square", "--class-prompt", "a square"]
    common += ["--class-data", classes, "--num-class-images", "3", "--seed", "3"]
    _wait([_train(4, [*common, "--out", str(tmp_path / "one.safetensors")], tmp_path / "loads-one.txt")])
    port = str(_free_port())
    hosts = ("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2")
    out2 = ["--out", str(tmp_path / "two.safetensors"), *hosts]
    two = [_train(2, [*common, *out2, "--process-id", str(p)], tmp_path / f"loads-{p}.txt") for p in range(2)]
    _wait(two)

    loaded = _loads(tmp_path / "loads-one.txt")  # per step: 2 instance rows, then 2 class rows
    rows = 2 * BATCH
    assert len(loaded) == STEPS * rows and all(n.startswith("i") for s in range(STEPS) for n in loaded[s * rows :][:2])
    for p in (0, 1):
        want = [loaded[s * rows + r] for s in range(STEPS) for r in range(p * BATCH, (p + 1) * BATCH)]
        got = _loads(tmp_path / f"loads-{p}.txt")
        print(f"process {p} decoded {got}")
        assert got == want, p

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "loss.jsonl").read_text().splitlines()]

    ref, got = losses(tmp_path / "one-run"), losses(tmp_path / "two-run")
    print(f"losses: one process {ref}, two processes {got}")
    assert len(got) == STEPS and np.allclose(got, ref, rtol=1e-5, atol=0)
    a, b = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "two.safetensors"))
    assert a.keys() == b.keys() and any(k.startswith("text_encoder.") for k in a)
    worst = max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(a[k]), 1e-12)) for k in a)
    print(f"LoRA tensors (transformer and CLIP-L): worst relative L2 difference {worst:.2e}")
    assert worst < 1e-3, worst
