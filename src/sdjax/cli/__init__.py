"""The `sdjax` command: `generate` images to PNG files, `serve` the HTTP API and web page, `pnginfo` read back,
`bench` time a workload, `compile` for a TPU slice without one, `convert` a single-file checkpoint, `train`.

A thin adapter over the pipeline, a module per command (`generate`, `serve`, `bench`, `compile`, `convert`,
`pnginfo`; `train` is `sdjax.finetune.cli`'s sub-app) over shared options and loading (`common`). This module is the
root `app`: its `--version`, and each command registered on it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from sdjax.cli import bench, calibrate, compile, convert, generate, pnginfo, serve
from sdjax.cli.common import (
    DTYPES,
    QUANTIZE_OPTION,
    DType,
    PromptSyntax,
    Quantize,
    ResizeMode,
    Upscaler,
    _jnp_dtype,
    _load_with_vae,
    _require_extra,
    image_grid,
    load_pipeline,
)
from sdjax.cli.generate_request import _a1111_sampler
from sdjax.cli.progress import Timings
from sdjax.finetune.cli import train_app

__all__ = [
    "DTYPES",
    "QUANTIZE_OPTION",
    "DType",
    "PromptSyntax",
    "Quantize",
    "ResizeMode",
    "Timings",
    "Upscaler",
    "_a1111_sampler",
    "_jnp_dtype",
    "_load_with_vae",
    "_require_extra",
    "app",
    "image_grid",
    "load_pipeline",
    "main",
]

app = typer.Typer(
    name="sdjax",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    help="Stable Diffusion in JAX: generate images, serve an HTTP API and web page, read PNG parameters.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        import sdjax

        typer.echo(f"sdjax {sdjax.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Stable Diffusion in JAX: generate images, serve an HTTP API and web page, read PNG parameters."""


app.command(no_args_is_help=True)(generate.generate)
app.command()(serve.serve)
app.add_typer(bench.bench_app, name="bench")
app.add_typer(train_app, name="train")
app.command("compile", no_args_is_help=True)(compile.compile_)
app.command(no_args_is_help=True)(convert.convert)
app.command(no_args_is_help=True)(pnginfo.pnginfo)
app.command()(calibrate.calibrate)


def main() -> None:
    from sdjax import runtime

    runtime.configure_cpu()  # XLA:CPU flags, before any JAX backend starts (no effect on GPU/TPU)
    app()
