"""Micro-benchmarks: the SD 1.5 UNet's dominant ops at their real shapes (batch 2, 64x64 latents, fp32),
JAX/XLA:CPU variants against PyTorch, timed side by side in one process.

Every round runs each variant of a case once (the order rotates each round), so a machine shared with other
work slows all variants alike; the table shows per-variant median and best wall times and their ratio to
PyTorch's (< 1: JAX faster). Run it with the cores to itself for absolute numbers; ratios survive some load.

    python benchmarks/cpu_ops.py                         # every case, this process's XLA_FLAGS
    python benchmarks/cpu_ops.py --cases conv3x3 attention --reps 7 --json ops.json
    python benchmarks/cpu_ops.py --flag-sweep            # a core set under several XLA_FLAGS (subprocesses)

JAX variants: `ynn` is XLA:CPU's default in jaxlib 0.10 (dots, convolutions and some elementwise/reduce
fusions go to YNNPACK); `eigen` compiles the same function with
`compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""}` (XLA's own emitters + Eigen for dots and
convolutions, what jaxlib <= 0.7 did). Conv lowerings are those of `benchmarks/conv_lowerings.py` plus NCHW
`lax.conv_general_dilated`; attention variants are described in `sdjax.ops.attention`.
Torch uses `torch.set_num_threads(n)` with n = the number of cores (2 on the reference machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


# ---------------------------------------------------------------------------------------------- timing
def _bench(variants: dict, reps: int) -> dict[str, list[float]]:
    """variants: name -> zero-argument callable that blocks until done. Interleaved rounds, rotated order."""
    names = list(variants)
    for n in names:  # warm-up (and first-call costs) outside the timed rounds
        variants[n]()
    times = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            variants[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def _median(xs):
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


# ---------------------------------------------------------------------------------------------- cases
def _cases():
    """name -> (group, description, builder). A builder returns (variants dict, flops or None)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from conv_lowerings import conv2d
    from jax import lax

    from sdjax.ops import attention as attn_ops

    rng = np.random.default_rng(0)

    def randn(*shape, scale=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    def jit_variant(fn, args, options=None):
        compiled = jax.jit(fn).lower(*args).compile(compiler_options=options or {})
        return lambda: compiled(*args).block_until_ready()

    def torch_variant(fn):
        def run():
            with torch.inference_mode():
                fn()

        return run

    # ---- 3x3 / 1x1 convolutions (NHWC activations, HWIO kernels)
    def conv_case(b, h, w, cin, cout, k, stride, pad):
        def build():
            x = randn(b, h, w, cin)
            kern = randn(k, k, cin, cout, scale=1 / math.sqrt(k * k * cin))
            bias = randn(cout, scale=0.1)
            xj, kj, bj = map(jnp.asarray, (x, kern, bias))
            xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
            kt = torch.from_numpy(kern).permute(3, 2, 0, 1).contiguous()
            bt = torch.from_numpy(bias)
            xj_nchw, kj_oihw = jnp.asarray(xt.numpy()), jnp.asarray(kt.numpy())
            v = {"torch": torch_variant(lambda: torch.nn.functional.conv2d(xt, kt, bt, stride=stride, padding=pad))}

            def nchw(x, k, bb):
                y = lax.conv_general_dilated(
                    x, k, (stride, stride), ((pad, pad), (pad, pad)), dimension_numbers=("NCHW", "OIHW", "NCHW")
                )
                return y + bb[None, :, None, None]

            for impl in ("xla", "shifted", "im2col") if k > 1 else ("xla",):
                fn = lambda x, k_, bb, impl=impl: conv2d(x, k_, bb, stride=stride, padding=pad, impl=impl)
                v[f"nhwc-{impl}/ynn"] = jit_variant(fn, (xj, kj, bj))
                v[f"nhwc-{impl}/eigen"] = jit_variant(fn, (xj, kj, bj), NO_YNN)
            v["nchw-xla/ynn"] = jit_variant(nchw, (xj_nchw, kj_oihw, bj))
            v["nchw-xla/eigen"] = jit_variant(nchw, (xj_nchw, kj_oihw, bj), NO_YNN)
            v["nhwc-xla-HIGHEST/ynn"] = jit_variant(
                lambda x, k_, bb: conv2d(
                    x, k_, bb, stride=stride, padding=pad, impl="xla", precision=lax.Precision.HIGHEST
                ),
                (xj, kj, bj),
            )
            ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
            return v, 2 * b * ho * wo * cout * cin * k * k

        return build

    # ---- GroupNorm(32) + SiLU (ResnetBlock2D's norm1/act), NHWC
    def gn_case(b, h, w, c):
        def build():
            x = randn(b, h, w, c)
            scale, bias = randn(c), randn(c)
            xj, sj, bj = map(jnp.asarray, (x, scale, bias))
            xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
            st, bt = torch.from_numpy(scale), torch.from_numpy(bias)

            def gn_silu(x, s, bb):
                xg = x.reshape(b, h * w, 32, c // 32)
                m = jnp.mean(xg, axis=(1, 3), keepdims=True)
                var = jnp.mean(jnp.square(xg - m), axis=(1, 3), keepdims=True)
                y = ((xg - m) * lax.rsqrt(var + 1e-5)).reshape(x.shape) * s + bb
                return jax.nn.silu(y)

            v = {
                "torch": torch_variant(
                    lambda: torch.nn.functional.silu(torch.nn.functional.group_norm(xt, 32, st, bt, 1e-5))
                )
            }
            v["jax/ynn"] = jit_variant(gn_silu, (xj, sj, bj))
            v["jax/eigen"] = jit_variant(gn_silu, (xj, sj, bj), NO_YNN)
            return v, None

        return build

    # ---- dense layers (tokens x in) @ (in x out)
    def dense_case(m, k, n):
        def build():
            x, wgt = randn(m, k), randn(k, n, scale=1 / math.sqrt(k))
            xj, wj = jnp.asarray(x), jnp.asarray(wgt)
            xt, wt = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(wgt.T))  # Linear weight (out, in)
            v = {"torch": torch_variant(lambda: torch.nn.functional.linear(xt, wt))}
            v["jax/ynn"] = jit_variant(jnp.matmul, (xj, wj))
            v["jax/eigen"] = jit_variant(jnp.matmul, (xj, wj), NO_YNN)
            v["jax-HIGHEST/ynn"] = jit_variant(
                lambda a, b_: jnp.matmul(a, b_, precision=lax.Precision.HIGHEST), (xj, wj)
            )
            return v, 2 * m * k * n

        return build

    # ---- attention on projected (B, T, H*D) inputs
    def attention_case(b, t, s, heads, d):
        def build():
            q, k, v_ = randn(b, t, heads * d), randn(b, s, heads * d), randn(b, s, heads * d)
            qj, kj, vj = map(jnp.asarray, (q, k, v_))
            qt, kt, vt = (torch.from_numpy(a).view(b, -1, heads, d).transpose(1, 2) for a in (q, k, v_))

            def torch_materialized():  # diffusers AttnProcessor (not 2_0): baddbmm + softmax + bmm
                qq, kk, vv = (a.reshape(b * heads, -1, d) for a in (qt, kt, vt))
                p = torch.baddbmm(
                    torch.empty(qq.shape[0], t, s), qq, kk.transpose(1, 2), beta=0, alpha=1 / math.sqrt(d)
                ).softmax(-1)
                return torch.bmm(p, vv)

            v = {
                "torch-sdpa": torch_variant(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)),
                "torch-materialized": torch_variant(torch_materialized),
            }
            for impl in attn_ops.IMPLEMENTATIONS:
                if impl in ("auto", "pallas"):  # pallas is the TPU kernel
                    continue
                fn = lambda q, k, v, impl=impl: attn_ops.attention(q, k, v, heads=heads, implementation=impl)
                v[f"{impl}/ynn"] = jit_variant(fn, (qj, kj, vj))
                v[f"{impl}/eigen"] = jit_variant(fn, (qj, kj, vj), NO_YNN)
            for chunk in (128, 256, 512, 2048):  # query-block sizes of "chunked" (its default: 1024)
                if chunk < t:
                    fn = lambda q, k, v, c=chunk: attn_ops.attention(
                        q, k, v, heads=heads, implementation="chunked", chunk_size=c
                    )
                    v[f"chunked-{chunk}/eigen"] = jit_variant(fn, (qj, kj, vj), NO_YNN)
            return v, 4 * b * heads * t * s * d

        return build

    # ---- elementwise / normalization pieces of the transformer block
    def layernorm_case(m, c):
        def build():
            x = randn(m, c)
            xj, xt = jnp.asarray(x), torch.from_numpy(x)

            def ln(x):
                mu = x.mean(-1, keepdims=True)
                var = jnp.square(x - mu).mean(-1, keepdims=True)
                return (x - mu) * lax.rsqrt(var + 1e-5)

            v = {"torch": torch_variant(lambda: torch.nn.functional.layer_norm(xt, (c,)))}
            v["jax/ynn"] = jit_variant(ln, (xj,))
            v["jax/eigen"] = jit_variant(ln, (xj,), NO_YNN)
            return v, None

        return build

    def geglu_case(m, c):
        def build():
            x = randn(m, 2 * c)
            xj, xt = jnp.asarray(x), torch.from_numpy(x)

            def geglu(x):
                a, g = jnp.split(x, 2, axis=-1)
                return a * jax.nn.gelu(g, approximate=False)

            v = {"torch": torch_variant(lambda: (lambda a, g: a * torch.nn.functional.gelu(g))(*xt.chunk(2, -1)))}
            v["jax/ynn"] = jit_variant(geglu, (xj,))
            v["jax/eigen"] = jit_variant(geglu, (xj,), NO_YNN)
            return v, None

        return build

    def softmax_case(n, t, s):
        def build():
            x = randn(n, t, s)
            xj, xt = jnp.asarray(x), torch.from_numpy(x)
            v = {"torch": torch_variant(lambda: torch.softmax(xt, -1))}
            v["jax/ynn"] = jit_variant(lambda a: jax.nn.softmax(a, axis=-1), (xj,))
            v["jax/eigen"] = jit_variant(lambda a: jax.nn.softmax(a, axis=-1), (xj,), NO_YNN)
            return v, None

        return build

    c = {}
    for h, cin, cout, stride in [
        (64, 320, 320, 1),
        (32, 640, 640, 1),
        (16, 1280, 1280, 1),
        (8, 1280, 1280, 1),
        (32, 320, 640, 1),
        (16, 640, 1280, 1),
        (64, 640, 320, 1),
        (32, 1280, 640, 1),
        (16, 2560, 1280, 1),
        (64, 320, 320, 2),
        (16, 1280, 1280, 2),
    ]:
        desc = f"3x3 s{stride} (2,{h},{h},{cin})->{cout}"
        c[f"conv3x3_{h}_{cin}_{cout}_s{stride}"] = ("conv3x3", desc, conv_case(2, h, h, cin, cout, 3, stride, 1))
    for h, cin, cout in [(64, 320, 320), (64, 640, 320), (32, 1280, 640)]:
        c[f"conv1x1_{h}_{cin}_{cout}"] = (
            "conv1x1",
            f"1x1 (2,{h},{h},{cin})->{cout}",
            conv_case(2, h, h, cin, cout, 1, 1, 0),
        )
    for h, ch in [(64, 320), (32, 640), (16, 1280)]:
        c[f"gn_silu_{h}_{ch}"] = ("norm", f"GroupNorm32+SiLU (2,{h},{h},{ch})", gn_case(2, h, h, ch))
    for m, k, n in [(8192, 320, 320), (8192, 320, 2560), (8192, 1280, 320), (2048, 640, 5120), (512, 1280, 1280)]:
        c[f"dense_{m}_{k}_{n}"] = ("dense", f"({m},{k})@({k},{n})", dense_case(m, k, n))
    for t, s, heads, d in [(4096, 4096, 8, 40), (4096, 77, 8, 40), (1024, 1024, 8, 80), (256, 256, 8, 160)]:
        c[f"attention_{t}_{s}_{d}"] = ("attention", f"B2 T{t} S{s} {heads}x{d}", attention_case(2, t, s, heads, d))
    c["layernorm_8192_320"] = ("elementwise", "LayerNorm (8192,320)", layernorm_case(8192, 320))
    c["geglu_8192_1280"] = ("elementwise", "GEGLU a*gelu(g) (8192,2x1280)", geglu_case(8192, 1280))
    c["softmax_16_1024_4096"] = ("elementwise", "softmax (16,1024,4096)", softmax_case(16, 1024, 4096))
    return c


SWEEP_CASES = [
    "conv3x3_64_320_320_s1",
    "conv3x3_16_1280_1280_s1",
    "conv1x1_64_640_320",
    "dense_8192_320_2560",
    "gn_silu_64_320",
    "attention_4096_4096_40",
]
SWEEP_FLAGS = [
    "",
    "--xla_cpu_experimental_ynn_fusion_type=",
    "--xla_force_host_platform_device_count=8",
    "--xla_cpu_multi_thread_eigen=false",
    "--xla_cpu_enable_fast_math=true",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce --xla_cpu_experimental_ynn_fusion_type=",
    "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot,eltwise,reduce "
    "--xla_cpu_experimental_ynn_fusion_type=",
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
]


def _meta():
    import jax
    import jaxlib
    import torch

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "torch": torch.__version__,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg()[0],
        "python": platform.python_version(),
    }


def run(case_names: list[str] | None, groups: list[str] | None, reps: int) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    cases = _cases()
    selected = [
        n
        for n, (g, _, _) in cases.items()
        if (not case_names or n in case_names or any(n.startswith(p) for p in case_names))
        and (not groups or g in groups)
    ]
    results = []
    for name in selected:
        group, desc, build = cases[name]
        variants, flops = build()
        times = _bench(variants, reps)
        ref = "torch" if "torch" in times else "torch-sdpa"
        ref_med, ref_min = _median(times[ref]), min(times[ref])
        for vname, ts in times.items():
            med, best = _median(ts), min(ts)
            results.append(
                {
                    "case": name,
                    "group": group,
                    "desc": desc,
                    "variant": vname,
                    "median_ms": med * 1e3,
                    "min_ms": best * 1e3,
                    "ratio_median": med / ref_med,
                    "ratio_min": best / ref_min,
                    "gflops_best": flops / best / 1e9 if flops else None,
                    "reps": len(ts),
                }
            )
        _print_case(results[-len(times) :])
        del variants
    return {"meta": _meta(), "results": results}


def _print_case(rows):
    r0 = rows[0]
    print(f"\n{r0['case']}  [{r0['desc']}]")
    print(
        f"  {'variant':28s} {'median ms':>10s} {'best ms':>9s} {'x torch(med)':>12s} {'x torch(best)':>13s} "
        f"{'GFLOP/s':>8s}"
    )
    for r in rows:
        gf = f"{r['gflops_best']:8.1f}" if r["gflops_best"] else " " * 8
        print(
            f"  {r['variant']:28s} {r['median_ms']:10.1f} {r['min_ms']:9.1f} {r['ratio_median']:12.2f} "
            f"{r['ratio_min']:13.2f} {gf}",
            flush=True,
        )


def flag_sweep(reps: int, cases: list[str]) -> dict:
    """Re-run `cases` in a fresh process per XLA_FLAGS setting (flags are read once, at backend start)."""
    out = {"meta": None, "sweep": []}
    for flags in SWEEP_FLAGS:
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        cmd = [sys.executable, __file__, "--reps", str(reps), "--cases", *cases, "--json", "/dev/stdout", "--quiet"]
        print(f"\n=== XLA_FLAGS={flags!r}", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"  failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
            out["sweep"].append({"XLA_FLAGS": flags, "error": proc.stderr[-2000:]})
            continue
        data = json.loads(proc.stdout[proc.stdout.index("{") :])
        out["meta"] = out["meta"] or data["meta"]
        for r in data["results"]:
            if r["variant"] in (
                "nhwc-xla/ynn",
                "nhwc-xla/eigen",
                "jax/ynn",
                "jax/eigen",
                "xla/ynn",
                "chunked/ynn",
                "chunked/eigen",
                "xla/eigen",
            ):
                print(
                    f"  {r['case']:28s} {r['variant']:16s} x torch: median {r['ratio_median']:.2f}  "
                    f"best {r['ratio_min']:.2f}   ({r['min_ms']:.1f} ms)",
                    flush=True,
                )
        out["sweep"].append({"XLA_FLAGS": flags, "results": data["results"]})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="*", help="case names or prefixes (default: all)")
    p.add_argument("--groups", nargs="*", help="conv3x3 conv1x1 norm dense attention elementwise")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--flag-sweep", action="store_true", help="compare XLA_FLAGS settings in subprocesses")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull if a.quiet else sys.stdout):
        data = flag_sweep(a.reps, a.cases or SWEEP_CASES) if a.flag_sweep else run(a.cases, a.groups, a.reps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
    else:
        print("\n" + json.dumps({"meta": data["meta"]}))


if __name__ == "__main__":
    main()
