"""The user API's ControlNet arguments -> a `families.sd.controlnet.ControlRequest` (what `generate(control_image=,
controlnet=, controlnet_conditioning_scale=, control_guidance_start=, control_guidance_end=, guess_mode=)` runs).

Arguments as diffusers' ControlNet pipelines take them:
- `controlnet`: a `(module, params)` pair (what `FlaxControlNetModel.from_pretrained` / `load_controlnet`
  return), a folder or Hub repo id (loaded once per pipeline, in the pipeline's dtype), or a list of those for
  several nets (`MultiControlNetModel`); None uses the net the pipeline was loaded with (`from_pretrained(...,
  controlnet=)`, params in `params["controlnet"]`).
- `control_image`: one net: an image (PIL, uint8 HWC array, path or bytes) or one per generated image; several
  nets: a list of one image per net, or (diffusers' nested form) one such list per generated image. Each is
  resized to the output size with Lanczos and scaled to [0, 1] (`preprocess.prepare_control_image`, diffusers'
  `prepare_image`).
- `controlnet_conditioning_scale`, `control_guidance_start`, `control_guidance_end`: a float, or one per net.
  The default scale is diffusers' per pipeline: 1.0 for text-to-image, 0.8 for image-to-image, 0.5 for SD
  inpainting and 1.0 for SDXL inpainting.
- `guess_mode`: static; forced on when the first net has `global_pool_conditions`, as diffusers does.
- `control_mode`: the mode of a ControlNet-Union net (Flux; an int, or one per net); families whose module has no
  `with_control_mode` refuse it.

A family with ControlNets of its own names their module in its pipeline class's `controlnet_module` (SD 3:
`families.sd3.controlnet`, Flux: `families.flux.controlnet`). `control_spec` hands such a pipeline to the module's
`control_spec` (same arguments); `control_request` asks it `check_task(task)` before any net is loaded and
`check_size(pipe, spec, height, width)` after, takes its `DEFAULT_SCALE`, and lets its `with_control_mode` (where it
has one) add the nets' control modes to the request; the scales, windows and control images are read here for every
family. The nets of the UNet families (SD 1.x/2.x, SDXL) are resolved here.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np

from sdjax.families.sd.controlnet import ControlRequest, ControlSpec, check_nets
from sdjax.models.controlnet import ControlNetModel
from sdjax.models.flux_controlnet import FluxControlNetModel
from sdjax.models.sd3_controlnet import SD3ControlNetModel

DEFAULT_SCALES = {"txt2img": 1.0, "img2img": 0.8, "inpaint": 0.5}  # SD; SDXL inpainting: 1.0
CONTROL_ARGS = (
    "controlnet",
    "controlnet_conditioning_scale",
    "control_guidance_start",
    "control_guidance_end",
    "guess_mode",
)


def is_pair(x: Any) -> bool:
    """Whether `x` is a `(module, params)` pair of a ControlNet (what `FlaxControlNetModel.from_pretrained` and
    `load_controlnet` return: a `ControlNetModel`, an `SD3ControlNetModel` or a `FluxControlNetModel`)."""
    nets = (ControlNetModel, SD3ControlNetModel, FluxControlNetModel)
    return isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], nets)


def family_controlnet(pipe):
    """The module of a family's own ControlNets (the pipeline class's `controlnet_module`), or None for the UNet
    families; a pipeline with neither takes no ControlNet."""
    target = getattr(pipe, "controlnet_module", "")
    if target:
        return importlib.import_module(target)
    if getattr(pipe, "unet", None) is None:
        raise ValueError(f"control_image=: {type(pipe).__name__} takes no ControlNet")
    return None


def resolve_nets(pipe, controlnet: Any, params: dict | None) -> list[tuple[ControlNetModel, Any]]:
    """`controlnet` (see the module docstring) -> `[(module, params), ...]`."""
    if controlnet is None:
        module = getattr(pipe, "controlnet", None)
        if module is None:
            raise ValueError(
                "control_image= needs a ControlNet: pass controlnet=(module, params) as returned by "
                "FlaxControlNetModel.from_pretrained, a ControlNet folder or repo id, or a list of them"
            )
        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        source = params if params is not None else pipe.params
        trees = (source or {}).get("controlnet")
        if trees is None:
            raise KeyError("params has no 'controlnet' entry: set params['controlnet'] = controlnet_params")
        trees = list(trees) if isinstance(trees, (list, tuple)) else [trees]
        if len(trees) != len(modules):
            raise ValueError(f"params['controlnet'] holds {len(trees)} param tree(s) for {len(modules)} ControlNet(s)")
        return list(zip(modules, trees))
    if is_pair(controlnet) or isinstance(controlnet, (str, os.PathLike)):
        items = [controlnet]
    elif isinstance(controlnet, (list, tuple)) and controlnet:
        items = list(controlnet)
    else:
        raise TypeError(
            f"controlnet must be a (module, params) pair, a ControlNet folder or repo id, or a list of them; got "
            f"{type(controlnet).__name__}"
        )
    out = []
    for k, item in enumerate(items):
        label = "controlnet" if len(items) == 1 else f"controlnet[{k}]"
        if isinstance(item, (str, os.PathLike)):
            out.append(_load(pipe, str(item)))
        elif is_pair(item):
            out.append((item[0], item[1]))
        else:
            raise TypeError(
                f"{label} must be a (module, params) pair as FlaxControlNetModel.from_pretrained returns, or a "
                f"ControlNet folder or repo id; got {type(item).__name__}"
            )
    return out


def _load(pipe, path: str):
    """The net at `path` in the pipeline's dtype, quantized as its denoiser is (`quant.params.controlnet_policy`);
    the last four loaded are kept."""
    cache = pipe.__dict__.setdefault("_controlnet_cache", {})
    policy = quant_policy(pipe, getattr(pipe, "quantization", None))
    key = (path, policy)
    if key not in cache:
        from sdjax.loading.controlnet import load_controlnet

        if len(cache) >= 4:
            cache.pop(next(iter(cache)))
        cache[key] = load_controlnet(path, dtype=pipe.dtype, quantize=policy)
    return cache[key]


def quant_policy(pipe, quantize: Any):
    """The weight-only policy of the ControlNets `pipe` loads by name or path when it is quantized with `quantize`
    (a scheme name, a `QuantPolicy` or None), or None."""
    if quantize is None:
        return None
    from sdjax.quant.params import controlnet_policy, resolve_policy

    component = pipe.denoiser.component
    return controlnet_policy(resolve_policy(quantize, component), component)


def per_net(name: str, value: Any, k: int, *, lo: float | None = None, hi: float | None = None) -> list[float]:
    """A float or one per net -> `k` floats (checked finite and within `[lo, hi]`)."""
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if len(values) == 1 and k > 1 and not isinstance(value, (list, tuple, np.ndarray)):
        values = values * k
    if len(values) != k:
        raise ValueError(f"{name}: got {len(values)} value(s) for {k} ControlNet(s); pass one float or one per net")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v):
            raise TypeError(f"{name} must be a finite float or a list of them, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"{name}={v!r} must lie in [{lo}, {hi}]")
        out.append(float(v))
    return out


def _images_per_net(control_image: Any, k: int) -> list[list[Any]]:
    """One net: an image or a list of one per generated image. Several nets (diffusers' convention): a list of one
    image per net, or a list of one such list per generated image (transposed here to per net)."""
    if k == 1:
        return [list(control_image) if isinstance(control_image, (list, tuple)) else [control_image]]
    if isinstance(control_image, (list, tuple)) and control_image and isinstance(control_image[0], (list, tuple)):
        if any(not isinstance(c, (list, tuple)) or len(c) != k for c in control_image):
            raise ValueError(
                f"control_image: as a list of lists, each inner list must hold one image per ControlNet ({k})"
            )
        return [list(t) for t in zip(*control_image)]
    if not isinstance(control_image, (list, tuple)) or len(control_image) != k:
        got = len(control_image) if isinstance(control_image, (list, tuple)) else 1
        raise ValueError(f"control_image: got {got} entries for {k} ControlNets; pass one image per net")
    return [[c] for c in control_image]


def first_control_image(control_image: Any):
    """The first image of a `control_image` argument (for the output size)."""
    x = control_image
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return x


def control_size(pipe, control_image: Any, height: int | None, width: int | None) -> tuple[int, int]:
    """The output size of text-to-image with a control image: given, else the control image's (diffusers)."""
    if height is not None and width is not None:
        return height, width
    from sdjax.core import images as image_lib

    w0, h0 = image_lib.load_image(first_control_image(control_image), "control_image").size
    height, width = height or h0, width or w0
    m = pipe._size_multiple()
    if height % m or width % m:
        raise ValueError(
            f"control_image is {w0}x{h0}, not a multiple of {m} for this model: pass width= and height= (the "
            f"control image is then resized) or resize it"
        )
    return height, width


def control_spec(pipe, controlnet: Any, params: dict | None, guess_mode: bool = False) -> tuple[ControlSpec, tuple]:
    """`controlnet` (see the module docstring) -> (the static `ControlSpec`, the nets' param trees), checked
    against the pipeline's UNet."""
    family = family_controlnet(pipe)
    if family is not None:
        return family.control_spec(pipe, controlnet, params, guess_mode)
    nets = resolve_nets(pipe, controlnet, params)
    modules = [m for m, _ in nets]
    for k, m in enumerate(modules):
        if not isinstance(m, ControlNetModel):
            label = "controlnet" if len(modules) == 1 else f"controlnet[{k}]"
            family = "a Flux.1" if isinstance(m, FluxControlNetModel) else "a Stable Diffusion 3 / 3.5"
            raise ValueError(
                f"{label} is a {type(m).__name__} ({family} ControlNet) but the pipeline is "
                f"{type(pipe).__name__}: load a ControlNet made for it"
            )
    check_nets(modules, pipe.unet.config)
    for k, m in enumerate(modules):
        if int(m.config.conditioning_channels) != 3:
            label = "controlnet" if len(modules) == 1 else f"controlnet[{k}]"
            raise ValueError(
                f"{label} takes {m.config.conditioning_channels}-channel control images; generate() prepares RGB "
                f"images (3 channels)"
            )
    if not isinstance(guess_mode, bool):
        raise TypeError(f"guess_mode must be a bool, got {type(guess_mode).__name__}")
    spec = ControlSpec(tuple(modules), guess_mode or bool(modules[0].config.global_pool_conditions))
    return spec, tuple(p for _, p in nets)


def control_request(
    pipe,
    *,
    control_image: Any,
    controlnet: Any,
    params: dict | None,
    count: int,
    height: int,
    width: int,
    task: str,
    controlnet_conditioning_scale: Any = None,
    control_guidance_start: Any = 0.0,
    control_guidance_end: Any = 1.0,
    guess_mode: bool = False,
    control_mode: Any = None,
) -> ControlRequest:
    """The ControlNet conditioning of one `generate` call for `count` images of `height` x `width`."""
    family = family_controlnet(pipe)
    modes = getattr(family, "with_control_mode", None)
    if control_mode is not None and modes is None:
        raise ValueError(
            f"control_mode={control_mode!r}: only ControlNet-Union nets of Flux take a control mode, not the "
            f"ControlNets of {type(pipe).__name__}"
        )
    if family is not None:
        family.check_task(task)  # before any net is loaded
    spec, trees = control_spec(pipe, controlnet, params, guess_mode)
    if family is not None:
        family.check_size(pipe, spec, height, width)
    k = len(trees)
    scale = controlnet_conditioning_scale
    if scale is None:
        scale = default_scale(pipe, family, task)
    scales = per_net("controlnet_conditioning_scale", scale, k)
    starts = per_net("control_guidance_start", control_guidance_start, k, lo=0.0, hi=1.0)
    ends = per_net("control_guidance_end", control_guidance_end, k, lo=0.0, hi=1.0)
    for s, e in zip(starts, ends):
        if s >= e:
            raise ValueError(f"control_guidance_start={s} must be below control_guidance_end={e}")
    request = ControlRequest(
        spec=spec,
        params=trees,
        images=control_image_arrays(control_image, k, count, width, height),
        scales=np.tile(np.asarray(scales, np.float32), (count, 1)),
        starts=np.tile(np.asarray(starts), (count, 1)),
        ends=np.tile(np.asarray(ends), (count, 1)),
    )
    return request if modes is None else modes(request, control_mode)


def default_scale(pipe, family, task: str) -> float:
    """diffusers' `controlnet_conditioning_scale` default for this pipeline and task: the family module's
    `DEFAULT_SCALE`, else (the UNet families) `DEFAULT_SCALES[task]`, 1.0 for SDXL inpainting."""
    if family is not None:
        return float(family.DEFAULT_SCALE)
    sdxl = getattr(pipe.unet.config, "addition_embed_type", None) == "text_time"
    return 1.0 if sdxl and task == "inpaint" else DEFAULT_SCALES[task]


def control_image_arrays(control_image: Any, k: int, count: int, width: int, height: int) -> np.ndarray:
    """`control_image` (see the module docstring) for `k` nets and `count` generated images -> float32
    `(count, k, 3, height, width)` in [0, 1]."""
    from sdjax.core import images as image_lib
    from sdjax.preprocess import prepare_control_image

    per = _images_per_net(control_image, k)
    arrays = []
    for j, images in enumerate(per):
        label = "control_image" if k == 1 else f"control_image[{j}]"
        if len(images) not in (1, count):
            raise ValueError(f"{label}: got {len(images)} images for {count} generated images; pass one, or one each")
        prepared = []
        for i, im in enumerate(images):
            name = label if len(images) == 1 else f"{label}[{i}]"
            if not isinstance(im, np.ndarray):
                im = image_lib.load_image(im, name)
            prepared.append(prepare_control_image(_checked(im, name), width, height)[0])
        a = np.stack(prepared)
        arrays.append(np.repeat(a, count, axis=0) if len(a) == 1 else a)
    return np.stack(arrays, axis=1)


def _checked(image: Any, name: str):
    from sdjax.preprocess import as_rgb_uint8

    if isinstance(image, np.ndarray):
        return as_rgb_uint8(image, what=name)
    return image
