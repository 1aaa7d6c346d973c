"""ControlNet for Flux.1: diffusers' `FluxControlNetPipeline` (with one net, or several as
`FluxMultiControlNetModel`) as the Flux family's `core.protocols.Feature`, in diffusers 0.42.1.

The control image is resized to the output size (Lanczos), scaled to [-1, 1], encoded by the pipeline's VAE inside
the program and packed 2x2 like the image latents; the net reads those tokens:

    control tokens_k = pack((vae posterior sample - shift) * scaling_factor)
    per model call i of the schedule (n calls, as diffusers' `controlnet_keep`):
        keep_k  = 1 - (i / n < control_guidance_start_k  or  (i + 1) / n > control_guidance_end_k)
        double, single = sum_k net_k(x, control tokens_k, text, pooled, t, [guidance], [mode_k])
                               * controlnet_conditioning_scale_k * keep_k
        out     = transformer(x, text, pooled, t, controlnet_block_samples=double,
                              controlnet_single_block_samples=single)

- The nets run on the prompt's text, pooled embedding and (for a net whose config says `guidance_embeds`, the
  dev nets) dev's distilled guidance scale. With true classifier-free guidance (a negative prompt) diffusers runs
  the nets once, on the positive prompt, and gives the same samples to both transformer calls; so does this hook
  (the nets run on the conditional half of the batch, their samples are repeated for the negative half).
- Union nets (`num_mode` set: Shakker-Labs' and InstantX's ControlNet-Union) take `control_mode` per net (an int in
  `[0, num_mode)`, the net's documented list: e.g. canny 0, tile 1, depth 2, ...), which diffusers embeds as one
  more text token; nets without modes take None. The modes are program inputs (changing them compiles nothing).
  One union net with several conditions (diffusers: `FluxMultiControlNetModel([net])` with a list of images and
  modes) is the same net given once per condition: `controlnet=[net, net]`, loaded once.
- The posterior noise of the control image's VAE sample is drawn from each image's key (stream
  `rng.ENCODE_CONTROL + k` for net k); diffusers draws it from the pipeline's generator.
- Several nets: their samples are summed block by block, so they must have as many double and single blocks.
- The keep table is `families.sd.controlnet.keep_table` (host, float64 as diffusers), so scales, starts and ends
  change without recompiling. A net whose scale is 0 for every image at a step is skipped (`lax.cond`): its
  samples are exactly 0 then, as diffusers' products.

Refused before anything is compiled, naming the argument: a net made for another family (SD 1.x/2.x, SDXL, SD 3),
a net that does not fit the transformer (`in_channels`, `patch_size`, the width `num_attention_heads *
attention_head_dim`, `joint_attention_dim`, `pooled_projection_dim`; the net's own head count may differ), a
pixel-space net (`conditioning_embedding_channels`, at load), `guess_mode`, an init image (diffusers' Flux
ControlNet image-to-image and inpainting pipelines are not implemented), a missing, out-of-range or superfluous
`control_mode`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sdjax import rng
from sdjax.core.loop import Hook
from sdjax.families.flux.denoiser import model_timestep
from sdjax.families.sd.controlnet import ControlRequest
from sdjax.models import flux as flux_model
from sdjax.models.flux_controlnet import FluxControlNetModel
from sdjax.pipelines.controlnet import resolve_nets
from sdjax.quant.modules import apply_dequantized

INPUTS = ("control_image", "control_scales", "control_modes")
DOUBLE = "controlnet_block_samples"  # the denoiser's keywords (`families.flux.denoiser`)
SINGLE = "controlnet_single_block_samples"


@dataclasses.dataclass(frozen=True)
class FluxControlSpec:
    """The static part of Flux ControlNet conditioning (part of the compile key): the net modules, in order.
    `params["controlnet"]` holds one param tree per net."""

    name: ClassVar[str] = "controlnet"  # (`core.protocols.Feature`)
    params_key: ClassVar[str] = "controlnet"

    nets: tuple[Any, ...]

    def __post_init__(self):
        object.__setattr__(self, "nets", tuple(self.nets))
        if not self.nets:
            raise ValueError("FluxControlSpec: give at least one ControlNet")

    def example_inputs(self, *, batch: int, height: int, width: int, calls: int) -> dict[str, np.ndarray]:
        """Zero program inputs (`INPUTS`) of the shapes a program of `calls` model calls takes."""
        k = len(self.nets)
        return {
            "control_image": np.zeros((batch, k, 3, height, width), np.float32),
            "control_scales": np.zeros((batch, calls, k), np.float32),
            "control_modes": np.zeros((batch, k), np.int32),
        }

    def hook(
        self,
        params: Any,
        inputs: dict,
        *,
        cond: Any,
        cfg: bool,
        latent_channels: int,
        encode: Callable[[jax.Array, int], jax.Array] | None = None,
    ) -> Hook:
        """The loop hook; `cond` is the Flux conditioning (`{"text", "pooled", "guidance"}`, negative prompts
        first with `cfg`), `encode` the program's VAE encoder (images NCHW in [-1, 1], a noise stream -> the
        denoiser's latents)."""
        del latent_channels
        if encode is None:
            raise ValueError("Flux ControlNets read VAE latents of the control image: the hook needs encode=")
        trees = tuple(params) if isinstance(params, (list, tuple)) else (params,)
        if len(trees) != len(self.nets):
            raise ValueError(
                f"params['controlnet'] holds {len(trees)} param tree(s) for {len(self.nets)} ControlNet(s)"
            )
        images = inputs["control_image"]
        tokens = []
        for k, net in enumerate(self.nets):
            z = encode(images[:, k].astype(jnp.float32) * 2.0 - 1.0, rng.ENCODE_CONTROL + k)
            tokens.append(flux_model.pack_latents(z).astype(net.dtype))
        rows = images.shape[0]

        def positive(x):  # the conditional half of a CFG-stacked batch (negative prompts first)
            return x[x.shape[0] - rows :]

        return FluxControlHook(
            spec=self,
            params=trees,
            tokens=tuple(tokens),
            scales=inputs["control_scales"],
            modes=inputs["control_modes"],
            text=positive(cond["text"]),
            pooled=positive(cond["pooled"]),
            guidance=positive(cond["guidance"]).astype(jnp.float32),
            cfg=cfg,
        )


@dataclasses.dataclass(frozen=True)
class FluxControlHook(Hook):
    """`model_kwargs`: the nets' summed double and single block samples for the (CFG-stacked) batch; see the
    module docstring.

    `tokens`: per net the packed control latents `(B, L, 64)`; `scales` `(B, calls, K)` the scale of net k at each
    model call (0 outside its start/end range); `modes` `(B, K)`; `text`, `pooled`, `guidance`: the positive
    prompts' (B rows)."""

    spec: FluxControlSpec
    params: tuple
    tokens: tuple
    scales: jax.Array
    modes: jax.Array
    text: jax.Array
    pooled: jax.Array
    guidance: jax.Array
    cfg: bool

    def model_kwargs(self, step, x_in, t):
        scales = jax.lax.dynamic_index_in_dim(self.scales, step, axis=1, keepdims=False)  # (B, K)
        b = self.text.shape[0]
        x = x_in[x_in.shape[0] - b :]  # the latents (both CFG halves hold the same)
        _, _, h, w = x.shape
        img_ids = jnp.asarray(flux_model.image_ids(h, w), jnp.float32)
        txt_ids = jnp.zeros((self.text.shape[1], 3), jnp.float32)
        double, single = None, None
        for k, net in enumerate(self.spec.nets):
            cfg = net.config
            args = (
                flux_model.pack_latents(x.astype(net.dtype)),
                self.tokens[k],
                self.text.astype(net.dtype),
                self.pooled.astype(net.dtype),
                model_timestep(t, b, net.dtype),
                img_ids,
                txt_ids,
                self.guidance if cfg.guidance_embeds else None,
                self.modes[:, k] if cfg.union else None,
            )
            d, s = _run_net(net, self.params[k], args, scales[:, k])
            double = d if double is None else tuple(a + c for a, c in zip(double, d))
            single = s if single is None else tuple(a + c for a, c in zip(single, s))
        out = {}
        for key, samples in ((DOUBLE, double), (SINGLE, single)):
            if samples:
                out[key] = tuple(jnp.concatenate([a, a]) for a in samples) if self.cfg else samples
        return out


def _run_net(net, params, args, scale):
    """One net's (double, single) samples, each image's scaled by `scale` `(B,)`; zeros without running the net
    when every scale is 0."""

    def run(_):  # weight-only: a quantized net's kernels are dequantized here
        return apply_dequantized(net, {"params": params}, *args, scale)

    shapes = jax.eval_shape(run, None)
    zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return jax.lax.cond(jnp.any(scale != 0), run, lambda _: zeros, None)


# ------------------------------------------------------------------------------------------------ host side
def _label(name: str, k: int, n: int) -> str:
    return name if n == 1 else f"{name}[{k}]"


def check_nets(nets: Sequence[Any], transformer_config: Any, *, name: str = "controlnet") -> None:
    """Refuse nets made for another family, nets that do not fit the transformer, and sets of nets that cannot be
    summed (see the module docstring)."""
    t = transformer_config
    for k, net in enumerate(nets):
        label = _label(name, k, len(nets))
        if not isinstance(net, FluxControlNetModel):
            raise ValueError(
                f"{label} is a {type(net).__name__} (a ControlNet of another model family) but the pipeline is "
                f"Flux.1: load a FluxControlNetModel (e.g. InstantX/FLUX.1-dev-Controlnet-Canny, "
                f"Shakker-Labs/FLUX.1-dev-ControlNet-Union-Pro)"
            )
        cfg = net.config
        for key, a, b in (
            ("in_channels", cfg.in_channels, t.in_channels),
            ("patch_size", cfg.patch_size, t.patch_size),
            ("num_attention_heads * attention_head_dim", cfg.inner_dim, t.inner_dim),
            ("joint_attention_dim", cfg.joint_attention_dim, t.joint_attention_dim),
            ("pooled_projection_dim", cfg.pooled_projection_dim, t.pooled_projection_dim),
        ):
            if a != b:
                raise ValueError(
                    f"{label} does not fit this model's transformer: {key} is {a} in the ControlNet, {b} in the "
                    f"transformer"
                )
    first = nets[0].config
    for k, net in enumerate(nets[1:], start=1):
        for key in ("num_layers", "num_single_layers"):
            if getattr(net.config, key) != getattr(first, key):
                raise ValueError(
                    f"{name}[{k}] has {key}={getattr(net.config, key)}, {name}[0] {getattr(first, key)}: several "
                    f"Flux ControlNets are summed block by block, so these must agree"
                )


def control_spec(pipe, controlnet: Any, params: dict | None, guess_mode: bool = False) -> tuple[FluxControlSpec, tuple]:
    """`controlnet` (as `pipelines.controlnet` takes it) -> (the static `FluxControlSpec`, the nets' param trees),
    checked against the pipeline's transformer."""
    if guess_mode is not False:
        raise ValueError("guess_mode: Flux ControlNets have no guess mode (FluxControlNetPipeline)")
    nets = resolve_nets(pipe, controlnet, params)
    check_nets([m for m, _ in nets], pipe.transformer.config)
    return FluxControlSpec(tuple(m for m, _ in nets)), tuple(p for _, p in nets)


DEFAULT_SCALE = 1.0  # FluxControlNetPipeline's controlnet_conditioning_scale


def check_task(task: str) -> None:
    """Flux ControlNets run text-to-image only (`pipelines.controlnet.control_request` asks before loading a net)."""
    if task != "txt2img":
        raise ValueError(
            f"Flux ControlNets run text-to-image only here, not {task} (diffusers' FluxControlNetImg2ImgPipeline "
            f"and FluxControlNetInpaintPipeline are not implemented): generate without an init image and mask "
            f"(image=, mask_image=), or without the ControlNet"
        )


def check_size(pipe, spec: FluxControlSpec, height: int, width: int) -> None:
    """Nothing to refuse: a Flux net's positions are rotary (no table to outgrow)."""
    del pipe, spec, height, width


def with_control_mode(request: ControlRequest, control_mode: Any) -> FluxControlRequest:
    """`request` with the nets' control modes (`control_mode`: an int or None for one net, or one per net; a
    single value is every net's), checked against the nets: a union net needs one in `[0, num_mode)`, a net
    without modes takes None."""
    nets = request.spec.nets
    k = len(nets)
    if isinstance(control_mode, (list, tuple)):
        values = list(control_mode)
        if len(values) != k:
            raise ValueError(f"control_mode: got {len(values)} value(s) for {k} ControlNet(s); pass one per net")
    else:
        values = [control_mode] * k
    modes = []
    for j, (net, mode) in enumerate(zip(nets, values)):
        label = _label("control_mode", j, k)
        cfg = net.config
        if mode is None:
            if cfg.union:
                raise ValueError(
                    f"{label}: {_label('controlnet', j, k)} is a ControlNet-Union net (num_mode={cfg.num_mode}): "
                    f"pass control_mode=, an int in [0, {cfg.num_mode}) naming the kind of control image (the "
                    f"net's model card lists them)"
                )
            modes.append(0)
            continue
        if isinstance(mode, bool) or not isinstance(mode, (int, np.integer)):
            raise TypeError(f"{label} must be an int or None, got {mode!r}")
        if not cfg.union:
            raise ValueError(
                f"{label}={mode}: {_label('controlnet', j, k)} is not a ControlNet-Union net (its config has no "
                f"num_mode); pass None for it"
            )
        if not 0 <= int(mode) < cfg.num_mode:
            raise ValueError(f"{label}={mode} must lie in [0, {cfg.num_mode}) (the net's num_mode)")
        modes.append(int(mode))
    fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(ControlRequest)}
    return FluxControlRequest(**fields, modes=np.asarray(modes, np.int32))


@dataclasses.dataclass
class FluxControlRequest(ControlRequest):
    """A `ControlRequest` with the nets' control modes `(K,)` int32 (0 for nets without modes)."""

    modes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.int32))

    def arrays(self, *, start: int, end: int, calls: int) -> dict[str, Any]:
        out = super().arrays(start=start, end=end, calls=calls)
        n = np.shape(self.images)[0]
        out["control_modes"] = np.tile(np.asarray(self.modes, np.int32)[None], (n, 1))
        return out
