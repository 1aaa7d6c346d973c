"""Compile a whole generation for a TPU slice without a TPU: will it fit, and how fast could it be?

libtpu (`pip install 'sdjax[tpu-aot]'`) has a compile-only client: `jax.experimental.topologies.get_topology_desc`
describes the devices of a slice (`v5e:2x2`: four v5e chips), a `Mesh` over them takes the params' and inputs'
shardings, and `jax.jit(...).lower(abstract inputs).compile()` runs XLA's TPU compiler on this machine. The program
is the generator's (`sdjax.core.generator.program`: text encoders -> the denoising `while` loop -> VAE decode),
lowered by `Generator.lower` from abstract params (`jax.ShapeDtypeStruct` from the model's configs: no weights are
read or allocated) placed by `sdjax.parallel.sharding`'s rules. (`Generator.run` executes the same computation as
two executables, the program up to the latents and then the VAE decode; their peak is the larger of the two
phases', which this one-program analysis does not report separately.)

What the report says, per device (one chip; on v4 libtpu's topology has one device per TensorCore, two per chip,
and each gets half the chip's HBM):
- XLA's buffer assignment (`Compiled.memory_analysis()`): arguments (params + inputs), outputs, temporaries and
  generated code; their total against the chip's HBM, the margin, fits or not. The TPU runtime keeps a little
  HBM for itself, so a small positive margin is not a guarantee.
- FLOPs and bytes accessed (`Compiled.cost_analysis()`, per device). XLA counts a `while` loop's body once, so
  one UNet call (the classifier-free-guidance batch, the loop's body) is compiled on its own on the same mesh and
  its counts are added once per further model call: `total = program + (calls - 1) * unet_call`.
- A roofline bound: `max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)` with the chip's datasheet numbers below
  (estimates: bf16 matmul peak, also used for float32, whose matmuls run slower on the MXU). Real runs are slower.

The batch is split over the mesh's `data` axis; a batch that does not divide by the chips gets a `model` axis for
the rest (`model_parallel`), over which the rules table splits attention / MLP / conv weights; so does a model whose
weights would take more than half a chip's HBM per replica (Flux.1: 33.7 GB in bf16). `fsdp=True` also splits the
large weights over `data` (`sdjax.parallel.sharding.fsdp`).

Models: the SD / SDXL presets (`sdjax.models.presets.ARCHITECTURES`), the Flux.1 presets "flux-dev" and
"flux-schnell" (`sdjax.families.flux.presets`: 1024x1024; no true CFG, as FluxPipeline runs by default), the SD 3 /
3.5 presets "sd35-large", "sd35-medium", "sd3-medium" (`sdjax.families.sd3.presets`: 1024x1024, CFG), or a diffusers
folder of any of these kinds (its configs only). The transformer families' matmul kernels (transformer and T5) can
be stored in float8 (`dtype="fp8"`: float8_e4m3fn weights, bfloat16 compute; each Dense casts its kernel where it
is used).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdjax.aot_report import GiB, Report


@dataclasses.dataclass(frozen=True)
class Chip:
    """Datasheet numbers of one TPU chip (estimates from Google Cloud's published specs)."""

    name: str
    hbm_bytes: int
    bf16_flops: float  # peak bf16 FLOP/s per chip
    hbm_bytes_per_s: float
    dims: int  # topology dimensions (2: x by y; 3: x by y by z)
    int8_ops: float  # peak int8 OP/s per chip (the MXU's int8 x int8 -> int32 products)


# Cloud TPU's system-architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e): bf16 275 / 197 / 459 / 918
# TFLOP/s and int8 275 / 394 / 918 / 1836 TOP/s per chip. v4 multiplies int8 at its bf16 rate; v5e, v5p and v6e at
# twice it. None of these chips lists an fp8 rate (fp8 products count at the bf16 rate).
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 32 * GiB, 275e12, 1200e9, 3, 275e12),
    "v5e": Chip("TPU v5e", 16 * GiB, 197e12, 819e9, 2, 394e12),
    "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2765e9, 3, 918e12),
    "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 1640e9, 2, 1836e12),
}

# Cloud slice names -> libtpu topology names. v5e / v6e names count chips; v4 / v5p names count TensorCores
# (two per chip).
SLICES: dict[str, str] = {
    "v5e-1": "v5e:1x1",
    "v5e-4": "v5e:2x2",
    "v5e-8": "v5e:2x4",
    "v5e-16": "v5e:4x4",
    "v6e-1": "v6e:1x1",
    "v6e-4": "v6e:2x2",
    "v6e-8": "v6e:2x4",
    "v6e-16": "v6e:4x4",
    "v4-8": "v4:2x2x1",
    "v4-16": "v4:2x2x2",
    "v4-32": "v4:2x2x4",
    "v5p-8": "v5p:2x2x1",
    "v5p-16": "v5p:2x2x2",
    "v5p-32": "v5p:2x2x4",
}
SLICES.update({f"v5litepod-{n}": SLICES[f"v5e-{n}"] for n in (4, 8, 16)})

INSTALL_HINT = "pip install 'sdjax[tpu-aot]'"
_TOPOLOGY = re.compile(r"(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?")


class LibtpuMissing(RuntimeError):
    """libtpu (the TPU compiler) is not installed."""


def valid_targets() -> str:
    kinds = ", ".join(f"{k} ({'AxBxC' if c.dims == 3 else 'AxB'})" for k, c in CHIPS.items())
    return f"one of {', '.join(SLICES)}, or KIND:SHAPE such as v5e:2x2 or v4:2x2x1 with KIND one of {kinds}"


def parse_target(target: str) -> tuple[str, tuple[int, ...]]:
    """`"v5e-4"` or `"v5e:2x2"` -> `("v5e", (2, 2))`; anything else -> ValueError listing the valid names."""
    name = SLICES.get(str(target).strip().lower(), str(target).strip().lower())
    m = _TOPOLOGY.fullmatch(name)
    if m is None:
        raise ValueError(f"target={target!r}: unknown TPU topology; expected {valid_targets()}")
    kind = m.group(1)
    shape = tuple(int(g) for g in m.groups()[1:] if g is not None)
    if len(shape) != CHIPS[kind].dims or min(shape) < 1:
        raise ValueError(
            f"target={target!r}: a {kind} topology has {CHIPS[kind].dims} dimensions; expected {valid_targets()}"
        )
    return kind, shape


def _require_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise LibtpuMissing(f"compiling for a TPU topology needs libtpu (the TPU compiler): {INSTALL_HINT}")
    # libtpu takes a lock file (/tmp/libtpu_lockfile) for the process that drives real chips; a compile-only
    # client drives none, so it may run beside another JAX process.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(target: str) -> tuple[str, list]:
    """The compile-only devices of `target` -> `(libtpu topology name, devices)`. Slices of up to one host's chips
    (8 for v5e / v6e, 4 for v4 / v5p) are described as one host."""
    kind, shape = parse_target(target)
    _require_libtpu()
    from jax.experimental import topologies

    name = f"{kind}:{'x'.join(map(str, shape))}"
    per_host = 8 if CHIPS[kind].dims == 2 else 4
    kwargs = {}
    if math.prod(shape) <= per_host:
        kwargs["chips_per_host_bounds"] = (*shape, 1) if len(shape) == 2 else shape
    try:
        devices = topologies.get_topology_desc(name, "tpu", **kwargs).devices
    except Exception as e:  # libtpu's own message names what it did not accept
        raise ValueError(
            f"target={target!r}: libtpu rejected topology {name!r}: {e}; expected {valid_targets()}"
        ) from e
    return name, list(devices)


# ---------------------------------------------------------------------------------------------- models
# Families whose presets live in their folder (`families/NAME/presets.py`: `ARCHITECTURES`, `Architecture`,
# `build_pipeline(arch, dtype, abstract=, weights_dtype=)`, `folder_architecture(folder)`).
PRESET_FAMILIES = ("flux", "sd3")


def _family_presets() -> dict[str, Any]:
    import importlib

    return {name: importlib.import_module(f"sdjax.families.{name}.presets") for name in PRESET_FAMILIES}


def _presets_of(arch):
    """The presets module whose `Architecture` `arch` is, or None (an SD / SDXL `Architecture`)."""
    return next((m for m in _family_presets().values() if isinstance(arch, m.Architecture)), None)


def architecture(model: str):
    """A preset name (`sdjax.models.presets.ARCHITECTURES`, or a family's: `families.flux.presets`,
    `families.sd3.presets`) or a diffusers folder -> `Architecture` or the family's architecture (configs only; no
    weights are read)."""
    from sdjax.config import read_json
    from sdjax.families import FAMILIES
    from sdjax.models.presets import ARCHITECTURES, resolve_alias

    families = _family_presets()
    if model in ARCHITECTURES:
        return ARCHITECTURES[model]
    for module in families.values():
        if model in module.ARCHITECTURES:
            return module.ARCHITECTURES[model]
    folder = Path(resolve_alias(model))
    if not (folder / "model_index.json").is_file():
        names = sorted(ARCHITECTURES) + [n for m in families.values() for n in sorted(m.ARCHITECTURES)]
        raise ValueError(
            f"model={model!r}: expected a preset ({', '.join(names)}) or a diffusers folder with model_index.json"
        )
    pipeline = str(read_json(folder / "model_index.json").get("_class_name", "")).removeprefix("Flax")
    for name, module in families.items():
        if pipeline in FAMILIES[name].model_index_classes:
            return module.folder_architecture(folder)
    return _folder_architecture(folder)


def _folder_architecture(folder: Path):
    from sdjax.config import read_json
    from sdjax.models.presets import Architecture
    from sdjax.models.unet import UNet2DConditionConfig
    from sdjax.models.vae import AutoencoderKLConfig

    index = read_json(folder / "model_index.json")

    def config(name: str, file: str = "config.json") -> dict | None:
        return read_json(folder / name / file) if name in index and (folder / name / file).is_file() else None

    unet, vae = config("unet"), config("vae")
    if unet is None or vae is None:
        raise ValueError(f"model={str(folder)!r}: needs unet/config.json and vae/config.json")
    unet_cfg = UNet2DConditionConfig.from_dict(unet, source=str(folder / "unet" / "config.json"))
    vae_cfg = AutoencoderKLConfig.from_dict(vae, source=str(folder / "vae" / "config.json"))
    scheduler = config("scheduler", "scheduler_config.json") or {"_class_name": "PNDMScheduler"}
    pipeline = str(index.get("_class_name", "StableDiffusionPipeline")).removeprefix("Flax")
    sample = unet_cfg.sample_size if isinstance(unet_cfg.sample_size, int) else unet_cfg.sample_size[0]
    settings = tuple((k, index[k]) for k in ("force_zeros_for_empty_prompt", "requires_aesthetics_score") if k in index)
    return Architecture(
        pipeline,
        config("text_encoder"),
        dataclasses.asdict(unet_cfg),
        dataclasses.asdict(vae_cfg),
        scheduler,
        sample * 2 ** (len(vae_cfg.block_out_channels) - 1),
        text_encoder_2=config("text_encoder_2"),
        settings=settings,
    )


def compile_for(
    target: str,
    *,
    model: str = "sd15",
    size: int | tuple[int, int] | None = None,
    batch: int = 1,
    steps: int = 30,
    sampler: str | None = None,
    dtype: str = "bfloat16",
    task: str = "txt2img",
    model_parallel: int | None = None,
    vae_slicing: bool = False,
    attention: str = "auto",
    controlnets: int = 0,
    unet_cost: bool = True,
    save_cache: str | os.PathLike | None = None,
    weights_dtype: str | None = None,
    fsdp: bool = False,
    quantize: str | None = None,
    quant_compute: str | None = None,
    calibration: Any = None,
    log: Callable[[str], None] = lambda s: None,
) -> Report:
    """Compile generation for `target` (a TPU slice such as `"v5e-4"` or `"v5e:2x2"`) and report memory, FLOPs
    and a roofline bound per device (module doc). `model` is a preset (`sd15`, `sd21`, `sdxl`, ..., `flux-dev`,
    `flux-schnell`, `sd35-large`, `sd35-medium`) or a diffusers folder (only its configs are read); `size` is `H` or
    `(H, W)` (default: the model's); `batch` is the global batch. `vae_slicing` decodes (and encodes) one image per chip
    at a time (`models.vae_slicing`: the VAE's activations of one image instead of the batch's). `attention` replaces
    the UNet's and VAE's attention ("chunked": query blocks, no whole score matrix; `sdjax.ops.attention`); "auto" is
    what a TPU VM traces. `controlnets` adds that many ControlNets (the architecture's own:
    `models.controlnet.config_from_unet`, as diffusers' `ControlNetModel.from_unet`) to every model call, with their
    control images as inputs; their weights are sharded by the same rules as the UNet's. `unet_cost=False` skips the
    compile of one model call (UNet + ControlNets; no loop-corrected FLOPs, bytes or roofline).
    `save_cache` writes the executable (`save_executable`) into that folder.

    `model_parallel` (devices per model replica) defaults to what the batch needs and at least what keeps one
    replica's weights under half a chip's HBM. `weights_dtype` ("float8_e4m3fn"; Flux and SD 3 models) stores
    the transformer's and T5's matmul kernels in that dtype, computed in `dtype`; `dtype="fp8"` is short for
    `dtype="bfloat16", weights_dtype="float8_e4m3fn"`. `fsdp` also splits the large weights over the data axis
    (`sdjax.parallel.sharding.fsdp`). `quantize` ("int8", "fp8"; `sdjax.quant`, as `from_pretrained(quantize=)`)
    stores the denoiser's kernels quantized with per-channel scales, dequantized inside the program (and the
    ControlNets' kernels, weight-only, as a quantized pipeline loads them: `quant.params.controlnet_policy`).
    `quant_compute` ("int8", "fp8"; needs `quantize` of the same scheme) multiplies its Dense layers and 2-D convs
    8-bit x 8-bit (`QuantPolicy(quantize, components=(denoiser,), compute=quant_compute)`, per-call input scales);
    their FLOPs are counted apart (`Report.quant_flops`) and timed at the chip's int8 rate in the roofline.
    `calibration` (with `quant_compute`: a `sdjax.quant.Calibration` or the path of its file, `sdjax calibrate`)
    gives those products static input scales, constants of the program instead of a reduction over each input;
    it is read and checked against the model's layers (paths and kernel shapes: the params are abstract) before
    anything compiles. `Calibration.placeholder_for` stands in for one in cost studies."""

    from sdjax import samplers
    from sdjax.core.tasks import TASKS
    from sdjax.parallel import sharding as sharding_lib

    _check_arguments(
        batch=batch,
        steps=steps,
        controlnets=controlnets,
        task=task,
        attention=attention,
        quantize=quantize,
        quant_compute=quant_compute,
        calibration=calibration,
    )
    if calibration is not None:
        from sdjax.quant.calibration import as_calibration

        calibration = as_calibration(calibration)
    arch, jdtype, wdtype = _model_and_dtypes(model, dtype, weights_dtype, controlnets=controlnets, quantize=quantize)
    kind, _ = parse_target(target)
    topology, devices = topology_devices(target)
    chip = CHIPS[kind]
    per_chip = len({tuple(d.coords) for d in devices})
    per_chip = len(devices) // per_chip if per_chip else 1
    n = len(devices)

    log(f"building {model} with abstract params")
    pipe, params = _abstract_pipeline(arch, jdtype, wdtype)
    if quantize:
        pipe, params = _quantized(pipe, params, quantize, quant_compute, calibration)
    weights = _nbytes({k: v for k, v in params.items() if k != "scheduler"})
    if model_parallel is None:
        model_parallel = _default_model_parallel(n, batch, weights, chip.hbm_bytes // per_chip, fsdp=fsdp)
    if model_parallel < 1 or n % model_parallel or batch % (n // model_parallel):
        raise ValueError(
            f"model_parallel={model_parallel}: must divide the {n} devices, and the batch ({batch}) must divide by "
            f"the data axis (devices / model_parallel)"
        )
    mesh = sharding_lib.make_mesh(n // model_parallel, model_parallel, devices)
    control = None
    if controlnets:
        control, params["controlnet"] = _abstract_controlnets(arch, jdtype, controlnets)
        if quantize:  # as a quantized pipeline loads them: weight-only, the denoiser's scheme
            from sdjax.quant.params import controlnet_policy, quantize_params

            params = quantize_params(params, controlnet_policy(pipe.quantization, pipe.denoiser.component))
        weights = _nbytes({k: v for k, v in params.items() if k != "scheduler"})
    dh, dw = pipe.default_size
    height, width = (size, size) if isinstance(size, int) else (size or (dh, dw))
    pipe.validate(steps=steps, height=height, width=width, sampler=sampler)
    gen = pipe.generator
    sampler_obj = pipe._sampler(sampler)
    gen.vae_slicing = vae_slicing
    if attention != "auto":
        gen.set_attention(attention)
    cfg = getattr(arch, "cfg", True)  # Flux: no true CFG (FluxPipeline's default); SD / SDXL / SD 3: CFG
    spec = gen.spec(
        task=TASKS[task](),
        batch=batch,
        height=height,
        width=width,
        steps=steps,
        sampler=sampler_obj,
        cfg=cfg,
        mesh=mesh,
        features=() if control is None else (control,),
    )
    calls = int(sampler_obj.num_model_calls(steps))

    log(f"compiling the whole generation for {topology} ({n} devices)")
    cost = _compile_with_cost(
        gen, spec, params, mesh, fsdp=fsdp, unet_cost=unet_cost, calls=calls, log=log, quant_compute=quant_compute
    )
    compiled = cost.pop("compiled")
    saved = None
    if save_cache is not None and compiled is not None:
        saved = str(save_executable(compiled, save_cache, f"{model}-{topology}-{height}x{width}-b{batch}-s{steps}"))
    return Report(
        target=str(target),
        topology=topology,
        chip=chip.name,
        chips=n // per_chip,
        devices=n,
        mesh=dict(mesh.shape),
        model=str(model),
        pipeline=type(pipe).__name__,
        task=task,
        dtype=jdtype.name,
        height=height,
        width=width,
        batch=batch,
        steps=steps,
        sampler=sampler or samplers.name_of(pipe.scheduler),
        model_calls=calls,
        weights_bytes=weights,
        hbm_bytes=chip.hbm_bytes // per_chip,
        **cost,
        peak_flops=chip.bf16_flops / per_chip,
        hbm_bytes_per_s=chip.hbm_bytes_per_s / per_chip,
        saved=saved,
        vae_slicing=bool(vae_slicing),
        attention=attention,
        controlnets=controlnets,
        weights_dtype=None if wdtype is None else wdtype.name,
        fsdp=bool(fsdp),
        cfg=cfg,
        quantize=quantize or None,
        quant_compute=quant_compute or None,
        quant_peak_flops=(chip.int8_ops if quant_compute == "int8" else chip.bf16_flops) / per_chip
        if quant_compute
        else None,
        calibration=None if calibration is None else _calibration_name(calibration),
    )


def _calibration_name(calibration) -> str:
    """How a report names its calibration: "placeholder", the file it was read from, or "in memory"."""
    return "placeholder" if calibration.placeholder else (calibration.source or "in memory")


def abstract_pipeline(
    model: str, dtype: str = "bfloat16", *, quantize: str | None = None, quant_compute: str | None = None
):
    """`(pipeline, abstract params)` as `compile_for` builds them for `model` (a preset or a diffusers folder) in
    `dtype`, with its denoiser quantized as `quantize` / `quant_compute` say (`pipe.quantization`: the policy)."""
    fixed = dict(batch=1, steps=1, controlnets=0, task="txt2img", attention="auto")
    _check_arguments(**fixed, quantize=quantize, quant_compute=quant_compute)
    arch, jdtype, wdtype = _model_and_dtypes(model, dtype, None, controlnets=0, quantize=quantize)
    pipe, params = _abstract_pipeline(arch, jdtype, wdtype)
    return _quantized(pipe, params, quantize, quant_compute) if quantize else (pipe, params)


def _model_and_dtypes(model: str, dtype: str, weights_dtype: str | None, *, controlnets: int, quantize):
    """`(architecture, compute dtype, float8 weights dtype or None)` of `compile_for`'s model and dtype arguments
    (`dtype="fp8"`: bfloat16 compute with float8 weights); a ValueError naming a combination sdjax cannot build."""
    import jax.numpy as jnp

    from sdjax.precision import resolve_dtype

    if str(dtype).lower() in FP8_NAMES:
        dtype, weights_dtype = "bfloat16", weights_dtype or "float8_e4m3fn"
    jdtype = jnp.dtype(resolve_dtype(dtype))
    wdtype = _weights_dtype(weights_dtype)
    arch = architecture(model)
    family = _presets_of(arch)
    if family is not None and controlnets:
        raise ValueError(f"controlnets={controlnets}: sdjax has no ControlNet for {model!r}; compile it without")
    if wdtype is not None and family is None:
        raise ValueError(f"weights_dtype={weights_dtype!r}: float8 weights are implemented for Flux and SD 3 only")
    if wdtype is not None and quantize:
        raise ValueError(
            f"quantize={quantize!r} with weights_dtype={weights_dtype!r} (or dtype='fp8'): both store the weights "
            "in 8 bits; give one"
        )
    return arch, jdtype, wdtype


def _quantized(pipe, params, quantize: str, quant_compute: str | None, calibration=None):
    """The abstract pipeline with its denoiser's kernels quantized (and, with `quant_compute`, its Dense layers and
    convs multiplying 8-bit x 8-bit, with `calibration`'s static input scales), as `from_pretrained(quantize=)`
    builds it; a calibration of another model is refused there (`Calibration.check`)."""
    from sdjax.quant import QuantPolicy, quantize_pipeline

    policy = quantize
    if quant_compute:
        component = pipe.denoiser.component
        policy = QuantPolicy(quantize, components=(component,), compute=quant_compute, calibration=calibration)
    return quantize_pipeline(pipe, params, policy)


def _check_arguments(
    *, batch, steps, controlnets, task, attention, quantize, quant_compute=None, calibration=None
) -> None:
    """`compile_for`'s arguments that need no model: a ValueError naming the first bad one."""
    from sdjax.core.tasks import TASKS
    from sdjax.models.layers import ATTENTION_IMPLEMENTATIONS
    from sdjax.quant import check_quantize

    check_quantize(quantize)
    if quant_compute is not None:
        if quant_compute not in ("int8", "fp8"):
            raise ValueError(f"quant_compute={quant_compute!r}: expected 'int8', 'fp8' or None (weight-only)")
        if quantize != quant_compute:
            raise ValueError(
                f"quant_compute={quant_compute!r} needs quantize={quant_compute!r} (the kernels stored in the type "
                f"the Dense layers and convs multiply in); quantize is {quantize!r}"
            )
    if calibration is not None and quant_compute is None:
        raise ValueError(
            "calibration= holds the input scales of 8-bit products: give quant_compute= (and quantize=) with it"
        )
    for name, value in (("batch", batch), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    if isinstance(controlnets, bool) or not isinstance(controlnets, int) or not 0 <= controlnets <= 8:
        raise ValueError(f"controlnets={controlnets!r}: expected an integer in [0, 8]")
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {sorted(TASKS)}")
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_IMPLEMENTATIONS}")


def _compile_with_cost(
    gen, spec, params, mesh, *, fsdp: bool, unet_cost: bool, calls: int, log, quant_compute: str | None = None
) -> dict[str, Any]:
    """Compile the whole program (an out-of-memory refusal is kept as `error`, with the bytes its message names)
    and, with `unet_cost`, one model call for the loop-corrected FLOPs and bytes -> the compiled executable
    (`"compiled"`, None when refused) and the `Report` fields of memory, time and cost. With `quant_compute`, the
    model call's 8-bit x 8-bit FLOPs are counted from its jaxpr too (`quant.compute.quantized_flops`); the
    denoiser is the program's only quantized component, so the generation has `calls` times them."""
    import contextlib

    from sdjax.parallel import sharding as sharding_lib

    def layout():  # the params' layout while tracing (each `with` needs a fresh context manager)
        return sharding_lib.fsdp() if fsdp else contextlib.nullcontext()

    t0 = time.perf_counter()
    compiled = error = None
    try:
        with layout():
            compiled = gen.lower(spec, params=params, mesh=mesh).compile()
    except Exception as e:  # the TPU compiler refuses a program that needs more HBM than the chip has
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        error = str(e).strip()
    compile_s = time.perf_counter() - t0
    required, available = _oom_bytes(error) if error else (None, None)
    memory = compiled.memory_analysis() if compiled is not None else None
    program_flops, program_bytes = _cost(compiled) if compiled is not None else (None, None)

    unet_flops = unet_bytes = unet_s = unet_quant = None
    if unet_cost and compiled is not None:
        log("compiling one model call (the loop's body) for its FLOPs and bytes")
        t0 = time.perf_counter()
        counts = {} if quant_compute else None
        with layout():
            unet_flops, unet_bytes = _cost(_compile_unet_call(gen, spec, params, mesh, quant_flops=counts))
        unet_s = time.perf_counter() - t0
        unet_quant = counts[quant_compute] if quant_compute else None
    loop_extra = calls - 1
    return dict(
        unet_call_quant_flops=unet_quant,
        quant_flops=None if unet_quant is None else calls * unet_quant,
        compiled=compiled,
        **_memory_fields(memory),
        compile_s=compile_s,
        unet_compile_s=unet_s,
        program_flops=program_flops,
        unet_call_flops=unet_flops,
        flops=program_flops + loop_extra * unet_flops if None not in (program_flops, unet_flops) else None,
        bytes_accessed=program_bytes + loop_extra * unet_bytes if None not in (program_bytes, unet_bytes) else None,
        error=error,
        required_bytes=required,
        available_bytes=available,
    )


FP8_NAMES = ("fp8", "float8", "float8_e4m3fn")  # `dtype` names meaning float8 weights, bfloat16 compute
WEIGHTS_DTYPES = ("float8_e4m3fn",)


def _weights_dtype(name: str | None):
    import jax.numpy as jnp

    if name is None:
        return None
    if str(name).lower() in FP8_NAMES:
        return jnp.dtype(jnp.float8_e4m3fn)
    raise ValueError(f"weights_dtype={name!r}: expected one of {WEIGHTS_DTYPES} (or None: the params' dtype)")


def _abstract_pipeline(arch, dtype, weights_dtype):
    """The architecture's pipeline with abstract params (SD / SDXL presets, or a family's: Flux.1, SD 3)."""
    from sdjax.pipelines.presets import build_pipeline

    family = _presets_of(arch)
    if family is not None:
        return family.build_pipeline(arch, dtype, abstract=True, weights_dtype=weights_dtype)
    return build_pipeline(arch, dtype, abstract=True)


def _default_model_parallel(devices: int, batch: int, weights_bytes: int, hbm_bytes: int, *, fsdp: bool) -> int:
    """Devices per model replica: what the batch needs (the batch divides by the rest), and more while one replica's
    share of the weights (divided by the data axis too with FSDP) would exceed half a device's HBM."""
    model_parallel = devices // math.gcd(batch, devices)
    for m in range(model_parallel, devices + 1, model_parallel):
        if devices % m:
            continue
        split = m * (devices // m if fsdp else 1)
        if weights_bytes / split <= hbm_bytes / 2:
            return m
    return devices


_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "code_bytes": "generated_code_size_in_bytes",
}


def _memory_fields(memory) -> dict[str, int | None]:
    return {k: None if memory is None else int(getattr(memory, v)) for k, v in _MEMORY_FIELDS.items()}


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# libtpu's messages: "the total memory required for HLO temporaries (17.89G) exceeds available HBM (15.75G)",
# "Used 20.50G of 15.75G hbm."
_OOM = (
    re.compile(r"required[^(]*\(([\d.]+)([KMGT]?)\)[^(]*available HBM \(([\d.]+)([KMGT]?)\)"),
    re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
)


def _oom_bytes(message: str) -> tuple[int | None, int | None]:
    """(required, available) bytes from the TPU compiler's out-of-memory message, where it says them."""
    for pattern in _OOM:
        m = pattern.search(message)
        if m:
            a, ua, b, ub = m.groups()
            return int(float(a) * _UNITS[ua]), int(float(b) * _UNITS[ub])
    return None, None


def _abstract_controlnets(arch, dtype, count: int):
    """`count` ControlNets made from the architecture's UNet config -> (ControlSpec, abstract param trees)."""
    import jax

    from sdjax.families.sd.controlnet import ControlSpec
    from sdjax.models.controlnet import ControlNetConfig, ControlNetModel, config_from_unet

    config = config_from_unet(arch.unet)
    # The control image is at the image's size: its embedding downsamples by the VAE's factor (8 with the
    # default 4 stages; the small test architectures' VAEs have fewer levels, so their nets fewer stages).
    stages = len(arch.vae["block_out_channels"])
    default = ControlNetConfig.conditioning_embedding_out_channels
    if stages != len(default):
        config["conditioning_embedding_out_channels"] = default[:stages]
    net = ControlNetModel(ControlNetConfig.from_dict(config, source="controlnet"), dtype=dtype)
    tree = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype), ControlNetModel.init_params_shape(net.config)
    )
    return ControlSpec(nets=(net,) * count), (tree,) * count


def _compile_unet_call(gen, spec, params, mesh, quant_flops: dict | None = None):
    """One model call of the loop's body (the CFG-doubled batch; with the spec's ControlNets, their residuals
    too) compiled on `mesh` with the program's shardings. `quant_flops` (a dict) receives the call's 8-bit x 8-bit
    FLOPs per device and mode (`quant.compute.quantized_flops` of its jaxpr, which is the whole batch's:
    divided by the device count)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from sdjax.core import features as feature_lib
    from sdjax.core.loop import merge_kwargs
    from sdjax.parallel import sharding as sharding_lib

    models = gen.models
    params = gen.check_params(params, features=spec.features)
    specs = sharding_lib.param_specs(params, mesh)
    placed = jax.tree_util.tree_map(
        lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, p)), params, specs
    )
    example = gen.example_inputs(spec)
    cond = jax.eval_shape(lambda p, i: models.conditioning.encode(p, i, cfg=spec.cfg), params, example)
    rows = 2 * spec.batch if spec.cfg else spec.batch
    f = models.vae_scale_factor
    batch = sharding_lib.batch_sharding(mesh)

    def sharded(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch)

    x = jax.ShapeDtypeStruct(
        (rows, int(models.denoiser.in_channels), spec.height // f, spec.width // f), models.dtype, sharding=batch
    )
    t = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=batch)

    calls = int(spec.sampler.num_model_calls(spec.steps))
    names = feature_lib.example_inputs(
        spec.features, batch=spec.batch, height=spec.height, width=spec.width, calls=calls
    )
    control_inputs = {k: example[k] for k in names}
    channels = int(models.vae.config.latent_channels)

    def call(p, x, t, c, ctl):
        # the features' arguments (ControlNets: the nets' residuals), as the program's hooks add them at step 0
        hooks = [f.hook(p[f.params_key], ctl, cond=c, cfg=spec.cfg, latent_channels=channels) for f in spec.features]
        extra = merge_kwargs(hooks, 0, x, t)
        inputs = {"guidance": jnp.ones((rows,), jnp.float32)}
        return models.denoiser.bind(p, c, inputs, cfg=spec.cfg)(x, t, **extra)

    abstract = jax.tree_util.tree_map(sharded, (cond, control_inputs))
    from sdjax.ops import attention as ops_attention

    with ops_attention.lowering_for(mesh.devices.flat[0].platform, mesh):  # the slice's attention choice
        traced = jax.jit(call).trace(placed, x, t, *abstract)
        if quant_flops is not None:
            from sdjax.quant.compute import quantized_flops

            n = mesh.devices.size
            quant_flops.update({k: v / n for k, v in quantized_flops(traced.jaxpr).items()})
        return traced.lower().compile()


def _cost(compiled) -> tuple[float | None, float | None]:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None, None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    flops, nbytes = cost.get("flops"), cost.get("bytes accessed")
    return (float(flops) if flops is not None else None, float(nbytes) if nbytes is not None else None)


def _nbytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


# ---------------------------------------------------------------------------------------------- saving
def save_executable(compiled, folder: str | os.PathLike, name: str) -> Path:
    """Write `compiled` with `jax.experimental.serialize_executable` -> `folder/name.jaxexec` (a pickle of the
    executable, its input and output tree structures, and the JAX / libtpu versions it was built with).

    Loading it (`load_executable`) needs the same JAX and libtpu versions and a TPU slice of the same topology;
    loading runs pickle, so load only files you made."""
    import pickle

    import jax
    from jax.experimental import serialize_executable

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    path = folder / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.jaxexec"
    meta = {"jax": jax.__version__, "libtpu": _libtpu_version()}
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump({"meta": meta, "payload": payload, "in_tree": in_tree, "out_tree": out_tree}, f)
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps(meta))
    return path


def load_executable(path: str | os.PathLike, backend: str = "tpu"):
    """The `jax.stages.Compiled` saved by `save_executable`, loaded onto `backend`'s devices (a TPU slice of the
    topology it was compiled for). Runs pickle: load only files you made."""
    import pickle

    from jax.experimental import serialize_executable

    with open(path, "rb") as f:
        saved = pickle.load(f)  # only files this user wrote (see the docstring)
    return serialize_executable.deserialize_and_load(
        saved["payload"], saved["in_tree"], saved["out_tree"], backend=backend
    )


def _libtpu_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libtpu")
    except PackageNotFoundError:
        return None
