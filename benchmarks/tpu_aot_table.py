"""Will it fit on a TPU slice? SD 1.5, SD 2.1 and SDXL compiled for TPU slices on a machine without a TPU.

    python benchmarks/tpu_aot_table.py [--models sd15,sd21,sdxl] [--per-chip 1,4,8] \
        [--targets v5e-1,v5e-4,v5e-8,v6e-4,v4-8] [--steps 30] [--dtype bfloat16] [--no-unet-cost] \
        [--vae-slicing] [--attention NAME] [--controlnets N] [--fsdp] [--quantize int8|fp8] \
        [--quant-compute int8|fp8] [--static-scales] [--out tpu_aot.jsonl] [--markdown]

Each row is `sdjax.aot.compile_for` (libtpu's compiler; `pip install 'sdjax[tpu-aot]'`) of the whole generation at
the model's native size (SD 1.5 512, SD 2.1 768, SDXL 1024) with a global batch of `per-chip x chips`, in a fresh
process (a compile of SDXL takes minutes and a few GB of host memory). Rows are appended to `--out` as JSON lines
as they finish, and a row already in `--out` is not compiled again, so the table can be filled over several
sessions. A compile that kills its process (libtpu's compiler has crashed on some shapes) is recorded as such, not
tried again. `--vae-slicing` compiles the rows with the VAE run one image per chip at a time (`sdjax compile
--vae-slicing`); such rows are rows of their own, as are `--fsdp` rows (the large weights split over the data axis
too), `--dtype fp8` rows (Flux / SD 3: float8 matmul kernels, bfloat16 compute) and `--quantize` /
`--quant-compute` rows (`sdjax compile --quantize ... --quant-compute ...`: the denoiser's kernels 8-bit, and its
Dense layers and convs multiplied 8-bit x 8-bit; the roofline counts those products at the chip's int8 rate).
`--static-scales` (with `--quant-compute`) gives those products static input scales, as a calibration file does
(`sdjax compile --calibration FILE`), from `Calibration.placeholder_for`: one range for every layer, since no
full-size weights exist here to calibrate; the program's memory, FLOPs and bytes do not depend on the constants.
`--models` also takes `flux-dev`, `flux-schnell`, `sd35-large`, `sd35-medium` (1024x1024; give their `--steps`: 28,
4, 28, 28).
`--markdown` prints the table of everything in `--out`.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

SIZES = {"sd15": 512, "sd21": 768, "sdxl": 1024, "flux-dev": 1024, "flux-schnell": 1024}
SIZES.update({"sd35-large": 1024, "sd35-medium": 1024, "sd3-medium": 1024})
FP8 = ("fp8", "float8", "float8_e4m3fn")  # `--dtype fp8`: float8 matmul kernels, bfloat16 compute
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


def key(row: dict) -> tuple:
    dtype, weights = row["dtype"], row.get("weights_dtype")
    if str(dtype).lower() in FP8:  # a spec's `fp8` is a report's bfloat16 compute + float8 weights
        dtype, weights = "bfloat16", "float8_e4m3fn"
    return (
        row["model"],
        row["target"],
        row["batch"],
        row["steps"],
        dtype,
        bool(row.get("vae_slicing")),
        row.get("attention", "auto"),
        row.get("controlnets", 0),
        weights,
        bool(row.get("fsdp")),
        row.get("quantize"),
        row.get("quant_compute"),
        bool(row.get("static_scales") or row.get("calibration")),
    )


def child(spec: dict) -> dict:
    from sdjax import aot

    calibration = None
    if spec.get("static_scales"):
        from sdjax.quant import Calibration

        pipe, params = aot.abstract_pipeline(
            spec["model"], spec["dtype"], quantize=spec.get("quantize"), quant_compute=spec.get("quant_compute")
        )
        calibration = Calibration.placeholder_for(params, pipe.quantization)
    report = aot.compile_for(
        spec["target"],
        model=spec["model"],
        size=SIZES.get(spec["model"]),
        batch=spec["batch"],
        steps=spec["steps"],
        dtype=spec["dtype"],
        unet_cost=spec["unet_cost"],
        vae_slicing=spec.get("vae_slicing", False),
        attention=spec.get("attention", "auto"),
        controlnets=spec.get("controlnets", 0),
        fsdp=spec.get("fsdp", False),
        quantize=spec.get("quantize"),
        quant_compute=spec.get("quant_compute"),
        calibration=calibration,
    )
    return report.to_dict()


def variant(row: dict) -> str:
    """The "VAE, attention" column: whole or sliced, the attention when it is not the TPU's own, ControlNets,
    float8 weights, FSDP, quantized denoiser weights and products."""
    attention = row.get("attention", "auto")
    nets = row.get("controlnets", 0)
    fp8 = row.get("weights_dtype") or str(row.get("dtype")).lower() in FP8
    return (
        ("sliced" if row.get("vae_slicing") else "whole")
        + ("" if attention == "auto" else f", {attention} attention")
        + (f", + {nets} ControlNet" if nets else "")
        + (", fp8 weights" if fp8 else "")
        + (", FSDP" if row.get("fsdp") else "")
        + (f", {row['quantize']} weights" if row.get("quantize") else "")
        + (f", {row['quant_compute']} products" if row.get("quant_compute") else "")
        + (", static scales" if row.get("calibration") else "")
    )


def markdown(rows: list[dict]) -> str:
    cols = [
        "model",
        "size",
        "target (chips)",
        "batch (per chip)",
        "VAE, attention",
        "arguments",
        "temporaries",
        "code",
        "total / device",
        "HBM / device",
        "fits",
        "compile s",
        "TFLOP / device",
        "roofline s",
        "roofline img/s",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def gib(n):
        return "-" if n is None else f"{n / 2**30:.2f} GiB"

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in sorted(rows, key=lambda r: (r["model"], r["target"], r["batch"], variant(r))):
        if r.get("crashed"):
            head = [
                r["model"],
                str(r["height"]),
                f"{r['target']} ({r['chips']})",
                f"{r['batch']} ({r['batch'] / r['chips']:g})",
            ]
            cells = head + [variant(r)] + ["-"] * 5 + [f"compiler crashed ({r['crashed']})"]
            lines.append("| " + " | ".join(cells + ["-"] * (len(cols) - len(cells))) + " |")
            continue
        total = gib(r["total_bytes"]) + ("" if r["argument_bytes"] is not None else " (temps; OOM)")
        cells = [
            r["model"],
            str(r["height"]),
            f"{r['target']} ({r['chips']})",
            f"{r['batch']} ({r['batch'] / r['chips']:g})",
            variant(r),
            gib(r["argument_bytes"]),
            gib(r["temp_bytes"]),
            gib(r["code_bytes"]),
            total,
            gib(r["hbm_bytes"]),
            "yes" if r["fits"] else "**no**",
            f"{r['compile_s']:.0f}",
            num(None if r["flops"] is None else r["flops"] / 1e12, ".1f"),
            num(r["roofline_s"], ".2f"),
            num(r["roofline_images_per_s"], ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="sd15,sd21,sdxl")
    ap.add_argument("--per-chip", default="1,4,8")
    ap.add_argument("--targets", default="v5e-1,v5e-4,v5e-8,v6e-4,v4-8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-unet-cost", action="store_true", help="skip the UNet call's compile (no FLOPs/roofline)")
    ap.add_argument("--vae-slicing", action="store_true", help="the VAE one image per chip at a time")
    ap.add_argument("--attention", default="auto", help="the UNet's and VAE's attention (auto: the TPU's own)")
    ap.add_argument("--controlnets", type=int, default=0, help="ControlNets in every model call")
    ap.add_argument("--fsdp", action="store_true", help="also split the large weights over the data axis")
    ap.add_argument("--quantize", choices=("int8", "fp8"), help="the denoiser's kernels quantized (sdjax compile)")
    ap.add_argument("--quant-compute", choices=("int8", "fp8"), help="its products 8-bit x 8-bit (with --quantize)")
    ap.add_argument(
        "--static-scales", action="store_true", help="those products with static input scales (placeholder calibration)"
    )
    ap.add_argument("--out", type=Path, default=Path("tpu_aot.jsonl"))
    ap.add_argument("--markdown", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.static_scales and not args.quant_compute:
        ap.error("--static-scales needs --quant-compute (the scales are those of the 8-bit products' inputs)")
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()] if args.out.exists() else []
    if args.markdown:
        print(markdown(rows))
        return
    from sdjax import aot

    done = {key(r) for r in rows}
    for model in args.models.split(","):
        for target in args.targets.split(","):
            kind, shape = aot.parse_target(target)
            chips = 1
            for d in shape:
                chips *= d
            for per_chip in (int(x) for x in args.per_chip.split(",")):
                spec = {
                    "model": model,
                    "target": target,
                    "batch": per_chip * chips,
                    "steps": args.steps,
                    "dtype": args.dtype,
                    "unet_cost": not args.no_unet_cost,
                    "vae_slicing": args.vae_slicing,
                    "attention": args.attention,
                    "controlnets": args.controlnets,
                    "fsdp": args.fsdp,
                    "quantize": args.quantize,
                    "quant_compute": args.quant_compute,
                    "static_scales": args.static_scales,
                }
                if key(spec) in done:
                    continue
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True
                )
                if proc.returncode != 0:
                    print(f"{spec}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                    if -proc.returncode in CRASH_SIGNALS:  # the compiler crashed (an exception exits 1; a
                        # SIGTERM/SIGKILL is someone stopping the run, or the OOM killer: tried again next time)
                        crash = {**spec, "height": SIZES.get(model), "chips": chips}
                        crash["crashed"] = signal.Signals(-proc.returncode).name
                        with args.out.open("a") as f:
                            f.write(json.dumps(crash) + "\n")
                    continue
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(
                    f"{model} {target} batch {spec['batch']}: total {row['total_bytes'] / 2**30:.2f} GiB/device, "
                    f"fits {row['fits']}, {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
