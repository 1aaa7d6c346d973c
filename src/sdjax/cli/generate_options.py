"""`sdjax generate`'s options: each declared once as an `Annotated` type (its flags, help and checks), and
`GenerateOptions`, the values of one invocation that the command's steps read."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from sdjax import metadata
from sdjax.cli.common import DType, PromptSyntax, Quantize, ResizeMode, Upscaler

PromptArg = Annotated[str, typer.Argument(help="What to draw.")]
NegativePromptOpt = Annotated[str, typer.Option("--negative-prompt", "-n", help="What not to draw.")]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="A diffusers folder, a .safetensors checkpoint, a Hugging Face Hub id, or a name in --models-dir's "
        "Stable-diffusion/. Default: the embedded tiny model.",
    ),
]
ConfigOpt = Annotated[
    str | None,
    typer.Option(
        help="For a single-file --model: a diffusers folder (or Hub id) giving its configs and, for a Flux.1 or "
        "SD 3 file, the text encoders, tokenizers and VAE it lacks.",
        rich_help_panel="Weights",
    ),
]
T5Opt = Annotated[
    Path | None,
    typer.Option(help="Flux / SD 3: a separate T5 encoder file (t5xxl_fp16 / fp8).", rich_help_panel="Weights"),
]
ClipLOpt = Annotated[
    Path | None,
    typer.Option(
        "--clip-l", help="Flux / SD 3: a separate CLIP-L file (clip_l.safetensors).", rich_help_panel="Weights"
    ),
]
ClipGOpt = Annotated[
    Path | None,
    typer.Option("--clip-g", help="SD 3: a separate CLIP-G file (clip_g.safetensors).", rich_help_panel="Weights"),
]
SamplerOpt = Annotated[
    str | None,
    typer.Option(help="Sampler name, e.g. euler_a, ddim, 'DPM++ 2M Karras'. Default: the model's scheduler."),
]
PromptSyntaxOpt = Annotated[
    PromptSyntax,
    typer.Option(
        help="plain: the prompt as CLIP reads it (75 tokens); a1111: AUTOMATIC1111's (word:1.3), [word], "
        "BREAK and prompts longer than 75 tokens."
    ),
]
LoraOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="LoRA file, folder or name in --lora-dir, optionally :SCALE (e.g. detail:0.7); repeatable. With "
        "--prompt-syntax a1111, <lora:name:scale> in the prompt does the same.",
        rich_help_panel="LoRA",
    ),
]
LoraDirOpt = Annotated[Path | None, typer.Option(help="Folder where LoRA names are looked up.", rich_help_panel="LoRA")]
ModelsDirOpt = Annotated[
    Path | None,
    typer.Option(
        help="AUTOMATIC1111 models folder (Stable-diffusion/, Lora/, embeddings/, VAE/) where --model, --vae, "
        "--embedding and --lora names are looked up.",
        rich_help_panel="Models directory",
    ),
]
EmbeddingOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="Textual-inversion embedding (file, or name in the models directory's embeddings/); its name is "
        "then a word of the prompt, as in AUTOMATIC1111. Repeatable.",
        rich_help_panel="Models directory",
    ),
]
AllowPickleOpt = Annotated[
    bool,
    typer.Option(
        help="Read pickled (.pt/.bin) embeddings with sdjax's restricted unpickler, which runs no code.",
        rich_help_panel="Models directory",
    ),
]
VaeOpt = Annotated[
    str | None,
    typer.Option(
        help="Replacement VAE: file, diffusers folder, Hub id, or name in the models directory's VAE/.",
        rich_help_panel="Models directory",
    ),
]
ClipSkipOpt = Annotated[
    int,
    typer.Option(
        min=1, help="CLIP skip (AUTOMATIC1111's): 1 conditions on the last text-encoder layer, 2 on the one before."
    ),
]
ScheduleOpt = Annotated[
    str | None,
    typer.Option(
        help="AUTOMATIC1111 schedule type (Automatic, Karras, Exponential, SGM Uniform, Beta, ...). With it, "
        "--sampler is read as A1111 reads it: 'DPM++ 2M' + Automatic is Karras, 'Euler a' + Automatic is Uniform."
    ),
]
StepsOpt = Annotated[int | None, typer.Option(min=1, help="Sampling steps. Default: the pipeline's (50).")]
GuidanceScaleOpt = Annotated[
    float | None,
    typer.Option(
        "--guidance-scale",
        "-g",
        min=0.0,
        help="Classifier-free guidance (CFG) scale. Default: 7.5; 1 (off) for Flux, whose distilled guidance is "
        "--distilled-guidance.",
    ),
]
DistilledGuidanceOpt = Annotated[
    float | None,
    typer.Option(
        min=0.0, help="Flux dev's distilled guidance (Forge's 'Distilled CFG Scale'). Default: the model's (3.5)."
    ),
]
WidthOpt = Annotated[
    int | None, typer.Option("--width", "-W", min=8, help="Width in pixels, a multiple of 8. Default: the model's.")
]
HeightOpt = Annotated[
    int | None,
    typer.Option("--height", "-H", min=8, help="Height in pixels, a multiple of 8. Default: the model's."),
]
SeedOpt = Annotated[
    int,
    typer.Option(
        "--seed",
        "-s",
        min=-1,
        max=metadata.SEED_MAX,
        help="Seed of the first image; image i uses seed + i. -1: random.",
    ),
]
NumImagesOpt = Annotated[int, typer.Option("--num-images", "-N", min=1, help="How many images.")]
BatchSizeOpt = Annotated[
    int | None,
    typer.Option(min=1, help="Images per compiled batch (does not change the images). Default: all at once."),
]
OutOpt = Annotated[Path, typer.Option("--out", "-o", file_okay=False, help="Output folder (created).")]
GridOpt = Annotated[bool, typer.Option("--grid", help="Also write all images as one grid PNG.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or timing summary.")]
VaeTilingOpt = Annotated[
    bool,
    typer.Option(
        "--vae-tiling",
        help="Encode/decode through the VAE in overlapping tiles (diffusers' enable_vae_tiling): bounded memory "
        "for large images; images larger than one tile (the VAE's sample_size, 512 px for SD 1.5) change slightly.",
    ),
]
VaeSlicingOpt = Annotated[
    bool,
    typer.Option(
        "--vae-slicing",
        help="Encode/decode one image per device at a time (diffusers' enable_vae_slicing): less memory for "
        "large batches, the same images.",
    ),
]
ImageOpt = Annotated[
    Path | None,
    typer.Option(
        "--image",
        "-i",
        exists=True,
        dir_okay=False,
        help="Init image: image-to-image (with --mask: inpainting). The size defaults to the image's.",
        rich_help_panel="Image to image",
    ),
]
StrengthOpt = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=1.0,
        help="Denoising strength of --image (A1111's: int(min(s, 0.999) * steps) + 1 steps run).",
        rich_help_panel="Image to image",
    ),
]
MaskOpt = Annotated[
    Path | None,
    typer.Option(
        exists=True,
        dir_okay=False,
        help="Inpainting mask for --image: white is repainted.",
        rich_help_panel="Image to image",
    ),
]
MaskBlurOpt = Annotated[
    float, typer.Option(min=0.0, help="Gaussian blur of the mask, in pixels.", rich_help_panel="Image to image")
]
OnlyMaskedOpt = Annotated[
    int | None,
    typer.Option(
        "--only-masked",
        min=0,
        help="Repaint only the masked region at full resolution, "
        "with this padding in pixels (A1111's 'Inpaint area: Only masked').",
        rich_help_panel="Image to image",
    ),
]
OutpaintOpt = Annotated[
    str | None,
    typer.Option(
        help="Outpaint: extend --image by L,T,R,B pixels (inpainting on a larger canvas).",
        rich_help_panel="Image to image",
    ),
]
ResizeModeOpt = Annotated[
    ResizeMode, typer.Option(help="How --image is fitted to --width/--height.", rich_help_panel="Image to image")
]
HiresScaleOpt = Annotated[
    float | None,
    typer.Option(min=0.0, help="Hires fix: upscale factor of the second pass.", rich_help_panel="Hires fix"),
]
HiresStrengthOpt = Annotated[
    float,
    typer.Option(
        min=0.0, max=1.0, help="Hires fix: denoising strength of the second pass.", rich_help_panel="Hires fix"
    ),
]
HiresStepsOpt = Annotated[
    int,
    typer.Option(min=0, help="Hires fix: second-pass steps (0: the first pass's).", rich_help_panel="Hires fix"),
]
HiresUpscalerOpt = Annotated[Upscaler, typer.Option(help="Hires fix: upscaler.", rich_help_panel="Hires fix")]
RefinerOpt = Annotated[
    str | None,
    typer.Option(
        help="SDXL refiner (folder, Hub id or file) for the end of the schedule.", rich_help_panel="SDXL refiner"
    ),
]
RefinerStartOpt = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=1.0,
        help="Fraction of the schedule after which the refiner takes over.",
        rich_help_panel="SDXL refiner",
    ),
]
ControlnetOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="ControlNet (folder or Hub id); repeat for several, each with its own --control-image.",
        rich_help_panel="ControlNet",
    ),
]
ControlImageOpt = Annotated[
    list[Path] | None,
    typer.Option(help="Control image, one per --controlnet.", rich_help_panel="ControlNet"),
]
ControlPreprocessOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="Preprocessor turning the control image into the map (none, canny, threshold, scribble_xdog, "
        "invert); one for all or one per net. Default: none (the image is the map).",
        rich_help_panel="ControlNet",
    ),
]
ControlScaleOpt = Annotated[
    list[float] | None,
    typer.Option(help="Conditioning scale; one for all or one per net. Default: 1.", rich_help_panel="ControlNet"),
]
ControlStartOpt = Annotated[
    list[float] | None,
    typer.Option(help="Fraction of the steps where a net starts (0).", rich_help_panel="ControlNet"),
]
ControlEndOpt = Annotated[
    list[float] | None,
    typer.Option(help="Fraction of the steps where a net stops (1).", rich_help_panel="ControlNet"),
]


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """The options of one `sdjax generate` call, as typer parsed them."""

    prompt: str
    negative_prompt: str
    model: str | None
    config: str | None
    t5: Path | None
    clip_l: Path | None
    clip_g: Path | None
    sampler: str | None
    prompt_syntax: PromptSyntax
    lora: list[str] | None
    lora_dir: Path | None
    models_dir: Path | None
    embedding: list[str] | None
    allow_pickle: bool
    vae: str | None
    clip_skip: int
    schedule: str | None
    steps: int | None
    guidance_scale: float | None
    distilled_guidance: float | None
    width: int | None
    height: int | None
    seed: int
    num_images: int
    batch_size: int | None
    dtype: DType
    quantize: Quantize | None
    quant_compute: Quantize | None
    calibration: Path | None
    out: Path
    grid: bool
    quiet: bool
    vae_tiling: bool
    vae_slicing: bool
    image: Path | None
    strength: float
    mask: Path | None
    mask_blur: float
    only_masked: int | None
    outpaint: str | None
    resize_mode: ResizeMode
    hires_scale: float | None
    hires_strength: float
    hires_steps: int
    hires_upscaler: Upscaler
    refiner: str | None
    refiner_start: float
    controlnet: list[str] | None
    control_image: list[Path] | None
    control_preprocess: list[str] | None
    control_scale: list[float] | None
    control_start: list[float] | None
    control_end: list[float] | None
