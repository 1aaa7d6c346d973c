"""The sharding rules table: PartitionSpecs of named params, and a (data, model) mesh gives the same images."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sdjax import StableDiffusionPipeline
from sdjax.parallel import make_mesh, param_specs, shard_params

pytestmark = pytest.mark.all_devices  # default meshes over all eight simulated devices


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))


def test_partition_specs_of_named_params(sd):
    _, params = sd
    specs = param_specs(params, make_mesh(data=4, model=2))
    attn = specs["unet"]["down_blocks_0"]["attentions_0"]["transformer_blocks_0"]
    assert attn["attn1"]["to_q"]["kernel"] == P(None, "model")
    assert attn["attn1"]["to_out_0"]["kernel"] == P("model", None)
    assert attn["attn1"]["to_out_0"]["bias"] == P()
    assert attn["ff"]["net_0"]["proj"]["kernel"] == P(None, "model")
    assert attn["ff"]["net_2"]["kernel"] == P("model", None)
    assert specs["unet"]["conv_in"]["kernel"] == P(None, None, None, "model")
    assert specs["unet"]["conv_norm_out"]["scale"] == P()
    layer = specs["text_encoder"]["text_model"]["encoder"]["layers_0"]
    assert layer["self_attn"]["k_proj"]["kernel"] == P(None, "model")
    assert layer["self_attn"]["out_proj"]["kernel"] == P("model", None)
    # The tiny CLIP MLP has 37 hidden units: not divisible by 2, so fc1/fc2 stay replicated.
    assert layer["mlp"]["fc1"]["kernel"] == P() and layer["mlp"]["fc2"]["kernel"] == P()
    assert all(s == P() for s in jax.tree_util.tree_leaves(specs["scheduler"], is_leaf=lambda x: isinstance(x, P)))
    # conv_out has 4 output channels: divisible by 2, so it splits; with model=8 nothing of width 4 can.
    assert specs["unet"]["conv_out"]["kernel"] == P(None, None, None, "model")
    wide = param_specs(params, make_mesh(data=1, model=8))
    assert wide["unet"]["conv_out"]["kernel"] == P()


def test_data_only_mesh_replicates_everything(sd):
    _, params = sd
    specs = param_specs(params, make_mesh(data=8, model=1))
    assert all(s == P() for s in jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)))


def test_model_axis_gives_the_same_images(sd):
    pipe, params = sd
    args = (["a cat", "a dog", "a car", "a boat"], [""] * 4, [3] * 4, [0, 1, 2, 3], [7.5] * 4)
    ref = pipe.generate_arrays(*args, steps=3, height=64, width=64)
    pipe.mesh = make_mesh(data=4, model=2)
    try:
        out = pipe.generate_arrays(*args, steps=3, height=64, width=64)
        placed = pipe.generator.place_params(params, pipe.mesh)  # the copy the run used (placed once per leaf)
        kernel = placed["unet"]["down_blocks_0"]["attentions_0"]["transformer_blocks_0"]["attn1"]["to_q"]["kernel"]
        assert kernel.sharding.spec == P(None, "model")
        assert len(kernel.addressable_shards) == 8 and kernel.addressable_shards[0].data.shape[1] * 2 == kernel.shape[1]
    finally:
        pipe.mesh = None
    assert np.abs(out.astype(int) - ref.astype(int)).max() <= 1


def test_bad_mesh_shapes():
    with pytest.raises(ValueError, match="model=3"):
        make_mesh(model=3)
    with pytest.raises(ValueError, match="data=3 x model=2"):
        make_mesh(data=3, model=2)


def test_shard_params_places_by_spec(sd):
    _, params = sd
    mesh = make_mesh(data=4, model=2)
    placed = shard_params({"unet": {"conv_in": params["unet"]["conv_in"]}}, mesh)
    assert placed["unet"]["conv_in"]["kernel"].sharding.spec == P(None, None, None, "model")
    np.testing.assert_array_equal(
        np.asarray(placed["unet"]["conv_in"]["kernel"]), np.asarray(params["unet"]["conv_in"]["kernel"])
    )
