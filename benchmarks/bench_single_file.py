"""Single-file loading: time and peak host memory of sdjax `load_single_file` vs diffusers `from_single_file`.

    python benchmarks/bench_single_file.py [--width 64] [--dtype fp16] [--reps 3] [--json out.json]
    python benchmarks/bench_single_file.py --arch sd15 --keep /tmp/sdjax-sd15 [--reps 3]   # full-size SD 1.5

Builds a small but not trivial SD 1.x-shaped pipeline with random weights (UNet `block_out_channels` = `width` x
(1, 2, 4, 4), a 6-layer CLIP text encoder, a 4-level VAE: about 40 M parameters at `--width 64`), writes it once as
an original-layout single file (fp16 by default, as civitai ships them; the test suite's own writer,
`tests/loading/ldm_fixtures.py`) plus the diffusers folder both loaders take the configs from (`config=`). Then each
loader runs in fresh Python processes (`--reps` each, median reported): the time of the load call alone (imports
apart), and the peak resident memory the load adds (`VmHWM` after the load minus after the imports). Both load
into float32. Needs torch, diffusers and transformers (test extras). Runs in well under a minute at the default size.

sdjax's rows: `sdjax` reads the abstract params trees from a shape cache (`models.shapes_cache`) that an untimed
load filled first, in a folder of the bench's own (what every load after a user's first one does); `--cold` adds a
`sdjax-cold` row with the cache off (every trace done, as a first load). `--baseline SRC` adds `sdjax@baseline`, the
same load from another checkout's `src` folder (e.g. `git archive HEAD src | tar -x -C /tmp/base`), with the same
shape-cache folder (filled by an untimed load of its own), run in turn with the others, for a before/after on one
machine in one window. The load average at the start and end is recorded.

`--arch sd15` writes the released SD 1.5 architecture instead (`benchmarks/full_size.py`: the configs sdjax
embeds, random weights; 1.07 G parameters, a 2.0 GiB fp16 file); the diffusers folder then keeps only its configs
and tokenizer (what `config=` reads). `--keep DIR` writes the files into DIR and reuses them on the next run
(`benchmarks/bench_lora_fuse.py` loads the same file).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    """Peak resident memory of this process so far, MiB: `VmHWM` (reset by exec, unlike `ru_maxrss`, which keeps
    the forking parent's peak), else `ru_maxrss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child_sdjax(path: str, config: str) -> dict:
    t0 = time.perf_counter()
    import jax

    from sdjax.loading.single_file import load_single_file

    import_s, base = time.perf_counter() - t0, _rss_mb()
    t0 = time.perf_counter()
    _, params, _ = load_single_file(path, config=config)
    jax.block_until_ready(params)
    return {"import_s": import_s, "load_s": time.perf_counter() - t0, "base_mb": base, "peak_mb": _rss_mb()}


def child_diffusers(path: str, config: str) -> dict:
    t0 = time.perf_counter()
    import torch
    from diffusers import StableDiffusionPipeline

    import_s, base = time.perf_counter() - t0, _rss_mb()
    t0 = time.perf_counter()
    StableDiffusionPipeline.from_single_file(path, config=config, local_files_only=True, torch_dtype=torch.float32)
    return {"import_s": import_s, "load_s": time.perf_counter() - t0, "base_mb": base, "peak_mb": _rss_mb()}


def make_files(out: Path, width: int, dtype: str, arch: str | None = None) -> tuple[Path, Path, int]:
    """Write the pipeline as a diffusers folder and as one original-layout file; returns (file, folder, #params).
    Files already in `out` (from an earlier run with the same settings) are reused."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "loading"), str(ROOT / "benchmarks")]
    import ldm_fixtures
    import reference
    import torch
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    tag = f"{arch or f'w{width}'}-{dtype}"
    folder, path, done = out / f"pipeline-{tag}", out / f"model-{tag}.safetensors", out / f"params-{tag}.json"
    if done.exists() and path.exists() and (folder / "model_index.json").exists():
        return path, folder, json.loads(done.read_text())["params"]
    w = width
    if arch == "sd15":
        import full_size

        # Each model goes to the file's dtype as soon as it exists: host memory stays near the file's size.
        torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        unet = full_size.torch_unet(full_size.SD15_UNET).to(torch_dtype)
        text = full_size.torch_text({**full_size.SD15_TEXT, "bos_token_id": 49406, "eos_token_id": 49407})
        text = text.to(torch_dtype)
        vae = full_size.torch_vae(full_size.SD15_VAE).to(torch_dtype)
    else:
        unet, text, vae = _small_models(reference, w)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=reference.clip_tokenizer(),
        unet=unet,
        scheduler=PNDMScheduler(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True, steps_offset=1
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder)
    if arch is not None:  # configs and tokenizer only: what config= reads
        for f in folder.rglob("*"):
            if f.suffix in (".safetensors", ".bin"):
                f.unlink()
    state = ldm_fixtures.pipeline_to_original(pipe, "sd1")
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    path = ldm_fixtures.save_original(state, path, dtype=torch_dtype)
    n = sum(p.numel() for m in (unet, text, vae) for p in m.parameters())
    done.write_text(json.dumps({"params": n}))
    return path, folder, n


def _small_models(reference, w: int):
    unet = reference.unet(
        dict(
            reference.UNET_SD1,
            sample_size=32,
            block_out_channels=(w, 2 * w, 4 * w, 4 * w),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=4 * w,
            attention_head_dim=8,
            norm_num_groups=32,
        )
    )
    text = reference.text_encoder(
        dict(
            reference.CLIP_SD1, hidden_size=4 * w, intermediate_size=16 * w, num_hidden_layers=6, num_attention_heads=8
        )
    )
    vae = reference.vae(dict(reference.VAE, block_out_channels=(w // 2, w, 2 * w, 2 * w), layers_per_block=2))
    return unet, text, vae


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=64, help="UNet base channels (SD 1.5: 320)")
    p.add_argument("--arch", choices=("sd15",), help="the released SD 1.5 architecture instead of --width")
    p.add_argument("--keep", help="write (or reuse) the files in this folder instead of a temporary one")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="tensors in the file")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--cold", action="store_true", help="also time sdjax with the shape cache off (row sdjax-cold)")
    p.add_argument("--baseline", metavar="SRC", help="also time sdjax imported from this src folder (before/after)")
    p.add_argument("--child", choices=("sdjax", "diffusers"), help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        fn = child_sdjax if args.child == "sdjax" else child_diffusers
        print(json.dumps(fn(args.file, args.config)))
        return
    with tempfile.TemporaryDirectory(prefix="sdjax-single-file-") as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        path, folder, n_params = make_files(out, args.width, args.dtype, args.arch)
        size_mb = path.stat().st_size / 2**20
        base = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
        cache = Path(tmp) / "shape-cache"
        envs = {"sdjax": {**base, "SDJAX_SHAPE_CACHE": str(cache)}}
        if args.cold:
            envs["sdjax-cold"] = {**base, "SDJAX_SHAPE_CACHE": "off"}
        if args.baseline:
            envs["sdjax@baseline"] = {**envs["sdjax"], "PYTHONPATH": str(Path(args.baseline).resolve())}
        envs["diffusers"] = base
        load_before = os.getloadavg()

        def child(name: str) -> dict:
            kind = "diffusers" if name == "diffusers" else "sdjax"
            cmd = [sys.executable, __file__, "--child", kind, "--file", str(path), "--config", str(folder)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=envs[name]).stdout
            return json.loads(out.strip().splitlines()[-1])

        child("sdjax")  # fills the shape cache, untimed
        if args.baseline:
            child("sdjax@baseline")  # the same cache folder: its trees may be keyed otherwise
        runs: dict[str, list[dict]] = {name: [] for name in envs}
        for _ in range(args.reps):
            for name in runs:
                runs[name].append(child(name))
        load_after = os.getloadavg()
    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            "load_s": statistics.median(r["load_s"] for r in rs),
            "import_s": statistics.median(r["import_s"] for r in rs),
            "load_peak_mb": statistics.median(r["peak_mb"] - r["base_mb"] for r in rs),
            "process_peak_mb": statistics.median(r["peak_mb"] for r in rs),
        }
    print(f"file: {n_params / 1e6:.1f} M parameters, {args.dtype}, {size_mb:.1f} MiB; loaded into float32 "
          f"({n_params * 4 / 2**20:.1f} MiB); median of {args.reps} fresh processes each")  # fmt: skip
    print(f"load average {load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end")
    print(f"{'':15s} {'load s':>8s} {'runs':>20s} {'+peak RSS MiB':>14s} {'process peak MiB':>17s} {'imports s':>10s}")
    for name, s in summary.items():
        each = ", ".join(f"{r['load_s']:.2f}" for r in runs[name])
        peaks = f"{s['load_peak_mb']:14.0f} {s['process_peak_mb']:17.0f}"
        row = f"{s['load_s']:8.2f} {each:>20s} {peaks} {s['import_s']:10.2f}"
        print(f"{name:15s} {row}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "arch": args.arch or f"small (width {args.width})",
                    "params_m": n_params / 1e6,
                    "file_dtype": args.dtype,
                    "file_mib": size_mb,
                    "load_average": {"start": load_before, "end": load_after},
                    "baseline": args.baseline,
                    "summary": summary,
                    "runs": runs,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
