"""The measuring loop of the embedded model's quantized-compute tables (benchmarks/quant_compute_quality.py: Dense
layers only; benchmarks/quant_conv_quality.py: convolutions too), kept in one place so that both tables measure the
same way: the shape evaluation's 28 held-out prompts, seed 0, against the float32 images of the same step count
(max / mean abs, PSNR) and the shape/colour accuracy (`sdjax.evaluation.shapes.score`); a calibrated variant
calibrates on `CALIBRATION_PROMPTS` (not among the held-out prompts), a seed of 1, 8 steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

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
ATTRIBUTES = ("colour", "background", "shape", "position", "size")


def measure(variants: Iterable[tuple[str, object, bool]], steps: Sequence[int]) -> Iterator[dict]:
    """Yields a row per variant and step count, in that order, as each is measured (a caller prints it at once):
    `variant`, `steps`, `max_abs`, `mean_abs`, `psnr_db` (None for images equal to the reference) and `accuracy`
    (per attribute and `all`). `variants` are `(label, QuantPolicy or None, calibrated)`; the float32 one (policy
    None) must come first: its images are the reference of the others."""
    from sdjax import quant
    from sdjax.evaluation.shapes import held_out_prompts, score
    from sdjax.pipelines.auto import load_pipeline

    prompts, scenes = held_out_prompts(2)
    base = {}
    for label, policy, calibrated in variants:
        pipe, _ = load_pipeline(None, **({"quantize": policy} if policy else {}))
        if calibrated:
            quant.use_calibration(pipe, quant.calibrate(pipe, CALIBRATION_PROMPTS, steps=8, seed=1))
        for n in steps:
            images = np.asarray(pipe.generate(prompts, steps=n, seed=0, output_type="np"), np.float32)
            if policy is None:
                base[n] = images
            d = np.abs(images - base[n])
            psnr = 10 * np.log10(1.0 / max(float(np.mean(d**2)), 1e-20)) if d.max() > 0 else None
            acc = score([(255 * np.clip(x, 0, 1)).round().astype(np.uint8) for x in images], scenes)
            yield dict(
                variant=label,
                steps=n,
                max_abs=float(d.max()),
                mean_abs=float(d.mean()),
                psnr_db=None if psnr is None else float(psnr),
                accuracy={k: float(v) for k, v in acc.items()},
            )
