"""`sdjax convert`: write a single-file checkpoint (original Stability/LDM layout) as a diffusers folder; with
`--quantize`, also (or, given a diffusers folder, only) the denoiser's quantized params beside its weights
(`loading.components.save_quantized_components`), which `--quantize` loads then read instead of the float weights."""

from __future__ import annotations

import enum
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from sdjax.cli.common import DType, QuantizeOpt, _jnp_dtype


class Prediction(str, enum.Enum):
    """What the UNet predicts (diffusers' `prediction_type`)."""

    epsilon = "epsilon"
    v_prediction = "v_prediction"


def convert(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            exists=True, help="Single-file checkpoint (.safetensors); with --quantize also a diffusers folder."
        ),
    ],
    out_dir: Annotated[
        Path | None, typer.Argument(file_okay=False, help="Diffusers folder to write (not for a folder CHECKPOINT).")
    ] = None,
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
    overwrite: Annotated[
        bool, typer.Option(help="Replace the files of a non-empty OUT_DIR, or an existing quantized file.")
    ] = False,
    quantize: QuantizeOpt = None,
) -> None:
    """Write a single-file checkpoint (original Stability/LDM layout) as a diffusers folder.

    The folder loads in sdjax and in diffusers; it is written next to OUT_DIR and moved in only when complete.
    With --quantize, the denoiser's params quantized at --dtype are written into the folder too
    (COMPONENT/sdjax_quantized.SCHEME.safetensors); `--quantize` loads at that dtype read them instead of the
    float weights. A diffusers folder as CHECKPOINT gets only those files.
    """
    console = Console(stderr=True)
    if checkpoint.is_dir():
        if quantize is None or out_dir is not None:
            raise typer.BadParameter(
                f"{checkpoint} is a folder: convert writes a folder's quantized params in place, with --quantize "
                "and no OUT_DIR",
                param_hint="CHECKPOINT",
            )
        _write_quantized(checkpoint, dtype, quantize.value, overwrite, console)
        return
    if out_dir is None:
        raise typer.BadParameter("give the diffusers folder to write", param_hint="OUT_DIR")
    from sdjax.loading.files import CheckpointError
    from sdjax.loading.single_file import UnknownArchitectureError, convert_to_diffusers
    from sdjax.models.convert import WeightLoadError

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
        f"{index.get('_class_name', '?')} written to {out} in {time.perf_counter() - start:.1f} s",
        highlight=False,
        soft_wrap=True,
    )
    if quantize is not None:
        _write_quantized(out, dtype, quantize.value, overwrite, console)


def _write_quantized(folder: Path, dtype: DType, scheme: str, overwrite: bool, console: Console) -> None:
    """Load `folder` with `quantize=scheme` at `dtype` (each kernel quantized as it is converted) and write the
    quantized denoiser into its component folder."""
    from sdjax.families import FAMILIES
    from sdjax.loading.components import quantized_file, save_quantized_components
    from sdjax.pipelines import load_pipeline

    start = time.perf_counter()
    index = json.loads((folder / "model_index.json").read_text()) if (folder / "model_index.json").is_file() else {}
    names = str(index.get("_class_name", "")).removeprefix("Flax")
    keys = {f.denoiser_component for f in FAMILIES.values() if names in f.model_index_classes}
    if len(keys) != 1:
        raise typer.BadParameter(
            f"{folder}: not a diffusers pipeline folder of a family sdjax knows (model_index.json "
            f"_class_name {names!r})",
            param_hint="CHECKPOINT",
        )
    target = quantized_file(folder, keys.pop(), scheme)
    if target.exists():
        if not overwrite:
            raise typer.BadParameter(f"{target} exists (--overwrite replaces it)", param_hint="--overwrite")
        target.unlink()  # else the load below would read it back instead of quantizing the float weights
    pipe, params = load_pipeline(str(folder), dtype=_jnp_dtype(dtype), quantize=scheme)
    written = save_quantized_components(folder, params, pipe.quantization, dtype=pipe.dtype)
    for path in written:
        console.print(
            f"{scheme} params written to {path} ({path.stat().st_size / 2**20:.1f} MiB, "
            f"{time.perf_counter() - start:.1f} s)",
            highlight=False,
            soft_wrap=True,  # a path is not broken over lines
        )
