"""What the `sdjax` commands share: the option enums, the dtype and quantization options, loading a pipeline,
extras' install hints, option parsers and output files."""

from __future__ import annotations

import enum
import math
import re
from pathlib import Path
from typing import Annotated, Any

import typer

DTYPES = ("float32", "bfloat16", "float16")


class ResizeMode(str, enum.Enum):
    """How an init image is fitted to the output size (A1111's resize modes)."""

    resize = "resize"
    crop = "crop"
    fill = "fill"


class Upscaler(str, enum.Enum):
    """Hires-fix upscalers."""

    latent = "latent"
    latent_nearest = "latent-nearest"
    lanczos = "lanczos"
    nearest = "nearest"


class PromptSyntax(str, enum.Enum):
    """How the prompt is read."""

    plain = "plain"
    a1111 = "a1111"


class DType(str, enum.Enum):
    """Weights and compute dtype."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Quantize(str, enum.Enum):
    """Weight-only quantization of the denoiser (`sdjax.quant`, docs/quantization.md)."""

    int8 = "int8"
    fp8 = "fp8"


QUANTIZE_OPTION = typer.Option(
    help="Store the denoiser's weights quantized (int8 or fp8 e4m3, per channel), dequantized inside the program.",
    rich_help_panel="Weights",
)


QUANT_COMPUTE_OPTION = typer.Option(
    help="Multiply the quantized denoiser's Dense layers and convolutions 8-bit x 8-bit (int8: TPU v5e/v5p/v6e, "
    "fp8: H100/H200); needs --quantize of the same type.",
    rich_help_panel="Weights",
)
CALIBRATION_OPTION = typer.Option(
    exists=True,
    dir_okay=False,
    help="Static input scales for --quant-compute (a quant_calibration.json written by sdjax calibrate for this "
    "model). Default: each layer scales its input per call.",
    rich_help_panel="Weights",
)

DTypeOpt = Annotated[DType, typer.Option(help="Weights and compute dtype.")]
QuantizeOpt = Annotated[Quantize | None, QUANTIZE_OPTION]
QuantComputeOpt = Annotated[Quantize | None, QUANT_COMPUTE_OPTION]
CalibrationOpt = Annotated[Path | None, CALIBRATION_OPTION]


def _check_quant_compute(quantize: Quantize | None, quant_compute: Quantize | None, calibration: Any = None) -> None:
    """--quant-compute needs --quantize of the same type, --calibration needs --quant-compute: a BadParameter
    (exit 2) naming the option, before anything is loaded or compiled."""
    if quant_compute is not None and quantize != quant_compute:
        given = "no --quantize" if quantize is None else f"--quantize {quantize.value}"
        raise typer.BadParameter(
            f"--quant-compute {quant_compute.value} multiplies kernels stored as {quant_compute.value}: give "
            f"--quantize {quant_compute.value} ({given} was given)",
            param_hint="--quant-compute",
        )
    if calibration is not None and quant_compute is None:
        raise typer.BadParameter(
            "a calibration holds the input scales of 8-bit products: give --quant-compute (and --quantize)",
            param_hint="--calibration",
        )


def _require_extra(extra: str, *modules: str) -> None:
    """Exit with an install hint when an optional extra's packages are missing."""
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True

    missing = [m for m in modules if absent(m)]
    if missing:
        typer.echo(
            f"error: this command needs the '{extra}' extra ({', '.join(missing)} not installed): "
            f"pip install 'sdjax[{extra}]'",
            err=True,
        )
        raise typer.Exit(2)


def _check_devices_env() -> None:
    """`SDJAX_DEVICES`, when set, checked at a command's start (a usage error naming it, exit 2) rather than at its
    first mesh: a server started without warming would otherwise answer its first request with a failed generation.
    Unset, nothing is checked and no JAX backend starts here."""
    import os

    from sdjax.parallel import sharding

    if os.environ.get(sharding.DEVICES_ENV, "").strip() in ("", "all"):
        return
    try:
        sharding.default_devices()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=sharding.DEVICES_ENV) from None


# ---------------------------------------------------------------------------------------------- loading
def _jnp_dtype(name: str | DType):
    import jax.numpy as jnp

    name = getattr(name, "value", name)
    if name not in DTYPES:
        raise typer.BadParameter(f"{name!r} is not one of {', '.join(DTYPES)}", param_hint="--dtype")
    return getattr(jnp, name)


def load_pipeline(model: str | None, dtype: str | DType, **kwargs: Any) -> Any:
    """The pipeline (its family from `model_index.json` or the file's tensors) for a folder, file or Hub id; None:
    the embedded model. `kwargs` go to `sdjax.load_pipeline` (`config=`, Flux's `t5=`, `clip_l=`). Its `.params`
    holds the weights."""
    from sdjax.pipelines import load_pipeline as load

    pipe, _ = load(model, dtype=_jnp_dtype(dtype), **kwargs)
    return pipe


def _load_with_vae(model: str | None, dtype, vae: str, **kwargs: Any) -> Any:
    """The pipeline with its VAE replaced (`--vae`)."""
    from sdjax.pipelines import load_pipeline as load

    pipe, _ = load(model, dtype=_jnp_dtype(dtype), vae=vae, **kwargs)
    return pipe


def _quantize_kw(quantize: Quantize | None) -> dict[str, str]:
    """`--quantize` as `load_pipeline`'s keyword (none when not given)."""
    return {"quantize": quantize.value} if quantize is not None else {}


def _quant_options(quantize: Quantize | None, quant_compute: Quantize | None, calibration: Path | None) -> Any:
    """--quantize / --quant-compute / --calibration checked before anything loads: the combination
    (`_check_quant_compute`) and the calibration file (read: one that is not a calibration, or was recorded for the
    other compute mode, is a BadParameter naming it). Returns the `sdjax.quant.Calibration`, or None."""
    _check_quant_compute(quantize, quant_compute, calibration)
    if calibration is None:
        return None
    from sdjax.quant import Calibration

    try:
        loaded = Calibration.load(calibration)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--calibration") from None
    if loaded.compute != quant_compute.value:
        raise typer.BadParameter(
            f"{calibration} was recorded for {loaded.compute} products, not --quant-compute {quant_compute.value}",
            param_hint="--calibration",
        )
    return loaded


def _apply_quant_compute(pipe: Any, quant_compute: Quantize | None, calibration: Any = None) -> Any:
    """A pipeline loaded with --quantize, its quantized Dense layers and 2-D convs switched to 8-bit x 8-bit
    products (--quant-compute) with the calibration's static input scales, if any: its policy with `compute` and
    `calibration` set (`compute_convs` left at its default, True), through `quantize_pipeline` (the loaded kernels
    are kept; a calibration of another model, or one of Dense layers only, is refused there, naming the file). The
    same params and program as `load_pipeline(quantize=QuantPolicy(..., compute=...))`."""
    if quant_compute is None:
        return pipe
    import dataclasses

    from sdjax.quant import quantize_pipeline

    policy = dataclasses.replace(pipe.quantization, compute=quant_compute.value, calibration=calibration)
    quantize_pipeline(pipe, pipe.params, policy)
    return pipe


# ---------------------------------------------------------------------------------------------- option parsers
_SIZE = re.compile(r"^(\d+)x(\d+)$")


def _parse_size(text: str, option: str) -> tuple[int, int]:
    m = _SIZE.match(text.strip())
    if not m:
        raise typer.BadParameter(f"{text!r} is not WIDTHxHEIGHT, e.g. 512x512", param_hint=option)
    return int(m.group(1)), int(m.group(2))


def _parse_list(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def _mega(value: float | None) -> int | None:
    return None if value is None else int(value * 1_000_000)


# ---------------------------------------------------------------------------------------------- files
_NUMBERED = re.compile(r"^(\d{5})-")


def _next_number(out: Path) -> int:
    numbers = [int(m.group(1)) for p in out.glob("*.png") if (m := _NUMBERED.match(p.name))]
    return max(numbers, default=-1) + 1


def image_grid(arrays, cols: int | None = None):
    """A grid of images, row-major, `cols = ceil(sqrt(n))` by default; empty cells stay black."""
    from PIL import Image

    n = len(arrays)
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    h, w = arrays[0].shape[:2]
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, a in enumerate(arrays):
        grid.paste(Image.fromarray(a), ((i % cols) * w, (i // cols) * h))
    return grid
