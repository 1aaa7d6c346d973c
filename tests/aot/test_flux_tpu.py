"""Flux.1 in `sdjax.aot` / `sdjax compile`: the released configs (shapes only), their weights split over a TPU
slice's `model` axis by the rules table, FSDP and float8 weights, and a compile of the tiny Flux for one v5e chip.

No 12e9-parameter compile here: those are docs/benchmarks.md's table ("Flux.1 on TPU"), minutes each.
"""

from __future__ import annotations

import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner

from sdjax import aot, cli
from sdjax.families.flux import presets
from sdjax.parallel import sharding

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'sdjax[tpu-aot]')")
runner = CliRunner()
GB = 1e9


@pytest.fixture(scope="module")
def dev_params():
    """FLUX.1-dev's abstract bf16 params (shapes from the configs: nothing allocated)."""
    _, params = presets.build_flux_pipeline("flux-dev", jnp.bfloat16)
    return {k: v for k, v in params.items() if k != "scheduler"}


@pytest.fixture(scope="module")
def tiny_report():
    if not HAS_LIBTPU:
        pytest.skip("libtpu is not installed (pip install 'sdjax[tpu-aot]')")
    return aot.compile_for("v5e-1", model="flux-tiny", size=16, batch=1, steps=2)


def _per_device_bytes(params, mesh) -> float:
    specs = sharding.param_specs(params, mesh)
    total = 0.0
    for x, spec in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(specs, is_leaf=_is_spec)):
        split = math.prod(mesh.shape[a] for a in spec if a is not None)
        total += math.prod(x.shape) * x.dtype.itemsize / split
    return total


def _is_spec(x) -> bool:
    return isinstance(x, P)


def test_released_configs_have_the_released_sizes(dev_params):
    sizes = {k: aot._nbytes(v) for k, v in dev_params.items()}
    # bf16: the transformer 11.90e9 parameters, T5 v1.1 XXL's encoder 4.76e9, CLIP-L 0.12e9, the VAE 0.08e9
    assert sizes["transformer"] == pytest.approx(23.80 * GB, rel=1e-3)
    assert sizes["text_encoder_2"] == pytest.approx(9.52 * GB, rel=1e-3)
    assert sizes["text_encoder"] == pytest.approx(0.246 * GB, rel=1e-2)
    assert sizes["vae"] == pytest.approx(0.168 * GB, rel=1e-2)
    t5 = dev_params["text_encoder_2"]
    assert t5["shared"]["embedding"].shape == (32128, 4096)
    assert t5["encoder"]["block_0"]["layer_1"]["DenseReluDense"]["wi_0"]["kernel"].shape == (4096, 10240)
    pipe, _ = presets.build_flux_pipeline("schnell", jnp.bfloat16)
    assert (pipe.default_steps, pipe.max_sequence_length, pipe.default_size) == (4, 256, (1024, 1024))
    assert pipe.tokenizer_2(["a cat"], 256).shape == (1, 256)
    with pytest.raises(ValueError, match="flux-dev"):
        presets.flux_architecture("flux-pro")


@needs_libtpu
def test_the_transformers_big_kernels_are_split_over_the_model_axis_on_v5e_4(dev_params):
    _, devices = aot.topology_devices("v5e-4")
    mesh = sharding.make_mesh(1, 4, devices)
    specs = sharding.param_specs(dev_params, mesh)
    t = specs["transformer"]
    double, single = t["transformer_blocks_0"], t["single_transformer_blocks_0"]
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        assert double["attn"][name]["kernel"] == P(None, "model"), name
        assert double["attn"][name]["bias"] == P("model"), name
    assert double["attn"]["to_out_0"]["kernel"] == P("model", None)
    assert double["attn"]["to_add_out"]["kernel"] == P("model", None)
    assert double["attn"]["to_add_out"]["bias"] == P()
    assert double["attn"]["norm_q"]["scale"] == P()
    for ff in ("ff", "ff_context"):
        assert double[ff]["net_0"]["proj"]["kernel"] == P(None, "model")
        assert double[ff]["net_2"]["kernel"] == P("model", None)
    for norm in ("norm1", "norm1_context"):
        assert double[norm]["linear"]["kernel"] == P(None, "model")
    assert single["norm"]["linear"]["kernel"] == P(None, "model")
    assert single["proj_mlp"]["kernel"] == P(None, "model")
    assert single["proj_out"]["kernel"] == P("model", None)
    assert single["attn"]["to_q"]["kernel"] == P(None, "model")
    assert t["norm_out"]["linear"]["kernel"] == P(None, "model")
    t5 = specs["text_encoder_2"]
    block = t5["encoder"]["block_0"]
    for name in ("q", "k", "v"):
        assert block["layer_0"]["SelfAttention"][name]["kernel"] == P(None, "model")
    assert block["layer_0"]["SelfAttention"]["o"]["kernel"] == P("model", None)
    assert block["layer_0"]["SelfAttention"]["relative_attention_bias"]["embedding"] == P()
    for name in ("wi_0", "wi_1"):
        assert block["layer_1"]["DenseReluDense"][name]["kernel"] == P(None, "model")
    assert block["layer_1"]["DenseReluDense"]["wo"]["kernel"] == P("model", None)
    assert t5["shared"]["embedding"] == P("model", None)
    # what stays whole is small: each chip holds a quarter of the 33.7 GB, plus under 1%
    total = sum(aot._nbytes(v) for v in dev_params.values())
    assert total / 4 < _per_device_bytes(dev_params, mesh) < total / 4 * 1.01


@needs_libtpu
def test_fsdp_splits_the_large_weights_over_the_data_axis_too(dev_params):
    _, devices = aot.topology_devices("v5e-8")
    mesh = sharding.make_mesh(4, 2, devices)
    with sharding.fsdp():
        specs = sharding.param_specs(dev_params, mesh)
        assert sharding.fsdp_min_size() == sharding.FSDP_MIN_SIZE
    assert sharding.fsdp_min_size() is None
    single = specs["transformer"]["single_transformer_blocks_0"]
    assert single["proj_mlp"]["kernel"] == P("data", "model")  # (3072, 12288): the free dim takes data
    assert single["proj_out"]["kernel"] == P("model", "data")  # (15360, 3072)
    assert single["norm"]["linear"]["bias"] == P("model")  # 9216 elements: under FSDP_MIN_SIZE
    assert specs["text_encoder_2"]["shared"]["embedding"] == P("model", "data")
    # the VAE stays out of FSDP (XLA gathered its batch instead of its kernels; see sharding.FSDP_EXCLUDE)
    assert specs["vae"]["decoder"]["up_blocks_0"]["resnets_0"]["conv1"]["kernel"] == P(None, None, None, "model")
    total = sum(aot._nbytes(v) for v in dev_params.values())
    with sharding.fsdp():
        assert total / 8 < _per_device_bytes(dev_params, mesh) < total / 8 * 1.03  # small params, the VAE whole
        sigmas = jax.ShapeDtypeStruct((2**21,), jnp.float32)
        assert sharding.param_specs({"scheduler": {"sigmas": sigmas}}, mesh) == {"scheduler": {"sigmas": P()}}
    with pytest.raises(ValueError, match="min_size"), sharding.fsdp(0):
        pass


def test_the_default_mesh_splits_weights_that_do_not_fit_one_chip():
    hbm = 16 * 2**30
    assert aot._default_model_parallel(4, 4, int(33.7 * GB), hbm, fsdp=False) == 4  # Flux bf16 on a v5e-4
    assert aot._default_model_parallel(4, 4, int(33.7 * GB), hbm, fsdp=True) == 1  # FSDP over data instead
    assert aot._default_model_parallel(8, 4, int(33.7 * GB), hbm, fsdp=False) == 4  # v5e-8: 8.4 GB a chip
    assert aot._default_model_parallel(8, 4, int(17.1 * GB), hbm, fsdp=False) == 2  # float8 weights: 8.6 GB a chip
    assert aot._default_model_parallel(4, 4, int(6.9 * GB), hbm, fsdp=False) == 1  # SDXL: as before
    assert aot._default_model_parallel(4, 2, int(6.9 * GB), hbm, fsdp=False) == 2  # the batch's own need


def test_float8_weights_are_the_matmul_kernels_only():
    _, params = presets.build_flux_pipeline("flux-tiny", jnp.bfloat16, weights_dtype="float8_e4m3fn")
    f8 = jnp.dtype(jnp.float8_e4m3fn)
    t = params["transformer"]["transformer_blocks_0"]
    assert t["attn"]["to_q"]["kernel"].dtype == f8 and t["attn"]["to_q"]["bias"].dtype == jnp.bfloat16
    assert t["attn"]["norm_q"]["scale"].dtype == jnp.bfloat16
    t5 = params["text_encoder_2"]
    assert t5["encoder"]["block_0"]["layer_1"]["DenseReluDense"]["wo"]["kernel"].dtype == f8
    assert t5["shared"]["embedding"].dtype == jnp.bfloat16
    for name in ("text_encoder", "vae"):
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params[name])), name
    with pytest.raises(ValueError, match="weights_dtype='int4'"):
        aot.compile_for("v5e-1", model="flux-tiny", weights_dtype="int4")
    with pytest.raises(ValueError, match="Flux and SD 3 only"):
        aot.compile_for("v5e-1", model="tiny", dtype="fp8")
    with pytest.raises(ValueError, match="no ControlNet for"):
        aot.compile_for("v5e-1", model="flux-tiny", controlnets=1)


@needs_libtpu
def test_tiny_flux_compiles_for_one_v5e(tiny_report):
    r = tiny_report
    assert (r.topology, r.chips, r.mesh, r.pipeline) == ("v5e:1x1", 1, {"data": 1, "model": 1}, "FluxPipeline")
    assert (r.model, r.dtype, r.weights_dtype, r.fsdp, r.cfg) == ("flux-tiny", "bfloat16", None, False, False)
    assert r.fits and r.error is None and r.margin_bytes > 0
    assert r.total_bytes == r.argument_bytes + r.output_bytes - r.alias_bytes + r.temp_bytes + r.code_bytes
    assert r.argument_bytes >= r.weights_bytes  # one chip holds every weight (+ the inputs)
    assert r.output_bytes >= 16 * 16 * 3 * 4  # the 16 x 16 x 3 float32 image
    # flow-matching Euler: one transformer call per step, of the batch alone (no CFG)
    assert (r.model_calls, r.sampler) == (2, "flow_euler")  # the registry name of FlowMatch Euler
    assert r.flops == pytest.approx(r.program_flops + r.unet_call_flops)
    assert r.roofline_s == pytest.approx(max(r.flops / 197e12, r.bytes_accessed / 819e9))
    assert "no CFG" in r.summary()
    assert json.loads(json.dumps(r.to_dict()))["cfg"] is False


@needs_libtpu
def test_cli_fp8_and_a_flux_folder_reach_the_program(monkeypatch, tmp_path):
    """`sdjax compile -m flux-tiny --dtype fp8` lowers the Flux program with float8 kernels and bf16 compute, with
    no CFG half; a diffusers Flux folder (configs only) builds the same shapes. Stopped before the TPU compile."""
    from sdjax.core.generator import Generator

    seen = []

    class Stop(Exception):
        pass

    def lower(self, spec, *, params, mesh, **kwargs):
        seen.append((spec, params, dict(mesh.shape)))
        raise Stop

    monkeypatch.setattr(Generator, "lower", lower)
    args = ["compile", "--target", "v5e-4", "--size", "32", "--batch", "4", "--steps", "2", "--in-process"]
    r = runner.invoke(cli.app, [*args, "-m", "flux-tiny", "--dtype", "fp8"])
    assert isinstance(r.exception, Stop), r.output
    folder = tmp_path / "tiny-flux"
    a = presets.FLUX_ARCHITECTURES["flux-tiny"]
    index = {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    for name, config, file in (
        ("transformer", a.transformer, "config.json"),
        ("text_encoder", a.text_encoder, "config.json"),
        ("text_encoder_2", a.text_encoder_2, "config.json"),
        ("vae", a.vae, "config.json"),
        ("scheduler", {k: v for k, v in a.scheduler.items() if k != "_class_name"}, "scheduler_config.json"),
    ):
        (folder / name).mkdir(parents=True)
        (folder / name / file).write_text(json.dumps(config))
    (folder / "model_index.json").write_text(json.dumps(index))
    r = runner.invoke(cli.app, [*args, "-m", str(folder)])
    assert isinstance(r.exception, Stop), r.output
    (spec, params, mesh), (_, folder_params, _) = seen
    assert spec.cfg is False and spec.batch == 4 and mesh == {"data": 4, "model": 1}
    kernel = params["transformer"]["transformer_blocks_0"]["attn"]["to_q"]["kernel"]
    assert kernel.dtype == jnp.float8_e4m3fn
    assert params["vae"]["decoder"]["conv_in"]["kernel"].dtype == jnp.bfloat16

    def shapes(p):
        return jax.tree_util.tree_map(lambda x: tuple(x.shape), {k: v for k, v in p.items() if k != "scheduler"})

    assert shapes(folder_params) == shapes(params)


@needs_libtpu
def test_fsdp_compiles_with_each_chip_holding_a_quarter_of_the_weights(monkeypatch):
    """`compile_for(fsdp=True)`: the program and the model call (the loop-corrected cost) both traced with the FSDP
    layout. The tiny model's params are under `FSDP_MIN_SIZE`, so the threshold is lowered for it."""
    import functools

    monkeypatch.setattr(sharding, "fsdp", functools.partial(sharding.fsdp, 256))
    r = aot.compile_for("v5e-4", model="flux-tiny", size=16, batch=4, steps=1, fsdp=True)
    assert r.fsdp and r.mesh == {"data": 4, "model": 1} and r.fits
    assert r.unet_call_flops is not None and "FSDP" in r.summary()
    assert r.argument_bytes < 0.5 * r.weights_bytes  # a quarter of the large kernels, the small params whole


def test_float8_kernels_give_the_image_of_their_upcast_values():
    """What the fp8 rows compile is what runs: float8 kernels in the params, each Dense casting its kernel to the
    compute dtype where it is used, give the image of the same values stored in bfloat16 (tiny Flux, CPU)."""
    import numpy as np

    _, params = presets.build_flux_pipeline("flux-tiny", jnp.bfloat16, abstract=False, seed=2)
    fp8 = presets.quantized_kernels(params, jnp.float8_e4m3fn)
    upcast = presets.quantized_kernels(fp8, jnp.bfloat16)
    kernel = ("transformer", "transformer_blocks_0", "attn", "to_q", "kernel")

    def leaf(p):
        for k in kernel:
            p = p[k]
        return p

    assert leaf(fp8).dtype == jnp.float8_e4m3fn and leaf(upcast).dtype == jnp.bfloat16
    assert not np.array_equal(np.asarray(leaf(upcast), np.float32), np.asarray(leaf(params), np.float32))

    def image(p):  # a pipeline each: compiled programs are cached by shapes, not by the params' dtypes
        fresh, _ = presets.build_flux_pipeline("flux-tiny", jnp.bfloat16, abstract=False, seed=2)
        out = fresh.generate(["a cat"], steps=2, seed=1, height=32, width=32, params=p, output_type="np")
        return np.asarray(out, np.float32)

    np.testing.assert_allclose(image(fp8), image(upcast), atol=1e-6)
