"""Winograd kernels kept between runs on CPU (`Generator.keep_winograd_kernels`, `ops.conv.PreparedKernels`): the
images are those of kernels computed inside the program, the program reads the kept kernels instead of computing
them, an edited kernel gets a new one, and kernels no longer used are freed.

The tiny test model's channels are under `WINOGRAD_MIN_CHANNELS`, so these tests lower the threshold to 1 (every
3x3 kernel of the UNet and the VAE takes Winograd's path) in a pipeline of their own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import StableDiffusionPipeline
from sdjax.ops import conv as ops_conv
from sdjax.parallel.sharding import make_mesh

KW = dict(steps=2, seed=1, output_type="np")


@pytest.fixture(scope="module")
def sd(sd1_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops_conv, "WINOGRAD_MIN_CHANNELS", 1)
        pipe, params = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
        pipe.devices = jax.devices()[:1]
        yield pipe, params


def _eligible(tree) -> int:
    """Kernels that get a kept leaf: every Winograd-eligible 3x3 kernel, and every upsampler's (a sub-pixel one)."""
    count = 0

    def walk(node, upsampler):
        nonlocal count
        if isinstance(node, dict):
            kernel = node.get("kernel")
            if kernel is not None and not isinstance(kernel, dict):
                rule = ops_conv.subpixel_eligible if upsampler else ops_conv.winograd_eligible
                count += rule(kernel)
            for k, v in node.items():
                walk(v, upsampler or k.startswith("upsamplers"))

    walk(tree, False)
    return count


def _counting(monkeypatch):
    calls = []
    transform = ops_conv._transform

    def counted(kind, sharding):
        fn = transform(kind, sharding)
        return lambda kernel: (calls.append(kernel.shape), fn(kernel))[1]

    monkeypatch.setattr(ops_conv, "_transform", counted)
    return calls


def test_kept_kernels_give_the_images_of_kernels_computed_in_the_program(sd, monkeypatch):
    pipe, params = sd
    gen = pipe.generator
    calls = _counting(monkeypatch)
    kept = pipe.generate("a red boat", **KW)
    wanted = _eligible(params["unet"]) + _eligible(params["vae"])
    assert wanted > 10 and len(gen.kernels) == wanted
    assert len(calls) == wanted
    again = pipe.generate("a red boat", **KW)
    assert len(calls) == wanted  # the second run computed no kernel
    gen.keep_winograd_kernels = False
    try:
        computed = pipe.generate("a red boat", **KW)
    finally:
        gen.keep_winograd_kernels = True
    np.testing.assert_array_equal(again, kept)
    # Two programs (kernels as arguments / computed inside) may fuse and round differently: a few 1e-6 apart.
    np.testing.assert_allclose(kept, computed, atol=1e-5)


def test_the_program_reads_the_kept_kernels(sd):
    """The kept kernels are the ones the program computes with (it does not compute its own): zeroing them changes
    the images."""
    pipe, _ = sd
    gen = pipe.generator
    before = pipe.generate("a cat", **KW)
    entries = gen.kernels._entries
    try:
        for key, (kernel, u) in list(entries.items()):
            entries[key] = (kernel, jnp.zeros_like(u))
        zeroed = pipe.generate("a cat", **KW)
    finally:
        gen.kernels.clear()  # the next run computes them again
    assert np.abs(zeroed - before).max() > 0.05
    np.testing.assert_array_equal(pipe.generate("a cat", **KW), before)


def test_an_edited_kernel_gets_a_new_transform_and_old_ones_are_freed(sd, monkeypatch):
    pipe, params = sd
    gen = pipe.generator
    pipe.generate("a dog", **KW)
    nbytes = gen.kernels.nbytes
    calls = _counting(monkeypatch)
    unet = jax.tree_util.tree_map(lambda x: x, params["unet"])  # new dicts, the same arrays
    block = unet["conv_in"]
    block["kernel"] = block["kernel"] * 1.5
    edited = {**params, "unet": unet}
    got = pipe.generate("a dog", params=edited, **KW)
    assert len(calls) == 1  # only the edited kernel was transformed again
    assert gen.kernels.nbytes == nbytes  # the old kernel's transform was dropped, not kept beside the new one
    gen.keep_winograd_kernels = False
    try:
        want = pipe.generate("a dog", params=edited, **KW)
    finally:
        gen.keep_winograd_kernels = True
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(got - pipe.generate("a dog", **KW)).max() > 1e-2


def test_kept_kernels_are_laid_out_like_their_kernels_on_the_mesh():
    """On a (data, model) mesh a kept transform is split over the model axis like its kernel's output channels
    (and replicated where the kernel is), and holds `winograd_kernel` of the kernel."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = make_mesh(data=2, model=2, devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    split = jax.device_put(
        rng.standard_normal((3, 3, 4, 8), np.float32), NamedSharding(mesh, PartitionSpec(None, None, None, "model"))
    )
    whole = jax.device_put(rng.standard_normal((3, 3, 4, 6), np.float32), NamedSharding(mesh, PartitionSpec()))
    kernels = ops_conv.PreparedKernels()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops_conv, "WINOGRAD_MIN_CHANNELS", 1)
        out = kernels.add({"a": {"kernel": split}, "b": {"kernel": whole}})
    assert tuple(out["a"]["winograd"].sharding.spec) == (None, None, "model")
    assert out["b"]["winograd"].sharding.is_fully_replicated
    for name, kernel in (("a", split), ("b", whole)):
        np.testing.assert_array_equal(out[name]["winograd"], ops_conv.winograd_kernel(kernel))
    # an upsampler's sub-pixel leaf (2, 2, Cin, 4 Cout) is split over its output channels like the kernel
    up = kernels.add({"upsamplers_0": {"conv": {"kernel": split}}})["upsamplers_0"]["conv"]
    assert set(up) == {"kernel", "subpixel"}
    assert tuple(up["subpixel"].sharding.spec) == (None, None, None, "model")
    np.testing.assert_array_equal(up["subpixel"], ops_conv.subpixel_kernel(split))


def test_kernels_beyond_the_budget_are_left_to_the_program(sd, monkeypatch):
    """`gen.kernels.budget` bounds the kept leaves' bytes (`leaf_nbytes`, 16 Cin Cout values a kernel, which is what
    the kept leaves hold); beyond it each program computes its own and nothing is held. The automatic budget (None)
    is half the host's available memory, decided once per size."""
    pipe, params = sd
    gen = pipe.generator
    kept = pipe.generate("a blue car", **KW)
    need = ops_conv.leaf_nbytes(params["unet"]) + ops_conv.leaf_nbytes(params["vae"])
    assert need > 0 and gen.kernels.nbytes == need
    try:
        gen.kernels.budget = need - 1
        over = pipe.generate("a blue car", **KW)
        assert len(gen.kernels) == 0 and gen.kernels.nbytes == 0  # nothing held
        np.testing.assert_allclose(over, kept, atol=1e-5)
        gen.kernels.budget = need
        np.testing.assert_array_equal(pipe.generate("a blue car", **KW), kept)
        assert gen.kernels.nbytes == need
        gen.kernels.budget = None
        free = {"bytes": 2 * need - 2}  # half of it: one byte short
        monkeypatch.setattr(ops_conv, "available_host_bytes", lambda: free["bytes"])
        gen.kernels._decided.clear()
        pipe.generate("a blue car", **KW)
        assert len(gen.kernels) == 0
        free["bytes"] = 4 * need  # decided already: the program's layout does not flip with free memory
        pipe.generate("a blue car", **KW)
        assert len(gen.kernels) == 0
        gen.kernels._decided.clear()
        pipe.generate("a blue car", **KW)
        assert gen.kernels.nbytes == need
    finally:
        gen.kernels.budget = None
        gen.kernels._decided.clear()


def test_available_host_bytes_is_memavailable():
    with open("/proc/meminfo") as f:
        line = next(line for line in f if line.startswith("MemAvailable:"))
    want = int(line.split()[1]) * 1024
    assert abs(ops_conv.available_host_bytes() - want) < 0.2 * want + 2**28  # memory moves a little in between
