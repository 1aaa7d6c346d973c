"""`ema_decay`: the EMA of the trained LoRA equals diffusers' `EMAModel` stepped by hand over the run's per-update
LoRAs, the written file holds the EMA values, and a run stopped half-way and resumed (the EMA restored from its
checkpoint) writes the unbroken run's file exactly: `tests/finetune/test_run.py` (`test_ema_is_diffusers_ema` and
`test_cli_run_then_resume_repeats_the_losses`, on the CLI run that keeps an EMA: one whole run and its compile
serve both). Here: a bad decay is refused before anything is loaded."""

import numpy as np
import pytest
from PIL import Image

from sdjax.finetune import train_lora


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema-images")
    rng = np.random.default_rng(3)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"e{i}.png")
        (root / f"e{i}.txt").write_text(f"sks, pattern {i}")
    return root


def test_bad_ema_decay_fails_before_loading(images, tmp_path):
    for bad in (0.0, 1.0, 1.5, -0.1, "0.9"):
        with pytest.raises(ValueError, match="ema_decay"):
            train_lora(images, tmp_path / "x.safetensors", model=str(tmp_path / "no-model"), ema_decay=bad)
