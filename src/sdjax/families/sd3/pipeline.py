"""Stable Diffusion 3 / 3.5 (SD 3 medium, SD 3.5 medium, large, large turbo and their fine-tunes) as an sdjax
pipeline: diffusers' `StableDiffusion3Pipeline`, `StableDiffusion3Img2ImgPipeline` and
`StableDiffusion3InpaintPipeline` in one class.

`StableDiffusion3Pipeline.from_pretrained(folder) -> (pipeline, params)` loads the stabilityai layout (CLIP-L and
CLIP-G with projection, T5 v1.1 XXL, the MMDiT transformer, the 16-channel VAE, `FlowMatchEulerDiscreteScheduler`),
sharded safetensors included; `text_encoder_3` may be null in `model_index.json` or left out with
`text_encoder_3=None` (T5's part of the text is then zeros, as in diffusers). `generate` takes diffusers' arguments:

- `guidance_scale` (7.0; SD 3.5 large turbo: 0, one branch) with `negative_prompt`: classifier-free guidance;
- `prompt_2` / `prompt_3` (CLIP-G / T5 texts; default: the prompt), `negative_prompt_2` / `negative_prompt_3`
  (default: the negative prompt); `max_sequence_length` (T5 tokens, 256);
- `skip_guidance_layers` (e.g. `[7, 8, 9]` for SD 3.5 medium), `skip_layer_guidance_scale` (2.8),
  `skip_layer_guidance_start` (0.01) / `_stop` (0.2): skip-layer guidance on the steps i with
  `steps * start < i < steps * stop`, text-to-image only (as diffusers: its img2img and inpaint pipelines have none);
- `image` + `strength` (0.6): image-to-image; `image` + `mask_image` (+ `strength`, 0.6): inpainting by latent
  blending (StableDiffusion3InpaintPipeline with a 16-channel transformer);
- `noise`: the initial noise `(N, 16, H/8, W/8)` (diffusers' `latents=`);
- `control_image` + `controlnet` (+ `controlnet_conditioning_scale`, 1.0; `control_guidance_start` / `_end`):
  StableDiffusion3ControlNetPipeline, text-to-image (`families.sd3.controlnet`); the output size defaults to the
  model's, not the control image's, as there.

The sampler is flow-matching Euler with the model's shift (3.0) on diffusers' own sigma grid (`sigma_grid=
"scheduler"`, what the SD 3 pipelines use); img2img's first step follows the "float" strength rule. diffusers'
img2img and inpaint pipelines default to 50 steps; `generate` uses the family's 28 for every task.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from sdjax.families import FAMILIES
from sdjax.families.sd3.conditioning import DEFAULT_SEQUENCE_LENGTH, SD3Conditioning
from sdjax.families.sd3.denoiser import SD3Denoiser
from sdjax.loading.components import ModelSpec, model_loader
from sdjax.models.sd3 import check_skip_layers
from sdjax.pipelines.flow import T5_LOADERS, FlowTransformerPipeline, on_flow_grid, per_image
from sdjax.text.t5_tokenizer import check_max_sequence_length

FAMILY = FAMILIES["sd3"]

SD3_TRANSFORMER = ModelSpec(
    "sdjax.models.sd3", "SD3TransformerConfig", "SD3Transformer2DModel", "convert_sd3_transformer", "sd3"
)


class StableDiffusion3Pipeline(FlowTransformerPipeline):
    """SD 3 / 3.5 text-to-image, image-to-image and inpainting (see the module docstring)."""

    model_index_classes = FAMILY.model_index_classes
    default_steps = FAMILY.defaults.steps
    default_guidance_scale = FAMILY.defaults.guidance_scale
    default_strength = {"img2img": 0.6, "inpaint": 0.6}  # StableDiffusion3Img2ImgPipeline, ...InpaintPipeline
    cfg_scale_default = FAMILY.defaults.guidance_scale  # the faces' CFG scale: the same true CFG (7, as diffusers)
    sigma_grid = "scheduler"  # diffusers' own FlowMatch sigma grid, what the SD 3 pipelines use
    model_label = "an SD 3 model"
    # The model classes only this family (and Flux, for T5) uses: (library, class) -> loader.
    component_loaders = {
        **T5_LOADERS,
        ("diffusers", "SD3Transformer2DModel"): model_loader(SD3_TRANSFORMER),
    }
    # Latents -> RGB by one linear map plus a bias (previews only: the A1111 progress image, ComfyUI's websocket
    # previews), applied to the transformer's latents ((z - shift) * scale): ComfyUI's published SD 3 values
    # (comfy/latent_formats.py, `SD3.latent_rgb_factors` and `latent_rgb_factors_bias`); rows are latent channels.
    latent_rgb_factors = (
        (-0.0922, -0.0175, 0.0749), (0.0311, 0.0633, 0.0954), (0.1994, 0.0927, 0.0458), (0.0856, 0.0339, 0.0902),
        (0.0587, 0.0272, -0.0496), (-0.0006, 0.1104, 0.0309), (0.0978, 0.0306, 0.0427), (-0.0042, 0.1038, 0.1358),
        (-0.0194, 0.0020, 0.0669), (-0.0488, 0.0130, -0.0268), (0.0922, 0.0988, 0.0951), (-0.0278, 0.0524, -0.0542),
        (0.0332, 0.0456, 0.0895), (-0.0069, -0.0030, -0.0810), (-0.0596, -0.0465, -0.0293), (-0.1448, -0.1463, -0.1189),
    )  # fmt: skip
    latent_rgb_factors_bias = (0.2394, 0.2135, 0.1925)
    controlnet_module = "sdjax.families.sd3.controlnet"  # its ControlNets (`pipelines.controlnet` hands them over)

    def __init__(
        self,
        *,
        tokenizer,
        text_encoder,
        tokenizer_2,
        text_encoder_2,
        transformer,
        vae,
        scheduler,
        tokenizer_3=None,
        text_encoder_3=None,
        dtype=jnp.float32,
        name: str = "",
        params: dict | None = None,
        max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
    ):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.tokenizer_2 = tokenizer_2
        self.text_encoder_2 = text_encoder_2
        if text_encoder_3 is not None and tokenizer_3 is None:
            raise ValueError("text_encoder_3 (T5) needs tokenizer_3")
        self.tokenizer_3 = tokenizer_3 if text_encoder_3 is not None else None
        self.text_encoder_3 = text_encoder_3
        self.transformer = transformer
        self._max_sequence_length = check_max_sequence_length(max_sequence_length, "SD 3")
        pooled = sum(int(e.config.projection_dim) for e in (text_encoder, text_encoder_2))
        if pooled != transformer.config.pooled_projection_dim:
            raise ValueError(
                f"SD 3: the two CLIP projections are {pooled} wide together, the transformer's "
                f"pooled_projection_dim is {transformer.config.pooled_projection_dim}"
            )
        super().__init__(
            denoiser=SD3Denoiser(transformer, dtype),
            vae=vae,
            scheduler=scheduler,
            dtype=dtype,
            name=name,
            params=params,
        )

    @classmethod
    def from_single_file(
        cls,
        path: str,
        *,
        config: str,
        dtype=jnp.float32,
        clip_l: str | None = None,
        clip_g: str | None = None,
        t5: str | None = None,
        keep_fp8: bool = False,
        quantize: str | None = None,
        **kwargs,
    ):
        """An SD 3 / 3.5 single file (`sd3.5_large.safetensors`, ...: the MMDiT under `model.diffusion_model.`, and the
        text encoders and VAE where it bundles them; `families.sd3.weights`) with the rest from `config`, a diffusers
        SD 3 folder (its configs, tokenizers, scheduler, and the weights of what neither the file nor `clip_l=` /
        `clip_g=` / `t5=` give) -> `(pipeline, params)`. `keep_fp8` keeps float8 weights float8 in memory.
        `quantize="int8"|"fp8"` (or a `sdjax.quant.QuantPolicy`): the transformer's kernels (and those of the text
        encoders a policy names) quantized, each as it is converted, from the files or from `config`'s folder."""
        from sdjax.families.sd3.weights import load_single_file_components
        from sdjax.quant import resolve_policy

        policy = resolve_policy(quantize, FAMILY.denoiser_component)
        loaded = load_single_file_components(
            path, config=config, dtype=dtype, clip_l=clip_l, clip_g=clip_g, t5=t5, keep_fp8=keep_fp8, quantize=policy
        )
        vae = loaded.pop("vae", None)
        return cls._with_file_components(path, config, loaded, policy, kwargs, dtype=dtype, vae=vae)

    def _read_lora(self, path, targets, name):
        """SD 3 / 3.5 LoRAs (diffusers/PEFT, kohya / ComfyUI reference names, OneTrainer layouts) on the transformer
        and the two CLIP text encoders (`families.sd3.lora`); what does not fit is refused by key."""
        from sdjax.families.sd3.lora import load_sd3_lora

        return load_sd3_lora(path, targets, name=name)

    def _conditioning(self):
        return SD3Conditioning(
            self.tokenizer,
            self.text_encoder,
            self.tokenizer_2,
            self.text_encoder_2,
            self.tokenizer_3,
            self.text_encoder_3,
            int(self.transformer.config.joint_attention_dim),
            self._max_sequence_length,
        )

    @property
    def skip_guidance_layers(self) -> tuple[int, ...]:
        """The transformer blocks that skip-layer guidance leaves out, compiled into the programs (empty: none).
        `generate(skip_guidance_layers=...)` sets it; a call without it keeps them compiled but off (scale 0)."""
        return self.generator.models.denoiser.skip_layers

    @skip_guidance_layers.setter
    def skip_guidance_layers(self, layers: Sequence[int]) -> None:
        layers = tuple(sorted(check_skip_layers(layers, self.transformer.config.num_layers)))
        if layers != self.skip_guidance_layers:
            self.denoiser = self.generator.models.denoiser.with_skip_layers(layers)
            self._replace_models(denoiser=self.denoiser)

    @property
    def is_inpainting_model(self) -> bool:
        return False  # a 16-channel transformer inpaints by latent blending (StableDiffusion3InpaintPipeline)

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
        prompt_2: str | Sequence[str] | None = None,
        prompt_3: str | Sequence[str] | None = None,
        negative_prompt_2: str | Sequence[str] | None = None,
        negative_prompt_3: str | Sequence[str] | None = None,
        max_sequence_length: int | None = None,
        skip_guidance_layers: Sequence[int] | None = None,
        skip_layer_guidance_scale: float = 2.8,
        skip_layer_guidance_start: float = 0.01,
        skip_layer_guidance_stop: float = 0.2,
        image=None,
        strength: float | None = None,
        **kwargs,
    ):
        """See the module docstring and `DiffusionPipeline.generate` (the task, size, noise and output arguments).
        `max_sequence_length` None keeps the pipeline's (256 unless set)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if max_sequence_length is not None:
            self.max_sequence_length = max_sequence_length
        # CLIP-L reads (negative_)prompt; CLIP-G and T5 read it too unless given texts of their own (diffusers:
        # `prompt_2 or prompt`, `negative_prompt_2 or negative_prompt`: an empty text means "the prompt's").
        conditioning: dict[str, Any] = {}
        for key, texts in (
            ("prompt_2", prompt_2),
            ("prompt_3", prompt_3),
            ("negative_prompt_2", negative_prompt_2),
            ("negative_prompt_3", negative_prompt_3),
        ):
            if texts:
                conditioning[key] = per_image(texts, len(prompts), num_images, key)
        if kwargs.get("control_image") is not None:
            if skip_guidance_layers is not None:
                raise ValueError(
                    "skip_guidance_layers and control_image cannot be combined (diffusers' "
                    "StableDiffusion3ControlNetPipeline has no skip-layer guidance)"
                )
            dh, dw = self.default_size  # StableDiffusion3ControlNetPipeline: the model's size, not the image's
            height, width = height or dh, width or dw
        if skip_guidance_layers is not None:
            if image is not None:
                raise ValueError(
                    "skip_guidance_layers: skip-layer guidance is text-to-image only (diffusers' SD 3 img2img and "
                    "inpaint pipelines have none)"
                )
            if kwargs.get("guidance_rescale"):
                raise ValueError("skip_guidance_layers and guidance_rescale cannot be combined")
            check_skip_layers(skip_guidance_layers, self.transformer.config.num_layers)
            conditioning.update(
                self._skip_layer_guidance(
                    steps=self.default_steps if steps is None else steps,
                    sampler=sampler,
                    height=height,
                    width=width,
                    scale=skip_layer_guidance_scale,
                    start=skip_layer_guidance_start,
                    stop=skip_layer_guidance_stop,
                )
            )
            self.skip_guidance_layers = skip_guidance_layers  # after the checks: a bad call changes nothing
        return super().generate(
            prompts,
            negative_prompt=negative_prompt,
            num_images=num_images,
            seed=seed,
            steps=steps,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            sampler=sampler,
            image=image,
            strength=strength,
            **kwargs,
            **conditioning,
        )

    def _skip_layer_guidance(self, *, steps, sampler, height, width, scale, start, stop) -> dict[str, Any]:
        """The conditioning options of skip-layer guidance: its scale and the model timesteps of the first and last
        step i with `steps * start < i < steps * stop` (StableDiffusion3Pipeline's rule; i counts model calls)."""
        for name, value in (("skip_layer_guidance_start", start), ("skip_layer_guidance_stop", stop)):
            if not 0 <= float(value) <= 1:
                raise ValueError(f"{name}={value!r} must lie in [0, 1]")
        if not np.isfinite(scale):
            raise ValueError(f"skip_layer_guidance_scale={scale!r} must be a finite number")
        dh, dw = self.default_size
        f = self.vae_scale_factor
        shape = (1, int(self.vae.config.latent_channels), (height or dh) // f, (width or dw) // f)
        timesteps = _timesteps(self._sampler(sampler), int(steps), shape)
        covered = [i for i in range(len(timesteps)) if steps * start < i < steps * stop]
        span = (float(timesteps[covered[0]]), float(timesteps[covered[-1]])) if covered else None
        return {"skip_layer_guidance_scale": float(scale), "skip_layer_guidance_timesteps": span}


def sd3_sampler(sampler: Any) -> Any:
    """A flow-matching sampler on diffusers' own sigma grid (what the SD 3 pipelines use)."""
    return on_flow_grid(sampler, StableDiffusion3Pipeline.sigma_grid)


def _timesteps(sampler: Any, steps: int, shape: tuple[int, ...]) -> np.ndarray:
    """The sampler's model timesteps for `steps` (the latent shape for the samplers whose schedule depends on it)."""
    if "shape" in inspect.signature(sampler.timesteps_for).parameters:
        return np.asarray(sampler.timesteps_for(steps, shape), np.float32)
    return np.asarray(sampler.timesteps_for(steps), np.float32)
