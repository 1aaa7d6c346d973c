"""Will one training step fit a TPU chip? `sdjax train`'s step compiled for TPU slices without a TPU (issue 36).

    python benchmarks/train_tpu_memory.py --cases sdxl:lora:1024,sdxl:lora:1024:remat --targets v5e-1,v5e-8 \
        --out docs/data/train_tpu_memory.jsonl
    python benchmarks/train_tpu_memory.py --cases flux-dev:lora:1024:remat:fsdp --targets v5e-8 --out ...
    python benchmarks/train_tpu_memory.py --markdown --out docs/data/train_tpu_memory.jsonl   # the table + JSON

A case is `MODEL:METHOD:SIZE[:remat][:fsdp][:fp32][:cache][:rankN]` (`sdjax.finetune.train_aot.TrainCase`): a
preset (`sd15`, `sd21`, `sdxl`, `flux-dev`, `flux-schnell`, `sd35-large`, ...), `lora` or `full`, the image side;
`remat` is `--gradient-checkpointing`, `fsdp` the `finetune.sharding` FSDP layout instead of replicated weights,
`fp32` runs without `--mixed-precision bf16` (the default here is bf16), `cache` trains from cached latents (no VAE
in the step), `rankN` the LoRA rank (default 8). One image per chip unless `--per-chip`. Each row is compiled in a
fresh process (an SDXL step takes minutes and several GB of host memory; libtpu's compiler may crash) and appended
to `--out` as a JSON line when done; rows already there are skipped, so the table fills over several sessions.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
FLAGS = ("remat", "fsdp", "fp32", "cache")


def parse_case(text: str, per_chip: int) -> dict:
    """`"sdxl:lora:1024:remat"` -> the `TrainCase` fields."""
    parts = text.strip().split(":")
    if len(parts) < 3:
        raise SystemExit(f"case {text!r}: expected MODEL:METHOD:SIZE[:remat][:fsdp][:fp32][:cache][:rankN]")
    model, method, size, *flags = parts
    case = {"model": model, "method": method, "size": int(size), "per_chip": per_chip, "rank": 8}
    for flag in flags:
        if flag.startswith("rank"):
            case["rank"] = int(flag.removeprefix("rank"))
        elif flag in FLAGS:
            case[flag] = True
        else:
            raise SystemExit(f"case {text!r}: unknown flag {flag!r} (expected {FLAGS} or rankN)")
    return {
        "model": case["model"],
        "method": case["method"],
        "size": case["size"],
        "per_chip": case["per_chip"],
        "remat": case.get("remat", False),
        "fsdp": case.get("fsdp", False),
        "mixed_precision": "no" if case.get("fp32") else "bf16",
        "rank": case["rank"],
        "cache_latents": case.get("cache", False),
    }


def key(row: dict) -> tuple:
    fields = ("model", "method", "size", "per_chip", "remat", "fsdp", "mixed_precision", "rank", "cache_latents")
    return (row["target"], *(row[f] for f in fields))


def child(spec: dict) -> dict:
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host's own backend; the TPU is libtpu's compile-only client
    from sdjax.finetune import train_aot

    target = spec.pop("target")
    case = train_aot.TrainCase(**spec)
    return train_aot.compile_case(case, target, log=lambda s: print(s, file=sys.stderr, flush=True))


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def what(r: dict) -> str:
    rank = f" r{r['rank']}" if r["method"] == "lora" else ""
    return f"{r['model']} {r['method']}{rank}"


def settings(r: dict) -> str:
    parts = ["bf16" if r["mixed_precision"] == "bf16" else "fp32"]
    parts += ["remat"] if r["remat"] else ["no remat"]
    parts += ["cached latents"] if r["cache_latents"] else []
    return ", ".join(parts)


def markdown(rows: list[dict]) -> str:
    cols = [
        "step",
        "size",
        "target (chips)",
        "batch (per chip)",
        "settings",
        "weights",
        "weights + state / chip",
        "arguments",
        "outputs - aliased",
        "temporaries",
        "total / chip",
        "HBM / chip",
        "fits",
        "compile s",
        "TFLOP / chip",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    order = sorted(rows, key=lambda r: (r["model"], r["method"], r["target"], r["fsdp"], r["remat"], r["size"]))
    for r in order:
        head = [
            what(r),
            str(r["size"]),
            f"{r['target']} ({r.get('chips', '?')})",
            f"{r.get('batch', '?')} ({r['per_chip']})",
            settings(r),
            "FSDP" if r["fsdp"] else "replicated",
        ]
        if r.get("crashed") or r.get("failed"):
            why = f"compiler crashed ({r['crashed']})" if r.get("crashed") else "failed"
            lines.append("| " + " | ".join(head + ["-"] * 5 + ["-", why, "-", "-"]) + " |")
            continue
        oom = r["argument_bytes"] is None
        out = None if oom else r["output_bytes"] - r["alias_bytes"]
        total = _gib(r["total_bytes"]) + (" (compiler's OOM message)" if oom else "")
        tflop = "-" if r["flops"] is None else f"{r['flops'] / 1e12:.2f}"
        cells = head + [
            _gib(r["placed_state_bytes"] + r["placed_frozen_bytes"]),
            _gib(r["argument_bytes"]),
            _gib(out),
            _gib(r["temp_bytes"]),
            total,
            _gib(r["hbm_bytes"]),
            "yes" if r["fits"] else "**no**",
            f"{r['compile_s']:.0f}",
            tflop,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_row(spec: dict, timeout: float | None) -> dict:
    """One row in a fresh process; a crash of the compiler is a row of its own."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {**spec, "failed": f"timed out after {timeout} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    print(f"{spec}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
    if -proc.returncode in CRASH_SIGNALS:
        return {**spec, "crashed": signal.Signals(-proc.returncode).name, "compile_s": time.perf_counter() - t0}
    return {**spec, "failed": proc.stderr[-2000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="sdxl:lora:1024,sdxl:lora:1024:remat,sd15:full:512")
    ap.add_argument("--targets", default="v5e-1,v5e-8")
    ap.add_argument("--per-chip", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per row (default: none)")
    ap.add_argument("--out", type=Path, default=Path("train_tpu_memory.jsonl"))
    ap.add_argument("--markdown", action="store_true", help="print the table and the JSON rows of --out and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    rows = [json.loads(x) for x in args.out.read_text().splitlines() if x.strip()] if args.out.exists() else []
    if args.markdown:
        print(markdown(rows))
        print(json.dumps(rows, indent=1))
        return
    done = {key(r) for r in rows if not r.get("failed")}
    for text in args.cases.split(","):
        for target in args.targets.split(","):
            spec = {"target": target, **parse_case(text, args.per_chip)}
            if key(spec) in done:
                continue
            row = run_row(spec, args.timeout)
            if not row.get("failed"):
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            rows.append(row)
            print(markdown([row]).splitlines()[-1], flush=True)
    print(markdown([r for r in rows if not r.get("failed")]))


if __name__ == "__main__":
    main()
