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
- The rest is `train lora`'s: the LoRA, the optimiser, the run directory, checkpoints and resuming, the kohya /
  PEFT files (`run.write_lora`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune import lora as lora_lib
from sdjax.finetune import run as run_lib

CLASS_PREFIX = "sdjax-class-"
# DreamBooth settings a resumed run must share too (besides `run._RESUME_KEYS`).
_RESUME_KEYS = ("instance_prompt", "with_prior_preservation", "class_prompt", "prior_loss_weight")


@dataclasses.dataclass(frozen=True)
class DreamBoothConfig(run_lib.LoraTrainConfig):
    """`LoraTrainConfig` (`data`: the instance images) plus the DreamBooth settings."""

    instance_prompt: str = ""
    with_prior_preservation: bool = False
    class_data: str | None = None
    class_prompt: str | None = None
    num_class_images: int = 100
    prior_loss_weight: float = 1.0
    class_steps: int | None = None  # denoising steps of the class images (default: the pipeline's)
    class_guidance_scale: float | None = None  # default: the pipeline's
    class_seed: int = 0
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
            if Path(self.class_data).expanduser().exists() and not Path(self.class_data).expanduser().is_dir():
                raise data_lib.DataError(f"class_data {self.class_data} is not a folder")
        if self.caption_dropout or self.shuffle_tags:
            raise ValueError("caption_dropout / shuffle_tags: DreamBooth trains fixed instance and class prompts")
        super().check()


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
    written: list[Path] = []
    i = 0
    while len(written) < missing:
        path = folder / f"{CLASS_PREFIX}{i:05d}.png"
        if not path.exists():
            image = pipe.generate(
                cfg.class_prompt,
                seed=cfg.class_seed + i,
                steps=cfg.class_steps,
                guidance_scale=cfg.class_guidance_scale,
                height=resolution,
                width=resolution,
                params=params,
            )[0]
            image.save(path)
            written.append(path)
            log(f"class image {len(written)}/{missing}: {path}")
        i += 1
    return written


def _check_resume(run_dir: Path, cfg: DreamBoothConfig) -> None:
    saved = run_dir / "config.json"
    if not saved.is_file():
        return
    old, new = json.loads(saved.read_text()), dataclasses.asdict(cfg)
    diff = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in _RESUME_KEYS if old.get(k) != new[k]]
    if diff:
        raise ValueError(
            f"{run_dir}: its checkpoints come from a DreamBooth run with other settings ({'; '.join(diff)}); use "
            "another run_dir or resume=False"
        )


def _with_prompt(dataset: data_lib.Dataset, prompt: str) -> data_lib.Dataset:
    items = tuple(dataclasses.replace(item, caption=prompt) for item in dataset.items)
    return dataclasses.replace(dataset, items=items)


def _batch(samplers: list[data_lib.Sampler], conditioning, micro: int, clip_skip: int) -> dict:
    """Micro-batch `micro`: the instance examples, then (with prior preservation) the class examples."""
    parts = [s.load(micro) for s in samplers]
    joined = {
        "pixels": np.concatenate([p["pixels"] for p in parts]),
        "time_ids": np.concatenate([p["time_ids"] for p in parts]),
        "captions": [c for p in parts for c in p["captions"]],
    }
    return run_lib._inputs(conditioning, joined, clip_skip)


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
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from sdjax.finetune import step as step_lib
    from sdjax.parallel.sharding import batch_sharding

    cfg = DreamBoothConfig(data=str(data), out=str(out), **options)
    cfg.check()
    run_dir = cfg.run_path
    if cfg.resume:
        run_lib._check_resume(run_dir, cfg)
        _check_resume(run_dir, cfg)
    instances = data_lib.scan(cfg.data, cfg.data_config(cfg.resolution or 512))  # bad data fails before loading
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
    mesh = run_lib._mesh(dataclasses.replace(cfg, batch_size=cfg.batch_size * len(samplers)), log)
    conditioning = pipe.generator.models.conditioning
    prediction_type = cfg.prediction_type or pipe.scheduler.prediction_type
    objective = step_lib.Objective(
        prediction_type=prediction_type,
        num_train_timesteps=int(pipe.scheduler.num_train_timesteps),
        min_snr_gamma=cfg.min_snr_gamma,
        noise_offset=cfg.noise_offset,
        input_perturbation=cfg.input_perturbation,
        prior_loss_weight=cfg.prior_loss_weight if cfg.with_prior_preservation else None,
    )
    scale = float(cfg.alpha if cfg.alpha is not None else cfg.rank) / cfg.rank
    models = step_lib.Models(
        conditioning,
        pipe.unet,
        pipe.vae,
        dtype,
        unet_scale=scale,
        text_scale=scale,
        remat=cfg.gradient_checkpointing,
        lora_dropout=cfg.lora_dropout,
    )
    targets = {"unet": lora_lib.UNET_TARGETS}
    if cfg.train_text_encoder:
        targets.update({c: lora_lib.TEXT_TARGETS for c in conditioning.components})
    frozen = {c: params[c] for c in ("unet", "vae", *conditioning.components)}
    lora = lora_lib.init_lora(jax.random.PRNGKey(cfg.seed), frozen, targets, cfg.rank)
    schedule = step_lib.lr_schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.lr_schedule)
    optimizer = step_lib.make_optimizer(
        schedule, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, accumulation=cfg.accumulation
    )
    state = step_lib.init_state(lora, optimizer)
    run_dir.mkdir(parents=True, exist_ok=True)
    manager = run_lib._checkpoints(run_dir)
    start = 0
    if cfg.resume:
        state, micro = run_lib._restore(manager, state)
        start = micro // cfg.accumulation
        if start:
            log(f"resuming {run_dir} at update {start}")
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    loss_log = run_dir / "loss.jsonl"
    run_lib._log_lines(loss_log, start)
    replicated = NamedSharding(mesh, PartitionSpec())
    state, frozen = jax.device_put(state, replicated), jax.device_put(frozen, replicated)
    train_step = step_lib.make_train_step(models, objective, pipe.scheduler.alphas_cumprod, optimizer)
    key = jax.random.PRNGKey(cfg.seed)
    losses: list[float] = []
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for update in range(start, end):
        t0 = time.perf_counter()
        micro_losses = []
        for micro in range(update * cfg.accumulation, (update + 1) * cfg.accumulation):
            batch = jax.device_put(_batch(samplers, conditioning, micro, cfg.clip_skip), batch_sharding(mesh))
            state, loss = train_step(state, frozen, batch, key)
            micro_losses.append(loss)
        loss = float(np.mean([float(v) for v in micro_losses]))
        seconds = time.perf_counter() - t0
        losses.append(loss)
        row = {"step": update, "loss": loss, "lr": float(schedule(update)), "seconds": round(seconds, 4)}
        with loss_log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at update {update}; lower lr ({cfg.lr}) or check the data")
        done = update + 1
        if (cfg.save_every and done % cfg.save_every == 0) or done == end:
            manager.save(done * cfg.accumulation, args=run_lib._save_args(state), force=True)
        if on_step is not None:
            on_step(done, cfg.steps, loss, seconds)
    manager.wait_until_finished()
    manager.close()
    if end == cfg.steps:
        run_lib.write_lora(cfg, state["lora"], pipe.unet.config, prediction_type, run_dir, len(instances.items))
        if loss_log.is_file():
            run_lib.plot_losses(loss_log, run_dir / "loss.png")
    return run_lib.TrainResult(Path(cfg.out), run_dir, losses, start, end, instances.skipped)
