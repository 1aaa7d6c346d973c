"""benchmarks/quant_gpu.py's `-static` variants (what the GPU session times against per-call input scales): the
ranges recorded by one call on the benchmark's inputs cover every 8-bit product of the UNet, and with them the
program computes what the per-call scales compute on those same inputs (the same `max|x|` per layer, now a
constant), so the output's error against bf16 is the same to float rounding. Run on the tiny UNet on CPU."""

from __future__ import annotations

import bench_scripts
import jax.numpy as jnp
import pytest

from sdjax.quant import compute as C


@pytest.fixture(scope="module")
def bench():
    return bench_scripts.load("quant_gpu")


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_static_ranges_cover_every_product_and_reproduce_the_per_call_scales(bench, scheme):
    a, unet, params = bench._unet("tiny")
    x, ctx, kw = bench._inputs(a, 1)
    inputs = (x, jnp.float32(500.0), ctx, kw)
    module, p = bench._variant(unet, params, f"{scheme}-compute-static", inputs)
    layers = {path.removeprefix("unet/").removesuffix("/kernel") for path in C.compute_kernels(p, scheme, "unet")}
    assert len(layers) >= 10 and set(module.amax) == layers  # every Dense layer and conv the policy computes in 8 bits
    assert all(v > 0 for v in module.amax.values())
    rows = bench.run("tiny", [1], 1, 1, ["bf16", f"{scheme}-compute", f"{scheme}-compute-static"])
    dynamic, static = rows[1]["rel_err_vs_bf16"], rows[2]["rel_err_vs_bf16"]
    assert 0 < dynamic < 0.1 and static == pytest.approx(dynamic, rel=1e-3)
