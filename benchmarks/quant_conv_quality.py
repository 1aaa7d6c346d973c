"""Quantized compute with convolutions on the embedded model (docs/benchmarks.md, quantization section;
docs/quantization.md, "Quantized compute"): int8 x int8 / fp8 x fp8 products in the Dense layers only
(`QuantPolicy(compute_convs=False)`) against the Dense layers and 2-D convolutions (the default), with per-call and
calibrated input scales, the UNet's first/last and small 1x1 convs too (`min_size=1024`), and the VAE
(`components=(..., "vae")`, `min_size=2048`: the embedded VAE's kernels are small); int8 weight-only for reference.

The shape evaluation's 28 held-out prompts, seed 0, against the float32 images of the same step count: max / mean
abs, PSNR and the shape/colour accuracy (`sdjax.evaluation.shapes.score`); the calibration runs on 8 prompts that
are not among them (a seed of 1, 8 steps). Run:

    python benchmarks/quant_conv_quality.py --steps 4 8 20 --json quant_conv_quality.json

`--only WORD ...` keeps the variants whose label contains one of the words (float32, the reference, always runs).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from quant_compute_quality import CALIBRATION_PROMPTS  # the same 8 calibration prompts as the Dense-only table

ATTRIBUTES = ("colour", "background", "shape", "position", "size")


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
    from sdjax.evaluation.shapes import held_out_prompts, score
    from sdjax.pipelines.auto import load_pipeline

    prompts, scenes = held_out_prompts(2)
    rows, base = [], {}
    for label, policy, calibrated in variants(quant):
        if args.only and policy is not None and not any(word in label for word in args.only):
            continue
        t0 = time.perf_counter()
        pipe, _ = load_pipeline(None, **({"quantize": policy} if policy else {}))
        if calibrated:
            quant.use_calibration(pipe, quant.calibrate(pipe, CALIBRATION_PROMPTS, steps=8, seed=1))
        for steps in args.steps:
            images = np.asarray(pipe.generate(prompts, steps=steps, seed=0, output_type="np"), np.float32)
            if policy is None:
                base[steps] = images
            d = np.abs(images - base[steps])
            psnr = 10 * np.log10(1.0 / max(float(np.mean(d**2)), 1e-20)) if d.max() > 0 else None
            acc = score([(255 * np.clip(x, 0, 1)).round().astype(np.uint8) for x in images], scenes)
            rows.append(
                dict(
                    variant=label,
                    steps=steps,
                    max_abs=float(d.max()),
                    mean_abs=float(d.mean()),
                    psnr_db=psnr,
                    accuracy={k: float(v) for k, v in acc.items()},
                )
            )
            shown = "-" if psnr is None else f"{psnr:.1f}"
            print(
                f"| {label} | {steps} | {d.max():.3f} | {d.mean():.4f} | {shown} | "
                + " | ".join(f"{acc[k]:.2f}" for k in (*ATTRIBUTES, "all"))
                + " |",
                flush=True,
            )
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
