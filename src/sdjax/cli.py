"""The `sdjax` command: `generate` images to PNG files, `serve` the HTTP API and web page, `pnginfo` read back,
`bench` time a workload, `compile` for a TPU slice without one.

A thin adapter over the pipeline: options become a `metadata.GenerationRequest`, its images run through
`metadata.generate_images` (one `pipeline.generate_arrays` call per batch), and each PNG carries its parameters
in AUTOMATIC1111's `parameters` text chunk. Image `i` of a run uses seed `--seed + i`, so the seed in a file
reproduces that image alone. Progress and the timing summary go to stderr; the written paths go to stdout.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import re
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from sdjax import metadata
from sdjax.finetune.cli import train_app

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


# ---------------------------------------------------------------------------------------------- progress
@dataclasses.dataclass
class Timings:
    load: float = 0.0
    compile: float = 0.0
    generate: float = 0.0
    denoise: float = 0.0
    decode: float = 0.0
    save: float = 0.0
    steps: int = 0  # model calls per batch
    batches: int = 0


class _CompileClock:
    """Sums JAX's compile-time events (tracing, lowering, backend compile) while active."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self):
        self.seconds = 0.0
        self._lock = threading.Lock()

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event in self.EVENTS:
            with self._lock:
                self.seconds += duration

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        try:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
        except (AttributeError, ValueError, KeyError):
            pass


class _Reporter:
    """Rich progress bars driven by the pipeline's `progress(stage, step, total)` callback (called from JAX's
    callback thread, possibly out of order: a bar never moves back)."""

    def __init__(self, progress: Progress | None, num_batches: int):
        self.progress = progress
        self.num_batches = num_batches
        self.batch = 0
        self.call_start = 0.0
        self.last_step_time: float | None = None
        self.first_step_time: float | None = None
        self.step = 0
        self.total = 0
        self.timings_denoise = 0.0
        self.timings_decode = 0.0
        self.compile_task = self.denoise_task = self.decode_task = None
        if progress is not None:
            self.compile_task = progress.add_task("Compiling / starting", total=None)
            # started (their clocks running) when the pipeline first reports them
            self.denoise_task = progress.add_task("Denoising", total=None, visible=False, start=False)
            self.decode_task = progress.add_task("Decoding", total=num_batches, visible=False, start=False)

    def start_batch(self, index: int) -> None:
        self.batch, self.step, self.total = index, 0, 0
        self.call_start = time.perf_counter()
        self.first_step_time = self.last_step_time = None

    def __call__(self, stage: str, step: int, total: int) -> None:
        now = time.perf_counter()
        if stage == "denoise" and step > self.step:
            self.step, self.total = step, total
            if self.first_step_time is None:
                self.first_step_time = now
                if self.progress is not None and self.batch == 0:
                    self.progress.update(self.compile_task, total=1, completed=1)
                    self.progress.start_task(self.denoise_task)
            self.last_step_time = now
            if self.progress is not None:
                self.progress.update(
                    self.denoise_task, total=total * self.num_batches, visible=True, completed=self.batch * total + step
                )
        elif stage == "denoise" and total and not self.total:
            self.total = total

    def end_batch(self) -> None:
        now = time.perf_counter()
        if self.first_step_time is not None and self.last_step_time is not None and self.step > 1:
            per_step = (self.last_step_time - self.first_step_time) / (self.step - 1)
            self.timings_denoise += per_step * self.step
            self.timings_decode += now - self.last_step_time
        if self.progress is not None:
            if self.batch == 0:
                self.progress.update(self.compile_task, total=1, completed=1)
                self.progress.start_task(self.decode_task)
            self.progress.update(self.decode_task, visible=True, completed=self.batch + 1)


def _progress_bars(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(finished_text="[green]✓"),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


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


# ---------------------------------------------------------------------------------------------- generate
@app.command(no_args_is_help=True)
def generate(
    prompt: Annotated[str, typer.Argument(help="What to draw.")],
    negative_prompt: Annotated[str, typer.Option("--negative-prompt", "-n", help="What not to draw.")] = "",
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="A diffusers folder, a .safetensors checkpoint, a Hugging Face Hub id, or a name in --models-dir's "
            "Stable-diffusion/. Default: the embedded tiny model.",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            help="For a single-file --model: a diffusers folder (or Hub id) giving its configs and, for a Flux.1 "
            "transformer file, its text encoders, tokenizers and VAE.",
            rich_help_panel="Weights",
        ),
    ] = None,
    t5: Annotated[
        Path | None,
        typer.Option(help="Flux: a separate T5 encoder file (t5xxl_fp16 / fp8).", rich_help_panel="Weights"),
    ] = None,
    clip_l: Annotated[
        Path | None,
        typer.Option("--clip-l", help="Flux: a separate CLIP-L file (clip_l.safetensors).", rich_help_panel="Weights"),
    ] = None,
    sampler: Annotated[
        str | None,
        typer.Option(help="Sampler name, e.g. euler_a, ddim, 'DPM++ 2M Karras'. Default: the model's scheduler."),
    ] = None,
    prompt_syntax: Annotated[
        PromptSyntax,
        typer.Option(
            help="plain: the prompt as CLIP reads it (75 tokens); a1111: AUTOMATIC1111's (word:1.3), [word], "
            "BREAK and prompts longer than 75 tokens."
        ),
    ] = PromptSyntax.plain,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            help="LoRA file, folder or name in --lora-dir, optionally :SCALE (e.g. detail:0.7); repeatable. With "
            "--prompt-syntax a1111, <lora:name:scale> in the prompt does the same.",
            rich_help_panel="LoRA",
        ),
    ] = None,
    lora_dir: Annotated[
        Path | None, typer.Option(help="Folder where LoRA names are looked up.", rich_help_panel="LoRA")
    ] = None,
    models_dir: Annotated[
        Path | None,
        typer.Option(
            help="AUTOMATIC1111 models folder (Stable-diffusion/, Lora/, embeddings/, VAE/) where --model, --vae, "
            "--embedding and --lora names are looked up.",
            rich_help_panel="Models directory",
        ),
    ] = None,
    embedding: Annotated[
        list[str] | None,
        typer.Option(
            help="Textual-inversion embedding (file, or name in the models directory's embeddings/); its name is "
            "then a word of the prompt, as in AUTOMATIC1111. Repeatable.",
            rich_help_panel="Models directory",
        ),
    ] = None,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            help="Read pickled (.pt/.bin) embeddings with sdjax's restricted unpickler, which runs no code.",
            rich_help_panel="Models directory",
        ),
    ] = False,
    vae: Annotated[
        str | None,
        typer.Option(
            help="Replacement VAE: file, diffusers folder, Hub id, or name in the models directory's VAE/.",
            rich_help_panel="Models directory",
        ),
    ] = None,
    clip_skip: Annotated[
        int,
        typer.Option(
            min=1, help="CLIP skip (AUTOMATIC1111's): 1 conditions on the last text-encoder layer, 2 on the one before."
        ),
    ] = 1,
    schedule: Annotated[
        str | None,
        typer.Option(
            help="AUTOMATIC1111 schedule type (Automatic, Karras, Exponential, SGM Uniform, Beta, ...). With it, "
            "--sampler is read as A1111 reads it: 'DPM++ 2M' + Automatic is Karras, 'Euler a' + Automatic is Uniform."
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Sampling steps. Default: the pipeline's (50).")] = None,
    guidance_scale: Annotated[
        float | None,
        typer.Option(
            "--guidance-scale",
            "-g",
            min=0.0,
            help="Classifier-free guidance (CFG) scale. Default: 7.5; 1 (off) for Flux, whose distilled guidance is "
            "--distilled-guidance.",
        ),
    ] = None,
    distilled_guidance: Annotated[
        float | None,
        typer.Option(
            min=0.0, help="Flux dev's distilled guidance (Forge's 'Distilled CFG Scale'). Default: the model's (3.5)."
        ),
    ] = None,
    width: Annotated[
        int | None, typer.Option("--width", "-W", min=8, help="Width in pixels, a multiple of 8. Default: the model's.")
    ] = None,
    height: Annotated[
        int | None,
        typer.Option("--height", "-H", min=8, help="Height in pixels, a multiple of 8. Default: the model's."),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            "--seed",
            "-s",
            min=-1,
            max=metadata.SEED_MAX,
            help="Seed of the first image; image i uses seed + i. -1: random.",
        ),
    ] = 0,
    num_images: Annotated[int, typer.Option("--num-images", "-N", min=1, help="How many images.")] = 1,
    batch_size: Annotated[
        int | None,
        typer.Option(min=1, help="Images per compiled batch (does not change the images). Default: all at once."),
    ] = None,
    dtype: Annotated[DType, typer.Option(help="Weights and compute dtype.")] = DType.float32,
    quantize: Annotated[Quantize | None, QUANTIZE_OPTION] = None,
    out: Annotated[Path, typer.Option("--out", "-o", file_okay=False, help="Output folder (created).")] = Path(
        "outputs"
    ),
    grid: Annotated[bool, typer.Option("--grid", help="Also write all images as one grid PNG.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or timing summary.")] = False,
    vae_tiling: Annotated[
        bool,
        typer.Option(
            "--vae-tiling",
            help="Encode/decode through the VAE in overlapping tiles (diffusers' enable_vae_tiling): bounded memory "
            "for large images; images larger than one tile (the VAE's sample_size, 512 px for SD 1.5) change slightly.",
        ),
    ] = False,
    vae_slicing: Annotated[
        bool,
        typer.Option(
            "--vae-slicing",
            help="Encode/decode one image per device at a time (diffusers' enable_vae_slicing): less memory for "
            "large batches, the same images.",
        ),
    ] = False,
    image: Annotated[
        Path | None,
        typer.Option(
            "--image",
            "-i",
            exists=True,
            dir_okay=False,
            help="Init image: image-to-image (with --mask: inpainting). The size defaults to the image's.",
            rich_help_panel="Image to image",
        ),
    ] = None,
    strength: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Denoising strength of --image (A1111's: int(min(s, 0.999) * steps) + 1 steps run).",
            rich_help_panel="Image to image",
        ),
    ] = 0.75,
    mask: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="Inpainting mask for --image: white is repainted.",
            rich_help_panel="Image to image",
        ),
    ] = None,
    mask_blur: Annotated[
        float, typer.Option(min=0.0, help="Gaussian blur of the mask, in pixels.", rich_help_panel="Image to image")
    ] = 4.0,
    only_masked: Annotated[
        int | None,
        typer.Option(
            "--only-masked",
            min=0,
            help="Repaint only the masked region at full resolution, "
            "with this padding in pixels (A1111's 'Inpaint area: Only masked').",
            rich_help_panel="Image to image",
        ),
    ] = None,
    outpaint: Annotated[
        str | None,
        typer.Option(
            help="Outpaint: extend --image by L,T,R,B pixels (inpainting on a larger canvas).",
            rich_help_panel="Image to image",
        ),
    ] = None,
    resize_mode: Annotated[
        ResizeMode, typer.Option(help="How --image is fitted to --width/--height.", rich_help_panel="Image to image")
    ] = ResizeMode.resize,
    hires_scale: Annotated[
        float | None,
        typer.Option(min=0.0, help="Hires fix: upscale factor of the second pass.", rich_help_panel="Hires fix"),
    ] = None,
    hires_strength: Annotated[
        float,
        typer.Option(
            min=0.0, max=1.0, help="Hires fix: denoising strength of the second pass.", rich_help_panel="Hires fix"
        ),
    ] = 0.7,
    hires_steps: Annotated[
        int,
        typer.Option(min=0, help="Hires fix: second-pass steps (0: the first pass's).", rich_help_panel="Hires fix"),
    ] = 0,
    hires_upscaler: Annotated[
        Upscaler, typer.Option(help="Hires fix: upscaler.", rich_help_panel="Hires fix")
    ] = Upscaler.latent,
    refiner: Annotated[
        str | None,
        typer.Option(
            help="SDXL refiner (folder, Hub id or file) for the end of the schedule.", rich_help_panel="SDXL refiner"
        ),
    ] = None,
    refiner_start: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Fraction of the schedule after which the refiner takes over.",
            rich_help_panel="SDXL refiner",
        ),
    ] = 0.8,
    controlnet: Annotated[
        list[str] | None,
        typer.Option(
            help="ControlNet (folder or Hub id); repeat for several, each with its own --control-image.",
            rich_help_panel="ControlNet",
        ),
    ] = None,
    control_image: Annotated[
        list[Path] | None,
        typer.Option(help="Control image, one per --controlnet.", rich_help_panel="ControlNet"),
    ] = None,
    control_preprocess: Annotated[
        list[str] | None,
        typer.Option(
            help="Preprocessor turning the control image into the map (none, canny, threshold, scribble_xdog, "
            "invert); one for all or one per net. Default: none (the image is the map).",
            rich_help_panel="ControlNet",
        ),
    ] = None,
    control_scale: Annotated[
        list[float] | None,
        typer.Option(help="Conditioning scale; one for all or one per net. Default: 1.", rich_help_panel="ControlNet"),
    ] = None,
    control_start: Annotated[
        list[float] | None,
        typer.Option(help="Fraction of the steps where a net starts (0).", rich_help_panel="ControlNet"),
    ] = None,
    control_end: Annotated[
        list[float] | None,
        typer.Option(help="Fraction of the steps where a net stops (1).", rich_help_panel="ControlNet"),
    ] = None,
) -> None:
    """Generate images from a prompt (or from an image: --image, --mask, --outpaint) and write PNGs carrying their
    parameters (AUTOMATIC1111 format)."""
    units = _control_units(controlnet, control_image, control_preprocess, control_scale, control_start, control_end)
    from sdjax import cli_models

    weights = cli_models.resolve_weights(
        models_dir=models_dir,
        model=model,
        vae=vae,
        embeddings=embedding,
        loras=lora,
        lora_dir=lora_dir,
        prompt=prompt,
        negative_prompt=negative_prompt,
        a1111_syntax=getattr(prompt_syntax, "value", prompt_syntax) == "a1111",
    )
    model = weights.model
    err = Console(stderr=True, quiet=quiet)
    _jnp_dtype(dtype)
    timings = Timings()
    t_start = time.perf_counter()
    bars = None if quiet else _progress_bars(err)
    with _CompileClock() as clock, bars or _Null():
        task = bars.add_task(f"Loading {model or 'the embedded model'}", total=None) if bars else None
        t0 = time.perf_counter()
        try:
            files = {k: v for k, v in (("config", config), ("t5", t5), ("clip_l", clip_l)) if v is not None}
            if files:
                if weights.vae is not None:
                    raise typer.BadParameter("--vae with --config/--t5/--clip-l is not supported", param_hint="--vae")
                pipe = load_pipeline(model, dtype, **{k: str(v) for k, v in files.items()}, **_quantize_kw(quantize))
            else:
                q = _quantize_kw(quantize)
                pipe = (
                    load_pipeline(model, dtype, **q)
                    if weights.vae is None
                    else _load_with_vae(model, dtype, weights.vae, **q)
                )
            for path in weights.embeddings:
                pipe.load_textual_inversion(path, token=path.stem, allow_pickle=allow_pickle)  # A1111: file name
            model_hash = cli_models.model_hash(weights)
            if distilled_guidance is not None and not hasattr(pipe, "distilled_guidance_scale"):
                raise typer.BadParameter(
                    "this model has no distilled guidance (Flux dev has); use --guidance-scale",
                    param_hint="--distilled-guidance",
                )
        except Exception as e:  # loading reports the file, key or id at fault: show it, not a traceback
            if bars:
                bars.stop()
            err.print(
                f"[red]error:[/red] could not load {model or 'the embedded model'}: {escape(str(e))}",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None
        cli_models.check_clip_skip(pipe, clip_skip)
        timings.load = time.perf_counter() - t0
        if vae_tiling:
            pipe.enable_vae_tiling()
        if vae_slicing:
            pipe.enable_vae_slicing()
        if bars:
            bars.update(task, total=1, completed=1)
        task = _task_options(
            pipe,
            image=image,
            strength=strength,
            mask=mask,
            mask_blur=mask_blur,
            only_masked=only_masked,
            outpaint=outpaint,
            resize_mode=resize_mode.value,
            hires_scale=hires_scale,
            hires_strength=hires_strength,
            hires_steps=hires_steps,
            hires_upscaler=hires_upscaler.value,
            width=width,
            height=height,
        )
        width, height = task.pop("width"), task.pop("height")
        refiner_pipe = None
        if refiner is not None:
            if image is not None or hires_scale is not None:
                raise typer.BadParameter(
                    "the refiner hand-off is for text-to-image; leave out --image and --hires-*", param_hint="--refiner"
                )
            if not 0 < refiner_start < 1:
                raise typer.BadParameter("must lie strictly between 0 and 1", param_hint="--refiner-start")
            try:
                refiner_pipe = load_pipeline(refiner, dtype)
                if vae_tiling:
                    refiner_pipe.enable_vae_tiling()
                if vae_slicing:
                    refiner_pipe.enable_vae_slicing()
            except Exception as e:
                err.print(
                    f"[red]error:[/red] could not load the refiner {refiner}: {escape(str(e))}",
                    highlight=False,
                    soft_wrap=True,
                )
                raise typer.Exit(1) from None
            task.update(refiner=metadata.model_label(refiner), refiner_switch=refiner_start)
        if weights.loras:
            _load_loras(pipe, weights.loras, err)
        if hasattr(pipe, "distilled_guidance_scale") and pipe.transformer.config.guidance_embeds:
            task["distilled_guidance"] = (
                pipe.distilled_guidance_scale if distilled_guidance is None else distilled_guidance
            )
        task.update(clip_skip=clip_skip, loras=weights.tags, vae=weights.vae_label, model_hash=model_hash,
                    lora_hashes=metadata.lora_hashes(weights.tag_files),
                    ti_hashes=metadata.ti_hashes([prompt, negative_prompt or ""],
                                                 [(p.stem, p) for p in weights.embeddings]))  # fmt: skip
        if units:
            if refiner is not None or hires_scale is not None:
                raise typer.BadParameter(
                    "ControlNet does not run with --refiner or --hires-*", param_hint="--controlnet"
                )
            _check_controlnets(pipe, units, err)
            task["control"] = units
        if schedule is not None:
            sampler = _a1111_sampler(sampler or pipe.default_sampler, schedule)
        request = _request(
            pipe,
            prompt=prompt,
            negative_prompt=negative_prompt,
            model=model,
            sampler=sampler,
            steps=steps,
            guidance_scale=guidance_scale,
            width=width,
            height=height,
            seed=seed,
            num_images=num_images,
            prompt_syntax=getattr(prompt_syntax, "value", prompt_syntax),
            **task,
        )
        if weights.model_label:
            request = dataclasses.replace(request, model=weights.model_label)
        images = request.images()
        size = batch_size or len(images)
        batches = [images[i : i + size] for i in range(0, len(images), size)]
        reporter = _Reporter(bars, len(batches))
        arrays = []
        compile_before = clock.seconds
        t0 = time.perf_counter()
        for index, batch in enumerate(batches):
            reporter.start_batch(index)
            try:
                arrays.extend(
                    metadata.generate_images(
                        pipe, batch, pad_to=size, refiner=refiner_pipe, progress=None if quiet else reporter
                    )
                )
            except ValueError as e:  # input only the pipeline can check (e.g. an empty mask)
                if bars:
                    bars.stop()
                err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
                raise typer.Exit(2) from None
            reporter.end_batch()
        timings.generate = time.perf_counter() - t0
        timings.compile = clock.seconds - compile_before
        timings.denoise, timings.decode = reporter.timings_denoise, reporter.timings_decode
        timings.steps, timings.batches = reporter.total or request.steps, len(batches)

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    number = _next_number(out)
    paths = []
    for k, (params, array) in enumerate(zip(images, arrays)):
        path = out / f"{number + k:05d}-{params.seed}.png"
        path.write_bytes(metadata.png_bytes(array, params.infotext()))
        paths.append(path)
    if grid:
        path = out / f"grid-{number:05d}.png"
        path.write_bytes(metadata.png_bytes(image_grid(arrays), images[0].infotext()))
        paths.append(path)
    timings.save = time.perf_counter() - t0
    for path in paths:
        typer.echo(str(path))
    if not quiet:
        _summary(err, timings, time.perf_counter() - t_start, len(images), request)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _task_options(
    pipe,
    *,
    image,
    strength,
    mask,
    mask_blur,
    only_masked,
    outpaint,
    resize_mode,
    hires_scale,
    hires_strength,
    hires_steps,
    hires_upscaler,
    width,
    height,
) -> dict[str, Any]:
    """The image-to-image, inpainting, outpainting and hires settings of `generate` as `GenerationRequest` fields
    (plus the resolved width/height), checked before anything loads or compiles."""
    from sdjax.core import images as image_lib

    out: dict[str, Any] = {"width": width, "height": height}
    if image is None:
        for flag, given in (
            ("--mask", mask is not None),
            ("--outpaint", outpaint is not None),
            ("--only-masked", only_masked is not None),
        ):
            if given:
                raise typer.BadParameter("needs --image", param_hint=flag)
        if hires_scale is not None:
            from sdjax.pipelines.recipes import Hires

            try:
                out["hires"] = Hires(
                    scale=hires_scale, strength=hires_strength, steps=hires_steps, upscaler=hires_upscaler
                )
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint="--hires-*") from None
        return out
    if hires_scale is not None:
        raise typer.BadParameter(
            "the hires fix is a text-to-image option; leave out --image", param_hint="--hires-scale"
        )
    try:
        init = image_lib.load_image(str(image), "--image").convert("RGB")
        mask_im = image_lib.load_image(str(mask), "--mask") if mask is not None else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--image/--mask") from None
    if outpaint is not None:
        if mask_im is not None:
            raise typer.BadParameter("--outpaint makes its own mask; leave out --mask", param_hint="--outpaint")
        try:
            sides = [int(v) for v in outpaint.split(",")]
            if len(sides) != 4:
                raise ValueError
        except ValueError:
            raise typer.BadParameter(
                f"{outpaint!r} is not four comma-separated ints L,T,R,B", param_hint="--outpaint"
            ) from None
        try:
            init, mask_im = image_lib.outpaint_canvas(init, *sides)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--outpaint") from None
    if mask_im is not None and mask_im.size != init.size:
        raise typer.BadParameter(
            f"the mask is {mask_im.size[0]}x{mask_im.size[1]} but the image is {init.size[0]}x{init.size[1]}",
            param_hint="--mask",
        )
    if width is None and height is None:
        width, height = init.size
    elif width is None or height is None:
        raise typer.BadParameter(
            "with --image give both --width and --height, or neither (the image's size)", param_hint="--width/--height"
        )
    out.update(
        width=width,
        height=height,
        init_image=init,
        mask_image=mask_im,
        denoising_strength=strength,
        resize_mode=resize_mode,
    )
    if mask_im is not None:
        out.update(mask_blur=mask_blur, inpaint_full_res_padding=only_masked)
    return out


def _load_with_vae(model: str | None, dtype, vae: str, **kwargs: Any) -> Any:
    """The pipeline with its VAE replaced (`--vae`)."""
    from sdjax.pipelines import load_pipeline as load

    pipe, _ = load(model, dtype=_jnp_dtype(dtype), vae=vae, **kwargs)
    return pipe


def _quantize_kw(quantize: Quantize | None) -> dict[str, str]:
    """`--quantize` as `load_pipeline`'s keyword (none when not given)."""
    return {"quantize": quantize.value} if quantize is not None else {}


def _load_loras(pipe, loras, err) -> None:
    """Load each (file, scale) and activate them together."""
    for path, scale in loras:
        try:
            pipe.load_lora(path, scale=scale)
        except Exception as e:  # the loader names the file, key or shape at fault
            err.print(f"[red]error:[/red] LoRA {escape(str(path))}: {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None


def _per_unit(values, n: int, option: str, default):
    if not values:
        return [default] * n
    if len(values) == 1:
        return list(values) * n
    if len(values) != n:
        raise typer.BadParameter(f"give one value, or one per --controlnet ({n}); got {len(values)}", param_hint=option)
    return list(values)


def _control_units(models, images, modules, scales, starts, ends) -> tuple:
    """--controlnet and its options -> `metadata.ControlUnit`s with their control maps (checked before loading)."""
    models, images = list(models or ()), list(images or ())
    if not models:
        if images or modules or scales or starts or ends:
            raise typer.BadParameter("control options need --controlnet", param_hint="--controlnet")
        return ()
    if len(images) != len(models):
        raise typer.BadParameter(
            f"give one --control-image per --controlnet ({len(models)}); got {len(images)}",
            param_hint="--control-image",
        )
    import numpy as np
    from PIL import Image

    from sdjax import preprocess

    n = len(models)
    modules = _per_unit(modules, n, "--control-preprocess", "none")
    scales = _per_unit(scales, n, "--control-scale", 1.0)
    starts = _per_unit(starts, n, "--control-start", 0.0)
    ends = _per_unit(ends, n, "--control-end", 1.0)
    units = []
    for model, path, module, scale, start, end in zip(models, images, modules, scales, starts, ends, strict=True):
        if not 0 <= start < end <= 1:
            raise typer.BadParameter(f"need 0 <= start < end <= 1, got {start} and {end}", param_hint="--control-start")
        try:
            pre = preprocess.get_preprocessor(module)
        except (KeyError, ValueError) as e:
            raise typer.BadParameter(str(e.args[0] if e.args else e), param_hint="--control-preprocess") from None
        try:
            with Image.open(path) as im:
                source = np.asarray(im.convert("RGB"))
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"{path}: not a readable image ({e})", param_hint="--control-image") from None
        try:
            control_map = pre(source)
        except (ValueError, ImportError) as e:
            raise typer.BadParameter(f"{module}: {e}", param_hint="--control-preprocess") from None
        units.append(metadata.ControlUnit(model, pre.name, float(scale), float(start), float(end), control_map))
    return tuple(units)


def _check_controlnets(pipe, units, err) -> None:
    """Load the nets now (cached on the pipeline) so that a bad id or a net for another family fails first."""
    from sdjax.pipelines.controlnet import control_spec

    try:
        control_spec(pipe, [u.model for u in units], None)
    except Exception as e:  # the loader names the folder, file or key at fault
        err.print(f"[red]error:[/red] ControlNet: {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _a1111_sampler(sampler: str, schedule: str) -> str:
    """--sampler + --schedule as one sampler string, with A1111's meaning of "Automatic"."""
    from sdjax.config import ConfigError
    from sdjax.samplers import a1111, schedules

    try:
        schedules.find_schedule(schedule)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--schedule") from None
    try:
        return metadata.sampler_id(a1111.canonical(sampler, schedule))
    except a1111.UnsupportedSamplerError as e:
        raise typer.BadParameter(str(e), param_hint="--sampler") from None
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--schedule") from None


def _request(
    pipe, *, prompt, negative_prompt, model, sampler, steps, guidance_scale, width, height, seed, num_images, **task
) -> metadata.GenerationRequest:
    """Resolve defaults from the pipeline and check everything before anything compiles."""
    import random

    dh, dw = pipe.default_size
    if guidance_scale is None:  # the face's default CFG scale: A1111's 7.5; Forge's 1 for guidance-distilled Flux
        guidance_scale = getattr(pipe, "cfg_scale_default", 7.5)
    request = metadata.GenerationRequest(
        prompt=prompt,
        negative_prompt=negative_prompt,
        num_images=num_images,
        seed=random.SystemRandom().randrange(metadata.SEED_MAX + 1) if seed == -1 else seed,
        steps=steps or pipe.default_steps,
        guidance_scale=guidance_scale,
        width=width or dw,
        height=height or dh,
        sampler=sampler or pipe.default_sampler,
        model=metadata.model_label(model),
        **task,
    )
    texts = [prompt, negative_prompt]
    if request.loras:  # the <lora:...> tags were resolved; the text encoder reads the rest
        texts = metadata.strip_lora_tags(texts, request.loras)
    for hint, kwargs in (
        ("--sampler", dict(sampler=request.sampler)),
        ("--steps", dict(steps=request.steps)),
        ("--width/--height", dict(height=request.height, width=request.width)),
        ("PROMPT", dict(prompts=[texts[0]], negative_prompts=[texts[1]])),
    ):
        try:
            pipe.validate(**kwargs)
        except (ValueError, KeyError) as e:
            raise typer.BadParameter(str(e.args[0] if e.args else e), param_hint=hint) from None
    return request


def _summary(console: Console, t: Timings, total: float, n: int, request: metadata.GenerationRequest) -> None:
    table = Table(
        title=f"{n} image(s), {request.width}x{request.height}, {request.steps} steps, {request.sampler}",
        title_justify="left",
        show_header=True,
        header_style="bold",
    )
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_row("load model", f"{t.load:.2f}")
    table.add_row("compile (JAX events)", f"{t.compile:.2f}")
    if t.denoise:
        table.add_row("denoise (from step times)", f"{t.denoise:.2f}")
        table.add_row("decode", f"{t.decode:.2f}")
    table.add_row("generate (all of the above but load)", f"{t.generate:.2f}")
    table.add_row("write PNGs", f"{t.save:.2f}")
    table.add_row("total", f"{total:.2f}")
    run = t.generate - t.compile
    if run > 0:
        table.add_row("images / s (excluding compile)", f"{n / run:.2f}")
    if t.denoise:
        table.add_row("batch steps / s", f"{t.steps * t.batches / t.denoise:.2f}")
    console.print(table)


# ---------------------------------------------------------------------------------------------- serve
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


@app.command()
def serve(
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="A diffusers folder or Hugging Face Hub id. Default: the embedded tiny model."
        ),
    ] = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on: 127.0.0.1 (this machine only) unless you name another.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    dtype: Annotated[DType, typer.Option(help="Weights and compute dtype.")] = DType.float32,
    quantize: Annotated[Quantize | None, QUANTIZE_OPTION] = None,
    max_batch: Annotated[int, typer.Option(min=1, help="Most images in one compiled batch.")] = 8,
    batch_sizes: Annotated[
        str | None,
        typer.Option(
            help="Compiled batch sizes, comma-separated (a batch is padded to the next). Default: powers of two up "
            "to --max-batch. One size (e.g. 8) makes every image's bytes independent of the load."
        ),
    ] = None,
    batch_window_ms: Annotated[
        float, typer.Option(min=0.0, help="How long the oldest waiting request waits for others to share its batch.")
    ] = 10.0,
    max_queue: Annotated[int, typer.Option(min=1, help="Most images waiting; more get 429 Retry-After.")] = 64,
    max_queue_cost: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Most work waiting, in millions of pixel-steps (width x height x steps x images); more get 429, "
            "a request larger than all of it 422. Default: no bound.",
        ),
    ] = None,
    max_request_cost: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Most work one request may ask for, in millions of pixel-steps (512x512 x 50 steps x 4 images = "
            "52.4); more get 422. Default: no bound beyond --max-size, --max-steps and --max-images.",
        ),
    ] = None,
    request_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds before a request is answered 504 and its work cancelled (compilation of a new shape counts).",
        ),
    ] = 300.0,
    warm_size: Annotated[
        list[str] | None,
        typer.Option(
            help="WIDTHxHEIGHT to compile at start-up, for each batch size (repeatable). Default: the model's size."
        ),
    ] = None,
    warm_steps: Annotated[
        list[int] | None,
        typer.Option(min=1, help="Steps to compile at start-up (repeatable). Default: --steps."),
    ] = None,
    warm_sampler: Annotated[
        list[str] | None,
        typer.Option(help="Samplers to compile at start-up (repeatable). Default: --sampler."),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(min=1, help="Steps of requests that give none, compiled at start-up. Default: the pipeline's."),
    ] = None,
    sampler: Annotated[
        str | None,
        typer.Option(help="Sampler of requests that give none, compiled at start-up. Default: the model's scheduler."),
    ] = None,
    no_warm: Annotated[bool, typer.Option("--no-warm", help="Compile nothing at start-up.")] = False,
    pin: Annotated[
        bool,
        typer.Option(
            "--pin",
            help="Serve only what start-up compiled: the --warm-size sizes x --warm-steps x --warm-sampler samplers "
            "(422 otherwise), so that no request stalls the server compiling.",
        ),
    ] = False,
    only_warm_sizes: Annotated[
        bool,
        typer.Option(
            "--only-warm-sizes",
            help="Refuse (422) sizes other than the --warm-size ones (sizes only; --pin also pins steps and samplers).",
        ),
    ] = False,
    max_size: Annotated[int, typer.Option(min=8, help="Largest width or height a request may ask for.")] = 1024,
    max_steps: Annotated[int, typer.Option(min=1, help="Most steps a request may ask for.")] = 150,
    max_images: Annotated[int, typer.Option(min=1, help="Most images one request may ask for.")] = 8,
    max_body_kb: Annotated[int, typer.Option(min=1, help="Largest request body in KiB (413 above).")] = 64,
    max_programs: Annotated[
        int, typer.Option(min=1, help="Compiled programs kept (least recently used out, their memory freed).")
    ] = 16,
    max_program_mb: Annotated[
        int | None, typer.Option(min=1, help="Bound on the programs' generated code in MiB (GPU/TPU report it).")
    ] = None,
    max_image_body_mb: Annotated[
        int, typer.Option(min=1, help="Largest body in MiB of the endpoints that carry images (img2img, edits).")
    ] = 48,
    body_timeout: Annotated[
        float, typer.Option(min=0.001, help="Seconds for a whole request body to arrive (then 400 or 408).")
    ] = 10.0,
    header_timeout: Annotated[
        float, typer.Option(min=0.001, help="Seconds for a connection's request head to arrive (then it is closed).")
    ] = 10.0,
    shutdown_timeout: Annotated[
        float,
        typer.Option(min=0.0, help="On SIGTERM, seconds to let running requests finish before cancelling them."),
    ] = 30.0,
    stuck_after: Annotated[
        float,
        typer.Option(
            min=0.001, help="GET /health/ready answers 503 when the running batch shows no progress this long."
        ),
    ] = 600.0,
    max_connections: Annotated[
        int, typer.Option(min=1, help="Most concurrent connections and requests; more get 503.")
    ] = 1024,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="SDJAX_API_KEY",
            help="Require this key as Authorization: Bearer <key> (OpenAI clients' api_key). Or set SDJAX_API_KEY.",
        ),
    ] = None,
    api_auth: Annotated[
        str | None,
        typer.Option(
            envvar="SDJAX_API_AUTH",
            help="Require HTTP basic auth (AUTOMATIC1111's --api-auth): user:password, comma-separated for several. "
            "Or set SDJAX_API_AUTH.",
        ),
    ] = None,
    cors_origins: Annotated[
        str | None,
        typer.Option(help="Origins allowed to call the API from a browser, comma-separated. Default: none."),
    ] = None,
    models_dir: Annotated[
        str | None,
        typer.Option(
            help="AUTOMATIC1111 models folder (Stable-diffusion/, Lora/, embeddings/, VAE/, ControlNet/), or a folder "
            "of diffusers model folders: --model names, POST /sdapi/v1/options (sd_model_checkpoint) switches, "
            "GET /sdapi/v1/sd-models, loras, embeddings (loaded at start-up) and sd-vae list them."
        ),
    ] = None,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            help="Load the pickled (.pt/.bin) embeddings of --models-dir too, with sdjax's restricted unpickler "
            "(runs no code). Default: they are listed as skipped."
        ),
    ] = False,
    vae: Annotated[
        str | None,
        typer.Option(help="Serve with this VAE: file, diffusers folder, Hub id or name in --models-dir's VAE/."),
    ] = None,
    controlnet_dir: Annotated[
        str | None,
        typer.Option(
            help="A folder of diffusers ControlNet folders that A1111 requests name in alwayson_scripts.controlnet "
            "(listed by GET /controlnet/model_list)."
        ),
    ] = None,
    file_ttl: Annotated[
        float, typer.Option(min=1.0, help='Seconds an image of response_format="url" stays downloadable.')
    ] = 3600.0,
    no_docs: Annotated[
        bool, typer.Option("--no-docs", help="No /docs page (it is served from the local swagger-ui-bundle).")
    ] = False,
    no_progress: Annotated[
        bool,
        typer.Option(
            "--no-progress",
            help="No per-step progress from the pipeline (a host callback per step; "
            "/sdapi/v1/progress then shows only queued/running).",
        ),
    ] = False,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve the OpenAI and AUTOMATIC1111 image APIs, /metrics and a web page at / (FastAPI + uvicorn)."""
    import logging

    _require_extra("serve", "fastapi", "uvicorn", "prometheus_client")
    from sdjax import server

    sizes = tuple(_parse_size(s, "--warm-size") for s in (warm_size or ()))
    try:
        batch = tuple(int(x) for x in batch_sizes.split(",")) if batch_sizes else ()
    except ValueError:
        raise typer.BadParameter(
            f"{batch_sizes!r} is not a comma-separated list of ints", param_hint="--batch-sizes"
        ) from None
    if any(b < 1 or b > max_batch for b in batch):
        raise typer.BadParameter(f"sizes must lie in 1..--max-batch ({max_batch})", param_hint="--batch-sizes")
    try:
        users = tuple(server.Auth.parse_user(u) for u in _parse_list(api_auth))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--api-auth") from None
    if models_dir is not None and not Path(models_dir).is_dir():
        raise typer.BadParameter(f"{models_dir} is not a folder", param_hint="--models-dir")
    if controlnet_dir is not None and not Path(controlnet_dir).is_dir():
        raise typer.BadParameter(f"{controlnet_dir} is not a folder", param_hint="--controlnet-dir")
    from sdjax import cli_models

    md = cli_models.open_models_dir(Path(models_dir) if models_dir else None)
    model, model_label, _ = cli_models.resolve_model(md, model)
    vae_target, vae_label = cli_models.resolve_vae(md, vae)
    checkpoint = ""  # the served model's A1111 title when it comes from the models directory
    entry = next((e for e in md.list("checkpoint") if str(e.path) == model), None) if md is not None else None
    if entry is not None:
        checkpoint = entry.name if entry.is_folder else f"{entry.name} [{md.hashes.sha256(entry.path)[:10]}]"
    if controlnet_dir is None and md is not None and md.folder("controlnet") is not None:
        controlnet_dir = str(md.folder("controlnet"))
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("sdjax")
    logger.addHandler(handler)
    logger.setLevel(log_level.upper())
    err = Console(stderr=True)
    t0 = time.perf_counter()
    with err.status(f"Loading {model or 'the embedded model'}"):
        try:
            q = _quantize_kw(quantize)
            pipe = (
                load_pipeline(model, dtype, **q)
                if vae_target is None
                else _load_with_vae(model, dtype, vae_target, **q)
            )
        except Exception as e:
            err.print(
                f"[red]error:[/red] could not load {model or 'the embedded model'}: {escape(str(e))}",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None
    for name, option in [(sampler, "--sampler"), *((s, "--warm-sampler") for s in warm_sampler or ())]:
        if name is not None:
            try:
                pipe.validate(sampler=name)
            except (ValueError, KeyError) as e:
                raise typer.BadParameter(str(e.args[0] if e.args else e), param_hint=option) from None
    warming = (
        ""
        if no_warm
        else (f"; compiling {len(sizes) or 1} size(s) first (GET /health/ready answers 503 until then, requests wait)")
    )
    err.print(f"Loaded in {time.perf_counter() - t0:.1f} s. Serving at http://{host}:{port}/{warming}", highlight=False)
    allowed = None
    if only_warm_sizes:
        h, w = pipe.default_size
        allowed = sizes or ((w, h),)
    config = server.ServerConfig(
        model_name=model_label or metadata.model_label(model),
        checkpoint=checkpoint,
        vae_name=vae_label,
        max_batch=max_batch,
        batch_sizes=batch,
        batch_window_s=batch_window_ms / 1000,
        max_queue_images=max_queue,
        max_queue_cost=_mega(max_queue_cost),
        request_timeout_s=request_timeout,
        max_body_bytes=max_body_kb * 1024,
        max_image_body_bytes=max_image_body_mb * 1024 * 1024,
        max_programs=max_programs,
        max_program_bytes=None if max_program_mb is None else max_program_mb * 1024 * 1024,
        body_timeout_s=body_timeout,
        header_timeout_s=header_timeout,
        shutdown_timeout_s=shutdown_timeout,
        stuck_after_s=stuck_after,
        max_connections=max_connections,
        warm_sizes=sizes,
        warm_steps=tuple(warm_steps or ()),
        warm_samplers=tuple(warm_sampler or ()),
        warm=not no_warm,
        pin=pin,
        progress=not no_progress,
        default_steps=steps,
        default_sampler=sampler,
        limits=server.Limits(
            max_images=max_images,
            max_steps=max_steps,
            max_size=max_size,
            sizes=allowed,
            max_cost=_mega(max_request_cost),
        ),
        api_key=api_key or None,
        api_auth=users,
        cors_origins=_parse_list(cors_origins),
        models_dir=models_dir,
        allow_pickle_embeddings=allow_pickle,
        controlnet_dir=controlnet_dir,
        file_ttl_s=file_ttl,
        docs=not no_docs,
    )
    server.serve(
        pipe,
        config,
        host=host,
        port=port,
        log_level=log_level,
        loader=(
            (lambda path: load_pipeline(path, dtype) if vae_target is None else _load_with_vae(path, dtype, vae_target))
            if models_dir
            else None
        ),
    )


# ---------------------------------------------------------------------------------------------- bench
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
app.add_typer(bench_app, name="bench")
app.add_typer(train_app, name="train")


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


# ---------------------------------------------------------------------------------------------- compile
@app.command("compile", no_args_is_help=True)
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
    _require_extra("tpu-aot", "libtpu")
    if size is None:
        hw = None
    elif size.strip().isdigit():
        hw = int(size)
    else:
        w, h = _parse_size(size, "--size")
        hw = (h, w)
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
    if not report.fits:
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
        raise typer.Exit(1)


# ---------------------------------------------------------------------------------------------- pnginfo
class Prediction(str, enum.Enum):
    """What the UNet predicts (diffusers' `prediction_type`)."""

    epsilon = "epsilon"
    v_prediction = "v_prediction"


@app.command(no_args_is_help=True)
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


@app.command(no_args_is_help=True)
def pnginfo(
    files: Annotated[list[Path], typer.Argument(exists=True, dir_okay=False, help="PNG files.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the parsed fields as JSON.")] = False,
) -> None:
    """Print the generation parameters stored in PNG files (sdjax, AUTOMATIC1111 and compatible tools)."""
    status = 0
    for path in files:
        try:
            text = metadata.read_parameters(path)
        except Exception as e:  # a file that is not an image, or a truncated or corrupt one: one line, go on
            typer.echo(f"{path}: {_unreadable(e)}", err=True)
            status = 1
            continue
        if text is None:
            typer.echo(f"{path}: no parameters chunk", err=True)
            status = 1
            continue
        if as_json:
            typer.echo(json.dumps({"file": str(path), **metadata.parse_parameters(text)}, ensure_ascii=False))
        else:
            typer.echo(f"{path}:\n{text}\n" if len(files) > 1 else text)
    raise typer.Exit(status)


def _unreadable(error: Exception) -> str:
    """Why `metadata.read_parameters` could not read a file, in words (for `pnginfo`)."""
    from PIL import UnidentifiedImageError

    if isinstance(error, UnidentifiedImageError):
        return "not an image (pnginfo reads PNG files)"
    if isinstance(error, OSError) and error.errno is not None:
        return f"cannot read it: {error.strerror or error}"
    if isinstance(error, (OSError, SyntaxError, ValueError, EOFError)):
        return f"truncated or corrupt image ({error})"
    raise error


def main() -> None:
    from sdjax import runtime

    runtime.configure_cpu()  # XLA:CPU flags, before any JAX backend starts (no effect on GPU/TPU)
    app()


if __name__ == "__main__":
    sys.exit(main())
