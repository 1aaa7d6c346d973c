"""Quantized params saved and read back (`save_quantized` / `load_quantized`): bit for bit for int8 and fp8, the
file readable by other safetensors readers, a pipeline taking the loaded params as they are, and
files of another scheme, another model or another format refused with the file named."""

from __future__ import annotations

import json
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sdjax import quant
from sdjax.loading.weight_readers import read_safetensors
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import params as P


def _leaves(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def quantized():
    return {scheme: load_pipeline(None, quantize=scheme) for scheme in ("int8", "fp8")}


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_round_trip_is_bit_exact(quantized, tmp_path, scheme):
    pipe, params = quantized[scheme]
    file = tmp_path / "unet.safetensors"
    quant.save_quantized(params, file, pipe.quantization)
    loaded, policy = quant.load_quantized(file, like={"unet": params["unet"]}, scheme=scheme)
    assert set(loaded) == {"unet"} and policy == pipe.quantization
    want, got = _leaves(params["unet"]), _leaves(loaded["unet"])
    assert set(want) == set(got)
    assert all(_same_bits(want[k], got[k]) for k in want), [k for k in want if not _same_bits(want[k], got[k])]
    assert sum(np.asarray(v).dtype == quant.SCHEMES[scheme] for v in got.values()) == len(
        P.quantized_kernels(params["unet"])
    )
    # another reader of the same format: sdjax's checkpoint reader (float8 included)
    other = read_safetensors(file)
    for k in ("unet/mid_block/resnets_0/conv1/kernel", "unet/mid_block/resnets_0/conv1/kernel_scale"):
        node = params["unet"]
        for key in k.split("/")[1:]:
            node = node[key]
        assert _same_bits(other[k], node), k
    assert other.metadata[file.name]["scheme"] == scheme


def test_the_safetensors_package_reads_an_int8_file(quantized, tmp_path):
    _, params = quantized["int8"]
    file = tmp_path / "unet.safetensors"
    quant.save_quantized(params, file)  # the policy inferred: the components holding quantized kernels
    tensors = load_file(str(file))
    flat = {
        "unet/" + "/".join(str(p.key) for p in k): v for k, v in jax.tree_util.tree_leaves_with_path(params["unet"])
    }
    assert set(tensors) == set(flat) and all(_same_bits(tensors[k], flat[k]) for k in flat)


def test_a_pipeline_takes_the_loaded_params_as_they_are(quantized, tmp_path):
    """`quantize_pipeline` on a float pipeline with the loaded component keeps the loaded kernels: the pipeline's
    params are then bit for bit the quantized pipeline's (the same program and arguments: the same images)."""
    pipe, params = quantized["int8"]
    file = tmp_path / "unet.safetensors"
    quant.save_quantized(params, file, pipe.quantization)
    fresh, fresh_params = load_pipeline(None)
    loaded, policy = quant.load_quantized(file, like=fresh_params)
    fresh, new_params = quant.quantize_pipeline(fresh, {**fresh_params, **loaded}, policy)
    want, got = _leaves(params["unet"]), _leaves(new_params["unet"])
    assert set(want) == set(got) and all(_same_bits(want[k], got[k]) for k in want)
    assert fresh.quantization == pipe.quantization and fresh.unet.compute is None


def test_another_scheme_or_model_is_refused(quantized, tmp_path):
    _, params = quantized["int8"]
    file = tmp_path / "unet.safetensors"
    quant.save_quantized(params, file)
    with pytest.raises(ValueError, match=rf"quantized params file {file} holds int8 kernels, not fp8"):
        quant.load_quantized(file, scheme="fp8")
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), P.dequantize_tree(params, jnp.float32)
    )
    quant.load_quantized(file, like=abstract)  # the float model's shapes: accepted
    # a model whose first layer is wider
    conv_in = abstract["unet"]["conv_in"]["kernel"]
    wider = {**abstract["unet"], "conv_in": {**abstract["unet"]["conv_in"]}}
    wider["conv_in"]["kernel"] = jax.ShapeDtypeStruct((*conv_in.shape[:-1], conv_in.shape[-1] + 1), jnp.float32)
    shape = re.escape(f"{tuple(conv_in.shape)} there and {wider['conv_in']['kernel'].shape} here")
    with pytest.raises(ValueError, match=rf"{file} is for another model: unet/conv_in/kernel has shape {shape}"):
        quant.load_quantized(file, like={"unet": wider})
    # a model with a layer the file lacks, and one without the component
    more = {"unet": {**abstract["unet"], "extra": {"kernel": jax.ShapeDtypeStruct((4, 4), jnp.float32)}}}
    with pytest.raises(ValueError, match=rf"{file} is for another model: it lacks unet/extra/kernel \(4, 4\)"):
        quant.load_quantized(file, like=more)
    with pytest.raises(ValueError, match=rf"{file} holds \['unet'\], which this model's params lack"):
        quant.load_quantized(file, like={"transformer": abstract["unet"]})


def _rewrite_metadata(src, dst, change):
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    dst.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    return dst


def test_files_that_are_not_quantized_params_are_refused(quantized, tmp_path):
    _, params = quantized["fp8"]
    file = tmp_path / "unet.safetensors"
    quant.save_quantized(params, file)
    with pytest.raises(FileNotFoundError, match="quantized params file .*nope.safetensors does not exist"):
        quant.load_quantized(tmp_path / "nope.safetensors")
    plain = tmp_path / "plain.safetensors"
    save_file({"a": np.ones(3, np.float32)}, str(plain))
    with pytest.raises(ValueError, match=rf"{plain} is not an sdjax quantized params file"):
        quant.load_quantized(plain)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match=rf"{junk} is not a safetensors file"):
        quant.load_quantized(junk)

    def relabel(header):  # the metadata says int8, the kernels are float8
        header["__metadata__"]["policy"] = header["__metadata__"]["policy"].replace('"fp8"', '"int8"')

    liar = _rewrite_metadata(file, tmp_path / "liar.safetensors", relabel)
    with pytest.raises(ValueError, match=rf"{liar}: unet/.*/kernel_scale is not the float32 scale of a int8 kernel"):
        quant.load_quantized(liar)
    with pytest.raises(ValueError, match="no component of params holds quantized kernels"):
        quant.save_quantized(load_pipeline(None)[1], tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=r"params\['text_encoder'\] holds no quantized kernels"):
        quant.save_quantized(params, tmp_path / "x.safetensors", P.QuantPolicy("fp8", components=("text_encoder",)))
