"""Quantized compute with convolutions on the embedded model (docs/benchmarks.md, quantization section;
docs/quantization.md, "Quantized compute"): int8 x int8 / fp8 x fp8 products in the Dense layers only
(`QuantPolicy(compute_convs=False)`) against the Dense layers and 2-D convolutions (the default), with per-call and
calibrated input scales, the UNet's first/last and small 1x1 convs too (`min_size=1024`), and the VAE
(`components=(..., "vae")`, `min_size=2048`: the embedded VAE's kernels are small); int8 weight-only for reference.

The shape evaluation's 28 held-out prompts, seed 0, against the float32 images of the same step count: max / mean
abs, PSNR and the shape/colour accuracy (`sdjax.evaluation.shapes.score`); the calibration runs on 8 prompts that
are not among them (a seed of 1, 8 steps; the loop: benchmarks/quant_measure.py). Run:

    python benchmarks/quant_conv_quality.py --steps 4 8 20 --json quant_conv_quality.json

`--only WORD ...` keeps the variants whose label contains one of the words (float32, the reference, always runs).
"""

from __future__ import annotations

import argparse
import json
import time

from quant_measure import ATTRIBUTES, measure  # measured as the Dense-only table (quant_compute_quality.py)


def variants(quant) -> list[tuple[str, object, bool]]:
    """`(label, QuantPolicy or None for float32, calibrated)` of every variant."""
    Q = quant.QuantPolicy
    unet = ("unet",)
    return [
        ("float32", None, False),
        ("int8 weight-only", Q("int8", components=unet), False),
        ("int8 compute, Dense only", Q("int8", components=unet, compute="int8", compute_convs=False), False),
        ("int8 compute, Dense + convs", Q("int8", components=unet, compute="int8"), False),
        ("int8 compute, Dense + convs, calibrated", Q("int8", components=unet, compute="int8"), True),
        (
            "int8 compute, + first/last/1x1 convs (min_size 1024)",
            Q("int8", components=unet, compute="int8", min_size=1024),
            False,
        ),
        (
            "int8 compute, UNet + VAE (min_size 2048)",
            Q("int8", components=("unet", "vae"), compute="int8", min_size=2048),
            False,
        ),
        (
            "int8 compute, VAE only (min_size 2048)",
            Q("int8", components=("vae",), compute="int8", min_size=2048),
            False,
        ),
        ("fp8 compute, Dense only", Q("fp8", components=unet, compute="fp8", compute_convs=False), False),
        ("fp8 compute, Dense + convs", Q("fp8", components=unet, compute="fp8"), False),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 8, 20])
    parser.add_argument("--only", nargs="*", default=None, help="Variants whose label contains one of these words.")
    parser.add_argument("--json", default=None, help="Write the rows to this JSON file.")
    args = parser.parse_args()

    from sdjax import quant

    chosen = [v for v in variants(quant) if not args.only or v[1] is None or any(w in v[0] for w in args.only)]
    rows, t0 = [], time.perf_counter()
    for i, row in enumerate(measure(chosen, args.steps), 1):
        rows.append(row)
        psnr, acc = row["psnr_db"], row["accuracy"]
        shown = "-" if psnr is None else f"{psnr:.1f}"
        print(
            f"| {row['variant']} | {row['steps']} | {row['max_abs']:.3f} | {row['mean_abs']:.4f} | {shown} | "
            + " | ".join(f"{acc[k]:.2f}" for k in (*ATTRIBUTES, "all"))
            + " |",
            flush=True,
        )
        if i % len(args.steps) == 0:  # a variant's last step count: its time (loading, calibration, generation)
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            t0 = time.perf_counter()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
