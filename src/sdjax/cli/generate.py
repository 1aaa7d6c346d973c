"""`sdjax generate`: options become a `metadata.GenerationRequest`, its images run through
`metadata.generate_images` (one `pipeline.generate_arrays` call per batch), and each PNG carries its parameters in
AUTOMATIC1111's `parameters` text chunk. Image `i` of a run uses seed `--seed + i`, so the seed in a file reproduces
that image alone. Progress and the timing summary go to stderr; the written paths go to stdout.

The command's steps, in order: check the ControlNet options and resolve the weight options to files
(`cli.models`), load the model, check the task options and load the refiner, LoRAs and ControlNets, build the
request, run its batches, write the PNGs, print the summary.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from sdjax import infotext, metadata
from sdjax.cli import generate_options as opt
from sdjax.cli.common import (
    CalibrationOpt,
    DType,
    DTypeOpt,
    PromptSyntax,
    QuantComputeOpt,
    QuantizeOpt,
    ResizeMode,
    Upscaler,
    _apply_quant_compute,
    _check_devices_env,
    _jnp_dtype,
    _load_with_vae,
    _next_number,
    _quant_options,
    _quantize_kw,
    image_grid,
    load_pipeline,
)
from sdjax.cli.generate_options import GenerateOptions
from sdjax.cli.generate_request import _a1111_sampler, _control_units, _request, _task_options
from sdjax.cli.progress import Timings, _CompileClock, _Null, _progress_bars, _Reporter, _summary
from sdjax.policy import A1111


def generate(
    prompt: opt.PromptArg,
    negative_prompt: opt.NegativePromptOpt = "",
    model: opt.ModelOpt = None,
    config: opt.ConfigOpt = None,
    t5: opt.T5Opt = None,
    clip_l: opt.ClipLOpt = None,
    clip_g: opt.ClipGOpt = None,
    sampler: opt.SamplerOpt = None,
    prompt_syntax: opt.PromptSyntaxOpt = PromptSyntax.plain,
    lora: opt.LoraOpt = None,
    lora_dir: opt.LoraDirOpt = None,
    models_dir: opt.ModelsDirOpt = None,
    embedding: opt.EmbeddingOpt = None,
    allow_pickle: opt.AllowPickleOpt = False,
    vae: opt.VaeOpt = None,
    clip_skip: opt.ClipSkipOpt = 1,
    schedule: opt.ScheduleOpt = None,
    steps: opt.StepsOpt = None,
    guidance_scale: opt.GuidanceScaleOpt = None,
    distilled_guidance: opt.DistilledGuidanceOpt = None,
    width: opt.WidthOpt = None,
    height: opt.HeightOpt = None,
    seed: opt.SeedOpt = 0,
    num_images: opt.NumImagesOpt = 1,
    batch_size: opt.BatchSizeOpt = None,
    dtype: DTypeOpt = DType.float32,
    quantize: QuantizeOpt = None,
    quant_compute: QuantComputeOpt = None,
    calibration: CalibrationOpt = None,
    out: opt.OutOpt = Path("outputs"),
    grid: opt.GridOpt = False,
    quiet: opt.QuietOpt = False,
    vae_tiling: opt.VaeTilingOpt = False,
    vae_slicing: opt.VaeSlicingOpt = False,
    image: opt.ImageOpt = None,
    strength: opt.StrengthOpt = A1111.strength,
    mask: opt.MaskOpt = None,
    mask_blur: opt.MaskBlurOpt = 4.0,
    only_masked: opt.OnlyMaskedOpt = None,
    outpaint: opt.OutpaintOpt = None,
    resize_mode: opt.ResizeModeOpt = ResizeMode.resize,
    hires_scale: opt.HiresScaleOpt = None,
    hires_strength: opt.HiresStrengthOpt = A1111.hires_strength,
    hires_steps: opt.HiresStepsOpt = 0,
    hires_upscaler: opt.HiresUpscalerOpt = Upscaler.latent,
    refiner: opt.RefinerOpt = None,
    refiner_start: opt.RefinerStartOpt = 0.8,
    controlnet: opt.ControlnetOpt = None,
    control_image: opt.ControlImageOpt = None,
    control_preprocess: opt.ControlPreprocessOpt = None,
    control_scale: opt.ControlScaleOpt = None,
    control_start: opt.ControlStartOpt = None,
    control_end: opt.ControlEndOpt = None,
) -> None:
    """Generate images from a prompt (or from an image: --image, --mask, --outpaint) and write PNGs carrying their
    parameters (AUTOMATIC1111 format)."""
    _generate(GenerateOptions(**locals()))


def _generate(o: GenerateOptions) -> None:
    """Check the options, load, run the batches, write the PNGs (paths to stdout) and the summary (stderr)."""
    units = _control_units(
        o.controlnet, o.control_image, o.control_preprocess, o.control_scale, o.control_start, o.control_end
    )
    from sdjax.cli import models as cli_models

    weights = cli_models.resolve_weights(
        models_dir=o.models_dir,
        model=o.model,
        vae=o.vae,
        embeddings=o.embedding,
        loras=o.lora,
        lora_dir=o.lora_dir,
        prompt=o.prompt,
        negative_prompt=o.negative_prompt,
        a1111_syntax=getattr(o.prompt_syntax, "value", o.prompt_syntax) == "a1111",
    )
    err = Console(stderr=True, quiet=o.quiet)
    _jnp_dtype(o.dtype)
    _check_devices_env()
    calibration = _quant_options(o.quantize, o.quant_compute, o.calibration)
    timings = Timings()
    t_start = time.perf_counter()
    bars = None if o.quiet else _progress_bars(err)
    with _CompileClock() as clock, bars or _Null():
        pipe, model_hash = _load_model(o, weights, bars, err, timings, calibration)
        request, refiner_pipe = _prepare(o, pipe, weights, model_hash, units, err)
        images = request.images()
        arrays = _run_batches(o, pipe, images, refiner_pipe, request, bars, err, clock, timings)
    paths = _write_pngs(o.out, images, arrays, o.grid, timings)
    for path in paths:
        typer.echo(str(path))
    if not o.quiet:
        _summary(err, timings, time.perf_counter() - t_start, len(images), request)


def _load_model(o: GenerateOptions, weights, bars, err: Console, timings: Timings, calibration=None):
    """The model (with --config and the encoder files, --vae, --quantize and --quant-compute with `calibration`, its
    embeddings, VAE tiling/slicing) and its hash; a model that does not load is a message naming what is at fault
    (exit 1), not a traceback."""
    from sdjax.cli import models as cli_models

    model = weights.model
    task = bars.add_task(f"Loading {model or 'the embedded model'}", total=None) if bars else None
    t0 = time.perf_counter()
    try:
        given = (("config", o.config), ("t5", o.t5), ("clip_l", o.clip_l), ("clip_g", o.clip_g))
        files = {k: v for k, v in given if v is not None}
        if files:
            if weights.vae is not None:
                raise typer.BadParameter(
                    "--vae with --config/--t5/--clip-l/--clip-g is not supported", param_hint="--vae"
                )
            pipe = load_pipeline(model, o.dtype, **{k: str(v) for k, v in files.items()}, **_quantize_kw(o.quantize))
        else:
            q = _quantize_kw(o.quantize)
            pipe = (
                load_pipeline(model, o.dtype, **q)
                if weights.vae is None
                else _load_with_vae(model, o.dtype, weights.vae, **q)
            )
        _apply_quant_compute(pipe, o.quant_compute, calibration)
        for path in weights.embeddings:
            pipe.load_textual_inversion(path, token=path.stem, allow_pickle=o.allow_pickle)  # A1111: file name
        model_hash = cli_models.model_hash(weights)
        if o.distilled_guidance is not None and not hasattr(pipe, "distilled_guidance_scale"):
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
    cli_models.check_clip_skip(pipe, o.clip_skip)
    timings.load = time.perf_counter() - t0
    if o.vae_tiling:
        pipe.enable_vae_tiling()
    if o.vae_slicing:
        pipe.enable_vae_slicing()
    if bars:
        bars.update(task, total=1, completed=1)
    return pipe, model_hash


def _prepare(o: GenerateOptions, pipe, weights, model_hash, units, err: Console):
    """The checked request (task options, refiner, LoRAs, infotext fields, ControlNets, sampler) and the refiner
    pipeline (None without --refiner)."""
    task = _task_options(
        pipe,
        image=o.image,
        strength=o.strength,
        mask=o.mask,
        mask_blur=o.mask_blur,
        only_masked=o.only_masked,
        outpaint=o.outpaint,
        resize_mode=o.resize_mode.value,
        hires_scale=o.hires_scale,
        hires_strength=o.hires_strength,
        hires_steps=o.hires_steps,
        hires_upscaler=o.hires_upscaler.value,
        width=o.width,
        height=o.height,
    )
    width, height = task.pop("width"), task.pop("height")
    refiner_pipe = _load_refiner(o, err)
    if o.refiner is not None:
        task.update(refiner=infotext.model_label(o.refiner), refiner_switch=o.refiner_start)
    if weights.loras:
        _load_loras(pipe, weights.loras, err)
    if hasattr(pipe, "distilled_guidance_scale") and pipe.transformer.config.guidance_embeds:
        task["distilled_guidance"] = (
            pipe.distilled_guidance_scale if o.distilled_guidance is None else o.distilled_guidance
        )
    task.update(clip_skip=o.clip_skip, loras=weights.tags, vae=weights.vae_label, model_hash=model_hash,
                lora_hashes=infotext.lora_hashes(weights.tag_files),
                ti_hashes=infotext.ti_hashes([o.prompt, o.negative_prompt or ""],
                                             [(p.stem, p) for p in weights.embeddings]))  # fmt: skip
    if units:
        if o.refiner is not None or o.hires_scale is not None:
            raise typer.BadParameter("ControlNet does not run with --refiner or --hires-*", param_hint="--controlnet")
        _check_controlnets(pipe, units, err)
        task["control"] = units
    sampler = o.sampler
    if o.schedule is not None:
        sampler = _a1111_sampler(sampler or pipe.default_sampler, o.schedule)
    request = _request(
        pipe,
        prompt=o.prompt,
        negative_prompt=o.negative_prompt,
        model=weights.model,
        sampler=sampler,
        steps=o.steps,
        guidance_scale=o.guidance_scale,
        width=width,
        height=height,
        seed=o.seed,
        num_images=o.num_images,
        prompt_syntax=getattr(o.prompt_syntax, "value", o.prompt_syntax),
        **task,
    )
    if weights.model_label:
        request = dataclasses.replace(request, model=weights.model_label)
    return request, refiner_pipe


def _load_refiner(o: GenerateOptions, err: Console):
    """The SDXL refiner of --refiner (None without it), checked to run with the other options."""
    if o.refiner is None:
        return None
    if o.image is not None or o.hires_scale is not None:
        raise typer.BadParameter(
            "the refiner hand-off is for text-to-image; leave out --image and --hires-*", param_hint="--refiner"
        )
    if not 0 < o.refiner_start < 1:
        raise typer.BadParameter("must lie strictly between 0 and 1", param_hint="--refiner-start")
    try:
        refiner_pipe = load_pipeline(o.refiner, o.dtype)
        if o.vae_tiling:
            refiner_pipe.enable_vae_tiling()
        if o.vae_slicing:
            refiner_pipe.enable_vae_slicing()
    except Exception as e:
        err.print(
            f"[red]error:[/red] could not load the refiner {o.refiner}: {escape(str(e))}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1) from None
    return refiner_pipe


def _load_loras(pipe, loras, err) -> None:
    """Load each (file, scale) and activate them together."""
    for path, scale in loras:
        try:
            pipe.load_lora(path, scale=scale)
        except Exception as e:  # the loader names the file, key or shape at fault
            err.print(f"[red]error:[/red] LoRA {escape(str(path))}: {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None


def _check_controlnets(pipe, units, err) -> None:
    """Load the nets now (cached on the pipeline) so that a bad id or a net for another family fails first."""
    from sdjax.pipelines.controlnet import control_spec

    try:
        control_spec(pipe, [u.model for u in units], None)
    except Exception as e:  # the loader names the folder, file or key at fault
        err.print(f"[red]error:[/red] ControlNet: {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _run_batches(o: GenerateOptions, pipe, images, refiner_pipe, request, bars, err: Console, clock, timings):
    """The images' pixel arrays, `--batch-size` at a time (the last batch padded), with their timings."""
    size = o.batch_size or len(images)
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
                    pipe, batch, pad_to=size, refiner=refiner_pipe, progress=None if o.quiet else reporter
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
    return arrays


def _write_pngs(out: Path, images, arrays, grid: bool, timings: Timings) -> list[Path]:
    """Write each image (numbered after the folder's last) and with --grid the grid; their paths."""
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    number = _next_number(out)
    paths = []
    for k, (params, array) in enumerate(zip(images, arrays)):
        path = out / f"{number + k:05d}-{params.seed}.png"
        path.write_bytes(infotext.png_bytes(array, params.infotext()))
        paths.append(path)
    if grid:
        path = out / f"grid-{number:05d}.png"
        path.write_bytes(infotext.png_bytes(image_grid(arrays), images[0].infotext()))
        paths.append(path)
    timings.save = time.perf_counter() - t0
    return paths
