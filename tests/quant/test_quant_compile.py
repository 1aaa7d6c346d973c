"""`sdjax compile --quantize int8` (`aot.compile_for(quantize=)`): the TPU program holds the denoiser's selected
kernels in 8 bits with their per-channel scales. The expected saving is counted here from the abstract UNet's
shapes and the policy's documented rule (>= 2 axes, >= 16,384 weights): bfloat16 -> int8 halves each selected
kernel and adds one float32 scale per output channel."""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from sdjax import aot, cli

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install 'sdjax[tpu-aot]')"
)
ARGS = ["compile", "--target", "v5e-1", "-m", "tiny", "--size", "32", "--batch", "1", "--steps", "1"]


@needs_libtpu
def test_compile_quantize_int8_holds_the_selected_kernels_in_8_bits():
    base = CliRunner().invoke(cli.app, [*ARGS, "--no-unet-cost", "--json", "--in-process"])
    q = CliRunner().invoke(cli.app, [*ARGS, "--no-unet-cost", "--json", "--in-process", "--quantize", "int8"])
    assert base.exit_code == 0 and q.exit_code == 0, base.output + q.output
    base, q = json.loads(base.stdout), json.loads(q.stdout)
    assert base["quantize"] is None and q["quantize"] == "int8" and q["fits"]
    _, params = aot._abstract_pipeline(aot.architecture("tiny"), jnp.dtype(jnp.bfloat16), None)
    selected = [
        leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(params["unet"])
        if jax.tree_util.keystr(path).endswith("['kernel']") and len(leaf.shape) >= 2 and np.prod(leaf.shape) >= 16384
    ]
    assert selected  # the tiny UNet has kernels above the policy's size
    saved = sum(int(np.prod(s)) * (2 - 1) - 4 * s[-1] for s in selected)
    assert base["weights_bytes"] - q["weights_bytes"] == saved
    # one v5e chip holds every argument: the program's inputs shrink by at least as much (the TPU's tiled layouts
    # pad small axes, more so for the bfloat16 kernels than the int8 ones)
    assert base["argument_bytes"] - q["argument_bytes"] >= saved


def test_quantize_is_checked_before_anything_compiles():
    with pytest.raises(ValueError, match="quantize='int4'"):
        aot.compile_for("v5e-1", model="tiny", quantize="int4")
    with pytest.raises(ValueError, match="quantize='int8' with weights_dtype"):
        aot.compile_for("v5e-1", model="flux-schnell", dtype="fp8", quantize="int8")
    bad = CliRunner().invoke(cli.app, [*ARGS, "--quantize", "int4"])
    assert bad.exit_code == 2 and "int4" in bad.output
