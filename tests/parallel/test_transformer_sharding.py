"""The transformer families on a mesh of 8 simulated CPU devices (tests/conftest.py): Flux.1 and SD 3's weights split
by the rules table over `model` and, inside `sharding.fsdp()`, over `data` too; the images equal the one-device
images (float32, <= 1e-5). The models are the tiny presets with random weights (`families.*.presets`)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sdjax.families.flux.presets import build_flux_pipeline
from sdjax.families.sd3.presets import SD3_ARCHITECTURES, build_sd3_pipeline
from sdjax.parallel import sharding

PROMPTS = ["a cat", "a dog", "a red car", "a boat"]
MIN_SIZE = 256  # the tiny models' kernels are far under FSDP_MIN_SIZE


def _generate(kind: str, mesh, *, fsdp: bool):
    """Four images of a fresh tiny pipeline on `mesh` (a fresh one: compiled programs and placed params are kept
    per mesh, not per FSDP layout) -> (images, the params as the run placed them)."""
    build = build_flux_pipeline if kind == "flux" else build_sd3_pipeline
    pipe, params = build(f"{kind}-tiny", jnp.float32, abstract=False, seed=1)
    pipe.mesh = mesh
    kwargs = {"guidance_scale": 3.5} if kind == "flux" else {"negative_prompt": "blurry"}
    with sharding.fsdp(MIN_SIZE) if fsdp else contextlib.nullcontext():
        out = pipe.generate(PROMPTS, steps=2, seed=3, height=32, width=32, params=params, output_type="np", **kwargs)
        placed = pipe.generator.place_params(params, mesh)  # the copies the run used (placed once per leaf)
    return np.asarray(out, np.float32), placed


@pytest.fixture(scope="module")
def devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets --xla_force_host_platform_device_count=8)")
    return jax.devices()[:8]


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_fsdp_and_model_axes_give_the_one_device_images(kind, devices):
    ref, _ = _generate(kind, sharding.make_mesh(1, 1, devices[:1]), fsdp=False)
    mesh = sharding.make_mesh(4, 2, devices)
    out, placed = _generate(kind, mesh, fsdp=True)
    assert out.shape == (4, 32, 32, 3) and np.isfinite(out).all()
    assert np.abs(out - ref).max() <= 1e-5
    t = placed["transformer"]["transformer_blocks_0"]
    # (32, 32) q projection: its output over `model` (the rules table), its input over `data` (FSDP)
    q = t["attn"]["to_q"]["kernel"]
    assert q.sharding.spec == P("data", "model")
    assert len(q.addressable_shards) == 8 and {s.data.shape for s in q.addressable_shards} == {(8, 16)}
    assert t["attn"]["to_out_0"]["kernel"].sharding.spec == P("model", "data")
    assert t["ff"]["net_0"]["proj"]["kernel"].sharding.spec == P("data", "model")
    assert t["norm1"]["linear"]["kernel"].sharding.spec == P("data", "model")  # AdaLN: 6 x width out
    assert placed["vae"]["decoder"]["conv_in"]["kernel"].sharding.spec == P(None, None, None, "model")  # no FSDP
    split = [x for x in jax.tree_util.tree_leaves(placed["transformer"]) if "data" in x.sharding.spec]
    assert len(split) >= 10


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_without_fsdp_the_data_axis_holds_whole_weights(kind, devices):
    mesh = sharding.make_mesh(4, 2, devices)
    build = build_flux_pipeline if kind == "flux" else build_sd3_pipeline
    _, params = build(f"{kind}-tiny", jnp.float32)
    specs = sharding.param_specs(params, mesh)
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert not any("data" in s for s in leaves)
    assert specs["transformer"]["transformer_blocks_0"]["attn"]["to_q"]["kernel"] == P(None, "model")


def test_sd35_large_weights_split_by_the_rules():
    """SD 3.5 large (8.1e9 transformer parameters, abstract): every big kernel of the MMDiT and of T5 split over
    `model` by the same rules as Flux's; a chip of a model-4 mesh holds a quarter of the weights (plus < 1%)."""
    _, params = build_sd3_pipeline(SD3_ARCHITECTURES["sd35-large"], jnp.bfloat16)
    params = {k: v for k, v in params.items() if k != "scheduler"}
    mesh = sharding.make_mesh(2, 4, jax.devices()[:8])
    specs = sharding.param_specs(params, mesh)
    block = specs["transformer"]["transformer_blocks_0"]
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        assert block["attn"][name]["kernel"] == P(None, "model"), name
    assert block["attn"]["to_out_0"]["kernel"] == P("model", None)
    assert block["attn"]["to_add_out"]["kernel"] == P("model", None)
    for ff in ("ff", "ff_context"):
        assert block[ff]["net_0"]["proj"]["kernel"] == P(None, "model")
        assert block[ff]["net_2"]["kernel"] == P("model", None)
    for norm in ("norm1", "norm1_context"):
        assert block[norm]["linear"]["kernel"] == P(None, "model")
    last = specs["transformer"]["transformer_blocks_37"]  # context pre-only: AdaLayerNormContinuous, 2 x width
    assert last["norm1_context"]["linear"]["kernel"] == P(None, "model")
    assert specs["transformer"]["context_embedder"]["kernel"] == P(None, "model")
    assert specs["transformer"]["norm_out"]["linear"]["kernel"] == P(None, "model")
    t5 = specs["text_encoder_3"]["encoder"]["block_0"]
    assert t5["layer_1"]["DenseReluDense"]["wi_0"]["kernel"] == P(None, "model")
    clip_g = specs["text_encoder_2"]["text_model"]["encoder"]["layers_0"]
    assert clip_g["mlp"]["fc1"]["kernel"] == P(None, "model")

    def nbytes(x):
        return int(np.prod(x.shape)) * x.dtype.itemsize

    total = sum(nbytes(x) for x in jax.tree_util.tree_leaves(params))
    per_chip = 0.0
    for x, s in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    ):
        per_chip += nbytes(x) / (4 if "model" in s else 1)
    assert total / 4 < per_chip < total / 4 * 1.01
    with sharding.fsdp():  # and with FSDP over data (2) too: an eighth
        specs = sharding.param_specs(params, mesh)
        assert specs["transformer"]["transformer_blocks_0"]["attn"]["to_q"]["kernel"] == P("data", "model")
        assert specs["transformer"]["pos_embed"]["pos_embed"] != P()  # the 192^2-position table: 0.9e8 values
