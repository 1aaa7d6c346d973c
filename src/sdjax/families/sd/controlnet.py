"""ControlNet for the UNet families (SD 1.x/2.x and SDXL share it): a `core.loop.Hook` that runs one or several
ControlNets before each UNet call and hands the UNet the sum of their residuals (diffusers
`StableDiffusionControlNetPipeline`, `...Img2ImgPipeline`, `...InpaintPipeline`,
`StableDiffusionXLControlNetPipeline` with `MultiControlNetModel`, in diffusers 0.42.1).

Per model call `i` of the window `[start, end)` (n = calls - start, j = i - start) and per net k:

    keep_k  = 1 - (j / n < control_guidance_start_k  or  (j + 1) / n > control_guidance_end_k)
    scale_k = controlnet_conditioning_scale_k * keep_k
    down, mid = sum_k  net_k(x_in[:, :C], t, context, control_image_k) * scale_k

- The keep table is computed on the host in float64 exactly as diffusers does (`keep_table`) and enters the
  program as an array `(B, calls, K)`: scales, starts and ends change without recompiling; the number of nets and
  guess mode are static (`ControlSpec`).
- Classifier-free guidance: the control image is repeated for both halves. In guess mode (Zhang et al.'s "guess
  mode", diffusers `guess_mode=True`, forced on by a `global_pool_conditions` net) the nets see only the
  conditional half (latents, text states, SDXL `text_embeds`/`time_ids`) and the unconditional half gets zero
  residuals; each net weights its residuals by `logspace(-1, 0, n_down + 1)` (`models.controlnet`).
- A 9-channel inpainting UNet: the nets get the first C (latent) channels of the model input, i.e. the scaled
  latents without mask and masked-image latents (what diffusers' ControlNet inpaint pipeline feeds them).
- A net whose scale is 0 for every image at a step (outside its start/end range) is skipped with `lax.cond`:
  its residuals are exactly 0 then, as diffusers' multiplied ones.
- SDXL ControlNets (`addition_embed_type="text_time"`) take the UNet's pooled text embedding and time ids.

The core sees a `ControlSpec` through `core.protocols.Feature` only (in `ProgramSpec.features`: `name`,
`params_key`, `hook`, `example_inputs`) and a `ControlRequest` as a `core.protocols.FeatureRequest` in
`Generator.run(features=)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.core.loop import Hook
from sdjax.quant.modules import apply_dequantized

INPUTS = ("control_image", "control_scales")


@dataclasses.dataclass(frozen=True)
class ControlSpec:
    """The static part of ControlNet conditioning (part of the compile key): the net modules, in order, and guess
    mode. `params["controlnet"]` holds one param tree per net (a list or tuple; a single tree for one net)."""

    name: ClassVar[str] = "controlnet"  # (`core.protocols.Feature`)
    params_key: ClassVar[str] = "controlnet"

    nets: tuple[Any, ...]
    guess_mode: bool = False

    def __post_init__(self):
        object.__setattr__(self, "nets", tuple(self.nets))
        if not self.nets:
            raise ValueError("ControlSpec: give at least one ControlNet")

    def example_inputs(self, *, batch: int, height: int, width: int, calls: int) -> dict[str, np.ndarray]:
        """Zero program inputs (`INPUTS`) of the shapes a program of `calls` model calls takes."""
        k = len(self.nets)
        channels = int(self.nets[0].config.conditioning_channels)
        return {
            "control_image": np.zeros((batch, k, channels, height, width), np.float32),
            "control_scales": np.zeros((batch, calls, k), np.float32),
        }

    def hook(
        self, params: Any, inputs: dict, *, cond: Any, cfg: bool, latent_channels: int, encode: Any = None
    ) -> Hook:
        """The loop hook; `cond` is the UNet families' conditioning `(context, added UNet arguments)`. `encode` is
        not used (these nets read the control image itself)."""
        del encode
        context, added = cond
        trees = tuple(params) if isinstance(params, (list, tuple)) else (params,)
        if len(trees) != len(self.nets):
            raise ValueError(
                f"params['controlnet'] holds {len(trees)} param tree(s) for {len(self.nets)} ControlNet(s)"
            )
        return ControlNetHook(
            spec=self,
            params=trees,
            images=inputs["control_image"],
            scales=inputs["control_scales"],
            context=context,
            added=dict(added),
            cfg=cfg,
            channels=latent_channels,
        )


@dataclasses.dataclass(frozen=True)
class ControlNetHook(Hook):
    """`model_kwargs`: the summed residuals of every net for the (CFG-doubled) batch; see the module docstring.

    `images` `(B, K, C, H, W)` control images in [0, 1]; `scales` `(B, calls, K)` the scale of net k at each model
    call (0 outside its start/end range)."""

    spec: ControlSpec
    params: tuple
    images: jax.Array
    scales: jax.Array
    context: jax.Array
    added: dict
    cfg: bool
    channels: int

    def model_kwargs(self, step, x_in, t):
        batch = self.images.shape[0]
        guess = self.spec.guess_mode and self.cfg
        sample = x_in[:, : self.channels]
        context, added = self.context, self.added
        if guess:  # the conditional half only
            sample, context = sample[batch:], context[batch:]
            added = {k: v[batch:] for k, v in added.items()}
        scales = jax.lax.dynamic_index_in_dim(self.scales, step, axis=1, keepdims=False)  # (B, K)
        down, mid = None, None
        for k, net in enumerate(self.spec.nets):
            image, scale = self.images[:, k], scales[:, k]
            if self.cfg and not guess:
                image, scale = jnp.concatenate([image, image]), jnp.concatenate([scale, scale])
            net_added = added if net.config.addition_embed_type == "text_time" else {}
            d, m = _run_net(net, self.params[k], sample, t, context, image, scale, self.spec.guess_mode, net_added)
            if down is None:
                down, mid = d, m
            else:
                down = tuple(a + b for a, b in zip(down, d))
                mid = mid + m
        if guess:
            down = tuple(jnp.concatenate([jnp.zeros_like(r), r]) for r in down)
            mid = jnp.concatenate([jnp.zeros_like(mid), mid])
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}


def _run_net(net, params, sample, t, context, image, scale, guess_mode: bool, added: dict):
    """One net's residuals, each image's scaled by `scale` `(B,)`; zeros without running the net when every scale
    is 0."""

    def run(_):
        down, mid = apply_dequantized(  # a quantized net's kernels dequantized here (weight-only)
            net,
            {"params": params},
            sample.astype(net.dtype),
            t,
            context,
            image,
            1.0,
            guess_mode,
            **added,
        )
        s = scale.reshape((-1, 1, 1, 1))
        return tuple((r * s).astype(r.dtype) for r in down), (mid * s).astype(mid.dtype)

    shapes = jax.eval_shape(run, None)
    zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return jax.lax.cond(jnp.any(scale != 0), run, lambda _: zeros, None)


# ------------------------------------------------------------------------------------------------ host side
def keep_table(starts: np.ndarray, ends: np.ndarray, *, start: int, end: int, calls: int) -> np.ndarray:
    """Guidance starts and ends `(N, K)` -> float32 `(N, calls, K)`: whether net k acts on image n at each model
    call of the schedule; 0 outside the window `[start, end)` and where diffusers' `controlnet_keep` is 0
    (`i / len(timesteps) < start or (i + 1) / len(timesteps) > end` in Python floats, `i` counted from the
    window's first call). `len(timesteps)` is `calls - start`: diffusers cuts the schedule by strength (or
    `denoising_start`) before it computes the keep factors, and by `denoising_end` only after."""
    starts, ends = np.asarray(starts, np.float64), np.asarray(ends, np.float64)
    table = np.zeros((starts.shape[0], calls, starts.shape[1]), np.float32)
    n = calls - start
    for i in range(start, end):
        j = i - start
        for b in range(starts.shape[0]):
            for k in range(starts.shape[1]):
                table[b, i, k] = 1.0 - float(j / n < float(starts[b, k]) or (j + 1) / n > float(ends[b, k]))
    return table


@dataclasses.dataclass
class ControlRequest:
    """ControlNet conditioning for one call: the static spec, the nets' params, and per-image arrays: `images`
    `(N, K, C, H, W)` in [0, 1] and `scales` `(N, K)` (host arrays, or traced ones inside a user's `pmap`);
    `starts`, `ends` `(N, K)` host floats."""

    spec: ControlSpec
    params: tuple
    images: Any
    scales: Any
    starts: np.ndarray
    ends: np.ndarray

    def arrays(self, *, start: int, end: int, calls: int) -> dict[str, Any]:
        """The program inputs (`INPUTS`) for the window `[start, end)` of a schedule of `calls` model calls:
        `control_scales` `(N, calls, K)` is each net's scale where it acts, else 0 (exactly diffusers' products:
        the keep factors are 0 or 1)."""
        keep = keep_table(self.starts, self.ends, start=start, end=end, calls=calls)
        traced = isinstance(self.scales, jax.core.Tracer) or isinstance(self.images, jax.core.Tracer)
        xp = jnp if traced else np
        return {
            "control_image": xp.asarray(self.images, xp.float32),
            "control_scales": keep * xp.asarray(self.scales, xp.float32)[:, None, :],
        }


def check_nets(nets: Sequence[Any], unet_config: Any, *, name: str = "controlnet") -> None:
    """Refuse ControlNets that do not fit the UNet: an SDXL net on an SD model (or the reverse), another text
    width, other block widths or depth (the residuals would not match the UNet's skips)."""
    unet_xl = getattr(unet_config, "addition_embed_type", None) == "text_time"
    for k, net in enumerate(nets):
        label = name if len(nets) == 1 else f"{name}[{k}]"
        cfg = net.config
        net_xl = cfg.addition_embed_type == "text_time"
        if net_xl != unet_xl:
            kind = "an SDXL ControlNet (addition_embed_type='text_time')" if net_xl else "an SD 1.x/2.x ControlNet"
            model = "an SDXL model" if unet_xl else "an SD 1.x/2.x model"
            raise ValueError(f"{label} is {kind} but the pipeline is {model}; load a ControlNet made for it")
        for key in ("cross_attention_dim", "block_out_channels", "layers_per_block"):
            a, b = getattr(cfg, key), getattr(unet_config, key)
            a, b = (tuple(a), tuple(b)) if isinstance(a, (list, tuple)) else (a, b)
            if a != b:
                raise ValueError(
                    f"{label} does not fit this model's UNet: {key} is {a!r} in the ControlNet, {b!r} in the UNet"
                )
        if cfg.addition_embed_type == "text_time" and (
            cfg.projection_class_embeddings_input_dim != unet_config.projection_class_embeddings_input_dim
        ):
            raise ValueError(
                f"{label} does not fit this model's UNet: projection_class_embeddings_input_dim "
                f"{cfg.projection_class_embeddings_input_dim} != {unet_config.projection_class_embeddings_input_dim}"
            )
