"""Peak host memory of loading with `quantize=` (issues 37, 34): the old way (full-precision load, then
`quantize_pipeline`) against quantizing each kernel as it is converted (`from_pretrained(quantize=)`), for a
diffusers folder and for an original-layout single file.

    python benchmarks/quant_load_memory.py [--folder /tmp/sdjax-sd15-fp16] [--file /tmp/sdjax-sd15-fp16.safetensors]
        [--sources folder,file] [--dtype float32,bfloat16] [--scheme int8] [--json quant_load_memory.json]

Writes (once; reused when `--folder` already holds it) a diffusers SD 1.5 folder with random weights, float16 as
the released `fp16` variant ships them: the released configs (`benchmarks/full_size.py`), saved by diffusers'
`save_pretrained` (torch, diffusers and transformers: test extras), no safety checker. UNet 860 M parameters
(1.6 GiB on disk), text encoder 123 M, VAE 84 M. The single file (`--file`, also written once) is an SD 1.5
checkpoint in the original layout, as civitai ships them (`v1-5-pruned-emaonly-fp16.safetensors`): every tensor
`sdjax.loading.single_file.checkpoint_shapes("sd15")` names, random normal values scaled by 1/sqrt(fan-in), float16
(no torch needed); `from_pretrained(file)` loads it through `from_single_file` with the embedded SD 1.5 configs.
Then, per source and `--dtype`, three variants, each in a fresh Python process (the parent process stays small):
- `plain`: `StableDiffusionPipeline.from_pretrained(source, dtype=dtype)`;
- `old`: the same, then `sdjax.quant.quantize_pipeline(pipe, params, scheme)` (what `quantize=` did before);
- `new`: `from_pretrained(source, dtype=dtype, quantize=scheme)` (each selected UNet kernel quantized as it is
  converted: `sdjax.quant.loading`);
- `switch-old`, `switch-new` (not run by default: `--variants switch-old,switch-new`): a model switched in by
  `sdjax serve --models-dir` under an int8/fp8 start-up model (`server.models_api.load_like`, as
  `ServerState.switch_model` calls it), with a loader that does not take `quantize=` (loaded in full precision,
  then quantized: the server before 2026-11-28) and with `sdjax serve`'s own switch loader (quantized as it loads).
Reported per run: the process's peak resident memory (`VmHWM` from /proc/self/status, and `ru_maxrss` of
`getrusage(RUSAGE_SELF)`: the same peak, except that Linux carries the launching process's peak across `exec`
into `ru_maxrss`, which is why the parent stays small), the same after the imports (before loading), the bytes of
the params the process holds at the end (UNet and all), and the load's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "old", "new")  # and "switch-old", "switch-new" (module docstring)


def _peaks_mib() -> dict[str, float]:
    hwm = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {"vmhwm_mib": hwm if hwm is not None else maxrss, "ru_maxrss_mib": maxrss}


def make_folder(out: Path) -> None:
    """The random SD 1.5 folder at float16 (see the module docstring); each model goes to float16 as soon as it
    exists, so this process peaks near the float32 UNet (3.3 GiB)."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
    import full_size
    import reference
    import torch
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    unet = full_size.torch_unet(full_size.SD15_UNET).to(torch.float16)
    text = full_size.torch_text({**full_size.SD15_TEXT, "bos_token_id": 49406, "eos_token_id": 49407})
    text = text.to(torch.float16)
    vae = full_size.torch_vae(full_size.SD15_VAE).to(torch.float16)
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
    pipe.save_pretrained(out, safe_serialization=True)


def make_file(out: Path) -> None:
    """The random original-layout SD 1.5 single file at float16 (see the module docstring); one tensor is drawn at
    a time, float16 as soon as it exists, so this process holds about the file's 2 GiB."""
    import numpy as np
    from safetensors.numpy import save_file

    from sdjax.loading.single_file import checkpoint_shapes

    rng = np.random.default_rng(0)
    tensors = {}
    for key, shape in sorted(checkpoint_shapes("sd15").items()):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        tensors[key] = (rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)).astype(np.float16)
    save_file(tensors, str(out))


def child(variant: str, folder: str, dtype: str, scheme: str) -> dict:
    t0 = time.perf_counter()
    import jax

    from sdjax import quant
    from sdjax.pipelines.stable_diffusion import StableDiffusionPipeline
    from sdjax.precision import resolve_dtype

    jax.numpy.zeros(1).block_until_ready()  # the backend is up before the baseline
    import_s, base = time.perf_counter() - t0, _peaks_mib()
    t0 = time.perf_counter()
    dt = resolve_dtype(dtype)
    if variant == "plain":
        pipe, params = StableDiffusionPipeline.from_pretrained(folder, dtype=dt)
    elif variant == "old":
        pipe, params = quant.quantize_pipeline(*StableDiffusionPipeline.from_pretrained(folder, dtype=dt), scheme)
    elif variant == "new":
        pipe, params = StableDiffusionPipeline.from_pretrained(folder, dtype=dt, quantize=scheme)
    elif variant in ("switch-old", "switch-new"):  # a --models-dir switch of `sdjax serve` (int8 start-up model)
        from types import SimpleNamespace

        from sdjax.cli import load_pipeline
        from sdjax.cli.serve import _switch_loader
        from sdjax.server import models_api

        if variant == "switch-old":  # a loader without quantize=: full precision, then quantized
            loader = lambda path: load_pipeline(path, dtype)
        else:
            loader = _switch_loader(SimpleNamespace(dtype=dtype), None)
        policy = quant.QuantPolicy(scheme, components=("unet",))
        pipe = models_api.load_like(loader, str(folder), policy, "unet", Path(folder).name)
        params = pipe.params
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    held = {k: quant.nbytes(v) for k, v in params.items() if k in ("unet", "text_encoder", "vae")}
    return {
        "variant": variant,
        "source": "file" if Path(folder).is_file() else "folder",
        "dtype": dtype,
        "scheme": scheme,
        "import_s": round(import_s, 2),
        "load_s": round(load_s, 2),
        "base": base,
        "peak": _peaks_mib(),
        "params_mib": {k: round(v / 2**20, 1) for k, v in held.items()},
        "unet_quantized_kernels": len(quant.params.quantized_kernels(params["unet"])),
    }


def _run(args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=str(ROOT), check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default="/tmp/sdjax-sd15-fp16", help="the random SD 1.5 folder (made when absent)")
    ap.add_argument(
        "--file", default="/tmp/sdjax-sd15-fp16.safetensors", help="the random SD 1.5 single file (made when absent)"
    )
    ap.add_argument("--sources", default="folder,file", help="comma-separated: folder, file")
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated load dtypes")
    ap.add_argument("--scheme", default="int8", choices=("int8", "fp8"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=4, metavar=("VARIANT", "SOURCE", "DTYPE", "SCHEME"), help=argparse.SUPPRESS)
    ap.add_argument("--make", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--make-file", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    if a.make:
        make_folder(Path(a.make))
        print(json.dumps({"made": a.make}))
        return
    if a.make_file:
        make_file(Path(a.make_file))
        print(json.dumps({"made": a.make_file}))
        return
    sources = {}
    for kind in a.sources.split(","):
        if kind == "folder":
            sources[kind] = Path(a.folder)
            if not (sources[kind] / "model_index.json").is_file():
                print(f"writing the random SD 1.5 folder (float16) to {a.folder} ...", file=sys.stderr)
                _run(["--make", a.folder])
        elif kind == "file":
            sources[kind] = Path(a.file)
            if not sources[kind].is_file():
                print(f"writing the random SD 1.5 single file (float16) to {a.file} ...", file=sys.stderr)
                _run(["--make-file", a.file])
        else:
            raise SystemExit(f"--sources: unknown source {kind!r} (folder, file)")
    rows = []
    for kind, source in sources.items():
        for dtype in a.dtype.split(","):
            for variant in a.variants.split(","):
                row = _run(["--child", variant, str(source), dtype, a.scheme])
                rows.append(row)
                print(f"{kind} {dtype} {variant}: {row['peak']['vmhwm_mib']:.0f} MiB", file=sys.stderr)
    print(f"\nSD 1.5 (random, float16 files), quantize={a.scheme!r}; peaks of a fresh process, MiB\n")
    print("| source | load dtype | variant | peak RSS (VmHWM) | ru_maxrss | after imports | added by loading "
          "| UNet params held | all params held | load s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, b = r["peak"], r["base"]
        print(
            f"| {r['source']} | {r['dtype']} | {r['variant']} | {p['vmhwm_mib']:.0f} | {p['ru_maxrss_mib']:.0f} | "
            f"{b['vmhwm_mib']:.0f} | {p['vmhwm_mib'] - b['vmhwm_mib']:.0f} | {r['params_mib']['unet']:.0f} | "
            f"{sum(r['params_mib'].values()):.0f} | {r['load_s']:.1f} |"
        )
    out = {"sources": {k: str(v) for k, v in sources.items()}, "scheme": a.scheme, "rows": rows}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
