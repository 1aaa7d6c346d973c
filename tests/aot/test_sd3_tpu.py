"""SD 3 / 3.5 in `sdjax.aot` / `sdjax compile`: the released configs (shapes only), a diffusers SD 3 folder's configs,
float8 kernels, and a compile of the tiny SD 3 for a v5e-4 with FSDP.

No 8e9-parameter compile here: those are docs/benchmarks.md's table ("SD 3.5 on TPU"), minutes each.
"""

from __future__ import annotations

import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest

from sdjax import aot
from sdjax.families.sd3 import presets
from sdjax.parallel import sharding

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'sdjax[tpu-aot]')")
GB = 1e9


def _sizes(kind):
    _, params = presets.build_sd3_pipeline(kind, jnp.bfloat16)
    return {k: aot._nbytes(v) for k, v in params.items() if k != "scheduler"}


def test_released_configs_have_the_released_sizes():
    large, medium, sd3 = (_sizes(k) for k in ("sd35-large", "sd35-medium", "sd3-medium"))
    # bf16 parameters: SD 3.5 large's MMDiT 8.15e9, medium's 2.47e9 (MMDiT-X, its 384^2 position table
    # included), SD 3 medium's 2.08e9; CLIP-L 0.12e9, CLIP-G 0.69e9, T5 XXL's encoder 4.76e9, the VAE 0.08e9
    assert large["transformer"] == pytest.approx(16.29 * GB, rel=1e-3)
    assert medium["transformer"] == pytest.approx(4.94 * GB, rel=1e-3)
    assert sd3["transformer"] == pytest.approx(4.17 * GB, rel=1e-3)
    assert large["text_encoder"] == pytest.approx(0.247 * GB, rel=1e-2)
    assert large["text_encoder_2"] == pytest.approx(1.389 * GB, rel=1e-2)
    assert large["text_encoder_3"] == pytest.approx(9.52 * GB, rel=1e-3)
    assert large["vae"] == pytest.approx(0.168 * GB, rel=1e-2)
    pipe, params = presets.build_sd3_pipeline("sd35-medium", jnp.bfloat16)
    assert (pipe.default_steps, pipe.max_sequence_length, pipe.default_size) == (28, 256, (1024, 1024))
    assert params["transformer"]["transformer_blocks_12"]["attn2"]["to_q"]["kernel"].shape == (1536, 1536)
    assert "attn2" not in params["transformer"]["transformer_blocks_13"]
    assert params["transformer"]["pos_embed"]["pos_embed"].shape == (1, 384 * 384, 1536)
    assert pipe.tokenizer_3(["a cat"], 256).shape == (1, 256)
    with pytest.raises(ValueError, match="sd35-large"):
        presets.sd3_architecture("sd4")


def test_float8_weights_are_the_transformer_and_t5_kernels():
    _, params = presets.build_sd3_pipeline("sd3-tiny", jnp.bfloat16, weights_dtype="float8_e4m3fn")
    f8 = jnp.dtype(jnp.float8_e4m3fn)
    block = params["transformer"]["transformer_blocks_0"]
    assert block["attn"]["to_q"]["kernel"].dtype == f8 and block["attn"]["to_q"]["bias"].dtype == jnp.bfloat16
    assert block["attn2"]["norm_q"]["scale"].dtype == jnp.bfloat16
    assert params["transformer"]["pos_embed"]["proj"]["kernel"].dtype == jnp.bfloat16  # a convolution
    assert params["text_encoder_3"]["encoder"]["block_0"]["layer_1"]["DenseReluDense"]["wo"]["kernel"].dtype == f8
    for name in ("text_encoder", "text_encoder_2", "vae"):
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params[name])), name


def test_a_diffusers_sd3_folder_gives_the_presets_shapes(tmp_path):
    a = presets.SD3_ARCHITECTURES["sd3-tiny"]
    index = {
        "_class_name": "StableDiffusion3Pipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
    }
    for name, config, file in (
        ("transformer", a.transformer, "config.json"),
        ("text_encoder", a.text_encoder, "config.json"),
        ("text_encoder_2", a.text_encoder_2, "config.json"),
        ("text_encoder_3", a.text_encoder_3, "config.json"),
        ("vae", a.vae, "config.json"),
        ("scheduler", {k: v for k, v in a.scheduler.items() if k != "_class_name"}, "scheduler_config.json"),
    ):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / file).write_text(json.dumps(config))
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    arch = aot.architecture(str(tmp_path))
    assert isinstance(arch, presets.SD3Architecture) and arch.cfg

    def shapes(kind):
        _, params = presets.build_sd3_pipeline(kind, jnp.bfloat16)
        return jax.tree_util.tree_map(lambda x: tuple(x.shape), {k: v for k, v in params.items() if k != "scheduler"})

    assert shapes(arch) == shapes("sd3-tiny")
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "text_encoder_3": [None, None]}))
    with pytest.raises(ValueError, match="without text_encoder_3"):
        aot.architecture(str(tmp_path))
    with pytest.raises(ValueError, match="sd35-large"):  # the error lists the presets of every family
        aot.architecture("no-such-model")


@needs_libtpu
def test_tiny_sd3_compiles_for_a_v5e_4_with_fsdp(monkeypatch):
    """CFG doubles each model call's rows; FSDP (threshold lowered for the tiny model) leaves each chip a quarter of
    the large kernels; the loop-corrected cost covers every step."""
    monkeypatch.setattr(sharding, "fsdp", functools.partial(sharding.fsdp, 256))
    r = aot.compile_for("v5e-4", model="sd3-tiny", size=16, batch=4, steps=2, fsdp=True)
    assert (r.pipeline, r.cfg, r.fsdp, r.mesh) == ("StableDiffusion3Pipeline", True, True, {"data": 4, "model": 1})
    assert r.fits and r.error is None
    assert (r.model_calls, r.sampler) == (2, "flow_euler")  # the registry name of FlowMatch Euler
    assert r.flops == pytest.approx(r.program_flops + r.unet_call_flops)
    assert r.argument_bytes < 0.5 * r.weights_bytes
    assert "FSDP" in r.summary() and "no CFG" not in r.summary()
