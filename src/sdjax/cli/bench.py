"""`sdjax bench`: time the pipeline's pieces (`sdjax.bench`), `bench samplers` the samplers' quality per step,
`bench controlnet` the cost of ControlNets per step. Tables go to stdout, progress and errors to stderr."""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sdjax.cli.common import DType, _parse_size


class Arch(str, enum.Enum):
    """Full-size architectures with random weights (released configs), and a tiny one."""

    sd15 = "sd15"
    sd21 = "sd21"
    sdxl = "sdxl"
    tiny = "tiny"


bench_app = typer.Typer(
    help="Benchmarks: `sdjax bench [OPTIONS]` times the pipeline's pieces; `sdjax bench samplers` measures quality "
    "per step of the samplers; `sdjax bench controlnet` the cost of ControlNets per step."
)


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="A diffusers folder or Hub id. Default: the embedded model (or --arch)."),
    ] = None,
    arch: Annotated[
        Arch | None,
        typer.Option(help="Benchmark a full-size architecture with random weights instead (nothing to download)."),
    ] = None,
    height: Annotated[int | None, typer.Option(help="Image height. Default: the model's.")] = None,
    width: Annotated[int | None, typer.Option(help="Image width. Default: the model's.")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Sampler steps of the end-to-end run.")] = 20,
    batch: Annotated[int, typer.Option(min=1, help="Images per call.")] = 1,
    dtype: Annotated[DType, typer.Option(help="Weights and compute dtype.")] = DType.float32,
    sampler: Annotated[str | None, typer.Option(help="Sampler. Default: the model's scheduler.")] = None,
    reps: Annotated[int, typer.Option(min=1, help="Timed calls per piece (after one warm call).")] = 3,
    attention: Annotated[
        str,
        typer.Option(
            help="UNet/VAE attention: auto (cuDNN on GPU, XLA on CPU, chunked for long sequences on CPU), xla, "
            "dot_product, chunked, or pallas (JAX's TPU flash-attention kernel; TPU only)."
        ),
    ] = "auto",
    torch: Annotated[
        bool,
        typer.Option(
            "--torch", help="Also run the workload in PyTorch diffusers (needs torch + diffusers) and show ratios."
        ),
    ] = False,
    torch_compile: Annotated[
        str | None,
        typer.Option(
            "--torch-compile",
            help="With --torch: torch.compile the PyTorch UNet and VAE decode in this mode (default, "
            "reduce-overhead, max-autotune, max-autotune-no-cudagraphs; channels-last, whole graphs).",
        ),
    ] = None,
    memory_only: Annotated[
        bool,
        typer.Option(
            "--memory-only", help="Compile against abstract weights of --arch and report XLA's memory analysis only."
        ),
    ] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the result as JSON here.")] = None,
) -> None:
    """Time text encoding, a UNet step, VAE decode and end-to-end generation; FLOPs, MFU, peak memory."""
    if ctx.invoked_subcommand is not None:
        return
    from sdjax import bench as bench_lib

    cfg = bench_lib.BenchConfig(
        model=model,
        arch=arch.value if arch else None,
        height=height,
        width=width,
        steps=steps,
        batch=batch,
        dtype=dtype.value,
        sampler=sampler,
        reps=reps,
        torch=torch,
        torch_compile=torch_compile,
        memory_only=memory_only,
        attention=attention,
    )
    try:
        cfg.validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if json_out is not None and not json_out.parent.is_dir():
        raise typer.BadParameter(f"folder {json_out.parent} does not exist", param_hint="--json")
    err = Console(stderr=True)
    try:
        with err.status("benchmarking") as status:
            result = bench_lib.run(cfg, log=lambda s: status.update(s))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    out = Console(width=None if sys.stdout.isatty() else 160)
    cols, rows = bench_lib.table_rows(result)
    mode = (result.get("torch") or {}).get("torch_compile")
    table = Table(*cols, title="sdjax bench" + (f" (PyTorch: torch.compile, mode {mode})" if mode else ""))
    for row in rows:
        table.add_row(*row)
    for line in bench_lib.summary_lines(result):
        out.print(line, highlight=False)
    out.print(table)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))
        err.print(f"wrote {json_out}", highlight=False)


@bench_app.command("samplers")
def bench_samplers(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="A diffusers folder or Hub id. Default: the embedded model.")
    ] = None,
    samplers: Annotated[
        str | None, typer.Option(help="Comma-separated sampler names. Default: the deterministic (ODE) samplers.")
    ] = None,
    steps: Annotated[str | None, typer.Option(help="Comma-separated step counts. Default: 4,6,8,12,16,24,32.")] = None,
    reference: Annotated[str, typer.Option(help="The reference solver.")] = "heun",
    reference_steps: Annotated[int, typer.Option(min=2, help="Steps of the reference solution.")] = 200,
    prompt: Annotated[str, typer.Option(help="The prompt.")] = "a red circle on a blue background",
    seed: Annotated[int, typer.Option(min=0, help="The seed (one initial noise for every sampler).")] = 0,
    guidance_scale: Annotated[float, typer.Option("--guidance-scale", "-g", min=0.0)] = 5.0,
    size: Annotated[str | None, typer.Option(help="WIDTHxHEIGHT. Default: the model's.")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write the error-vs-evaluations plot here (PNG; matplotlib).")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the result as JSON here.")] = None,
) -> None:
    """Distance of each sampler's result to a many-step reference solution against model evaluations, and each
    sampler's own cost per call against a model call."""
    from sdjax.bench import samplers as lib
    from sdjax.config import ConfigError

    width, height = _parse_size(size, "--size") if size else (None, None)
    try:
        cfg = lib.SamplerBenchConfig(
            model=model,
            prompt=prompt,
            seed=seed,
            guidance=guidance_scale,
            samplers=lib.parse_list(samplers, lib.ODE_SAMPLERS),
            steps=lib.parse_list(steps, lib.STEPS, int),
            reference=reference,
            reference_steps=reference_steps,
            height=height,
            width=width,
        )
        cfg.validate()
    except (ValueError, ConfigError) as e:
        raise typer.BadParameter(str(e.args[0] if e.args else e)) from None
    for path, option in ((plot, "--plot"), (json_out, "--json")):
        if path is not None and not path.parent.is_dir():
            raise typer.BadParameter(f"folder {path.parent} does not exist", param_hint=option)
    err = Console(stderr=True)
    try:
        with err.status("benchmarking samplers") as status:
            result = lib.run(cfg, log=lambda s: status.update(s))
    except (ValueError, FileNotFoundError, RuntimeError, ConfigError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    out = Console(width=None if sys.stdout.isatty() else 200)
    cols, rows = lib.table(result)
    ref = result["reference"]
    table = Table(*cols, title=f"relative L2 distance to {ref['sampler']} x {ref['steps']} steps (model evaluations)")
    for row in rows:
        table.add_row(*row)
    out.print(table)
    out.print(f"one model call of the loop: {1000 * result['seconds_per_model_call']:.2f} ms", highlight=False)
    if plot is not None:
        if lib.plot(result, plot):
            err.print(f"wrote {plot}", highlight=False)
        else:
            err.print("no plot: matplotlib is not installed (pip install 'sdjax[bench]')", highlight=False)
    if json_out is not None:
        lib.write_json(result, json_out)
        err.print(f"wrote {json_out}", highlight=False)


@bench_app.command("controlnet")
def bench_controlnet(
    controlnets: Annotated[str, typer.Option(help="Comma-separated numbers of ControlNets to time.")] = "0,1,2",
    arch: Annotated[
        Arch, typer.Option(help="The UNet (random weights); the ControlNets are shaped like it.")
    ] = Arch.sd15,
    height: Annotated[int | None, typer.Option(help="Image height. Default: the architecture's.")] = None,
    width: Annotated[int | None, typer.Option(help="Image width. Default: the architecture's.")] = None,
    batch: Annotated[int, typer.Option(min=1, help="Images per step (x2 with classifier-free guidance).")] = 1,
    dtype: Annotated[DType, typer.Option(help="Weights and compute dtype.")] = DType.float32,
    reps: Annotated[int, typer.Option(min=1, help="Timed calls per case (after one warm call).")] = 3,
    torch: Annotated[
        bool, typer.Option("--torch", help="Also time the step in PyTorch diffusers, side by side, and show ratios.")
    ] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the result as JSON here.")] = None,
) -> None:
    """Time one denoising step (UNet with CFG) with 0, 1, 2, ... ControlNets."""
    from sdjax.bench import controlnet as lib

    try:
        counts = tuple(int(k) for k in controlnets.split(","))
    except ValueError:
        raise typer.BadParameter(
            f"{controlnets!r}: expected comma-separated integers", param_hint="--controlnets"
        ) from None
    cfg = lib.ControlNetBenchConfig(
        arch=arch.value, controlnets=counts, height=height, width=width, batch=batch, dtype=dtype.value, reps=reps,
        torch=torch,
    )  # fmt: skip
    try:
        cfg.validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if json_out is not None and not json_out.parent.is_dir():
        raise typer.BadParameter(f"folder {json_out.parent} does not exist", param_hint="--json")
    err = Console(stderr=True)
    try:
        with err.status("benchmarking ControlNet steps") as status:
            result = lib.run(cfg, log=lambda s: status.update(s))
    except (ValueError, RuntimeError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    out = Console(width=None if sys.stdout.isatty() else 160)
    cols, rows = lib.table_rows(result)
    table = Table(*cols, title="sdjax bench controlnet")
    for row in rows:
        table.add_row(*row)
    out.print(lib.summary_line(result), highlight=False)
    out.print(table)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))
        err.print(f"wrote {json_out}", highlight=False)
