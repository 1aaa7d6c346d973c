"""Flux.1 (dev, schnell and their fine-tunes) as an sdjax pipeline: diffusers' `FluxPipeline`,
`FluxImg2ImgPipeline` and `FluxInpaintPipeline` in one class.

`FluxPipeline.from_pretrained(folder) -> (pipeline, params)` loads the black-forest-labs layout (CLIP-L,
T5 v1.1 XXL, the transformer, the 16-channel VAE, `FlowMatchEulerDiscreteScheduler`), sharded safetensors
included. `generate` takes diffusers' arguments:

- `guidance_scale` (3.5): dev's distilled guidance, embedded by the transformer (schnell ignores it);
- `true_cfg_scale` (1.0) with `negative_prompt`: real classifier-free guidance (two transformer calls per step),
  as diffusers does only when both are given;
- `prompt_2` / `negative_prompt_2`: the T5 texts (default: the prompts); `max_sequence_length` (512; 256 for
  schnell, as its model card and diffusers' examples use);
- `image` + `strength` (0.6): image-to-image; `image` + `mask_image` (+ `strength`): inpainting by latent blending;
- `noise`: the initial noise `(N, 16, H/8, W/8)` unpacked (diffusers' `latents=` is the same packed 2x2);
- `control_image` + `controlnet` (+ `controlnet_conditioning_scale`, 1.0; `control_guidance_start` / `_end`;
  `control_mode` for union nets): FluxControlNetPipeline, text-to-image (`families.flux.controlnet`); the output
  size defaults to the model's, not the control image's, as there.

The sampler is flow-matching Euler with the model's shift (dev: dynamic, from the image's token count) on the
sigma grid FluxPipeline passes (`np.linspace(1, 1/n, n)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from sdjax.families import FAMILIES
from sdjax.families.flux.conditioning import FluxConditioning
from sdjax.families.flux.denoiser import FluxDenoiser
from sdjax.loading.components import ModelSpec, model_loader
from sdjax.pipelines.flow import T5_LOADERS, FlowTransformerPipeline, on_flow_grid, per_image
from sdjax.text.t5_tokenizer import check_max_sequence_length

FAMILY = FAMILIES["flux"]

FLUX_TRANSFORMER = ModelSpec(
    "sdjax.models.flux", "FluxTransformerConfig", "FluxTransformer2DModel", "convert_flux_transformer", "flux"
)


class FluxPipeline(FlowTransformerPipeline):
    """Flux.1 text-to-image, image-to-image and inpainting (see the module docstring)."""

    model_index_classes = FAMILY.model_index_classes
    default_steps = FAMILY.defaults.steps
    default_strength = {"img2img": 0.6, "inpaint": 0.6}  # FluxImg2ImgPipeline, FluxInpaintPipeline
    default_guidance_scale = FAMILY.defaults.guidance_scale
    # The model classes only this family uses: (library, class) -> loader, consulted before the shared table.
    component_loaders = {
        **T5_LOADERS,
        ("diffusers", "FluxTransformer2DModel"): model_loader(FLUX_TRANSFORMER),
    }
    # Latents -> RGB by one linear map plus a bias (previews only: the A1111 progress image, ComfyUI's websocket
    # previews), applied to the transformer's latents ((z - shift) * scale): ComfyUI's published Flux values
    # (comfy/latent_formats.py, `Flux.latent_rgb_factors` and `latent_rgb_factors_bias`); rows are latent channels.
    latent_rgb_factors = (
        (-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433), (-0.0174, 0.0160, 0.0617),
        (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115), (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259),
        (-0.0245, 0.0250, 0.1180), (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
        (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499), (-0.1262, -0.0982, -0.0778),
    )  # fmt: skip
    latent_rgb_factors_bias = (-0.0329, -0.0718, -0.0851)
    # What the faces (CLI, server) use: the guidance scales they pass per image are Forge's "CFG scale" (true CFG,
    # off at 1); dev's embedded guidance is Forge's "Distilled CFG Scale".
    cfg_scale_default = 1.0
    distilled_guidance_scale = 3.5
    sigma_grid = "flux"  # FluxPipeline's sigmas: linspace(1, 1/n, n), then the shift
    model_label = "a Flux model"
    controlnet_module = "sdjax.families.flux.controlnet"  # its ControlNets (`pipelines.controlnet` hands them over)

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
        dtype=jnp.float32,
        name: str = "",
        params: dict | None = None,
        max_sequence_length: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.tokenizer_2 = tokenizer_2
        self.text_encoder_2 = text_encoder_2
        self.transformer = transformer
        schnell = not transformer.config.guidance_embeds
        if max_sequence_length is None:
            max_sequence_length = 256 if schnell else 512
        self._max_sequence_length = check_max_sequence_length(max_sequence_length, "Flux")
        if schnell:  # timestep-distilled: 4 steps, no guidance
            self.default_steps = 4
            self.default_guidance_scale = 0.0
        super().__init__(
            denoiser=FluxDenoiser(transformer, dtype),
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
        keep_fp8: bool = False,
        t5: str | None = None,
        clip_l: str | None = None,
        quantize: str | None = None,
        **kwargs,
    ):
        """A Flux transformer file as people have them (`flux1-dev.safetensors` in BFL layout, ComfyUI/Forge files
        with fp8 e4m3fn weights, city96's `.gguf`; `families.flux.weights`) with the other components from `config`,
        a diffusers Flux folder or Hub repo (its tokenizers, VAE, scheduler, and text encoders unless `t5=` /
        `clip_l=` name the separate files: `t5xxl_fp16.safetensors`, `t5xxl_fp8_e4m3fn.safetensors`,
        `clip_l.safetensors`) -> `(pipeline, params)`. `keep_fp8=True` keeps float8 weights float8 in memory (one
        byte per weight; each layer casts them to the compute dtype). The transformer's architecture is read from
        the file's tensors. `quantize="int8"|"fp8"`: the transformer's kernels quantized (`sdjax.quant`), each as
        it is converted; a `QuantPolicy` naming the text encoders quantizes theirs as they are converted too,
        from the `t5=` / `clip_l=` files or from `config`'s folder."""
        from pathlib import Path

        from sdjax.config import read_json
        from sdjax.families.flux import weights
        from sdjax.quant import resolve_policy

        policy = resolve_policy(quantize, FAMILY.denoiser_component)

        def folder_config(component):  # a local config folder's configs (else the released models' defaults)
            local = Path(str(config)) / component / "config.json"
            return read_json(local) if local.is_file() else None

        # The transformer's config fills what tensors cannot say (the rotary axes); it must agree with them.
        loaded = {
            "transformer": weights.load_flux_transformer_file(
                path, dtype=dtype, keep_fp8=keep_fp8, config=folder_config("transformer"), quantize=policy
            )
        }
        if t5 is not None:
            loaded["text_encoder_2"] = weights.load_t5_file(
                t5, dtype=dtype, keep_fp8=keep_fp8, config=folder_config("text_encoder_2"), quantize=policy
            )
        if clip_l is not None:
            loaded["text_encoder"] = weights.load_clip_l_file(
                clip_l, dtype=dtype, config=folder_config("text_encoder"), quantize=policy
            )
        return cls._with_file_components(path, config, loaded, policy, kwargs, dtype=dtype)

    def _conditioning(self):
        return FluxConditioning(
            self.tokenizer, self.text_encoder, self.tokenizer_2, self.text_encoder_2, self._max_sequence_length
        )

    @property
    def is_inpainting_model(self) -> bool:
        return False  # Flux inpaints by latent blending (FluxInpaintPipeline); Fill models are not loaded yet

    def _read_lora(self, path, targets, name):
        """Flux LoRAs (kohya, ComfyUI, BFL, diffusers/PEFT layouts) on the transformer and CLIP-L
        (`families.flux.lora`); T5 layers in them are reported and skipped."""
        from sdjax.families.flux.lora import load_flux_lora

        return load_flux_lora(path, targets["transformer"], name=name, text_encoder=targets.get("text_encoder"))

    def generate_arrays(self, *args, **kwargs):
        """`DiffusionPipeline.generate_arrays` (the faces' entry): `guidance_scales` are the true-CFG scales (Forge's
        "CFG scale"); `guidance=` (dev's distilled guidance) defaults to `distilled_guidance_scale`."""
        kwargs.setdefault("guidance", self.distilled_guidance_scale)
        return super().generate_arrays(*args, **kwargs)

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
        true_cfg_scale: float = 1.0,
        prompt_2: str | Sequence[str] | None = None,
        negative_prompt_2: str | Sequence[str] | None = None,
        max_sequence_length: int | None = None,
        image=None,
        strength: float | None = None,
        **kwargs,
    ):
        """See the module docstring and `DiffusionPipeline.generate` (the task, size, noise and output
        arguments)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        default = self.distilled_guidance_scale if self.transformer.config.guidance_embeds else 0.0
        guidance = default if guidance_scale is None else float(guidance_scale)
        if not jnp.isfinite(guidance) or not jnp.isfinite(true_cfg_scale):
            raise ValueError(f"guidance_scale={guidance} and true_cfg_scale={true_cfg_scale} must be finite")
        true_cfg = negative_prompt is not None or negative_prompt_2 is not None
        if max_sequence_length is not None:
            self.max_sequence_length = max_sequence_length
        if kwargs.get("control_image") is not None and image is None:
            dh, dw = self.default_size  # FluxControlNetPipeline: the model's size, not the control image's
            height, width = height or dh, width or dw
        conditioning = {"guidance": guidance}
        for key, texts in (("prompt_2", prompt_2), ("negative_prompt_2", negative_prompt_2)):
            if texts is not None:
                conditioning[key] = per_image(texts, len(prompts), num_images, key)
        if true_cfg and negative_prompt_2 is not None and negative_prompt is None:
            negative_prompt = ""
        if true_cfg and prompt_2 is not None and "negative_prompt_2" not in conditioning:
            conditioning["negative_prompt_2"] = per_image(
                negative_prompt if negative_prompt is not None else "", len(prompts), num_images, "negative_prompt"
            )
        return super().generate(
            prompts,
            negative_prompt=negative_prompt,
            num_images=num_images,
            seed=seed,
            steps=steps,
            guidance_scale=float(true_cfg_scale) if true_cfg else 1.0,
            height=height,
            width=width,
            sampler=sampler,
            image=image,
            strength=strength,
            **kwargs,
            **conditioning,
        )


def flux_sampler(sampler: Any) -> Any:
    """A flow-matching sampler on FluxPipeline's sigma grid (`linspace(1, 1/n, n)`, then the model's shift)."""
    return on_flow_grid(sampler, FluxPipeline.sigma_grid)
