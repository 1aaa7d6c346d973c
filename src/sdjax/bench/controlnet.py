"""`sdjax bench controlnet`: the cost of one denoising step with 0, 1, 2, ... ControlNets, sdjax against PyTorch
diffusers side by side.

One step is one model call of the loop with classifier-free guidance (a `2B` batch): with K > 0 nets, the K
ControlNets on the doubled batch (the control image repeated for both halves) and then the UNet with the summed
residuals. In sdjax the nets reach the step as any feature reaches a generation: one
`families.sd.controlnet.ControlRequest` (a `core.protocols.FeatureRequest`, every net at scale 1 for the one model
call) whose params and input arrays `core.features` checks and puts in (`check`, `params_keys`, `with_params`,
`request_inputs`, as `Generator.run` does), then inside the step the features' hooks built from
`params[feature.params_key]` and their arguments merged by `core.loop.merge_kwargs` (as `core.loop` and
`aot.py`'s one-call program do), then the UNet (its params prepared once outside the step, `ops.conv.prepare`).
In PyTorch: what `StableDiffusionControlNetPipeline` runs per step (`ControlNetModel`, or `MultiControlNetModel`
for K > 1, then `UNet2DConditionModel` with `down_block_additional_residuals` / `mid_block_additional_residual`).

Weights are random (`models.presets`): the UNet of `arch` and ControlNets shaped like it (diffusers'
`ControlNetModel.from_unet` keys). The K nets share one weight set on each side (the memory of one net, the
compute of K), so that SD 1.5 in float32 with two nets fits beside its PyTorch twin (torch: a UNet and one net,
about 5 GB; sdjax: those and the UNet's Winograd kernels on CPU, about 9 GB). Timing as `sdjax bench --torch`
(`bench._time_side_by_side`): one warm call per side, then calls alternating between sdjax and the torch worker,
so a shared machine slows both alike and the ratios hold where the absolute times do not.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from sdjax.bench import (
    TorchWorker,
    _compile,
    _flops,
    _time_side_by_side,
    check_run_fields,
    serve_pieces,
    worker_stdout,
)
from sdjax.models.presets import ARCHITECTURES, random_params

if TYPE_CHECKING:
    from sdjax.families.sd.controlnet import ControlRequest


@dataclasses.dataclass(frozen=True)
class ControlNetBenchConfig:
    arch: str = "sd15"  # one of ARCHITECTURES: its UNet, and ControlNets shaped like it
    controlnets: tuple[int, ...] = (0, 1, 2)  # numbers of ControlNets to time
    height: int | None = None  # default: the architecture's size
    width: int | None = None
    batch: int = 1  # images (the step runs 2 x batch with classifier-free guidance)
    dtype: str = "float32"
    reps: int = 3
    torch: bool = False
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "controlnets", tuple(self.controlnets))

    def validate(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch={self.arch!r}: expected one of {sorted(ARCHITECTURES)}")
        if not self.controlnets or any(
            isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 8 for k in self.controlnets
        ):
            raise ValueError(f"controlnets={self.controlnets!r}: expected numbers of nets in [0, 8], e.g. (0, 1, 2)")
        if len(set(self.controlnets)) != len(self.controlnets):
            raise ValueError(f"controlnets={self.controlnets!r}: a number appears twice")
        check_run_fields(self, ("batch", "reps"))

    def size(self) -> tuple[int, int]:
        native = ARCHITECTURES[self.arch].size
        return self.height or native, self.width or native


def controlnet_config(unet: dict) -> dict:
    """`sdjax.models.controlnet.config_from_unet` (imported when called: this module loads without flax)."""
    from sdjax.models.controlnet import config_from_unet

    return config_from_unet(unet)


def _inputs(cfg: ControlNetBenchConfig, unet: dict) -> dict[str, np.ndarray]:
    """The step's inputs (host float32), the same numbers on both sides: CFG-doubled latents, timestep, text
    states, SDXL's pooled text and time ids, and one control image in [0, 1]."""
    height, width = cfg.size()
    b, r = cfg.batch, np.random.default_rng(cfg.seed)
    out = {
        "x": r.standard_normal((2 * b, unet["in_channels"], height // 8, width // 8), np.float32),
        "t": np.full((2 * b,), 500.0, np.float32),
        "context": r.standard_normal((2 * b, 77, unet["cross_attention_dim"]), np.float32),
        "image": r.random((b, 3, height, width), np.float32),
    }
    if unet.get("addition_embed_type") == "text_time":
        pooled = unet["projection_class_embeddings_input_dim"] - 6 * unet["addition_time_embed_dim"]
        out["text_embeds"] = r.standard_normal((2 * b, pooled), np.float32)
        out["time_ids"] = np.tile(np.asarray([[height, width, 0, 0, height, width]], np.float32), (2 * b, 1))
    return out


def _request(net: Any, net_params: Any, image: np.ndarray, k: int) -> ControlRequest:
    """`k` copies of `net` (sharing `net_params`) as one ControlNet feature request: each acts at scale 1 over the
    whole schedule, on `image` `(B, 3, H, W)` for every net."""
    from sdjax.families.sd.controlnet import ControlRequest, ControlSpec

    batch = image.shape[0]
    return ControlRequest(
        spec=ControlSpec((net,) * k),
        params=(net_params,) * k,
        images=np.repeat(image[:, None], k, axis=1),  # (B, K, 3, H, W)
        scales=np.ones((batch, k), np.float32),
        starts=np.zeros((batch, k)),
        ends=np.ones((batch, k)),
    )


def run(cfg: ControlNetBenchConfig, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Time one step for each number of nets in `cfg.controlnets`; returns the JSON-able result."""
    cfg.validate()
    import jax
    import jax.numpy as jnp

    from sdjax.core import features as feature_lib
    from sdjax.core.loop import merge_kwargs
    from sdjax.models.controlnet import ControlNetConfig, ControlNetModel
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel
    from sdjax.ops import conv as ops_conv

    dtype = jnp.dtype(cfg.dtype)
    height, width = cfg.size()
    a = ARCHITECTURES[cfg.arch]
    log(f"building a random {cfg.arch} UNet and ControlNet")
    unet = UNet2DConditionModel(UNet2DConditionConfig.from_dict(a.unet, source=f"{cfg.arch} unet"), dtype=dtype)
    net = ControlNetModel(ControlNetConfig.from_dict(controlnet_config(a.unet), source="controlnet"), dtype=dtype)
    # (donated: the prepared tree reuses the random weights' buffers instead of copying them beside the originals)
    unet_params = jax.jit(ops_conv.prepare, donate_argnums=0)(
        random_params(unet.init_params_shape(unet.config), cfg.seed, dtype)
    )
    net_params = random_params(net.init_params_shape(net.config), cfg.seed + 1, dtype) if max(cfg.controlnets) else None
    host = _inputs(cfg, a.unet)
    x, t = jnp.asarray(host["x"], dtype), jnp.asarray(host["t"])
    context = jnp.asarray(host["context"], dtype)
    added = {k: jnp.asarray(host[k], dtype) for k in ("text_embeds", "time_ids") if k in host}
    result: dict[str, Any] = {
        "arch": cfg.arch,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "dtype": cfg.dtype,
        "height": height,
        "width": width,
        "batch": cfg.batch,
        "reps": cfg.reps,
        "controlnets": list(cfg.controlnets),
    }
    # Every program is compiled before the PyTorch worker starts: its weights never meet XLA's compile-time peak.
    programs = {}
    step_inputs = {"x": x, "t": t, "context": context, **added}  # the step's own inputs (no feature may take them)
    for k in cfg.controlnets:
        log(f"compiling one step with {k} ControlNet(s)")
        requests = (_request(net, net_params, host["image"], k),) if k else ()
        features = feature_lib.check([r.spec for r in requests])
        feature_lib.params_keys(features, components=("unet",))
        params = feature_lib.with_params({"unet": unet_params}, requests)
        arrays = feature_lib.request_inputs(features, requests, start=0, end=1, calls=1, taken=step_inputs)
        arrays = {name: jnp.asarray(v) for name, v in arrays.items()}  # on the device once, not per timed call

        def step(params, x, t, context, added, arrays, features=features):
            hooks = [
                f.hook(params[f.params_key], arrays, cond=(context, added), cfg=True, latent_channels=x.shape[1])
                for f in features
            ]
            kwargs = merge_kwargs(hooks, 0, x, t)  # the loop's arguments at its first model call
            return unet.apply({"params": params["unet"]}, x, t, context, **added, **kwargs)

        args = (params, x, t, context, added, arrays)
        programs[f"controlnets={k}"] = (k, args, *_compile(step, *args))
    worker = None
    if cfg.torch:
        log("starting the PyTorch diffusers worker")
        worker = TorchWorker(cfg, height, width, serve="sdjax.bench.controlnet:_torch_serve")
    try:
        steps: dict[str, dict[str, Any]] = {}
        torch_side: dict[str, Any] = {}
        for name, (k, args, compiled, compile_s) in programs.items():
            log(f"timing one step with {k} ControlNet(s)")
            timed, torch_side[name] = _time_side_by_side(lambda f=compiled, a=args: f(*a), worker, name, cfg.reps)
            steps[name] = {"controlnets": k, "compile_s": compile_s, **timed, "flops": _flops(compiled)}
            theirs = f", torch {torch_side[name]['median_s']:.3f} s" if worker is not None else ""
            log(f"{name}: sdjax {timed['median_s']:.3f} s{theirs}")
        result["steps"] = steps
        if worker is not None:
            result["torch"] = {**worker.info(), **torch_side}
            result["ratios"] = {name: steps[name]["median_s"] / torch_side[name]["median_s"] for name in steps}
    finally:
        if worker is not None:
            worker.close()
    return result


# ---------------------------------------------------------------------------------------------- PyTorch side
def _torch_serve(spec: dict) -> None:
    """The worker (see `bench.TorchWorker`): a diffusers UNet and ControlNet of the same configs, one piece per
    number of nets."""
    import diffusers
    import torch

    reply = worker_stdout()
    cfg = ControlNetBenchConfig(**spec["config"])
    torch.set_num_threads(os.cpu_count() or 1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, cfg.dtype)
    a = ARCHITECTURES[cfg.arch]
    torch.manual_seed(cfg.seed)
    unet = diffusers.UNet2DConditionModel.from_config(a.unet).to(dev, torch_dtype).eval()
    net = None
    if max(cfg.controlnets):
        net = diffusers.ControlNetModel.from_config(controlnet_config(a.unet)).to(dev, torch_dtype).eval()
    host = {k: torch.from_numpy(v).to(dev, torch_dtype) for k, v in _inputs(cfg, a.unet).items()}
    x, t, context = host["x"], host["t"].float(), host["context"]
    added = {}
    if "text_embeds" in host:
        added = {"added_cond_kwargs": {"text_embeds": host["text_embeds"], "time_ids": host["time_ids"]}}
    image = torch.cat([host["image"]] * 2)  # the pipeline's control image for both CFG halves

    def step(k: int):
        residuals = {}
        if k:
            controlnet = net if k == 1 else diffusers.models.controlnets.MultiControlNetModel([net] * k)
            cond = image if k == 1 else [image] * k
            scale = 1.0 if k == 1 else [1.0] * k
            down, mid = controlnet(
                x, t, encoder_hidden_states=context, controlnet_cond=cond, conditioning_scale=scale,
                guess_mode=False, return_dict=False, **added,
            )  # fmt: skip
            residuals = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
        return unet(x, t, encoder_hidden_states=context, **added, **residuals, return_dict=False)

    pieces = {f"controlnets={k}": (lambda k=k: step(k)) for k in cfg.controlnets}
    serve_pieces(pieces, dev, reply)


# ---------------------------------------------------------------------------------------------- report
def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the human-readable table: per number of nets, sdjax's step, its cost over the step
    without nets, and with torch, torch's step and the ratio."""
    torch_res = result.get("torch") or {}
    cols = ["ControlNets", "compile s", "median s", "best s", "GFLOP", "x no-net step"]
    if torch_res:
        cols += ["torch median s", "torch x no-net step", "sdjax / torch"]
    base = result["steps"].get("controlnets=0")
    rows = []
    for name, p in result["steps"].items():
        row = [
            str(p["controlnets"]),
            f"{p['compile_s']:.1f}",
            f"{p['median_s']:.4f}",
            f"{p['best_s']:.4f}",
            "-" if p["flops"] is None else f"{p['flops'] / 1e9:.1f}",
            "-" if base is None else f"{p['median_s'] / base['median_s']:.2f}",
        ]
        if torch_res:
            t0 = torch_res.get("controlnets=0")
            row += [
                f"{torch_res[name]['median_s']:.4f}",
                "-" if t0 is None else f"{torch_res[name]['median_s'] / t0['median_s']:.2f}",
                f"{result['ratios'][name]:.2f}",
            ]
        rows.append(row)
    return cols, rows


def summary_line(result: dict[str, Any]) -> str:
    torch_res = result.get("torch")
    where = f"{result['device']} ({result['backend']})"
    if torch_res:
        where += f"; torch {torch_res['torch']} on {torch_res['device']}, {torch_res['threads']} threads"
    return (
        f"one denoising step (CFG: batch {2 * result['batch']}) of a random {result['arch']} UNet with ControlNets, "
        f"{result['dtype']}, {result['height']}x{result['width']}, median of {result['reps']}; {where}"
    )
