"""`finetune.train_aot` (what benchmarks/train_tpu_memory.py runs): a tiny model's training step compiled for a TPU
slice with libtpu's compile-only client, with the weights replicated and with `finetune.sharding`'s FSDP layout.

The tiny SD preset's full fine-tune (float32 master copy and AdamW moments, bf16 compute) on `v5e:2x2` (4 chips),
one 16 x 16 image per chip (small: what is checked is the weights' and state's layout, not the activations); the
FSDP threshold lowered to 256 elements so the tiny weights are split. Tens of seconds a compile.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from sdjax.finetune import train_aot

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'sdjax[tpu-aot]')")


@pytest.fixture(scope="module")
def rows():
    if not HAS_LIBTPU:
        pytest.skip("libtpu is not installed (pip install 'sdjax[tpu-aot]')")
    case = train_aot.TrainCase("tiny", "full", size=16, fsdp_min_size=256)
    replicated = train_aot.compile_case(case, "v5e:2x2")
    fsdp = train_aot.compile_case(dataclasses.replace(case, fsdp=True), "v5e:2x2")
    return replicated, fsdp


@needs_libtpu
def test_the_step_compiles_for_four_v5e_chips(rows):
    for r in rows:
        assert (r["topology"], r["chip"], r["chips"], r["devices"]) == ("v5e:2x2", "TPU v5e", 4, 4)
        assert r["mesh"] == {"data": 4, "model": 1} and r["batch"] == 4
        assert r["error"] is None and r["fits"]
        m = r
        assert r["total_bytes"] == (
            m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"] + m["code_bytes"]
        )
        assert r["hbm_bytes"] == 16 * 2**30 and r["margin_bytes"] == r["hbm_bytes"] - r["total_bytes"]
        assert r["flops"] > 0


@needs_libtpu
def test_the_state_is_donated_and_what_a_chip_holds_matches_the_layout(rows):
    for r in rows:
        # the new state reuses the old state's buffers: at least its bytes on a chip are aliased (TPU layouts pad
        # small arrays, so the buffers are at least the logical bytes)
        assert r["alias_bytes"] >= r["placed_state_bytes"]
        assert r["argument_bytes"] >= r["placed_state_bytes"] + r["placed_frozen_bytes"]
    replicated, fsdp = rows
    # replicated: every chip holds the whole state (float32 master + 2 AdamW moments + the step) and frozen params
    assert replicated["placed_state_bytes"] == replicated["state_bytes"]
    assert replicated["placed_frozen_bytes"] == replicated["frozen_bytes"]
    # the master copy is 1/3 of the state (master, mu, nu: float32 each)
    assert replicated["trained_bytes"] == pytest.approx(replicated["state_bytes"] / 3, rel=1e-3)


@needs_libtpu
def test_fsdp_splits_the_master_copy_and_moments_over_the_chips(rows):
    replicated, fsdp = rows
    # nearly all of the state is in leaves over the threshold: a chip holds a little over a quarter of it
    assert fsdp["placed_state_bytes"] < 0.3 * fsdp["state_bytes"]
    assert fsdp["placed_frozen_bytes"] < replicated["placed_frozen_bytes"]  # the text encoder (the VAE stays whole)
    # and XLA's buffers per chip shrink with it: arguments and the donated state's aliases
    assert fsdp["argument_bytes"] < 0.6 * replicated["argument_bytes"]
    assert fsdp["alias_bytes"] < 0.5 * replicated["alias_bytes"]
    assert fsdp["flops"] == pytest.approx(replicated["flops"], rel=0.1)  # the same work per chip


def test_bad_cases_fail_before_compiling():
    with pytest.raises(ValueError, match="method='dreambooth'"):
        train_aot.TrainCase("tiny", "dreambooth").check()
    with pytest.raises(ValueError, match="size=100"):
        train_aot.TrainCase("tiny", size=100).check()
    with pytest.raises(ValueError, match="per_chip=0"):
        train_aot.TrainCase("tiny", per_chip=0).check()
    with pytest.raises(ValueError, match="trains LoRAs only"):
        train_aot.build(train_aot.TrainCase("flux-tiny", "full", size=32), 1)
