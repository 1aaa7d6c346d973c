"""`train_flow_lora`: a LoRA run of a flow-matching model (Flux.1 dev / schnell, SD 3 / 3.5), from a data folder to
diffusers' LoRA file; what `train_lora` (and `sdjax train lora`) runs when `model` is such a model.

The run is `train lora`'s (`finetune.run.run_loop`: the run directory, loss log, orbax checkpoints, exact
resuming, EMA, validation images) with the flow step of `finetune.flow` and the family pieces of
`finetune.flow_models`. The settings are `LoraTrainConfig`'s plus the scripts' flow options (`FLOW_OPTIONS`); the
UNet-only ones (prediction type, Min-SNR-gamma, noise offset, input perturbation, text-encoder LoRA, clip skip) are
refused. `out` is diffusers' `pytorch_lora_weights.safetensors` layout (`transformer.<module>.lora_A.weight`),
which diffusers' `load_lora_weights` and `sdjax generate --lora` read.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune import run as run_lib
from sdjax.finetune.run import LoraTrainConfig, OnStep, TrainResult

FLOW_FAMILIES = ("flux", "sd3")
# The options only flow models have (a CLI or API call naming one is a flow run, and refused for other models).
FLOW_OPTIONS = (
    "weighting_scheme",
    "logit_mean",
    "logit_std",
    "mode_scale",
    "guidance_scale",
    "lora_layers",
    "max_sequence_length",
    "precondition_outputs",
)
_RESUME_KEYS = (
    "model",
    "rank",
    "alpha",
    "batch_size",
    "accumulation",
    "seed",
    "lr",
    "optimizer",
    "ema_decay",
    *FLOW_OPTIONS,
)
# UNet-only settings -> their default (a flow run refuses other values).
_UNET_ONLY = {
    "prediction_type": None,
    "min_snr_gamma": None,
    "noise_offset": 0.0,
    "input_perturbation": 0.0,
    "train_text_encoder": False,
    "clip_skip": 1,
    "peft": False,
}


def model_family(model: str | None) -> str | None:
    """The family name of `model` (a folder, Hub id, single file or None: the embedded SD model) as sdjax's loader
    would pick it, without loading it; None when it cannot tell (the loader then reports the problem)."""
    from sdjax.families import family_of_file, family_of_pipeline_class
    from sdjax.pipelines.auto import pipeline_class_name, resolve_alias

    if model is None:
        return "sd"
    path = resolve_alias(str(model))
    if os.path.isfile(path):
        family = family_of_file(path)
        return family.name if family is not None else "sd"
    try:
        return family_of_pipeline_class(pipeline_class_name(path)).name
    except Exception:
        return None


def is_flow_run(options: dict) -> bool:
    """Whether `train_lora(**options)` is a flow run: a Flux / SD 3 model, or a flow option given."""
    return any(k in options for k in FLOW_OPTIONS) or model_family(options.get("model")) in FLOW_FAMILIES


@dataclasses.dataclass(frozen=True)
class FlowLoraTrainConfig(LoraTrainConfig):
    """`LoraTrainConfig` with the flow scripts' options (defaults: the family's script's, where None)."""

    weighting_scheme: str | None = None  # Flux: "none" (uniform); SD 3: "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    guidance_scale: float = 3.5  # Flux dev's guidance input while training (the script's --guidance_scale)
    lora_layers: tuple[str, ...] | None = None  # PEFT target_modules; None: the script's default
    max_sequence_length: int | None = None  # T5 tokens; None: the pipeline's (Flux dev 512, schnell 256, SD 3 256)
    precondition_outputs: bool | None = None  # None: SD 3 yes (its script's default), Flux no

    written: ClassVar[str] = "the LoRA (diffusers' transformer.<module>.lora_A/lora_B layout)"
    latent_cache: ClassVar[bool] = True  # `cache_latents` (`finetune.cache`) serves flow runs too

    def __post_init__(self):
        super().__post_init__()
        layers = self.lora_layers
        if isinstance(layers, str):
            layers = [t.strip() for t in layers.split(",")]
        if layers is not None:
            object.__setattr__(self, "lora_layers", tuple(layers))

    def check(self) -> None:
        """Bad settings fail here, naming the setting, before anything is loaded or compiled."""
        from sdjax.finetune import flow

        for name, default in _UNET_ONLY.items():
            if getattr(self, name) != default:
                why = "out is already diffusers' file" if name == "peft" else "a UNet (SD 1.x / 2.x / XL) setting"
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: flow-matching LoRA training (Flux, SD 3) has no such "
                    f"option ({why})"
                )
        flow.FlowObjective(
            weighting_scheme=self.weighting_scheme or "none",
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            mode_scale=self.mode_scale,
        )
        if not math.isfinite(self.guidance_scale):
            raise ValueError(f"guidance_scale={self.guidance_scale} (--guidance-scale) must be a finite number")
        n = self.max_sequence_length
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 512):
            raise ValueError(f"max_sequence_length={n!r} (--max-sequence-length) must be an int in [1, 512]")
        if self.lora_layers is not None and not all(isinstance(t, str) and t for t in self.lora_layers):
            raise ValueError(f"lora_layers={self.lora_layers!r} (--lora-layers) must be module names, e.g. attn.to_q")
        super().check()
        family = model_family(self.model)
        if family not in FLOW_FAMILIES:
            from sdjax.families import FAMILIES

            given = [k for k in FLOW_OPTIONS if getattr(self, k) != getattr(FlowLoraTrainConfig, k)]
            what = f"a {FAMILIES[family].title} model" if family in FAMILIES else "not a model sdjax can read"
            raise ValueError(
                f"model={self.model!r} is {what}: the flow-matching options {given} (flow LoRA training) are for "
                "Flux.1 and SD 3 / 3.5 models"
            )
        if self.lora_layers is not None:
            _check_targets_from_config(self.model, family, self.lora_layers)


def _check_targets_from_config(model: str, family: str, targets) -> None:
    """The targets against the transformer the folder's `transformer/config.json` describes (shapes only; the
    loader reuses that trace), when `model` is a local folder."""
    from sdjax.config import read_json
    from sdjax.finetune import flow_models

    config_path = Path(str(model)) / "transformer" / "config.json"
    if not config_path.is_file():
        return  # a Hub id or single file: checked after loading, still before anything is compiled
    if family == "flux":
        from sdjax.models import flux as module

        config = module.FluxTransformerConfig.from_dict(read_json(config_path), source=str(config_path))
    else:
        from sdjax.models import sd3 as module

        config = module.SD3TransformerConfig.from_dict(read_json(config_path), source=str(config_path))
    flow_models.target_paths(module.init_params_shape(config), targets, source=f"{model}'s transformer")


def _objective(cfg: FlowLoraTrainConfig, adapter: Any, scheduler: Any):
    from sdjax.finetune import flow

    precondition = cfg.precondition_outputs
    return flow.FlowObjective(
        weighting_scheme=cfg.weighting_scheme or adapter.default_weighting,
        logit_mean=cfg.logit_mean,
        logit_std=cfg.logit_std,
        mode_scale=cfg.mode_scale,
        precondition_outputs=adapter.default_precondition if precondition is None else bool(precondition),
        num_train_timesteps=int(scheduler.num_train_timesteps),
        shift=float(getattr(scheduler, "shift", 1.0)),
        use_dynamic_shifting=bool(getattr(scheduler, "use_dynamic_shifting", False)),
    )


def _pixel_multiple(cfg: FlowLoraTrainConfig, pipe: Any, adapter: Any, resolution: int) -> None:
    """Image sides must give latents the transformer can patch: multiples of VAE factor x patch."""
    multiple = 2 ** (len(pipe.vae.config.block_out_channels) - 1) * adapter.latent_multiple
    if cfg.bucketing and cfg.bucket_step % multiple:
        raise ValueError(f"bucket_step={cfg.bucket_step} must be a multiple of {multiple} for this model")
    if not cfg.bucketing and resolution % multiple:
        raise ValueError(f"resolution={resolution} must be a multiple of {multiple} for this model (VAE x patch)")


def write_flow_lora(cfg: FlowLoraTrainConfig, lora: dict, targets, family: str, num_images: int = 0) -> None:
    """`cfg.out` in diffusers' LoRA layout (`flow_models.peft_state_dict`) with a few training notes."""
    from sdjax.finetune import flow_models
    from sdjax.finetune import lora as lora_lib

    host = {c: {k: {n: np.asarray(v) for n, v in ab.items()} for k, ab in layers.items()} for c, layers in lora.items()}
    alpha = float(cfg.alpha if cfg.alpha is not None else cfg.rank)
    tensors, meta = flow_models.peft_state_dict(host, rank=cfg.rank, alpha=alpha, targets=targets)
    meta |= {
        "sdjax_family": family,
        "sdjax_steps": str(cfg.steps),
        "sdjax_images": str(num_images),
        "sdjax_comment": cfg.comment,
    }
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    lora_lib.save_safetensors(cfg.out, tensors, meta)


def _load(cfg: FlowLoraTrainConfig):
    import jax.numpy as jnp

    from sdjax.pipelines import load_pipeline

    dtype = jnp.bfloat16 if cfg.mixed_precision == "bf16" else jnp.float32
    pipe, params = load_pipeline(cfg.model, dtype=dtype)
    if cfg.max_sequence_length is not None:
        pipe.max_sequence_length = cfg.max_sequence_length
    return pipe, params, dtype


def train_flow_lora(
    data: str | Path,
    out: str | Path,
    *,
    on_step: OnStep | None = None,
    log: Callable[[str], None] = lambda s: None,
    stop_after: int | None = None,
    **options: Any,
) -> TrainResult:
    """Train a LoRA of a Flux.1 or SD 3 model on the images of `data` and write it to `out` (diffusers' LoRA
    layout); `options` are the fields of `FlowLoraTrainConfig`; `stop_after` as in `train_lora`."""
    import jax

    from sdjax.finetune import flow, flow_models
    from sdjax.finetune import step as step_lib

    cfg = FlowLoraTrainConfig(data=str(data), out=str(out), **options)
    session = run_lib.Session.begin(cfg, on_step=on_step, log=log, stop_after=stop_after, resume_keys=_RESUME_KEYS)
    pipe, params, dtype = _load(cfg)
    adapter = flow_models.adapter_for(pipe, dtype, guidance_scale=cfg.guidance_scale, remat=cfg.gradient_checkpointing)
    resolution = cfg.resolution or pipe.default_size[0]
    _pixel_multiple(cfg, pipe, adapter, resolution)
    targets = cfg.lora_layers or adapter.default_targets
    component = adapter.component
    lora = flow_models.init_lora(jax.random.PRNGKey(cfg.seed), params[component], targets, cfg.rank)
    dataset = session.prepare(resolution)
    log(f"LoRA on {len(lora[component])} layers of the {adapter.family} transformer ({', '.join(targets)})")
    objective = _objective(cfg, adapter, pipe.scheduler)
    scale = float(cfg.alpha if cfg.alpha is not None else cfg.rank) / cfg.rank
    models = flow.FlowModels(adapter, pipe.vae, dtype, scale, cfg.lora_dropout)
    schedule, optimizer = run_lib._optimizer(cfg)
    state = step_lib.init_state(lora, optimizer)
    train_step = flow.make_flow_train_step(models, objective, optimizer)
    frozen = {component: params[component], "vae": params["vae"]}
    texts = flow_models.TextStates(pipe.generator.models.conditioning, params, dtype)
    sampler = data_lib.Sampler(dataset, cfg.data_config(resolution), cfg.batch_size, cfg.seed)
    images = sampler.load
    if cfg.cache_latents:  # every view encoded once now; the VAE leaves the step
        from sdjax.finetune import cache as cache_lib

        cache = cache_lib.build(sampler.dataset, sampler.cfg, models, frozen["vae"], cfg.seed, log)
        frozen = {component: params[component]}
        images = lambda micro: cache.batch(sampler, micro)

    def batches(micro: int) -> dict:
        batch = images(micro)
        pixels = {k: batch[k] for k in ("pixels", "latents") if k in batch}
        return {**pixels, **texts(batch["captions"])}

    def finish(state: dict) -> None:
        write_flow_lora(cfg, state["lora"], targets, adapter.family, len(dataset.items))

    validate = run_lib.lora_validator(cfg, pipe, params, resolution, log)
    return session.loop(state, frozen, train_step, batches, schedule, finish, validate=validate)
