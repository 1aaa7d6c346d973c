"""benchmarks/quant_gpu.py's `-static` variants (what the GPU session times against per-call input scales): the
ranges recorded by one call on the benchmark's inputs cover every 8-bit product of the UNet, and with them the
program computes what the per-call scales compute on those same inputs (the same `max|x|` per layer, now a
constant), so the output's error against bf16 is the same to float rounding. Run on the tiny UNet on CPU: one run
of the benchmark for both schemes, beside one bf16 row."""

from __future__ import annotations

import bench_scripts
import pytest

from sdjax.quant import compute as C

SCHEMES = ("int8", "fp8")


@pytest.fixture(scope="module")
def bench_run():
    """`bench.run` on the tiny UNet (1 image, 1 step, no timed rep: the accuracy and one UNet call's program per
    variant, not the timed loop's, which nothing here reads) -> (its rows by variant, the `(module, params)` its
    `_variant` built for each variant, on the run's own inputs: the static variants' ranges recorded there)."""
    bench = bench_scripts.load("quant_gpu")  # a fresh module of the script: the wrapper below is this run's only
    built = {}
    variant = bench._variant

    def recording(unet, params, name, inputs):
        built[name] = variant(unet, params, name, inputs)
        return built[name]

    bench._variant = recording
    names = ["bf16", *(f"{s}-compute{static}" for s in SCHEMES for static in ("", "-static"))]
    rows = bench.run("tiny", [1], 1, 0, names)
    assert [r["variant"] for r in rows] == names
    return {r["variant"]: r for r in rows}, built


@pytest.mark.parametrize("scheme", SCHEMES)
def test_static_ranges_cover_every_product_and_reproduce_the_per_call_scales(bench_run, scheme):
    rows, built = bench_run
    module, p = built[f"{scheme}-compute-static"]
    layers = {path.removeprefix("unet/").removesuffix("/kernel") for path in C.compute_kernels(p, scheme, "unet")}
    assert len(layers) >= 10 and set(module.amax) == layers  # every Dense layer and conv the policy computes in 8 bits
    assert all(v > 0 for v in module.amax.values())
    dynamic, static = rows[f"{scheme}-compute"]["rel_err_vs_bf16"], rows[f"{scheme}-compute-static"]["rel_err_vs_bf16"]
    assert 0 < dynamic < 0.1 and static == pytest.approx(dynamic, rel=1e-3)
