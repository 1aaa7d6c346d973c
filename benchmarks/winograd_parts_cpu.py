"""Where the time of a Winograd F(2x2, 3x3) convolution goes on CPU (`sdjax.ops.conv.conv3x3_winograd`): the input
transform, the 16 batched matrix products, the output transform, against XLA's direct convolution of the same shape.

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python benchmarks/winograd_parts_cpu.py --reps 7 --json parts.json

(`sdjax.runtime.configure_cpu` sets that flag for the CLI; this script leaves XLA_FLAGS to the caller.) Each part is
its own jitted program on inputs of its real shape, the parts called in turn each round; medians in milliseconds.
The parts' sum can differ from the whole: XLA fuses across them inside one program, and a part's output buffer is
fresh memory on every call. "strided" is the input transform as sdjax wrote it before 2026-11-27 (16 sums of
strided slices), as a part and inside the whole convolution, beside today's separable one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# (batch, height = width, input channels, output channels): the SD 1.5 UNet's 64x64, 32x32 and 16x16 levels at the
# classifier-free-guidance batch, and the VAE decoder's 64x64 and 128x128 levels.
SHAPES = [
    (2, 64, 320, 320),
    (2, 64, 960, 320),
    (2, 32, 640, 640),
    (2, 16, 1280, 1280),
    (1, 64, 512, 512),
    (1, 128, 512, 512),
]

# B^T of Winograd F(2x2, 3x3), for the input transform as sdjax computed it before 2026-11-27 (the reference column).
_BT = ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1))


def strided_input(x):
    """The input transform as 16 sums of strided slices of the padded input (even sizes), stacked."""
    import jax.numpy as jnp

    n, h, w, c = x.shape
    th, tw = h // 2, w // 2
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    d = [[xp[:, i : i + 2 * th - 1 : 2, j : j + 2 * tw - 1 : 2] for j in range(4)] for i in range(4)]
    out = []
    for a in range(4):
        for b in range(4):
            terms = [_BT[a][i] * _BT[b][j] * d[i][j] for i in range(4) for j in range(4) if _BT[a][i] * _BT[b][j]]
            out.append(sum(terms[1:], terms[0]))
    return jnp.stack(out).reshape(16, n * th * tw, c)


def parts(n, h, c, d):
    import jax.numpy as jnp
    import numpy as np

    from sdjax.ops import conv as ops_conv

    rng = np.random.default_rng(0)
    th = h // 2
    x = jnp.asarray(rng.standard_normal((n, h, h, c)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((3, 3, c, d)).astype(np.float32) * 0.05)
    u = ops_conv.winograd_kernel(k)
    v = jnp.asarray(rng.standard_normal((16, n * th * th, c)).astype(np.float32))
    m = jnp.asarray(rng.standard_normal((4, 4, n, th, th, d)).astype(np.float32))
    return {
        "direct": (ops_conv.conv2d, (x, k)),
        "winograd": (ops_conv.conv3x3_winograd, (x, u)),
        "winograd, strided input": (
            lambda x, u: ops_conv.winograd_output(
                jnp.einsum("ptc,pcd->ptd", strided_input(x), u).reshape(4, 4, n, th, th, -1)
            ),
            (x, u),
        ),
        "input transform, strided": (strided_input, (x,)),
        "input transform": (ops_conv.winograd_input, (x,)),
        "16 products": (lambda v, u: jnp.einsum("ptc,pcd->ptd", v, u), (v, u)),
        "output transform": (ops_conv.winograd_output, (m,)),
    }, {
        "direct": 2 * n * h * h * c * d * 9,
        "16 products": 2 * 16 * n * th * th * c * d,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import jax
    import numpy as np

    rows = []
    print(
        "| shape (n, h, cin -> cout) | direct ms | Winograd ms | (strided input) | input transform | (strided) "
        "| 16 products | output transform |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n, h, c, d in SHAPES:
        fns, flops = parts(n, h, c, d)
        compiled = {name: jax.jit(f).lower(*args).compile() for name, (f, args) in fns.items()}
        times = {name: [] for name in compiled}
        for _ in range(a.reps):
            for name, f in compiled.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(*fns[name][1]))
                times[name].append(time.perf_counter() - t0)
        med = {name: float(np.median(t)) for name, t in times.items()}
        gflops = {name: flops[name] / med[name] / 1e9 for name in flops}
        rows.append({"shape": [n, h, h, c, d], "median_s": med, "gflop_per_s": gflops})
        print(
            f"| ({n}, {h}x{h}, {c} -> {d}) | {med['direct'] * 1e3:.1f} ({gflops['direct']:.0f} GFLOP/s) | "
            f"{med['winograd'] * 1e3:.1f} | {med['winograd, strided input'] * 1e3:.1f} | "
            f"{med['input transform'] * 1e3:.1f} | {med['input transform, strided'] * 1e3:.1f} | "
            f"{med['16 products'] * 1e3:.1f} ({gflops['16 products']:.0f} GFLOP/s) | "
            f"{med['output transform'] * 1e3:.1f} |",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"reps": a.reps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
