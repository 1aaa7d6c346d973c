"""`sdjax calibrate`: record the static input ranges of a model's int8 x int8 (or fp8 x fp8) Dense layers and 2-D
convolutions over a few prompts and write them next to its weights (`sdjax.quant.calibrate`, a version 2 calibration
file; docs/quantization.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from sdjax.cli.common import DType, DTypeOpt, Quantize, _quantize_kw, load_pipeline


def _prompts(prompt: list[str] | None, prompts_file: Path | None) -> list[str]:
    prompts = list(prompt or [])
    if prompts_file is not None:
        prompts += [line.strip() for line in prompts_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise typer.BadParameter("give one or more prompts (--prompt, or --prompts-file)", param_hint="--prompt")
    return prompts


def _output(model: str | None, output: Path | None) -> Path:
    from sdjax.quant import CALIBRATION_FILE

    if output is None:
        if model is None or not Path(model).is_dir():
            raise typer.BadParameter(
                f"where to write: -o FILE (only a folder --model gets {CALIBRATION_FILE} inside it by default)",
                param_hint="--output",
            )
        output = Path(model) / CALIBRATION_FILE
    if not output.parent.is_dir():
        raise typer.BadParameter(f"{output}: the folder {output.parent} does not exist", param_hint="--output")
    return output


def calibrate(
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="A diffusers folder, a .safetensors checkpoint or a Hub id. Default: the embedded model.",
        ),
    ] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="A calibration prompt (repeat).")] = None,
    prompts_file: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="A text file of prompts, one per line.")
    ] = None,
    compute: Annotated[
        Quantize,
        typer.Option(
            "--quant-compute",
            help="The 8-bit products of the Dense layers and convolutions (weights quantized the same way): int8 "
            "(TPU) or fp8 (GPU).",
        ),
    ] = Quantize.int8,
    steps: Annotated[int, typer.Option(min=1, help="Sampling steps of the calibration run.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the calibration images.")] = 0,
    dtype: DTypeOpt = DType.float32,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", dir_okay=False, help="The calibration file. Default: MODEL/quant_calibration.json."
        ),
    ] = None,
) -> None:
    """Record the input ranges of the denoiser's quantized Dense layers and convolutions over a few prompts (a
    calibration for quantized compute); load it with --calibration FILE or QuantPolicy(..., compute=...,
    calibration=FILE)."""
    prompts = _prompts(prompt, prompts_file)
    output = _output(model, output)
    from sdjax import quant

    pipe = load_pipeline(model, dtype, **_quantize_kw(compute))
    policy = dataclasses.replace(pipe.quantization, compute=compute.value)
    quant.quantize_pipeline(pipe, pipe.params, policy)  # the loaded kernels kept, Dense layers and convs multiply 8-bit
    calibration = quant.calibrate(pipe, prompts, steps=steps, seed=seed)
    calibration.save(output)
    unseen = [p for p, rec in calibration.layers.items() if rec.amax is None]
    convs = sum(len(rec.shape) == 4 for rec in calibration.layers.values())  # conv kernels (h, w, in, out)
    typer.echo(
        f"{output}: {len(calibration.layers)} {compute.value} layers of {', '.join(policy.components)} "
        f"({len(calibration.layers) - convs} Dense, {convs} conv), {len(prompts)} prompt(s), {steps} steps"
        + (f"; {len(unseen)} never called (per-call scales): {', '.join(unseen[:3])}" if unseen else "")
    )
