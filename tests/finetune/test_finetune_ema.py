"""`ema_decay`: the EMA of the trained LoRA equals diffusers' `EMAModel` stepped by hand over the run's per-update
LoRAs, the written file holds the EMA values, and a run stopped half-way and resumed (the EMA restored from its
checkpoint) writes the unbroken run's file exactly: `tests/finetune/test_run.py` (`test_ema_is_diffusers_ema` and
`test_cli_run_then_resume_repeats_the_losses`, on the CLI run that keeps an EMA: one whole run and its compile
serve both). Here, without a run: the decay schedule of diffusers' EMAModel options (warm-up, inv_gamma, power,
update_after_step, min_decay) against `EMAModel.get_decay`, the shadow they give against `EMAModel.step`, and bad
settings refused before anything is loaded."""

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from sdjax.finetune import ema as ema_lib
from sdjax.finetune import train_lora

# (sdjax's `EmaSchedule`, the same as diffusers' `EMAModel` keyword arguments)
SCHEDULES = [
    (dict(decay=0.999), dict(decay=0.999)),
    (dict(decay=0.9, update_after_step=3, min_decay=0.5), dict(decay=0.9, update_after_step=3, min_decay=0.5)),
    (dict(decay=0.9999, warmup=True), dict(decay=0.9999, use_ema_warmup=True)),
    (
        dict(decay=0.95, warmup=True, inv_gamma=2.5, power=0.75, update_after_step=2, min_decay=0.3),
        dict(decay=0.95, use_ema_warmup=True, inv_gamma=2.5, power=0.75, update_after_step=2, min_decay=0.3),
    ),
    (
        dict(decay=0.99, warmup=True, inv_gamma=0.5, power=1.0),
        dict(decay=0.99, use_ema_warmup=True, inv_gamma=0.5, power=1.0),
    ),
]


def _diffusers_ema(params, kwargs):
    from diffusers.training_utils import EMAModel

    return EMAModel(params, **kwargs)


@pytest.mark.parametrize(("ours", "theirs"), SCHEDULES)
def test_decay_is_diffusers_get_decay(ours, theirs):
    import torch

    reference = _diffusers_ema([torch.nn.Parameter(torch.zeros(1))], theirs)
    schedule = ema_lib.EmaSchedule(**ours)
    decays = [ema_lib.decay_at(step, schedule) for step in range(1, 301)]
    assert decays == [reference.get_decay(step) for step in range(1, 301)]  # the same double-precision numbers
    assert decays[0] == 0.0 and decays == sorted(decays) and max(decays) <= schedule.decay
    if schedule.min_decay:  # the floor lifts the first averaging updates (diffusers: not the copies before them)
        first = schedule.update_after_step + 1
        assert decays[first - 1] == 0.0 and decays[first] == schedule.min_decay


@pytest.mark.parametrize(("ours", "theirs"), [SCHEDULES[1], SCHEDULES[3]])
def test_shadow_is_diffusers_step(ours, theirs):
    """The shadow after each of 9 updates of two parameters (float32) against diffusers' `EMAModel.step` on torch
    parameters holding the same values: the copies of the first `update_after_step + 1` updates, the min_decay floor,
    the warm-up and the cap (SCHEDULES[3]: decays 0, 0, 0, 0.3, 0.405, 0.50, 0.58, 0.63, 0.67)."""
    import torch

    rng = np.random.default_rng(11)
    shapes = [(3, 4), (5,)]
    values = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(10)]
    params = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values[0]]
    reference = _diffusers_ema(params, theirs)
    schedule = ema_lib.EmaSchedule(**ours)
    shadow = ema_lib.init(values[0])
    for step in range(1, 10):
        with torch.no_grad():
            for p, v in zip(params, values[step]):
                p.copy_(torch.from_numpy(v))
        reference.step(params)
        shadow = ema_lib.update(shadow, values[step], step, schedule)
        assert reference.cur_decay_value == ema_lib.decay_at(step, schedule)
        for ours_leaf, theirs_leaf in zip(shadow, reference.shadow_params):
            np.testing.assert_allclose(np.asarray(ours_leaf), theirs_leaf.numpy(), rtol=0, atol=1e-6, err_msg=step)
        if step <= schedule.update_after_step + 1:  # decay 0: the shadow is the update's values
            for ours_leaf, v in zip(shadow, values[step]):
                np.testing.assert_allclose(np.asarray(ours_leaf), v, rtol=0, atol=1e-6)
    assert not np.allclose(np.asarray(shadow[0]), values[9][0], atol=1e-3)  # averaged, not the last values


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema-images")
    rng = np.random.default_rng(3)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"e{i}.png")
        (root / f"e{i}.txt").write_text(f"sks, pattern {i}")
    return root


ON = dict(ema_decay=0.9)
WARM = dict(ema_decay=0.9, ema_warmup=True)
BAD = [
    *[(dict(ema_decay=bad), r"ema_decay=.* \(--ema-decay\) must be") for bad in (0.0, 1.0, 1.5, -0.1, "0.9", True)],
    # the options need the EMA
    (dict(ema_warmup=True), r"ema_warmup=True \(--ema-warmup\) applies to the EMA: it needs ema_decay"),
    (dict(ema_update_after_step=5), r"ema_update_after_step=5 \(--ema-update-after-step\) .* needs ema_decay"),
    (dict(ema_min_decay=0.1), r"ema_min_decay=0.1 \(--ema-min-decay\) .* needs ema_decay"),
    (dict(ema_power=0.75), r"ema_power=0.75 \(--ema-power\) .* needs ema_decay"),
    # inv_gamma and power shape the warm-up only
    ({**ON, "ema_power": 0.75}, r"ema_power=0.75 \(--ema-power\) .* needs ema_warmup=True \(--ema-warmup\)"),
    ({**ON, "ema_inv_gamma": 2.0}, r"ema_inv_gamma=2.0 \(--ema-inv-gamma\) .* needs ema_warmup=True"),
    ({**ON, "ema_warmup": "yes"}, r"ema_warmup='yes' \(--ema-warmup\) must be True or False"),
    *[({**WARM, "ema_inv_gamma": v}, r"ema_inv_gamma=.* \(--ema-inv-gamma\) must be a positive") for v in (0, -1.0)],
    *[({**WARM, "ema_power": v}, r"ema_power=.* \(--ema-power\) must be a positive") for v in (0.0, float("inf"))],
    *[
        ({**ON, "ema_update_after_step": v}, r"ema_update_after_step=.* \(--ema-update-after-step\) must be an integer")
        for v in (-1, 1.5, True)
    ],
    *[
        ({**ON, "ema_min_decay": v}, r"ema_min_decay=.* \(--ema-min-decay\) must be a number in \[0, ema_decay=0.9\]")
        for v in (-0.1, 0.95, "0.1")
    ],
]


@pytest.mark.parametrize(("options", "match"), BAD)
def test_bad_ema_settings_fail_before_loading(images, tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        train_lora(images, tmp_path / "x.safetensors", model=str(tmp_path / "no-model"), **options)


def test_cli_ema_options(images, tmp_path):
    """The CLI passes the options through: a power without --ema-warmup exits 2 naming it; with everything given
    correctly only the missing model fails (after the settings passed)."""
    from sdjax.cli import app

    cli = ["train", "lora", "--data", str(images), "--out", str(tmp_path / "x.safetensors")]
    result = CliRunner().invoke(app, [*cli, "--ema-decay", "0.99", "--ema-power", "0.75"])
    assert result.exit_code == 2 and "--ema-power" in result.output and "--ema-warmup" in result.output
    result = CliRunner().invoke(app, [*cli, "--ema-update-after-step", "3"])
    assert result.exit_code == 2 and "--ema-update-after-step" in result.output and "--ema-decay" in result.output
