"""One SD 1.5 UNet step (512x512, classifier-free-guidance batch 2, float32) taken apart: every kind of block timed
in isolation at its real shapes, sdjax (jitted, params prepared as the denoising loop prepares them) against the
same diffusers PyTorch module with the same random weights, calls interleaved in one process.

    python benchmarks/profile_unet_cpu.py                    # the table
    python benchmarks/profile_unet_cpu.py --reps 5 --json unet_pieces.json
    python benchmarks/profile_unet_cpu.py --only attn --hlo  # attention pieces + XLA temp memory / HLO notes
    python benchmarks/profile_unet_cpu.py --full             # also the whole UNet step (two 3.4 GB copies)
    python benchmarks/profile_unet_cpu.py --only none --full # the whole step alone
    python benchmarks/profile_unet_cpu.py --torch-profile    # torch.profiler op table of the 4096-token attention

Pieces (`PIECES`): time embedding, conv_in, the output head (GroupNorm, SiLU, conv_out), every ResnetBlock2D shape
(input channels, output channels, resolution) with its count in the step, every Transformer2DModel (channels,
tokens), down/up samplers; and, as sub-pieces of the transformers (not added to the step), self-attention (attn1)
and cross-attention (attn2, 77 context tokens) at 64^2, 32^2, 16^2 and 8^2 tokens and the GEGLU feed-forward.
"share" is count x median over the sum of all step pieces, per framework. Ratios < 1: sdjax faster.

Each round calls every variant once (the order alternates), so load from other work slows both alike; only the
ratios travel between runs. `--variants` adds sdjax alternatives of a piece (attention implementations,
Winograd thresholds) timed in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

B, LAT, CTX, CTX_DIM, TEMB = 2, 64, 77, 768, 1280

# (kind, key, count in one step). Resnet key: (cin, cout, res); transformer: (channels, res); sampler: (c, res).
PIECES = [
    ("time_embedding", (), 1),
    ("conv_in", (), 1),
    ("resnet", (320, 320, 64), 2),
    ("transformer", (320, 64), 5),
    ("downsample", (320, 64), 1),
    ("resnet", (320, 640, 32), 1),
    ("resnet", (640, 640, 32), 1),
    ("transformer", (640, 32), 5),
    ("downsample", (640, 32), 1),
    ("resnet", (640, 1280, 16), 1),
    ("resnet", (1280, 1280, 16), 1),
    ("transformer", (1280, 16), 5),
    ("downsample", (1280, 16), 1),
    ("resnet", (1280, 1280, 8), 4),  # down_blocks_3 (2) + mid block (2)
    ("transformer", (1280, 8), 1),
    ("resnet", (2560, 1280, 8), 3),
    ("upsample", (1280, 8), 1),
    ("resnet", (2560, 1280, 16), 2),
    ("resnet", (1920, 1280, 16), 1),
    ("upsample", (1280, 16), 1),
    ("resnet", (1920, 640, 32), 1),
    ("resnet", (1280, 640, 32), 1),
    ("resnet", (960, 640, 32), 1),
    ("upsample", (640, 32), 1),
    ("resnet", (960, 320, 64), 1),
    ("resnet", (640, 320, 64), 2),
    ("out", (), 1),
]
# Sub-pieces of the transformers (each transformer = GroupNorm + proj_in + attn1 + attn2 + ff + proj_out + norms).
SUB_PIECES = [(kind, (c, res), 0) for c, res in ((320, 64), (640, 32), (1280, 16), (1280, 8)) for kind in ("attn1",)]
SUB_PIECES += [(kind, (c, res), 0) for c, res in ((320, 64), (640, 32), (1280, 16), (1280, 8)) for kind in ("attn2",)]
SUB_PIECES += [("ff", (c, res), 0) for c, res in ((320, 64), (640, 32), (1280, 16))]


def name_of(kind, key):
    if kind == "resnet":
        return f"resnet {key[0]}->{key[1]} @{key[2]}^2"
    if kind in ("transformer", "attn1", "attn2", "ff"):
        return f"{kind} {key[0]}ch @{key[1]}^2 ({key[1] ** 2} tok)"
    if kind in ("downsample", "upsample"):
        return f"{kind} {key[0]}ch @{key[1]}^2"
    return kind


# ---------------------------------------------------------------------------------------------- builders
def _builders(torch, jax, jnp):
    """kind -> build(key) -> (torch_module, torch_args, sdjax_module, sdjax_args_builder(torch_args))."""
    import diffusers.models.attention_processor as dap
    import diffusers.models.embeddings as demb
    import diffusers.models.resnet as dres
    import diffusers.models.transformers.transformer_2d as dt2d
    from diffusers.models.attention import FeedForward as TFeedForward

    from sdjax.models import layers

    def nhwc(t):
        return jnp.asarray(t.permute(0, 2, 3, 1).contiguous().numpy())

    def tok(t):
        return jnp.asarray(t.numpy())

    def randn(*shape):
        return torch.randn(*shape)

    def resnet(key):
        cin, cout, res = key
        tm = dres.ResnetBlock2D(in_channels=cin, out_channels=cout, temb_channels=TEMB, groups=32, eps=1e-5)
        x, temb = randn(B, cin, res, res), randn(B, TEMB)
        jm = layers.ResnetBlock2D(cout, 32, 1e-5, "silu")
        return tm, (x, temb), jm, (nhwc(x), tok(temb)), {}

    def transformer(key):
        c, res = key
        tm = dt2d.Transformer2DModel(
            num_attention_heads=8, attention_head_dim=c // 8, in_channels=c, cross_attention_dim=CTX_DIM,
            norm_num_groups=32, use_linear_projection=False,
        )  # fmt: skip
        x, ctx = randn(B, c, res, res), randn(B, CTX, CTX_DIM)
        jm = layers.Transformer2DModel(8, 1, 32, False)
        return tm, (x, ctx), jm, (nhwc(x), tok(ctx)), {}

    def attn(key, cross):
        c, res = key
        tm = dap.Attention(query_dim=c, heads=8, dim_head=c // 8, cross_attention_dim=CTX_DIM if cross else None)
        x = randn(B, res * res, c)
        jm = layers.Attention(8, c // 8)
        if cross:
            ctx = randn(B, CTX, CTX_DIM)
            return tm, (x, ctx), jm, (tok(x), tok(ctx)), {}
        return tm, (x,), jm, (tok(x),), {}

    def ff(key):
        c, res = key
        tm = TFeedForward(c, activation_fn="geglu")
        x = randn(B, res * res, c)
        return tm, (x,), layers.FeedForward(), (tok(x),), {}

    def sampler(key, up):
        c, res = key
        x = randn(B, c, res, res)
        if up:
            return dres.Upsample2D(c, use_conv=True, out_channels=c), (x,), layers.Upsample2D(c), (nhwc(x),), {}
        tm = dres.Downsample2D(c, use_conv=True, out_channels=c, padding=1)
        return tm, (x,), layers.Downsample2D(c, 1), (nhwc(x),), {}

    def time_embedding(key):
        proj = demb.Timesteps(320, flip_sin_to_cos=True, downscale_freq_shift=0)
        emb = demb.TimestepEmbedding(320, TEMB)

        class TorchTime(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = emb

            def forward(self, t):
                return self.emb(proj(t))

        class JaxTime(layers.nn.Module):
            @layers.nn.compact
            def __call__(self, t):
                e = layers.timestep_embedding(t, 320, flip_sin_to_cos=True, freq_shift=0)
                return layers.TimestepEmbedding(TEMB, name="emb")(e)

        t = torch.full((B,), 500.0)
        return TorchTime(), (t,), JaxTime(), (tok(t),), {}

    def conv_in(key):
        tm = torch.nn.Conv2d(4, 320, 3, padding=1)
        x = randn(B, 4, LAT, LAT)
        return tm, (x,), layers.conv(320, 3, dtype=jnp.float32), (nhwc(x),), {}

    def out(key):
        class TorchOut(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv_norm_out = torch.nn.GroupNorm(32, 320, eps=1e-5)
                self.conv_out = torch.nn.Conv2d(320, 4, 3, padding=1)

            def forward(self, x):
                return self.conv_out(torch.nn.functional.silu(self.conv_norm_out(x)))

        class JaxOut(layers.nn.Module):
            @layers.nn.compact
            def __call__(self, x):
                x = jax.nn.silu(layers.GroupNorm(32, 1e-5, name="conv_norm_out")(x))
                return layers.conv(4, 3, dtype=jnp.float32, name="conv_out")(x)

        x = randn(B, 320, LAT, LAT)
        return TorchOut(), (x,), JaxOut(), (nhwc(x),), {}

    return {
        "resnet": resnet,
        "transformer": transformer,
        "attn1": lambda k: attn(k, False),
        "attn2": lambda k: attn(k, True),
        "ff": ff,
        "downsample": lambda k: sampler(k, False),
        "upsample": lambda k: sampler(k, True),
        "time_embedding": time_embedding,
        "conv_in": conv_in,
        "out": out,
    }


def _convert(torch_module, jax_module, jax_args, replace):
    """The torch module's state dict as the sdjax module's params (the loader's key rule; `replace`: key fixes)."""
    import jax

    from sdjax.models.convert import convert_state_dict

    sd = {}
    for k, v in torch_module.state_dict().items():
        if k.startswith("Conv2d_0."):  # diffusers Downsample2D's old alias of `conv`
            continue
        for a, b in replace.items():
            k = k.replace(a, b)
        sd[k] = v.detach().numpy()
    expected = jax.eval_shape(lambda: jax_module.init(jax.random.key(0), *jax_args))["params"]
    return convert_state_dict(sd, expected, component=type(jax_module).__name__)


# ---------------------------------------------------------------------------------------------- timing
def _interleaved(variants: dict, reps: int) -> dict[str, list[float]]:
    names = list(variants)
    for n in names:  # warm-up
        variants[n]()
    times = {n: [] for n in names}
    for r in range(reps):
        for n in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            variants[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def _variant_settings(spec: str):
    """'attention=chunked' / 'winograd=256' / 'chunk=512' -> a dict of settings."""
    out = {}
    for part in spec.split(","):
        k, v = part.split("=")
        out[k] = v
    return out


ATTENTION_KINDS = ("transformer", "attn1", "attn2")
CONV_KINDS = ("resnet", "upsample", "downsample", "out", "conv_in")


def _applies(settings: dict, kind: str) -> bool:
    """Whether a variant's settings can change this piece (attention settings: attention pieces; Winograd: convs)."""
    if not settings:
        return True
    if ("attention" in settings or "chunk" in settings) and kind not in ATTENTION_KINDS:
        return False
    return not ("winograd" in settings and kind not in CONV_KINDS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="piece kinds to run (resnet, transformer, attn1, ...)")
    p.add_argument("--no-sub", action="store_true", help="skip the attention / feed-forward sub-pieces")
    p.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help="extra sdjax settings timed alongside, e.g. attention=xla winograd=256 chunk=512 mode=ynn-noconv "
        "(comma-joined; mode: sdjax.runtime's XLA:CPU library mode for that compile)",
    )
    p.add_argument("--hlo", action="store_true", help="report XLA temp memory and the largest buffers per piece")
    p.add_argument("--full", action="store_true", help="also time the whole UNet step (both frameworks)")
    p.add_argument("--torch-profile", action="store_true", help="torch.profiler table of attn1 at 4096 tokens")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from sdjax import runtime

    runtime.configure_cpu()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from sdjax.ops import conv as ops_conv

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    builders = _builders(torch, jax, jnp)
    pieces = PIECES + ([] if args.no_sub else SUB_PIECES)
    if args.only:
        pieces = [pc for pc in pieces if pc[0] in args.only]
    variant_specs = {"sdjax": {}} | {v: _variant_settings(v) for v in args.variants}

    def sdjax_call(jm, params, jargs, settings):
        """A compiled zero-argument call of the sdjax module under `settings` (+ the compiled executable)."""
        threshold = int(settings.get("winograd", ops_conv.WINOGRAD_MIN_CHANNELS))
        saved = ops_conv.WINOGRAD_MIN_CHANNELS
        ops_conv.WINOGRAD_MIN_CHANNELS = threshold
        try:
            prepared = jax.jit(ops_conv.prepare)(params)  # as the denoising loop: once, outside the step
        finally:
            ops_conv.WINOGRAD_MIN_CHANNELS = saved
        overrides = {}
        for field, key in (("implementation", "attention"), ("chunk_size", "chunk")):
            if key in settings:
                overrides[field] = int(settings[key]) if field == "chunk_size" else settings[key]
        module = jm
        if overrides:  # the attention field sits on Attention / Transformer2DModel modules
            fields = set(getattr(jm, "__dataclass_fields__", {}))
            module = jm.clone(**{k: v for k, v in overrides.items() if k in fields})
        fn = jax.jit(lambda p, *a: module.apply({"params": p}, *a))
        options = runtime.cpu_compiler_options(settings["mode"]) if "mode" in settings else {}
        compiled = fn.lower(prepared, *jargs).compile(compiler_options=options)
        return (lambda: jax.block_until_ready(compiled(prepared, *jargs))), compiled, module, prepared

    rows = []
    for kind, key, count in pieces:
        name = name_of(kind, key)
        tm, targs, jm, jargs, replace = builders[kind](key)
        tm = tm.eval()
        params = _convert(tm, jm, jargs, replace)
        params = jax.tree_util.tree_map(jnp.asarray, params)
        variants = {}
        compiled_of = {}

        def torch_run(tm=tm, targs=targs):
            with torch.inference_mode():
                return tm(*targs)

        variants["torch"] = torch_run
        check = None
        for vname, settings in variant_specs.items():
            if not _applies(settings, kind):
                continue
            run, compiled, module, prepared = sdjax_call(jm, params, jargs, settings)
            variants[vname] = run
            compiled_of[vname] = compiled
            if vname == "sdjax":  # numbers: sdjax vs torch on this piece
                got = np.asarray(run())
                ref = torch_run()
                ref = (ref[0] if isinstance(ref, tuple) else getattr(ref, "sample", ref)).numpy()
                if ref.ndim == 4 and got.ndim == 4:
                    ref = ref.transpose(0, 2, 3, 1)
                check = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-12))
        times = _interleaved(variants, args.reps)
        row = {
            "piece": name,
            "kind": kind,
            "key": list(key),
            "count": count,
            "max_rel_err": check,
            "median_s": {v: statistics.median(ts) for v, ts in times.items()},
            "best_s": {v: min(ts) for v, ts in times.items()},
        }
        cost = compiled_of["sdjax"].cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        row["gflop"] = float(cost.get("flops", float("nan"))) / 1e9 if cost else None
        if args.hlo:
            mem = compiled_of["sdjax"].memory_analysis()
            row["xla_temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0))
            hlo = compiled_of["sdjax"].as_text()
            row["hlo_has_while"] = " while(" in hlo or "while(" in hlo
            row["hlo_largest_f32"] = _largest_shapes(hlo)
        rows.append(row)
        m = row["median_s"]
        extra = "  ".join(f"{v}={m[v] / m['torch']:.2f}x" for v in variant_specs if v != "sdjax" and v in m)
        print(
            f"{name:40s} x{count}  sdjax {m['sdjax'] * 1e3:8.1f} ms  torch {m['torch'] * 1e3:8.1f} ms  "
            f"ratio {m['sdjax'] / m['torch']:.2f}  err {check:.1e}  {extra}",
            flush=True,
        )
        del tm, params, variants, compiled_of

    step_rows = [r for r in rows if r["count"]]
    for r in rows:  # a variant that does not apply to a piece runs it as sdjax does
        for v in variant_specs:
            r["median_s"].setdefault(v, r["median_s"]["sdjax"])
            r["best_s"].setdefault(v, r["best_s"]["sdjax"])
    totals = {v: sum(r["count"] * r["median_s"][v] for r in step_rows) for v in ["torch", *variant_specs]}
    for r in step_rows:
        r["share"] = {v: r["count"] * r["median_s"][v] / max(totals[v], 1e-12) for v in ("sdjax", "torch")}
    result = {"rows": rows, "step_sum_s": totals, "reps": args.reps, "variants": variant_specs}

    if args.torch_profile:
        result["torch_profile"] = _torch_profile(torch, builders)
    if args.full:
        modes = sorted({st["mode"] for st in variant_specs.values() if "mode" in st})
        result["full_step"] = _full_step(jax, jnp, torch, ops_conv, args.reps, modes)

    if rows:
        print()
        print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def _largest_shapes(hlo: str, n: int = 3) -> list[str]:
    """The `n` largest f32 array shapes in the HLO text (e.g. whether 4096x4096 scores exist)."""
    import re

    sizes = {}
    for m in re.finditer(r"f32\[([0-9,]+)\]", hlo):
        dims = [int(d) for d in m.group(1).split(",") if d]
        sizes[m.group(0)] = math.prod(dims) * 4
    return [f"{s} ({b / 2**20:.0f} MiB)" for s, b in sorted(sizes.items(), key=lambda kv: -kv[1])[:n]]


def _torch_profile(torch, builders) -> list[dict]:
    """torch.profiler's top CPU ops for attn1 at 4096 tokens (which SDPA kernel runs)."""
    from torch.profiler import ProfilerActivity, profile

    tm, targs, *_ = builders["attn1"]((320, 64))
    with torch.inference_mode():
        tm(*targs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            tm(*targs)
    out = []
    for ev in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]:
        out.append({"op": ev.key, "self_ms": ev.self_cpu_time_total / 1e3, "calls": ev.count})
    print("torch.profiler, attn1 320ch @64^2 (4096 tokens):")
    for o in out:
        print(f"  {o['op']:50s} {o['self_ms']:9.1f} ms  x{o['calls']}")
    return out


def _full_step(jax, jnp, torch, ops_conv, reps, modes=()) -> dict:
    """The whole SD 1.5 UNet step, both frameworks, same weights (sum-of-pieces check); `modes`: the sdjax step
    also compiled with each of these XLA:CPU library modes (`sdjax.runtime`), timed in the same rounds."""
    import diffusers

    from sdjax import runtime
    from sdjax.models.presets import ARCHITECTURES
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel, convert_unet

    cfg_raw = ARCHITECTURES["sd15"].unet
    tm = diffusers.UNet2DConditionModel.from_config(cfg_raw).eval()
    cfg = UNet2DConditionConfig.from_dict({k: v for k, v in cfg_raw.items() if not k.startswith("_")})
    params = convert_unet({k: v.numpy() for k, v in tm.state_dict().items()}, cfg, cast=jnp.asarray)
    params = jax.jit(ops_conv.prepare)(params)
    x, t, ctx = torch.randn(B, 4, LAT, LAT), torch.full((B,), 500.0), torch.randn(B, CTX, CTX_DIM)
    model = UNet2DConditionModel(cfg)
    xj, tj, cj = (jnp.asarray(a.numpy()) for a in (x, t, ctx))
    lowered = jax.jit(lambda p, x, t, c: model.apply({"params": p}, x, t, c)).lower(params, xj, tj, cj)
    compiled = {"sdjax": lowered.compile()}
    for mode in modes:
        compiled[f"sdjax mode={mode}"] = lowered.compile(compiler_options=runtime.cpu_compiler_options(mode))

    def torch_run():
        with torch.inference_mode():
            return tm(x, t, encoder_hidden_states=ctx).sample

    calls = {k: (lambda c=c: jax.block_until_ready(c(params, xj, tj, cj))) for k, c in compiled.items()}
    times = _interleaved({**calls, "torch": torch_run}, reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        "full UNet step: "
        + "  ".join(f"{k} {v:.2f} s" for k, v in med.items())
        + "  ratios "
        + "  ".join(f"{k} {med[k] / med['torch']:.2f}" for k in compiled)
    )
    return {"median_s": med, "best_s": {k: min(v) for k, v in times.items()}}


def table(result) -> str:
    """Markdown table of the pieces (step pieces with their share, then the transformer sub-pieces)."""
    variants = [v for v in result["variants"] if v != "sdjax"]
    head = "| piece | x | sdjax ms | torch ms | sdjax / torch | share sdjax | share torch | GFLOP |"
    head += "".join(f" {v} / torch |" for v in variants)
    lines = [head, "|" + "---|" * (8 + len(variants))]
    for r in result["rows"]:
        m = r["median_s"]
        share = r.get("share")
        cells = [
            r["piece"],
            str(r["count"]) if r["count"] else "(sub)",
            f"{m['sdjax'] * 1e3:.1f}",
            f"{m['torch'] * 1e3:.1f}",
            f"**{m['sdjax'] / m['torch']:.2f}**",
            f"{share['sdjax']:.1%}" if share else "",
            f"{share['torch']:.1%}" if share else "",
            f"{r['gflop']:.1f}" if r.get("gflop") else "",
        ]
        cells += [f"{m[v] / m['torch']:.2f}" for v in variants]
        lines.append("| " + " | ".join(cells) + " |")
    tot = result["step_sum_s"]
    lines.append(
        f"| **sum of step pieces** | | {tot['sdjax'] * 1e3:.0f} | {tot['torch'] * 1e3:.0f} | "
        f"**{tot['sdjax'] / tot['torch']:.2f}** | | | |" + "".join(f" {tot[v] / tot['torch']:.2f} |" for v in variants)
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
