"""`train_lora`: a LoRA training run of an SD 1.x / 2.x / XL model, from a data folder to a kohya file.

A run directory holds `config.json` (every setting), `loss.jsonl` (one line per optimiser update: step, loss,
learning rate, seconds), `checkpoints/` (orbax: the LoRA, the optimiser state and the step; the data order and
noise are functions of the seed and the step, so a resumed run repeats the unbroken one's losses), `loss.png`
(when matplotlib is installed), with `peft=True` `pytorch_lora_weights.safetensors`, and with validation prompts
`validation/step-NNNNNN-i.png` (`finetune.validation`). The LoRA itself goes to `out` as a kohya / A1111
`.safetensors` file; with `ema_decay` the EMA of the LoRA (`finetune.ema`, checkpointed too) is what is written.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune import lora as lora_lib
from sdjax.finetune.loop import OnStep, RowBatches, run_loop
from sdjax.finetune.run_dir import check_resume as _check_resume

# The written files' float precision (`save_precision`; kohya's --save_precision float / fp16 / bf16).
SAVE_PRECISIONS = ("fp32", "fp16", "bf16")


def save_dtype(precision: str):
    """The numpy dtype of a `save_precision` (bfloat16: ml_dtypes', which safetensors writes as BF16)."""
    import ml_dtypes

    return {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}[precision]


# The optimiser's settings besides its name and learning rate (a resumed run of any trainer keeps them).
ADAM_SETTINGS = ("adam_beta1", "adam_beta2", "adam_epsilon")
OPTIMIZER_SETTINGS = ("weight_decay", "max_grad_norm", *ADAM_SETTINGS)
# The EMA's settings (`finetune.ema.EmaSchedule`): the ones after `ema_decay` apply with it only.
EMA_OPTIONS = ("ema_warmup", "ema_inv_gamma", "ema_power", "ema_update_after_step", "ema_min_decay")
EMA_SETTINGS = ("ema_decay", *EMA_OPTIONS)
# Settings a resumed LoRA run must share with the run that wrote the checkpoint.
_RESUME_KEYS = (
    "model",
    "rank",
    "alpha",
    "conv_rank",
    "conv_alpha",
    "train_text_encoder",
    "text_encoder_lr",
    "cache_text_encoder_outputs",
    "batch_size",
    "accumulation",
    "seed",
    "lr",
    "optimizer",
    *EMA_SETTINGS,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The settings every trainer shares (written to the run directory's config.json with the trainer's own)."""

    data: str
    out: str
    model: str | None = None  # diffusers folder, single file, Hub id; None: the embedded model
    steps: int = 300  # optimiser updates
    lr: float = 1e-4
    lr_schedule: str = "constant"
    warmup: int = 0
    optimizer: str = "adamw"  # or "adafactor", "prodigy" (lr 1.0), "lion" (`step.update_rule`)
    weight_decay: float = 1e-2  # decoupled, in every optimiser (`step.update_rule`)
    max_grad_norm: float | None = 1.0  # global-norm clipping before the optimiser; None: off
    adam_beta1: float = 0.9  # AdamW's and Prodigy's betas and epsilon (diffusers' scripts' --adam_beta1, ...)
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    batch_size: int = 1
    accumulation: int = 1
    resolution: int | None = None  # default: the model's sample size
    bucketing: bool = True
    bucket_step: int = 64
    random_crop: bool = False
    flip: bool = False
    shuffle_tags: bool = False
    keep_tokens: int = 0
    on_bad_image: str = "skip"
    prediction_type: str | None = None  # default: the scheduler config's
    min_snr_gamma: float | None = None
    noise_offset: float = 0.0
    input_perturbation: float = 0.0
    mixed_precision: str = "no"  # or "bf16": frozen weights and compute in bfloat16, trained values in float32
    gradient_checkpointing: bool = False
    clip_skip: int = 1
    seed: int = 0
    devices: int | None = None  # data-parallel devices (default: the most that divide the batch)
    fsdp: bool = False  # split the large weights (a fine-tune's master copy and moments too) over the devices
    fsdp_min_size: int | None = None  # with fsdp: params of at least this many elements are split (None: 2^20)
    run_dir: str | None = None  # default: <out without suffix>-run
    save_every: int = 0  # checkpoint every N updates (0: only at the end)
    resume: bool = True  # continue from the run directory's latest checkpoint
    ema_decay: float | None = None  # EMA of the trained values (diffusers' EMAModel rule, `finetune.ema`); None: off
    # diffusers' EMAModel options (use_ema_warmup, inv_gamma, power, update_after_step, min_decay; its defaults)
    ema_warmup: bool = False  # decay 1 - (1 + s / ema_inv_gamma) ** -ema_power instead of (1 + s) / (10 + s)
    ema_inv_gamma: float = 1.0
    ema_power: float = 2 / 3
    ema_update_after_step: int = 0  # updates whose EMA is a copy of the values before the averaging starts
    ema_min_decay: float = 0.0  # the decay's floor once averaging (after the copies)
    validation_prompts: tuple[str, ...] = ()  # images drawn with the current values (`finetune.validation`)
    validation_every: int = 0  # updates between validation images (0: before the first update and at the end only)
    validation_seed: int = 0
    validation_steps: int | None = None  # denoising steps of validation images (default: the pipeline's)
    cache_latents: bool = False  # encode every image once before training (`finetune.cache`); trainers opt in
    tensorboard: bool = False  # TensorBoard event files of the loss and learning rate in RUN_DIR/tensorboard/
    save_precision: str = "fp32"  # the written files' weights: "fp32", "fp16" or "bf16" (`SAVE_PRECISIONS`)

    written: ClassVar[str] = "the LoRA"  # what `out` holds (in the error of a wrong suffix)
    out_suffix: ClassVar[str] = ".safetensors"  # "": `out` is a folder
    # Whether this config's trainer reads a latent cache; looked up on the config's own class only (a subclass's
    # trainer builds its own batches, so it opts in itself).
    latent_cache: ClassVar[bool] = False

    def __post_init__(self):
        prompts = self.validation_prompts
        prompts = (prompts,) if isinstance(prompts, str) else tuple(prompts or ())
        object.__setattr__(self, "validation_prompts", prompts)

    def check(self) -> None:
        """Bad settings fail here, naming the setting, before anything is loaded or compiled (the shared ones;
        a trainer's config checks its own first)."""
        if self.lr <= 0 or not math.isfinite(self.lr):
            raise ValueError(f"lr={self.lr} must be a positive number")
        from sdjax.finetune.step import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} (--optimizer) must be one of {', '.join(OPTIMIZERS)}")
        self._check_optimizer_settings()
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r} must be 'no' or 'bf16'")
        if self.save_precision not in SAVE_PRECISIONS:
            raise ValueError(
                f"save_precision={self.save_precision!r} (--save-precision) must be one of {', '.join(SAVE_PRECISIONS)}"
            )
        if self.resolution is not None and (self.resolution < 8 or self.resolution % 8):
            raise ValueError(f"resolution={self.resolution} must be a positive multiple of 8")
        if self.out_suffix and not str(self.out).endswith(self.out_suffix):
            raise ValueError(f"out={self.out}: {self.written} is written as a {self.out_suffix} file")
        if self.save_every < 0 or self.warmup < 0:
            raise ValueError("save_every and warmup must be 0 or more")
        self._check_fsdp()
        self._check_extras()
        self.data_config(self.resolution or 512).check()
        if self.cache_latents:
            if not type(self).__dict__.get("latent_cache", False):
                raise ValueError(f"cache_latents (--cache-latents): {type(self).__name__} runs have no latent cache")
            from sdjax.finetune import cache as cache_lib

            cache_lib.check(self.data_config(self.resolution or 512))
        if not Path(self.data).expanduser().is_dir():
            raise data_lib.DataError(f"data folder {self.data} does not exist or is not a folder")

    def _check_optimizer_settings(self) -> None:
        """Weight decay, clipping, and the betas and epsilon of the optimisers that have them."""
        number = lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        flag = lambda name: f"{name} (--{name.replace('_', '-')})"
        if not number(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"{flag('weight_decay')}={self.weight_decay!r} must be a number >= 0")
        g = self.max_grad_norm
        if g is not None and (not number(g) or g <= 0):
            raise ValueError(f"{flag('max_grad_norm')}={g!r} must be a positive number (None: no clipping)")
        for name in ("adam_beta1", "adam_beta2"):
            b = getattr(self, name)
            if not number(b) or not 0 <= b < 1:
                raise ValueError(f"{flag(name)}={b!r} must be a number in [0, 1)")
        if not number(self.adam_epsilon) or self.adam_epsilon <= 0:
            raise ValueError(f"{flag('adam_epsilon')}={self.adam_epsilon!r} must be a positive number")
        if self.optimizer not in ("adamw", "prodigy"):
            for name in ADAM_SETTINGS:
                if getattr(self, name) != getattr(TrainConfig, name):
                    raise ValueError(
                        f"{flag(name)}={getattr(self, name)!r}: optimizer={self.optimizer!r} has no such setting "
                        "(AdamW's and Prodigy's)"
                    )

    def _check_fsdp(self) -> None:
        """The layout settings (the device count is checked with the mesh, `_mesh`)."""
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"fsdp={self.fsdp!r} (--fsdp) must be True or False")
        n = self.fsdp_min_size
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"fsdp_min_size={n!r} (--fsdp-min-size) must be a positive integer (elements)")
            if not self.fsdp:
                raise ValueError(f"fsdp_min_size={n} (--fsdp-min-size) applies with fsdp=True (--fsdp) only")

    def _check_extras(self) -> None:
        """EMA and validation images (the CLI flag is named beside the setting)."""
        self._check_ema()
        if not all(isinstance(p, str) for p in self.validation_prompts):
            raise ValueError(f"validation_prompts={self.validation_prompts!r} (--validation-prompt) must be strings")
        every = self.validation_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise ValueError(f"validation_every={every!r} (--validation-every) must be 0 or a positive integer")
        if every and not self.validation_prompts:
            raise ValueError(
                f"validation_every={every} (--validation-every) needs a validation prompt (--validation-prompt)"
            )
        steps = self.validation_steps
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise ValueError(f"validation_steps={steps!r} (--validation-steps) must be a positive integer")
        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            raise ValueError("tensorboard=True (--tensorboard) needs tensorboardX: pip install 'sdjax[train]'")

    def _check_ema(self) -> None:
        """`ema_decay` and diffusers' EMAModel options (`EMA_OPTIONS`), which need it."""
        number = lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        flag = lambda name: f"{name}={getattr(self, name)!r} (--{name.replace('_', '-')})"
        d = self.ema_decay
        if d is not None and not (number(d) and 0.0 < d < 1.0):
            raise ValueError(f"{flag('ema_decay')} must be a number in (0, 1), e.g. 0.999 (None: no EMA)")
        if d is None:
            for name in EMA_OPTIONS:
                if getattr(self, name) != getattr(TrainConfig, name):
                    raise ValueError(f"{flag(name)} applies to the EMA: it needs ema_decay (--ema-decay)")
            return
        if not isinstance(self.ema_warmup, bool):
            raise ValueError(f"{flag('ema_warmup')} must be True or False")
        for name in ("ema_inv_gamma", "ema_power"):
            value = getattr(self, name)
            if not number(value) or value <= 0:
                raise ValueError(f"{flag(name)} must be a positive number")
            if not self.ema_warmup and value != getattr(TrainConfig, name):
                raise ValueError(f"{flag(name)} shapes the warm-up: it needs ema_warmup=True (--ema-warmup)")
        n = self.ema_update_after_step
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{flag('ema_update_after_step')} must be an integer >= 0 (optimiser updates)")
        m = self.ema_min_decay
        if not number(m) or not 0.0 <= m <= d:
            raise ValueError(f"{flag('ema_min_decay')} must be a number in [0, ema_decay={d}]")

    def data_config(self, resolution: int) -> data_lib.DataConfig:
        return data_lib.DataConfig(
            resolution=resolution,
            bucketing=self.bucketing,
            bucket_step=self.bucket_step,
            random_crop=self.random_crop,
            flip=self.flip,
            shuffle_tags=self.shuffle_tags,
            keep_tokens=self.keep_tokens,
            on_bad_image=self.on_bad_image,
        )

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path(str(self.out).removesuffix(".safetensors") + "-run")


@dataclasses.dataclass(frozen=True)
class LoraTrainConfig(TrainConfig):
    """Every setting of a LoRA run (written to the run directory's config.json)."""

    rank: int = 8
    alpha: float | None = None  # default: rank (scale 1)
    # LoCon (kohya's --network_args conv_dim=R conv_alpha=A): the UNet's ResNet blocks and samplers adapted too, their
    # 3x3 convolutions at conv_rank / conv_alpha (`lora.conv_paths`); None: attention only
    conv_rank: int | None = None
    conv_alpha: float | None = None  # default with conv_rank: kohya's 1.0 (`lora.KOHYA_CONV_ALPHA`), not conv_rank
    train_text_encoder: bool = False
    text_encoder_lr: float | None = None  # the text encoders' LoRA's learning rate (same schedule); None: lr
    lora_dropout: float = 0.0  # dropout on the UNet LoRA's input (PEFT's lora_dropout)
    caption_dropout: float = 0.0
    peft: bool = False  # also write diffusers' pytorch_lora_weights.safetensors into the run directory
    comment: str = ""
    # the frozen text encoders' outputs of each caption computed once, outside the step (`cache.TextEncoderCache`)
    cache_text_encoder_outputs: bool = False

    latent_cache: ClassVar[bool] = True
    # Whether this config's trainer feeds cached text states to its step (looked up on the class itself, as
    # `latent_cache`: a subclass that builds its own batches opts in itself).
    text_cache: ClassVar[bool] = True

    def check(self) -> None:
        """Bad settings fail here, naming the setting, before anything is loaded or compiled."""
        if int(self.rank) != self.rank or self.rank < 1:
            raise ValueError(f"rank={self.rank!r}: a LoRA rank must be a positive integer")
        self._check_conv()
        for name in ("steps", "batch_size", "accumulation"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout={self.lora_dropout} must be in [0, 1)")
        t = self.text_encoder_lr
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t > 0):
                raise ValueError(f"text_encoder_lr={t!r} (--text-encoder-lr) must be a positive number")
            if self.train_text_encoder is not True:
                raise ValueError(
                    f"text_encoder_lr={t} (--text-encoder-lr) applies to the text encoders' LoRA: it needs "
                    "train_text_encoder=True (--train-text-encoder)"
                )
            if self.optimizer == "prodigy":
                raise ValueError(
                    f"text_encoder_lr={t} (--text-encoder-lr) with optimizer='prodigy': Prodigy estimates one step "
                    "size, which lr multiplies for every weight (diffusers' scripts use lr for the text encoders too)"
                )
        self._check_text_cache()
        super().check()

    def _check_text_cache(self) -> None:
        """`cache_text_encoder_outputs`: a flag, of a trainer that has the cache, with frozen text encoders."""
        flag = f"cache_text_encoder_outputs={self.cache_text_encoder_outputs!r} (--cache-text-encoder-outputs)"
        if not isinstance(self.cache_text_encoder_outputs, bool):
            raise ValueError(f"{flag} must be True or False")
        if not self.cache_text_encoder_outputs:
            return
        if not type(self).__dict__.get("text_cache", False):
            raise ValueError(f"{flag}: {type(self).__name__} runs have no text-encoder cache (their own batches)")
        if self.train_text_encoder:
            raise ValueError(
                f"{flag} with train_text_encoder=True (--train-text-encoder): the text encoders' LoRA changes their "
                "outputs at every step, so they cannot be encoded ahead; leave out one of the two"
            )

    def _check_conv(self) -> None:
        """`conv_rank` / `conv_alpha` (LoCon), named with their flags."""
        c, a = self.conv_rank, self.conv_alpha
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(
                f"conv_rank={c!r} (--conv-rank) must be a positive integer (kohya's conv_dim; None: no conv LoRA)"
            )
        if a is None:
            return
        if c is None:
            raise ValueError(
                f"conv_alpha={a!r} (--conv-alpha) is the alpha of the conv LoRA: it needs conv_rank (--conv-rank)"
            )
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a) or a <= 0:
            raise ValueError(f"conv_alpha={a!r} (--conv-alpha) must be a positive number (default: kohya's 1)")

    def lora_scales(self) -> tuple[float, float | None]:
        """`(alpha / rank, conv_alpha / conv_rank or None)`: the scales of the LoRA's layers (the second for the
        UNet's convolutions wider than 1x1 with LoCon)."""
        scale = float(self.alpha if self.alpha is not None else self.rank) / self.rank
        if self.conv_rank is None:
            return scale, None
        return scale, self.conv_alpha_value / self.conv_rank

    @property
    def conv_alpha_value(self) -> float | None:
        """The conv LoRA's alpha as trained: `conv_alpha`, by default kohya's 1.0 (None without `conv_rank`)."""
        if self.conv_rank is None:
            return None
        return float(self.conv_alpha if self.conv_alpha is not None else lora_lib.KOHYA_CONV_ALPHA)

    def data_config(self, resolution: int) -> data_lib.DataConfig:
        return dataclasses.replace(super().data_config(resolution), caption_dropout=self.caption_dropout)


@dataclasses.dataclass
class TrainResult:
    out: Path
    run_dir: Path
    losses: list[float]  # per update of this call (after a resume: from the resumed step)
    start_step: int
    steps: int
    skipped_images: tuple[str, ...]


def _silent(message: str) -> None:
    pass


@dataclasses.dataclass
class Session:
    """One trainer call: its checked settings, its data set (scanned before any model is loaded, so bad data fails
    first), the caller's `on_step`, `log` and `stop_after`, and after `prepare` the bucketed data set and the
    data-parallel mesh. Every trainer starts with `begin` and ends with `loop` (`run_loop`, then the result)."""

    cfg: Any
    dataset: Any
    on_step: OnStep | None = None
    log: Callable[[str], None] = _silent
    stop_after: int | None = None
    mesh: Any = None

    @classmethod
    def begin(
        cls,
        cfg: Any,
        *,
        on_step: OnStep | None = None,
        log: Callable[[str], None] = _silent,
        stop_after: int | None = None,
        resume_keys: tuple[str, ...] = _RESUME_KEYS,
        what: str = "a run",
    ) -> Session:
        """Check `cfg`, refuse to resume a run directory written with other `resume_keys` settings (`what` names
        that run), scan the data folder."""
        cfg.check()
        if cfg.resume:  # every trainer's optimiser settings, and its own
            _check_resume(cfg.run_path, cfg, tuple(dict.fromkeys((*resume_keys, *OPTIMIZER_SETTINGS))), what)
        dataset = data_lib.scan(cfg.data, cfg.data_config(cfg.resolution or 512))  # bad data fails before loading
        return cls(cfg, dataset, on_step, log, stop_after)

    def prepare(self, resolution: int) -> data_lib.Dataset:
        """The data set in the buckets of the training `resolution` (logged) and the mesh (`_mesh`)."""
        dataset = data_lib.with_buckets(self.dataset, self.cfg.data_config(resolution))
        self.log(
            f"{len(dataset.items)} images ({dataset.examples_per_epoch} examples per epoch), buckets {dataset.buckets}"
        )
        self.dataset, self.mesh = dataset, _mesh(self.cfg, self.log)
        return dataset

    def loop(
        self,
        state: dict,
        frozen: dict,
        train_step: Callable,
        batches: Callable[[int], dict] | RowBatches,
        schedule: Callable,
        finish: Callable[[dict], None],
        *,
        validate: Callable[[Any, int], Sequence[Path]] | None = None,
        trained: str = "lora",
    ) -> TrainResult:
        """`run_loop` with this call's settings, mesh and hooks -> the call's `TrainResult`."""
        losses, start, end = run_loop(
            self.cfg,
            state,
            frozen,
            train_step,
            batches,
            mesh=self.mesh,
            schedule=schedule,
            finish=finish,
            on_step=self.on_step,
            log=self.log,
            stop_after=self.stop_after,
            trained=trained,
            validate=validate,
        )
        return TrainResult(Path(self.cfg.out), self.cfg.run_path, losses, start, end, self.dataset.skipped)


# ------------------------------------------------------------------------------------------------ pieces
def _load(cfg: TrainConfig, what: str = "LoRA training"):
    """`(pipeline, params, compute dtype)`: the model loaded in the compute dtype, which must be an SD 1.x / 2.x / XL
    UNet model (`what` names the training in the error)."""
    import jax.numpy as jnp

    from sdjax.pipelines import load_pipeline

    dtype = jnp.bfloat16 if cfg.mixed_precision == "bf16" else jnp.float32
    pipe, params = load_pipeline(cfg.model, dtype=dtype)
    if not hasattr(pipe, "unet") or not hasattr(pipe.generator.models.conditioning, "tokenize"):
        raise ValueError(
            f"{cfg.model}: {what} supports SD 1.x / 2.x / XL UNet models (this is a {type(pipe).__name__})"
        )
    return pipe, params, dtype


def _mesh(cfg: LoraTrainConfig, log: Callable[[str], None]):
    import jax

    from sdjax.parallel.sharding import default_devices, make_mesh

    available = default_devices()  # every process's, with several (`finetune.distributed`)
    if jax.process_count() > 1:  # one program over all processes' devices: the batch must split over all of them
        if (cfg.devices or len(available)) != len(available) or cfg.batch_size % len(available):
            raise ValueError(
                f"batch_size={cfg.batch_size} (devices={cfg.devices}): over {jax.process_count()} processes the "
                f"batch is split over all {len(available)} devices; give a batch size they divide"
            )
        return make_mesh(devices=available)
    n = cfg.devices or math.gcd(cfg.batch_size, len(available))
    if n > len(available) or cfg.batch_size % n:
        raise ValueError(
            f"devices={n}: need at most {len(available)} devices and a batch size ({cfg.batch_size}) they divide"
        )
    if cfg.devices is None and n < len(available):
        log(f"data parallel over {n} of {len(available)} devices (the batch size {cfg.batch_size} divides by {n})")
    if cfg.fsdp and n < 2:
        raise ValueError(
            f"fsdp=True (--fsdp) splits the weights over the data-parallel devices, and this run has one (devices="
            f"{cfg.devices}, batch_size={cfg.batch_size}, {len(available)} available): give a batch size that 2 or "
            "more devices divide, or leave out --fsdp"
        )
    return make_mesh(devices=available[:n])


def _objective(cfg: TrainConfig, pipe, prior_loss_weight: float | None = None):
    """The training objective of `cfg` on `pipe`'s scheduler (`prediction_type`: `cfg`'s or the scheduler's)."""
    from sdjax.finetune import step as step_lib

    return step_lib.Objective(
        prediction_type=cfg.prediction_type or pipe.scheduler.prediction_type,
        num_train_timesteps=int(pipe.scheduler.num_train_timesteps),
        min_snr_gamma=cfg.min_snr_gamma,
        noise_offset=cfg.noise_offset,
        input_perturbation=cfg.input_perturbation,
        prior_loss_weight=prior_loss_weight,
    )


def _optimizer(cfg: TrainConfig):
    """`(lr schedule, optimizer)` of `cfg` (`step.make_optimizer`: `cfg.optimizer` after clipping, accumulation)."""
    from sdjax.finetune import step as step_lib

    schedule = step_lib.lr_schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.lr_schedule)
    text_lr = getattr(cfg, "text_encoder_lr", None)
    text_schedule = None if text_lr is None else step_lib.lr_schedule(text_lr, cfg.steps, cfg.warmup, cfg.lr_schedule)
    optimizer = step_lib.make_optimizer(
        schedule,
        text_schedule=text_schedule,
        optimizer=cfg.optimizer,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        accumulation=cfg.accumulation,
        b1=cfg.adam_beta1,
        b2=cfg.adam_beta2,
        eps=cfg.adam_epsilon,
    )
    return schedule, optimizer


def _lora_step(cfg: LoraTrainConfig, pipe, params, dtype, objective):
    """A LoRA run's frozen weights, initial state (the LoRA from `cfg.seed`, the optimiser), jitted step and lr
    schedule."""
    import jax

    from sdjax.finetune import step as step_lib

    conditioning = pipe.generator.models.conditioning
    scale, conv_scale = cfg.lora_scales()
    models = step_lib.Models(
        conditioning,
        pipe.unet,
        pipe.vae,
        dtype,
        unet_scale=scale,
        text_scale=scale,
        remat=cfg.gradient_checkpointing,
        lora_dropout=cfg.lora_dropout,
        unet_conv_scale=conv_scale,
    )
    targets = {"unet": lora_lib.UNET_TARGETS}
    if cfg.train_text_encoder:
        targets.update({c: lora_lib.TEXT_TARGETS for c in conditioning.components})
    frozen = {c: params[c] for c in ("unet", "vae", *conditioning.components)}
    lora = lora_lib.init_lora(jax.random.PRNGKey(cfg.seed), frozen, targets, cfg.rank, conv_rank=cfg.conv_rank)
    schedule, optimizer = _optimizer(cfg)
    state = step_lib.init_state(lora, optimizer)
    train_step = step_lib.make_train_step(models, objective, pipe.scheduler.alphas_cumprod, optimizer)
    return frozen, state, train_step, schedule


def lora_validator(cfg: LoraTrainConfig, pipe, params: dict, resolution: int, log: Callable[[str], None]):
    """`run_loop`'s `validate` of a LoRA run: images with the LoRA merged into a copy of `params` (None: no
    validation prompts)."""
    from sdjax.finetune import validation as validation_lib

    scale, conv_scale = cfg.lora_scales()
    return validation_lib.make_validator(
        cfg,
        pipe,
        lambda lora: validation_lib.lora_params(params, lora, scale, conv_scale),
        (resolution, resolution),
        log,
    )


def _inputs(conditioning, batch: dict, clip_skip: int) -> dict:
    ids = np.asarray(conditioning.tokenize(batch["captions"]), np.int32)
    n = len(batch["captions"])
    images = {k: batch[k] for k in ("pixels", "latents") if k in batch}  # latents: from a latent cache
    return {**images, "ids": ids, "clip_skip": np.full((n,), clip_skip, np.int32), "time_ids": batch["time_ids"]}


def _batches(cfg: TrainConfig, models, frozen: dict, sampler, log: Callable[[str], None]):
    """`(batches, frozen)`: `RowBatches` of images the step encodes with the VAE, or with `cfg.cache_latents` of
    latents from a cache built now with `models.vae` (`finetune.cache`); the VAE then leaves the step's frozen
    params (it is not in the compiled step). Their text: token ids the step encodes, or with
    `cfg.cache_text_encoder_outputs` the captions' text states (`cache.TextEncoderCache`, filled as captions come,
    with the text encoders of `frozen`, which then leave the step's frozen params too)."""
    from sdjax.finetune import cache as cache_lib

    conditioning = models.conditioning
    load = sampler.load
    if cfg.cache_latents:
        latents = cache_lib.build(sampler.dataset, sampler.cfg, models, frozen["vae"], cfg.seed, log)
        frozen = {k: v for k, v in frozen.items() if k != "vae"}
        load = lambda micro, rows: latents.batch(sampler, micro, rows)
    states = None
    if getattr(cfg, "cache_text_encoder_outputs", False):
        states = cache_lib.TextEncoderCache(conditioning, frozen, models.dtype, cfg.clip_skip)
        frozen = {k: v for k, v in frozen.items() if k not in conditioning.components}

    def text(batch: dict) -> dict:
        if states is None:
            return _inputs(conditioning, batch, cfg.clip_skip)
        images = {k: batch[k] for k in ("pixels", "latents") if k in batch}
        return {**images, **states(batch["captions"]), "time_ids": batch["time_ids"]}

    return RowBatches(lambda micro, rows: text(load(micro, rows)), sampler.batch_size), frozen


def write_lora(
    cfg: LoraTrainConfig, lora: dict, unet_config: Any, prediction_type: str, run_dir: Path, num_images: int = 0
) -> None:
    """The kohya file at `cfg.out` (and diffusers' file in the run directory with `cfg.peft`)."""
    host = {c: {k: {n: np.asarray(v) for n, v in ab.items()} for k, ab in layers.items()} for c, layers in lora.items()}
    alpha = float(cfg.alpha if cfg.alpha is not None else cfg.rank)
    conv_alpha = cfg.conv_alpha_value
    meta = lora_lib.kohya_metadata(
        rank=cfg.rank,
        alpha=alpha,
        conv_rank=cfg.conv_rank,
        conv_alpha=conv_alpha,
        base_model_version=lora_lib.base_model_version(unet_config, prediction_type),
        comment=cfg.comment,
        extra={
            "ss_num_train_images": str(num_images),
            "ss_max_train_steps": str(cfg.steps),
            "ss_learning_rate": str(cfg.lr),
            "ss_seed": str(cfg.seed),
            "ss_network_train_unet_only": str(not cfg.train_text_encoder),
        },
    )
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    dtype = save_dtype(cfg.save_precision)
    tensors = lora_lib.kohya_state_dict(host, alpha, unet_config, conv_alpha=conv_alpha)
    lora_lib.save_safetensors(cfg.out, tensors, meta, dtype)
    if cfg.peft:
        tensors, peft_meta = lora_lib.peft_state_dict(host, alpha, cfg.rank, cfg.conv_rank, conv_alpha)
        lora_lib.save_safetensors(run_dir / "pytorch_lora_weights.safetensors", tensors, peft_meta, dtype)


# ------------------------------------------------------------------------------------------------ the run
def train_lora(
    data: str | Path,
    out: str | Path,
    *,
    on_step: OnStep | None = None,
    log: Callable[[str], None] = lambda s: None,
    stop_after: int | None = None,
    **options: Any,
) -> TrainResult:
    """Train a LoRA on the images of `data` and write it to `out` (kohya `.safetensors`); `options` are the
    fields of `LoraTrainConfig`. `stop_after` ends the run after that many updates of this call (checkpointed,
    without writing `out`): for tests of resuming and for time-boxed runs. SD 1.x / 2.x / XL only: Flux and SD 3
    runs go to `finetune.flow_run` (`sdjax.finetune.train_lora` and the CLI choose)."""
    from sdjax.finetune import step as step_lib

    cfg = LoraTrainConfig(data=str(data), out=str(out), **options)
    session = Session.begin(cfg, on_step=on_step, log=log, stop_after=stop_after)
    pipe, params, dtype = _load(cfg)
    resolution = cfg.resolution or pipe.default_size[0]
    dataset = session.prepare(resolution)
    conditioning = pipe.generator.models.conditioning
    objective = _objective(cfg, pipe)
    prediction_type = objective.prediction_type
    frozen, state, train_step, schedule = _lora_step(cfg, pipe, params, dtype, objective)
    sampler = data_lib.Sampler(dataset, cfg.data_config(resolution), cfg.batch_size, cfg.seed)
    cache_models = step_lib.Models(conditioning, pipe.unet, pipe.vae, dtype)  # the VAE a latent cache runs
    batches, frozen = _batches(cfg, cache_models, frozen, sampler, log)

    def finish(state: dict) -> None:
        write_lora(cfg, state["lora"], pipe.unet.config, prediction_type, cfg.run_path, len(dataset.items))

    validate = lora_validator(cfg, pipe, params, resolution, log)
    return session.loop(state, frozen, train_step, batches, schedule, finish, validate=validate)
