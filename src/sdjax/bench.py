"""`sdjax bench`: one text-to-image workload timed piece by piece, with XLA's FLOP counts, memory and MFU.

What is measured (each piece compiled ahead of time with `jit(...).lower(...).compile()`, so compile time is
apart from run time; run times are the median and best of `reps` calls after one warm call):

- `text`: the text encoder(s) on the stacked (negative, prompt) batch, `2B x 77` tokens;
- `unet`: one UNet call on `2B` latents (classifier-free guidance doubles the batch), i.e. one sampler step;
- `decode`: the VAE decoder on `B` latents;
- `e2e`: the whole generation as the pipeline runs it (`pipeline.aot_compile`: encode -> `fori_loop` over the
  sampler -> decode), giving end-to-end latency and images/s.

FLOPs come from XLA's cost analysis of each compiled piece; the end-to-end count is `text + steps * unet +
decode` (cost analysis counts a `while` loop's body once). MFU divides achieved FLOP/s by a matmul rate measured
in the same process (`dtype`, largest square matmul that is quick on the device), not by a datasheet. Peak memory
is the device allocator's peak on GPU/TPU; on CPU, XLA's buffer assignment for the end-to-end executable
(arguments + outputs + temporaries) and the process's peak RSS.

Models: a diffusers folder or Hub id (`model`), the embedded model (default), or a full-size architecture with
random weights built from the released configs (`arch`: sd15, sd21, sdxl; `tiny` for tests) -- nothing to
download. `memory_only` compiles the end-to-end executable against abstract params (`jax.ShapeDtypeStruct`),
allocates no weights and reports XLA's memory analysis: how much a workload needs before buying the memory.

With `torch=True` the same workload runs in PyTorch diffusers (same architecture, same dtype, random weights of
its own, in a subprocess after the JAX part so both never hold weights at once) and the table gets the ratios
`sdjax / torch` (< 1: sdjax faster). torch and diffusers are needed only for that.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------- architectures
# The released configs (config.json keys of diffusers / transformers); weights are random.
_BETAS = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
)
_CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    projection_dim=768,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
_SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    norm_num_groups=32,
    sample_size=512,
    act_fn="silu",
    scaling_factor=0.18215,
)
_SD_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768,
    attention_head_dim=8,
    norm_num_groups=32,
    act_fn="silu",
    flip_sin_to_cos=True,
    freq_shift=0,
    downsample_padding=1,
    mid_block_scale_factor=1,
    norm_eps=1e-5,
)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A pipeline's component configs (diffusers / transformers keys) and its native image size."""

    pipeline: str  # model_index.json `_class_name`
    text_encoder: dict
    unet: dict
    vae: dict
    scheduler: dict  # with `_class_name`
    size: int
    text_encoder_2: dict | None = None


ARCHITECTURES: dict[str, Architecture] = {
    # stable-diffusion-v1-5/stable-diffusion-v1-5
    "sd15": Architecture(
        "StableDiffusionPipeline",
        _CLIP_L,
        _SD_UNET,
        _SD_VAE,
        {"_class_name": "PNDMScheduler", **_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False},
        512,
    ),
    # stabilityai/stable-diffusion-2-1 (768 px, v-prediction, OpenCLIP ViT-H text tower)
    "sd21": Architecture(
        "StableDiffusionPipeline",
        dict(
            _CLIP_L,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=23,
            num_attention_heads=16,
            hidden_act="gelu",
            projection_dim=512,
        ),
        dict(
            _SD_UNET,
            sample_size=96,
            attention_head_dim=(5, 10, 20, 20),
            cross_attention_dim=1024,
            use_linear_projection=True,
            upcast_attention=True,
        ),
        dict(_SD_VAE, sample_size=768),
        {
            "_class_name": "DDIMScheduler",
            **_BETAS,
            "clip_sample": False,
            "set_alpha_to_one": False,
            "prediction_type": "v_prediction",
        },
        768,
    ),
    # stabilityai/stable-diffusion-xl-base-1.0
    "sdxl": Architecture(
        "StableDiffusionXLPipeline",
        _CLIP_L,
        dict(
            sample_size=128,
            in_channels=4,
            out_channels=4,
            layers_per_block=2,
            block_out_channels=(320, 640, 1280),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            cross_attention_dim=2048,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
            norm_num_groups=32,
        ),
        dict(_SD_VAE, sample_size=1024, scaling_factor=0.13025, force_upcast=True),
        {"_class_name": "EulerDiscreteScheduler", **_BETAS, "timestep_spacing": "leading"},
        1024,
        text_encoder_2=dict(
            _CLIP_L,
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=20,
            hidden_act="gelu",
            projection_dim=1280,
        ),
    ),
    # A seconds-long SD-shaped model for tests.
    "tiny": Architecture(
        "StableDiffusionPipeline",
        dict(
            _CLIP_L, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32
        ),
        dict(
            _SD_UNET,
            sample_size=8,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=4,
            norm_num_groups=8,
        ),
        dict(
            _SD_VAE,
            block_out_channels=(16, 32),
            layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            norm_num_groups=8,
            sample_size=16,
        ),
        {"_class_name": "PNDMScheduler", **_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False},
        16,
    ),
}


def random_params(shapes: Any, seed: int, dtype) -> Any:
    """Random weights for a params tree of `jax.ShapeDtypeStruct`: kernels N(0, 1/fan_in) (HWIO / (in, out)),
    embeddings N(0, 0.02), norm scales 1, biases 0; floats in `dtype`. Deterministic from `seed`."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        shape = tuple(leaf.shape)
        if name == "scale":
            x = np.ones(shape, np.float32)
        elif name == "bias":
            x = np.zeros(shape, np.float32)
        elif name == "embedding":
            x = rng.standard_normal(shape, np.float32) * np.float32(0.02)
        else:
            fan_in = max(1, math.prod(shape[:-1]))
            x = rng.standard_normal(shape, np.float32) * np.float32(1 / math.sqrt(fan_in))
        return jnp.asarray(x, dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def build_pipeline(arch: str | Architecture, dtype, *, abstract: bool = False, seed: int = 0):
    """The sdjax pipeline of an architecture with random weights -> `(pipeline, params)`.

    `abstract=True`: params are `jax.ShapeDtypeStruct` (nothing allocated) except the small sampler state."""
    import jax
    import jax.numpy as jnp

    from sdjax import samplers
    from sdjax.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel
    from sdjax.models.vae import AutoencoderKL, AutoencoderKLConfig
    from sdjax.pipelines import StableDiffusionPipeline
    from sdjax.pipelines.stable_diffusion_xl import StableDiffusionXLPipeline
    from sdjax.text.tokenizer import CLIPTokenizer

    a = ARCHITECTURES[arch] if isinstance(arch, str) else arch
    dtype = jnp.dtype(dtype)
    parts = {
        "text_encoder": (CLIPTextModel, CLIPTextConfig.from_dict(a.text_encoder, source="text_encoder")),
        "unet": (UNet2DConditionModel, UNet2DConditionConfig(**a.unet)),
        "vae": (AutoencoderKL, AutoencoderKLConfig(**a.vae)),
    }
    if a.text_encoder_2 is not None:
        parts["text_encoder_2"] = (
            CLIPTextModelWithProjection,
            CLIPTextConfig.from_dict(a.text_encoder_2, source="text_encoder_2"),
        )
    modules, params = {}, {}
    for i, (name, (cls, config)) in enumerate(parts.items()):
        modules[name] = cls(config=config, dtype=dtype)
        shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), cls.init_params_shape(config))
        params[name] = shapes if abstract else random_params(shapes, seed + i, dtype)
    sampler = samplers.get_sampler(dict(a.scheduler))
    params["scheduler"] = sampler.create_state()
    common = dict(
        tokenizer=CLIPTokenizer.default(),
        scheduler=sampler,
        dtype=dtype,
        name=f"random {a.pipeline}",
        **{k: modules[k] for k in ("text_encoder", "unet", "vae")},
    )
    if a.pipeline == "StableDiffusionXLPipeline":
        pipe = StableDiffusionXLPipeline(
            tokenizer_2=CLIPTokenizer.default(pad_token="!"), text_encoder_2=modules["text_encoder_2"], **common
        )
    else:
        pipe = StableDiffusionPipeline(**common)
    pipe.params = params
    return pipe, params


# ---------------------------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: str | None = None  # diffusers folder / Hub id; None with arch None: the embedded model
    arch: str | None = None  # one of ARCHITECTURES (random weights)
    height: int | None = None
    width: int | None = None
    steps: int = 20
    batch: int = 1
    dtype: str = "float32"
    sampler: str | None = None
    reps: int = 3
    torch: bool = False
    memory_only: bool = False
    seed: int = 0
    attention: str = "auto"  # the UNet's and VAE's attention (sdjax.models.layers.ATTENTION_IMPLEMENTATIONS)

    def validate(self) -> None:
        """Reject bad settings by name before anything is built or compiled."""
        if self.model is not None and self.arch is not None:
            raise ValueError("give either model or arch, not both")
        if self.arch is not None and self.arch not in ARCHITECTURES:
            raise ValueError(f"arch={self.arch!r}: expected one of {sorted(ARCHITECTURES)}")
        from sdjax.models.layers import ATTENTION_IMPLEMENTATIONS

        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention={self.attention!r}: expected one of {ATTENTION_IMPLEMENTATIONS}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}: expected float32, bfloat16 or float16")
        for name in ("steps", "batch", "reps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 8 or value % 8):
                raise ValueError(f"{name}={value!r}: expected a positive multiple of 8")
        if self.memory_only and self.arch is None:
            raise ValueError("memory_only needs arch (it compiles against abstract weights of a known config)")
        if self.memory_only and self.torch:
            raise ValueError("memory_only runs nothing, so there is nothing to compare with torch")


# ---------------------------------------------------------------------------------------------- measuring
def _block(x):
    import jax

    return jax.block_until_ready(x)


def _time(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    """One warm call, then `reps` timed calls -> median and best seconds."""
    _block(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _block(fn())
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "best_s": min(times)}


def _flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    value = (cost or {}).get("flops")
    return float(value) if value is not None and value >= 0 else None


def _memory(compiled) -> dict[str, int] | None:
    try:
        m = compiled.memory_analysis()
    except Exception:
        return None
    if m is None:
        return None
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    out = {f: int(getattr(m, f, 0) or 0) for f in fields}
    out["total_bytes"] = (
        out["argument_size_in_bytes"]
        + out["output_size_in_bytes"]
        + out["temp_size_in_bytes"]
        - out["alias_size_in_bytes"]
    )
    return out


def matmul_peak(dtype, n: int | None = None, reps: int = 5) -> float:
    """Measured FLOP/s of a square matmul in `dtype` on the default device (the MFU denominator)."""
    import jax
    import jax.numpy as jnp

    if n is None:
        n = 2048 if jax.default_backend() == "cpu" else 8192
    x = jnp.ones((n, n), dtype) * jnp.asarray(0.01, dtype)
    f = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
    t = _time(lambda: f(x, x), reps)["best_s"]
    return 2.0 * n**3 / t


def _compile(fn, *args, **kwargs):
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(fn, **kwargs).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _device_peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _load(cfg: BenchConfig, dtype):
    if cfg.arch is not None:
        pipe, params = build_pipeline(cfg.arch, dtype, abstract=cfg.memory_only, seed=cfg.seed)
    else:
        from sdjax.pipelines.auto import load_pipeline

        pipe, params = load_pipeline(cfg.model, dtype=dtype, safety_checker=None)
    if cfg.attention != "auto":
        pipe.unet, pipe.vae = pipe.unet.clone(attention=cfg.attention), pipe.vae.clone(attention=cfg.attention)
    return pipe, params


def run(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Benchmark one workload; returns the JSON-able result (see the module docstring)."""
    cfg.validate()
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(cfg.dtype)
    t0 = time.perf_counter()
    log("building the pipeline" if cfg.arch else f"loading {cfg.model or 'the embedded model'}")
    pipe, params = _load(cfg, dtype)
    load_s = time.perf_counter() - t0
    dh, dw = pipe.default_size
    height, width = cfg.height or dh, cfg.width or dw
    pipe.validate(steps=cfg.steps, height=height, width=width, sampler=cfg.sampler)
    b = cfg.batch
    result: dict[str, Any] = {
        "model": cfg.model or (f"random {cfg.arch}" if cfg.arch else "embedded"),
        "pipeline": type(pipe).__name__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "devices": 1,
        "dtype": cfg.dtype,
        "height": height,
        "width": width,
        "steps": cfg.steps,
        "batch": b,
        "sampler": cfg.sampler or type(pipe.scheduler).__name__,
        "attention": cfg.attention,
        "reps": cfg.reps,
        "load_s": load_s,
    }
    # One device: the pieces and the end-to-end executable all run on the first device (no batch splitting).
    pipe.devices = jax.devices()[:1]
    prompts = ["a photograph of an astronaut riding a horse"] * b
    ids = jnp.asarray(pipe.prepare_inputs(prompts))
    neg = jnp.asarray(pipe.prepare_inputs([""] * b))
    extra = pipe._batch_extra([""] * b, height, width)
    extra = None if extra is None else jax.tree_util.tree_map(jnp.asarray, extra)
    f = pipe.vae_scale_factor
    lat_shape = (b, pipe.unet.config.in_channels, height // f, width // f)

    if cfg.memory_only:
        return _memory_only(pipe, params, cfg, result, ids, neg, extra, height, width, log)

    def conditioning(p, i, n, e):
        return pipe._conditioning(p, i, n, height, width, e)

    pieces: dict[str, dict[str, Any]] = {}
    log("compiling and timing the text encoder")
    text_c, s = _compile(conditioning, params, ids, neg, extra)
    context, added = text_c(params, ids, neg, extra)
    pieces["text"] = {
        "compile_s": s,
        **_time(lambda: text_c(params, ids, neg, extra), cfg.reps),
        "flops": _flops(text_c),
    }

    log("compiling and timing one UNet step")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2 * b,) + lat_shape[1:], np.float32), dtype)
    t = jnp.full((2 * b,), 500.0, jnp.float32)

    def unet_step(p, x, t, c, a):
        return pipe.unet.apply({"params": p["unet"]}, x, t, c, **a)

    unet_c, s = _compile(unet_step, params, x, t, context, added)
    pieces["unet"] = {
        "compile_s": s,
        **_time(lambda: unet_c(params, x, t, context, added), cfg.reps),
        "flops": _flops(unet_c),
    }

    log("compiling and timing the VAE decoder")
    z = jnp.asarray(np.random.default_rng(1).standard_normal(lat_shape, np.float32))
    decode_c, s = _compile(pipe._decode, params, z)
    pieces["decode"] = {"compile_s": s, **_time(lambda: decode_c(params, z), cfg.reps), "flops": _flops(decode_c)}

    log(f"compiling and timing end-to-end generation ({cfg.steps} steps)")
    t0 = time.perf_counter()
    run_e2e = pipe.aot_compile(
        batch_size=b, height=height, width=width, steps=cfg.steps, sampler=cfg.sampler, params=params
    )
    e2e_compile = time.perf_counter() - t0
    keys = np.asarray(
        jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(jax.random.key(0), i)))(jnp.arange(b)), np.uint32
    )
    guidance = np.full((b,), 7.5, np.float32)
    np_ids, np_neg = np.asarray(ids), np.asarray(neg)
    np_extra = None if extra is None else jax.tree_util.tree_map(np.asarray, extra)
    e2e = _time(lambda: run_e2e(np_ids, np_neg, keys, guidance, np_extra), cfg.reps)
    flop_parts = [pieces[k]["flops"] for k in ("text", "unet", "decode")]
    e2e_flops = (
        None
        if None in flop_parts
        else pieces["text"]["flops"] + cfg.steps * pieces["unet"]["flops"] + pieces["decode"]["flops"]
    )
    pieces["e2e"] = {"compile_s": e2e_compile, **e2e, "flops": e2e_flops}

    log("measuring the matmul rate for MFU")
    peak = matmul_peak(dtype)
    for piece in pieces.values():
        piece["tflops_per_s"] = piece["flops"] / piece["median_s"] / 1e12 if piece["flops"] else None
        piece["mfu"] = piece["flops"] / piece["median_s"] / peak if piece["flops"] else None
    result.update(
        pieces=pieces,
        images_per_s=b / e2e["median_s"],
        matmul_peak_tflops_per_s=peak / 1e12,
        e2e_memory=_memory(run_e2e.compiled),
        device_peak_bytes=_device_peak_bytes(),
        process_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    if cfg.torch:
        del run_e2e, text_c, unet_c, decode_c, pipe, params
        gc.collect()
        log("running the same workload in PyTorch diffusers (subprocess)")
        result["torch"] = run_torch(cfg, height, width)
        result["ratios"] = {
            k: result["pieces"][k]["median_s"] / result["torch"][k]["median_s"]
            for k in ("text", "unet", "decode", "e2e")
            if k in result["torch"]
        }
    return result


def _memory_only(pipe, params, cfg, result, ids, neg, extra, height, width, log) -> dict[str, Any]:
    """Compile end-to-end generation against abstract params and report XLA's memory analysis."""
    import jax
    import jax.numpy as jnp

    b = cfg.batch
    log(f"compiling end-to-end generation against abstract weights ({height}x{width}, batch {b})")

    def spec(x):
        return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)

    t0 = time.perf_counter()
    lowered = pipe._jit_sample.lower(
        params,
        spec(ids),
        spec(neg),
        jax.ShapeDtypeStruct((b, 2), jnp.uint32),
        jax.ShapeDtypeStruct((b,), jnp.float32),
        None,
        None if extra is None else jax.tree_util.tree_map(spec, extra),
        num_inference_steps=cfg.steps,
        height=height,
        width=width,
        sampler=pipe._sampler(cfg.sampler),
        progress=False,
        guidance_rescale=0.0,
    )
    compiled = lowered.compile()
    weights = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params))
    result.update(compile_s=time.perf_counter() - t0, weights_bytes=int(weights), e2e_memory=_memory(compiled))
    return result


# ---------------------------------------------------------------------------------------------- PyTorch side
def run_torch(cfg: BenchConfig, height: int, width: int) -> dict[str, Any]:
    """The same workload in PyTorch diffusers, in a fresh Python process; returns its timings."""
    spec = {"config": dataclasses.asdict(cfg), "height": height, "width": width}
    code = (
        "import json, sys; from sdjax.bench import _torch_worker; "
        "print(json.dumps(_torch_worker(json.loads(sys.argv[1]))))"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the PyTorch benchmark failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _torch_pipeline(cfg: BenchConfig, torch_dtype):
    import diffusers
    import torch
    import transformers

    from sdjax.text.tokenizer import ASSETS

    if cfg.arch is None:
        from sdjax.pipelines.auto import resolve_alias

        pipe = diffusers.DiffusionPipeline.from_pretrained(
            resolve_alias(cfg.model or "embedded"), torch_dtype=torch_dtype, safety_checker=None
        )
        return pipe
    a = ARCHITECTURES[cfg.arch]
    torch.manual_seed(cfg.seed)

    def text(config, cls):
        return cls(transformers.CLIPTextConfig(**config)).to(torch_dtype).eval()

    def tokenizer(pad="<|endoftext|>"):
        return transformers.CLIPTokenizer(
            str(ASSETS / "vocab.json"), str(ASSETS / "merges.txt"), pad_token=pad, model_max_length=77
        )

    sched_cfg = dict(a.scheduler)
    scheduler = getattr(diffusers, sched_cfg.pop("_class_name")).from_config(sched_cfg)
    unet = diffusers.UNet2DConditionModel.from_config(a.unet).to(torch_dtype).eval()
    vae = diffusers.AutoencoderKL.from_config(a.vae).to(torch_dtype).eval()
    if a.pipeline == "StableDiffusionXLPipeline":
        return diffusers.StableDiffusionXLPipeline(
            vae=vae,
            unet=unet,
            scheduler=scheduler,
            tokenizer=tokenizer(),
            tokenizer_2=tokenizer("!"),
            text_encoder=text(a.text_encoder, transformers.CLIPTextModel),
            text_encoder_2=text(a.text_encoder_2, transformers.CLIPTextModelWithProjection),
        )
    return diffusers.StableDiffusionPipeline(
        vae=vae,
        unet=unet,
        scheduler=scheduler,
        tokenizer=tokenizer(),
        text_encoder=text(a.text_encoder, transformers.CLIPTextModel),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _torch_worker(spec: dict) -> dict[str, Any]:
    import torch

    cfg = BenchConfig(**spec["config"])
    height, width, b = spec["height"], spec["width"], cfg.batch
    torch.set_num_threads(os.cpu_count() or 1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, cfg.dtype)
    pipe = _torch_pipeline(cfg, torch_dtype).to(dev)
    pipe.set_progress_bar_config(disable=True)
    if cfg.sampler is not None:  # the diffusers class and config that the sdjax sampler mirrors
        import diffusers

        from sdjax import samplers

        chosen = samplers.get_sampler(cfg.sampler, base_config=dict(pipe.scheduler.config))
        keys = {k: getattr(chosen, k) for k in chosen.config_keys()}
        pipe.scheduler = getattr(diffusers, chosen.diffusers_class).from_config({**pipe.scheduler.config, **keys})

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        with torch.inference_mode():
            t0 = time.perf_counter()
            fn()
            sync()
            first = time.perf_counter() - t0
            times = []
            for _ in range(cfg.reps):
                t0 = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t0)
        return {"first_call_s": first, "median_s": statistics.median(times), "best_s": min(times)}

    prompts = ["a photograph of an astronaut riding a horse"] * b
    xl = hasattr(pipe, "text_encoder_2")
    out: dict[str, Any] = {"device": dev, "threads": torch.get_num_threads(), "torch": torch.__version__}
    with torch.inference_mode():
        enc = pipe.encode_prompt(
            prompts, device=dev, num_images_per_prompt=1, do_classifier_free_guidance=True, negative_prompt=[""] * b
        )
    out["text"] = timed(
        lambda: pipe.encode_prompt(
            prompts, device=dev, num_images_per_prompt=1, do_classifier_free_guidance=True, negative_prompt=[""] * b
        )
    )
    if xl:
        context = torch.cat([enc[1], enc[0]])
        pooled = torch.cat([enc[3], enc[2]])
        time_ids = torch.tensor([[height, width, 0, 0, height, width]] * (2 * b), dtype=torch_dtype, device=dev)
        added = {"added_cond_kwargs": {"text_embeds": pooled, "time_ids": time_ids}}
    else:
        context = torch.cat([enc[1], enc[0]])
        added = {}
    f = pipe.vae_scale_factor
    c = pipe.unet.config.in_channels
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2 * b, c, height // f, width // f), generator=gen).to(dev, torch_dtype)
    t = torch.full((2 * b,), 500.0, device=dev)
    out["unet"] = timed(lambda: pipe.unet(x, t, encoder_hidden_states=context, **added))
    z = torch.randn((b, c, height // f, width // f), generator=gen).to(dev, torch_dtype)
    out["decode"] = timed(lambda: pipe.vae.decode(z / pipe.vae.config.scaling_factor))
    out["e2e"] = timed(
        lambda: pipe(
            prompts,
            negative_prompt=[""] * b,
            num_inference_steps=cfg.steps,
            height=height,
            width=width,
            guidance_scale=7.5,
            output_type="np",
        )
    )
    if dev == "cuda":
        out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    out["process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


# ---------------------------------------------------------------------------------------------- report
def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the human-readable table (the CLI renders them with rich)."""
    if "pieces" not in result:  # memory_only
        m = result["e2e_memory"] or {}
        rows = [
            ["weights", _fmt_bytes(result["weights_bytes"])],
            ["arguments", _fmt_bytes(m.get("argument_size_in_bytes"))],
            ["outputs", _fmt_bytes(m.get("output_size_in_bytes"))],
            ["temporaries", _fmt_bytes(m.get("temp_size_in_bytes"))],
            ["total (XLA buffer assignment)", _fmt_bytes(m.get("total_bytes"))],
            ["compile", f"{result['compile_s']:.1f} s"],
        ]
        return ["memory", "value"], rows
    torch_res = result.get("torch") or {}
    cols = ["piece", "compile s", "median s", "best s", "GFLOP", "TFLOP/s", "MFU"]
    if torch_res:
        cols += ["torch median s", "sdjax / torch"]
    rows = []
    for name, label in (
        ("text", "text encoder"),
        ("unet", "UNet step (CFG batch)"),
        ("decode", "VAE decode"),
        ("e2e", f"end to end ({result['steps']} steps)"),
    ):
        p = result["pieces"][name]
        row = [
            label,
            f"{p['compile_s']:.2f}",
            f"{p['median_s']:.4f}",
            f"{p['best_s']:.4f}",
            "-" if p["flops"] is None else f"{p['flops'] / 1e9:.1f}",
            "-" if p["tflops_per_s"] is None else f"{p['tflops_per_s']:.3f}",
            "-" if p["mfu"] is None else f"{100 * p['mfu']:.1f}%",
        ]
        if torch_res:
            row += [f"{torch_res[name]['median_s']:.4f}", f"{result['ratios'][name]:.2f}"]
        rows.append(row)
    return cols, rows


def summary_lines(result: dict[str, Any]) -> list[str]:
    if "pieces" not in result:
        return [
            f"{result['model']} ({result['pipeline']}), {result['dtype']}, {result['height']}x{result['width']}, "
            f"batch {result['batch']}, {result['steps']} steps on {result['device']} ({result['backend']})"
        ]
    m = result.get("e2e_memory") or {}
    return [
        f"{result['model']} ({result['pipeline']}), {result['dtype']}, {result['height']}x{result['width']}, batch "
        f"{result['batch']}, {result['steps']} steps, {result['sampler']} on {result['device']} ({result['backend']})",
        f"images/s {result['images_per_s']:.3f}; load {result['load_s']:.1f} s; measured matmul rate "
        f"{result['matmul_peak_tflops_per_s']:.3f} TFLOP/s ({result['dtype']})",
        f"memory: device peak {_fmt_bytes(result['device_peak_bytes'])}; end-to-end executable "
        f"{_fmt_bytes(m.get('total_bytes'))} (XLA); process peak RSS {_fmt_bytes(result['process_peak_rss_bytes'])}",
    ]
