"""Fine-tuning of SD 1.x / 2.x / XL models: LoRA training (`train_lora`, `sdjax train lora`) and textual
inversion (`train_textual_inversion`, `sdjax train textual-inversion`), DreamBooth LoRAs with prior preservation
(`train_dreambooth`, `sdjax train dreambooth`), full fine-tunes of the UNet (`train_finetune`, `sdjax train finetune`).

- `data`: image folders with captions, kohya repeat folders, aspect-ratio buckets, augmentations.
- `lora`: the trainable LoRA as a delta pytree, merged inside the loss; kohya / PEFT files.
- `step`: the jitted training step (objectives, Min-SNR-gamma, noise offset, AdamW, accumulation, mesh).
- `textual_inversion`: a new token's embedding rows trained in the frozen text encoder(s); A1111 / diffusers files.
- `dreambooth`: instance + class images (drawn by the base model when missing), the prior-preservation loss.
- `full`: the full UNet fine-tune (float32 master weights, bf16 compute) and its diffusers folder;
  `ldm_file`: a pipeline as one original-layout (A1111) file; `cache`: latents encoded once before training.
- `run`: a run (run directory, loss log, orbax checkpoints, resuming); `cli`: the `sdjax train` commands.
- `ema`: the EMA of the trained values (diffusers' `EMAModel` rule); `validation`: images drawn during a run.
- `flow`, `flow_models`, `flow_run`, `flow_cli`: LoRAs of Flux.1 and SD 3 / 3.5 (flow matching), what `train_lora`
  runs for those models (`FlowLoraTrainConfig`); diffusers' LoRA file.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DreamBoothConfig",
    "FinetuneConfig",
    "FlowLoraTrainConfig",
    "LoraTrainConfig",
    "TextualInversionConfig",
    "train_dreambooth",
    "train_finetune",
    "train_lora",
    "train_textual_inversion",
]


def train_lora(data, out, **options: Any):
    """Train a LoRA (see `sdjax.finetune.run.train_lora`; Flux.1 / SD 3 models: `finetune.flow_run`)."""
    from sdjax.finetune import flow_run
    from sdjax.finetune.run import train_lora as run

    if flow_run.is_flow_run(options):  # Flux / SD 3 (flow matching)
        return flow_run.train_flow_lora(data, out, **options)
    return run(data, out, **options)


def train_textual_inversion(data, out, **options: Any):
    """Train a textual-inversion embedding (see `sdjax.finetune.textual_inversion.train_textual_inversion`)."""
    from sdjax.finetune.textual_inversion import train_textual_inversion as run

    return run(data, out, **options)


def train_dreambooth(data, out, **options: Any):
    """Train a DreamBooth LoRA (see `sdjax.finetune.dreambooth.train_dreambooth`)."""
    from sdjax.finetune.dreambooth import train_dreambooth as run

    return run(data, out, **options)


def train_finetune(data, out, **options: Any):
    """Fine-tune the whole UNet (see `sdjax.finetune.full.train_finetune`)."""
    from sdjax.finetune.full import train_finetune as run

    return run(data, out, **options)


def __getattr__(name: str):
    if name == "DreamBoothConfig":
        from sdjax.finetune.dreambooth import DreamBoothConfig

        return DreamBoothConfig
    if name == "FinetuneConfig":
        from sdjax.finetune.full import FinetuneConfig

        return FinetuneConfig
    if name == "LoraTrainConfig":
        from sdjax.finetune.run import LoraTrainConfig

        return LoraTrainConfig
    if name == "FlowLoraTrainConfig":
        from sdjax.finetune.flow_run import FlowLoraTrainConfig

        return FlowLoraTrainConfig
    if name == "TextualInversionConfig":
        from sdjax.finetune.textual_inversion import TextualInversionConfig

        return TextualInversionConfig
    raise AttributeError(name)
