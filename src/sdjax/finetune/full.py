"""`train_finetune`: a full fine-tune of the UNet of an SD 1.x / 2.x / XL model, as diffusers'
`examples/text_to_image/train_text_to_image.py` (and its SDXL twin), from a data folder to a diffusers folder.

- What trains: every UNet parameter. The text encoder(s) and the VAE are frozen (diffusers' example too).
- Precision: the trained weights are a float32 master copy, and so are their gradients and the AdamW moments. With
  `mixed_precision="bf16"` the loss casts the master copy to bfloat16 for the forward and backward pass (the
  UNet's compute dtype; norms and softmax stay float32 inside the model), and the frozen text encoder(s) and VAE
  are bfloat16, as accelerate's bf16 autocast with the example's `weight_dtype` does; the master copy is then read
  in float32 from the model's files (never upcast from bfloat16).
- The objective is the LoRA step's (`step.unet_loss`: epsilon / v-prediction, Min-SNR-gamma, noise offset, input
  perturbation; the same latents, noise and timesteps from `fold_in(key, micro-step)`), the optimiser optax AdamW
  (weight decay 1e-2 on every parameter, as torch's AdamW over `unet.parameters()`), global-norm clipping at
  `max_grad_norm`, warm-up, constant or cosine schedule, `accumulation` micro-batches per update. Gradient
  checkpointing is the step's `jax.checkpoint` of the UNet call; the EMA (`ema_decay`) is `finetune.ema`, stepped
  once per update, over the whole UNet (float32).
- Data parallel as `train lora`: the batch is split over the local devices, the master copy and the optimiser
  state replicated, or with `fsdp` split over the devices (`finetune.sharding`, placed by `loop.run_loop`).
- Outputs: `out` is a diffusers folder: the base model's folder (a single-file model is converted first:
  `loading.single_file.convert_to_diffusers`) with `unet/diffusion_pytorch_model.safetensors` replaced by the
  trained UNet (float32, diffusers' key layout: `models.convert.params_to_state_dict`; the EMA weights with
  `ema_decay`, as the example's `ema_unet.copy_to`), written next to `out` and moved in when complete. With
  `single_file` also one AUTOMATIC1111 / original-layout `.safetensors` file of the whole pipeline
  (`finetune.ldm_file`). The run directory (`<out>-run`) is `train lora`'s: config.json, loss.jsonl, loss.png,
  orbax checkpoints (master weights, optimiser state, step, EMA; resumed exactly), validation images.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune import run as run_lib

# Settings a resumed fine-tune must share with the run that wrote its checkpoints.
_RESUME_KEYS = (
    "model",
    "batch_size",
    "accumulation",
    "seed",
    "lr",
    "optimizer",
    *run_lib.EMA_SETTINGS,
    "cache_latents",
)
WEIGHTS = "diffusion_pytorch_model.safetensors"


@dataclasses.dataclass(frozen=True)
class FinetuneConfig(run_lib.TrainConfig):
    """Every setting of a full fine-tune (written to the run directory's config.json); `out` is a folder."""

    lr: float = 1e-5  # diffusers' README command for train_text_to_image.py (its argparse default is 1e-4)
    caption_dropout: float = 0.0
    single_file: str | None = None  # also write the pipeline as one original-layout (A1111) .safetensors file

    written: ClassVar[str] = "the fine-tuned model"
    out_suffix: ClassVar[str] = ""  # a diffusers folder
    latent_cache: ClassVar[bool] = True

    def check(self) -> None:
        """Bad settings fail here, naming the setting, before anything is loaded or compiled."""
        for name in ("steps", "batch_size", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"{name}={value!r} (--{name.replace('_', '-')}) must be a positive integer")
        out = Path(self.out).expanduser()
        if str(self.out).endswith(".safetensors") or (out.exists() and not out.is_dir()):
            raise ValueError(
                f"out={self.out}: {self.written} is written as a diffusers folder (the single file goes to "
                "--single-file)"
            )
        if self.single_file is not None and not str(self.single_file).endswith(".safetensors"):
            raise ValueError(f"single_file={self.single_file} (--single-file) must name a .safetensors file")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout={self.caption_dropout} (--caption-dropout) must be in [0, 1]")
        super().check()

    def data_config(self, resolution: int) -> data_lib.DataConfig:
        return dataclasses.replace(super().data_config(resolution), caption_dropout=self.caption_dropout)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path(str(self.out).rstrip("/\\") + "-run")


@dataclasses.dataclass
class FinetuneResult(run_lib.TrainResult):
    unet: Any = None  # the written UNet params (float32; the EMA with `ema_decay`); None when not finished


# ------------------------------------------------------------------------------------------------ the step
def unet_params_loss(master, models, objective, alphas_cumprod, inputs: dict):
    """The diffusion loss of the UNet with the float32 `master` params cast to `models.dtype` (the gradient comes
    back float32), on given `latents`, `noise`, `timesteps`, `context`, `unet_kwargs` (and `perturbation`)."""
    import jax

    from sdjax.finetune import step as step_lib

    params = jax.tree_util.tree_map(lambda p: p.astype(models.dtype), master)
    return step_lib.unet_loss(None, params, models, objective, alphas_cumprod, inputs)


def make_loss(models, objective, alphas_cumprod: np.ndarray) -> Callable:
    """`loss(master, frozen, batch, key)`: latents (the frozen VAE's, or cached), context (the frozen text
    encoders), the draws of `step.make_loss` from `key`, the diffusion loss."""
    import jax
    import jax.numpy as jnp

    from sdjax.finetune import step as step_lib

    ac = jnp.asarray(alphas_cumprod, jnp.float32)

    def loss(master, frozen, batch, key):
        k_vae, k_draw, _ = jax.random.split(key, 3)
        latents = step_lib.batch_latents(models, frozen, batch, k_vae)
        text_inputs = {k: batch[k] for k in ("ids", "clip_skip", "time_ids")}
        context, kwargs = step_lib.encode_text({}, frozen, models, text_inputs)
        draws = step_lib.draw(k_draw, latents.shape, objective)
        inputs = {"latents": latents, "context": context, "unet_kwargs": kwargs, **draws}
        return unet_params_loss(master, models, objective, ac, inputs)

    return loss


def init_state(master, optimizer) -> dict:
    import jax
    import jax.numpy as jnp

    from sdjax.finetune import step as step_lib

    master = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), master)
    return step_lib.init_state(master, optimizer, "unet")


def _load(cfg: FinetuneConfig):
    """`(pipeline, params, compute dtype)`: the model loaded in the compute dtype (an SD 1.x / 2.x / XL UNet model)."""
    return run_lib._load(cfg, "full fine-tuning")


def _models(cfg: FinetuneConfig, pipe, dtype):
    from sdjax.finetune import step as step_lib

    conditioning = pipe.generator.models.conditioning
    return step_lib.Models(conditioning, pipe.unet, pipe.vae, dtype, remat=cfg.gradient_checkpointing)


def master_unet(cfg: FinetuneConfig, params: dict, dtype, components: tuple[str, ...]):
    """The float32 master copy of the UNet: a copy of the loaded params (float32 runs; the train step donates its
    state, the pipeline keeps its own), or the UNet read again in float32 from the model's files (bf16 runs)."""
    import jax
    import jax.numpy as jnp

    if jnp.dtype(dtype) == jnp.float32:
        return jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32, copy=True), params["unet"])
    from sdjax.loading.components import load_pipeline_components
    from sdjax.loading.single_file import load_single_file
    from sdjax.models.presets import EMBEDDED_MODEL, resolve_alias

    model = resolve_alias(cfg.model or EMBEDDED_MODEL)
    skip = {c: None for c in (*components, "vae", "safety_checker", "feature_extractor", "image_encoder")}
    if os.path.isfile(model):
        _, loaded, _ = load_single_file(model, dtype=jnp.float32, overrides=skip)
    else:
        _, loaded, _ = load_pipeline_components(model, dtype=jnp.float32, overrides=skip)
    return loaded["unet"]


# ------------------------------------------------------------------------------------------------ outputs
def write_folder(out: str | Path, model: str | None, unet_params, dtype=np.float32) -> Path:
    """The base model's diffusers folder at `out` with the UNet weights replaced by `unet_params` (as `dtype`);
    built next to `out` and moved in when complete (the entries it writes replace those of an existing `out`).
    The other components are the base model's files as they are."""
    from safetensors.numpy import save_file

    from sdjax.loading.files import resolve_model_dir
    from sdjax.loading.single_file import convert_to_diffusers
    from sdjax.models.convert import params_to_state_dict
    from sdjax.models.presets import EMBEDDED_MODEL, resolve_alias

    source = resolve_alias(model or EMBEDDED_MODEL)
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        if os.path.isfile(source):
            convert_to_diffusers(source, partial, overwrite=True)
            for f in (partial / "unet").iterdir():  # the converted weights make way for the trained ones
                if f.name != "config.json":
                    f.unlink()
        else:
            folder = resolve_model_dir(source)
            for entry in folder.iterdir():
                if entry.name == "unet":
                    (partial / "unet").mkdir()
                    shutil.copyfile(entry / "config.json", partial / "unet" / "config.json")
                elif entry.is_dir():
                    shutil.copytree(entry, partial / entry.name)
                elif entry.name != ".gitattributes":
                    shutil.copyfile(entry, partial / entry.name)
        state = params_to_state_dict(unet_params, dtype=dtype)
        save_file(state, str(partial / "unet" / WEIGHTS), metadata={"format": "pt"})
        out.mkdir(parents=True, exist_ok=True)
        for entry in partial.iterdir():
            target = out / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            entry.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def write_single_file(
    path: str | Path, folder: Path, prediction_type: str, metadata: dict[str, str], dtype=np.float32
) -> Path:
    """The written diffusers `folder` (read back in float32) as one original-layout file at `path`, every
    component's weights as `dtype`."""
    import jax.numpy as jnp

    from sdjax.finetune import ldm_file
    from sdjax.loading.components import load_pipeline_components

    components, params, _ = load_pipeline_components(folder, dtype=jnp.float32)
    return ldm_file.write(path, components, params, prediction_type, dtype=dtype, metadata=metadata)


# ------------------------------------------------------------------------------------------------ the run
def train_finetune(
    data: str | Path,
    out: str | Path,
    *,
    on_step: run_lib.OnStep | None = None,
    log: Callable[[str], None] = lambda s: None,
    stop_after: int | None = None,
    **options: Any,
) -> FinetuneResult:
    """Fine-tune every UNet weight on the images of `data` and write the model as a diffusers folder `out` (and
    with `single_file` an original-layout file); `options` are `FinetuneConfig`'s fields. `stop_after` ends the run
    after that many updates of this call (checkpointed, nothing written)."""
    import jax
    import jax.numpy as jnp

    from sdjax.finetune import step as step_lib
    from sdjax.finetune import validation as validation_lib

    cfg = FinetuneConfig(data=str(data), out=str(out), **options)
    session = run_lib.Session.begin(
        cfg, on_step=on_step, log=log, stop_after=stop_after, resume_keys=_RESUME_KEYS, what="a fine-tune"
    )
    pipe, params, dtype = _load(cfg)
    resolution = cfg.resolution or pipe.default_size[0]
    data_cfg = cfg.data_config(resolution)
    dataset = session.prepare(resolution)
    objective = run_lib._objective(cfg, pipe)
    models = _models(cfg, pipe, dtype)
    components = tuple(models.conditioning.components)
    master = master_unet(cfg, params, dtype, components)
    sampler = data_lib.Sampler(dataset, data_cfg, cfg.batch_size, cfg.seed)
    frozen = {c: params[c] for c in ("vae", *components)}
    batches, frozen = run_lib._batches(cfg, models, frozen, sampler, log)
    schedule, optimizer = run_lib._optimizer(cfg)
    state = init_state(master, optimizer)
    del master
    train_step = step_lib.jit_step(make_loss(models, objective, pipe.scheduler.alphas_cumprod), optimizer, "unet")
    written: dict[str, Any] = {}

    def with_unet(unet) -> dict:
        host = jax.device_get(unet)  # the run's values live on its mesh; the pipeline's params may not
        return {**params, "unet": jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), host)}

    def finish(state: dict) -> None:
        unet = jax.device_get(state["unet"])
        dtype = run_lib.save_dtype(cfg.save_precision)
        folder = write_folder(cfg.out, cfg.model, unet, dtype)
        log(f"diffusers folder: {folder}")
        if cfg.single_file:
            meta = {"sdjax_steps": str(cfg.steps), "sdjax_model": str(cfg.model or "embedded")}
            written_file = write_single_file(cfg.single_file, folder, objective.prediction_type, meta, dtype)
            log(f"single file: {written_file}")
        written["unet"] = unet

    validate = validation_lib.make_validator(cfg, pipe, with_unet, (resolution, resolution), log)
    result = session.loop(state, frozen, train_step, batches, schedule, finish, validate=validate, trained="unet")
    return FinetuneResult(**vars(result), unet=written.get("unet"))
