"""Stable Diffusion XL text-to-image, with the API of Diffusers' `FlaxStableDiffusionXLPipeline`.

Differences from SD 1.x/2.x, all as in diffusers' `StableDiffusionXLPipeline`:
- two tokenizers and text encoders; ids are `(N, 2, 77)` (the second tokenizer pads with `!`);
- the UNet context is the penultimate hidden states of both encoders concatenated (768 + 1280 = 2048 wide);
  the pooled, projected embedding of encoder 2 and the micro-conditioning `time_ids`
  `(orig_h, orig_w, crop_top, crop_left, target_h, target_w)` enter through the UNet's added embedding;
- with no negative prompt and `force_zeros_for_empty_prompt`, the unconditional embeddings are zeros;
- `__call__` takes guidance before height/width, and `_generate` ends with `return_latents` (static argument 9 in
  the guide's AOT recipe).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.pipelines import common
from sdjax.pipelines.common import PipelineOutput
from sdjax.pipelines.stable_diffusion import StableDiffusionPipeline


class StableDiffusionXLPipeline(StableDiffusionPipeline):
    """SDXL text-to-image (diffusers `StableDiffusionXLPipeline`); same high-level `generate` as SD."""

    model_index_class = "StableDiffusionXLPipeline"
    pipeline_config_keys = ("force_zeros_for_empty_prompt",)
    default_steps = 50
    ids_suffix = (2, 77)

    def __init__(
        self,
        *,
        tokenizer,
        tokenizer_2,
        text_encoder,
        text_encoder_2,
        unet,
        vae,
        scheduler,
        force_zeros_for_empty_prompt: bool = True,
        **kwargs,
    ):
        self.tokenizer_2 = tokenizer_2
        self.text_encoder_2 = text_encoder_2
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        super().__init__(
            tokenizer=tokenizer, text_encoder=text_encoder, unet=unet, vae=vae, scheduler=scheduler, **kwargs
        )
        self._p_generate = jax.pmap(
            self._generate, in_axes=(0, 0, 0, None, None, None, 0, 0, 0, None), static_broadcasted_argnums=(3, 4, 5, 9)
        )
        self._jit_generate = jax.jit(self._generate, static_argnums=(3, 4, 5, 9))

    def prepare_inputs(self, prompt: str | Sequence[str]) -> np.ndarray:
        """Tokenize with both tokenizers: int32 `(N, 2, 77)`."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not isinstance(prompt, (list, tuple)) or not all(isinstance(p, str) for p in prompt):
            raise TypeError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")
        return np.stack([self.tokenizer(list(prompt)), self.tokenizer_2(list(prompt))], axis=1)

    # ------------------------------------------------------------------ conditioning
    def _encode(self, params, ids):
        """ids `(B, 2, 77)` -> context `(B, 77, D1 + D2)` (penultimate layers), pooled `(B, P)` from encoder 2."""
        out1 = self.text_encoder.apply({"params": params["text_encoder"]}, ids[:, 0])
        out2 = self.text_encoder_2.apply({"params": params["text_encoder_2"]}, ids[:, 1])
        context = jnp.concatenate([out1.hidden_states[-2], out2.hidden_states[-2]], axis=-1)
        return context, out2.text_embeds

    def default_time_ids(self, height: int, width: int) -> tuple[float, ...]:
        return (height, width, 0, 0, height, width)

    def _conditioning(self, params, prompt_ids, neg_prompt_ids, height: int, width: int, extra):
        """`extra` = (time_ids (B, 6), neg_time_ids (B, 6), zero_negative (B,) bool) or None for the defaults."""
        batch = prompt_ids.shape[0]
        if extra is None:
            time_ids = jnp.broadcast_to(jnp.asarray(self.default_time_ids(height, width), jnp.float32), (batch, 6))
            zero_neg = jnp.full((batch,), neg_prompt_ids is None and self.force_zeros_for_empty_prompt)
            extra = (time_ids, time_ids, zero_neg)
        time_ids, neg_time_ids, zero_neg = extra
        if neg_prompt_ids is None:
            neg_prompt_ids = jnp.broadcast_to(jnp.asarray(self.prepare_inputs([""])), prompt_ids.shape)
        context, pooled = self._encode(params, jnp.concatenate([neg_prompt_ids, prompt_ids]))
        keep = jnp.concatenate([~zero_neg, jnp.ones((batch,), bool)]).astype(context.dtype)
        context = context * keep[:, None, None]
        pooled = pooled * keep[:, None].astype(pooled.dtype)
        added = {"text_embeds": pooled, "time_ids": jnp.concatenate([neg_time_ids, time_ids]).astype(jnp.float32)}
        return context, added

    def _batch_extra(
        self,
        negative_prompts: list[str],
        height: int,
        width: int,
        original_size=None,
        crops_coords_top_left=(0, 0),
        target_size=None,
        negative_original_size=None,
        negative_crops_coords_top_left=None,
        negative_target_size=None,
    ):
        original_size = tuple(original_size or (height, width))
        target_size = tuple(target_size or (height, width))
        crops = tuple(crops_coords_top_left)
        for name, v in (
            ("original_size", original_size),
            ("crops_coords_top_left", crops),
            ("target_size", target_size),
        ):
            if len(v) != 2:
                raise ValueError(f"{name} must be a pair (height, width) / (top, left), got {v!r}")
        neg = (
            tuple(negative_original_size or original_size)
            + tuple(negative_crops_coords_top_left or crops)
            + tuple(negative_target_size or target_size)
        )
        n = len(negative_prompts)
        time_ids = np.tile(np.asarray(original_size + crops + target_size, np.float32), (n, 1))
        neg_time_ids = np.tile(np.asarray(neg, np.float32), (n, 1))
        zero_neg = np.asarray([p == "" and self.force_zeros_for_empty_prompt for p in negative_prompts])
        return time_ids, neg_time_ids, zero_neg

    # ------------------------------------------------------------------ the guide's API
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
        return_latents: bool = False,
    ):
        """Per-device SDXL generation: ids `(B, 2, 77)`, one key -> images `(B, H, W, 3)` (or latents)."""
        num_inference_steps = common.check_static("num_inference_steps", num_inference_steps)
        dh, dw = self.default_size
        height = dh if height is None else common.check_static("height", height)
        width = dw if width is None else common.check_static("width", width)
        if isinstance(return_latents, jax.core.Tracer):
            raise TypeError("return_latents must be static: with pmap add 9 to static_broadcasted_argnums")
        keys = common.image_keys(common.as_key_array(prng_seed), prompt_ids.shape[0])
        return self._sample(
            params,
            prompt_ids,
            neg_prompt_ids,
            keys,
            guidance_scale,
            latents,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            sampler=self.scheduler,
            return_latents=bool(return_latents),
        )

    def __call__(
        self,
        prompt_ids,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        guidance_scale=7.5,
        height: int | None = None,
        width: int | None = None,
        latents=None,
        neg_prompt_ids=None,
        return_dict: bool = True,
        output_type: str | None = None,
        jit: bool = False,
    ):
        """The old Flax SDXL call (guidance before height/width). `output_type="latent"` returns latents."""
        height = self.default_size[0] if height is None else height
        width = self.default_size[1] if width is None else width
        return_latents = output_type == "latent"
        if common.is_traced(prompt_ids, prng_seed, params):
            out = self._generate(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                guidance_scale,
                latents,
                neg_prompt_ids,
                return_latents,
            )
            return PipelineOutput(out) if return_dict else (out,)
        self._validate_call(
            prompt_ids,
            params,
            prng_seed,
            num_inference_steps,
            height,
            width,
            guidance_scale,
            latents,
            neg_prompt_ids,
            jit,
        )
        if jit:
            ndev, bs = prompt_ids.shape[:2]
            g = common.per_device_guidance(guidance_scale, ndev, bs)
            out = self._p_generate(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                g,
                latents,
                neg_prompt_ids,
                return_latents,
            )
        else:
            out = self._jit_generate(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                jnp.asarray(guidance_scale, jnp.float32),
                latents,
                neg_prompt_ids,
                return_latents,
            )
        out = np.array(out)
        return PipelineOutput(out) if return_dict else (out,)

    def _check_params(self, params, per_device: bool) -> None:
        super()._check_params(params, per_device)
        if "text_encoder_2" not in params:
            raise KeyError("params is missing component 'text_encoder_2'; pass the params from from_pretrained")
