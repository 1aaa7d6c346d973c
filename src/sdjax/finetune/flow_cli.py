"""The flow-matching options of `sdjax train lora` (Flux.1, SD 3 / 3.5; `finetune.flow_run`) and the choice of
trainer: a `--model` of a flow family, or any of these options, makes the command a flow run (the DreamBooth ones
too: `sdjax train dreambooth` is SD 1.x / 2.x / XL's). Imports nothing
heavy (the CLI module imports it at start-up). Every option defaults to None ("the family's default"), so an option
the user gave can be told from one they did not."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

FLOW_CLI: dict[str, tuple[Any, Any]] = {
    "weighting_scheme": (
        Annotated[
            str | None,
            typer.Option(
                help="Flux / SD 3: timestep density and loss weighting (none, logit_normal, mode, sigma_sqrt, "
                "cosmap). Default: Flux none, SD 3 logit_normal (diffusers' scripts)."
            ),
        ],
        None,
    ),
    "logit_mean": (Annotated[float | None, typer.Option(help="Flux / SD 3: logit_normal mean (0).")], None),
    "logit_std": (Annotated[float | None, typer.Option(help="Flux / SD 3: logit_normal std (1).")], None),
    "mode_scale": (Annotated[float | None, typer.Option(help="Flux / SD 3: the mode density's scale (1.29).")], None),
    "guidance_scale": (
        Annotated[float | None, typer.Option(help="Flux dev: the guidance input while training (3.5).")],
        None,
    ),
    "lora_layers": (
        Annotated[
            str | None,
            typer.Option(
                help="Flux / SD 3: comma-separated LoRA targets (PEFT target_modules, e.g. attn.to_q,attn.to_k). "
                "Default: the script's (Flux: attention and MLPs; SD 3: attention)."
            ),
        ],
        None,
    ),
    "max_sequence_length": (
        Annotated[int | None, typer.Option(help="Flux / SD 3: T5 tokens. Default: the pipeline's.")],
        None,
    ),
    "precondition_outputs": (
        Annotated[
            bool | None,
            typer.Option(help="Flux / SD 3: loss on x0 = x_t - sigma v (EDM). Default: SD 3 yes, Flux no."),
        ],
        None,
    ),
    # DreamBooth (the scripts' options; `sdjax train dreambooth`'s names, which states its own for SD models)
    "instance_prompt": (
        Annotated[
            str | None,
            typer.Option(help="Flux / SD 3 DreamBooth: every image's prompt, e.g. 'a photo of sks dog' (not .txt)."),
        ],
        None,
    ),
    "with_prior_preservation": (
        Annotated[
            bool | None,
            typer.Option(
                help="Flux / SD 3: train class images too (prior preservation). Default: on with --class-prompt."
            ),
        ],
        None,
    ),
    "class_data": (
        Annotated[Path | None, typer.Option(help="Flux / SD 3: class images; missing ones are drawn there.")],
        None,
    ),
    "class_prompt": (
        Annotated[str | None, typer.Option(help="Flux / SD 3: the class images' prompt, e.g. 'a photo of dog'.")],
        None,
    ),
    "num_class_images": (
        Annotated[int | None, typer.Option(help="Flux / SD 3: class images wanted (missing ones drawn; 100).")],
        None,
    ),
    "prior_loss_weight": (
        Annotated[float | None, typer.Option(help="Flux / SD 3: weight of the class images' loss (1).")],
        None,
    ),
    "class_steps": (
        Annotated[int | None, typer.Option(help="Flux / SD 3: denoising steps of drawn class images.")],
        None,
    ),
    "sample_batch_size": (
        Annotated[int | None, typer.Option(help="Flux / SD 3: class images drawn per batch (4).")],
        None,
    ),
    # a transformer file as --model (flux1-dev.safetensors): what it lacks
    "config": (
        Annotated[
            Path | None,
            typer.Option(help="Flux / SD 3 transformer file as --model: a diffusers folder of the family (the rest)."),
        ],
        None,
    ),
    "t5": (
        Annotated[Path | None, typer.Option(help="Flux / SD 3 transformer file: a separate T5-XXL file.")],
        None,
    ),
    "clip_l": (
        Annotated[Path | None, typer.Option(help="Flux / SD 3 transformer file: a separate CLIP-L file.")],
        None,
    ),
    "clip_g": (
        Annotated[Path | None, typer.Option(help="SD 3 transformer file: a separate CLIP-G file.")],
        None,
    ),
}
FLOW_ORDER = " " + " ".join(FLOW_CLI)


def lora_trainer(options: dict) -> tuple[Any, Any]:
    """`(config class, trainer)` of `sdjax train lora` with these `options` (the flow options not given are
    removed from `options`; given ones stay, and a flow config refuses them for a UNet model)."""
    from sdjax.finetune import flow_run

    given = {k: options.pop(k) for k in list(options) if k in FLOW_CLI}
    given = {k: v for k, v in given.items() if v is not None}
    if given or flow_run.model_family(options.get("model")) in flow_run.FLOW_FAMILIES:
        options.update(given)
        return flow_run.FlowLoraTrainConfig, flow_run.train_flow_lora
    from sdjax.finetune.run import LoraTrainConfig, train_lora

    return LoraTrainConfig, train_lora
