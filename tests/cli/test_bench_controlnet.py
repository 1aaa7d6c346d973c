"""`sdjax bench controlnet`: the ControlNets' config as diffusers derives it from the UNet, the cost each net adds
to a step (XLA's FLOP counts), the PyTorch side's ratios, and its input checks."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sdjax.bench import controlnet as bench_controlnet
from sdjax.cli import app
from sdjax.models.presets import ARCHITECTURES


@pytest.mark.parametrize("arch", ["sd15", "sdxl", "tiny"])
def test_controlnet_config_is_diffusers_from_unet(arch):
    """Our net config, read by diffusers, equals the config `ControlNetModel.from_unet` derives from the UNet
    (models built on torch's meta device: no weights allocated)."""
    diffusers = pytest.importorskip("diffusers")
    import torch

    ours = bench_controlnet.controlnet_config(ARCHITECTURES[arch].unet)
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel.from_config(ARCHITECTURES[arch].unet)
        expected = diffusers.ControlNetModel.from_unet(unet, load_weights_from_unet=False).config
        got = diffusers.ControlNetModel.from_config(ours).config
    assert _plain(got) == _plain(expected)


def _plain(config) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config).items() if not k.startswith("_")}


def test_each_net_adds_one_nets_cost_and_torch_gives_ratios():
    pytest.importorskip("diffusers")
    cfg = bench_controlnet.ControlNetBenchConfig(arch="tiny", controlnets=(0, 1, 2), reps=1, torch=True)
    r = bench_controlnet.run(cfg)
    flops = [r["steps"][f"controlnets={k}"]["flops"] for k in (0, 1, 2)]
    one_net = flops[1] - flops[0]
    assert one_net > 0.2 * flops[0]  # a net is the UNet's encoder half: a real share of the step
    assert flops[2] - flops[0] == pytest.approx(2 * one_net, rel=1e-3)
    for name, p in r["steps"].items():
        assert r["torch"][name]["median_s"] > 0 and p["median_s"] > 0
        assert r["ratios"][name] == pytest.approx(p["median_s"] / r["torch"][name]["median_s"])
    cols, rows = bench_controlnet.table_rows(r)
    assert [row[0] for row in rows] == ["0", "1", "2"] and cols[-1] == "sdjax / torch"


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(arch="sd3"), "arch"),
        (dict(controlnets=()), "controlnets"),
        (dict(controlnets=(0, 9)), "controlnets"),
        (dict(controlnets=(1, 1)), "twice"),
        (dict(height=30), "height"),
        (dict(dtype="int8"), "dtype"),
        (dict(reps=0), "reps"),
    ],
)
def test_bad_settings_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        bench_controlnet.ControlNetBenchConfig(**kwargs).validate()


def test_cli(tmp_path):
    res = CliRunner().invoke(app, ["bench", "controlnet", "--controlnets", "0,x"])
    assert res.exit_code == 2 and "--controlnets" in res.output
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "controlnet", "--arch", "tiny", "--controlnets", "1", "--reps", "1",
                                   "--json", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "sdjax bench controlnet" in res.output
    assert json.loads(out.read_text())["steps"]["controlnets=1"]["median_s"] > 0
