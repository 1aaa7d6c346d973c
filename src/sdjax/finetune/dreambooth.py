"""`train_dreambooth`: a DreamBooth LoRA (Ruiz et al. 2022) with prior preservation, as diffusers'
`examples/dreambooth/train_dreambooth_lora.py`.

- Instance images (`data`) are all trained with `instance_prompt` ("a photo of sks dog"); their captions are not
  read. With `with_prior_preservation`, class images (`class_data`) are trained with `class_prompt` ("a photo of
  dog"): each micro-batch is `batch_size` instance examples followed by `batch_size` class examples, and the loss
  is `MSE(instance half) + prior_loss_weight * MSE(class half)` (`step.Objective.prior_loss_weight`).
- Class images: when `class_data` holds fewer than `num_class_images` images, the base model draws the missing ones
  (`pipe.generate(class_prompt)`, image `i` with seed `class_seed + i`, `class_steps` steps, at the training
  resolution) and saves them as `class_data/sdjax-class-NNNNN.png`; a second run finds them and draws nothing.
- Examples are cropped to `resolution x resolution` (diffusers' square crop; no buckets: instance and class examples
  share a batch). Min-SNR weighting together with prior preservation is refused (see `step.Objective`).
- Several hosts (`finetune.distributed`): micro-batches are built by rows (`run.RowBatches` of `2 * batch_size`
  rows with prior preservation): each process opens only the rows its devices hold, instance rows from the
  instance sampler and class rows from the class sampler (`data.part_rows`), so the global batch is the one-process
  [instance; class] batch and the loss's halves pair as they do on one host. The class folder must be full
  (drawing class images is refused over several processes).
- FSDP (`fsdp=True`): the frozen UNet and text encoders split over the devices as in `train lora`
  (`finetune.sharding`); the LoRA and its optimiser state stay whole.
- The rest is `train lora`'s: the LoRA, the optimiser, the run directory, checkpoints and resuming, the kohya /
  PEFT files (`run.write_lora`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune import run as run_lib

CLASS_PREFIX = "sdjax-class-"
# DreamBooth settings a resumed run must share too (besides `run._RESUME_KEYS`).
_RESUME_KEYS = ("instance_prompt", "with_prior_preservation", "class_prompt", "prior_loss_weight")


@dataclasses.dataclass(frozen=True)
class DreamBoothFields:
    """The DreamBooth settings (diffusers' scripts' names), declared once for `DreamBoothConfig` (SD 1.x / 2.x / XL)
    and `flow_run.FlowLoraTrainConfig` (Flux, SD 3), which each check them in their own words. The defaults are
    the flow runs' (no instance prompt: the images' captions; prior preservation on with a class_prompt);
    `DreamBoothConfig` narrows the first two. Listed before `LoraTrainConfig` among a config's bases, so that these
    fields follow its fields."""

    instance_prompt: str | None = None  # every instance image's prompt; None: the images' .txt captions
    with_prior_preservation: bool | None = None  # None: on with a class_prompt
    class_data: str | None = None  # class images; the missing ones of num_class_images are drawn there
    class_prompt: str | None = None
    num_class_images: int = 100
    prior_loss_weight: float = 1.0
    class_steps: int | None = None  # denoising steps of drawn class images (default: the pipeline's)
    class_guidance_scale: float | None = None  # default: the pipeline's
    class_seed: int = 0
    sample_batch_size: int = 4  # class images drawn per generate call (the scripts' --sample_batch_size)


@dataclasses.dataclass(frozen=True)
class DreamBoothConfig(DreamBoothFields, run_lib.LoraTrainConfig):
    """`LoraTrainConfig` (`data`: the instance images) plus the DreamBooth settings (`DreamBoothFields`), which
    here need an instance prompt and turn prior preservation on only when asked."""

    instance_prompt: str = ""
    with_prior_preservation: bool = False
    bucketing: bool = False  # square crops (diffusers'); buckets are refused with prior preservation

    def check(self) -> None:
        if not self.instance_prompt.strip():
            raise ValueError("instance_prompt is empty: DreamBooth trains the instance images with it")
        if self.with_prior_preservation:
            if not self.class_prompt or not self.class_prompt.strip():
                raise ValueError("with_prior_preservation needs a class_prompt (e.g. 'a photo of dog')")
            if not self.class_data:
                raise ValueError("with_prior_preservation needs a class_data folder (class images go there)")
            if int(self.num_class_images) != self.num_class_images or self.num_class_images < 1:
                raise ValueError(f"num_class_images={self.num_class_images} must be at least 1 with prior preservation")
            if not math.isfinite(self.prior_loss_weight) or self.prior_loss_weight < 0:
                raise ValueError(f"prior_loss_weight={self.prior_loss_weight} must be 0 or more")
            if self.bucketing:
                raise ValueError("bucketing with prior preservation: instance and class examples share a batch")
            if self.min_snr_gamma is not None:
                raise ValueError(
                    "min_snr_gamma with prior preservation is refused: diffusers' train_dreambooth_lora.py has no "
                    "Min-SNR weighting and its SDXL script weights the instance losses with the whole batch's SNRs"
                )
            if self.class_steps is not None and self.class_steps < 1:
                raise ValueError(f"class_steps={self.class_steps} must be at least 1")
            check_sample_batch_size(self.sample_batch_size)
            if Path(self.class_data).expanduser().exists() and not Path(self.class_data).expanduser().is_dir():
                raise data_lib.DataError(f"class_data {self.class_data} is not a folder")
        if self.caption_dropout or self.shuffle_tags:
            raise ValueError("caption_dropout / shuffle_tags: DreamBooth trains fixed instance and class prompts")
        super().check()


def check_sample_batch_size(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sample_batch_size={n!r} (--sample-batch-size) must be a positive integer")


# ------------------------------------------------------------------------------------------------ class images
def class_images(folder: str | Path) -> list[Path]:
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in data_lib.IMAGE_SUFFIXES)


def fill_class_images(
    pipe, params, cfg: DreamBoothConfig, resolution: int, log: Callable[[str], None] = lambda s: None
) -> list[Path]:
    """Draw the class images `cfg.class_data` lacks (up to `num_class_images`) with the base model; returns the
    paths written (empty when the folder already holds enough)."""
    folder = Path(cfg.class_data).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    missing = cfg.num_class_images - len(class_images(folder))
    if missing > 0:
        from sdjax.finetune import distributed

        if distributed.process_count() > 1:
            raise ValueError(
                f"{folder} lacks {missing} class images, and generating them is not supported over several "
                "processes: generate them first on one process (or give a full class folder)"
            )
    todo: list[tuple[int, Path]] = []  # (number, path) of the images to draw: the first free names
    i = 0
    while len(todo) < max(missing, 0):
        path = folder / f"{CLASS_PREFIX}{i:05d}.png"
        if not path.exists():
            todo.append((i, path))
        i += 1
    written: list[Path] = []
    n = cfg.sample_batch_size
    for start in range(0, len(todo), n):
        chunk = todo[start : start + n]
        # Image number i is seed class_seed + i alone (per-image seeds), in whatever batch it is drawn. The last
        # batch is filled up with images that are not kept: one compiled program draws every batch.
        seeds = [cfg.class_seed + i for i, _ in chunk]
        seeds += [seeds[-1] + k for k in range(1, n - len(chunk) + 1)]
        images = pipe.generate(
            [cfg.class_prompt] * n,
            seed=seeds,
            steps=cfg.class_steps,
            guidance_scale=cfg.class_guidance_scale,
            height=resolution,
            width=resolution,
            params=params,
        )
        for (_, path), image in zip(chunk, images, strict=False):
            image.save(path)
            written.append(path)
            log(f"class image {len(written)}/{missing}: {path}")
    return written


def _with_prompt(dataset: data_lib.Dataset, prompt: str) -> data_lib.Dataset:
    items = tuple(dataclasses.replace(item, caption=prompt) for item in dataset.items)
    return dataclasses.replace(dataset, items=items)


def _batch(
    samplers: list[data_lib.Sampler], conditioning, micro: int, clip_skip: int, rows: Sequence[int] | None = None
) -> dict:
    """Micro-batch `micro`: the instance examples, then (with prior preservation) the class examples; with `rows`
    (indices into that whole micro-batch, as `run.RowBatches` asks) only those rows, each sampler opening its own."""
    sizes = [s.batch_size for s in samplers]
    parts = [s.load(micro, r) for s, r in zip(samplers, data_lib.part_rows(rows, sizes), strict=True) if r is None or r]
    joined = {
        "pixels": np.concatenate([p["pixels"] for p in parts]),
        "time_ids": np.concatenate([p["time_ids"] for p in parts]),
        "captions": [c for p in parts for c in p["captions"]],
    }
    return run_lib._inputs(conditioning, joined, clip_skip)


def _row_batches(samplers: list[data_lib.Sampler], conditioning, clip_skip: int) -> run_lib.RowBatches:
    """The run's micro-batches, built by rows (`_batch`)."""

    def load(micro: int, rows: Sequence[int] | None) -> dict:
        return _batch(samplers, conditioning, micro, clip_skip, rows)

    return run_lib.RowBatches(load, sum(s.batch_size for s in samplers))


# ------------------------------------------------------------------------------------------------ the run
def train_dreambooth(
    data: str | Path,
    out: str | Path,
    *,
    on_step: run_lib.OnStep | None = None,
    log: Callable[[str], None] = lambda s: None,
    stop_after: int | None = None,
    **options: Any,
) -> run_lib.TrainResult:
    """Train a DreamBooth LoRA on the instance images of `data` (with `instance_prompt`) and write it to `out`
    (kohya `.safetensors`); `options` are the fields of `DreamBoothConfig`."""

    cfg = DreamBoothConfig(data=str(data), out=str(out), **options)
    session = run_lib.Session.begin(cfg, on_step=on_step, log=log, stop_after=stop_after)
    run_dir = cfg.run_path
    if cfg.resume:
        run_lib._check_resume(run_dir, cfg, _RESUME_KEYS, "a DreamBooth run")
    instances = session.dataset
    pipe, params, dtype = run_lib._load(cfg)
    resolution = cfg.resolution or pipe.default_size[0]
    data_cfg = cfg.data_config(resolution)
    instances = _with_prompt(data_lib.with_buckets(instances, data_cfg), cfg.instance_prompt)
    samplers = [data_lib.Sampler(instances, data_cfg, cfg.batch_size, cfg.seed)]
    log(f"{len(instances.items)} instance images ({instances.examples_per_epoch} examples per epoch)")
    if cfg.with_prior_preservation:
        drawn = fill_class_images(pipe, params, cfg, resolution, log)
        classes = _with_prompt(data_lib.scan(cfg.class_data, data_cfg), cfg.class_prompt)
        log(f"{len(classes.items)} class images ({len(drawn)} drawn now)")
        samplers.append(data_lib.Sampler(classes, data_cfg, cfg.batch_size, cfg.seed + 1))
    session.dataset = instances
    session.mesh = run_lib._mesh(dataclasses.replace(cfg, batch_size=cfg.batch_size * len(samplers)), log)
    conditioning = pipe.generator.models.conditioning
    objective = run_lib._objective(cfg, pipe, cfg.prior_loss_weight if cfg.with_prior_preservation else None)
    prediction_type = objective.prediction_type
    frozen, state, train_step, schedule = run_lib._lora_step(cfg, pipe, params, dtype, objective)

    def finish(state: dict) -> None:
        run_lib.write_lora(cfg, state["lora"], pipe.unet.config, prediction_type, run_dir, len(instances.items))

    batches = _row_batches(samplers, conditioning, cfg.clip_skip)
    validate = run_lib.lora_validator(cfg, pipe, params, resolution, log)
    return session.loop(state, frozen, train_step, batches, schedule, finish, validate=validate)
