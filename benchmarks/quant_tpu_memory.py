"""Off-device TPU compile of a quantized model (docs/quantization.md, table (d)): `sdjax.aot.compile_for(quantize=)`
(what `sdjax compile --quantize` runs: the denoiser's kernels int8 or fp8 with their per-channel scales, dequantized
in the program), against the unquantized compile in the same settings.

    python benchmarks/quant_tpu_memory.py --model sdxl --target v5e-4 --batch 4 --steps 30 --quantize none,int8

One compile per process (SDXL takes minutes and several GB of host memory); rows are printed as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def child(args) -> dict:
    from sdjax import aot

    report = aot.compile_for(
        args.target,
        model=args.model,
        batch=args.batch,
        steps=args.steps,
        dtype=args.dtype,
        unet_cost=not args.no_unet_cost,
        quantize=None if args.quantize == "none" else args.quantize,
    )
    return {"quantize": args.quantize, **report.to_dict()}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="sdxl")
    parser.add_argument("--target", default="v5e-4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantize", default="none,int8")
    parser.add_argument("--no-unet-cost", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    for q in args.quantize.split(","):
        cmd = [sys.executable, __file__, "--child", "--quantize", q]
        for name in ("model", "target", "batch", "steps", "dtype"):
            cmd += [f"--{name}", str(getattr(args, name))]
        cmd += ["--no-unet-cost"] if args.no_unet_cost else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
        print(lines[-1] if lines else json.dumps({"quantize": q, "failed": out.stderr[-2000:]}), flush=True)


if __name__ == "__main__":
    main()
