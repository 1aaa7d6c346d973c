"""`sdjax.ops.attention.attention`: every implementation equals PyTorch's scaled_dot_product_attention."""

import jax
import numpy as np
import pytest

from sdjax.ops.attention import IMPLEMENTATIONS, attention


def _torch_sdpa(q, k, v, heads):
    torch = pytest.importorskip("torch")
    b, t, c = q.shape
    split = lambda x: torch.from_numpy(x).view(b, x.shape[1], heads, -1).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
    return out.transpose(1, 2).reshape(b, t, -1).numpy()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
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


def test_bad_arguments():
    x = np.zeros((1, 4, 6), np.float32)
    with pytest.raises(ValueError, match="unknown implementation 'sparse'"):
        attention(x, x, x, heads=2, implementation="sparse")
    with pytest.raises(ValueError, match="does not split into 4 heads"):
        attention(x, x, x, heads=4)
    with pytest.raises(ValueError, match="expected q"):
        attention(x[0], x, x, heads=2)
