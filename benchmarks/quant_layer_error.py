"""Per-layer quantization error on random full-size weights: the kernels of one SD 1.5 UNet block (docs/quantization.md,
table (b)).

The block's params are drawn as `sdjax.models.presets.random_params` draws them (kernels N(0, 1/fan_in)); a second
draw with Student-t (3 degrees of freedom) entries, scaled the same way, stands in for the heavy-tailed weights
trained models have (a few large weights set a channel's scale). For each quantized kernel (`QuantPolicy` defaults)
and scheme: the max and mean |error| over the kernel's range max|w|, the worst error in units of the channel's scale,
the SQNR, and the relative error of the layer's output `x @ W` for 256 random inputs (a conv as its im2col matmul).
Run: `python benchmarks/quant_layer_error.py [--block down_blocks_1] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block", default="down_blocks_1")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from sdjax.models.presets import ARCHITECTURES
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel
    from sdjax.quant import params as P
    from sdjax.quant import scheme as S

    shapes = UNet2DConditionModel.init_params_shape(UNet2DConditionConfig(**ARCHITECTURES["sd15"].unet))[args.block]
    policy = P.QuantPolicy("int8")
    kernels = {}

    def collect(path, leaf):
        name = "/".join(str(k.key) for k in path)
        if name.endswith("kernel") and policy.selects(name, leaf):
            kernels[name] = tuple(leaf.shape)

    jax.tree_util.tree_map_with_path(collect, shapes)
    rng = np.random.default_rng(0)
    rows = []
    for name, shape in sorted(kernels.items()):
        fan_in = math.prod(shape[:-1])
        draws = {
            "normal": rng.standard_normal(shape, np.float32),
            "t3": rng.standard_t(3, shape).astype(np.float32) / np.float32(math.sqrt(3.0)),
        }
        x = rng.standard_normal((256, fan_in), np.float32)
        for dist, w in draws.items():
            w = w / np.float32(math.sqrt(fan_in))
            y = x @ w.reshape(fan_in, -1)
            for scheme in ("int8", "fp8"):
                q, scale = S.quantize_kernel(w, scheme)
                stats = S.error_stats(w, q, scale)
                deq = np.asarray(S.dequantize_kernel(q, scale)).reshape(fan_in, -1)
                out_err = float(np.linalg.norm(x @ deq - y) / np.linalg.norm(y))
                bf = np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32)).reshape(fan_in, -1)
                bf_err = float(np.linalg.norm(x @ bf - y) / np.linalg.norm(y))
                row = dict(layer=name, shape=shape, weights=dist, scheme=scheme, output_rel_err=out_err,
                           bf16_output_rel_err=bf_err, **stats)  # fmt: skip
                rows.append(row)
                print(
                    f"{name:55s} {str(shape):20s} {dist:6s} {scheme:4s} max/range={stats['max_err_over_range']:.2e} "
                    f"mean/range={stats['mean_err_over_range']:.2e} max/scale={stats['max_err_in_scales']:.3f} "
                    f"sqnr={stats['sqnr_db']:.1f} dB out={out_err:.2e} (bf16 {bf_err:.2e})",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
