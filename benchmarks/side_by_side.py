"""The harness of the CPU comparisons with PyTorch diffusers on shrunk random models (flux_cpu.py, sd3_cpu.py).

A script builds one diffusers pipeline with random weights (the shrunk T5 and VAE below are common to all),
saves it, loads the same folder into sdjax, and times pairs of callables (sdjax's, PyTorch's) alternately in one
process, one warm-up call of each first: load from other work slows both alike, so the ratio is the result and
the absolute times are this CPU's. The 1-minute load average before and after the timing goes out with the
numbers (table and JSON), since PyTorch's CPU times degrade much more than XLA's on an oversubscribed machine, and
so do the XLA flags (`parse_args` applies the `sdjax` commands' CPU settings).

    args = parse_args(__doc__)
    rows = [("one call", *alternate(sdjax_fn, torch_fn, args.reps))]
    report(rows, args)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:  # reference.py, t5_reference.py: the tests' builders of small torch models
    sys.path.insert(0, str(TESTS))

SIZE = 512  # image side in pixels
STEPS = 4  # denoising steps end to end
MAX_SEQ = 128  # T5 tokens
T5_WIDTH = 512  # the shrunk T5's width (8 heads of 64, 4 layers)

Row = tuple[str, float, float]  # (piece, sdjax seconds, torch seconds)


def parse_args(doc: str) -> argparse.Namespace:
    """The scripts' shared command line: `--reps` (timed pairs per piece), `--json` (where to write the rows).

    Then XLA:CPU is set up as the `sdjax` commands set it up (`sdjax.runtime.configure_cpu`, before JAX starts:
    Eigen instead of YNNPACK for dots and convolutions); `SDJAX_NO_CPU_TUNING=1` leaves XLA's defaults."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="alternating timed calls of each side per piece")
    ap.add_argument("--json", type=str, default=None, help="write the rows (and the load) to this file")
    args = ap.parse_args()
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


# ---------------------------------------------------------------------------------------------- output
def report(rows: Sequence[Row], args: argparse.Namespace, load: tuple[float, float], notes=(), **extra) -> None:
    """Print the table (then `notes`, one line each) and, with `--json`, write `{reps, statistic, load, rows,
    **extra}`. `load`: the 1-minute load averages before and after the timing."""
    width = max(len(name) for name, _, _ in rows) + 4
    print(f"{'piece':<{width}} {'sdjax s':>9} {'torch s':>9} {'sdjax/torch':>12}")
    for name, sj, pt in rows:
        print(f"{name:<{width}} {sj:9.3f} {pt:9.3f} {sj / pt:12.2f}")
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
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
