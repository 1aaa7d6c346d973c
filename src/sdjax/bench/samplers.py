"""Quality per step of the samplers (`sdjax bench samplers`): how far each sampler's result lies from a
high-accuracy solution of the same probability-flow ODE, against the number of model evaluations.

The way k-diffusion and the DPM-Solver papers compare samplers: one prompt, one seed, one initial noise; the
reference is the ODE solved with many steps of a second-order method (`reference` sampler, `reference_steps`);
each sampler runs at several step counts and the distance of its final latents to the reference is reported as
a relative L2 error `||x - x_ref|| / ||x_ref||`, next to its model evaluations per image (`num_model_calls`; the
classifier-free-guidance pair counts once). Every sampler runs on the same grid family: `timestep_spacing=
"trailing"` (the first call at t = T - 1, sigma_max, for all of them; the Karras variants use the full sigma
range anyway) and none clips x0 (DDIM's default `clip_sample` is turned off), so the only difference is the
discretisation. Samplers that add noise (Euler a, DPM2 a, the SDE
solvers) solve a different equation per draw and are left out; LCM/TCD need distilled models.

The sampler's own cost per model call (its `step`, without the UNet) is timed on the latent shape, next to the
cost of one model call of the whole loop (UNet + guidance + sampler), from two timed runs of different lengths.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ODE_SAMPLERS = (
    "ddim",
    "pndm",
    "euler",
    "euler_karras",
    "heun",
    "lms",
    "dpm2",
    "dpmpp_2m",
    "dpmpp_2m_karras",
    "unipc",
    "deis",
)
STEPS = (4, 6, 8, 12, 16, 24, 32)


@dataclasses.dataclass(frozen=True)
class SamplerBenchConfig:
    model: str | None = None  # None: the embedded model
    prompt: str = "a red circle on a blue background"
    seed: int = 0
    guidance: float = 5.0
    samplers: tuple[str, ...] = ODE_SAMPLERS
    steps: tuple[int, ...] = STEPS
    reference: str = "heun"
    reference_steps: int = 200
    height: int | None = None
    width: int | None = None
    timing_steps: int = 8

    def validate(self) -> None:
        from sdjax import samplers

        for name in (*self.samplers, self.reference):
            samplers.get_sampler(name)  # raises naming the sampler
        if not self.steps or min(self.steps) < 1:
            raise ValueError(f"steps: expected positive step counts, got {self.steps}")
        if self.reference_steps < 2 * max(self.steps):
            raise ValueError(
                f"reference_steps={self.reference_steps} must be at least twice the largest step count "
                f"({max(self.steps)}) to serve as a reference"
            )


def _sampler(pipe, name: str):
    from sdjax import samplers

    sampler = samplers.get_sampler(name, pipe.scheduler, timestep_spacing="trailing")
    if sampler.config.get("clip_sample"):  # DDIM's default clips x0 to [-1, 1]: not the ODE the others solve
        sampler = samplers.get_sampler(sampler, clip_sample=False)
    return sampler


def _latents(pipe, cfg: SamplerBenchConfig, sampler, steps: int, height: int, width: int) -> np.ndarray:
    out = pipe.generate_arrays(
        [cfg.prompt],
        [""],
        [cfg.seed],
        [0],
        [cfg.guidance],
        steps=steps,
        height=height,
        width=width,
        sampler=sampler,
        output="latents",
    )
    return np.asarray(out, np.float64)


def _step_cost(sampler, shape: tuple[int, ...], calls: int) -> float:
    """Seconds per call of the sampler's own update (a fixed model output; no UNet), over `calls` calls."""
    import jax
    import jax.numpy as jnp

    def run(x):
        state = sampler.set_timesteps(sampler.create_state(), calls // sampler.order, shape)

        def body(i, carry):
            x, st = carry
            out = 0.1 * x
            x, st = sampler.step(st, out, i, x, noise=jnp.zeros_like(x) if sampler.stochastic else None)
            return x, st

        return jax.lax.fori_loop(0, sampler.num_model_calls(calls // sampler.order), body, (x, state))[0]

    fn = jax.jit(run)
    x = jnp.ones(shape, jnp.float32)
    fn(x).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / sampler.num_model_calls(calls // sampler.order)


def _call_cost(pipe, cfg, sampler, height, width) -> float:
    """Seconds per model call of the whole loop, from runs of n and 2n steps (compile and decode cancel out)."""
    n = cfg.timing_steps
    times = {}
    for steps in (n, 2 * n):
        _latents(pipe, cfg, sampler, steps, height, width)  # compile
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            _latents(pipe, cfg, sampler, steps, height, width)
            best = min(best, time.perf_counter() - t0)
        times[steps] = best
    calls = sampler.num_model_calls(2 * n) - sampler.num_model_calls(n)
    return max(times[2 * n] - times[n], 0.0) / calls


def run(cfg: SamplerBenchConfig, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The benchmark; returns the JSON-able result (`rows`: one per sampler x steps)."""
    cfg.validate()
    from sdjax.pipelines.auto import load_pipeline

    log("loading")
    pipe, _ = load_pipeline(cfg.model, safety_checker=None)
    dh, dw = pipe.default_size
    height, width = cfg.height or dh, cfg.width or dw
    log(f"reference: {cfg.reference} x {cfg.reference_steps} steps")
    ref_sampler = _sampler(pipe, cfg.reference)
    reference = _latents(pipe, cfg, ref_sampler, cfg.reference_steps, height, width)
    norm = float(np.linalg.norm(reference))
    rows = []
    for name in cfg.samplers:
        sampler = _sampler(pipe, name)
        for steps in cfg.steps:
            log(f"{name}: {steps} steps")
            try:
                sampler.num_model_calls(steps)
                x = _latents(pipe, cfg, sampler, steps, height, width)
            except ValueError as e:  # below the sampler's minimum
                rows.append({"sampler": name, "steps": steps, "nfe": None, "error": None, "skipped": str(e)})
                continue
            err = float(np.linalg.norm(x - reference)) / norm
            rows.append({"sampler": name, "steps": steps, "nfe": int(sampler.num_model_calls(steps)), "error": err})
    log("timing")
    shape = (2, pipe.unet.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    call = _call_cost(pipe, cfg, _sampler(pipe, "euler"), height, width)
    overhead = {name: _step_cost(_sampler(pipe, name), shape, cfg.timing_steps) for name in cfg.samplers}
    return {
        "model": cfg.model or "embedded",
        "prompt": cfg.prompt,
        "seed": cfg.seed,
        "guidance": cfg.guidance,
        "size": [height, width],
        "reference": {"sampler": cfg.reference, "steps": cfg.reference_steps},
        "rows": rows,
        "seconds_per_model_call": call,
        "sampler_seconds_per_call": overhead,
    }


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Rows: sampler; columns: the relative error at each step count (NFE in brackets), then the sampler's own
    cost per call as a share of a model call."""
    steps = sorted({r["steps"] for r in result["rows"]})
    cols = ["sampler", *(f"{s} steps" for s in steps), "own cost / call"]
    out = []
    by = {(r["sampler"], r["steps"]): r for r in result["rows"]}
    for name in dict.fromkeys(r["sampler"] for r in result["rows"]):
        cells = [name]
        for s in steps:
            r = by.get((name, s))
            cells.append("-" if r is None or r["error"] is None else f"{r['error']:.2e} ({r['nfe']})")
        share = result["sampler_seconds_per_call"][name] / max(result["seconds_per_model_call"], 1e-12)
        cells.append(f"{100 * share:.2f}%")
        out.append(cells)
    return cols, out


def plot(result: dict[str, Any], path: Path) -> bool:
    """Error against model evaluations, log-log (needs matplotlib: `pip install 'sdjax[bench]'`); False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 5), dpi=110)
    for name in dict.fromkeys(r["sampler"] for r in result["rows"]):
        pts = sorted((r["nfe"], r["error"]) for r in result["rows"] if r["sampler"] == name and r["error"] is not None)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model evaluations per image")
    ax.set_ylabel("relative L2 distance to the reference latents")
    ref = result["reference"]
    ax.set_title(f"{result['model']}: distance to {ref['sampler']} x {ref['steps']} steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2))


def parse_list(text: str | None, default: Sequence, cast=str) -> tuple:
    if not text:
        return tuple(default)
    return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
