"""LoRA fuse/unfuse time: sdjax `load_lora` / `fuse_loras` / `unfuse_loras` vs diffusers `load_lora_weights` /
`fuse_lora` / `unfuse_lora` (peft), the same kohya file on the same checkpoint, side by side.

    python benchmarks/bench_lora_fuse.py --arch sd15 --keep /tmp/sdjax-sd15 [--rank 16] [--reps 3] [--json out.json]
    python benchmarks/bench_lora_fuse.py [--width 64]        # a small SD 1.x-shaped model (quick check)

The checkpoint is `benchmarks/bench_single_file.py`'s original-layout file (`--arch sd15`: the released SD 1.5
architecture with random weights), loaded by each library's `from_single_file` into float32. The LoRA is written here
in kohya/A1111's layout (`lora_unet_*` / `lora_te_*`, `.lora_down.weight`, `.lora_up.weight`, `.alpha`, float16) with
random factors of rank `--rank`, on what kohya's LoRA trains by default: every attention projection, feed-forward
linear and `proj_in`/`proj_out` of the UNet's transformer blocks and every attention and MLP linear of the text
encoder. Each library runs in its own fresh process; times are the call alone (jax arrays blocked on), medians of
`--reps` fuse/unfuse cycles after the load; `adapted` is how many layers each library actually put the LoRA on.

Semantics differ: sdjax's `load_lora` reads the file and fuses (the generation program takes params as arguments:
a LoRA is always fused, outside jit); `unfuse_loras` hands back the kept base arrays (no arithmetic); `fuse_loras`
adds `up @ down` into each touched kernel again (on the device, one small compiled program per kernel shape).
diffusers' `load_lora_weights` injects PEFT layers (the LoRA then runs as an extra branch per layer), `fuse_lora`
merges them into the base weights, `unfuse_lora` subtracts them again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_single_file

UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out")
TE_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def make_lora(folder: Path, out: Path, rank: int, alpha: float, seed: int = 0) -> tuple[Path, int]:
    """A random kohya LoRA for the UNet and text encoder whose configs are in `folder` (shapes from meta-device
    models: nothing is allocated). Returns (path, number of adapted layers)."""
    import numpy as np
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.numpy import save_file
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
        text = CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder"))
    rng = np.random.default_rng(seed)
    tensors = {}

    def add(prefix: str, name: str, weight_shape) -> None:
        out_ch, in_ch, *k = weight_shape
        key = prefix + name.replace(".", "_")
        down = rng.standard_normal((rank, in_ch, *k)) / np.sqrt(in_ch)
        up = rng.standard_normal((out_ch, rank, *([1] * len(k)))) * 0.01
        tensors[f"{key}.lora_down.weight"] = down.astype(np.float16)
        tensors[f"{key}.lora_up.weight"] = up.astype(np.float16)
        tensors[f"{key}.alpha"] = np.asarray(alpha, np.float16)

    for name, m in unet.named_modules():
        if ".attentions." in name and name.endswith(UNET_TARGETS) and hasattr(m, "weight"):
            add("lora_unet_", name, tuple(m.weight.shape))
    for name, m in text.named_modules():
        if "encoder.layers." in name and name.endswith(TE_TARGETS) and hasattr(m, "weight"):
            name = name if name.startswith("text_model.") else "text_model." + name
            add("lora_te_", name, tuple(m.weight.shape))
    path = out / f"lora-kohya-r{rank}.safetensors"
    save_file(tensors, str(path))
    return path, len(tensors) // 3


def _rss_mb() -> float:
    return bench_single_file._rss_mb()


def child_sdjax(ckpt: str, config: str, lora: str, reps: int) -> dict:
    import jax

    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_single_file(ckpt, config=config)
    base_mb = _rss_mb()
    t0 = time.perf_counter()
    name = pipe.load_lora(lora)
    jax.block_until_ready(pipe.params)
    load_s = time.perf_counter() - t0
    fuse, unfuse = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        pipe.unfuse_loras()
        jax.block_until_ready(pipe.params)
        unfuse.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pipe.fuse_loras()
        jax.block_until_ready(pipe.params)
        fuse.append(time.perf_counter() - t0)
    adapted = len(pipe.loaded_loras[name].factors)
    return {"load_s": load_s, "fuse_s": fuse, "unfuse_s": unfuse, "adapted": adapted, "base_mb": base_mb,
            "peak_mb": _rss_mb()}  # fmt: skip


def child_diffusers(ckpt: str, config: str, lora: str, reps: int) -> dict:
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_single_file(
        ckpt, config=config, local_files_only=True, torch_dtype=torch.float32
    )
    base_mb = _rss_mb()
    t0 = time.perf_counter()
    pipe.load_lora_weights(str(Path(lora).parent), weight_name=Path(lora).name, adapter_name="bench")
    load_s = time.perf_counter() - t0
    adapted = sum(
        1 for m in (pipe.unet, pipe.text_encoder) for _, mod in m.named_modules() if hasattr(mod, "lora_A") and
        "bench" in getattr(mod, "lora_A", {})
    )  # fmt: skip
    fuse, unfuse = [], []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            pipe.fuse_lora()
            fuse.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pipe.unfuse_lora()
            unfuse.append(time.perf_counter() - t0)
    return {"load_s": load_s, "fuse_s": fuse, "unfuse_s": unfuse, "adapted": adapted, "base_mb": base_mb,
            "peak_mb": _rss_mb()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=("sd15",), help="the released SD 1.5 architecture (else a small model)")
    p.add_argument("--width", type=int, default=64, help="UNet base channels of the small model")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=8.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--keep", help="folder for the checkpoint files (written once, reused)")
    p.add_argument("--json")
    p.add_argument("--child", choices=("sdjax", "diffusers"), help=argparse.SUPPRESS)
    p.add_argument("--files", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        fn = child_sdjax if args.child == "sdjax" else child_diffusers
        print(json.dumps(fn(*args.files, args.reps)))
        return
    with tempfile.TemporaryDirectory(prefix="sdjax-lora-bench-") as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        ckpt, folder, n_params = bench_single_file.make_files(out, args.width, "fp16", args.arch)
        lora, n_layers = make_lora(folder, out, args.rank, args.alpha)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
        runs = {}
        for name in ("sdjax", "diffusers"):
            cmd = [sys.executable, __file__, "--child", name, "--reps", str(args.reps), "--files"]
            res = subprocess.run(cmd + [str(ckpt), str(folder), str(lora)], capture_output=True, text=True, env=env)
            if res.returncode:
                raise SystemExit(f"{name} child failed:\n{res.stderr[-3000:]}")
            runs[name] = json.loads(res.stdout.strip().splitlines()[-1])
    model = args.arch or f"small, width {args.width}"
    print(f"checkpoint: {n_params / 1e6:.0f} M parameters ({model}), float32; kohya LoRA rank {args.rank}, "
          f"{n_layers} layers; median of {args.reps} cycles, fresh process each")  # fmt: skip
    print(f"{'':10s} {'adapted':>8s} {'load+inject s':>14s} {'fuse s':>8s} {'unfuse s':>9s} {'+RSS MiB':>9s}")
    for name, r in runs.items():
        load = r["load_s"]
        print(f"{name:10s} {r['adapted']:8d} {load:14.2f} {statistics.median(r['fuse_s']):8.3f} "
              f"{statistics.median(r['unfuse_s']):9.3f} {r['peak_mb'] - r['base_mb']:9.0f}")  # fmt: skip
    result = {"arch": args.arch, "params_m": n_params / 1e6, "rank": args.rank, "layers": n_layers, "runs": runs}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
