"""The upsamplers' and the large convolutions' CPU paths, shape by shape, against PyTorch in the same process.

    python benchmarks/upsample_conv_cpu.py [--reps 3] [--json upsample_conv.json]

Two questions, at the shapes of SD 1.5 (UNet: CFG batch 2, 64x64 latents; VAE decoder: 512x512 image), float32:

1. Upsamplers (diffusers `Upsample2D`: nearest 2x, then a 3x3 conv): XLA's convolution of the upsampled tensor
   ("direct"), Winograd F(2x2, 3x3) of it (what sdjax ran for >= 512 input channels before the sub-pixel path),
   and the sub-pixel path (`ops.conv.conv3x3_upsampled`, a 2x2 conv of the input to 4 x Cout channels, its kernel
   prepared ahead as the generator does), against torch `interpolate` + `conv2d`.
2. 3x3 convolutions at the decoder's large sizes: XLA's direct convolution against Winograd (its kernel prepared
   ahead), against torch `conv2d` -- where `ops.conv.WINOGRAD_MAX_PIXELS` comes from.

Each round calls every variant once, so load slows all alike; the ratios are the result. Every variant is checked
against torch (max error relative to the output's scale, in the JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# (n, h, w, cin), cout: the input of each upsampler conv
UPSAMPLERS = [
    ((2, 8, 8, 1280), 1280),  # UNet up block 0
    ((2, 16, 16, 1280), 1280),  # UNet up block 1
    ((2, 32, 32, 640), 640),  # UNet up block 2
    ((1, 64, 64, 512), 512),  # VAE decoder up block 0
    ((1, 128, 128, 512), 512),  # VAE decoder up block 1
    ((1, 256, 256, 256), 256),  # VAE decoder up block 2
]
CONVS = [
    ((1, 64, 64, 512), 512),  # VAE decoder, 64x64 level
    ((1, 128, 128, 512), 512),  # VAE decoder, 128x128 level
    ((1, 256, 256, 512), 256),  # VAE decoder, first conv at 256x256
    ((2, 64, 64, 640), 320),  # UNet up block 3
    ((2, 32, 32, 1280), 640),  # UNet up block 2
]


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def case(kind: str, shape, cout: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from sdjax.ops import conv as ops_conv

    n, h, w, c = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, np.float32)
    k = (rng.standard_normal((3, 3, c, cout)) / np.sqrt(9 * c)).astype(np.float32)
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
    kt = torch.from_numpy(k).permute(3, 2, 0, 1).contiguous()
    xj, kj = jnp.asarray(x), jnp.asarray(k)
    wino = jax.jit(ops_conv.winograd_kernel)(kj)
    sub = jax.jit(ops_conv.subpixel_kernel)(kj)

    if kind == "upsample":

        def torch_fn():
            with torch.no_grad():
                up = torch.nn.functional.interpolate(xt, scale_factor=2.0, mode="nearest")
                return torch.nn.functional.conv2d(up, kt, padding=1)

        up = ops_conv.upsample2x_nearest
        variants = {
            "direct": (jax.jit(lambda x, k: ops_conv.conv2d(up(x), k)), kj),
            "winograd": (jax.jit(lambda x, u: ops_conv.conv3x3_winograd(up(x), u)), wino),
            "subpixel": (jax.jit(ops_conv.conv3x3_upsampled), sub),
        }
    else:

        def torch_fn():
            with torch.no_grad():
                return torch.nn.functional.conv2d(xt, kt, padding=1)

        variants = {
            "direct": (jax.jit(ops_conv.conv2d), kj),
            "winograd": (jax.jit(ops_conv.conv3x3_winograd), wino),
        }
    ref = torch_fn().permute(0, 2, 3, 1).numpy()
    errors = {}
    for name, (fn, arg) in variants.items():
        got = np.asarray(fn(xj, arg))
        errors[name] = float(np.abs(got - ref).max() / np.abs(ref).max())
    times = {name: [] for name in [*variants, "torch"]}
    for r in range(reps):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            fn, arg = variants[name]
            times[name].append(_time(lambda fn=fn, arg=arg: fn(xj, arg).block_until_ready()))
        times["torch"].append(_time(torch_fn))
    medians = {name: statistics.median(v) for name, v in times.items()}
    return {
        "kind": kind,
        "input": list(shape),
        "cout": cout,
        "median_s": medians,
        "over_torch": {name: medians[name] / medians["torch"] for name in variants},
        "max_rel_err": errors,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [case("upsample", s, c, args.reps) for s, c in UPSAMPLERS]
    rows += [case("conv", s, c, args.reps) for s, c in CONVS]
    print("| piece | input (n, h, w, cin) -> cout | torch ms | direct | Winograd | sub-pixel |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        ratios = row["over_torch"]
        cells = [f"{ratios[v]:.2f}" if v in ratios else "" for v in ("direct", "winograd", "subpixel")]
        label = "upsampler (2x + 3x3 conv)" if row["kind"] == "upsample" else "3x3 conv"
        shape = ", ".join(map(str, row["input"]))
        print(f"| {label} | ({shape}) -> {row['cout']} | {1e3 * row['median_s']['torch']:.0f} | {' | '.join(cells)} |")
    if args.json:
        args.json.write_text(json.dumps({"reps": args.reps, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
