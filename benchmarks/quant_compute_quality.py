"""Quantized compute on the embedded model (docs/quantization.md, "Quantized compute"): int8 / fp8 weight-only
against int8 x int8 / fp8 x fp8 Dense layers with dynamic (per-call) and calibrated (static) input scales. The
convolutions stay weight-only here (`compute_convs=False`, table (a2) of docs/benchmarks.md); with them in 8 bits too:
benchmarks/quant_conv_quality.py.

The shape evaluation's 28 held-out prompts, seed 0, against the float32 images of the same step count (max / mean
abs, PSNR) and the shape/colour accuracy; the calibration runs on 8 prompts that are not among them (a seed of 1,
the default 8 steps). Run: `python benchmarks/quant_compute_quality.py [--steps 8 20] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

CALIBRATION_PROMPTS = [
    "a yellow triangle on a black background",
    "a small white circle in the top left corner",
    "a large blue square on a red background",
    "a purple circle at the bottom",
    "a green triangle on a white background",
    "an orange square in the center",
    "a big red triangle on a green background",
    "a tiny black circle on a yellow background",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 20])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from sdjax import quant
    from sdjax.evaluation.shapes import held_out_prompts, score
    from sdjax.pipelines.auto import load_pipeline

    prompts, scenes = held_out_prompts(2)
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
    rows, base = [], {}
    for label, policy, calibrated in variants:
        pipe, _ = load_pipeline(None, **({"quantize": policy} if policy else {}))
        if calibrated:
            quant.use_calibration(pipe, quant.calibrate(pipe, CALIBRATION_PROMPTS, steps=8, seed=1))
        for steps in args.steps:
            images = np.asarray(pipe.generate(prompts, steps=steps, seed=0, output_type="np"), np.float32)
            if policy is None:
                base[steps] = images
            d = np.abs(images - base[steps])
            psnr = 10 * np.log10(1.0 / max(float(np.mean(d**2)), 1e-20))
            acc = score([(255 * np.clip(x, 0, 1)).round().astype(np.uint8) for x in images], scenes)
            row = dict(
                variant=label,
                steps=steps,
                max_abs=float(d.max()),
                mean_abs=float(d.mean()),
                psnr_db=float(psnr) if d.max() > 0 else None,
                accuracy=acc,
            )
            rows.append(row)
            print(
                f"| {label} | {steps} | {row['max_abs']:.3f} | {row['mean_abs']:.4f} | "
                f"{psnr if d.max() > 0 else float('nan'):.1f} | "
                + " | ".join(f"{acc[k]:.2f}" for k in ("colour", "background", "shape", "position", "size"))
                + f" | {acc['all']:.3f} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
