"""`sdjax compile --quantize int8 --quant-compute int8` (`aot.compile_for(quant_compute=)`): the denoiser's Dense
layers and convolutions multiply int8 x int8 in the TPU program, their FLOPs are counted apart and timed at the
chip's int8 rate.

The expected count is worked out by hand from the tiny architecture (configs in `sdjax.models.presets`): its UNet
has three 2-D kernels of >= 16,384 weights (the policy's default `min_size`), all outside the top (latent-size) level:
- the mid block's feed-forward, `ff/net_0/proj` (64 -> 512, GEGLU's doubled width) and `ff/net_2` (256 -> 64), on
  the mid block's tokens: a 16x16 image is 8x8 latents (the tiny VAE downsamples by 2), 4x4 after the UNet's one
  downsampler, so 16 tokens per row;
- `time_embedding/linear_2` (128 -> 128), one token per row.
One image with classifier-free guidance is 2 rows per model call. A Dense layer of `tokens` rows is
`2 * tokens * in * out` FLOPs.

Its convolutions of >= 16,384 weights (the first and last stay float) are 3x3 "same" convolutions; XLA counts the
taps that fall inside the input, not the zero padding: on an n x n map a 3x3 kernel has (3n - 2)^2 such taps, 10^2 at
4x4 and 22^2 at 8x8, each `2 * in * out` FLOPs per row. The selected ones, as in -> out channels: at 4x4
32 -> 64 once, 64 -> 64 seven times, 128 -> 64 and 96 -> 64 (the up block's resnets on concatenated skips); at 8x8
the upsampler's 64 -> 64 and the last resnets' 96 -> 32 and 64 -> 32.

The image is 16x16: the size changes these counts, not which layers multiply in int8.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from sdjax import aot, cli

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install 'sdjax[tpu-aot]')"
)
runner = CliRunner()
SETTINGS = dict(model="tiny", size=16, batch=1, steps=2, quantize="int8")

ROWS = 2  # one image, CFG
MID_TOKENS = ROWS * 4 * 4
HAND_COUNT_PER_CALL = (
    2 * MID_TOKENS * 64 * 512  # mid_block ... ff/net_0/proj
    + 2 * MID_TOKENS * 256 * 64  # mid_block ... ff/net_2
    + 2 * ROWS * 128 * 128  # time_embedding/linear_2
)
CONV_PER_CALL = (
    2 * ROWS * 10**2 * (32 * 64 + 7 * 64 * 64 + 128 * 64 + 96 * 64)  # 3x3 convs at 4x4
    + 2 * ROWS * 22**2 * 64 * 64  # the upsampler's conv, 8x8
    + 2 * ROWS * 22**2 * (96 * 32 + 64 * 32)  # 3x3 convs at 8x8
)


@pytest.fixture(scope="module")
def reports():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'sdjax[tpu-aot]')")
    weight_only = aot.compile_for("v5e-1", **SETTINGS)
    compute = aot.compile_for("v5e-1", **SETTINGS, quant_compute="int8")
    return weight_only, compute


@needs_libtpu
def test_int8_flops_are_the_hand_count_of_the_quantized_dense_layers(reports):
    weight_only, compute = reports
    assert compute.quantize == "int8" and compute.quant_compute == "int8"
    assert compute.model_calls == 3  # the tiny model's PNDM: 2 steps, 3 model calls
    assert HAND_COUNT_PER_CALL == 3_211_264 and CONV_PER_CALL == 35_864_576
    assert compute.unet_call_quant_flops == HAND_COUNT_PER_CALL + CONV_PER_CALL
    assert compute.quant_flops == 3 * (HAND_COUNT_PER_CALL + CONV_PER_CALL)
    assert weight_only.quant_compute is None and weight_only.quant_flops is None
    # XLA counts the int8 dots among the program's FLOPs: they are part of the total, not beside it
    assert compute.unet_call_flops > compute.unet_call_quant_flops


@needs_libtpu
def test_roofline_times_the_int8_products_at_the_int8_rate(reports):
    weight_only, compute = reports
    # v5e datasheet: 197 TFLOP/s bf16, 394 TOP/s int8, 819 GB/s; one chip, one device
    assert (compute.peak_flops, compute.quant_peak_flops, compute.hbm_bytes_per_s) == (197e12, 394e12, 819e9)
    q = compute.quant_flops
    want = (compute.flops - q) / 197e12 + q / 394e12
    assert compute.compute_s == pytest.approx(want, rel=1e-12)
    assert compute.roofline_s == max(want, compute.bytes_accessed / 819e9)
    assert weight_only.compute_s == weight_only.flops / 197e12
    # the same model, the same program but for the Dense products (a few more FLOPs for quantizing their inputs):
    # half the time for the int8 share makes the compute bound lower
    assert abs(compute.flops - weight_only.flops) < q / 2
    assert compute.compute_s < weight_only.compute_s
    # (the tiny model is bandwidth-bound: its roofline is the bytes' time either way)
    d = compute.to_dict()
    assert d["quant_compute"] == "int8" and d["quantize"] == "int8" and d["compute_s"] == compute.compute_s


@needs_libtpu
def test_cli_passes_quant_compute_and_prints_the_int8_rows(reports, monkeypatch):
    _, compute = reports
    seen = {}

    def fake(target, **kwargs):
        seen.update(kwargs)
        return compute

    monkeypatch.setattr(aot, "compile_for", fake)
    args = ["compile", "--target", "v5e-1", "-m", "tiny", "--in-process", "--quantize", "int8"]
    table = runner.invoke(cli.app, [*args, "--quant-compute", "int8"])
    assert table.exit_code == 0, table.output
    assert seen["quantize"] == "int8" and seen["quant_compute"] == "int8"
    assert "of which int8 x int8 products" in table.stdout and "compute time at peak rates" in table.stdout
    assert "int8 products" in table.stdout
    as_json = runner.invoke(cli.app, [*args, "--quant-compute", "int8", "--json"])
    out = json.loads(as_json.stdout)
    assert out["quant_flops"] == 3 * (HAND_COUNT_PER_CALL + CONV_PER_CALL) and out["quantize"] == "int8"


def test_chip_table_int8_rates():
    assert {k: (c.bf16_flops, c.int8_ops) for k, c in aot.CHIPS.items()} == {
        "v4": (275e12, 275e12),
        "v5e": (197e12, 394e12),
        "v5p": (459e12, 918e12),
        "v6e": (918e12, 1836e12),
    }


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(quant_compute="int8"), r"quant_compute='int8' needs quantize='int8'.*quantize is None"),
        (dict(quantize="fp8", quant_compute="int8"), r"quant_compute='int8' needs quantize='int8'.*'fp8'"),
        (dict(quantize="int8", quant_compute="int4"), r"quant_compute='int4': expected 'int8', 'fp8'"),
    ],
)
def test_bad_combinations_are_refused_before_any_compile(kwargs, match, monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("reached the topology / the compiler")

    monkeypatch.setattr(aot, "topology_devices", no_compile)
    monkeypatch.setattr(aot, "_abstract_pipeline", no_compile)
    with pytest.raises(ValueError, match=match):
        aot.compile_for("v5e-1", model="tiny", **kwargs)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--quant-compute", "int8"], "give --quantize int8 (no --quantize was given)"),
        (["--quantize", "fp8", "--quant-compute", "int8"], "give --quantize int8 (--quantize fp8 was given)"),
    ],
)
def test_cli_refuses_quant_compute_without_its_quantize(flags, said, monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled")

    monkeypatch.setattr(aot, "compile_for", no_compile)
    r = runner.invoke(cli.app, ["compile", "--target", "v5e-1", "-m", "tiny", "--in-process", *flags])
    assert r.exit_code == 2, r.output
    assert "--quant-compute" in r.output and said in " ".join(r.output.split())
