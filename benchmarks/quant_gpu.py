"""The denoiser step with quantized weights on an accelerator: bf16 against weight-only int8 / fp8 and 8-bit compute
(`QuantPolicy(compute="fp8" | "int8")`: Dense layers and convs multiply 8-bit x 8-bit), SDXL's UNet at 1024x1024 by
default. `-static` variants give those products static input scales (`QuantPolicy(calibration=)`), recorded by one
UNet call on the benchmark's own inputs, as `sdjax calibrate` records them on prompts: no per-call `max|x|`
reduction in the program (TensorRT's fp8 UNet uses calibrated static scales too).

    python benchmarks/quant_gpu.py [--arch sdxl] [--batch 8,1] [--steps 10] [--reps 3] [--json out.json]
    python benchmarks/quant_gpu.py --arch tiny --batch 1 --steps 2 --reps 1      # a seconds-long check on CPU

Random full-size weights (the released config), made on the device in bf16; each variant's params derived from
them (`sdjax.quant.params.quantize_tree`) and run through `sdjax.quant.modules.DequantizingModule`, as a pipeline
loaded with `quantize=` runs them. A row is one program of `--steps` UNet calls in a `lax.fori_loop` (classifier-
free guidance: the UNet batch is twice the images), timed as the median of `--reps` calls after a warm call, per
step. `--batch 8` with SDXL is MLPerf Inference's text-to-image setting per UNet call (1024x1024, guidance on).
Also printed: the params' device bytes, the compile time, the output's relative error against bf16 after one
step, and how many fp8 matrix products the compiled program holds (cuBLASLt's fp8 custom calls on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

VARIANTS = (
    "bf16",
    "int8",
    "fp8",
    "fp8-compute",
    "fp8-compute-qdq",
    "fp8-compute-static",
    "int8-compute",
    "int8-compute-static",
)


def _unet(arch: str):
    import jax
    import jax.numpy as jnp

    from sdjax.models.presets import ARCHITECTURES, random_params
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel

    a = ARCHITECTURES[arch]
    config = UNet2DConditionConfig(**a.unet)
    unet = UNet2DConditionModel(config=config, dtype=jnp.bfloat16)
    shapes = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), UNet2DConditionModel.init_params_shape(config)
    )
    return a, unet, random_params(shapes, 0, jnp.bfloat16)


def _inputs(a, images: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    n, lat = 2 * images, a.size // 8
    x = jnp.asarray(rng.standard_normal((n, a.unet["in_channels"], lat, lat)), jnp.bfloat16)
    ctx = jnp.asarray(rng.standard_normal((n, 77, a.unet["cross_attention_dim"])), jnp.bfloat16)
    kw = {}
    if a.unet.get("addition_embed_type") == "text_time":
        pooled = a.unet["projection_class_embeddings_input_dim"] - 6 * a.unet["addition_time_embed_dim"]
        kw = {
            "text_embeds": jnp.asarray(rng.standard_normal((n, pooled)), jnp.bfloat16),
            "time_ids": jnp.tile(jnp.asarray([[a.size, a.size, 0, 0, a.size, a.size]], jnp.float32), (n, 1)),
        }
    return x, ctx, kw


def _qdq_dense(x, q, scale, bias, dtype, amax=None):
    """The fp8 product spelled as XLA's GEMM rewriter pattern (`dot(convert(fp8) * s, convert(fp8))`)."""
    import jax
    import jax.numpy as jnp

    from sdjax.quant import compute

    qx, sx = compute.quantize_input(x, "fp8", amax)
    xd = qx.astype(dtype) * sx.astype(dtype)
    y = jax.lax.dot_general(xd, q.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    y = (y * scale).astype(dtype)
    return y if bias is None else y + bias.astype(dtype)


def _variant(unet, params, name: str, inputs):
    """`(module, params)` of variant `name`; `inputs` `(x, t, ctx, kw)`: what a `-static` variant calibrates on."""
    import jax.numpy as jnp

    from sdjax.quant import modules
    from sdjax.quant import params as qparams

    if name == "bf16":
        return unet, params
    scheme = name.split("-")[0]
    compute = scheme if "compute" in name else None
    policy = qparams.QuantPolicy(scheme, components=("unet",), compute=compute)
    p = qparams.quantize_tree(params, policy, "unet")
    amax = _calibrated(unet, p, compute, inputs) if name.endswith("static") else None
    return modules.DequantizingModule(unet, jnp.bfloat16, compute, amax=amax), p


def _calibrated(unet, p, compute: str, inputs) -> dict[str, float]:
    """Each compute layer's input `max|x|` over one call on `inputs` (module path -> amax), recorded by the
    interceptor's `observe` hook as `sdjax.quant.calibrate` records it."""
    import jax
    import jax.numpy as jnp

    from sdjax.quant import modules

    seen: dict[str, float] = {}

    def observe(path, amax):
        seen[path] = max(seen.get(path, 0.0), float(amax))

    module = modules.DequantizingModule(unet, jnp.bfloat16, compute, observe=observe)
    x, t, ctx, kw = inputs
    jax.block_until_ready(jax.jit(lambda p, x, ctx, kw: module.apply({"params": p}, x, t, ctx, **kw))(p, x, ctx, kw))
    jax.effects_barrier()
    return seen


def run(arch: str, batches: list[int], steps: int, reps: int, variants: list[str]) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdjax.quant import compute
    from sdjax.quant import params as qparams

    a, unet, params = _unet(arch)
    direct = compute.dense_quantized  # the library's product (the qdq variant swaps in another for its row)
    t = jnp.float32(500.0)
    rows, reference = [], {}
    for images in batches:
        x, ctx, kw = _inputs(a, images)
        for name in variants:
            module, p = _variant(unet, params, name, (x, t, ctx, kw))
            compute.dense_quantized = _qdq_dense if name.endswith("qdq") else direct

            # the conditioning is an argument, as in a pipeline's program: closed over, it would be a constant
            # that XLA folds through (the fp8 input scales of the cross-attention projections included)
            def loop(p, x, ctx, kw, module=module):
                body = lambda i, x: x - 0.01 * module.apply({"params": p}, x, t, ctx, **kw).astype(x.dtype)
                return jax.lax.fori_loop(0, steps, body, x)

            one = jax.jit(lambda p, x, ctx, kw, module=module: module.apply({"params": p}, x, t, ctx, **kw))
            one = one.lower(p, x, ctx, kw).compile()
            out = np.asarray(one(p, x, ctx, kw).astype(jnp.float32))
            if name == "bf16":
                reference[images] = out
            ref = reference.get(images)
            rel = None if ref is None else float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            times, compile_s, hlo = [], None, one.as_text()
            if reps:  # reps 0: the accuracy and the one call's program only (no loop compiled, nothing timed)
                t0 = time.perf_counter()
                compiled = jax.jit(loop).lower(p, x, ctx, kw).compile()
                compile_s = time.perf_counter() - t0
                hlo = compiled.as_text()
                jax.block_until_ready(compiled(p, x, ctx, kw))
            for _ in range(reps):
                t1 = time.perf_counter()
                jax.block_until_ready(compiled(p, x, ctx, kw))
                times.append(time.perf_counter() - t1)
            row = {
                "variant": name,
                "images": images,
                "unet_batch": 2 * images,
                "ms_per_step": statistics.median(times) / steps * 1e3 if times else None,
                "best_ms_per_step": min(times) / steps * 1e3 if times else None,
                "params_bytes": qparams.nbytes(p),
                "compile_s": compile_s,
                "rel_err_vs_bf16": rel,
                "f8_mentions": hlo.lower().count("f8e4m3fn"),
                "s8_mentions": hlo.count("s8["),
                "cublas_f8_calls": hlo.count("__cublas$lt$matmul$f8"),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            compute.dense_quantized = direct
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sdxl")
    ap.add_argument("--batch", default="8,1", help="images per UNet call (comma-separated; CFG doubles it)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per row (0: accuracy only, nothing timed)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.reps < 0:
        raise SystemExit(f"--reps {args.reps}: expected 0 or more")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; expected some of {VARIANTS}")
    import jax

    rows = run(args.arch, [int(b) for b in args.batch.split(",")], args.steps, args.reps, variants)
    base = {r["images"]: r["ms_per_step"] for r in rows if r["variant"] == "bf16"}
    print(f"\n{jax.devices()[0].device_kind}, {args.arch}, {args.steps} steps a program, medians of {args.reps}")
    print(f"{'variant':<21}{'images':>7}{'ms/step':>10}{'vs bf16':>9}{'params GiB':>12}{'rel err':>10}{'f8 gemms':>10}")
    for r in rows:
        ms, b = r["ms_per_step"], base.get(r["images"])
        ratio = ms / b if ms is not None and b else float("nan")
        err = "" if r["rel_err_vs_bf16"] is None else f"{r['rel_err_vs_bf16']:.4f}"
        print(
            f"{r['variant']:<21}{r['images']:>7}{float('nan') if ms is None else ms:>10.2f}{ratio:>9.3f}"
            f"{r['params_bytes'] / 2**30:>12.2f}{err:>10}{r['cublas_f8_calls']:>10}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
