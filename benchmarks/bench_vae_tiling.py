"""VAE tiling: XLA's memory analysis of the SD 1.5 VAE decode (and encode) at a large size, whole image vs tiled.

    python benchmarks/bench_vae_tiling.py [--size 2048] [--dtype float32] [--encode] [--unrolled] [--json out.json]

The SD 1.5 VAE (the released config, `sdjax.bench.ARCHITECTURES["sd15"]`) with abstract params (shapes only:
nothing is allocated or run), `jax.jit(decode).lower(ShapeDtypeStruct...).compile().memory_analysis()` for one
`size x size` image: the whole-image decode, the tiled decode (`models.vae_tiling`, diffusers' 512 px tiles with
0.25 overlap, each tile shape under one `lax.map`) and, with `--unrolled`, the same tiles as a Python loop (every
tile its own code in one program) to show what the `lax.map` buys. Temporaries are XLA's `temp_size_in_bytes`
(the peak of intermediate buffers); arguments are the weights plus the input. Compiles for the default backend
(CPU here), with sdjax's CPU flags.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from unittest import mock


def _unrolled_map(f, xs):
    import jax
    import jax.numpy as jnp

    n = jax.tree_util.tree_leaves(xs)[0].shape[0]
    return jnp.stack([f(jax.tree_util.tree_map(lambda x, i=i: x[i], xs)) for i in range(n)])


def measure(kind: str, mode: str, size: int, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp

    from sdjax.bench import ARCHITECTURES
    from sdjax.core import autoencoder
    from sdjax.models import vae as V
    from sdjax.models import vae_tiling

    config = V.AutoencoderKLConfig.from_dict(dict(ARCHITECTURES["sd15"].vae))
    dt = jnp.dtype(dtype)
    vae = V.AutoencoderKL(config, dtype=dt)
    params = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), V.init_params_shape(config))
    tiling = None if mode == "whole" else vae_tiling.VaeTiling.for_config(config)
    if kind == "decode":
        x = jax.ShapeDtypeStruct((1, config.latent_channels, size // 8, size // 8), jnp.float32)

        def fn(p, z):
            return autoencoder.decode(vae, p, z, dt, tiling)
    else:
        x = jax.ShapeDtypeStruct((1, 3, size, size), jnp.float32)

        def fn(p, images):
            return autoencoder.encode(vae, p, images, None, dt, tiling)

    patch = mock.patch.object(jax.lax, "map", _unrolled_map) if mode == "unrolled" else mock.MagicMock()
    t0 = time.perf_counter()
    with patch:
        compiled = jax.jit(fn).lower(params, x).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    weights = sum(math.prod(s.shape) * dt.itemsize for s in jax.tree_util.tree_leaves(params))
    return {
        "kind": kind,
        "mode": mode,
        "size": size,
        "dtype": dtype,
        "compile_s": compile_s,
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "weights_bytes": int(weights),
        "backend": jax.default_backend(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048, help="image edge in pixels (a multiple of 8)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--encode", action="store_true", help="also the encoder (image-to-image, inpainting)")
    p.add_argument("--unrolled", action="store_true", help="also the tiles as an unrolled Python loop")
    p.add_argument("--json")
    args = p.parse_args()
    from sdjax.runtime import configure_cpu

    configure_cpu()
    modes = ["whole", "tiled"] + (["unrolled"] if args.unrolled else [])
    rows = []
    for kind in ["decode"] + (["encode"] if args.encode else []):
        for mode in modes:
            rows.append(measure(kind, mode, args.size, args.dtype))
            r = rows[-1]
            print(f"  {kind} {mode}: temp {r['temp_bytes'] / 2**20:.0f} MiB (compile {r['compile_s']:.0f} s)")
    mib = 2**20
    print(f"\nSD 1.5 VAE, {args.size}x{args.size}, batch 1, {args.dtype}, backend {rows[0]['backend']}")
    print(f"{'':8s} {'mode':9s} {'temp MiB':>10s} {'args MiB':>9s} {'out MiB':>8s} {'compile s':>10s}")
    for r in rows:
        print(
            f"{r['kind']:8s} {r['mode']:9s} {r['temp_bytes'] / mib:10.0f} {r['argument_bytes'] / mib:9.0f} "
            f"{r['output_bytes'] / mib:8.0f} {r['compile_s']:10.1f}"
        )
    print(json.dumps(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
