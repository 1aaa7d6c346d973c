"""`train_flow_lora`: a LoRA run of a flow-matching model (Flux.1 dev / schnell, SD 3 / 3.5), from a data folder to
diffusers' LoRA file; what `train_lora` (and `sdjax train lora`) runs when `model` is such a model.

The run is `train lora`'s (`finetune.loop.run_loop`: the run directory, loss log, orbax checkpoints, exact
resuming, EMA, validation images) with the flow step of `finetune.flow` and the family pieces of
`finetune.flow_models`. The settings are `LoraTrainConfig`'s plus the scripts' flow options (`FLOW_OPTIONS`); the
UNet-only ones (prediction type, Min-SNR-gamma, noise offset, input perturbation, clip skip) are refused.

- `train_text_encoder`: LoRA on the CLIP encoders too (the scripts' `--train_text_encoder`; T5 frozen).
- DreamBooth (the scripts' `--instance_prompt`, `--with_prior_preservation`, ...): `instance_prompt` replaces the
  images' captions; with prior preservation (on with a `class_prompt`) each micro-batch is `batch_size` instance
  examples then `batch_size` class examples of `class_data` (trained with `class_prompt`; the missing ones of
  `num_class_images` drawn by the base model first, `finetune.dreambooth.fill_class_images`), and the loss is
  `instance + prior_loss_weight * class` (`flow.FlowObjective.prior_loss_weight`).
- Batches are built by rows (`run.RowBatches`): each process of a multi-host run decodes (or takes from the latent
  cache) only the rows of the global [instance; class] batch its devices hold, and encodes only their captions.

`out` is diffusers' `pytorch_lora_weights.safetensors` layout (`transformer.<module>.lora_A.weight`, and
`text_encoder.<module>...` with text-encoder LoRA), which diffusers' `load_lora_weights` and `sdjax generate
--lora` read.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune import run as run_lib
from sdjax.finetune.dreambooth import DreamBoothFields
from sdjax.finetune.run import LoraTrainConfig, OnStep, TrainResult

FLOW_FAMILIES = ("flux", "sd3")
# The flow scripts' objective and model options.
_SCRIPT_OPTIONS = (
    "weighting_scheme",
    "logit_mean",
    "logit_std",
    "mode_scale",
    "guidance_scale",
    "lora_layers",
    "max_sequence_length",
    "precondition_outputs",
)
# DreamBooth's (the scripts' names; for SD models they are `sdjax train dreambooth`'s).
DREAMBOOTH_OPTIONS = tuple(f.name for f in dataclasses.fields(DreamBoothFields))
# A transformer file as `model` (flux1-dev.safetensors, sd3.5_large.safetensors): the diffusers folder for what the
# file lacks and the separate encoder files, as `sdjax.load_pipeline` takes them (`from_single_file`).
MODEL_FILES = ("config", "t5", "clip_l", "clip_g")
# The options only flow LoRA runs have (a CLI or API call naming one is a flow run, and refused for other models).
FLOW_OPTIONS = (*_SCRIPT_OPTIONS, *DREAMBOOTH_OPTIONS, *MODEL_FILES)
_RESUME_KEYS = (
    "model",
    *MODEL_FILES,
    "rank",
    "alpha",
    "batch_size",
    "accumulation",
    "seed",
    "lr",
    "optimizer",
    *run_lib.EMA_SETTINGS,
    "train_text_encoder",
    "text_encoder_lr",
    *_SCRIPT_OPTIONS,
    "instance_prompt",
    "with_prior_preservation",
    "class_prompt",
    "prior_loss_weight",
)
# UNet-only settings -> their default (a flow run refuses other values).
_UNET_ONLY = {
    "prediction_type": None,
    "min_snr_gamma": None,
    "noise_offset": 0.0,
    "input_perturbation": 0.0,
    "clip_skip": 1,
    "peft": False,
    "conv_rank": None,  # LoCon: the UNet's ResNet convolutions (a transformer has none)
    "conv_alpha": None,
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
class FlowLoraTrainConfig(DreamBoothFields, LoraTrainConfig):
    """`LoraTrainConfig` with the flow scripts' options (defaults: the family's script's, where None) and
    DreamBooth's (`dreambooth.DreamBoothFields`)."""

    weighting_scheme: str | None = None  # Flux: "none" (uniform); SD 3: "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    guidance_scale: float = 3.5  # Flux dev's guidance input while training (the script's --guidance_scale)
    lora_layers: tuple[str, ...] | None = None  # PEFT target_modules; None: the script's default
    max_sequence_length: int | None = None  # T5 tokens; None: the pipeline's (Flux dev 512, schnell 256, SD 3 256)
    precondition_outputs: bool | None = None  # None: SD 3 yes (its script's default), Flux no
    config: str | None = None  # with a transformer file as `model`: a diffusers folder of the family (the rest)
    t5: str | None = None  # ... and separate encoder files (T5-XXL, CLIP-L, CLIP-G), else the folder's
    clip_l: str | None = None
    clip_g: str | None = None

    written: ClassVar[str] = "the LoRA (diffusers' transformer.<module>.lora_A/lora_B layout)"
    latent_cache: ClassVar[bool] = True  # `cache_latents` (`finetune.cache`) serves flow runs too
    text_cache: ClassVar[bool] = True  # flow runs always train from cached text states (`flow_models.TextStates`)

    def __post_init__(self):
        super().__post_init__()
        layers = self.lora_layers
        if isinstance(layers, str):
            layers = [t.strip() for t in layers.split(",")]
        if layers is not None:
            object.__setattr__(self, "lora_layers", tuple(layers))

    @property
    def prior_preservation(self) -> bool:
        """DreamBooth's prior preservation: `with_prior_preservation`, by default on with a `class_prompt`."""
        if self.with_prior_preservation is None:
            return self.class_prompt is not None
        return bool(self.with_prior_preservation)

    def check(self) -> None:
        """Bad settings fail here, naming the setting, before anything is loaded or compiled."""
        from sdjax.finetune import flow

        if not isinstance(self.train_text_encoder, bool):
            raise ValueError(f"train_text_encoder={self.train_text_encoder!r} (--train-text-encoder) must be a bool")

        for name, default in _UNET_ONLY.items():
            if getattr(self, name) != default:
                why = "out is already diffusers' file" if name == "peft" else "a UNet (SD 1.x / 2.x / XL) setting"
                raise ValueError(
                    f"{name}={getattr(self, name)!r} (--{name.replace('_', '-')}): flow-matching LoRA training "
                    f"(Flux, SD 3) has no such option ({why})"
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
                "Flux.1 and SD 3 / 3.5 models (SD 1.x / 2.x / XL DreamBooth: sdjax train dreambooth)"
            )
        _check_model_files(self, family)
        _check_dreambooth(self)
        if self.lora_layers is not None:
            _check_targets_from_config(self.config or self.model, family, self.lora_layers)


def _check_model_files(cfg: FlowLoraTrainConfig, family: str) -> None:
    """A transformer file as `model` needs `config` (a folder); `config`, `t5`, `clip_l`, `clip_g` are only for
    such a file, and each encoder file must be one the family takes and exist."""
    from sdjax.families import FAMILIES
    from sdjax.pipelines.auto import resolve_alias

    given = {k: getattr(cfg, k) for k in MODEL_FILES if getattr(cfg, k) is not None}
    flag = lambda k: f"{k} (--{k.replace('_', '-')})"
    if not os.path.isfile(resolve_alias(str(cfg.model))):
        if given:
            k = next(iter(given))
            raise ValueError(
                f"{flag(k)}={given[k]!r}: only with a single transformer file as model; model={cfg.model!r} is a "
                "folder or Hub id with every component"
            )
        return
    title, parts = FAMILIES[family].title, FAMILIES[family].single_file_parts
    if cfg.config is None:
        raise ValueError(
            f"model={cfg.model!r} is a {title} transformer file (a single file, without tokenizers and configs): "
            f"give {flag('config')} a diffusers {title} folder for what the file lacks"
        )
    if not Path(cfg.config).expanduser().is_dir():
        raise ValueError(f"{flag('config')}={cfg.config!r} is not a folder (a diffusers {title} folder)")
    for k in ("t5", "clip_l", "clip_g"):
        if k not in given:
            continue
        if k not in parts:
            raise ValueError(
                f"{flag(k)}={given[k]!r}: a {title} model has no such encoder file (it takes "
                f"{', '.join(flag(p) for p in parts)})"
            )
        if not Path(given[k]).expanduser().is_file():
            raise ValueError(f"{flag(k)}={given[k]!r} is not a file")


def _check_dreambooth(cfg: FlowLoraTrainConfig) -> None:
    """The DreamBooth settings (the CLI flag named beside each)."""
    if cfg.instance_prompt is not None and not (isinstance(cfg.instance_prompt, str) and cfg.instance_prompt.strip()):
        raise ValueError(f"instance_prompt={cfg.instance_prompt!r} (--instance-prompt) is empty")
    given = [k for k in ("class_prompt", "class_data") if getattr(cfg, k) is not None]
    if cfg.with_prior_preservation is False and given:
        raise ValueError(
            f"{given[0]} (--{given[0].replace('_', '-')}) is for prior preservation, which "
            "with_prior_preservation=False (--no-with-prior-preservation) turns off"
        )
    if not cfg.prior_preservation:
        return
    if not isinstance(cfg.class_prompt, str) or not cfg.class_prompt.strip():
        raise ValueError(
            "with_prior_preservation (--with-prior-preservation) needs a class_prompt (--class-prompt), e.g. "
            "'a photo of dog'"
        )
    if not cfg.class_data:
        raise ValueError(
            "with_prior_preservation (--with-prior-preservation) needs class_data (--class-data): the class images' "
            "folder (the missing ones are drawn there)"
        )
    n = cfg.num_class_images
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_class_images={n!r} (--num-class-images) must be a positive integer")
    w = cfg.prior_loss_weight
    if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w >= 0):
        raise ValueError(f"prior_loss_weight={w!r} (--prior-loss-weight) must be a finite number >= 0")
    if cfg.class_steps is not None and (not isinstance(cfg.class_steps, int) or cfg.class_steps < 1):
        raise ValueError(f"class_steps={cfg.class_steps!r} (--class-steps) must be a positive integer")
    from sdjax.finetune.dreambooth import check_sample_batch_size

    check_sample_batch_size(cfg.sample_batch_size)
    if cfg.bucketing:
        raise ValueError(
            "bucketing with prior preservation (--with-prior-preservation): instance and class examples share a "
            "batch, so every example is cropped to resolution x resolution; add --no-bucketing (bucketing=False)"
        )
    folder = Path(cfg.class_data).expanduser()
    if folder.exists() and not folder.is_dir():
        raise data_lib.DataError(f"class_data {cfg.class_data} (--class-data) is not a folder")


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
        prior_loss_weight=float(cfg.prior_loss_weight) if cfg.prior_preservation else None,
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
    """`cfg.out` in diffusers' LoRA layout (`flow_models.peft_state_dict`; `targets`: the transformer's, or per
    component) with a few training notes."""
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
    lora_lib.save_safetensors(cfg.out, tensors, meta, run_lib.save_dtype(cfg.save_precision))


def _load(cfg: FlowLoraTrainConfig):
    import jax.numpy as jnp

    from sdjax.pipelines import load_pipeline

    dtype = jnp.bfloat16 if cfg.mixed_precision == "bf16" else jnp.float32
    files = {k: getattr(cfg, k) for k in MODEL_FILES if getattr(cfg, k) is not None}
    pipe, params = load_pipeline(cfg.model, dtype=dtype, **files)
    if cfg.max_sequence_length is not None:
        pipe.max_sequence_length = cfg.max_sequence_length
    return pipe, params, dtype


def _with_prompt(dataset: data_lib.Dataset, prompt: str) -> data_lib.Dataset:
    items = tuple(dataclasses.replace(item, caption=prompt) for item in dataset.items)
    return dataclasses.replace(dataset, items=items)


def _samplers(cfg: FlowLoraTrainConfig, session, pipe, params, resolution: int, log) -> list[data_lib.Sampler]:
    """The instance sampler (every image with `instance_prompt` when given) and, with prior preservation, the class
    images' (drawn first where missing; `class_prompt`, no caption dropout or tag shuffling); the session's mesh
    splits the [instance; class] batch."""
    from sdjax.finetune import dreambooth

    data_cfg = cfg.data_config(resolution)
    if not cfg.prior_preservation:
        dataset = session.prepare(resolution)  # buckets and the mesh
    else:  # the mesh splits the [instance; class] batch
        dataset = session.dataset = data_lib.with_buckets(session.dataset, data_cfg)
        session.mesh = run_lib._mesh(dataclasses.replace(cfg, batch_size=2 * cfg.batch_size), log)
    if cfg.instance_prompt is not None:
        dataset = session.dataset = _with_prompt(dataset, cfg.instance_prompt)
    samplers = [data_lib.Sampler(dataset, data_cfg, cfg.batch_size, cfg.seed)]
    if not cfg.prior_preservation:
        return samplers
    log(f"{len(dataset.items)} instance images ({dataset.examples_per_epoch} examples per epoch)")
    drawn = dreambooth.fill_class_images(pipe, params, cfg, resolution, log)
    class_cfg = dataclasses.replace(data_cfg, caption_dropout=0.0, shuffle_tags=False)
    classes = _with_prompt(data_lib.scan(cfg.class_data, class_cfg), cfg.class_prompt)
    log(f"{len(classes.items)} class images ({len(drawn)} drawn now), prior loss weight {cfg.prior_loss_weight}")
    samplers.append(data_lib.Sampler(classes, class_cfg, cfg.batch_size, cfg.seed + 1))
    return samplers


def row_batches(cfg: FlowLoraTrainConfig, models, frozen: dict, samplers: list, text, log):
    """`(run.RowBatches, frozen)`: micro-batches [instance; class] built row by row (a process's rows only: their
    images decoded, or their latents taken from a cache built now, `finetune.cache`; their captions' `text`
    inputs); with `cfg.cache_latents` the VAE leaves `frozen`."""
    loads = [s.load for s in samplers]
    if cfg.cache_latents:  # every view encoded once now; the VAE leaves the step
        from sdjax.finetune import cache as cache_lib

        caches = [
            cache_lib.build(s.dataset, s.cfg, models, frozen["vae"], cfg.seed + i, log) for i, s in enumerate(samplers)
        ]
        loads = [lambda micro, rows, c=c, s=s: c.batch(s, micro, rows) for c, s in zip(caches, samplers)]
        frozen = {k: v for k, v in frozen.items() if k != "vae"}
    sizes = [s.batch_size for s in samplers]

    def load(micro: int, rows: Sequence[int] | None) -> dict:
        mine = data_lib.part_rows(rows, sizes)  # [instance; class] rows as each sampler's own
        parts = [fn(micro, r) for fn, r in zip(loads, mine, strict=True) if r is None or r]
        key = "latents" if cfg.cache_latents else "pixels"
        captions = [c for p in parts for c in p["captions"]]
        return {key: np.concatenate([p[key] for p in parts]), **text(captions)}

    return run_lib.RowBatches(load, sum(sizes)), frozen


def _lora(cfg: FlowLoraTrainConfig, adapter, params: dict, log) -> tuple[dict, dict]:
    """`(lora, targets per component)`: the transformer's LoRA and with `train_text_encoder` the CLIP encoders'."""
    import jax

    from sdjax.finetune import flow_models

    key = jax.random.PRNGKey(cfg.seed)
    targets = {adapter.component: tuple(cfg.lora_layers or adapter.default_targets)}
    lora = flow_models.init_lora(key, params[adapter.component], targets[adapter.component], cfg.rank)
    if cfg.train_text_encoder:
        lora |= flow_models.init_text_lora(key, params, adapter.text_encoders, cfg.rank)
        targets |= {c: flow_models.TEXT_TARGETS for c in adapter.text_encoders}
    for c, layers in lora.items():
        log(f"LoRA on {len(layers)} layers of the {adapter.family} {c} ({', '.join(targets[c])})")
    return lora, targets


def _text(cfg: FlowLoraTrainConfig, pipe, params: dict, adapter, dtype):
    """The step's text inputs of captions: their text states, or with text-encoder LoRA their CLIP ids and T5
    states (`flow_models.TextStates`, `TextInputs`)."""
    from sdjax.finetune import flow_models

    states = flow_models.TextStates(pipe.generator.models.conditioning, params, dtype)
    return flow_models.TextInputs(states, adapter) if cfg.train_text_encoder else states


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
    from sdjax.finetune import flow, flow_models
    from sdjax.finetune import step as step_lib

    cfg = FlowLoraTrainConfig(data=str(data), out=str(out), **options)
    session = run_lib.Session.begin(cfg, on_step=on_step, log=log, stop_after=stop_after, resume_keys=_RESUME_KEYS)
    pipe, params, dtype = _load(cfg)
    adapter = flow_models.adapter_for(pipe, dtype, guidance_scale=cfg.guidance_scale, remat=cfg.gradient_checkpointing)
    resolution = cfg.resolution or pipe.default_size[0]
    _pixel_multiple(cfg, pipe, adapter, resolution)
    lora, targets = _lora(cfg, adapter, params, log)
    samplers = _samplers(cfg, session, pipe, params, resolution, log)
    objective = _objective(cfg, adapter, pipe.scheduler)
    scale = float(cfg.alpha if cfg.alpha is not None else cfg.rank) / cfg.rank
    conditioning = pipe.generator.models.conditioning
    models = flow.FlowModels(adapter, pipe.vae, dtype, scale, cfg.lora_dropout, conditioning)
    schedule, optimizer = run_lib._optimizer(cfg)
    state = step_lib.init_state(lora, optimizer)
    train_step = flow.make_flow_train_step(models, objective, optimizer)
    frozen = {c: params[c] for c in (adapter.component, "vae", *lora)}
    texts = _text(cfg, pipe, params, adapter, dtype)
    batches, frozen = row_batches(cfg, models, frozen, samplers, texts, log)

    def finish(state: dict) -> None:
        write_flow_lora(cfg, state["lora"], targets, adapter.family, len(session.dataset.items))

    validate = run_lib.lora_validator(cfg, pipe, params, resolution, log)
    return session.loop(state, frozen, train_step, batches, schedule, finish, validate=validate)
