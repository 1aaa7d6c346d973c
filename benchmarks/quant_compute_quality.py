"""Quantized compute on the embedded model (docs/quantization.md, "Quantized compute"): int8 / fp8 weight-only
against int8 x int8 / fp8 x fp8 Dense layers with dynamic (per-call) and calibrated (static) input scales. The
convolutions stay weight-only here (`compute_convs=False`, table (a2) of docs/benchmarks.md); with them in 8 bits too:
benchmarks/quant_conv_quality.py.

The shape evaluation's 28 held-out prompts, seed 0, against the float32 images of the same step count (max / mean
abs, PSNR) and the shape/colour accuracy; the calibration runs on 8 prompts that are not among them (a seed of 1,
the default 8 steps; the loop: benchmarks/quant_measure.py).
Run: `python benchmarks/quant_compute_quality.py [--steps 8 20] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json

from quant_measure import ATTRIBUTES, measure


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 20])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from sdjax import quant

    variants = [
        ("float32", None, False),
        ("int8 weight-only", quant.QuantPolicy("int8", components=("unet",)), False),
        (
            "int8 compute, dynamic",
            quant.QuantPolicy("int8", components=("unet",), compute="int8", compute_convs=False),
            False,
        ),
        (
            "int8 compute, calibrated",
            quant.QuantPolicy("int8", components=("unet",), compute="int8", compute_convs=False),
            True,
        ),
        ("fp8 weight-only", quant.QuantPolicy("fp8", components=("unet",)), False),
        (
            "fp8 compute, dynamic",
            quant.QuantPolicy("fp8", components=("unet",), compute="fp8", compute_convs=False),
            False,
        ),
        (
            "fp8 compute, calibrated",
            quant.QuantPolicy("fp8", components=("unet",), compute="fp8", compute_convs=False),
            True,
        ),
    ]
    rows = []
    for row in measure(variants, args.steps):
        rows.append(row)
        psnr, acc = row["psnr_db"], row["accuracy"]
        print(
            f"| {row['variant']} | {row['steps']} | {row['max_abs']:.3f} | {row['mean_abs']:.4f} | "
            f"{float('nan') if psnr is None else psnr:.1f} | "
            + " | ".join(f"{acc[k]:.2f}" for k in ATTRIBUTES)
            + f" | {acc['all']:.3f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
