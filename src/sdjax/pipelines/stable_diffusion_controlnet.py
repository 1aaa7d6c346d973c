"""Stable Diffusion 1.x / 2.x with a ControlNet, with the API of Diffusers' `FlaxStableDiffusionControlNetPipeline`
(diffusers <= 0.39), over the same generation program as everything else (`families.sd.controlnet`).

    controlnet, controlnet_params = FlaxControlNetModel.from_pretrained(repo, from_pt=True, dtype=jnp.float32)
    pipe, params = FlaxStableDiffusionControlNetPipeline.from_pretrained(sd_repo, controlnet=controlnet, ...)
    params["controlnet"] = controlnet_params
    prompt_ids = pipe.prepare_text_inputs(prompts)           # (N, 77)
    processed_image = pipe.prepare_image_inputs(images)      # (N, 3, H, W) in [0, 1], sides cut to multiples of 64
    out = pipe(shard(prompt_ids), shard(processed_image), replicate(params), rngs, 50, jit=True)

- `from_pretrained(..., controlnet=)` takes the module (the guides then set `params["controlnet"]`), a `(module,
  params)` pair or a ControlNet folder / repo id (both also fill `params["controlnet"]`); a diffusers
  `StableDiffusionControlNetPipeline` folder with its own `controlnet/` loads as it is.
- `__call__(prompt_ids, image, params, prng_seed, num_inference_steps=50, guidance_scale=7.5, latents=None,
  neg_prompt_ids=None, controlnet_conditioning_scale=1.0, return_dict=True, jit=False)`: the output size is the
  control image's. With `jit=True` inputs are per device (`shard`, `replicate`, one key per device) and `pmap` runs
  the program; scales may be a float, one per device or one per image.
- `_generate(prompt_ids, image, params, prng_seed, num_inference_steps, guidance_scale, latents=None,
  neg_prompt_ids=None, controlnet_conditioning_scale=1.0)`: the per-device function for a user's own `pmap`.

Differences from the old class: noise is drawn per image from `fold_in(prng_seed, j)` (as every sdjax guide
class), a `global_pool_conditions` net runs in guess mode (diffusers' PyTorch rule), and the high-level
`generate(prompt, control_image=...)` uses the loaded net when `controlnet=` is not given.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from sdjax.core.tasks import TaskRequest
from sdjax.core.tasks.txt2img import Txt2Img
from sdjax.families.sd.controlnet import ControlRequest, ControlSpec, check_nets
from sdjax.models.controlnet import ControlNetModel
from sdjax.pipelines import common
from sdjax.pipelines.controlnet import is_pair, quant_policy
from sdjax.pipelines.flax_api import GuideCall
from sdjax.pipelines.stable_diffusion import SD_CLASSES, StableDiffusionPipeline

_UNSET = object()


class StableDiffusionControlNetPipeline(StableDiffusionPipeline):
    """Text-to-image guided by one ControlNet (`FlaxStableDiffusionControlNetPipeline`; see the module docstring)."""

    model_index_classes = (*SD_CLASSES, "StableDiffusionControlNetPipeline")

    def __init__(self, *, controlnet: ControlNetModel | None = None, **components):
        self.controlnet = controlnet
        super().__init__(**components)
        if controlnet is not None:
            check_nets([controlnet], self.unet.config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *, controlnet: Any = _UNSET, **kwargs):
        """`StableDiffusionPipeline.from_pretrained` plus the ControlNet: `controlnet=` a module, a `(module, params)`
        pair or a ControlNet folder / repo id (loaded in `dtype`); without it, the folder's own `controlnet/`."""
        pipe, params = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        if controlnet is _UNSET:
            return pipe, params
        if isinstance(controlnet, (str, os.PathLike)):
            from sdjax.loading.controlnet import load_controlnet

            policy = quant_policy(pipe, kwargs.get("quantize"))  # quantized as the UNet, when it is
            controlnet = load_controlnet(controlnet, dtype=kwargs.get("dtype", jnp.float32), quantize=policy)
        if is_pair(controlnet):
            module, params["controlnet"] = controlnet
        elif isinstance(controlnet, ControlNetModel) or controlnet is None:
            module = controlnet
            params.pop("controlnet", None)  # the folder's own weights do not belong to this module
        else:
            raise TypeError(
                "controlnet must be a ControlNet module (FlaxControlNetModel.from_pretrained(...)[0]), a (module, "
                f"params) pair or a ControlNet folder or repo id; got {type(controlnet).__name__}"
            )
        if module is not None:
            check_nets([module], pipe.unet.config)
        pipe.controlnet = module
        return pipe, params

    # ------------------------------------------------------------------ the guide's API
    prepare_text_inputs = StableDiffusionPipeline.prepare_inputs  # CLIP ids `(N, 77)`

    def prepare_image_inputs(self, image) -> np.ndarray:
        """PIL image(s) -> float32 `(N, 3, H, W)` in [0, 1]: RGB, each side cut down to a multiple of 64, Lanczos
        resize, as the old Flax pipeline prepared control images."""
        from PIL import Image

        images = image if isinstance(image, list) else [image]
        if not isinstance(image, (Image.Image, list)) or not all(isinstance(im, Image.Image) for im in images):
            bad = type(image).__name__ if not isinstance(image, list) else "a list holding a non-PIL item"
            raise ValueError(f"image has to be a PIL.Image.Image or a list of them, got {bad}")
        out = []
        for im in images:
            im = im.convert("RGB")
            w, h = (x - x % 64 for x in im.size)
            if w < 64 or h < 64:
                raise ValueError(f"image is {im.size[0]}x{im.size[1]}; each side must be at least 64 pixels")
            a = np.asarray(im.resize((w, h), resample=Image.LANCZOS), np.float32) / 255.0
            out.append(a.transpose(2, 0, 1))
        if len({a.shape for a in out}) != 1:
            raise ValueError("image: the images have different sizes after cutting to multiples of 64")
        return np.stack(out)

    def _control(self, params, image, scale, n: int, traced: bool) -> ControlRequest:
        if self.controlnet is None:
            raise ValueError(
                "this pipeline has no ControlNet: load it with from_pretrained(..., controlnet=controlnet) and set "
                "params['controlnet'] = controlnet_params"
            )
        cfg = self.controlnet.config
        images = image.reshape((n, 1) + tuple(image.shape[-3:]))
        return ControlRequest(
            spec=ControlSpec((self.controlnet,), bool(cfg.global_pool_conditions)),
            params=(params["controlnet"],) if not traced else (),
            images=images,
            scales=scale.reshape(n, 1),
            starts=np.zeros((n, 1)),
            ends=np.ones((n, 1)),
        )

    def _guide_call(
        self, prompt_ids, image, params, prng_seed, steps, guidance_scale, latents, neg_prompt_ids, scale, *,
        traced: bool, **options,
    ) -> GuideCall:  # fmt: skip
        """The `GuideCall` of both entry points: text-to-image at the control image's size, `scale` one per image;
        `traced` (inside a user's `pmap`): the nets' params come from the traced `params`."""
        return GuideCall(
            prompt_ids,
            params,
            prng_seed,
            steps,
            int(image.shape[-2]),
            int(image.shape[-1]),
            guidance_scale,
            neg_prompt_ids,
            TaskRequest(Txt2Img()),
            noise=latents,
            features=(self._control(params, image, scale, int(np.prod(np.shape(scale))), traced=traced),),
            **options,
        )

    def _generate(
        self,
        prompt_ids,
        image,
        params,
        prng_seed,
        num_inference_steps: int,
        guidance_scale,
        latents=None,
        neg_prompt_ids=None,
        controlnet_conditioning_scale=1.0,
    ):
        """Per-device generation: ids `(B, 77)`, control images `(B, 3, H, W)`, one key -> images `(B, H, W, 3)`."""
        scale = common.guidance_per_image(controlnet_conditioning_scale, prompt_ids.shape[0])
        return self._traced(
            self._guide_call(
                prompt_ids,
                jnp.asarray(image),
                params,
                prng_seed,
                num_inference_steps,
                guidance_scale,
                latents,
                neg_prompt_ids,
                scale,
                traced=True,
            )
        )

    def __call__(
        self,
        prompt_ids,
        image,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        guidance_scale=7.5,
        latents=None,
        neg_prompt_ids=None,
        controlnet_conditioning_scale=1.0,
        return_dict: bool = True,
        jit: bool = False,
    ):
        """The old Flax ControlNet call (see the module docstring); images `(ndev, bs, H, W, 3)` with `jit=True`,
        `(N, H, W, 3)` without. Inside a user's `pmap` it is `_generate` (the images, not a `PipelineOutput`)."""
        if common.is_traced(prompt_ids, prng_seed, params, image, controlnet_conditioning_scale):
            return self._generate(
                prompt_ids, image, params, prng_seed, num_inference_steps, guidance_scale, latents, neg_prompt_ids,
                controlnet_conditioning_scale,
            )  # fmt: skip
        lead = tuple(np.shape(prompt_ids)[: 2 if jit else 1])
        image = self._check_image(image, lead, jit)
        if "controlnet" not in (params or {}):
            raise KeyError("params has no 'controlnet' entry: set params['controlnet'] = controlnet_params")
        scale = self._scales(controlnet_conditioning_scale, lead, jit)
        call = self._guide_call(
            prompt_ids, image, params, prng_seed, num_inference_steps, guidance_scale, latents, neg_prompt_ids, scale,
            traced=False, jit=jit, return_dict=return_dict,
        )  # fmt: skip
        return self._guide(call)

    def _check_image(self, image, lead: tuple[int, ...], jit: bool) -> np.ndarray:
        shape = tuple(np.shape(image)) if isinstance(image, (np.ndarray, jnp.ndarray)) else None
        channels = int(self.controlnet.config.conditioning_channels) if self.controlnet is not None else 3
        want = "(num_devices, batch_per_device, C, H, W)" if jit else "(N, C, H, W)"
        if shape is None:
            raise TypeError(
                f"image must be an array {want} as made by prepare_image_inputs (shard()-ed with jit=True), got "
                f"{type(image).__name__}"
            )
        if len(shape) != len(lead) + 3 or shape[: len(lead)] != lead or shape[-3] != channels:
            raise ValueError(
                f"image has shape {shape}; expected {want} with C={channels} and leading dimensions {lead} like "
                f"prompt_ids, as made by prepare_image_inputs{' and shard()' if jit else ''}"
            )
        return np.asarray(image, np.float32)

    @staticmethod
    def _scales(scale, lead: tuple[int, ...], jit: bool) -> np.ndarray:
        s = np.asarray(scale, np.float32)
        if not np.isfinite(s).all():
            raise ValueError(f"controlnet_conditioning_scale={scale!r} must be finite")
        if jit:
            ndev, bs = lead
            if s.shape not in ((), (ndev,), (ndev, 1), (ndev, bs)):
                raise ValueError(
                    f"controlnet_conditioning_scale has shape {s.shape}; with jit=True use a float or an array of "
                    f"shape ({ndev},), ({ndev}, 1) or ({ndev}, {bs})"
                )
            s = s.reshape(ndev, -1) if s.ndim else s
            return np.broadcast_to(s, (ndev, bs)).reshape(-1)
        if s.shape not in ((), (1,), lead):
            raise ValueError(
                f"controlnet_conditioning_scale has shape {s.shape}; use a float or one value per prompt {lead}"
            )
        return np.broadcast_to(s.reshape(-1), lead).reshape(-1)
