"""What SD 1.x/2.x and SDXL pipelines share: loading, the user API and the guide API's plumbing, all over one
`sdjax.core.Generator`.

The user API: `generate(prompt, ..., image=, mask_image=, strength=)` picks the task from its arguments
(text-to-image, image-to-image, inpainting), `generate_arrays` is the batch call the CLI and the server make,
`compile`/`warmup`/`aot_compile` compile ahead of time. The guide API (`prepare_inputs`, `__call__(..., jit=)`,
`_generate`) lives in the family modules and the task subclasses; it runs the same program.

The sampler is read from `self.scheduler` at each call, so assigning `pipe.scheduler = ...` takes effect on the
next call of either API (a different sampler is a different compiled program).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sdjax import rng
from sdjax import samplers as sampler_lib
from sdjax.core import Generator
from sdjax.core.tasks import TaskRequest, img2img, inpaint, txt2img
from sdjax.pipelines import common
from sdjax.pipelines.common import PipelineOutput, Progress
from sdjax.pipelines.images import make_image_grid, numpy_to_pil, to_uint8
from sdjax.pipelines.lora import LoraMixin
from sdjax.pipelines.textual_inversion import TextualInversionMixin
from sdjax.pipelines.vae_tiling import VaeTilingMixin


class DiffusionPipeline(LoraMixin, TextualInversionMixin, VaeTilingMixin):
    """Base of `StableDiffusionPipeline` and `StableDiffusionXLPipeline` (see the module docstring)."""

    model_index_classes: tuple[str, ...] = ()  # model_index.json `_class_name`s this family loads
    # (library, class) -> loader of the model classes only this family uses (`loading.components`)
    component_loaders: dict = {}
    pipeline_config_keys: tuple[str, ...] = ()  # model_index.json settings passed to __init__
    default_steps = 50
    default_guidance_scale = 7.5
    returns_nsfw = False  # the old API's tuple output: (images, nsfw flags) for SD, (images,) for SDXL
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

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        *,
        revision: str | None = None,
        variant: str | None = None,
        dtype=jnp.float32,
        from_pt: bool = False,
        split_head_dim: bool = False,
        use_memory_efficient_attention: bool = False,
        attention: str | None = None,
        local_files_only: bool = False,
        vae: Any = None,
        quantize: str | None = None,
        **components,
    ):
        """Load a diffusers folder or Hub repo id -> `(pipeline, params)` (a single `.safetensors` checkpoint
        file goes to `from_single_file`).

        `dtype` is the dtype of the stored params and of the computation (the scheduler state stays float32).
        A keyword named like a component (`scheduler=`, `safety_checker=None`, ...) replaces or disables it;
        `scheduler` may be a sampler object (`sdjax.samplers.get_sampler(...)`), a scheduler config dict, or a
        sampler name such as `"euler_a"` or `"DPM++ 2M Karras"` (built from the model's own scheduler config, as
        diffusers' `from_config`). `vae` replaces the VAE: a diffusers VAE folder or Hub repo, a single VAE file,
        or a `(module, params)` pair. `"sdjax/embedded"` names the small model shipped with the package. `from_pt`
        is accepted for compatibility and has no effect: PyTorch-format weights are always converted.
        `quantize="int8"|"fp8"` (or a `sdjax.quant.QuantPolicy`) stores the denoiser's kernels quantized,
        dequantized inside the program (`sdjax.quant`, docs/quantization.md).
        """
        from sdjax.loading.components import load_pipeline_components
        from sdjax.loading.single_file import load_vae
        from sdjax.models.presets import resolve_alias
        from sdjax.quant import check_quantize

        del from_pt
        check_quantize(quantize)
        pretrained_model_name_or_path = resolve_alias(pretrained_model_name_or_path)
        if os.path.isfile(pretrained_model_name_or_path):
            return cls.from_single_file(
                pretrained_model_name_or_path,
                dtype=dtype,
                vae=vae,
                split_head_dim=split_head_dim,
                attention=attention or ("chunked" if use_memory_efficient_attention else None),
                quantize=quantize,
                **components,
            )
        scheduler = components.pop("scheduler", None)
        loaded, params, model_index = load_pipeline_components(
            pretrained_model_name_or_path,
            expected_class=cls.model_index_classes,
            revision=revision,
            variant=variant,
            dtype=dtype,
            local_files_only=local_files_only,
            overrides=components,
            vae=vae,
            vae_loader=load_vae,
            loaders=cls.component_loaders,
        )
        return cls._assemble(
            loaded,
            params,
            model_index,
            dtype=dtype,
            name=str(pretrained_model_name_or_path),
            scheduler=scheduler,
            split_head_dim=split_head_dim,
            attention=attention or ("chunked" if use_memory_efficient_attention else None),
            quantize=quantize,
        )

    @classmethod
    def from_single_file(
        cls,
        path: str,
        *,
        dtype=jnp.float32,
        prediction_type: str | None = None,
        config: str | None = None,
        vae: Any = None,
        extract_ema: bool = False,
        allow_pickle: bool = False,
        split_head_dim: bool = False,
        attention: str | None = None,
        local_files_only: bool = False,
        quantize: str | None = None,
        **components,
    ):
        """Load an original-layout checkpoint file (as civitai ships them: SD 1.x, 2.x, XL base / refiner,
        inpainting) -> `(pipeline, params)`. The architecture is inferred from the tensors; configs and tokenizers
        come from sdjax's embedded config sets (or `config=`, a diffusers folder or Hub repo); `prediction_type`
        overrides what the file says (SD 2.x 512 epsilon vs 768 v-prediction). `.ckpt` pickles are refused unless
        `allow_pickle=True` (read by a restricted unpickler that executes no code). See
        `sdjax.loading.single_file`. `quantize` as for `from_pretrained`."""
        from sdjax.loading.single_file import load_single_file
        from sdjax.quant import check_quantize

        check_quantize(quantize)
        scheduler = components.pop("scheduler", None)
        loaded, params, model_index = load_single_file(
            path,
            dtype=dtype,
            prediction_type=prediction_type,
            config=config,
            vae=vae,
            extract_ema=extract_ema,
            allow_pickle=allow_pickle,
            overrides=components,
            local_files_only=local_files_only,
        )
        found = model_index.get("_class_name", "")
        if found not in cls.model_index_classes:
            raise ValueError(
                f"{path}: the checkpoint is a {found} model; load it with the matching pipeline class "
                f"(or sdjax.load_pipeline, which picks it)"
            )
        return cls._assemble(
            loaded,
            params,
            model_index,
            dtype=dtype,
            name=str(path),
            scheduler=scheduler,
            split_head_dim=split_head_dim,
            attention=attention,
            quantize=quantize,
        )

    @classmethod
    def _assemble(
        cls,
        loaded: dict,
        params: dict,
        model_index: dict,
        *,
        dtype,
        name: str,
        scheduler=None,
        split_head_dim: bool = False,
        attention: str | None = None,
        quantize: str | None = None,
    ):
        """The pipeline from loaded components: runtime options on the modules, the sampler override, the
        quantized denoiser (`sdjax.quant.quantize_pipeline`)."""
        from sdjax.quant import quantize_pipeline

        runtime = {"split_head_dim": split_head_dim}
        if attention:
            runtime["attention"] = attention
        for component in ("unet", "transformer", "text_encoder", "text_encoder_2", "vae"):
            module = loaded.get(component)
            if module is not None:
                fields = {k: v for k, v in runtime.items() if hasattr(module, k)}
                loaded[component] = module.clone(**fields) if fields else module
        if scheduler is not None:
            loaded["scheduler"] = sampler_lib.get_sampler(scheduler, base_config=loaded["scheduler"])
            params["scheduler"] = loaded["scheduler"].create_state()
        settings = {k: model_index[k] for k in cls.pipeline_config_keys if k in model_index}
        pipe = cls(**loaded, **settings, dtype=dtype, name=name, params=params)
        return quantize_pipeline(pipe, params, quantize)

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
        """The sampler for a name (from the model's scheduler config), a sampler object, or None (the current
        `self.scheduler`)."""
        if name is None:
            return self.scheduler
        if isinstance(name, sampler_lib.Sampler):
            return name
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
        """The task the arguments ask for: text-to-image without `image`, image-to-image with it, inpainting with
        `image` and `mask_image`. `image` may also be UNet latents `(N, C, h, w)` (the SDXL base's output)."""
        if image is None:
            if mask_image is not None:
                raise ValueError("mask_image= needs image= (the image to inpaint)")
            if strength is not None or denoising_start is not None:
                raise ValueError("strength= and denoising_start= need image= (they set how much of it to keep)")
            if self.is_inpainting_model:
                raise ValueError(
                    f"this model's UNet takes {self.denoiser.in_channels} input channels (an "
                    f"inpainting model): pass image= and mask_image="
                )
            return txt2img.request(denoising_end=denoising_end)
        images = image if isinstance(image, (list, tuple)) else [image]
        if _is_latents(images[0], self.vae.config.latent_channels):
            if mask_image is not None:
                raise ValueError("image= given as latents cannot be inpainted here; pass pixels")
            latents = np.concatenate([np.asarray(x, np.float32) for x in images])
            return img2img.request(
                [],
                width=width,
                height=height,
                strength=1.0 if strength is None else strength,
                denoising_start=denoising_start,
                denoising_end=denoising_end,
                latents=_repeat(latents, count, "image"),
            )
        images = _repeat_list(images, count, "image")
        if mask_image is None:
            if self.is_inpainting_model:
                raise ValueError(
                    f"this model's UNet takes {self.denoiser.in_channels} input channels (an "
                    f"inpainting model): it needs mask_image= as well as image="
                )
            return img2img.request(
                images,
                width=width,
                height=height,
                strength=0.8 if strength is None else strength,
                resize_mode=resize_mode,
                denoising_start=denoising_start,
                denoising_end=denoising_end,
            )
        masks = _repeat_list(mask_image if isinstance(mask_image, (list, tuple)) else [mask_image], count, "mask_image")
        return inpaint.request(
            images,
            masks,
            width=width,
            height=height,
            strength=1.0 if strength is None else strength,
            resize_mode=resize_mode,
            mask_blur=mask_blur,
            padding_mask_crop=padding_mask_crop,
            paste_back=paste_back,
            denoising_start=denoising_start,
            denoising_end=denoising_end,
        )

    def _task_size(self, image, mask_image, height, width, padding_mask_crop) -> tuple[int, int]:
        """Output size: given, else the init image's (img2img, inpainting), else the model's default."""
        if image is None or _is_latents(_first(image), self.vae.config.latent_channels):
            if image is not None and height is None and width is None:
                z = np.asarray(_first(image))
                return z.shape[-2] * self.vae_scale_factor, z.shape[-1] * self.vae_scale_factor
            dh, dw = self.default_size
            return height or dh, width or dw
        if height is not None and width is not None:
            return height, width
        from sdjax.core import images as image_lib

        first = image_lib.load_image(_first(image), "image")
        w0, h0 = first.size
        height, width = height or h0, width or w0
        if height % self._size_multiple() or width % self._size_multiple():
            raise ValueError(
                f"image is {w0}x{h0}, not a multiple of {self._size_multiple()} for this model: pass "
                f"width= and height= (the image is then resized) or resize it"
            )
        return height, width

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
        **conditioning,
    ) -> np.ndarray:
        """Images `(N, H, W, 3)` uint8 (`output="float"`: float32 in [0, 1]; `output="latents"`: the final latents
        `(N, C, h, w)` float32); image `i` uses
        key `fold_in(PRNGKey(seeds[i]), image_indices[i])`. The batch is padded to `pad_to` (or the next multiple
        of the device count) and sharded over the mesh's `data` axis; padding images are dropped. `control` (from
        `sdjax.pipelines.controlnet.control_request`) adds ControlNet conditioning. Raises
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
            control=control,
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
        seed: int = 0,
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
        **conditioning,
    ):
        """Prompt(s) -> list of PIL images (`num_images` per prompt); `output_type="np"` gives float32 arrays
        `(N, H, W, 3)` in [0, 1] (as diffusers), `"latent"` the final latents `(N, C, h, w)`. Image `i` of the
        call uses `fold_in(PRNGKey(seed), i)`, whatever the device count.

        - image-to-image: `image` (PIL, numpy HWC, a path, or a list of one per image) and `strength` (0.8);
        - inpainting: `image` and `mask_image` (white = repaint), `strength` (1.0), `mask_blur`,
          `padding_mask_crop` (repaint the masked region at full resolution), `paste_back`;
        - `denoising_end` / `denoising_start`: the SDXL base -> refiner hand-off (see `pipelines.recipes`);
        - `noise`: the initial noise `(N, C, h, w)` instead of noise drawn from the seed;
        - `prompt_syntax="a1111"`: prompts read as AUTOMATIC1111 reads them (`(word:1.3)`, `[word]`, `BREAK`,
          longer than 75 tokens; `sdjax.text.prompt_syntax`);
        - ControlNet (with any task): `control_image`, `controlnet`, `controlnet_conditioning_scale`,
          `control_guidance_start`/`_end`, `guess_mode` as diffusers' ControlNet pipelines
          (`sdjax.pipelines.controlnet`); without an init image the output size defaults to the control image's.
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
        height, width = self._task_size(image, mask_image, height, width, padding_mask_crop)
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
            )
        elif controlnet is not None or controlnet_conditioning_scale is not None:
            raise ValueError("controlnet= and controlnet_conditioning_scale= need control_image= (the control map)")
        out = self.generate_arrays(
            all_prompts,
            all_negs,
            [seed] * count,
            list(range(count)),
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

    # ------------------------------------------------------------------ ahead of time
    def compile(
        self,
        *,
        batch_size: int,
        height: int | None = None,
        width: int | None = None,
        steps: int | None = None,
        sampler=None,
        task: str = "txt2img",
        guidance: bool = True,
        interactive: bool = False,
        previews: bool = False,
        guidance_rescale: float = 0.0,
        output: str = "images",
        controlnet=None,
        guess_mode: bool = False,
    ):
        """Compile (or fetch from the cache) what `generate_arrays` runs for this setting, so the first request of
        that shape does not wait for XLA. Returns `(main, decode)` (`Generator.executables`: the program up to the
        latents and the VAE decode, or the whole program and None). `controlnet` (as for `generate`; True for the
        pipeline's own net) and `guess_mode` compile the ControlNet program."""
        from sdjax.core.tasks import TASKS

        dh, dw = self.default_size
        height, width = height or dh, width or dw
        steps = self.default_steps if steps is None else steps
        self.validate(steps=steps, height=height, width=width, sampler=sampler)
        if task not in TASKS:
            raise ValueError(f"task={task!r} must be one of {sorted(TASKS)}")
        mesh = self.generator.get_mesh()
        ndata = mesh.shape["data"]
        total = -(-batch_size // ndata) * ndata
        spec = self.generator.spec(
            task=TASKS[task](),
            batch=total,
            height=height,
            width=width,
            steps=steps,
            sampler=self._sampler(sampler),
            cfg=guidance,
            interactive=interactive,
            previews=previews,
            guidance_rescale=guidance_rescale,
            output=output,
        )
        params = None
        if controlnet is not None:
            from sdjax.pipelines.controlnet import control_spec

            control, trees = control_spec(self, None if controlnet is True else controlnet, None, guess_mode)
            spec = dataclasses.replace(spec, control=control)
            params = {**self.generator.check_params(self.params), "controlnet": trees}
        return self.generator.executables(spec, params=params)

    def warmup(
        self, batch_size: int, height: int, width: int, steps: int, sampler=None, interactive: bool = False
    ) -> None:
        """Compile the text-to-image program of this shape ahead of time."""
        self.compile(
            batch_size=batch_size, height=height, width=width, steps=steps, sampler=sampler, interactive=interactive
        )

    def aot_compile(
        self,
        *,
        batch_size: int,
        height: int | None = None,
        width: int | None = None,
        steps: int | None = None,
        sampler=None,
        params: dict | None = None,
        guidance_rescale: float = 0.0,
    ):
        """Compile text-to-image for one static setting ahead of time (`jit(...).lower(...).compile()`).

        Returns `fn(prompt_ids, neg_prompt_ids, keys, guidance_scales, extra=None) -> images (B, H, W, 3)` float32
        that runs the compiled executables (`fn.compiled`, and `fn.decode` for the VAE decode when the generator
        splits it off; `Generator.executables`) with the params placed on the pipeline's mesh; `keys` are
        per-image raw keys `(B, 2)`; `extra` overrides the family's micro-conditioning inputs (a dict; SDXL's
        `time_ids`, `neg_time_ids`, `zero_neg`). `batch_size` must divide by the mesh's data axis.
        """
        from sdjax.parallel import sharding as sharding_lib

        dh, dw = self.default_size
        height, width = height or dh, width or dw
        steps = self.default_steps if steps is None else steps
        self.validate(steps=steps, height=height, width=width, sampler=sampler)
        gen = self.generator
        mesh = gen.get_mesh()
        if batch_size % mesh.shape[sharding_lib.DATA]:
            raise ValueError(
                f"batch_size={batch_size} must be a multiple of the mesh's data axis "
                f"({mesh.shape[sharding_lib.DATA]} devices)"
            )
        spec = gen.spec(
            batch=batch_size,
            height=height,
            width=width,
            steps=steps,
            sampler=self._sampler(sampler),
            guidance_rescale=guidance_rescale,
        )
        params = gen.check_params(self.params if params is None else params)
        compiled, decode = gen.executables(spec, params=params)
        placed = gen.place_params(params, mesh)
        start, end = gen.window(spec, TaskRequest(spec.task))
        defaults = gen.example_inputs(spec)

        def run(prompt_ids, neg_prompt_ids, keys, guidance_scales, extra_values=None):
            host = {
                **defaults,
                "ids": np.asarray(prompt_ids, np.int32),
                "neg_ids": np.asarray(neg_prompt_ids, np.int32),
                "keys": np.asarray(keys, np.uint32),
                "guidance": np.asarray(guidance_scales, np.float32),
                **(extra_values or {}),
            }
            inputs = {k: sharding_lib.put_global_batch(v, mesh) for k, v in host.items()}
            win = {"start": np.int32(start), "end": np.int32(end), "run": np.int32(0)}
            out, _ = compiled(placed, inputs, win)
            return out if decode is None else decode(placed["vae"], out)

        run.compiled = compiled
        run.decode = decode
        return run

    # ------------------------------------------------------------------ the guide API's shared plumbing
    def _guide(self, call: GuideCall):
        """One old-Flax call, whatever the class's argument order: traced inside a user's `pmap` -> the program on
        this device's slice; else checked, run (`pmap` with `jit=True`, the mesh otherwise), safety-checked."""
        if call.traced:
            out = self._traced(call)
            return PipelineOutput(out) if call.return_dict else (out,)
        self._validate_guide_call(call)
        out = self._guide_run(call)
        nsfw = self._run_safety_checker(out, call.params, call.jit) if call.output == "images" else None
        if not call.return_dict:
            return (out, nsfw) if self.returns_nsfw else (out,)
        return PipelineOutput(out, nsfw)

    def _run_safety_checker(self, images: np.ndarray, params, jit: bool):
        """Per-image NSFW flags (blacking flagged images in place); None without a safety checker."""
        return None

    def _static_shape(self, steps, height, width) -> tuple[int, int, int]:
        steps = common.check_static("num_inference_steps", steps)
        dh, dw = self.default_size
        height = dh if height is None else common.check_static("height", height)
        width = dw if width is None else common.check_static("width", width)
        return steps, height, width

    def _guide_run(self, call: GuideCall) -> np.ndarray:
        """`jit=True`: per-device inputs `(ndev, bs, ...)` under `pmap` (params replicated, one key per device);
        else a global batch on the mesh, one key for the call."""
        gen = self.generator
        task, steps, height, width = call.task, call.steps, call.height, call.width
        lead = np.shape(call.prompt_ids)[: 2 if call.jit else 1]
        n = int(np.prod(lead))
        keys = np.asarray(rng.as_key_array(call.prng_seed))
        keys = np.stack([np.asarray(rng.image_keys(jnp.asarray(k), lead[-1])) for k in keys.reshape(-1, 2)])
        negatives = [None if call.neg_prompt_ids is None else "ids"] * n
        if not call.jit:
            g = np.broadcast_to(np.asarray(call.guidance_scale, np.float32).reshape(-1), (n,))
            out = gen.run(
                prompts=[""] * n,
                negative_prompts=negatives,
                keys=keys.reshape(n, 2),
                guidance_scales=g,
                steps=steps,
                height=height,
                width=width,
                sampler=self.scheduler,
                task=task,
                noise=call.noise,
                params=call.params,
                output=call.output,
                ids=np.asarray(call.prompt_ids),
                cfg=True,
                neg_ids=None if call.neg_prompt_ids is None else np.asarray(call.neg_prompt_ids),
                control=call.control,
            )
            return np.array(out)
        ndev, bs = lead
        flat = np.asarray(call.prompt_ids).reshape((n,) + self.ids_suffix)
        host = {
            "ids": flat,
            "neg_ids": (
                gen.models.conditioning.tokenize([""] * n)
                if call.neg_prompt_ids is None
                else np.asarray(call.neg_prompt_ids).reshape(flat.shape)
            ),
            "keys": keys.reshape(n, 2),
            "guidance": np.broadcast_to(
                np.asarray(common.per_device_guidance(call.guidance_scale, ndev, bs)), (ndev, bs)
            )
            .reshape(-1)
            .astype(np.float32),
            **gen.models.conditioning.host_inputs(
                negative_prompts=negatives, height=height, width=width, task=task.spec.name
            ),
        }
        for name in task.spec.inputs:
            host[name] = np.asarray(task.arrays[name], np.float32).reshape((n,) + np.shape(task.arrays[name])[2:])
        if call.noise is not None:
            host["noise"] = np.asarray(call.noise, np.float32).reshape((n,) + np.shape(call.noise)[2:])
        spec = gen.spec(
            task=task.spec,
            batch=bs,
            height=height,
            width=width,
            steps=steps,
            sampler=self.scheduler,
            explicit_noise=call.noise is not None,
            output=call.output,
            control=None if call.control is None else call.control.spec,
            vae_slice=1,  # a per-device program
        )
        start, end = gen.window(spec, task)
        if call.control is not None:
            host.update(call.control.arrays(start=start, end=end, calls=int(spec.sampler.num_model_calls(steps))))
        inputs = {k: v.reshape((ndev, bs) + v.shape[1:]) for k, v in host.items()}
        win = {"start": np.int32(start), "end": np.int32(end)}
        params = gen.check_params(call.params, control=call.control is not None)
        out, _ = gen.pmapped(spec)(params, inputs, win)
        return np.array(out)

    def _traced(self, call: GuideCall):
        """The program traced inside a user's own `pmap` (the per-device `_generate`)."""
        from sdjax.core import program

        gen = self.generator
        steps, height, width = self._static_shape(call.steps, call.height, call.width)
        batch = call.prompt_ids.shape[0]
        negatives = [None if call.neg_prompt_ids is None else "ids"] * batch
        neg = (
            jnp.broadcast_to(jnp.asarray(gen.models.conditioning.tokenize([""])), call.prompt_ids.shape)
            if call.neg_prompt_ids is None
            else call.neg_prompt_ids
        )
        host = gen.models.conditioning.host_inputs(
            negative_prompts=negatives, height=height, width=width, task=call.task.spec.name
        )
        inputs = {
            "ids": call.prompt_ids,
            "neg_ids": neg,
            "keys": rng.image_keys(rng.as_key_array(call.prng_seed), batch),
            "guidance": common.guidance_per_image(call.guidance_scale, batch),
            **{k: jnp.asarray(v) for k, v in host.items()},
            **{k: jnp.asarray(v) for k, v in call.task.arrays.items()},
        }
        if call.noise is not None:
            inputs["noise"] = call.noise
        spec = gen.spec(
            task=call.task.spec,
            batch=batch,
            height=height,
            width=width,
            steps=steps,
            sampler=self.scheduler,
            explicit_noise=call.noise is not None,
            output=call.output,
            control=None if call.control is None else call.control.spec,
            vae_slice=1,  # a per-device program
        )
        start, end = gen.window(spec, call.task)
        if call.start is not None:
            start = call.start
        if call.control is not None:
            inputs.update(call.control.arrays(start=start, end=end, calls=int(spec.sampler.num_model_calls(steps))))
        win = {"start": jnp.asarray(start, jnp.int32), "end": jnp.int32(end)}
        out, _ = program(gen.models, spec, call.params, inputs, win)
        return out

    def _validate_guide_call(self, call: GuideCall) -> None:
        jit, steps, height, width = call.jit, call.steps, call.height, call.width
        for name, v in (("num_inference_steps", steps), ("height", height), ("width", width)):
            common.check_static(name, v)
        common.check_steps(steps)
        common.check_size(height, width, self._size_multiple())
        self.generator.check_params(call.params, control=call.control is not None)
        if jit:
            leaf = jax.tree_util.tree_leaves(call.params[self.denoiser.component])[0]
            if leaf.ndim == 0 or leaf.shape[0] != jax.local_device_count():
                raise ValueError("with jit=True params must be replicated per device: p_params = replicate(params)")
        ids = tuple(np.shape(call.prompt_ids))
        suffix = self.ids_suffix
        lead = ids[: len(ids) - len(suffix)]
        if ids[len(lead) :] != suffix or len(lead) != (2 if jit else 1):
            want = (
                f"(num_devices, batch_per_device, {', '.join(map(str, suffix))})"
                if jit
                else f"(N, {', '.join(map(str, suffix))})"
            )
            how = "shard(pipeline.prepare_inputs(prompts))" if jit else "pipeline.prepare_inputs(prompts)"
            raise ValueError(
                f"prompt_ids has shape {ids}; with jit={jit} {type(self).__name__} expects {want}, as made by {how}"
            )
        g = np.shape(call.guidance_scale)
        if jit:
            ndev = jax.local_device_count()
            if lead[0] != ndev:
                raise ValueError(
                    f"prompt_ids has {lead[0]} device slices but there are {ndev} local devices: "
                    f"the prompt count must be divisible by {ndev} (shard() splits it per device)"
                )
            if np.shape(call.prng_seed)[:1] != (ndev,):
                raise ValueError(
                    f"prng_seed has shape {np.shape(call.prng_seed)}; with jit=True pass one key per "
                    f"device: jax.random.split(key, {ndev})"
                )
            if g not in ((), (ndev,), (ndev, 1), (ndev, lead[1])):
                raise ValueError(
                    f"guidance_scale has shape {g}; with jit=True use a float or an array of shape "
                    f"({ndev},), ({ndev}, 1) or ({ndev}, {lead[1]})"
                )
        elif g not in ((), (1,), (lead[0],)):
            raise ValueError(f"guidance_scale has shape {g}; use a float or one value per prompt ({lead[0]},)")
        if call.neg_prompt_ids is not None and np.shape(call.neg_prompt_ids) != ids:
            raise ValueError(
                f"neg_prompt_ids has shape {np.shape(call.neg_prompt_ids)} but prompt_ids has shape "
                f"{ids}: pass one negative prompt per prompt"
            )
        if call.noise is not None:
            want = lead + (
                self.vae.config.latent_channels,
                height // self.vae_scale_factor,
                width // self.vae_scale_factor,
            )
            if tuple(np.shape(call.noise)) != want:
                raise ValueError(
                    f"{call.noise_name} has shape {np.shape(call.noise)}; expected {want} for {height}x{width}"
                )
        for name, x in call.task.arrays.items():
            if tuple(np.shape(x)[: len(lead)]) != tuple(lead):
                label = {"image": call.image_name, "mask": "mask"}.get(name, name)
                raise ValueError(
                    f"{label} has shape {np.shape(x)}; its leading dimensions must match prompt_ids' {lead}"
                )

    @property
    def ids_suffix(self) -> tuple[int, ...]:
        return tuple(self.generator.models.conditioning.ids_suffix)


@dataclasses.dataclass
class GuideCall:
    """One call of the old Flax API, whatever the class's argument order."""

    prompt_ids: Any
    params: Any
    prng_seed: Any
    steps: int
    height: int
    width: int
    guidance_scale: Any
    neg_prompt_ids: Any
    task: TaskRequest
    jit: bool = False
    return_dict: bool = True
    noise: Any = None
    noise_name: str = "latents"
    image_name: str = "image"
    output: str = "images"
    start: Any = None  # an explicit first model call (the traced `_generate(start_timestep)`)
    traced: bool = False
    control: Any = None  # a `core.controlnet.ControlRequest` (the ControlNet guide class)


def seed_keys(seeds: Sequence[int], indices: Sequence[int]) -> np.ndarray:
    """Per-image raw keys `fold_in(PRNGKey(seed), index)` `(N, 2)` uint32."""
    if not len(seeds):
        return np.zeros((0, 2), np.uint32)
    fold = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))
    return np.asarray(fold(jnp.asarray(np.asarray(seeds, np.uint32)), jnp.asarray(np.asarray(indices, np.uint32))))


def _first(image):
    return image[0] if isinstance(image, (list, tuple)) else image


def _is_latents(x, channels: int) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) == 4 and np.shape(x)[1] == channels


def _repeat(x: np.ndarray, n: int, name: str) -> np.ndarray:
    if x.shape[0] == n:
        return x
    if x.shape[0] == 1:
        return np.repeat(x, n, axis=0)
    raise ValueError(f"{name}: got {x.shape[0]} for {n} images; pass one, or one per image")


def _repeat_list(items: list, n: int, name: str) -> list:
    if len(items) == n:
        return list(items)
    if len(items) == 1:
        return list(items) * n
    raise ValueError(f"{name}: got {len(items)} for {n} images; pass one, or one per image")


_SAMPLER_CACHE: dict = {}


def _cached_sampler(base, name: str):
    key = (base, name)
    if key not in _SAMPLER_CACHE:
        if len(_SAMPLER_CACHE) > 64:
            _SAMPLER_CACHE.clear()
        _SAMPLER_CACHE[key] = sampler_lib.get_sampler(name, base_config=base)
    return _SAMPLER_CACHE[key]
