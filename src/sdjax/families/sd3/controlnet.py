"""ControlNet for Stable Diffusion 3 / 3.5: diffusers' `StableDiffusion3ControlNetPipeline` (with one net, or several
as `SD3MultiControlNetModel`) as the SD 3 family's `core.protocols.Feature`, in diffusers 0.42.1.

The control image is resized to the output size (Lanczos), scaled to [-1, 1] and encoded by the pipeline's VAE
inside the program; the net reads those latents, not pixels:

    control latents_k = (vae posterior sample - shift) * scaling_factor     (shift 0 for InstantX's nets, below)
    per model call i of the schedule (n calls, as diffusers' `controlnet_keep`):
        keep_k  = 1 - (i / n < control_guidance_start_k  or  (i + 1) / n > control_guidance_end_k)
        samples = sum_k  net_k(x_in, control latents_k, text, pooled_k, t) * controlnet_conditioning_scale_k * keep_k
        out     = transformer(x_in, text, pooled, t, controlnet_block_samples=samples)

- A net whose config says `force_zeros_for_pooled_projection` (InstantX's SD 3 nets; diffusers' default) gets zero
  pooled embeddings, and its control latents are encoded without subtracting the VAE's `shift_factor` (as it was
  trained); the SD 3.5 large nets get the prompt's pooled embeddings and the shifted latents. Nets without
  `joint_attention_dim` (SD 3.5 large) take no text states; nets with `use_pos_embed` false run the transformer's
  patch embedding (its `pos_embed` params, copied into the net's tree here as diffusers' pipeline copies the module).
- Classifier-free guidance: the net runs on the CFG-doubled batch (uncond text first) with the control latents and
  scales repeated for both halves. diffusers encodes the doubled control images, so its two halves get different
  posterior noise, drawn from torch's global generator (not the pipeline's `generator`); sdjax draws one posterior
  sample per image from the image's key (stream `rng.ENCODE_CONTROL + k`) and repeats it.
- Several nets (diffusers: a list of nets or `SD3MultiControlNetModel`): their samples are summed; they must have as
  many blocks and the same `force_zeros_for_pooled_projection` (diffusers reads that flag from the first net only).
- The keep table is `families.sd.controlnet.keep_table` (host, float64 as diffusers), so scales, starts and ends
  change without recompiling. A net whose scale is 0 for every image at a step is skipped (`lax.cond`): its
  samples are exactly 0 then, as diffusers' products.

Refused before anything is compiled, naming the argument: a net made for another family (an SD 1.x/2.x or SDXL
`ControlNetModel`), a net that does not fit the transformer (patch size, latent channels, width, text or pooled
width), an inpainting net (`extra_conditioning_channels` > 0: diffusers' `StableDiffusion3ControlNetInpaintingPipeline`,
which sdjax does not have), `guess_mode`, an init image (diffusers has no SD 3 ControlNet image-to-image pipeline)
and an output larger than a net's position table.
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
from sdjax.models.flux_controlnet import FluxControlNetModel
from sdjax.models.sd3_controlnet import SD3ControlNetModel
from sdjax.pipelines.controlnet import resolve_nets
from sdjax.quant.modules import apply_dequantized

INPUTS = ("control_image", "control_scales")
SAMPLES = "controlnet_block_samples"  # the denoiser's keyword for the summed samples (`families.sd3.denoiser`)


@dataclasses.dataclass(frozen=True)
class SD3ControlSpec:
    """The static part of SD 3 ControlNet conditioning (part of the compile key): the net modules, in order (a
    `use_pos_embed` false net already given the transformer's config), and `latent_offset`, added to the VAE
    encoder's latents: `shift_factor * scaling_factor` for nets trained on latents without the shift (InstantX's),
    else 0. `params["controlnet"]` holds one param tree per net."""

    name: ClassVar[str] = "controlnet"  # (`core.protocols.Feature`)
    params_key: ClassVar[str] = "controlnet"

    nets: tuple[Any, ...]
    latent_offset: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "nets", tuple(self.nets))
        if not self.nets:
            raise ValueError("SD3ControlSpec: give at least one ControlNet")

    @property
    def zero_pooled(self) -> bool:
        """The nets take zero pooled embeddings (`force_zeros_for_pooled_projection`, the same for every net)."""
        return bool(self.nets[0].config.force_zeros_for_pooled_projection)

    def example_inputs(self, *, batch: int, height: int, width: int, calls: int) -> dict[str, np.ndarray]:
        """Zero program inputs (`INPUTS`) of the shapes a program of `calls` model calls takes."""
        k = len(self.nets)
        return {
            "control_image": np.zeros((batch, k, 3, height, width), np.float32),
            "control_scales": np.zeros((batch, calls, k), np.float32),
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
        """The loop hook; `cond` is the SD 3 conditioning (`{"text", "pooled"}`, CFG-stacked), `encode` the
        program's VAE encoder (images NCHW in [-1, 1], a noise stream -> the denoiser's latents)."""
        del latent_channels
        if encode is None:
            raise ValueError("SD 3 ControlNets read VAE latents of the control image: the hook needs encode=")
        trees = tuple(params) if isinstance(params, (list, tuple)) else (params,)
        if len(trees) != len(self.nets):
            raise ValueError(
                f"params['controlnet'] holds {len(trees)} param tree(s) for {len(self.nets)} ControlNet(s)"
            )
        images = inputs["control_image"]
        latents = []
        for k in range(len(self.nets)):
            z = encode(images[:, k].astype(jnp.float32) * 2.0 - 1.0, rng.ENCODE_CONTROL + k)
            z = z + self.latent_offset if self.latent_offset else z
            latents.append(jnp.concatenate([z, z]) if cfg else z)
        pooled = cond["pooled"]
        return SD3ControlHook(
            spec=self,
            params=trees,
            latents=tuple(latents),
            scales=inputs["control_scales"],
            text=cond["text"],
            pooled=jnp.zeros_like(pooled) if self.zero_pooled else pooled,
            cfg=cfg,
        )


@dataclasses.dataclass(frozen=True)
class SD3ControlHook(Hook):
    """`model_kwargs`: the nets' summed block samples for the (CFG-doubled) batch; see the module docstring.

    `latents`: per net the control latents `(rows, C, h, w)` (already doubled for CFG); `scales` `(B, calls, K)`
    the scale of net k at each model call (0 outside its start/end range)."""

    spec: SD3ControlSpec
    params: tuple
    latents: tuple
    scales: jax.Array
    text: jax.Array
    pooled: jax.Array
    cfg: bool

    def model_kwargs(self, step, x_in, t):
        scales = jax.lax.dynamic_index_in_dim(self.scales, step, axis=1, keepdims=False)  # (B, K)
        rows = x_in.shape[0]
        timestep = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (rows,))
        total = None
        for k, net in enumerate(self.spec.nets):
            scale = jnp.concatenate([scales[:, k], scales[:, k]]) if self.cfg else scales[:, k]
            text = self.text if net.config.joint else None
            samples = _run_net(net, self.params[k], x_in, self.latents[k], text, self.pooled, timestep, scale)
            total = samples if total is None else tuple(a + b for a, b in zip(total, samples))
        return {SAMPLES: total}


def _run_net(net, params, x_in, latents, text, pooled, timestep, scale):
    """One net's block samples, each image's scaled by `scale` `(rows,)`; zeros without running the net when every
    scale is 0."""

    def run(_):
        # weight-only: a quantized net's kernels (and those of the transformer's patch embedding it borrows) here
        return apply_dequantized(net, {"params": params}, x_in, latents, text, pooled, timestep, scale)

    shapes = jax.eval_shape(run, None)
    zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return jax.lax.cond(jnp.any(scale != 0), run, lambda _: zeros, None)


# ------------------------------------------------------------------------------------------------ host side
def check_nets(nets: Sequence[Any], transformer_config: Any, *, name: str = "controlnet") -> None:
    """Refuse nets made for another family, nets that do not fit the transformer, inpainting nets, and sets of
    nets that cannot be summed (see the module docstring)."""
    t = transformer_config
    for k, net in enumerate(nets):
        label = name if len(nets) == 1 else f"{name}[{k}]"
        if not isinstance(net, SD3ControlNetModel):
            kind = "a Stable Diffusion 1.x/2.x or SDXL ControlNet"
            if isinstance(net, FluxControlNetModel):
                kind = "a Flux.1 ControlNet"
            raise ValueError(
                f"{label} is a {type(net).__name__} ({kind}) but the pipeline "
                f"is Stable Diffusion 3 / 3.5: load an SD3ControlNetModel (e.g. InstantX/SD3-Controlnet-Canny, "
                f"stabilityai/stable-diffusion-3.5-large-controlnet-canny)"
            )
        cfg = net.config
        pairs = [
            ("patch_size", cfg.patch_size, t.patch_size),
            ("in_channels", cfg.in_channels, t.in_channels),
            ("num_attention_heads * attention_head_dim", cfg.inner_dim, t.inner_dim),
            ("pooled_projection_dim", cfg.pooled_projection_dim, t.pooled_projection_dim),
        ]
        if cfg.joint:
            pairs.append(("joint_attention_dim", cfg.joint_attention_dim, t.joint_attention_dim))
        for key, a, b in pairs:
            if a != b:
                raise ValueError(
                    f"{label} does not fit this model's transformer: {key} is {a} in the ControlNet, {b} in the "
                    f"transformer"
                )
        if cfg.extra_conditioning_channels:
            raise ValueError(
                f"{label} is an inpainting ControlNet (extra_conditioning_channels={cfg.extra_conditioning_channels}: "
                f"it reads the mask too), made for diffusers' StableDiffusion3ControlNetInpaintingPipeline, which "
                f"sdjax does not have"
            )
    first = nets[0].config
    for k, net in enumerate(nets[1:], start=1):
        for key in ("num_layers", "force_zeros_for_pooled_projection"):
            if getattr(net.config, key) != getattr(first, key):
                raise ValueError(
                    f"{name}[{k}] has {key}={getattr(net.config, key)!r}, {name}[0] {getattr(first, key)!r}: "
                    f"several SD 3 ControlNets are summed block by block and share the pooled input, so these must "
                    f"agree"
                )


def control_spec(pipe, controlnet: Any, params: dict | None, guess_mode: bool = False) -> tuple[SD3ControlSpec, tuple]:
    """`controlnet` (as `pipelines.controlnet` takes it) -> (the static `SD3ControlSpec`, the nets' param trees),
    checked against the pipeline's transformer."""
    if guess_mode is not False:
        raise ValueError("guess_mode: SD 3 ControlNets have no guess mode (StableDiffusion3ControlNetPipeline)")
    nets = resolve_nets(pipe, controlnet, params)
    check_nets([m for m, _ in nets], pipe.transformer.config)
    modules, trees = [], []
    for module, tree in nets:
        if not module.config.use_pos_embed:  # the transformer's patch embedding, as diffusers' pipeline copies it
            source = params if params is not None else pipe.params
            transformer = (source or {}).get("transformer")
            if transformer is None or "pos_embed" not in transformer:
                raise KeyError(
                    "controlnet has use_pos_embed=false and runs the transformer's patch embedding: params has no "
                    "'transformer' entry with 'pos_embed'"
                )
            module = module.clone(pos_embed_config=pipe.transformer.config)
            tree = {**tree, "pos_embed": transformer["pos_embed"]}
        modules.append(module)
        trees.append(tree)
    offset = 0.0
    if modules[0].config.force_zeros_for_pooled_projection:
        vae = pipe.vae.config
        offset = float(vae.shift_factor or 0.0) * float(vae.scaling_factor)
    return SD3ControlSpec(tuple(modules), offset), tuple(trees)


DEFAULT_SCALE = 1.0  # StableDiffusion3ControlNetPipeline's controlnet_conditioning_scale


def check_task(task: str) -> None:
    """SD 3 ControlNets run text-to-image only (`pipelines.controlnet.control_request` asks before loading a net)."""
    if task != "txt2img":
        raise ValueError(
            f"SD 3 ControlNets run text-to-image only, not {task} (diffusers has no SD 3 ControlNet image-to-image "
            f"pipeline, and its inpainting one needs an inpainting net): generate without an init image and mask "
            f"(image=, mask_image=), or without the ControlNet"
        )


def check_size(pipe, spec: SD3ControlSpec, height: int, width: int) -> None:
    """Refuse an output of more patches on a side than a net's position table holds (`pos_embed_max_size`)."""
    f, k = pipe.vae_scale_factor, len(spec.nets)
    for j, net in enumerate(spec.nets):
        cfg = net.config
        m, p = cfg.pos_embed_max_size, cfg.patch_size
        table = cfg.use_pos_embed and cfg.pos_embed_type is not None and m is not None
        if table and (height // f // p > m or width // f // p > m):
            label = "controlnet" if k == 1 else f"controlnet[{j}]"
            raise ValueError(
                f"{label}: a {width}x{height} image is more than its pos_embed_max_size={m} patches on a side "
                f"(at most {m * p * f} pixels)"
            )
