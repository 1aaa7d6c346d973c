"""`sdjax bench`: the pieces it times, the FLOPs and memory it reports, its architectures, its input checks."""

import json
import math

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from sdjax import bench
from sdjax.cli import app


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))


@pytest.fixture(scope="module")
def tiny_result():
    return bench.run(bench.BenchConfig(arch="tiny", steps=2, reps=1))


def test_every_piece_is_timed_and_counted(tiny_result):
    r = tiny_result
    assert (r["height"], r["width"], r["batch"], r["steps"]) == (16, 16, 1, 2)
    for name in ("text", "unet", "decode", "e2e"):
        p = r["pieces"][name]
        assert p["compile_s"] > 0 and 0 < p["best_s"] <= p["median_s"], (name, p)
        assert p["flops"] > 0 and p["mfu"] > 0, (name, p)
    assert r["images_per_s"] == pytest.approx(1 / r["pieces"]["e2e"]["median_s"])
    # End-to-end FLOPs count every model call of the sampler (PNDM: one more than the steps).
    pipe = bench.build_pipeline("tiny", "float32", abstract=True)[0]
    calls = pipe.scheduler.num_model_calls(2)
    assert type(pipe.scheduler).__name__ == "PNDM" and r["sampler"] == "pndm" and calls == 3
    flops = {k: r["pieces"][k]["flops"] for k in ("text", "unet", "decode", "e2e")}
    assert flops["e2e"] == flops["text"] + calls * flops["unet"] + flops["decode"]
    assert r["matmul_peak_tflops_per_s"] > 0
    mem = r["e2e_memory"]
    # The executable's arguments hold at least the text encoder's and the UNet's weights (float32; jit drops the
    # unused VAE encoder).
    params = bench.build_pipeline("tiny", "float32", abstract=True)[1]
    assert mem["argument_size_in_bytes"] >= 4 * (_count(params["unet"]) + _count(params["text_encoder"]))
    assert r["process_peak_rss_bytes"] > mem["total_bytes"]


def test_unet_flops_scale_with_batch(tiny_result):
    """XLA's count for one UNet step grows linearly with the batch (an independent check of what is counted)."""
    one = tiny_result["pieces"]["unet"]["flops"]
    two = bench.run(bench.BenchConfig(arch="tiny", steps=1, reps=1, batch=2))["pieces"]["unet"]["flops"]
    assert two == pytest.approx(2 * one, rel=0.05)


def test_memory_only_allocates_nothing_and_grows_with_resolution():
    small = bench.run(bench.BenchConfig(arch="tiny", memory_only=True, height=16, width=16, steps=2))
    large = bench.run(bench.BenchConfig(arch="tiny", memory_only=True, height=64, width=64, steps=2))
    params = bench.build_pipeline("tiny", "float32", abstract=True)[1]
    # The model weights (float32), without the sampler state (the program builds that from the config).
    weights = {k: v for k, v in params.items() if k != "scheduler"}
    assert small["weights_bytes"] == large["weights_bytes"] == 4 * _count(weights)
    assert large["e2e_memory"]["temp_size_in_bytes"] > 4 * small["e2e_memory"]["temp_size_in_bytes"] > 0
    assert "pieces" not in small


def test_random_weights_are_scaled_like_an_init():
    _, params = bench.build_pipeline("tiny", "float32", seed=3)
    conv = np.asarray(params["unet"]["conv_in"]["kernel"])  # HWIO
    assert conv.std() == pytest.approx(1 / math.sqrt(np.prod(conv.shape[:-1])), rel=0.15)
    assert np.all(np.asarray(params["unet"]["conv_norm_out"]["scale"]) == 1)
    assert np.all(np.asarray(params["unet"]["conv_in"]["bias"]) == 0)
    again = bench.build_pipeline("tiny", "float32", seed=3)[1]
    np.testing.assert_array_equal(conv, np.asarray(again["unet"]["conv_in"]["kernel"]))


@pytest.mark.slow
def test_full_size_architectures_have_the_released_parameter_counts():
    """Parameter counts of the released checkpoints (UNet, VAE, text encoders), from abstract shapes only."""
    _, sd15 = bench.build_pipeline("sd15", "float32", abstract=True)
    assert _count(sd15["unet"]) == 859_520_964
    assert _count(sd15["vae"]) == 83_653_863
    assert _count(sd15["text_encoder"]) == 123_060_480
    _, sdxl = bench.build_pipeline("sdxl", "bfloat16", abstract=True)
    assert _count(sdxl["unet"]) == 2_567_463_684
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree_util.tree_leaves(sdxl["unet"]))


def test_same_workload_in_pytorch_gives_ratios():
    pytest.importorskip("diffusers")
    r = bench.run(bench.BenchConfig(arch="tiny", steps=2, reps=1, torch=True))
    for name in bench.PIECES:
        assert r["torch"][name]["median_s"] > 0
        assert r["ratios"][name] == pytest.approx(r["pieces"][name]["median_s"] / r["torch"][name]["median_s"])


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(arch="sd3"), "arch"),
        (dict(steps=0), "steps"),
        (dict(batch=-1), "batch"),
        (dict(height=30), "height"),
        (dict(width=True), "width"),
        (dict(dtype="int8"), "dtype"),
        (dict(model="x", arch="tiny"), "model or arch"),
        (dict(memory_only=True), "memory_only"),
        (dict(attention="flash3"), "attention"),
        (dict(arch="tiny", attention="pallas"), "attention='pallas' is the TPU kernel"),
        (dict(arch="tiny", memory_only=True, torch=True), "torch"),
        (dict(arch="tiny", torch=True, torch_compile="fastest"), "torch_compile='fastest'"),
        (dict(arch="tiny", torch_compile="reduce-overhead"), "set torch too"),
    ],
)
def test_bad_settings_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        bench.BenchConfig(**kwargs).validate()


def test_cli_writes_table_and_json(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "--arch", "tiny", "--memory-only", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "temporaries" in res.output
    assert json.loads(out.read_text())["weights_bytes"] > 0


def test_cli_rejects_a_bad_height_before_building_anything():
    res = CliRunner().invoke(app, ["bench", "--arch", "tiny", "--height", "30"])
    assert res.exit_code == 2
    assert "height" in res.output
