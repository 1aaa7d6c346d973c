"""A Flux LoRA run with text-encoder LoRA and prior preservation over two processes (`jax.distributed`, gloo on CPU,
2 devices each) against one process with 4 devices (tests/finetune/test_multihost_training.py's pattern and launcher,
multihost_launch.py): the same global [instance; class] batch split over 4 devices either way, so the same losses
and LoRA; each process decodes only the images of its own rows of every batch (process 0 the instance half, process
1 the class half)."""

from __future__ import annotations

import numpy as np
import pytest
from flow_helpers import save_flux
from multihost_launch import one_and_two, read_loads, read_losses, worst_tensor
from PIL import Image
from safetensors.numpy import load_file

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("optax")

STEPS, BATCH, SIZE = 2, 2, 32


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
    one_and_two([("lora", common, tmp_path)])

    loaded = read_loads(tmp_path / "loads-one.txt")  # per step: 2 instance rows, then 2 class rows
    rows = 2 * BATCH
    assert len(loaded) == STEPS * rows and all(n.startswith("i") for s in range(STEPS) for n in loaded[s * rows :][:2])
    for p in (0, 1):
        want = [loaded[s * rows + r] for s in range(STEPS) for r in range(p * BATCH, (p + 1) * BATCH)]
        got = read_loads(tmp_path / f"loads-{p}.txt")
        print(f"process {p} decoded {got}")
        assert got == want, p

    ref, got = read_losses(tmp_path / "one-run"), read_losses(tmp_path / "two-run")
    print(f"losses: one process {ref}, two processes {got}")
    assert len(got) == STEPS and np.allclose(got, ref, rtol=1e-5, atol=0)
    a, b = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "two.safetensors"))
    assert any(k.startswith("text_encoder.") for k in a)
    worst = worst_tensor(a, b)  # asserts the same keys
    print(f"LoRA tensors (transformer and CLIP-L): worst relative L2 difference {worst:.2e}")
    assert worst < 1e-3, worst
