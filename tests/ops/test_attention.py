"""`sdjax.ops.attention.attention`: every implementation equals PyTorch's scaled_dot_product_attention."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax.ops import attention as ops_attention
from sdjax.ops.attention import IMPLEMENTATIONS, attention


def _torch_sdpa(q, k, v, heads):
    torch = pytest.importorskip("torch")
    b, t, c = q.shape
    split = lambda x: torch.from_numpy(x).view(b, x.shape[1], heads, -1).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
    return out.transpose(1, 2).reshape(b, t, -1).numpy()


@pytest.mark.parametrize("impl", [i for i in IMPLEMENTATIONS if i != "pallas"])  # the TPU kernel: below
@pytest.mark.parametrize("t,s", [(64, 64), (100, 77), (37, 130)])
def test_matches_torch(impl, t, s):
    rng = np.random.default_rng(t + s)
    heads, d = 4, 8
    q = rng.standard_normal((2, t, heads * d), dtype=np.float32) * 2
    k = rng.standard_normal((2, s, heads * d), dtype=np.float32) * 2
    v = rng.standard_normal((2, s, heads * d), dtype=np.float32)
    got = jax.jit(lambda q, k, v: attention(q, k, v, heads=heads, implementation=impl, chunk_size=32, block_size=48))(
        q, k, v
    )
    np.testing.assert_allclose(np.asarray(got), _torch_sdpa(q, k, v, heads), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("chunk", [16, 50, 1024])
def test_chunked_any_chunk_size_matches_torch(chunk):
    """Blocks that divide the queries, that need padding, and one block larger than the sequence (one block per
    head, CPU's "auto" above AUTO_CHUNK_ABOVE tokens)."""
    rng = np.random.default_rng(chunk)
    heads, d = 2, 40
    q, k, v = (rng.standard_normal((2, n, heads * d), dtype=np.float32) for n in (50, 77, 77))
    got = jax.jit(lambda q, k, v: attention(q, k, v, heads=heads, implementation="chunked", chunk_size=chunk))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), _torch_sdpa(q, k, v, heads), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "tokens,most", [(1152, 1024), (1229, 1024), (4096, 1024), (1024, 1024), (77, 1024), (2049, 1024), (50, 16)]
)
def test_balanced_chunk_pads_less_than_a_row_of_eight_per_block(tokens, most):
    """The fewest blocks of at most `most` queries; the padding is under 8 rows a block (blocks of `most` would pad
    up to `most - 1`); counts `most` divides keep blocks of `most`."""
    chunk = ops_attention.balanced_chunk(tokens, most)
    blocks = -(-tokens // chunk)
    assert chunk <= most and blocks == -(-tokens // most)
    assert 0 <= blocks * chunk - tokens < 8 * blocks
    if tokens % most == 0:
        assert chunk == most


def test_bad_arguments():
    x = np.zeros((1, 4, 6), np.float32)
    with pytest.raises(ValueError, match="unknown implementation 'sparse'"):
        attention(x, x, x, heads=2, implementation="sparse")
    with pytest.raises(ValueError, match="does not split into 4 heads"):
        attention(x, x, x, heads=4)
    with pytest.raises(ValueError, match="expected q"):
        attention(x[0], x, x, heads=2)


@pytest.fixture
def tpu_kernel_on_cpu(monkeypatch):
    """Programs traced as for a TPU, with the Pallas TPU kernel run by Pallas' TPU interpreter on this CPU."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    real, calls = tpu_flash.pl.pallas_call, []

    def interpreted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs, interpret=pltpu.InterpretParams())

    monkeypatch.setattr(tpu_flash.pl, "pallas_call", interpreted)
    with ops_attention.lowering_for("tpu"):
        yield calls  # the kernels traced


@pytest.mark.parametrize("t,s,d", [(128, 256, 40), (256, 128, 64), (128, 77, 40), (100, 128, 8)])
def test_pallas_tpu_kernel_matches_torch(tpu_kernel_on_cpu, t, s, d):
    """The TPU flash-attention kernel where it takes the shapes (sequences in blocks of 128), XLA's attention where
    it does not (77 text tokens, 100 queries): the same numbers either way."""
    rng = np.random.default_rng(t + s + d)
    heads = 2
    q = rng.standard_normal((2, t, heads * d), dtype=np.float32) * 2
    k = rng.standard_normal((2, s, heads * d), dtype=np.float32) * 2
    v = rng.standard_normal((2, s, heads * d), dtype=np.float32)
    takes = ops_attention.pallas_takes(t, s, d, d)
    assert takes == (t % 128 == 0 and s % 128 == 0)
    got = jax.jit(lambda q, k, v: attention(q, k, v, heads=heads, implementation="pallas"))(q, k, v)
    assert bool(tpu_kernel_on_cpu) == takes  # the kernel ran exactly where it takes the shapes
    np.testing.assert_allclose(np.asarray(got), _torch_sdpa(q, k, v, heads), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("data,model", [(4, 1), (2, 2)])
def test_pallas_on_a_mesh_runs_per_device(tpu_kernel_on_cpu, data, model):
    """XLA cannot partition a Mosaic kernel: on a mesh the kernel runs per device (`shard_map`, batch over the data
    axis, heads over the model axis) and gives the unpartitioned numbers. Here on 4 of this CPU's devices."""
    from sdjax.parallel.sharding import batch_sharding, make_mesh

    mesh = make_mesh(data, model, jax.devices()[:4])
    rng = np.random.default_rng(data)
    q, k, v = (rng.standard_normal((4, 128, 4 * 8), dtype=np.float32) for _ in range(3))
    placed = [jax.device_put(x, batch_sharding(mesh)) for x in (q, k, v)]
    with ops_attention.lowering_for("tpu", mesh):
        got = jax.jit(lambda q, k, v: attention(q, k, v, heads=4, implementation="pallas"))(*placed)
    assert tpu_kernel_on_cpu
    np.testing.assert_allclose(np.asarray(got), _torch_sdpa(q, k, v, 4), rtol=2e-5, atol=2e-5)


def test_pallas_upcast_runs_the_kernel_in_float32(tpu_kernel_on_cpu):
    """SD 2.x's `upcast_attention` with bf16 activations: the kernel gets float32 q, k and v, so its output is the
    float32 attention rounded once to bf16."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 2 * 64)), jnp.bfloat16) for _ in range(3))
    got = jax.jit(lambda q, k, v: attention(q, k, v, heads=2, implementation="pallas", upcast=True))(q, k, v)
    assert got.dtype == jnp.bfloat16 and tpu_kernel_on_cpu
    f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    want = _torch_sdpa(*f32, 2)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)
    assert np.abs(np.asarray(got, np.float32) - want).max() <= np.abs(want).max() * 2**-8  # one bf16 rounding


def test_pallas_is_refused_outside_tpu_programs():
    x = np.zeros((1, 128, 8), np.float32)
    with pytest.raises(ValueError, match="attention='pallas' is the TPU kernel.*'cpu'"):
        attention(x, x, x, heads=1, implementation="pallas")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (sdjax[tpu-aot])")
def test_pallas_keeps_no_score_matrix_on_a_tpu():
    """Compiled for a v5e chip (no TPU needed): SD 1.5's first-level self-attention (8 heads of 40 over 4096
    tokens, CFG batch 2). XLA's attention keeps the float32 scores, 2 x 8 x 4096 x 4096 x 4 bytes = 1 GiB; the
    kernel keeps blocks in the chip's VMEM and needs no HBM temporaries of that size."""
    from jax.sharding import SingleDeviceSharding

    from sdjax import aot

    device = aot.topology_devices("v5e-1")[1][0]
    x = jax.ShapeDtypeStruct((2, 4096, 8 * 40), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    temps = {}
    with ops_attention.lowering_for("tpu"):
        for impl in ("xla", "pallas"):
            fn = jax.jit(lambda q, k, v, impl=impl: attention(q, k, v, heads=8, implementation=impl))
            temps[impl] = fn.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
    assert temps["xla"] >= 2 * 8 * 4096 * 4096 * 4
    assert temps["pallas"] < 2 * 4096 * 8 * 40 * 2 * 4  # a few copies of q/k/v/out at most


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (sdjax[tpu-aot])")
def test_pallas_on_a_tpu_slice_is_not_gathered():
    """On a v5e-4 with the batch split over the chips, each chip runs the kernel on its own images: no all-gather,
    and about a quarter of the whole attention's FLOPs per chip (as XLA's partitioned attention)."""
    from jax.sharding import NamedSharding

    from sdjax import aot
    from sdjax.parallel.sharding import make_mesh

    mesh = make_mesh(4, 1, aot.topology_devices("v5e-4")[1])
    x = jax.ShapeDtypeStruct((8, 1024, 8 * 40), jnp.bfloat16, sharding=NamedSharding(mesh, jax.P("data")))
    flops = {}
    with ops_attention.lowering_for("tpu", mesh):
        for impl in ("xla", "pallas"):
            fn = jax.jit(lambda q, k, v, impl=impl: attention(q, k, v, heads=8, implementation=impl))
            compiled = fn.lower(x, x, x).compile()
            assert "all-gather" not in compiled.as_text(), impl
            cost = compiled.cost_analysis()
            flops[impl] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    whole = 2 * 2 * 8 * 8 * 1024 * 1024 * 40  # q k^T and p v, every image and head
    assert flops["xla"] == pytest.approx(whole / 4, rel=0.1)
    assert flops["pallas"] == pytest.approx(whole / 4, rel=0.1)
