"""`sdjax convert`: write a single-file checkpoint (original Stability/LDM layout) as a diffusers folder."""

from __future__ import annotations

import enum
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from sdjax.cli.common import DType, _jnp_dtype


class Prediction(str, enum.Enum):
    """What the UNet predicts (diffusers' `prediction_type`)."""

    epsilon = "epsilon"
    v_prediction = "v_prediction"


def convert(
    checkpoint: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, help="Single-file checkpoint (.safetensors).")
    ],
    out_dir: Annotated[Path, typer.Argument(file_okay=False, help="Diffusers folder to write.")],
    dtype: Annotated[DType, typer.Option(help="Dtype of the written weights.")] = DType.float32,
    prediction_type: Annotated[
        Prediction | None,
        typer.Option(help="Override what the UNet predicts, for SD 2.x files that cannot tell (768 models: v)."),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            help="Diffusers folder or Hub id whose configs and tokenizers to use instead of the embedded set."
        ),
    ] = None,
    extract_ema: Annotated[bool, typer.Option(help="Write the EMA weights of files that hold both.")] = False,
    allow_pickle: Annotated[
        bool,
        typer.Option(help="Read a pickled .ckpt/.pt with a restricted unpickler that cannot run code."),
    ] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace the files of a non-empty OUT_DIR.")] = False,
) -> None:
    """Write a single-file checkpoint (original Stability/LDM layout) as a diffusers folder.

    The folder loads in sdjax and in diffusers; it is written next to OUT_DIR and moved in only when complete.
    """
    from sdjax.loading.files import CheckpointError
    from sdjax.loading.single_file import UnknownArchitectureError, convert_to_diffusers
    from sdjax.models.convert import WeightLoadError

    console = Console(stderr=True)
    start = time.perf_counter()
    try:
        out = convert_to_diffusers(
            checkpoint,
            out_dir,
            overwrite=overwrite,
            dtype=_jnp_dtype(dtype),
            prediction_type=prediction_type.value if prediction_type else None,
            config=config,
            extract_ema=extract_ema,
            allow_pickle=allow_pickle,
        )
    except (CheckpointError, UnknownArchitectureError, WeightLoadError, FileExistsError, ValueError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    index = json.loads((out / "model_index.json").read_text())
    console.print(
        f"{index.get('_class_name', '?')} written to {out} in {time.perf_counter() - start:.1f} s", highlight=False
    )
