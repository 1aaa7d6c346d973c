"""One training step compiled for a TPU slice on a machine without a TPU: does a fine-tune fit the chips?

The step is the one `sdjax train` runs, built by the trainers' own functions from the released configs with abstract
params (`jax.ShapeDtypeStruct`: no weight is read or allocated):

- `lora` of an SD 1.x / 2.x / XL model: `run._lora_step` (the UNet LoRA merged into the frozen kernels, AdamW,
  the VAE encode and the text encoder(s) inside the step; `step.make_train_step`);
- `full` fine-tune of such a UNet: `full.make_loss` under `step.jit_step(..., "unet")` with `full.init_state`'s
  float32 master copy and AdamW moments;
- `lora` of Flux.1 / SD 3: `flow.make_flow_train_step` with the family adapter (`flow_models.adapter_for`; the
  text states are inputs of the step, as `flow_run` feeds them).

`mixed_precision="bf16"` is the trainers' bf16 (frozen weights and compute bfloat16; the LoRA, a full fine-tune's
master copy, gradients and moments float32); `remat` is `--gradient-checkpointing` (the UNet call's
`jax.checkpoint`, Flux / SD 3's per-block remat). The global batch is `per_chip x chips`, split over the mesh's
`data` axis; the weights are replicated (`loop.run_loop`'s layout) or, with `fsdp`, laid out by
`finetune.sharding` (large frozen weights, and a full fine-tune's master copy and moments, split over `data`).

The compile is `sdjax.aot`'s: libtpu's compile-only devices of the slice (`aot.topology_devices`), attention traced
for the TPU (`ops.attention.lowering_for`), `lower(...).compile()`, then XLA's buffer assignment
(`memory_analysis()`: arguments, outputs, aliases of the donated state, temporaries, generated code; total =
arguments + outputs - aliases + temporaries + code) per chip against its HBM, and `cost_analysis()`'s FLOPs per chip.
A program the compiler refuses for lack of HBM is reported with the bytes its message names.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

METHODS = ("lora", "full")
MIXED_PRECISION = ("no", "bf16")


@dataclasses.dataclass(frozen=True)
class TrainCase:
    """What to compile: a preset model (`aot.architecture` names: sd15, sd21, sdxl, flux-dev, sd35-large, ...,
    tiny, flux-tiny), the method, the square image size, the batch per chip and the trainer's settings."""

    model: str
    method: str = "lora"
    size: int | None = None  # default: the model's native size
    per_chip: int = 1
    remat: bool = False
    fsdp: bool = False
    mixed_precision: str = "bf16"
    rank: int = 8
    cache_latents: bool = False  # latents as inputs (`--cache-latents`): no VAE in the step
    fsdp_min_size: int | None = None  # None: `parallel.sharding.FSDP_MIN_SIZE`

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: expected one of {METHODS}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: expected one of {MIXED_PRECISION}")
        for name in ("per_chip", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        if self.size is not None and (self.size < 8 or self.size % 8):
            raise ValueError(f"size={self.size!r}: expected a positive multiple of 8")


@dataclasses.dataclass
class BuiltStep:
    """A step and its arguments: `train_step(state, frozen, batch, key)`; `state`, `frozen` arrays or shape
    structs, `batch` host-shaped structs (global batch)."""

    train_step: Callable
    state: dict
    frozen: dict
    batch: dict
    trained: str
    family: str
    size: int = 0  # the image side


def _struct(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _abstract_pipeline(model: str, dtype):
    """`(pipeline, abstract params, family)` of a preset or diffusers folder (configs only)."""
    from sdjax import aot

    arch = aot.architecture(model)
    presets = aot._presets_of(arch)
    if presets is None:
        from sdjax.pipelines.presets import build_pipeline

        pipe, params = build_pipeline(arch, dtype, abstract=True)
        return pipe, params, "sd"
    pipe, params = presets.build_pipeline(arch, dtype, abstract=True)
    return pipe, params, presets.__name__.split(".")[-2]


def _pixels(n: int, size: int):
    import jax.numpy as jnp

    return _struct((n, 3, size, size), jnp.float32)


def _latents(pipe, n: int, size: int):
    import jax.numpy as jnp

    factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    return _struct((n, int(pipe.vae.config.latent_channels), size // factor, size // factor), jnp.float32)


def _sd_batch(pipe, n: int, size: int, cache_latents: bool) -> dict:
    """`run._inputs`' arrays for `n` examples: pixels (or cached latents), token ids, clip skip, SDXL time ids."""
    import jax.numpy as jnp
    import numpy as np

    ids = np.asarray(pipe.generator.models.conditioning.tokenize([""] * n), np.int32)
    images = {"latents": _latents(pipe, n, size)} if cache_latents else {"pixels": _pixels(n, size)}
    return {
        **images,
        "ids": _struct(ids.shape, jnp.int32),
        "clip_skip": _struct((n,), jnp.int32),
        "time_ids": _struct((n, 6), jnp.float32),
    }


def _sd_lora(case: TrainCase, pipe, params, dtype, n: int, size: int) -> BuiltStep:
    from sdjax.finetune import run as run_lib

    cfg = run_lib.LoraTrainConfig(
        data="-",
        out="-.safetensors",
        rank=case.rank,
        mixed_precision=case.mixed_precision,
        gradient_checkpointing=case.remat,
    )
    objective = run_lib._objective(cfg, pipe)
    frozen, state, train_step, _ = run_lib._lora_step(cfg, pipe, params, dtype, objective)
    if case.cache_latents:
        frozen = {k: v for k, v in frozen.items() if k != "vae"}
    return BuiltStep(train_step, state, frozen, _sd_batch(pipe, n, size, case.cache_latents), "lora", "sd")


def _sd_full(case: TrainCase, pipe, params, dtype, n: int, size: int) -> BuiltStep:
    import jax
    import jax.numpy as jnp

    from sdjax.finetune import full
    from sdjax.finetune import run as run_lib
    from sdjax.finetune import step as step_lib

    cfg = full.FinetuneConfig(
        data="-", out="-", mixed_precision=case.mixed_precision, gradient_checkpointing=case.remat
    )
    objective = run_lib._objective(cfg, pipe)
    models = full._models(cfg, pipe, dtype)
    master = jax.tree_util.tree_map(lambda x: _struct(x.shape, jnp.float32), params["unet"])
    _, optimizer = run_lib._optimizer(cfg)
    state = jax.eval_shape(lambda m: full.init_state(m, optimizer), master)
    train_step = step_lib.jit_step(full.make_loss(models, objective, pipe.scheduler.alphas_cumprod), optimizer, "unet")
    components = tuple(models.conditioning.components)
    frozen = {c: params[c] for c in (() if case.cache_latents else ("vae",)) + components}
    return BuiltStep(train_step, state, frozen, _sd_batch(pipe, n, size, case.cache_latents), "unet", "sd")


def _flow_lora(case: TrainCase, pipe, params, dtype, n: int, size: int, family: str) -> BuiltStep:
    import jax

    from sdjax.finetune import flow, flow_models, flow_run
    from sdjax.finetune import run as run_lib
    from sdjax.finetune import step as step_lib

    cfg = flow_run.FlowLoraTrainConfig(
        data="-",
        out="-.safetensors",
        rank=case.rank,
        mixed_precision=case.mixed_precision,
        gradient_checkpointing=case.remat,
    )
    adapter = flow_models.adapter_for(pipe, dtype, guidance_scale=cfg.guidance_scale, remat=case.remat)
    component = adapter.component
    lora = flow_models.init_lora(jax.random.PRNGKey(cfg.seed), params[component], adapter.default_targets, cfg.rank)
    objective = flow_run._objective(cfg, adapter, pipe.scheduler)
    scale = float(cfg.alpha if cfg.alpha is not None else cfg.rank) / cfg.rank
    models = flow.FlowModels(adapter, pipe.vae, dtype, scale, cfg.lora_dropout)
    _, optimizer = run_lib._optimizer(cfg)
    state = step_lib.init_state(lora, optimizer)
    train_step = flow.make_flow_train_step(models, objective, optimizer)
    frozen = {component: params[component]} | ({} if case.cache_latents else {"vae": params["vae"]})
    text = jax.eval_shape(
        lambda p, i: pipe.generator.models.conditioning.encode(p, i, cfg=False),
        {c: params[c] for c in pipe.generator.models.conditioning.components},
        _flow_text_inputs(pipe),
    )
    images = {"latents": _latents(pipe, n, size)} if case.cache_latents else {"pixels": _pixels(n, size)}
    batch = {
        **images,
        "text": _struct((n, *text["text"].shape[1:]), dtype),
        "pooled": _struct((n, *text["pooled"].shape[1:]), dtype),
    }
    return BuiltStep(train_step, state, frozen, batch, "lora", family)


def _flow_text_inputs(pipe) -> dict:
    """One caption's text inputs, as `flow_models.TextStates` builds them (for the states' shapes)."""
    import numpy as np

    conditioning = pipe.generator.models.conditioning
    inputs = {k: v for k, v in conditioning.text_inputs([""], [""]).items() if not k.startswith("neg_")}
    if getattr(conditioning, "name", "") == "flux":
        inputs["embedded_guidance"] = np.zeros((1,), np.float32)
    return inputs


def build(case: TrainCase, data: int) -> BuiltStep:
    """The trainer's step of `case` for a `data`-way data-parallel mesh (global batch `per_chip x data`)."""
    import jax.numpy as jnp

    case.check()
    dtype = jnp.bfloat16 if case.mixed_precision == "bf16" else jnp.float32
    pipe, params, family = _abstract_pipeline(case.model, dtype)
    size = case.size or int(pipe.default_size[0])
    n = case.per_chip * data
    if family == "sd":
        make = _sd_lora if case.method == "lora" else _sd_full
        built = make(case, pipe, params, dtype, n, size)
    elif case.method != "lora":
        raise ValueError(f"method={case.method!r}: {case.model} ({family}) trains LoRAs only (full: SD 1.x / 2.x / XL)")
    else:
        built = _flow_lora(case, pipe, params, dtype, n, size, family)
    return dataclasses.replace(built, size=size)


def _nbytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def lower_step(built: BuiltStep, mesh, *, fsdp: bool, fsdp_min_size: int | None = None):
    """`(lowered step, Layout)` on `mesh`: the trainer's own `jit` with every argument replicated but the batch
    (`fsdp=False`, what `loop.run_loop` places), or `finetune.sharding`'s FSDP layout's re-jit (`fsdp=True`)."""
    import jax
    import jax.numpy as jnp

    from sdjax.finetune import sharding as train_sharding
    from sdjax.ops import attention as ops_attention

    kw = {} if fsdp_min_size is None else {"min_size": fsdp_min_size}
    lay = train_sharding.layout(mesh, built.state, built.frozen, trained=built.trained, fsdp=fsdp, **kw)
    state, frozen = lay.abstract(built.state, built.frozen)
    batch = lay.abstract_batch(built.batch)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=lay.replicated)
    step = lay.step(built.train_step) if fsdp else built.train_step
    with ops_attention.lowering_for(mesh.devices.flat[0].platform, mesh):  # the slice's attention choice
        return step.lower(state, frozen, batch, key), lay


def compile_case(case: TrainCase, target: str, *, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Compile `case`'s step for the TPU slice `target` (`"v5e-8"`, `"v6e:2x4"`, ...) -> a JSON-able row: the
    case, the slice, the bytes (weights, trained values, optimiser state, what the layout puts on one chip) and
    XLA's memory analysis per chip against the chip's HBM, the verdict, compile seconds and FLOPs per chip."""
    from sdjax import aot
    from sdjax.finetune import sharding as train_sharding
    from sdjax.parallel import sharding as sharding_lib

    case.check()
    kind, _ = aot.parse_target(target)
    topology, devices = aot.topology_devices(target)
    chip = aot.CHIPS[kind]
    chips = len({tuple(d.coords) for d in devices}) or 1
    per_chip_devices = len(devices) // chips
    mesh = sharding_lib.make_mesh(len(devices), 1, devices)
    log(f"building the {case.method} step of {case.model} (abstract params)")
    built = build(case, len(devices))
    log(f"compiling for {topology} ({len(devices)} devices{', FSDP' if case.fsdp else ''})")
    t0 = time.perf_counter()
    lowered, lay = lower_step(built, mesh, fsdp=case.fsdp, fsdp_min_size=case.fsdp_min_size)
    compiled = error = None
    try:
        compiled = lowered.compile()
    except Exception as e:  # the TPU compiler refuses a program that needs more HBM than a chip has
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        error = str(e).strip()
    compile_s = time.perf_counter() - t0
    memory = aot._memory_fields(compiled.memory_analysis() if compiled is not None else None)
    flops, bytes_accessed = aot._cost(compiled) if compiled is not None else (None, None)
    required, available = aot._oom_bytes(error) if error else (None, None)
    hbm = chip.hbm_bytes // per_chip_devices
    total = None
    if memory["argument_bytes"] is not None:
        m = memory
        total = m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"] + m["code_bytes"]
    elif required is not None:
        total = required
    fits = error is None and total is not None and total <= hbm
    return {
        **dataclasses.asdict(case),
        "size": built.size,
        "family": built.family,
        "target": str(target),
        "topology": topology,
        "chip": chip.name,
        "chips": chips,
        "devices": len(devices),
        "mesh": dict(mesh.shape),
        "batch": int(next(iter(built.batch.values())).shape[0]),
        "frozen_bytes": _nbytes(built.frozen),
        "trained_bytes": _nbytes(built.state[built.trained]),
        "state_bytes": _nbytes(built.state),
        "placed_state_bytes": train_sharding.bytes_per_device(built.state, lay.state),
        "placed_frozen_bytes": train_sharding.bytes_per_device(built.frozen, lay.frozen),
        **memory,
        "total_bytes": total,
        "hbm_bytes": hbm,
        "margin_bytes": None if total is None else hbm - total,
        "fits": fits,
        "error": error[:2000] if error else None,
        "required_bytes": required,
        "available_bytes": available,
        "compile_s": round(compile_s, 1),
        "flops": flops,
        "bytes_accessed": bytes_accessed,
    }
