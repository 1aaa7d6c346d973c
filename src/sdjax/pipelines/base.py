"""What SD 1.x/2.x and SDXL pipelines share: the user API over one `sdjax.core.Generator`, with loading, ahead-of-time
compilation and the old Flax guide API's plumbing mixed in from sibling modules.

The user API: `generate(prompt, ..., image=, mask_image=, strength=)` picks the task from its arguments
(text-to-image, image-to-image, inpainting), `generate_arrays` is the batch call the CLI and the server make.
Mixed in: `from_pretrained` / `from_single_file` (`pipelines.loading`), `compile` / `warmup` / `aot_compile`
(`pipelines.compiling`), the LoRA, textual-inversion and VAE-tiling methods (`pipelines.lora`,
`pipelines.textual_inversion`, `pipelines.vae_tiling`) and the guide API's shared plumbing (`pipelines.flax_api`).
The guide API itself (`prepare_inputs`, `__call__(..., jit=)`, `_generate`) lives in the family modules and the task
subclasses; it runs the same program.

The sampler is read from `self.scheduler` at each call, so assigning `pipe.scheduler = ...` takes effect on the
next call of either API (a different sampler is a different compiled program).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sdjax import planning, policy
from sdjax import samplers as sampler_lib
from sdjax.core import Generator
from sdjax.core.tasks import TaskRequest
from sdjax.pipelines import common
from sdjax.pipelines.common import Progress
from sdjax.pipelines.compiling import CompileMixin
from sdjax.pipelines.flax_api import FlaxGuideMixin
from sdjax.pipelines.flax_api import GuideCall as GuideCall  # re-exported (importable from here as before)
from sdjax.pipelines.images import make_image_grid, numpy_to_pil, to_uint8
from sdjax.pipelines.loading import LoadingMixin
from sdjax.pipelines.lora import LoraMixin
from sdjax.pipelines.textual_inversion import TextualInversionMixin
from sdjax.pipelines.vae_tiling import VaeTilingMixin


class DiffusionPipeline(LoadingMixin, CompileMixin, FlaxGuideMixin, LoraMixin, TextualInversionMixin, VaeTilingMixin):
    """Base of `StableDiffusionPipeline` and `StableDiffusionXLPipeline` (see the module docstring)."""

    model_index_classes: tuple[str, ...] = ()  # model_index.json `_class_name`s this family loads
    # (library, class) -> loader of the model classes only this family uses (`loading.components`)
    component_loaders: dict = {}
    pipeline_config_keys: tuple[str, ...] = ()  # model_index.json settings passed to __init__
    default_steps = 50
    # diffusers' defaults of the pipeline classes mirrored (`sdjax.policy`; the faces use A1111's instead)
    default_strength = {"img2img": 0.8, "inpaint": 1.0}  # StableDiffusionImg2ImgPipeline, ...InpaintPipeline
    default_guidance_scale = 7.5
    # Latents -> RGB by one linear map (A1111's "Approx cheap" preview): rows are latent channels. SD 1.x/2.x values;
    # SDXL overrides them. For previews only (e.g. the server's /sdapi/v1/progress current image).
    latent_rgb_factors = (
        (0.298, 0.207, 0.208),
        (0.187, 0.286, 0.173),
        (-0.158, 0.189, 0.264),
        (-0.184, -0.271, -0.473),
    )

    def __init__(self, *, denoiser, vae, scheduler, dtype=jnp.float32, name: str = "", params: dict | None = None):
        self.denoiser = denoiser  # the family's `core.protocols.Denoiser`
        self.vae = vae
        self.scheduler = scheduler
        self.dtype = dtype
        self.name = name
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.generator = Generator(
            conditioning=self._conditioning(),
            denoiser=denoiser,
            vae=vae,
            sampler=scheduler,
            params=params,
            dtype=dtype,
        )

    def _conditioning(self):  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ state shared with the generator
    @property
    def params(self) -> dict | None:
        return self.generator.params

    @params.setter
    def params(self, value: dict | None) -> None:
        self.generator.params = value

    @property
    def devices(self) -> list | None:
        """Devices the high-level path spreads a batch over (default: all)."""
        return self.generator.devices

    @devices.setter
    def devices(self, value) -> None:
        self.generator.devices = list(value) if value is not None else None

    @property
    def mesh(self) -> Mesh | None:
        """A `(data, model)` mesh from `sdjax.parallel.make_mesh` (default: data-parallel over `devices`)."""
        return self.generator.mesh

    @mesh.setter
    def mesh(self, value: Mesh | None) -> None:
        self.generator.mesh = value

    # ------------------------------------------------------------------ helpers of both APIs
    @property
    def default_size(self) -> tuple[int, int]:
        h, w = self.denoiser.sample_size
        return h * self.vae_scale_factor, w * self.vae_scale_factor

    def numpy_to_pil(self, images):
        return numpy_to_pil(images)

    make_image_grid = staticmethod(make_image_grid)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * self.denoiser.size_multiple

    @property
    def is_inpainting_model(self) -> bool:
        return int(self.denoiser.in_channels) != int(self.vae.config.latent_channels)

    @property
    def default_sampler(self) -> str:
        return sampler_lib.name_of(self.scheduler)

    @property
    def sampler_names(self) -> list[str]:
        return sampler_lib.available()

    def _sampler(self, name) -> Any:
        """The sampler for a name (from the model's scheduler config), a sampler object (a diffusers-parity `Sampler`
        or a k-diffusion-form `KDiffusionSampler`), or None (the current `self.scheduler`)."""
        if name is None:
            return self.scheduler
        if sampler_lib.is_sampler(name):
            return name
        if not isinstance(name, str):
            raise TypeError(
                f"sampler must be a name, a sampler object (sdjax.samplers) or None, got {type(name).__name__}"
            )
        return _cached_sampler(self.scheduler, name)

    def validate(
        self,
        *,
        prompts: Sequence[str] | None = None,
        negative_prompts: Sequence[str] | None = None,
        steps: int | None = None,
        height: int | None = None,
        width: int | None = None,
        guidance_scales: Sequence[float] | None = None,
        sampler: str | None = None,
        num_images: int | None = None,
    ) -> None:
        """Check high-level arguments; raises ValueError naming the argument, before anything compiles."""
        if prompts is not None and (not prompts or not all(isinstance(p, str) for p in prompts)):
            raise ValueError("prompt must be a non-empty str or list of str")
        if negative_prompts is not None and prompts is not None and len(negative_prompts) not in (1, len(prompts)):
            raise ValueError(
                f"negative_prompt: got {len(negative_prompts)} for {len(prompts)} prompts; pass one, or one per prompt"
            )
        if steps is not None:
            common.check_steps(common.check_static("steps", steps))
        if height is not None or width is not None:
            dh, dw = self.default_size
            common.check_size(height or dh, width or dw, self._size_multiple())
        if guidance_scales is not None:
            for g in guidance_scales:
                if not np.isfinite(g):
                    raise ValueError(f"guidance_scale={g} must be a finite number")
        if num_images is not None and (not isinstance(num_images, int) or num_images < 1):
            raise ValueError(f"num_images={num_images!r} must be a positive int")
        if sampler is not None:
            self._sampler(sampler)

    # ------------------------------------------------------------------ the user API
    def task_request(
        self,
        *,
        image=None,
        mask_image=None,
        strength: float | None = None,
        height: int,
        width: int,
        count: int,
        resize_mode: str = "resize",
        mask_blur: float = 0.0,
        padding_mask_crop: int | None = None,
        paste_back: bool | None = None,
        denoising_start: float | None = None,
        denoising_end: float | None = None,
    ) -> TaskRequest:
        """The task the arguments ask for, with diffusers' meanings (`sdjax.planning.plan_task` under
        `policy.DIFFUSERS`): text-to-image without `image`, image-to-image with it, inpainting with `image` and
        `mask_image`. `image` may also be the denoiser's latents `(N, C, h, w)` (the SDXL base's output)."""
        inputs = planning.TaskInputs(
            image=image,
            mask_image=mask_image,
            strength=strength,
            resize_mode=resize_mode,
            mask_blur=mask_blur,
            padding_mask_crop=padding_mask_crop,
            paste_back=paste_back,
            denoising_start=denoising_start,
            denoising_end=denoising_end,
        )
        return planning.plan_task(
            self, inputs, height=height, width=width, count=count, steps=None, policy=policy.DIFFUSERS
        )

    def generate_arrays(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str],
        seeds: Sequence[int],
        image_indices: Sequence[int],
        guidance_scales: Sequence[float],
        *,
        steps: int,
        height: int,
        width: int,
        sampler=None,
        pad_to: int | None = None,
        progress: Progress | None = None,
        params: dict | None = None,
        guidance_rescale: float = 0.0,
        task: TaskRequest | None = None,
        should_stop=None,
        noise=None,
        output: str = "images",
        prompt_syntax: str | None = None,
        control=None,
        features: Sequence = (),
        **conditioning,
    ) -> np.ndarray:
        """Images `(N, H, W, 3)` uint8 (`output="float"`: float32 in [0, 1]; `output="latents"`: the final latents
        `(N, C, h, w)` float32); image `i` uses
        key `fold_in(PRNGKey(seeds[i]), image_indices[i])`. The batch is padded to `pad_to` (or the next multiple
        of the device count) and sharded over the mesh's `data` axis; padding images are dropped. `control` (from
        `sdjax.pipelines.controlnet.control_request`) adds ControlNet conditioning; `features` are further
        `core.protocols.FeatureRequest`s (the ControlNet's runs after them). Raises
        `sdjax.core.Cancelled` when `should_stop()` returns True between two denoising steps."""
        n = len(prompts)
        if not (len(negative_prompts) == len(seeds) == len(image_indices) == len(guidance_scales) == n):
            raise ValueError(
                "generate_arrays: prompts, negative_prompts, seeds, image_indices and guidance_scales "
                "must have the same length"
            )
        self.validate(
            prompts=list(prompts),
            steps=steps,
            height=height,
            width=width,
            guidance_scales=list(guidance_scales),
            sampler=sampler,
        )
        keys = seed_keys(seeds, image_indices)
        params = self.with_active_loras(params)  # never drop a loaded LoRA silently (pipelines.lora)
        self._check_text_tables(params)
        out = self.generator.run(
            prompts=list(prompts),
            negative_prompts=[p or None for p in negative_prompts],
            keys=keys,
            guidance_scales=list(guidance_scales),
            steps=steps,
            height=height,
            width=width,
            sampler=self._sampler(sampler),
            task=task,
            conditioning=conditioning,
            noise=noise,
            pad_to=pad_to,
            params=params,
            output="latents" if output == "latents" else "images",
            guidance_rescale=guidance_rescale,
            progress=progress,
            should_stop=should_stop,
            prompt_syntax=prompt_syntax,
            features=(*features, *(() if control is None else (control,))),
        )
        if output == "latents":
            return out
        finish = task.finish if task is not None else None
        if output == "float":
            return out if finish is None else finish(to_uint8(out)).astype(np.float32) / 255.0
        images = to_uint8(out)
        return images if finish is None else finish(images)

    def _check_text_tables(self, params: dict | None) -> None:
        """Refuse params whose token tables are smaller than the text encoders now need (params taken before
        `load_textual_inversion` added tokens: the new tokens' ids would read past the table)."""
        if params is None:
            return
        for component in ("text_encoder", "text_encoder_2"):
            module, tree = getattr(self, component, None), params.get(component) if isinstance(params, dict) else None
            vocab = getattr(getattr(module, "config", None), "vocab_size", None)
            try:
                table = tree["text_model"]["embeddings"]["token_embedding"]["embedding"]
            except (KeyError, TypeError):
                continue
            if vocab is not None and int(table.shape[0]) != int(vocab):
                raise ValueError(
                    f"params[{component!r}] has a token table of {table.shape[0]} rows but the {component} now has "
                    f"{vocab} tokens (embeddings were loaded after these params were taken): pass pipe.params"
                )

    def generate(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] | None = None,
        num_images: int = 1,
        seed: int | Sequence[int] = 0,
        steps: int | None = None,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        sampler=None,
        *,
        image=None,
        mask_image=None,
        strength: float | None = None,
        resize_mode: str = "resize",
        mask_blur: float = 0.0,
        padding_mask_crop: int | None = None,
        paste_back: bool | None = None,
        denoising_start: float | None = None,
        denoising_end: float | None = None,
        noise=None,
        output_type: str = "pil",
        progress: Progress | None = None,
        params: dict | None = None,
        guidance_rescale: float = 0.0,
        prompt_syntax: str | None = None,
        control_image=None,
        controlnet=None,
        controlnet_conditioning_scale=None,
        control_guidance_start=0.0,
        control_guidance_end=1.0,
        guess_mode: bool = False,
        control_mode=None,
        **conditioning,
    ):
        """Prompt(s) -> list of PIL images (`num_images` per prompt); `output_type="np"` gives float32 arrays
        `(N, H, W, 3)` in [0, 1] (as diffusers), `"latent"` the final latents `(N, C, h, w)`. Image `i` of the
        call uses `fold_in(PRNGKey(seed), i)`, whatever the device count; `seed` a list of one int per image:
        image `i` is the image `seed=seed[i]` gives alone (`fold_in(PRNGKey(seed[i]), 0)`; AUTOMATIC1111's
        per-image seeds).

        - image-to-image: `image` (PIL, numpy HWC, a path, or a list of one per image) and `strength` (default:
          the class's `default_strength`, diffusers' own: SD 0.8, SDXL 0.3, Flux and SD 3 0.6);
        - inpainting: `image` and `mask_image` (white = repaint), `strength` (SD 1.0, SDXL 0.9999, Flux/SD 3 0.6),
          `mask_blur`,
          `padding_mask_crop` (repaint the masked region at full resolution), `paste_back`;
        - `denoising_end` / `denoising_start`: the SDXL base -> refiner hand-off (see `pipelines.recipes`);
        - `noise`: the initial noise `(N, C, h, w)` instead of noise drawn from the seed;
        - `prompt_syntax="a1111"`: prompts read as AUTOMATIC1111 reads them (`(word:1.3)`, `[word]`, `BREAK`,
          longer than 75 tokens; `sdjax.text.prompt_syntax`);
        - ControlNet (with any task): `control_image`, `controlnet`, `controlnet_conditioning_scale`,
          `control_guidance_start`/`_end`, `guess_mode` (and, for Flux's union nets, `control_mode`) as diffusers'
          ControlNet pipelines (`sdjax.pipelines.controlnet`); without an init image the output size defaults to the
          control image's.
        The output size defaults to the init image's (else the model's); `resize_mode` ("resize", "crop", "fill")
        says how an init image of another size is fitted.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negs = (
            [negative_prompt or ""]
            if negative_prompt is None or isinstance(negative_prompt, str)
            else list(negative_prompt)
        )
        self.validate(prompts=prompts, negative_prompts=negs, num_images=num_images)
        if output_type not in ("pil", "np", "latent"):
            raise ValueError(f"output_type={output_type!r} must be 'pil', 'np' or 'latent'")
        negs = negs * len(prompts) if len(negs) == 1 else negs
        steps = self.default_steps if steps is None else steps
        guidance_scale = self.default_guidance_scale if guidance_scale is None else guidance_scale
        if control_image is not None and image is None:
            from sdjax.pipelines.controlnet import control_size

            height, width = control_size(self, control_image, height, width)
        height, width = planning.task_size(self, planning.TaskInputs(image=image), height, width)
        self.validate(steps=steps, height=height, width=width, sampler=sampler)
        all_prompts = [p for p in prompts for _ in range(num_images)]
        all_negs = [q for q in negs for _ in range(num_images)]
        count = len(all_prompts)
        task = self.task_request(
            image=image,
            mask_image=mask_image,
            strength=strength,
            height=height,
            width=width,
            count=count,
            resize_mode=resize_mode,
            mask_blur=mask_blur,
            padding_mask_crop=padding_mask_crop,
            paste_back=paste_back,
            denoising_start=denoising_start,
            denoising_end=denoising_end,
        )
        control = None
        if control_image is not None:
            from sdjax.pipelines.controlnet import control_request

            control = control_request(
                self,
                control_image=control_image,
                controlnet=controlnet,
                params=params,
                count=count,
                height=height,
                width=width,
                task=task.spec.name,
                controlnet_conditioning_scale=controlnet_conditioning_scale,
                control_guidance_start=control_guidance_start,
                control_guidance_end=control_guidance_end,
                guess_mode=guess_mode,
                control_mode=control_mode,
            )
        elif controlnet is not None or controlnet_conditioning_scale is not None:
            raise ValueError("controlnet= and controlnet_conditioning_scale= need control_image= (the control map)")
        elif control_mode is not None:
            raise ValueError("control_mode= needs control_image= (the control map) and a ControlNet-Union net")
        seeds, indices = per_image_seeds(seed, count)
        out = self.generate_arrays(
            all_prompts,
            all_negs,
            seeds,
            indices,
            [guidance_scale] * count,
            steps=steps,
            height=height,
            width=width,
            sampler=sampler,
            progress=progress,
            params=params,
            task=task,
            guidance_rescale=guidance_rescale,
            noise=noise,
            output={"pil": "images", "np": "float", "latent": "latents"}[output_type],
            prompt_syntax=prompt_syntax,
            control=control,
            **conditioning,
        )
        if output_type != "pil":
            return out
        return numpy_to_pil(out)


def per_image_seeds(seed: int | Sequence[int], count: int) -> tuple[list[int], list[int]]:
    """`generate`'s `seed` as `(seeds, image indices)` of its `count` images: one seed for the call (indices
    0, 1, ...), or one seed per image (each index 0)."""

    def is_int(x) -> bool:
        return isinstance(x, int | np.integer) and not isinstance(x, bool)

    if is_int(seed):
        return [int(seed)] * count, list(range(count))
    seeds = list(seed) if isinstance(seed, Sequence | np.ndarray) and not isinstance(seed, str) else None
    if seeds is None or len(seeds) != count or not all(is_int(s) for s in seeds):
        raise ValueError(f"seed={seed!r}: expected one int, or a list of one int per image ({count})")
    return [int(s) for s in seeds], [0] * count


def seed_keys(seeds: Sequence[int], indices: Sequence[int]) -> np.ndarray:
    """Per-image raw keys `fold_in(PRNGKey(seed), index)` `(N, 2)` uint32."""
    if not len(seeds):
        return np.zeros((0, 2), np.uint32)
    fold = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))
    return np.asarray(fold(jnp.asarray(np.asarray(seeds, np.uint32)), jnp.asarray(np.asarray(indices, np.uint32))))


_SAMPLER_CACHE: dict = {}


def _cached_sampler(base, name: str):
    key = (base, name)
    if key not in _SAMPLER_CACHE:
        if len(_SAMPLER_CACHE) > 64:
            _SAMPLER_CACHE.clear()
        _SAMPLER_CACHE[key] = sampler_lib.get_sampler(name, base_config=base)
    return _SAMPLER_CACHE[key]
