"""`ema_decay`: the EMA of the trained LoRA equals diffusers' `EMAModel` stepped by hand over the run's per-update
LoRAs (read back from the orbax checkpoints), the written file holds the EMA values, and a run stopped half-way
and resumed (the EMA restored from its checkpoint) writes the unbroken run's file exactly."""

import functools
import shutil

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from sdjax.finetune import lora as lora_lib
from sdjax.finetune import run as run_lib
from sdjax.finetune import train_lora

DECAY = 0.3  # below diffusers' warm-up (1 + s) / (10 + s) from the 4th update: both regimes in 4 updates
OPTIONS = dict(
    steps=4, rank=2, alpha=4.0, batch_size=2, accumulation=2, resolution=64, lr=1e-2, save_every=1, ema_decay=DECAY
)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema-images")
    rng = np.random.default_rng(3)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"e{i}.png")
        (root / f"e{i}.txt").write_text(f"sks, pattern {i}")
    return root


def _flat(lora: dict) -> dict[str, np.ndarray]:
    return {f"{c}/{k}/{f}": np.asarray(v[f]) for c, layers in lora.items() for k, v in layers.items() for f in v}


def _diffusers_ema(per_update: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """diffusers' EMAModel (decay DECAY, its defaults otherwise) stepped once per update with that update's LoRA."""
    import torch
    from diffusers.training_utils import EMAModel

    names = sorted(per_update[0])
    params = [torch.nn.Parameter(torch.from_numpy(per_update[0][n].copy())) for n in names]
    ema = EMAModel(params, decay=DECAY)
    for values in per_update:
        with torch.no_grad():
            for p, n in zip(params, names):
                p.copy_(torch.tensor(values[n]))
        ema.step(params)
    return {n: s.detach().numpy() for n, s in zip(names, ema.shadow_params)}


def test_ema_is_diffusers_ema_and_resumes_exactly(sd1_dir, images, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    monkeypatch.setattr(run_lib, "_checkpoints", functools.partial(run_lib._checkpoints, keep=None))  # keep all
    out = tmp_path / "ema.safetensors"
    result = train_lora(images, out, model=str(sd1_dir), **OPTIONS)
    run = result.run_dir
    saved = [ocp.StandardCheckpointer().restore((run / "checkpoints" / str(2 * u) / "default").absolute()) for u in
             range(1, 5)]  # fmt: skip
    per_update = [_flat(s["lora"]) for s in saved]
    assert not np.allclose(per_update[0]["unet/" + next(iter(saved[0]["lora"]["unet"])) + "/up"], 0)

    for u in range(4):  # the EMA after each update against diffusers' EMAModel over the updates so far
        reference = _diffusers_ema(per_update[: u + 1])
        ours = _flat(saved[u]["ema"])
        assert ours.keys() == reference.keys()
        for name in reference:
            np.testing.assert_allclose(ours[name], reference[name], rtol=2e-6, atol=1e-8, err_msg=f"{u + 1}: {name}")
    first = _flat(saved[0]["ema"])  # the first update copies the values (decay 0)
    assert all(np.array_equal(first[n], per_update[0][n]) for n in first)

    written = load_file(str(out))  # the EMA values, not the last update's
    expected = lora_lib.kohya_state_dict(saved[-1]["ema"], OPTIONS["alpha"])
    raw = lora_lib.kohya_state_dict(saved[-1]["lora"], OPTIONS["alpha"])
    assert written.keys() == expected.keys()
    for key in written:
        np.testing.assert_array_equal(written[key], expected[key], err_msg=key)
    assert any(not np.array_equal(written[k], raw[k]) for k in written if k.endswith("lora_up.weight"))

    resumed_run = tmp_path / "resumed-run"  # stopped after update 2: resuming restores the LoRA, optimiser and EMA
    shutil.copytree(run, resumed_run)
    for micro in (6, 8):
        shutil.rmtree(resumed_run / "checkpoints" / str(micro))
    resumed = train_lora(
        images, tmp_path / "resumed.safetensors", model=str(sd1_dir), run_dir=str(resumed_run), **OPTIONS
    )
    assert resumed.start_step == 2 and resumed.losses == result.losses[2:]
    again = load_file(str(tmp_path / "resumed.safetensors"))
    for key in written:
        np.testing.assert_array_equal(again[key], written[key], err_msg=key)


def test_bad_ema_decay_fails_before_loading(images, tmp_path):
    for bad in (0.0, 1.0, 1.5, -0.1, "0.9"):
        with pytest.raises(ValueError, match="ema_decay"):
            train_lora(images, tmp_path / "x.safetensors", model=str(tmp_path / "no-model"), ema_decay=bad)
