"""Full-size SD 1.5 components, sdjax against PyTorch diffusers/transformers, timed side by side in one process.

    python benchmarks/bench_components.py                                   # UNet, VAE decode, CLIP text
    python benchmarks/bench_components.py --components unet --reps 5 \\
        --variants default ynn-off ynn-off+attn-chunked --json unet.json

- UNet: batch 2 (classifier-free guidance), 64x64 latents (512x512 images), 77x768 context, one call.
- VAE decode: batch 1, 64x64 latents -> 512x512 image.
- CLIP text encoder (SD 1.5's ViT-L/14 text tower): batch 2 x 77 tokens.

Random weights (configs from `benchmarks/full_size.py`): the PyTorch model is built with a fixed seed and its
state dict converted to sdjax params, so both compute the same function; the table shows the largest
difference between the outputs as a check. Compile time (JAX's `lower().compile()`; PyTorch's first call) is
reported apart from the steady state: median and best of `--reps` interleaved calls, and their ratios to
PyTorch's (< 1: sdjax faster). Torch runs with `torch.set_num_threads(<cores>)`.

Variants (sdjax, combined with "+"):
- `default`: the XLA:CPU defaults of this process (XLA_FLAGS as given; nothing from `sdjax.runtime`).
- `ynn-off`: `jit(compiler_options=sdjax.runtime.cpu_compiler_options("eigen"))`: XLA's own emitters and
  Eigen for every dot/convolution, no YNNPACK.
- `ynn-noconv`: YNNPACK for dots and reductions, Eigen for convolutions.
- `attn-<impl>`: what-if: the models' attention routed through `sdjax.ops.attention.attention(impl=<impl>)`
  (impl: xla, deferred, chunked, flash, dot_product). Patched in for tracing only; the models are unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))


def _variant_options(name: str):
    from sdjax import runtime

    opts, attn = {}, None
    for part in name.split("+"):
        if part == "default":
            continue
        if part == "ynn-off":
            opts.update(runtime.cpu_compiler_options("eigen"))
        elif part == "ynn-noconv":
            opts.update(runtime.cpu_compiler_options("ynn-noconv"))
        elif part.startswith("attn-"):
            attn = part[len("attn-") :]
        else:
            raise SystemExit(f"unknown variant part {part!r} in {name!r}")
    return opts, attn


@contextlib.contextmanager
def _attention_override(impl: str | None):
    """Make every model attention resolve to `impl` while tracing (what-if only)."""
    if impl is None:
        yield
        return
    from sdjax.ops import attention as ops_attention

    original = ops_attention.resolve
    ops_attention.resolve = lambda implementation, query_tokens: impl
    try:
        yield
    finally:
        ops_attention.resolve = original


# ---------------------------------------------------------------------------------------------- components
def _unet():
    import jax.numpy as jnp
    import numpy as np
    import torch

    from benchmarks.full_size import SD15_UNET, torch_unet
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel, convert_unet

    tm = torch_unet(SD15_UNET)
    cfg = UNet2DConditionConfig(**SD15_UNET)
    state = {k: v.detach().numpy() for k, v in tm.state_dict().items()}
    params = convert_unet(state, cfg, cast=jnp.asarray)
    del state
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 64, 64), dtype=np.float32)
    ctx = rng.standard_normal((2, 77, 768), dtype=np.float32)
    t = np.array([981, 981], np.int64)
    xt, ctxt, tt = torch.from_numpy(x), torch.from_numpy(ctx), torch.from_numpy(t)
    args = (params, jnp.asarray(x), jnp.asarray(t.astype(np.int32)), jnp.asarray(ctx))

    def torch_call():
        return tm(xt, tt, encoder_hidden_states=ctxt).sample

    def make_fn(_):
        model = UNet2DConditionModel(cfg)
        return lambda p, x, t, c: model.apply({"params": p}, x, t, c)

    return dict(
        name="unet",
        desc="SD1.5 UNet, batch 2, 64x64 latents, 77x768 context",
        torch=torch_call,
        make_fn=make_fn,
        args=args,
        keep=[tm],
    )


def _vae():
    import jax.numpy as jnp
    import numpy as np
    import torch

    from benchmarks.full_size import SD15_VAE, torch_vae
    from sdjax.models.vae import AutoencoderKL, AutoencoderKLConfig, convert_vae

    tm = torch_vae(SD15_VAE)
    cfg = AutoencoderKLConfig(**SD15_VAE)
    state = {k: v.detach().numpy() for k, v in tm.state_dict().items()}
    params = convert_vae(state, cfg, cast=jnp.asarray)
    del state
    z = np.random.default_rng(1).standard_normal((1, 4, 64, 64), dtype=np.float32)
    zt = torch.from_numpy(z)

    def make_fn(_):
        model = AutoencoderKL(cfg)
        return lambda p, z: model.apply({"params": p}, z, method=AutoencoderKL.decode)

    return dict(
        name="vae_decode",
        desc="SD1.5 VAE decode, batch 1, 64x64 -> 512x512",
        torch=lambda: tm.decode(zt).sample,
        make_fn=make_fn,
        args=(params, jnp.asarray(z)),
        keep=[tm],
    )


def _clip():
    import jax.numpy as jnp
    import numpy as np
    import torch

    from benchmarks.full_size import SD15_TEXT, torch_text
    from sdjax.models.clip import CLIPTextConfig, CLIPTextModel, convert_clip_text

    tm = torch_text(SD15_TEXT)
    cfg = CLIPTextConfig(**SD15_TEXT)
    state = {k: v.detach().numpy() for k, v in tm.state_dict().items()}
    params = convert_clip_text(state, cfg, with_projection=False, cast=jnp.asarray)
    del state
    ids = np.random.default_rng(2).integers(0, SD15_TEXT["vocab_size"] - 1, (2, 77)).astype(np.int64)
    ids[:, -1] = SD15_TEXT["vocab_size"] - 1  # an end-of-text-like token for pooling
    idt = torch.from_numpy(ids)

    def make_fn(_):
        model = CLIPTextModel(cfg)
        return lambda p, ids: model.apply({"params": p}, ids).last_hidden_state

    return dict(
        name="clip_text",
        desc="SD1.5 CLIP text encoder, batch 2 x 77 tokens",
        torch=lambda: tm(idt).last_hidden_state,
        make_fn=make_fn,
        args=(params, jnp.asarray(ids.astype(np.int32))),
        keep=[tm],
    )


COMPONENTS = {"unet": _unet, "vae": _vae, "clip": _clip}


# ---------------------------------------------------------------------------------------------- bench
def bench_component(build, variants: list[str], reps: int) -> list[dict]:
    import jax
    import numpy as np
    import torch

    comp = build()
    rows = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        ref = comp["torch"]().numpy()
        torch_first = time.perf_counter() - t0
    runs = {"torch": comp["torch"]}
    info = {"torch": {"compile_s": None, "first_call_s": torch_first, "max_abs_diff": 0.0}}
    for v in variants:
        opts, attn = _variant_options(v)
        with _attention_override(attn):
            t0 = time.perf_counter()
            compiled = jax.jit(comp["make_fn"](v)).lower(*comp["args"]).compile(compiler_options=opts)
            compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = np.asarray(compiled(*comp["args"]))
        first = time.perf_counter() - t0
        info[v] = {
            "compile_s": compile_s,
            "first_call_s": first,
            "max_abs_diff": float(np.abs(out - ref.reshape(out.shape)).max()),
        }
        print(
            f"  [{comp['name']}] {v}: compile {compile_s:.1f} s, first call {first:.1f} s, "
            f"max|sdjax - torch| {info[v]['max_abs_diff']:.2e}",
            flush=True,
        )
        runs[v] = lambda c=compiled, a=comp["args"]: c(*a).block_until_ready()
        del out
    times = {k: [] for k in runs}
    names = list(runs)
    for r in range(reps):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            if k == "torch":
                with torch.inference_mode():
                    runs[k]()
            else:
                runs[k]()
            times[k].append(time.perf_counter() - t0)
        print(f"  [{comp['name']}] round {r}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    tmed, tmin = statistics.median(times["torch"]), min(times["torch"])
    for k, ts in times.items():
        rows.append(
            {
                "component": comp["name"],
                "desc": comp["desc"],
                "variant": k,
                **info[k],
                "median_s": statistics.median(ts),
                "min_s": min(ts),
                "times_s": ts,
                "ratio_median": statistics.median(ts) / tmed,
                "ratio_min": min(ts) / tmin,
            }
        )
    del comp, runs
    gc.collect()
    return rows


def _print_table(rows):
    print(
        f"\n{'component':11s} {'variant':28s} {'compile s':>9s} {'median s':>9s} {'best s':>8s} "
        f"{'x torch(med)':>12s} {'x torch(best)':>13s} {'max|diff|':>9s}"
    )
    for r in rows:
        c = f"{r['compile_s']:9.1f}" if r["compile_s"] is not None else f"{'-':>9s}"
        print(
            f"{r['component']:11s} {r['variant']:28s} {c} {r['median_s']:9.2f} {r['min_s']:8.2f} "
            f"{r['ratio_median']:12.2f} {r['ratio_min']:13.2f} {r['max_abs_diff']:9.1e}"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--components", nargs="*", default=list(COMPONENTS), choices=list(COMPONENTS))
    p.add_argument("--variants", nargs="*", default=["default", "ynn-off"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write the rows (and metadata) as JSON here")
    a = p.parse_args(argv)

    import jax
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    meta = {
        "jax": jax.__version__,
        "torch": torch.__version__,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "cores": os.cpu_count(),
        "loadavg_start": os.getloadavg()[0],
        "devices": len(jax.devices()),
    }
    rows = []
    for name in a.components:
        print(f"== {name}", flush=True)
        rows += bench_component(COMPONENTS[name], a.variants, a.reps)
    meta["loadavg_end"] = os.getloadavg()[0]
    _print_table(rows)
    print(
        json.dumps(
            {
                "meta": meta,
                "summary": [
                    {
                        k: r[k]
                        for k in ("component", "variant", "compile_s", "median_s", "min_s", "ratio_median", "ratio_min")
                    }
                    for r in rows
                ],
            }
        )
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
