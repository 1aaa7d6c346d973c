"""`sdjax bench samplers`: distances to a many-step reference shrink as the steps grow (the samplers converge to
the one ODE), faster for a second-order sampler; the table, JSON and plot; bad input named."""

import json

import pytest
from typer.testing import CliRunner

from sdjax.bench import samplers as bench_samplers
from sdjax.cli import app


@pytest.fixture(scope="module")
def cli_run(sd1_dir, tmp_path_factory):
    """One `sdjax bench samplers ... --json` run: (its exit code, stdout, the JSON it wrote)."""
    out = tmp_path_factory.mktemp("bench-samplers") / "r.json"
    args = ["bench", "samplers", "-m", str(sd1_dir), "--samplers", "ddim,dpmpp_2m", "--steps", "4,12"]
    r = CliRunner().invoke(app, [*args, "--reference-steps", "24", "--json", str(out)])
    return r.exit_code, r.output, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def result(cli_run):
    return cli_run[2]


def test_errors_shrink_with_steps_and_order(result):
    err = {(r["sampler"], r["steps"]): r["error"] for r in result["rows"]}
    for name in ("ddim", "dpmpp_2m"):  # ddim converges only with x0 clipping off
        assert 0 < err[name, 12] < err[name, 4], (name, err)
    # first order: about 4x less error for 4x the steps at best; second order: clearly more than first order's gain
    assert err["dpmpp_2m", 4] / err["dpmpp_2m", 12] > err["ddim", 4] / err["ddim", 12]
    nfe = {(r["sampler"], r["steps"]): r["nfe"] for r in result["rows"]}
    assert nfe["ddim", 12] == 12 and nfe["dpmpp_2m", 4] == 4
    assert result["seconds_per_model_call"] > 0 and all(v > 0 for v in result["sampler_seconds_per_call"].values())


def test_table_and_plot(result, tmp_path):
    cols, rows = bench_samplers.table(result)
    assert cols == ["sampler", "4 steps", "12 steps", "own cost / call"] and [r[0] for r in rows] == [
        "ddim",
        "dpmpp_2m",
    ]
    assert bench_samplers.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args,word",
    [
        (["--samplers", "bogus"], "bogus"),
        (["--steps", "4,64", "--reference-steps", "100"], "reference_steps"),
        (["--steps", "0"], "steps"),
    ],
)
def test_bad_input_is_named(args, word, tmp_path):
    r = CliRunner().invoke(app, ["bench", "samplers", *args])
    assert r.exit_code == 2 and word in r.output, r.output


def test_cli_writes_json(cli_run):
    code, output, written = cli_run
    assert code == 0, output
    assert [r["sampler"] for r in written["rows"]][:1] == ["ddim"] and "dpmpp_2m" in output
    assert written["reference"] == {"sampler": "heun", "steps": 24}
