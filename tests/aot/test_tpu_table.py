"""benchmarks/tpu_aot_table.py's runner: a row whose compile kills its child process (libtpu's compiler has died
with SIGSEGV on some shapes) is recorded as a crash row, shown in the table and not compiled again; a row that
compiled is not compiled again either. The child process is replaced (no compile runs here)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import bench_scripts
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tpu_aot_table.py"


@pytest.fixture
def table():
    return bench_scripts.load("tpu_aot_table")


def test_a_crashed_compile_is_a_row_and_is_not_retried(table, tmp_path, monkeypatch):
    out = tmp_path / "rows.jsonl"
    ran = []

    def fake_run(cmd, **kwargs):
        spec = json.loads(cmd[-1])
        ran.append((spec["model"], spec["target"], spec["batch"]))
        if spec["batch"] == 8:  # the crashing shape
            return subprocess.CompletedProcess(cmd, -signal.SIGSEGV, "", "Fatal Python error: Segmentation fault")
        if spec["target"] == "v5e-4":  # stopped from outside (or the OOM killer): not a crash, tried again
            return subprocess.CompletedProcess(cmd, -signal.SIGTERM, "", "")
        row = {**spec, "height": 512, "chips": 1, "argument_bytes": 2**30, "temp_bytes": 2**30, "code_bytes": 0,
               "total_bytes": 2 * 2**30, "hbm_bytes": 16 * 2**30, "fits": True, "compile_s": 1.0, "flops": None,
               "roofline_s": None, "roofline_images_per_s": None}  # fmt: skip
        return subprocess.CompletedProcess(cmd, 0, json.dumps(row) + "\n", "")

    monkeypatch.setattr(table.subprocess, "run", fake_run)
    argv = [str(SCRIPT), "--models", "sd15", "--per-chip", "1,8", "--targets", "v5e-1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    table.main()
    assert ran == [("sd15", "v5e-1", 1), ("sd15", "v5e-1", 8)]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("crashed") for r in rows] == [None, "SIGSEGV"]
    table.main()  # both rows are in --out: nothing runs again
    assert len(ran) == 2
    monkeypatch.setattr(sys, "argv", [*argv[:-3], "v5e-4", "--per-chip", "1", "--out", str(out)])
    table.main()  # a SIGTERM is not recorded: the row runs again the next time
    table.main()
    assert ran[2:] == [("sd15", "v5e-4", 4)] * 2 and len(out.read_text().splitlines()) == 2
    lines = table.markdown(rows).splitlines()
    crash = [line for line in lines if "compiler crashed (SIGSEGV)" in line]
    assert len(crash) == 1 and crash[0].startswith("| sd15 | 512 | v5e-1 (1) | 8 (8) | whole |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)  # every row has every column


def test_the_variant_column_names_slicing_attention_and_controlnets(table):
    assert table.variant({}) == "whole"
    assert table.variant({"vae_slicing": True, "attention": "pallas", "controlnets": 1}) == (
        "sliced, pallas attention, + 1 ControlNet"
    )
    # rows written before the attention and ControlNet options keep their keys
    old = {"model": "sd15", "target": "v5e-1", "batch": 1, "steps": 30, "dtype": "bfloat16"}
    assert table.key(old) == table.key({**old, "attention": "auto", "controlnets": 0, "vae_slicing": False})


def test_fp8_and_fsdp_rows_are_rows_of_their_own(table):
    """`--dtype fp8` (a report's bfloat16 compute + float8 weights) and `--fsdp` rows: their own keys and variant
    names; a finished fp8 row matches the spec that asked for it, so it is not compiled again."""
    spec = {"model": "flux-dev", "target": "v6e-1", "batch": 1, "steps": 28, "dtype": "fp8", "fsdp": False}
    row = {**spec, "dtype": "bfloat16", "weights_dtype": "float8_e4m3fn"}
    assert table.key(spec) == table.key(row)
    assert table.key(row) != table.key({**row, "weights_dtype": None})
    assert table.key({**row, "fsdp": True}) != table.key(row)
    assert table.variant(row) == "whole, fp8 weights"
    assert table.variant({"fsdp": True}) == "whole, FSDP"
    assert table.SIZES["flux-dev"] == table.SIZES["sd35-large"] == 1024


def test_quantized_rows_are_rows_of_their_own(table):
    """`--quantize` / `--quant-compute` rows: keys of their own (a weight-only int8 row is not the int8-compute one,
    nor the unquantized one), named in the variant column; rows written before the options keep their keys, and a
    `sdjax compile --json` report (which carries both fields) matches the spec that asks for it."""
    old = {"model": "flux-schnell", "target": "v5e-4", "batch": 4, "steps": 4, "dtype": "bfloat16", "fsdp": True}
    weights = {**old, "quantize": "int8", "quant_compute": None}
    compute = {**weights, "quant_compute": "int8"}
    assert table.key(old) == table.key({**old, "quantize": None, "quant_compute": None})
    assert len({table.key(old), table.key(weights), table.key(compute)}) == 3
    assert table.variant(weights) == "whole, FSDP, int8 weights"
    assert table.variant(compute) == "whole, FSDP, int8 weights, int8 products"
    # `--static-scales`: the spec asks with `static_scales`, the report answers with its `calibration`
    static_spec = {**compute, "static_scales": True}
    static_row = {**compute, "calibration": "placeholder"}
    assert table.key(static_spec) == table.key(static_row) != table.key(compute)
    assert table.key({**compute, "static_scales": False, "calibration": None}) == table.key(compute)
    assert table.variant(static_row) == "whole, FSDP, int8 weights, int8 products, static scales"
