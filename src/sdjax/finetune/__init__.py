"""Fine-tuning of SD 1.x / 2.x / XL models: LoRA training (`train_lora`, `sdjax train lora`) and textual
inversion (`train_textual_inversion`, `sdjax train textual-inversion`), DreamBooth LoRAs with prior preservation
(`train_dreambooth`, `sdjax train dreambooth`).

- `data`: image folders with captions, kohya repeat folders, aspect-ratio buckets, augmentations.
- `lora`: the trainable LoRA as a delta pytree, merged inside the loss; kohya / PEFT files.
- `step`: the jitted training step (objectives, Min-SNR-gamma, noise offset, AdamW, accumulation, mesh).
- `textual_inversion`: a new token's embedding rows trained in the frozen text encoder(s); A1111 / diffusers files.
- `dreambooth`: instance + class images (drawn by the base model when missing), the prior-preservation loss.
- `run`: a run (run directory, loss log, orbax checkpoints, resuming); `cli`: the `sdjax train` commands.
- `ema`: the EMA of the trained values (diffusers' `EMAModel` rule); `validation`: images drawn during a run.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DreamBoothConfig",
    "LoraTrainConfig",
    "TextualInversionConfig",
    "train_dreambooth",
    "train_lora",
    "train_textual_inversion",
]


def train_lora(data, out, **options: Any):
    """Train a LoRA (see `sdjax.finetune.run.train_lora`)."""
    from sdjax.finetune.run import train_lora as run

    return run(data, out, **options)


def train_textual_inversion(data, out, **options: Any):
    """Train a textual-inversion embedding (see `sdjax.finetune.textual_inversion.train_textual_inversion`)."""
    from sdjax.finetune.textual_inversion import train_textual_inversion as run

    return run(data, out, **options)


def train_dreambooth(data, out, **options: Any):
    """Train a DreamBooth LoRA (see `sdjax.finetune.dreambooth.train_dreambooth`)."""
    from sdjax.finetune.dreambooth import train_dreambooth as run

    return run(data, out, **options)


def __getattr__(name: str):
    if name == "DreamBoothConfig":
        from sdjax.finetune.dreambooth import DreamBoothConfig

        return DreamBoothConfig
    if name == "LoraTrainConfig":
        from sdjax.finetune.run import LoraTrainConfig

        return LoraTrainConfig
    if name == "TextualInversionConfig":
        from sdjax.finetune.textual_inversion import TextualInversionConfig

        return TextualInversionConfig
    raise AttributeError(name)
