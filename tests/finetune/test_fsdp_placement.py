"""`finetune.distributed.place` on CPU: device arrays split over a mesh without a program compiled per leaf shape
(JAX's device-to-device split compiles one slicing program per shape: 0.1-0.2 s of CPU each, ~130 shapes for the
tiny SD 1.x fine-tune's FSDP layout), the same values and the asked-for sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_counter import counting_compiles
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sdjax.finetune import distributed

pytestmark = pytest.mark.all_devices


def test_device_arrays_are_split_from_host_memory_without_compiling():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets --xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    split = NamedSharding(mesh, PartitionSpec("data"))
    rng = np.random.default_rng(0)
    host = {
        "kernel": rng.standard_normal((16, 3), np.float32),
        "bias": rng.standard_normal((8,), np.float32),
        "half": rng.standard_normal((24, 2, 2)).astype(jnp.bfloat16),
        "count": np.arange(8, dtype=np.int32),
    }
    on_one = jax.device_put(host, jax.devices()[0])  # as a loaded or restored state arrives
    with counting_compiles() as compiles:
        placed = distributed.place(on_one, split)
        jax.block_until_ready(placed)
    assert compiles == []
    for name, x in placed.items():
        assert x.sharding.is_equivalent_to(split, x.ndim), name
        assert x.addressable_shards[0].data.shape[0] * 8 == x.shape[0], name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(host[name]), err_msg=name)
    # an array already in the layout is handed back as it is (no copy through the host)
    again = distributed.place(placed, split)
    assert all(again[k] is placed[k] for k in placed)
    # typed PRNG keys keep JAX's own path (the host has no array of keys)
    keys = jax.random.split(jax.random.key(0), 8)
    placed_keys = distributed.place(keys, split)
    assert jax.random.key_data(placed_keys).tolist() == jax.random.key_data(keys).tolist()
