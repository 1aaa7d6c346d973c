"""Image-to-image cost against strength, and inpainting against text-to-image, sdjax vs PyTorch diffusers.

Both frameworks run the same model folder (default: the embedded model, a real SD 1.x diffusers folder) with the
same sampler, steps and batch, in one process, alternating call by call so that a busy machine slows both alike.
Reported: the median and best wall time per call after one warm call (compilation excluded), and sdjax / torch
(< 1: sdjax faster). The number of model calls each run makes is printed too: img2img at strength s runs
`int(steps * s)` steps (diffusers' rule, which both follow).

    python benchmarks/bench_tasks.py --steps 20 --reps 5 --json tasks.json
    python benchmarks/bench_tasks.py --model path/to/sd15 --height 512 --width 512 --steps 20 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _images(size: tuple[int, int]):
    import numpy as np
    from PIL import Image

    h, w = size
    r = np.random.default_rng(0)
    image = Image.fromarray(r.integers(0, 255, (h // 8, w // 8, 3), np.uint8)).resize((w, h), Image.BILINEAR)
    m = np.zeros((h, w), np.uint8)
    m[h // 4 : 3 * h // 4, w // 4 : 3 * w // 4] = 255
    return image, Image.fromarray(m)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="diffusers folder (default: the embedded model)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import diffusers
    import torch

    from sdjax import runtime

    runtime.configure_cpu()
    from sdjax.pipelines import load_pipeline
    from sdjax.pipelines.auto import resolve_alias

    torch.set_num_threads(args.threads)
    folder = resolve_alias(args.model or "embedded")
    pipe, _ = load_pipeline(folder, safety_checker=None)
    tpipe = diffusers.StableDiffusionPipeline.from_pretrained(folder, safety_checker=None).to(torch.float32)
    tpipe.set_progress_bar_config(disable=True)
    dh, dw = pipe.default_size
    size = (args.height or dh, args.width or dw)
    image, mask = _images(size)
    sampler = pipe.default_sampler
    cases = [("txt2img", {})] + [(f"img2img s={s}", {"image": image, "strength": s}) for s in (0.25, 0.5, 0.75, 1.0)]
    cases += [("inpaint s=1.0", {"image": image, "mask_image": mask, "strength": 1.0})]

    def torch_call(kw):
        common = dict(
            prompt="a red circle on a blue background",
            num_inference_steps=args.steps,
            output_type="np",
            height=size[0],
            width=size[1],
        )
        with torch.no_grad():
            if "mask_image" in kw:
                return diffusers.StableDiffusionInpaintPipeline(**tpipe.components)(**common, **kw)
            if "image" in kw:
                common.pop("height"), common.pop("width")
                return diffusers.StableDiffusionImg2ImgPipeline(**tpipe.components)(**common, **kw)
            return tpipe(**common)

    def jax_call(kw):
        return pipe.generate(
            "a red circle on a blue background", steps=args.steps, height=size[0], width=size[1], output_type="np", **kw
        )

    rows = []
    for name, kw in cases:
        calls = []

        def count(stage, step, total, calls=calls):
            if stage == "denoise" and step == 0:
                calls.append(total)

        pipe.generate("warm", steps=args.steps, height=size[0], width=size[1], output_type="np", progress=count, **kw)
        torch_call(kw)
        jax_call(kw)  # warm (the counting run compiled the interactive variant)
        tj, tt = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax_call(kw)
            tj.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch_call(kw)
            tt.append(time.perf_counter() - t0)
        rows.append(
            {
                "case": name,
                "model_calls": calls[0],
                "sdjax_median_s": statistics.median(tj),
                "sdjax_best_s": min(tj),
                "torch_median_s": statistics.median(tt),
                "torch_best_s": min(tt),
                "ratio_median": statistics.median(tj) / statistics.median(tt),
            }
        )
        print(
            f"{name:16s} calls {calls[0]:3d}  sdjax {rows[-1]['sdjax_median_s']:.3f} s  torch "
            f"{rows[-1]['torch_median_s']:.3f} s  ratio {rows[-1]['ratio_median']:.2f}",
            flush=True,
        )
    result = {
        "model": args.model or "sdjax/embedded",
        "size": list(size),
        "steps": args.steps,
        "reps": args.reps,
        "sampler": sampler,
        "threads": args.threads,
        "rows": rows,
    }
    print("\n| case | model calls | sdjax median s | torch median s | sdjax / torch |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['model_calls']} | {r['sdjax_median_s']:.3f} | {r['torch_median_s']:.3f} | "
            f"{r['ratio_median']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
