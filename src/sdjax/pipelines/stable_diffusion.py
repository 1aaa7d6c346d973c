"""Stable Diffusion 1.x / 2.x with the API of Diffusers' Flax pipelines, as thin shims over `sdjax.core`.

- `StableDiffusionPipeline` (`FlaxStableDiffusionPipeline`): text-to-image; `prepare_inputs(prompt)`,
  `__call__(prompt_ids, params, prng_seed, ..., jit=)`, `_generate` (the per-device function users `pmap`).
- `StableDiffusionImg2ImgPipeline` (`FlaxStableDiffusionImg2ImgPipeline`): `prepare_inputs(prompt, image) ->
  (prompt_ids, processed_images)`, `__call__(prompt_ids, image, params, prng_seed, strength=0.8, ...)`.
- `StableDiffusionInpaintPipeline` (`FlaxStableDiffusionInpaintPipeline`): `prepare_inputs(prompt, image, mask) ->
  (prompt_ids, masked_images, masks)`, `__call__(prompt_ids, mask, masked_image, params, prng_seed, ...)`.

Every class also has the high-level `generate(prompt, image=, mask_image=, ...)`; they differ only in their guide
API. Any of them loads any SD 1.x/2.x folder (txt2img, img2img or inpainting checkpoints), as diffusers allows.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.core.tasks import TaskRequest
from sdjax.core.tasks.img2img import Img2Img
from sdjax.core.tasks.inpaint import Inpaint
from sdjax.core.tasks.txt2img import Txt2Img
from sdjax.families.sd import SDConditioning, UNetDenoiser
from sdjax.pipelines import common
from sdjax.pipelines.base import DiffusionPipeline
from sdjax.pipelines.flax_api import GuideCall

SD_CLASSES = ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline")


class StableDiffusionPipeline(DiffusionPipeline):
    """Text-to-image with a CLIP text encoder, a UNet, a VAE and a sampler (diffusers `StableDiffusionPipeline`)."""

    model_index_classes = SD_CLASSES

    def __init__(
        self,
        *,
        tokenizer,
        text_encoder,
        unet,
        vae,
        scheduler,
        safety_checker=None,
        feature_extractor=None,
        dtype=jnp.float32,
        name: str = "",
        params: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.safety_checker = safety_checker
        self.feature_extractor = feature_extractor
        self.unet = unet
        super().__init__(
            denoiser=UNetDenoiser(unet, dtype), vae=vae, scheduler=scheduler, dtype=dtype, name=name, params=params
        )

    def _conditioning(self):
        return SDConditioning(self.tokenizer, self.text_encoder)

    # ------------------------------------------------------------------ the guide's API
    returns_nsfw = True

    def prepare_inputs(self, prompt: str | Sequence[str]) -> np.ndarray:
        """Tokenize to CLIP ids: int32 `(N, 77)`, padded and truncated (with a warning)."""
        return self.tokenizer(_prompts(prompt))

    def _generate(
        self,
        prompt_ids,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        latents=None,
        neg_prompt_ids=None,
    ):
        """Per-device generation: ids `(B, 77)`, one key -> images `(B, H, W, 3)` in [0, 1].

        Image `j` uses `fold_in(prng_seed, j)`. Steps, height and width fix shapes and must be static.
        """
        return self._traced(
            GuideCall(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                guidance_scale,
                neg_prompt_ids,
                TaskRequest(Txt2Img()),
                noise=latents,
            )
        )

    def __call__(
        self,
        prompt_ids,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        latents=None,
        neg_prompt_ids=None,
        return_dict: bool = True,
        jit: bool = False,
    ):
        """The old Flax pipeline call. With `jit=True` inputs are per device (`replicate(params)`,
        `shard(prompt_ids)` -> `(ndev, bs, 77)`, one key per device) and images come back `(ndev, bs, H, W, 3)`;
        with `jit=False`, `(N, 77)` -> `(N, H, W, 3)`. Called inside a user's `pmap`, it traces `_generate`."""
        dh, dw = self.default_size
        return self._guide(
            GuideCall(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                dh if height is None else height,
                dw if width is None else width,
                guidance_scale,
                neg_prompt_ids,
                TaskRequest(Txt2Img()),
                jit=jit,
                return_dict=return_dict,
                noise=latents,
                traced=common.is_traced(prompt_ids, prng_seed, params),
            )
        )

    def _run_safety_checker(self, images: np.ndarray, params, jit: bool):
        if self.safety_checker is None or "safety_checker" not in params:
            return None
        flat = images.reshape((-1,) + images.shape[-3:])
        sc_params = params["safety_checker"]
        if jit:
            sc_params = jax.tree_util.tree_map(lambda x: x[0], sc_params)
        flat, nsfw = self.safety_checker.check(sc_params, flat)
        images[...] = flat.reshape(images.shape)
        return np.asarray(nsfw).reshape(images.shape[:-3])


class StableDiffusionImg2ImgPipeline(StableDiffusionPipeline):
    """Image-to-image with the old Flax API (`FlaxStableDiffusionImg2ImgPipeline`)."""

    def prepare_inputs(self, prompt: str | Sequence[str], image=None):
        """`(prompt_ids (N, 77), images (N, 3, H, W) float32 in [-1, 1])`; each image resized down to a multiple of
        32 (Lanczos), as the old Flax pipeline did. Without `image`, the prompt ids alone."""
        ids = self.tokenizer(_prompts(prompt))
        if image is None:
            return ids
        return ids, np.stack([_legacy_image(im) for im in _list(image)])

    @staticmethod
    def get_timestep_start(num_inference_steps: int, strength: float) -> int:
        """The first step index for `strength` (the old API's `start_timestep`)."""
        init = min(int(num_inference_steps * strength), num_inference_steps)
        return max(num_inference_steps - init, 0)

    def _generate(
        self,
        prompt_ids,
        image,
        params,
        prng_seed,
        start_timestep,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        noise=None,
        neg_prompt_ids=None,
    ):
        """Per-device image-to-image from step `start_timestep` (a step index, as the old API)."""
        return self._traced(
            GuideCall(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                guidance_scale,
                neg_prompt_ids,
                TaskRequest(Img2Img(), {"image": image}),
                noise=noise,
                start=start_timestep * getattr(self.scheduler, "order", 1),
            )
        )

    def __call__(
        self,
        prompt_ids,
        image,
        params,
        prng_seed,
        strength: float = 0.8,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        noise=None,
        neg_prompt_ids=None,
        return_dict: bool = True,
        jit: bool = False,
    ):
        """The old Flax img2img call; `image` from `prepare_inputs` (`shard`ed with `jit=True`). The output size
        is the image's (`height`/`width`, if given, must equal it)."""
        traced = common.is_traced(prompt_ids, prng_seed, params, image)
        if not traced:
            height, width = _image_size("image", image, height, width, 4 if jit else 3)
            image = np.asarray(image, np.float32)
        return self._guide(
            GuideCall(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                guidance_scale,
                neg_prompt_ids,
                TaskRequest(Img2Img(), {"image": image}, strength=strength),
                jit=jit,
                return_dict=return_dict,
                noise=noise,
                noise_name="noise",
                traced=traced,
            )
        )


class StableDiffusionInpaintPipeline(StableDiffusionPipeline):
    """Inpainting with the old Flax API (`FlaxStableDiffusionInpaintPipeline`); works with 9-channel inpainting
    UNets and, by latent blending, with ordinary ones."""

    def prepare_inputs(self, prompt: str | Sequence[str], image=None, mask=None):
        """`(prompt_ids, masked_images (N, 3, H, W), masks (N, 1, H, W))`, sizes rounded down to a multiple of 32,
        masks binarized at 0.5, as the old Flax pipeline did. Without `image`, the prompt ids alone."""
        ids = self.tokenizer(_prompts(prompt))
        if image is None:
            return ids
        if mask is None:
            raise ValueError("prepare_inputs: pass mask= with image= (white = repaint)")
        images = np.stack([_legacy_image(im) for im in _list(image)])
        masks = np.stack([_legacy_mask(m) for m in _list(mask)])
        if images.shape[-2:] != masks.shape[-2:]:
            raise ValueError(f"image and mask sizes differ: {images.shape[-2:]} vs {masks.shape[-2:]}")
        return ids, images * (masks < 0.5), masks

    def _generate(
        self,
        prompt_ids,
        mask,
        masked_image,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        latents=None,
        neg_prompt_ids=None,
    ):
        task = TaskRequest(Inpaint(from_noise=True), {"image": masked_image, "mask": mask})
        return self._traced(
            GuideCall(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                guidance_scale,
                neg_prompt_ids,
                task,
                noise=latents,
            )
        )

    def __call__(
        self,
        prompt_ids,
        mask,
        masked_image,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        latents=None,
        neg_prompt_ids=None,
        return_dict: bool = True,
        jit: bool = False,
    ):
        """The old Flax inpainting call (note: `mask` before `masked_image`, as the old API). The output size is
        the images' (`height`/`width`, if given, must equal it)."""
        traced = common.is_traced(prompt_ids, prng_seed, params, mask, masked_image)
        if not traced:
            height, width = _image_size("masked_image", masked_image, height, width, 4 if jit else 3)
            if np.shape(mask)[-2:] != (height, width) or np.shape(mask)[-3] != 1:
                raise ValueError(
                    f"mask has shape {np.shape(mask)}; expected (..., 1, {height}, {width}) like "
                    f"masked_image {np.shape(masked_image)}"
                )
            mask, masked_image = np.asarray(mask, np.float32), np.asarray(masked_image, np.float32)
        task = TaskRequest(Inpaint(from_noise=True), {"image": masked_image, "mask": mask})
        return self._guide(
            GuideCall(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                guidance_scale,
                neg_prompt_ids,
                task,
                jit=jit,
                return_dict=return_dict,
                noise=latents,
                image_name="masked_image",
                traced=traced,
            )
        )


# ----------------------------------------------------------------------------------------------- helpers
def _prompts(prompt) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(p, str) for p in prompt):
        raise TypeError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")
    return list(prompt)


def _list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _legacy_image(image) -> np.ndarray:
    from sdjax.core import images as image_lib

    im = image_lib.load_image(image, "image").convert("RGB")
    w, h = (x - x % 32 for x in im.size)
    return image_lib.image_array(im.resize((w, h), resample=image_lib.Image.LANCZOS))


def _legacy_mask(mask) -> np.ndarray:
    from sdjax.core import images as image_lib

    m = image_lib.load_image(mask, "mask").convert("L")
    w, h = (x - x % 32 for x in m.size)
    return image_lib.mask_array(m.resize((w, h)))


def _image_size(name: str, image, height, width, ndim: int) -> tuple[int, int]:
    shape = np.shape(image)
    if len(shape) != ndim + 1 or shape[-3] not in (1, 3):
        lead = "(num_devices, batch_per_device, " if ndim == 4 else "(N, "
        raise ValueError(f"{name} has shape {shape}; expected {lead}C, H, W) as made by prepare_inputs")
    h, w = int(shape[-2]), int(shape[-1])
    if (height is not None and height != h) or (width is not None and width != w):
        raise ValueError(
            f"height/width {height}x{width} differ from the {name} size {h}x{w}; resize the image before prepare_inputs"
        )
    return h, w
