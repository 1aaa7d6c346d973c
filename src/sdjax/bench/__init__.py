"""`sdjax bench`: one text-to-image workload timed piece by piece, with XLA's FLOP counts, memory and MFU.

What is measured (each piece compiled ahead of time with `jit(...).lower(...).compile()`, so compile time is
apart from run time; run times are the median and best of `reps` calls after one warm call):

- `text`: the text encoder(s) on the stacked (negative, prompt) batch, `2B x 77` tokens;
- `unet`: one UNet call on `2B` latents (classifier-free guidance doubles the batch), i.e. one sampler step;
- `unet_loop`: the same step `steps` times in one program (`lax.fori_loop`; torch: calls back to back), per
  step: what a step costs inside a generation, without the per-call dispatch that one call pays (on a GPU 3.5 ms
  of an SD 1.5 step's 11.6, docs/benchmarks.md);
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
its own) in a worker process, timed side by side: for each piece both sides get a warm call, then the timed calls
alternate between them (sdjax, torch, torch, sdjax, ...), so a machine shared with other work slows both alike and
the ratios `sdjax / torch` (< 1: sdjax faster) hold even where absolute times do not. Both processes hold their
weights meanwhile (SD 1.5 float32: about 4.5 GB each). torch and diffusers are needed only for that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sdjax.models.presets import ARCHITECTURES, Architecture, random_params  # noqa: F401 (re-exported)
from sdjax.pipelines.presets import build_pipeline


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
    torch_compile: str | None = (
        None  # torch.compile mode for the PyTorch side's UNet and VAE decode (TORCH_COMPILE_MODES)
    )
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
        if self.attention == "pallas":
            import jax

            if jax.default_backend() != "tpu":
                raise ValueError(
                    f"attention='pallas' is the TPU kernel and this machine runs {jax.default_backend()!r} "
                    "(sdjax compile --attention pallas compiles for a TPU slice from here)"
                )
        check_run_fields(self, ("steps", "batch", "reps"))
        if self.memory_only and self.arch is None:
            raise ValueError("memory_only needs arch (it compiles against abstract weights of a known config)")
        if self.memory_only and self.torch:
            raise ValueError("memory_only runs nothing, so there is nothing to compare with torch")
        if self.torch_compile is not None:
            if self.torch_compile not in TORCH_COMPILE_MODES:
                raise ValueError(f"torch_compile={self.torch_compile!r}: expected one of {TORCH_COMPILE_MODES}")
            if not self.torch:
                raise ValueError("torch_compile applies to the PyTorch side: set torch too")


# The timed pieces, in the order they run; "unet_loop" is per step of `steps` steps run back to back.
PIECES = ("text", "unet", "unet_loop", "decode", "e2e")

# torch.compile's modes: "reduce-overhead" and "max-autotune" replay CUDA graphs on a GPU (what removes PyTorch's
# per-op launch cost at batch 1); "max-autotune" also times candidate kernels while compiling (minutes).
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# ---------------------------------------------------------------------------------------------- measuring
def check_run_fields(cfg: Any, counts: tuple[str, ...]) -> None:
    """The fields every benchmark config shares: `dtype`, the integer `counts` (>= 1), optional `height`/`width`
    (multiples of 8); raises ValueError naming the field."""
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={cfg.dtype!r}: expected float32, bfloat16 or float16")
    for name in counts:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    for name in ("height", "width"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 8 or value % 8):
            raise ValueError(f"{name}={value!r}: expected a positive multiple of 8")


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


def _time_side_by_side(fn: Callable[[], Any], worker: TorchWorker | None, piece: str, reps: int):
    """`_time` of `fn` and, with a worker, the same number of torch calls of `piece` interleaved with it."""
    if worker is None:
        return _time(fn, reps), None
    _block(fn())
    first = worker.call(piece)
    ours, theirs = [], []
    for r in range(reps):
        for side in ("jax", "torch") if r % 2 == 0 else ("torch", "jax"):
            if side == "torch":
                theirs.append(worker.call(piece))
            else:
                t0 = time.perf_counter()
                _block(fn())
                ours.append(time.perf_counter() - t0)
    summary = {"median_s": statistics.median(ours), "best_s": min(ours)}
    return summary, {"first_call_s": first, "median_s": statistics.median(theirs), "best_s": min(theirs)}


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
    if cfg.attention != "auto":  # the pieces call pipe.unet / pipe.vae, the whole generation the generator's
        pipe.unet, pipe.vae = pipe.unet.clone(attention=cfg.attention), pipe.vae.clone(attention=cfg.attention)
        pipe.generator.set_attention(cfg.attention)
    return pipe, params


def run(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Benchmark one workload; returns the JSON-able result (see the module docstring)."""
    cfg.validate()
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(cfg.dtype)
    t0 = time.perf_counter()
    log("building the pipeline" if cfg.arch else f"loading {cfg.model or 'the embedded model'}")
    from sdjax import samplers

    pipe, params = _load(cfg, dtype)
    load_s = time.perf_counter() - t0
    dh, dw = pipe.default_size
    height, width = cfg.height or dh, cfg.width or dw
    pipe.validate(steps=cfg.steps, height=height, width=width, sampler=cfg.sampler)
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
        "batch": cfg.batch,
        "sampler": cfg.sampler or samplers.name_of(pipe.scheduler),
        "attention": cfg.attention,
        "reps": cfg.reps,
        "load_s": load_s,
    }
    # One device: the pieces and the end-to-end executable all run on the first device (no batch splitting).
    pipe.devices = jax.devices()[:1]
    if cfg.memory_only:
        return _memory_only(pipe, params, cfg, result, height, width, log)
    worker = None
    if cfg.torch:
        log("starting the PyTorch diffusers worker")
        worker = TorchWorker(cfg, height, width)
    try:
        return _run_pieces(cfg, pipe, params, result, height, width, worker, log)
    finally:
        if worker is not None:
            worker.close()


def _run_pieces(cfg, pipe, params, result, height, width, worker, log) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from sdjax.core import autoencoder
    from sdjax.ops import conv as ops_conv

    dtype = jnp.dtype(cfg.dtype)
    b = cfg.batch
    gen = pipe.generator
    cond = gen.models.conditioning
    prompts = ["a photograph of an astronaut riding a horse"] * b
    host = {
        "ids": cond.tokenize(prompts),
        "neg_ids": cond.tokenize([""] * b),
        **cond.host_inputs(negative_prompts=[None] * b, height=height, width=width, task="txt2img"),
    }
    f = pipe.vae_scale_factor
    lat_shape = (b, pipe.vae.config.latent_channels, height // f, width // f)

    def conditioning(p, inputs):
        return cond.encode(p, inputs, cfg=True)

    inputs = {k: jnp.asarray(v) for k, v in host.items()}
    pieces: dict[str, dict[str, Any]] = {}
    torch_side: dict[str, Any] = {}
    log("compiling and timing the text encoder")
    text_c, s = _compile(conditioning, params, inputs)
    context, added = text_c(params, inputs)
    timed, torch_side["text"] = _time_side_by_side(lambda: text_c(params, inputs), worker, "text", cfg.reps)
    pieces["text"] = {"compile_s": s, **timed, "flops": _flops(text_c)}

    log("compiling and timing one UNet step")
    x = jnp.asarray(
        np.random.default_rng(0).standard_normal((2 * b, pipe.unet.config.in_channels) + lat_shape[2:], np.float32),
        dtype,
    )
    t = jnp.full((2 * b,), 500.0, jnp.float32)

    # The UNet's params as the denoising loop sees them: prepared once per program (Winograd kernels on CPU,
    # sdjax.ops.conv), outside the step.
    unet_params = jax.jit(ops_conv.prepare)(params["unet"])

    def unet_step(p, x, t, c, a):
        return pipe.unet.apply({"params": p}, x, t, c, **a)

    unet_c, s = _compile(unet_step, unet_params, x, t, context, added)
    timed, torch_side["unet"] = _time_side_by_side(
        lambda: unet_c(unet_params, x, t, context, added), worker, "unet", cfg.reps
    )
    pieces["unet"] = {"compile_s": s, **timed, "flops": _flops(unet_c)}

    # The same step as a generation runs it: `steps` steps in one program (torch: that many calls back to back),
    # per step. On a GPU one call of a step also pays the dispatch and the first launches, which a loop hides.
    log(f"compiling and timing {cfg.steps} UNet steps in one program")

    def unet_loop(p, x, t, c, a):
        return jax.lax.fori_loop(0, cfg.steps, lambda i, y: y - 0.001 * unet_step(p, y, t, c, a).astype(y.dtype), x)

    loop_c, s = _compile(unet_loop, unet_params, x, t, context, added)
    timed, torch_side["unet_loop"] = _time_side_by_side(
        lambda: loop_c(unet_params, x, t, context, added), worker, "unet_loop", cfg.reps
    )
    for side in (timed, torch_side["unet_loop"]):
        for k in ("median_s", "best_s", "first_call_s"):
            if side is not None and k in side:
                side[k] /= cfg.steps
    pieces["unet_loop"] = {"compile_s": s, **timed, "flops": pieces["unet"]["flops"]}

    log("compiling and timing the VAE decoder")
    z = jnp.asarray(np.random.default_rng(1).standard_normal(lat_shape, np.float32))

    def decode(p, z):
        return autoencoder.decode(pipe.vae, p["vae"], z, pipe.dtype)

    decode_c, s = _compile(decode, params, z)
    timed, torch_side["decode"] = _time_side_by_side(lambda: decode_c(params, z), worker, "decode", cfg.reps)
    pieces["decode"] = {"compile_s": s, **timed, "flops": _flops(decode_c)}

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
    extra = {k: v for k, v in host.items() if k not in ("ids", "neg_ids")}
    e2e, torch_side["e2e"] = _time_side_by_side(
        lambda: run_e2e(host["ids"], host["neg_ids"], keys, guidance, extra), worker, "e2e", cfg.reps
    )
    flop_parts = [pieces[k]["flops"] for k in ("text", "unet", "decode")]
    model_calls = int(pipe._sampler(cfg.sampler).num_model_calls(cfg.steps))  # PNDM: one more than the steps
    e2e_flops = (
        None
        if None in flop_parts
        else pieces["text"]["flops"] + model_calls * pieces["unet"]["flops"] + pieces["decode"]["flops"]
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
        e2e_memory=_run_memory(run_e2e.compiled, run_e2e.decode),
        device_peak_bytes=_device_peak_bytes(),
        process_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    if worker is not None:
        result["torch"] = {**worker.info(), **torch_side}
        result["ratios"] = {
            k: result["pieces"][k]["median_s"] / result["torch"][k]["median_s"] for k in PIECES if k in result["torch"]
        }
    return result


def _run_memory(main, decode) -> dict[str, int] | None:
    """XLA's memory analysis of a generation run as executed: one program, or the program up to the latents
    followed by the VAE decode (its arguments stay resident during the decode, its output is the decode's input)."""
    m = _memory(main)
    d = None if decode is None or m is None else _memory(decode)
    if d is None:
        return m
    during_decode = m["argument_size_in_bytes"] + m["output_size_in_bytes"] + d["temp_size_in_bytes"]
    return {
        "argument_size_in_bytes": m["argument_size_in_bytes"],
        "output_size_in_bytes": d["output_size_in_bytes"],
        "temp_size_in_bytes": max(m["temp_size_in_bytes"], d["temp_size_in_bytes"]),
        "alias_size_in_bytes": m["alias_size_in_bytes"],
        "generated_code_size_in_bytes": m["generated_code_size_in_bytes"] + d["generated_code_size_in_bytes"],
        "total_bytes": max(m["total_bytes"], during_decode + d["output_size_in_bytes"]),
    }


def _memory_only(pipe, params, cfg, result, height, width, log) -> dict[str, Any]:
    """Compile end-to-end generation against abstract params and report XLA's memory analysis."""
    import jax
    import jax.numpy as jnp

    b = cfg.batch
    log(f"compiling end-to-end generation against abstract weights ({height}x{width}, batch {b})")
    t0 = time.perf_counter()
    gen = pipe.generator
    spec = gen.spec(batch=b, height=height, width=width, steps=cfg.steps, sampler=pipe._sampler(cfg.sampler))
    compiled = gen.lower(spec, params=params).compile()
    weights = sum(
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree_util.tree_leaves({k: v for k, v in params.items() if k != "scheduler"})
    )
    result.update(compile_s=time.perf_counter() - t0, weights_bytes=int(weights), e2e_memory=_memory(compiled))
    return result


# ---------------------------------------------------------------------------------------------- PyTorch side
class TorchWorker:
    """The same workload in PyTorch diffusers, in a worker process that times one piece per request.

    Requests and replies are JSON lines on the worker's stdin and stdout (the worker sends whatever torch or
    diffusers print to stderr, which goes to a temporary file shown if the worker fails).
    """

    def __init__(self, cfg: Any, height: int, width: int, *, serve: str = "sdjax.bench:_torch_serve"):
        """`cfg`: a config dataclass that `serve` ("module:function", run in the worker with the spec) reads."""
        spec = {"config": dataclasses.asdict(cfg), "height": height, "width": width}
        module, _, function = serve.partition(":")
        code = f"import json, sys; from {module} import {function}; {function}(json.loads(sys.argv[1]))"
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._info = self._request({"cmd": "ready"})

    def _request(self, message: dict[str, Any]) -> Any:
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        while True:  # a reply is one JSON line; anything a library printed at import (before the redirect) is skipped
            try:
                line = self._proc.stdout.readline()
            except OSError:
                line = ""
            if not line:
                self._proc.wait()
                self._stderr.seek(0)
                raise RuntimeError(
                    f"the PyTorch benchmark worker failed (exit {self._proc.returncode}):\n"
                    f"{self._stderr.read()[-3000:]}"
                )
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(reply, dict):
                return reply

    def call(self, piece: str) -> float:
        """Seconds one call of `piece` (text, unet, decode, e2e; the serve function's names) took in torch."""
        return float(self._request({"cmd": "run", "piece": piece})["s"])

    def info(self) -> dict[str, Any]:
        return {**self._info, **self._request({"cmd": "info"})}

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


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


def _torch_serve(spec: dict) -> None:
    """The worker's loop (see `TorchWorker`)."""
    import torch

    reply = worker_stdout()
    cfg = BenchConfig(**spec["config"])
    height, width, b = spec["height"], spec["width"], cfg.batch
    torch.set_num_threads(os.cpu_count() or 1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, cfg.dtype)
    pipe = _torch_pipeline(cfg, torch_dtype).to(dev)
    pipe.set_progress_bar_config(disable=True)
    if cfg.torch_compile is not None:
        compile_torch_pipeline(pipe, cfg.torch_compile)
    if cfg.sampler is not None:  # the diffusers class and config that the sdjax sampler mirrors
        import diffusers

        from sdjax import samplers

        chosen = samplers.get_sampler(cfg.sampler, base_config=dict(pipe.scheduler.config))
        keys = {k: getattr(chosen, k) for k in chosen.config_keys()}
        pipe.scheduler = getattr(diffusers, chosen.diffusers_class).from_config({**pipe.scheduler.config, **keys})

    prompts = ["a photograph of an astronaut riding a horse"] * b
    xl = hasattr(pipe, "text_encoder_2")
    with torch.inference_mode():
        enc = pipe.encode_prompt(
            prompts, device=dev, num_images_per_prompt=1, do_classifier_free_guidance=True, negative_prompt=[""] * b
        )
    context = torch.cat([enc[1], enc[0]])
    added = {}
    if xl:
        pooled = torch.cat([enc[3], enc[2]])
        time_ids = torch.tensor([[height, width, 0, 0, height, width]] * (2 * b), dtype=torch_dtype, device=dev)
        added = {"added_cond_kwargs": {"text_embeds": pooled, "time_ids": time_ids}}
    f = pipe.vae_scale_factor
    c = pipe.unet.config.in_channels
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2 * b, c, height // f, width // f), generator=gen).to(dev, torch_dtype)
    t = torch.full((2 * b,), 500.0, device=dev)
    z = torch.randn((b, c, height // f, width // f), generator=gen).to(dev, torch_dtype)

    def unet_loop():
        y = x
        for _ in range(cfg.steps):
            y = y - 0.001 * pipe.unet(y, t, encoder_hidden_states=context, **added).sample

    pieces = {
        "text": lambda: pipe.encode_prompt(
            prompts, device=dev, num_images_per_prompt=1, do_classifier_free_guidance=True, negative_prompt=[""] * b
        ),
        "unet": lambda: pipe.unet(x, t, encoder_hidden_states=context, **added),
        "unet_loop": unet_loop,
        "decode": lambda: pipe.vae.decode(z / pipe.vae.config.scaling_factor),
        "e2e": lambda: pipe(
            prompts,
            negative_prompt=[""] * b,
            num_inference_steps=cfg.steps,
            height=height,
            width=width,
            guidance_scale=7.5,
            output_type="np",
        ),
    }

    serve_pieces(pieces, dev, reply, torch_compile=cfg.torch_compile)


def compile_torch_pipeline(pipe, mode: str) -> None:
    """diffusers' own recipe for a faster pipeline: channels-last UNet and VAE, `torch.compile` of the UNet and the
    VAE decode (whole graphs, static shapes). Each compiles at its first call, so the worker's first call of a
    piece includes it (reported as the torch side's first_call_s)."""
    import torch

    pipe.unet.to(memory_format=torch.channels_last)
    pipe.vae.to(memory_format=torch.channels_last)
    pipe.unet = torch.compile(pipe.unet, mode=mode, fullgraph=True, dynamic=False)
    pipe.vae.decode = torch.compile(pipe.vae.decode, mode=mode, fullgraph=True, dynamic=False)


def worker_stdout():
    """The worker's reply stream: the original stdout, which from now on only replies reach (whatever torch or
    diffusers print goes to stderr)."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return reply


def serve_pieces(pieces: dict[str, Callable[[], Any]], dev: str, reply, *, torch_compile: str | None = None) -> None:
    """A worker's request loop: "ready" (device, threads, torch version), "run" one piece (seconds, synchronized
    on CUDA, under `torch.inference_mode`), "info" (peak memory); one JSON line per reply."""
    import torch

    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "ready":
            out: dict[str, Any] = {"device": dev, "threads": torch.get_num_threads(), "torch": torch.__version__}
            out["torch_compile"] = torch_compile
        elif request["cmd"] == "run":
            with torch.inference_mode():
                t0 = time.perf_counter()
                pieces[request["piece"]]()
                if dev == "cuda":
                    torch.cuda.synchronize()
                out = {"s": time.perf_counter() - t0}
        else:  # info
            out = {"process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
            if dev == "cuda":
                out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        reply.write(json.dumps(out) + "\n")
        reply.flush()


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
        ("unet", "UNet step (CFG batch), one call"),
        ("unet_loop", f"UNet step in a loop of {result['steps']}"),
        ("decode", "VAE decode"),
        ("e2e", f"end to end ({result['steps']} steps)"),
    ):
        if name not in result["pieces"]:  # results written before the piece existed
            continue
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
