"""`sdjax train ...`: the fine-tuning commands (registered in `sdjax.cli` as the `train` sub-app).

`sdjax train lora --data DIR --out star.safetensors --steps 300` trains a LoRA of the embedded model (or
`--model`) and writes it as a kohya / A1111 file that `sdjax generate --lora` loads. A thin adapter over
`sdjax.finetune.train_lora`: options become its keyword arguments (`sdjax train textual-inversion`: the same over
`train_textual_inversion`); progress (loss, step time, ETA) goes to stderr, the written path to stdout. Imports
nothing heavy until a command runs (the base install has no optax / orbax).
"""

from __future__ import annotations

import enum
import importlib.util
import inspect
from pathlib import Path
from typing import Annotated, Any

import typer

from sdjax.finetune.flow_cli import FLOW_CLI, FLOW_ORDER, lora_trainer

train_app = typer.Typer(
    no_args_is_help=True,
    help="Fine-tune a model: `sdjax train lora` trains a LoRA (SD 1.x / 2.x / XL) and writes a kohya/A1111 file; "
    "`sdjax train textual-inversion` trains a new token's embedding (A1111 and diffusers files); "
    "`sdjax train dreambooth` trains a DreamBooth LoRA with prior preservation.",
)


class Precision(str, enum.Enum):
    no = "no"
    bf16 = "bf16"


class SavePrecision(str, enum.Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class Schedule(str, enum.Enum):
    constant = "constant"
    cosine = "cosine"


class Optimizer(str, enum.Enum):
    adamw = "adamw"
    adafactor = "adafactor"
    prodigy = "prodigy"
    lion = "lion"


class Prediction(str, enum.Enum):
    epsilon = "epsilon"
    v_prediction = "v_prediction"


class OnBad(str, enum.Enum):
    skip = "skip"
    error = "error"


def _require_train_extra() -> None:
    missing = [m for m in ("optax", "orbax.checkpoint") if _absent(m)]
    if missing:
        typer.echo(
            f"error: training needs the 'train' extra ({', '.join(missing)} not installed): pip install 'sdjax[train]'",
            err=True,
        )
        raise typer.Exit(2)


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _progress(label: str = "train lora"):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[step_time]}/step"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


def _plain(value):
    """A command's option value as the trainer's keyword argument (enums by value, paths as strings)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


def _run(label: str, config_cls, train, data: Path, out: Path, options: dict) -> None:
    """Check the settings (exit 2 naming a bad one), then train with a progress bar on stderr; the run directory
    and skipped images go to stderr, the written file to stdout."""
    from sdjax.finetune import distributed
    from sdjax.finetune.data import DataError
    from sdjax.finetune.run import OPTIMIZER_SETTINGS

    options = {k: _plain(v) for k, v in options.items()}
    for name in OPTIMIZER_SETTINGS:  # not given: the trainer's default
        if options.get(name, 0) is None:
            del options[name]
    if options.get("max_grad_norm") == 0:  # --max-grad-norm 0: the trainers' None (no clipping)
        options["max_grad_norm"] = None
    hosts = {k: options.pop(k, None) for k in DISTRIBUTED}
    try:
        cfg = config_cls(data=str(data), out=str(out), **options)
        cfg.check()
        if hosts.pop("distributed") or any(v is not None for v in hosts.values()):
            distributed.initialize(hosts["coordinator"], hosts["num_processes"], hosts["process_id"])
            distributed.check_supported(validation=bool(options.get("validation_prompts")))
        if cfg.fsdp:  # the devices it splits over (before any model is loaded)
            from sdjax.finetune.run import _mesh

            _mesh(cfg, lambda s: None)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    progress = _progress(label)
    task = progress.add_task("train", total=options["steps"], loss="-", step_time="-")

    def on_step(done: int, total: int, loss: float, seconds: float) -> None:
        progress.update(task, completed=done, loss=f"{loss:.4f}", step_time=f"{seconds:.2f}s")

    with progress:
        try:
            result = train(data, out, on_step=on_step, log=progress.console.print, **options)
        except (DataError, FileNotFoundError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    for skipped in result.skipped_images:
        typer.echo(f"skipped: {skipped}", err=True)
    typer.echo(f"run directory: {result.run_dir}", err=True)
    typer.echo(str(result.out))


# ------------------------------------------------------------------------------------------------ shared options
# name -> (type with its option, default): the options of more than one command (a command states its own ones).
SHARED: dict[str, tuple[Any, Any]] = {
    "model": (
        Annotated[
            str | None,
            typer.Option("--model", "-m", help="Diffusers folder, single file or Hub id. Default: embedded."),
        ],
        None,
    ),
    "steps": (Annotated[int, typer.Option(help="Optimiser updates.")], 300),
    "rank": (Annotated[int, typer.Option(help="LoRA rank (network dim).")], 8),
    "alpha": (Annotated[float | None, typer.Option(help="LoRA alpha (scale alpha/rank). Default: the rank.")], None),
    "conv_rank": (
        Annotated[
            int | None,
            typer.Option(
                help="LoCon (kohya's conv_dim): also adapt the UNet's ResNet blocks and down/upsamplers, their 3x3 "
                "convs at this rank (time_emb_proj and 1x1 conv_shortcut at --rank). SD 1.x / 2.x / XL. Default: off."
            ),
        ],
        None,
    ),
    "conv_alpha": (
        Annotated[
            float | None,
            typer.Option(help="With --conv-rank: the 3x3 conv LoRA's alpha (kohya's conv_alpha). Default: 1, kohya's."),
        ],
        None,
    ),
    "lr": (Annotated[float, typer.Option(help="Learning rate (prodigy: a multiplier of its estimate, use 1).")], 1e-4),
    "optimizer": (
        Annotated[
            Optimizer,
            typer.Option(
                help="adamw, adafactor (factored, no parameter scaling), prodigy (sets its own step size: --lr 1) "
                "or lion (--lr 3-10x below AdamW's); decoupled weight decay (--weight-decay) in each."
            ),
        ],
        Optimizer.adamw,
    ),
    # the optimiser's settings: None (not given) is the trainer's default
    "save_precision": (
        Annotated[
            SavePrecision,
            typer.Option(
                help="The written files' weights: fp32, fp16 or bf16 (the LoRA, embedding, or the fine-tune's UNet "
                "and every model of --single-file)."
            ),
        ],
        SavePrecision.fp32,
    ),
    "weight_decay": (
        Annotated[float | None, typer.Option(help="Decoupled weight decay, every optimiser. Default: 1e-2.")],
        None,
    ),
    "max_grad_norm": (
        Annotated[
            float | None,
            typer.Option(help="Clip gradients to this global norm; 0: none. Default: 1 (textual inversion: none)."),
        ],
        None,
    ),
    "adam_beta1": (Annotated[float | None, typer.Option(help="adamw / prodigy: beta1. Default: 0.9.")], None),
    "adam_beta2": (Annotated[float | None, typer.Option(help="adamw / prodigy: beta2. Default: 0.999.")], None),
    "adam_epsilon": (Annotated[float | None, typer.Option(help="adamw / prodigy: epsilon. Default: 1e-8.")], None),
    "lr_schedule": (Annotated[Schedule, typer.Option(help="After warm-up.")], Schedule.constant),
    "warmup": (Annotated[int, typer.Option(help="Linear warm-up updates.")], 0),
    "batch_size": (Annotated[int, typer.Option(help="Images per micro-batch (split over the devices).")], 1),
    "accumulation": (Annotated[int, typer.Option(help="Micro-batches per optimiser update.")], 1),
    "resolution": (Annotated[int | None, typer.Option(help="Training side length. Default: the model's.")], None),
    "bucketing": (Annotated[bool, typer.Option(help="Aspect-ratio buckets (multiples of --bucket-step).")], True),
    "random_crop": (Annotated[bool, typer.Option(help="Random instead of center crops.")], False),
    "flip": (Annotated[bool, typer.Option(help="Random horizontal flips.")], False),
    "on_bad_image": (Annotated[OnBad, typer.Option(help="Unreadable images: skip (named) or stop.")], OnBad.skip),
    "train_text_encoder": (Annotated[bool, typer.Option(help="LoRA on the text encoder(s) too.")], False),
    "text_encoder_lr": (
        Annotated[float | None, typer.Option(help="The text encoders' LoRA's learning rate. Default: --lr.")],
        None,
    ),
    "prediction_type": (Annotated[Prediction | None, typer.Option(help="Default: the scheduler config's.")], None),
    "min_snr_gamma": (Annotated[float | None, typer.Option(help="Min-SNR-gamma weighting (e.g. 5).")], None),
    "noise_offset": (Annotated[float, typer.Option(help="Noise offset (e.g. 0.05).")], 0.0),
    "mixed_precision": (
        Annotated[Precision, typer.Option(help="bf16: bfloat16 compute, float32 LoRA.")],
        Precision.no,
    ),
    "gradient_checkpointing": (
        Annotated[bool, typer.Option(help="Recompute UNet activations (less memory).")],
        False,
    ),
    "seed": (Annotated[int, typer.Option(help="Seed of the LoRA init, data order and noise.")], 0),
    "run_dir": (
        Annotated[Path | None, typer.Option(help="Run directory. Default: OUT without suffix + '-run'.")],
        None,
    ),
    "save_every": (Annotated[int, typer.Option(help="Checkpoint every N updates (0: at the end).")], 0),
    "resume": (Annotated[bool, typer.Option(help="Continue from the run directory's latest checkpoint.")], True),
    "peft": (Annotated[bool, typer.Option(help="Also write diffusers' pytorch_lora_weights.safetensors.")], False),
    "ema_decay": (
        Annotated[
            float | None,
            typer.Option(
                help="EMA of the trained weights (diffusers' EMAModel warm-up), e.g. 0.999; written at the "
                "end. Default: off."
            ),
        ],
        None,
    ),
    # diffusers' EMAModel options (its defaults), with --ema-decay only
    "ema_warmup": (
        Annotated[
            bool,
            typer.Option(
                "--ema-warmup",
                help="EMA decay 1 - (1 + s / INV_GAMMA) ** -POWER (diffusers' use_ema_warmup) instead of "
                "(1 + s) / (10 + s), s counting the averaging updates.",
            ),
        ],
        False,
    ),
    "ema_inv_gamma": (Annotated[float, typer.Option(help="With --ema-warmup: its INV_GAMMA.")], 1.0),
    "ema_power": (
        Annotated[float, typer.Option(help="With --ema-warmup: its POWER (e.g. 3/4 for shorter runs).")],
        2 / 3,
    ),
    "ema_update_after_step": (
        Annotated[int, typer.Option(help="EMA: copy the values for the first N + 1 updates, then average.")],
        0,
    ),
    "ema_min_decay": (Annotated[float, typer.Option(help="EMA: the decay's floor once averaging.")], 0.0),
    "validation_prompts": (
        Annotated[
            list[str] | None,
            typer.Option(
                "--validation-prompt",
                metavar="TEXT",
                help="Draw an image of this prompt into RUN_DIR/validation/ (repeatable): before the first update, "
                "every --validation-every updates and at the end.",
            ),
        ],
        None,
    ),
    "validation_every": (
        Annotated[int, typer.Option(help="Updates between validation images (0: at the start and end only).")],
        0,
    ),
    "validation_seed": (Annotated[int, typer.Option(help="Seed of every validation image.")], 0),
    "tensorboard": (
        Annotated[bool, typer.Option(help="TensorBoard event files of the loss and lr in RUN_DIR/tensorboard/.")],
        False,
    ),
    "cache_latents": (
        Annotated[bool, typer.Option(help="Encode every image once with the VAE before training (no random crops).")],
        False,
    ),
    "cache_text_encoder_outputs": (
        Annotated[
            bool,
            typer.Option(
                help="Encode each distinct caption once with the frozen text encoder(s) and train from the kept "
                "states, without the encoders in the step (kohya's --cache_text_encoder_outputs; not with "
                "--train-text-encoder; shuffled tags make one entry per order)."
            ),
        ],
        False,
    ),
    "fsdp": (
        Annotated[
            bool,
            typer.Option(
                "--fsdp",
                help="Split the large weights (and a fine-tune's master copy and optimiser state) over the "
                "data-parallel devices (FSDP / ZeRO-3) instead of a whole copy on each; needs 2 or more devices.",
            ),
        ],
        False,
    ),
    "fsdp_min_size": (
        Annotated[
            int | None,
            typer.Option(help="With --fsdp: split the params of at least this many elements. Default: 1048576."),
        ],
        None,
    ),
    "validation_steps": (
        Annotated[int | None, typer.Option(help="Denoising steps of validation images. Default: the pipeline's.")],
        None,
    ),
}
# Several hosts (`finetune.distributed`): handled before the config is built, never part of it
SHARED.update(
    coordinator=(
        Annotated[
            str | None,
            typer.Option(help="Several hosts: the coordinator's host:port (jax.distributed; with the next two)."),
        ],
        None,
    ),
    num_processes=(Annotated[int | None, typer.Option(help="Several hosts: how many processes train together.")], None),
    process_id=(Annotated[int | None, typer.Option(help="Several hosts: this process's id, 0 .. N-1.")], None),
    distributed=(
        Annotated[
            bool,
            typer.Option(
                "--distributed", help="Several hosts: jax.distributed from the cluster's environment (TPU pod, SLURM)."
            ),
        ],
        False,
    ),
)
DISTRIBUTED = ("coordinator", "num_processes", "process_id", "distributed")
EXTRAS = (
    " save_precision optimizer weight_decay max_grad_norm adam_beta1 adam_beta2 adam_epsilon ema_decay "
    "ema_warmup ema_inv_gamma ema_power ema_update_after_step ema_min_decay "
    "validation_prompts validation_every validation_seed validation_steps tensorboard " + " ".join(DISTRIBUTED)
)
SHARED.update(FLOW_CLI)  # `train lora`'s flow-matching options (Flux, SD 3): finetune.flow_cli
LoraOut = Annotated[Path, typer.Option(help="The LoRA to write (.safetensors, kohya/A1111 layout).")]


def _options(order: str):
    """A command with the `SHARED` options besides its own parameters, all in `order` (the options' order in
    `--help`); a shared option the command states itself (another help or default) is its own. The shared
    options' values reach the command in its `**shared`."""

    def wrap(func):
        own = inspect.signature(func, eval_str=True).parameters
        params = [
            own[name].replace(kind=inspect.Parameter.KEYWORD_ONLY)
            if name in own
            else inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, annotation=SHARED[name][0], default=SHARED[name][1]
            )
            for name in order.split()
        ]
        func.__signature__ = inspect.Signature(params, return_annotation=None)
        return func

    return wrap


# ------------------------------------------------------------------------------------------------ the commands
@train_app.command("lora")
@_options(
    "data out model steps rank alpha conv_rank conv_alpha lora_dropout lr lr_schedule warmup batch_size accumulation "
    "resolution bucketing bucket_step random_crop flip caption_dropout shuffle_tags keep_tokens on_bad_image "
    "train_text_encoder text_encoder_lr prediction_type min_snr_gamma noise_offset input_perturbation mixed_precision "
    "gradient_checkpointing seed run_dir save_every resume peft cache_latents cache_text_encoder_outputs fsdp "
    "fsdp_min_size" + EXTRAS + FLOW_ORDER
)
def lora(
    data: Annotated[Path, typer.Option(help="Images with same-name .txt captions (and/or kohya N_name folders).")],
    out: LoraOut,
    lora_dropout: Annotated[float, typer.Option(help="Dropout on the UNet LoRA's input (PEFT's).")] = 0.0,
    bucket_step: Annotated[int, typer.Option(help="Bucket side multiple in pixels.")] = 64,
    caption_dropout: Annotated[float, typer.Option(help="Share of empty captions.")] = 0.0,
    shuffle_tags: Annotated[bool, typer.Option(help="Shuffle comma-separated tags.")] = False,
    keep_tokens: Annotated[int, typer.Option(help="Tags kept in front when shuffling.")] = 0,
    input_perturbation: Annotated[float, typer.Option(help="Input perturbation (e.g. 0.1).")] = 0.0,
    **shared: Any,
) -> None:
    """Train a LoRA on a folder of captioned images; writes OUT (kohya/A1111; Flux and SD 3: diffusers' layout)
    and a run directory."""
    options = {k: v for k, v in locals().items() if k not in ("data", "out", "shared")} | shared
    _require_train_extra()
    config_cls, train = lora_trainer(options)  # Flux / SD 3 models and flow options: finetune.flow_run

    _run("train lora", config_cls, train, data, out, options)


@train_app.command("textual-inversion")
@_options(
    "data token init_word out model vectors steps lr lr_schedule warmup batch_size accumulation resolution bucketing "
    "random_crop flip on_bad_image prediction_type min_snr_gamma noise_offset mixed_precision gradient_checkpointing "
    "seed run_dir save_every resume fsdp fsdp_min_size" + EXTRAS
)
def textual_inversion(
    data: Annotated[Path, typer.Option(help="Images (.txt captions naming the token optional; else templates).")],
    token: Annotated[str, typer.Option(help="The new token, e.g. '<star>'.")],
    init_word: Annotated[str, typer.Option(help="Word whose embedding starts the token's rows, e.g. 'star'.")],
    out: Annotated[Path, typer.Option(help="The embedding to write (.safetensors, A1111 layout).")],
    vectors: Annotated[int, typer.Option(help="Embedding rows (tokens TOKEN, TOKEN_1, ...).")] = 1,
    lr: Annotated[float, typer.Option(help="Learning rate (prodigy: a multiplier of its estimate, use 1).")] = 5e-3,
    mixed_precision: Annotated[Precision, typer.Option(help="bf16: bfloat16 compute, float32 rows.")] = Precision.no,
    seed: Annotated[int, typer.Option(help="Seed of the data order, templates and noise.")] = 0,
    **shared: Any,
) -> None:
    """Train a new token's embedding (textual inversion); writes OUT (A1111), learned_embeds.safetensors
    (diffusers, in the run directory) and a run directory."""
    options = {k: v for k, v in locals().items() if k not in ("data", "out", "shared")} | shared
    _require_train_extra()
    from sdjax.finetune.textual_inversion import TextualInversionConfig, train_textual_inversion

    _run("train textual-inversion", TextualInversionConfig, train_textual_inversion, data, out, options)


_DREAMBOOTH_ORDER = (
    "instance_data instance_prompt out model with_prior_preservation class_data class_prompt num_class_images "
    "prior_loss_weight class_steps sample_batch_size steps rank alpha conv_rank conv_alpha lr lr_schedule warmup "
    "batch_size accumulation resolution random_crop flip train_text_encoder text_encoder_lr prediction_type "
    "min_snr_gamma mixed_precision gradient_checkpointing seed run_dir save_every resume peft fsdp "
    "fsdp_min_size" + EXTRAS
)
# the flow-matching options (Flux, SD 3) that DreamBooth does not state itself
_DREAMBOOTH_FLOW = tuple(k for k in FLOW_CLI if k not in _DREAMBOOTH_ORDER.split())


@train_app.command("dreambooth")
@_options(_DREAMBOOTH_ORDER + "".join(f" {k}" for k in _DREAMBOOTH_FLOW))
def dreambooth(
    instance_data: Annotated[Path, typer.Option(help="The subject's images (their captions are not read).")],
    instance_prompt: Annotated[str, typer.Option(help="Prompt of every instance image, e.g. 'a photo of sks dog'.")],
    out: LoraOut,
    with_prior_preservation: Annotated[
        bool | None, typer.Option(help="Train class images too (prior preservation). Default: on with --class-prompt.")
    ] = None,
    class_data: Annotated[Path | None, typer.Option(help="Class images; missing ones are drawn there.")] = None,
    class_prompt: Annotated[str | None, typer.Option(help="Prompt of the class images, e.g. 'a photo of dog'.")] = None,
    num_class_images: Annotated[int, typer.Option(help="Class images wanted (missing ones are generated).")] = 100,
    prior_loss_weight: Annotated[float, typer.Option(help="Weight of the class images' loss.")] = 1.0,
    class_steps: Annotated[int | None, typer.Option(help="Denoising steps of generated class images.")] = None,
    sample_batch_size: Annotated[int, typer.Option(help="Class images generated per batch.")] = 4,
    batch_size: Annotated[int, typer.Option(help="Instance images per micro-batch (as many class images).")] = 1,
    min_snr_gamma: Annotated[float | None, typer.Option(help="Min-SNR-gamma (not with prior preservation).")] = None,
    **shared: Any,
) -> None:
    """Train a DreamBooth LoRA (instance prompt, class images with prior preservation); writes OUT
    (kohya/A1111; Flux and SD 3: diffusers' layout) and a run directory."""
    options = {k: v for k, v in locals().items() if k not in ("instance_data", "out", "shared")} | shared
    if with_prior_preservation is None:
        options["with_prior_preservation"] = class_prompt is not None
    _require_train_extra()
    from sdjax.finetune import flow_run

    flow = {k: v for k in _DREAMBOOTH_FLOW if (v := options.pop(k)) is not None}
    if flow or flow_run.model_family(options.get("model")) in flow_run.FLOW_FAMILIES:
        # Flux / SD 3: the flow LoRA trainer's DreamBooth (one resolution, as diffusers' scripts); a UNet model
        # given flow options is refused by its config, naming them
        options |= flow | {"bucketing": False}
        _run("train dreambooth", flow_run.FlowLoraTrainConfig, flow_run.train_flow_lora, instance_data, out, options)
        return
    from sdjax.finetune.dreambooth import DreamBoothConfig, train_dreambooth

    _run("train dreambooth", DreamBoothConfig, train_dreambooth, instance_data, out, options)


@train_app.command("finetune")
@_options(
    "data out model single_file steps lr lr_schedule warmup batch_size accumulation resolution "
    "bucketing bucket_step random_crop flip caption_dropout shuffle_tags keep_tokens on_bad_image prediction_type "
    "min_snr_gamma noise_offset input_perturbation mixed_precision gradient_checkpointing cache_latents seed run_dir "
    "save_every resume fsdp fsdp_min_size" + EXTRAS
)
def finetune(
    data: Annotated[Path, typer.Option(help="Images with same-name .txt captions (and/or kohya N_name folders).")],
    out: Annotated[Path, typer.Option(help="The diffusers folder to write (the base model with the trained UNet).")],
    single_file: Annotated[
        Path | None, typer.Option(help="Also write the model as one A1111 / original-layout .safetensors file.")
    ] = None,
    lr: Annotated[float, typer.Option("--lr", "--learning-rate", help="Learning rate (prodigy: use 1).")] = 1e-5,
    mixed_precision: Annotated[
        Precision, typer.Option(help="bf16: bfloat16 compute, float32 master weights and optimiser.")
    ] = Precision.no,
    bucket_step: Annotated[int, typer.Option(help="Bucket side multiple in pixels.")] = 64,
    caption_dropout: Annotated[float, typer.Option(help="Share of empty captions.")] = 0.0,
    shuffle_tags: Annotated[bool, typer.Option(help="Shuffle comma-separated tags.")] = False,
    keep_tokens: Annotated[int, typer.Option(help="Tags kept in front when shuffling.")] = 0,
    input_perturbation: Annotated[float, typer.Option(help="Input perturbation (e.g. 0.1).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the data order and noise.")] = 0,
    **shared: Any,
) -> None:
    """Fine-tune the whole UNet on a folder of captioned images; writes OUT (a diffusers folder), optionally an
    A1111 single file, and a run directory."""
    options = {k: v for k, v in locals().items() if k not in ("data", "out", "shared")} | shared
    _require_train_extra()
    from sdjax.finetune.full import FinetuneConfig, train_finetune

    _run("train finetune", FinetuneConfig, train_finetune, data, out, options)
