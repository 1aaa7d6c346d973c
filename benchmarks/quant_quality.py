"""Quality of weight-only quantization on the embedded model (docs/quantization.md, table (a)).

For each weight format (float32, bfloat16, int8 and fp8 with float32 and with bfloat16 compute) and each step count:
the images of the shape evaluation's held-out prompts against the float32 images (max / mean abs difference, PSNR
over the batch) and the shape/colour evaluation's accuracy (`sdjax.evaluation.shapes.score`, "all" attributes
right, and per attribute). Run: `python benchmarks/quant_quality.py [--steps 4 8 20] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 8, 20])
    parser.add_argument("--per-combination", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from sdjax.evaluation.shapes import held_out_prompts, score
    from sdjax.pipelines.auto import load_pipeline

    prompts, scenes = held_out_prompts(args.per_combination)
    formats = [
        ("float32", "float32", None),
        ("bfloat16", "bfloat16", None),
        ("int8 (fp32 compute)", "float32", "int8"),
        ("fp8 (fp32 compute)", "float32", "fp8"),
        ("int8 (bf16 compute)", "bfloat16", "int8"),
        ("fp8 (bf16 compute)", "bfloat16", "fp8"),
    ]
    rows, base = [], {}
    for label, dtype, quantize in formats:
        pipe, _ = load_pipeline(None, dtype=dtype, **({"quantize": quantize} if quantize else {}))
        for steps in args.steps:
            t = time.perf_counter()
            images = np.asarray(pipe.generate(prompts, steps=steps, seed=args.seed, output_type="np"), np.float32)
            seconds = time.perf_counter() - t
            if label == "float32":
                base[steps] = images
            d = np.abs(images - base[steps])
            psnr = 10 * np.log10(1.0 / max(float(np.mean(d**2)), 1e-20))
            acc = score([(255 * np.clip(x, 0, 1)).round().astype(np.uint8) for x in images], scenes)
            row = dict(
                weights=label,
                steps=steps,
                images=len(prompts),
                max_abs=float(d.max()),
                mean_abs=float(d.mean()),
                psnr_db=float(psnr) if d.max() > 0 else float("inf"),
                accuracy_all=acc["all"],
                accuracy={k: v for k, v in acc.items() if k != "all"},
                seconds=seconds,
            )
            rows.append(row)
            print(
                f"{label:22s} steps={steps:3d} max={row['max_abs']:.4f} mean={row['mean_abs']:.4f} "
                f"psnr={row['psnr_db']:.1f} dB accuracy(all)={row['accuracy_all']:.3f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
