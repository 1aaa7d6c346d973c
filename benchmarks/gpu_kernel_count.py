"""How many GPU kernels a UNet step compiles to, by kind, on a machine without a GPU (docs/benchmarks.md: the H100
profile of the SD 1.5 step, 932 kernels: elementwise 283, reductions 187, transposes 148).

    python3 -m venv /tmp/cudavenv       # a separate venv: the CUDA plugin never goes into the project's
    /tmp/cudavenv/bin/pip install jax==0.10.2 jaxlib==0.10.2 jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 \
        "nvidia-cudnn-cu12>=9.8,<10" flax numpy safetensors tokenizers huggingface_hub pillow typer rich
    /tmp/cudavenv/bin/pip install --no-deps -e .
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python \
        benchmarks/gpu_kernel_count.py --target-config h100_sxm.txtpb [--arch sd15] [--loop 5] [--split-head-dim] \
        [--json out.json] [--hlo out.hlo.txt]
    ... --arch tiny             # a seconds-long check (8 s)

One UNet call (classifier-free guidance: batch 2 x `--images`, latents `size / 8`, bf16), or with `--loop N` a
`lax.fori_loop` of N calls as `gpu_unet_loop.py` / `gpu_unet_profile.py` run it (then the loop body's kernels are
counted, once per step, and what XLA hoisted out of the loop is reported apart), is lowered from abstract params
(`jax.ShapeDtypeStruct` on the device) for a compile-only CUDA device and compiled. The device comes from a
`GpuTargetConfigProto` text (`benchmarks/cuda_aot_probe.py`): XLA's `xla/backends/gpu/target_config/specs/
h100_sxm.txtpb`, less the fields the installed proto rejects (jaxlib 0.10.2: `collective_memory_granularity`).

The optimized HLO's kernels (fusions, custom calls and unfused ops of the entry computation and of what it runs:
loop bodies, command buffers, calls) are put in the profile's classes: convolutions (cuDNN), matrix products
(cuBLAS), attention (cuDNN flash attention), reductions (a fusion with a `reduce`: XLA's kInput reduction emitter,
Triton normalization fusions), transposes (a fusion whose hero is a `transpose`, layout copies), concatenates, and
elementwise (the other kLoop fusions). Each kernel's `op_name` metadata (jax's name stack: the flax module path)
names the model part it computes, so each class splits into GroupNorm, LayerNorm, attention head split/merge, ...

How the count differs from what a GPU runs:
- attention: `jax.nn.dot_product_attention(implementation="cudnn")` asks the installed cuDNN for its version. With
  no cuDNN library in the venv (the CUDA plugin brings none) sdjax falls back to XLA's attention (score products, a
  float32 softmax: matrix products, reductions and elementwise kernels) where a GPU runs one cuDNN kernel; with
  `nvidia-cudnn-cu12` installed (no GPU or driver needed) the program has the cuDNN attention a GPU traces. The
  script says which. Head widths over 128 (SD 1.5's 1280-channel level) use XLA's attention either way.
- nothing is autotuned (no GPU to time candidates), and Triton GEMM fusions are off (`--xla_gpu_enable_triton_gemm=
  false`: their tiling failed for small matrices with jaxlib 0.10.2), so matrix products are cuBLAS calls where a
  GPU may choose Triton GEMM fusions, and layouts XLA picks after autotuning may differ.
- counts, not times: a kernel count says nothing about the bytes each kernel moves.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

# The profile's classes, in its order.
CLASSES = (
    "convolution",
    "matrix product",
    "elementwise (kLoop)",
    "reduction (kInput)",
    "attention (cuDNN)",
    "transpose / copy",
    "concatenate",
    "other",
)

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_NOT_KERNELS = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
}


def parse_hlo(text: str) -> tuple[dict[str, list[dict]], str]:
    """Optimized HLO text -> ({computation name: [instruction]}, entry name); an instruction is a dict of its
    name, opcode, shape and the rest of its line (operands and attributes)."""
    comps: dict[str, list[dict]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line.strip())
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            comps[current].append({"name": m.group(2), "shape": m.group(3), "opcode": m.group(4), "rest": m.group(5)})
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _attr(rest: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", rest)
    return m.group(1) if m else None


def _op_name(rest: str) -> str:
    m = re.search(r'op_name="([^"]*)"', rest)
    return m.group(1) if m else ""


def kernels(comps: dict[str, list[dict]], entry: str) -> list[tuple[dict, bool]]:
    """The instructions that launch work, each with whether it runs inside a loop: those of the entry computation
    and of the computations it runs (command buffers and other `call`s, loop bodies, conditional branches), not
    those inside fusions or reducers."""
    out, todo, seen = [], [(entry, False)], set()
    while todo:
        name, in_loop = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for ins in comps[name]:
            op, rest = ins["opcode"], ins["rest"]
            if op == "call" or op.endswith("-start") and "calls=" in rest:
                todo.append((_attr(rest, "calls") or _attr(rest, "to_apply"), in_loop))
            elif op == "while":
                todo += [(_attr(rest, "body"), True), (_attr(rest, "condition"), True)]
            elif op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", rest)
                todo += [(b.strip().lstrip("%"), in_loop) for b in m.group(1).split(",")] if m else []
            elif op not in _NOT_KERNELS and not op.endswith("-done"):
                out.append((ins, in_loop))
    return out


def _fused(comps, ins) -> list[dict]:
    """The instructions inside a fusion (nested fusions included)."""
    out, todo = [], [_attr(ins["rest"], "calls")]
    while todo:
        for sub in comps.get(todo.pop(), []):
            out.append(sub)
            if sub["opcode"] == "fusion":
                todo.append(_attr(sub["rest"], "calls"))
    return out


def classify(ins, fused: list[dict]) -> tuple[str, str]:
    """(profile class, detail) of one kernel instruction; `fused`: its fused instructions (fusions only).

    A fusion is classed by the op that decides how XLA emits it (its "hero"): a `reduce` makes a reduction kernel
    whatever the fusion kind, a `transpose` a tiled transpose (XLA marks those kInput too), a `concatenate` a
    concatenate; the rest are elementwise (kLoop)."""
    op, rest = ins["opcode"], ins["rest"]
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', rest).group(1)
        if "fmha" in target or "attention" in target.lower():
            return "attention (cuDNN)", target
        if "conv" in target:
            return "convolution", target
        if "gemm" in target or "matmul" in target:
            return "matrix product", target
        return "other", target
    if op in ("copy", "transpose"):
        return "transpose / copy", op
    if op in ("convolution", "dot", "concatenate"):
        return {"convolution": "convolution", "dot": "matrix product", "concatenate": "concatenate"}[op], op
    if op != "fusion":
        return "other", op
    kind = _attr(rest, "kind") or "?"
    ops = collections.Counter(sub["opcode"] for sub in fused)
    if kind == "kCustom":
        m = re.search(r'"kind":"([^"]*)"', rest)
        kind = m.group(1) if m else kind
        if "fmha" in kind or "sdpa" in kind:
            return "attention (cuDNN)", kind
    if ops["convolution"] or "conv" in kind:
        return "convolution", kind
    if ops["dot"] or "gemm" in kind:
        return "matrix product", kind
    if ops["reduce"]:
        return "reduction (kInput)", f"{kind} reduce"
    if ops["transpose"] or ops["copy"]:
        return "transpose / copy", f"{kind} transpose"
    if ops["concatenate"]:
        return "concatenate", f"{kind} concatenate"
    if kind == "kCustom" or kind.startswith("__"):
        return "other", kind
    return "elementwise (kLoop)", kind


# The part of the model a kernel computes, from the op_name metadata (jax's name stack: the flax module path, then
# the jax op): the first role below that any instruction of the kernel names.
_ROLES = (
    ("attention core", re.compile(r"/attn\d/.*(BTNH|BNTS|softmax|vmap|dot_product|scan|while)")),
    ("LayerNorm", re.compile(r"/transformer_blocks_\d+/norm\d/")),
    ("GroupNorm", re.compile(r"/(resnets_\d+/norm\d|attentions_\d+/norm|conv_norm_out|group_norm)/")),
    ("attention head split/merge", re.compile(r"/attn\d/(transpose|reshape|convert_element_type)$")),
    ("attention projections", re.compile(r"/attn\d/to_")),
    ("feed-forward (GEGLU)", re.compile(r"/ff/")),
    ("transformer proj_in/out", re.compile(r"/attentions_\d+/proj_(in|out)/")),
    ("time embedding", re.compile(r"time_emb|time_embedding|/sin$|/cos$")),
    ("convolution", re.compile(r"/(conv\w*|downsamplers_\d+|upsamplers_\d+)/")),
    ("skip concatenate", re.compile(r"/up_blocks_\d+/concatenate")),
    ("SiLU", re.compile(r"jit\(silu\)")),
    ("residual add", re.compile(r"/add$")),
    ("NCHW <-> NHWC", re.compile(r"UNet2DConditionModel/transpose$")),
)


def role(names: list[str], operands: str) -> str:
    for label, pattern in _ROLES:
        if any(pattern.search(n) for n in names):
            return label
    if any(n.startswith("p[") for n in names) or re.search(r"p__\w*kernel", operands):
        return "weight relayout"
    if re.search(r"p__\w*bias", operands):
        return "bias broadcast"
    return "other"


def count(hlo_text: str) -> dict:
    """Kernel counts of an optimized HLO module: per class, per (class, role), per detail and per kernel name (the
    fusion's name without its number, as a GPU profile shows it). With a loop in the program, the tables count the
    loop's kernels (once per step) and `outside_loop` those that run once."""
    comps, entry = parse_hlo(hlo_text)
    rows = []
    found = kernels(comps, entry)
    # operands of the matrix products: a concatenate feeding one is XLA's dot merger joining weights (q, k, v)
    gemm_operands = {
        name
        for ins, _ in found
        if ins["opcode"] == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)', ins["rest"])
        for name in re.findall(r"%?([\w.\-]+)", ins["rest"].split("),", 1)[0])
    }
    for ins, in_loop in found:
        fused = _fused(comps, ins) if ins["opcode"] == "fusion" else []
        cls, detail = classify(ins, fused)
        names = [n for n in [_op_name(ins["rest"])] + [_op_name(sub["rest"]) for sub in fused] if n]
        r = role(names, ins["rest"].split(")", 1)[0])
        if cls == "transpose / copy" and any(re.search(r"/attn\d/", n) for n in names):
            r = "attention head split/merge"
        if cls == "concatenate" and ins["name"] in gemm_operands:
            r = "merged weights (XLA dot merger)"
        rows.append(
            {
                "class": cls,
                "detail": detail,
                "role": r,
                "in_loop": in_loop,
                "kernel": ins["name"],
                "op_name": names[0] if names else "",
                "shape": re.sub(r"\{[^{}]*\}", "", ins["shape"]),  # layouts dropped; tuples (custom calls) whole
            }
        )
    looped = any(r["in_loop"] for r in rows)
    counted = [r for r in rows if r["in_loop"] or not looped]
    tally = collections.Counter
    by_class = tally(r["class"] for r in counted)
    return {
        "kernels": len(counted),
        "outside_loop": len(rows) - len(counted),
        "by_class": {c: by_class[c] for c in CLASSES if by_class[c]},
        "by_class_role": dict(sorted(tally(f"{r['class']} | {r['role']}" for r in counted).items())),
        "by_class_detail": dict(sorted(tally(f"{r['class']} | {r['detail']}" for r in counted).items())),
        "by_name": dict(tally(re.sub(r"\.\d+$", "", r["kernel"]) for r in counted).most_common()),
        "rows": rows,
    }


def compile_unet(args, device):
    """Lower and compile one UNet call (or `args.loop` of them in a `fori_loop`) for `device`; returns (compiled,
    seconds to trace and lower, seconds to compile)."""
    import jax
    import jax.numpy as jnp

    from sdjax.models.presets import ARCHITECTURES
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel
    from sdjax.ops import attention as ops_attention

    if args.arch not in ARCHITECTURES:
        raise SystemExit(f"--arch {args.arch!r}: choose one of {sorted(ARCHITECTURES)}")
    a = ARCHITECTURES[args.arch]
    config = UNet2DConditionConfig(**a.unet)
    dtype = jnp.dtype(args.dtype)
    unet = UNet2DConditionModel(
        config=config, dtype=dtype, attention=args.attention, split_head_dim=args.split_head_dim
    )
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    params = jax.tree_util.tree_map(lambda s: abstract(s.shape, dtype), UNet2DConditionModel.init_params_shape(config))
    n, lat = 2 * args.images, (args.size or a.size) // 8
    x = abstract((n, config.in_channels, lat, lat), dtype)
    t = abstract((n,), jnp.float32)
    ctx = abstract((n, 77, config.cross_attention_dim), dtype)
    kw = {}
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        kw = {"text_embeds": abstract((n, pooled), dtype), "time_ids": abstract((n, 6), jnp.float32)}

    def step(p, x, t, ctx, kw):
        return unet.apply({"params": p}, x, t, ctx, **kw)

    def loop(p, x, t, ctx, kw):  # as gpu_unet_loop.py's program, the timestep an argument that changes per step
        def body(i, x):
            return x - 0.001 * step(p, x, t * (1.0 - i / args.loop), ctx, kw).astype(x.dtype)

        return jax.lax.fori_loop(0, args.loop, body, x)

    t0 = time.perf_counter()
    with ops_attention.lowering_for(device.platform):  # attention as a GPU process traces it (cuDNN)
        lowered = jax.jit(loop if args.loop else step).lower(params, x, t, ctx, kw)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, t1 - t0, time.perf_counter() - t1


def print_table(result: dict) -> None:
    where = (
        f"per step of a {result['loop']}-step loop, {result['outside_loop']} more outside it"
        if result["loop"]
        else "one call"
    )
    took = f"lower {result['lower_s']:.1f} s, compile {result['compile_s']:.1f} s"
    print(f"{result['kernels']} kernels ({where}; {took}; {result['device']})")
    print(f"{'class':34s} {'kernels':>7s}")
    for c, n in result["by_class"].items():
        print(f"{c:34s} {n:7d}")
    print("\nby class | module role")
    for k, n in result["by_class_role"].items():
        print(f"  {k:60s} {n:5d}")
    print("\nby class | kind / custom-call target")
    for k, n in result["by_class_detail"].items():
        print(f"  {k:60s} {n:5d}")
    print("\nby kernel name (as a GPU profile names them)")
    for k, n in result["by_name"].items():
        print(f"  {k:60s} {n:5d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-config", required=True, help="GpuTargetConfigProto text file (h100_sxm.txtpb)")
    ap.add_argument("--arch", default="sd15")
    ap.add_argument("--size", type=int, default=None, help="image size (default: the architecture's)")
    ap.add_argument("--images", type=int, default=1, help="images per call; the UNet batch is twice that (CFG)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--split-head-dim", action="store_true", help="heads on their own axis (no fold transposes)")
    ap.add_argument("--loop", type=int, default=0, help="compile N steps in a fori_loop; count the loop's kernels")
    ap.add_argument("--json", help="write the counts (and every kernel's class, role and op_name) here")
    ap.add_argument("--hlo", help="write the optimized HLO text here")
    args = ap.parse_args()

    from jax.experimental import topologies

    config = Path(args.target_config).read_text()
    device = topologies.get_topology_desc("", "cuda", target_config=config, topology="1x1x1").devices[0]
    compiled, lower_s, compile_s = compile_unet(args, device)
    text = compiled.as_text()
    if args.hlo:
        Path(args.hlo).write_text(text)
    result = {
        "device": device.device_kind,
        "arch": args.arch,
        "images": args.images,
        "dtype": args.dtype,
        "attention": args.attention,
        "split_head_dim": args.split_head_dim,
        "loop": args.loop,
        "lower_s": round(lower_s, 1),
        "compile_s": round(compile_s, 1),
        **count(text),
    }
    print_table(result)
    if not result["by_class"].get("attention (cuDNN)"):
        print("\nno cuDNN attention in this program (no cuDNN library in this venv?): XLA's attention is counted")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
