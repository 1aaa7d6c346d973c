"""`sdjax compile --quantize int8` (`aot.compile_for(quantize=)`): the TPU program holds the denoiser's selected
kernels in 8 bits with their per-channel scales. The expected saving is counted here from the abstract UNet's
shapes and the policy's documented rule (>= 2 axes, >= 16,384 weights): bfloat16 -> int8 halves each selected
kernel and adds one float32 scale per output channel. With `--quant-compute int8`, the int8 FLOPs the roofline
takes at the int8 rate are those of the selected Dense and conv layers, counted by hand."""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compute_helpers import layer_flops_by_hand
from typer.testing import CliRunner

from sdjax import aot, cli
from sdjax.quant import compute as C
from sdjax.quant import params as P

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


@needs_libtpu
def test_compile_quant_compute_int8_counts_the_dense_and_conv_products():
    int8 = ["--quantize", "int8", "--quant-compute", "int8"]
    out = CliRunner().invoke(cli.app, [*ARGS, "--json", "--in-process", *int8])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    pipe, params = aot._abstract_pipeline(aot.architecture("tiny"), jnp.dtype(jnp.bfloat16), None)
    policy = P.QuantPolicy("int8", components=("unet",), compute="int8")
    selected = C.compute_kernels(P.quantize_tree(params["unet"], policy, "unet"), "int8")
    assert any(len(q.shape) == 4 for q, _ in selected.values()) and any(len(q.shape) == 2 for q, _ in selected.values())
    # one model call: the CFG-doubled batch of one image, 32 px -> latents of 32 / the VAE's factor, 77 text tokens
    cfg, f = pipe.unet.config, pipe.generator.models.vae_scale_factor
    args = (
        jax.ShapeDtypeStruct((2, cfg.in_channels, 32 // f, 32 // f), jnp.bfloat16),
        jax.ShapeDtypeStruct((2,), jnp.float32),
        jax.ShapeDtypeStruct((2, 77, cfg.cross_attention_dim), jnp.bfloat16),
    )
    by_hand = layer_flops_by_hand(pipe.unet, params["unet"], args, selected)
    assert len(by_hand) == len(selected)
    assert report["quant_compute"] == "int8" and report["unet_call_quant_flops"] == sum(by_hand)
    calls = report["quant_flops"] / report["unet_call_quant_flops"]
    assert calls == int(calls) >= 1 and report["quant_peak_flops"] == 2 * report["peak_flops"]  # v5e: int8 at 2x
    print(f"int8 share of a model call: {sum(by_hand) / report['unet_call_flops']:.3f}")


def test_quantize_is_checked_before_anything_compiles():
    with pytest.raises(ValueError, match="quantize='int4'"):
        aot.compile_for("v5e-1", model="tiny", quantize="int4")
    with pytest.raises(ValueError, match="quantize='int8' with weights_dtype"):
        aot.compile_for("v5e-1", model="flux-schnell", dtype="fp8", quantize="int8")
    bad = CliRunner().invoke(cli.app, [*ARGS, "--quantize", "int4"])
    assert bad.exit_code == 2 and "int4" in bad.output
