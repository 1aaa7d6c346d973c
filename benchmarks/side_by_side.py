"""The harness of the CPU comparisons with PyTorch diffusers on shrunk random models (flux_cpu.py, sd3_cpu.py).

A script builds one diffusers pipeline with random weights (the shrunk T5 and VAE below are common to all),
saves it, loads the same folder into sdjax, and times pairs of callables (sdjax's, PyTorch's) alternately in one
process, one warm-up call of each first: load from other work slows both alike, so the ratio is the result and
the absolute times are this CPU's. The 1-minute load average before and after the timing goes out with the
numbers (table and JSON), since PyTorch's CPU times degrade much more than XLA's on an oversubscribed machine, and
so do the XLA flags (`parse_args` applies the `sdjax` commands' CPU settings).

Memory: with both frameworks in the timing process, its peak RSS says nothing of either alone. So after the timing
`own_process_peaks` starts the script again once per side (hidden option `--memory-child SIDE FOLDER`, same
environment and so the same XLA flags): that fresh process imports one framework, loads the saved folder, makes one
end-to-end call (sdjax's includes its compile) and reports its peak resident memory, `VmHWM`, which exec resets
(`ru_maxrss` would start from the parent's peak: Python's subprocess starts children with vfork + exec).

    args = parse_args(__doc__)
    if serve_memory_child(args, sdjax=lambda folder: ..., torch=lambda folder: ...):  # folder -> e2e callable
        return
    rows = [("one call", *alternate(sdjax_fn, torch_fn, args.reps))]
    report(rows, args, load, peaks=own_process_peaks(folder))
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:  # reference.py, t5_reference.py: the tests' builders of small torch models
    sys.path.insert(0, str(TESTS))

SIZE = 512  # image side in pixels
STEPS = 4  # denoising steps end to end
MAX_SEQ = 128  # T5 tokens
T5_WIDTH = 512  # the shrunk T5's width (8 heads of 64, 4 layers)

Row = tuple[str, float, float]  # (piece, sdjax seconds, torch seconds)
SIDES = ("sdjax", "torch")


def parse_args(doc: str) -> argparse.Namespace:
    """The scripts' shared command line: `--reps` (timed pairs per piece), `--json` (where to write the rows), and
    the hidden `--memory-child SIDE FOLDER` of the memory measurement (`own_process_peaks`).

    Then XLA:CPU is set up as the `sdjax` commands set it up (`sdjax.runtime.configure_cpu`, before JAX starts:
    Eigen instead of YNNPACK for dots and convolutions); `SDJAX_NO_CPU_TUNING=1` leaves XLA's defaults. A torch
    memory child skips it: importing sdjax would import JAX there (the flags are in its environment anyway)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="alternating timed calls of each side per piece")
    ap.add_argument("--json", type=str, default=None, help="write the rows (and the load) to this file")
    ap.add_argument("--memory-child", nargs=2, metavar=("SIDE", "FOLDER"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child is not None and args.memory_child[0] not in SIDES:
        ap.error(f"--memory-child: side {args.memory_child[0]!r} is not one of {SIDES}")
    if args.memory_child is None or args.memory_child[0] == "sdjax":
        from sdjax import runtime

        runtime.configure_cpu()
    return args


# ---------------------------------------------------------------------------------------------- shared pieces
def t5_parts(folder: Path, seed: int = 0):
    """A 4-layer T5 v1.1 encoder of width `T5_WIDTH` from `seed` and its tokenizer (written under `folder`)."""
    import t5_reference
    from transformers import T5TokenizerFast

    tok = t5_reference.write_t5_tokenizer(folder / "t5tok")
    cfg = {**t5_reference.T5_TINY, "d_model": T5_WIDTH, "d_ff": 1024, "d_kv": 64, "num_heads": 8, "num_layers": 4}
    return t5_reference.t5_encoder(cfg, seed=seed), T5TokenizerFast.from_pretrained(str(tok))


def vae(scaling_factor: float, shift_factor: float):
    """The 16-channel VAE of Flux and SD 3 shrunk to widths (64, 128, 256, 256), one layer per block (weights from
    torch's global generator: seed it first)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=(64, 128, 256, 256),
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


# ---------------------------------------------------------------------------------------------- timing
def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def load_average() -> float:
    """The 1-minute load average (runnable processes; this machine's cores: `os.cpu_count()`)."""
    return os.getloadavg()[0]


def alternate(sdjax_fn: Callable[[], object], torch_fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Medians of `reps` alternating timings (one warm-up call of each first, not counted)."""
    sdjax_fn()
    torch_fn()
    sj, pt = [], []
    for _ in range(reps):
        sj.append(seconds(sdjax_fn))
        pt.append(seconds(torch_fn))
    return statistics.median(sj), statistics.median(pt)


# ---------------------------------------------------------------------------------------------- memory
MEMORY_TAG = "memory-child: "  # the prefix of a memory child's one JSON line on its stdout
FRAMEWORK = {"sdjax": ("jax", "sdjax"), "torch": ("torch", "diffusers")}  # imported by a child before the load


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status in MiB: `VmHWM` (peak resident memory since exec), `VmRSS` (now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def serve_memory_child(args: argparse.Namespace, **sides: Callable[[str], Callable[[], object]]) -> bool:
    """False unless this process is a memory child (`--memory-child SIDE FOLDER`). Then: import that side's
    framework, `sides[SIDE](FOLDER)` (load the folder into that side only and return its end-to-end call, as the
    timing makes it), call it once, print one `MEMORY_TAG` line of JSON (peak RSS and what else went into the
    process) and return True: the script has nothing more to do."""
    if args.memory_child is None:
        return False
    side, folder = args.memory_child
    for module in FRAMEWORK[side]:
        importlib.import_module(module)
    if side == "torch":
        import torch

        torch.set_grad_enabled(False)  # as the scripts' main does before the timing
    after_imports = status_mib("VmRSS")
    t0 = time.perf_counter()
    call = sides[side](folder)
    load_s = time.perf_counter() - t0
    after_load = status_mib("VmRSS")
    t0 = time.perf_counter()
    call()
    out = {
        "side": side,
        "peak_rss_mib": status_mib("VmHWM"),
        "rss_after_imports_mib": after_imports,
        "rss_after_load_mib": after_load,
        "load_s": load_s,
        "first_call_s": time.perf_counter() - t0,
        "other_framework_imported": ("torch" if side == "sdjax" else "jax") in sys.modules,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(MEMORY_TAG + json.dumps(out), flush=True)
    return True


def own_process_peaks(folder: Path | str) -> dict[str, Any]:
    """Each side's end-to-end generation once in a fresh process of this script, one side after the other (the
    caller's memory stays as it is meanwhile): `{side: the child's report}`, or `{side: {"error": ...}}` where
    a child failed (the timing is kept). The children inherit this environment, the XLA flags included; a child
    whose flags differ gets `xla_flags_differ` (the report prints a warning)."""
    script = Path(sys.modules["__main__"].__file__).resolve()
    peaks: dict[str, Any] = {}
    for side in SIDES:
        cmd = [sys.executable, str(script), "--memory-child", side, str(folder)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
        tagged = [line for line in proc.stdout.splitlines() if line.startswith(MEMORY_TAG)]
        if proc.returncode != 0 or not tagged:
            peaks[side] = {"side": side, "error": f"memory child exited {proc.returncode} (its stderr is above)"}
            continue
        peaks[side] = json.loads(tagged[-1][len(MEMORY_TAG) :])
        if side == "sdjax" and peaks[side]["xla_flags"] != os.environ.get("XLA_FLAGS", ""):
            peaks[side]["xla_flags_differ"] = True
    return peaks


def _peak(peaks: dict[str, Any], side: str) -> float | None:
    return peaks.get(side, {}).get("peak_rss_mib")


# ---------------------------------------------------------------------------------------------- output
def report(
    rows: Sequence[Row],
    args: argparse.Namespace,
    load: tuple[float, float],
    notes=(),
    peaks: dict[str, Any] | None = None,
    **extra,
) -> None:
    """Print the table (then `notes`, one line each) and, with `--json`, write `{reps, statistic, load, rows,
    **extra}` plus the memory: `timing_process_peak_rss_mib` (this process, both sides, VmHWM now) and, with
    `peaks` (`own_process_peaks`), `peak_rss_own_process_mib` per side and the children's reports.
    `load`: the 1-minute load averages before and after the timing."""
    width = max(len(name) for name, _, _ in rows) + 4
    print(f"{'piece':<{width}} {'sdjax s':>9} {'torch s':>9} {'sdjax/torch':>12}")
    for name, sj, pt in rows:
        print(f"{name:<{width}} {sj:9.3f} {pt:9.3f} {sj / pt:12.2f}")
    timing_peak = status_mib("VmHWM")
    own = None
    if peaks is not None:
        sj, pt = _peak(peaks, "sdjax"), _peak(peaks, "torch")
        own = {"sdjax": sj, "torch": pt, "ratio": sj / pt if sj and pt else None}
        cells = [f"{v:9.0f}" if v is not None else f"{'-':>9}" for v in (sj, pt)]
        ratio = f"{own['ratio']:12.2f}" if own["ratio"] is not None else f"{'-':>12}"
        label = "end to end once, own process"
        print(f"{'peak RSS (own process), MiB':<{width}} {'sdjax':>9} {'torch':>9} {'sdjax/torch':>12}")
        print(f"{label:<{width}} {cells[0]} {cells[1]} {ratio}")
        print("  (a fresh process per side: its imports, the folder's load, one end-to-end call with any compile)")
        for side, child in peaks.items():
            if "error" in child:
                print(f"  {side}: {child['error']}")
            if child.get("other_framework_imported"):
                print(f"  warning: the {side} child imported the other framework too")
            if child.get("xla_flags_differ"):
                print(f"  warning: the {side} child ran with XLA_FLAGS={child['xla_flags']!r}")
    print(f"peak RSS of this timing process (both sides, VmHWM): {timing_peak:.0f} MiB")
    print(f"1-minute load average before / after the timing: {load[0]:.2f} / {load[1]:.2f} ({os.cpu_count()} CPUs)")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for line in notes:
        print(line)
    if args.json:
        out = {
            "reps": args.reps,
            "statistic": "median",
            "load_average_1min": {"before": load[0], "after": load[1], "cpus": os.cpu_count()},
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "rows": [{"piece": n, "sdjax_s": sj, "torch_s": pt, "ratio": sj / pt} for n, sj, pt in rows],
            **extra,
            "timing_process_peak_rss_mib": timing_peak,
        }
        if peaks is not None:
            out["peak_rss_own_process_mib"] = own
            out["memory_children"] = peaks
        Path(args.json).write_text(json.dumps(out, indent=1))
