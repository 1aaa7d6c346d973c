"""`sdjax compile`: compile the whole generation for a TPU slice on this machine (`sdjax.aot`, libtpu's compiler,
the `tpu-aot` extra) and report memory per chip against its HBM, FLOPs and a roofline bound."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sdjax.cli.common import (
    CalibrationOpt,
    QuantComputeOpt,
    QuantizeOpt,
    _parse_size,
    _quant_options,
    _require_extra,
)


def compile_(
    target: Annotated[
        str, typer.Option(help="TPU slice: v5e-1, v5e-4, v5e-8, v6e-4, v4-8, ... or a topology such as v5e:2x2.")
    ],
    model: Annotated[
        str,
        typer.Option("--model", "-m", help="A preset (sd15, sdxl, flux-dev, ...) or a diffusers folder (configs only)"),
    ] = "sd15",
    size: Annotated[str | None, typer.Option(help="Image size: 512, or WIDTHxHEIGHT. Default: the model's.")] = None,
    batch: Annotated[int, typer.Option(min=1, help="Images per call (the global batch over all chips).")] = 1,
    steps: Annotated[int, typer.Option(min=1, help="Sampler steps.")] = 30,
    sampler: Annotated[str | None, typer.Option(help="Sampler. Default: the model's scheduler.")] = None,
    dtype: Annotated[
        str, typer.Option(help="Weights and compute dtype: bf16, float32, ...; fp8: float8 kernels, bf16 compute.")
    ] = "bfloat16",
    task: Annotated[str, typer.Option(help="txt2img, img2img or inpaint.")] = "txt2img",
    model_parallel: Annotated[
        int | None,
        typer.Option(min=1, help="Devices per model replica (the mesh's model axis). Default: what the batch needs."),
    ] = None,
    vae_slicing: Annotated[
        bool,
        typer.Option(
            help="Decode (and encode) one image per chip at a time (diffusers' enable_vae_slicing): the VAE's "
            "activations of one image instead of the whole batch's. Same images."
        ),
    ] = False,
    attention: Annotated[
        str,
        typer.Option(
            help="The UNet's and VAE's attention: auto (what a TPU VM traces: XLA's), pallas (JAX's TPU "
            "flash-attention kernel: no score matrix in HBM), chunked (query blocks), xla, ..."
        ),
    ] = "auto",
    controlnets: Annotated[
        int,
        typer.Option(
            min=0,
            max=8,
            help="ControlNets in every model call (each the model's own ControlNet architecture, as "
            "ControlNetModel.from_unet makes it); their weights count against the chip's memory.",
        ),
    ] = 0,
    unet_cost: Annotated[
        bool,
        typer.Option(
            help="Also compile one model call (UNet + ControlNets) for loop-corrected FLOPs, bytes and the roofline."
        ),
    ] = True,
    save_cache: Annotated[
        Path | None,
        typer.Option(help="Write the compiled executable here (serialize_executable; same JAX/libtpu to load)."),
    ] = None,
    fsdp: Annotated[
        bool,
        typer.Option(help="Also split the large weights over the data axis (FSDP; Flux / SD 3 on 16 GB chips)."),
    ] = False,
    quantize: QuantizeOpt = None,
    quant_compute: QuantComputeOpt = None,
    calibration: CalibrationOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of a table.")] = False,
    isolate: Annotated[
        bool,
        typer.Option(
            "--isolate/--in-process",
            help="Compile in a child process, so that a crash of libtpu's compiler is reported instead of ending "
            "this command without a message (--in-process: in this process, for debuggers and native tracebacks).",
        ),
    ] = True,
) -> None:
    """Compile the whole generation for a TPU slice on this machine (no TPU needed, libtpu's compiler) and report
    memory per chip against its HBM, FLOPs and a roofline bound. Exit status 1 when it does not fit, 3 when the
    compiler crashes."""
    from sdjax import aot, isolated

    err = Console(stderr=True)
    try:
        aot.parse_target(target)
    except ValueError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    _quant_options(quantize, quant_compute, calibration)  # the file read and checked before the compile
    _require_extra("tpu-aot", "libtpu")
    hw = _image_size(size)
    try:
        with err.status("compiling") as status:
            run = functools.partial(isolated.call, aot.compile_for, what="compile") if isolate else aot.compile_for
            report = run(
                target,
                model=model,
                size=hw,
                batch=batch,
                steps=steps,
                sampler=sampler,
                dtype=dtype,
                task=task,
                model_parallel=model_parallel,
                vae_slicing=vae_slicing,
                attention=attention,
                controlnets=controlnets,
                unet_cost=unet_cost,
                save_cache=save_cache,
                fsdp=fsdp,
                quantize=None if quantize is None else quantize.value,
                quant_compute=None if quant_compute is None else quant_compute.value,
                calibration=None if calibration is None else str(calibration),
                log=lambda s: status.update(s),
            )
    except (ValueError, FileNotFoundError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except isolated.ChildCrashed as e:
        err.print(
            f"[red]error:[/red] libtpu's compiler crashed on this program ({e}). Known for some shapes (SD 1.5 with "
            "8 images per chip, in the VAE decoder's convolutions); --vae-slicing changes those shapes, or try "
            "another libtpu version.",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(3) from None
    _print_report(report, target, as_json, err)
    if not report.fits:
        _misfit_hints(report, target, err)
        raise typer.Exit(1)


def _image_size(size: str | None):
    """--size as `aot.compile_for`'s size: None (the model's), one int, or (height, width)."""
    if size is None:
        return None
    if size.strip().isdigit():
        return int(size)
    w, h = _parse_size(size, "--size")
    return (h, w)


def _print_report(report, target: str, as_json: bool, err: Console) -> None:
    """The report as JSON or as a table on stdout."""
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        out = Console(width=None if sys.stdout.isatty() else 160)
        out.print(report.summary(), highlight=False)
        table = Table("quantity", "value", title=f"sdjax compile {target}")
        for row in report.rows():
            table.add_row(*row)
        out.print(table)
        if report.saved:
            err.print(f"wrote {report.saved}", highlight=False)


def _misfit_hints(report, target: str, err: Console) -> None:
    """Say that it does not fit, with the options that might make it."""
    err.print(f"[red]does not fit[/red] on {target}", highlight=False)
    if not report.vae_slicing and report.batch > report.mesh.get("data", 1):
        err.print(
            "hint: --vae-slicing decodes one image per chip at a time (the same images); at large sizes the "
            "VAE's activations of the whole batch are often what does not fit",
            highlight=False,
            soft_wrap=True,
        )
    if report.attention == "auto":
        err.print(
            "hint: --attention pallas (JAX's TPU flash-attention kernel) or --attention chunked (blocks of "
            "queries) compute attention without the whole score matrix of the long self-attentions (SD 2.1 with "
            "8 images per v5e chip: 9.65 GiB with chunked, 28.4 without)",
            highlight=False,
            soft_wrap=True,
        )
