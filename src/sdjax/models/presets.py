"""Model presets: the released configs of the architectures sdjax serves (diffusers / transformers `config.json`
keys), random weights for them, and the names of models that ship with sdjax.

One registry used by `sdjax bench`, the TPU compile reports, the benchmarks and the tests: architectures
(`ARCHITECTURES`: sd15, sd15-inpainting, sd21, sdxl, sdxl-refiner, sdxl-inpainting, tiny) and model aliases
(`ALIASES`: "sdjax/embedded", the small model trained by sdjax itself).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

# The small model shipped inside the package (trained by sdjax itself, see sdjax.training).
EMBEDDED_MODEL = str(Path(__file__).resolve().parents[1] / "assets" / "embedded")
ALIASES = {"sdjax/embedded": EMBEDDED_MODEL, "embedded": EMBEDDED_MODEL}


def resolve_alias(name: str | os.PathLike) -> str:
    """`"sdjax/embedded"` -> the shipped model's folder; anything else unchanged."""
    return ALIASES.get(str(name), str(name))


# ---------------------------------------------------------------------------------------------- architectures
# The released configs (config.json keys of diffusers / transformers); weights are random.
_BETAS = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
)
_CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    projection_dim=768,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
_SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    norm_num_groups=32,
    sample_size=512,
    act_fn="silu",
    scaling_factor=0.18215,
)
_SD_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768,
    attention_head_dim=8,
    norm_num_groups=32,
    act_fn="silu",
    flip_sin_to_cos=True,
    freq_shift=0,
    downsample_padding=1,
    mid_block_scale_factor=1,
    norm_eps=1e-5,
)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A pipeline's component configs (diffusers / transformers keys) and its native image size."""

    pipeline: str  # model_index.json `_class_name`
    text_encoder: dict | None  # None: the SDXL refiner (text_encoder_2 only)
    unet: dict
    vae: dict
    scheduler: dict  # with `_class_name`
    size: int
    text_encoder_2: dict | None = None
    settings: tuple[tuple[str, Any], ...] = ()  # model_index.json settings (force_zeros_for_empty_prompt, ...)


ARCHITECTURES: dict[str, Architecture] = {
    # stable-diffusion-v1-5/stable-diffusion-v1-5
    "sd15": Architecture(
        "StableDiffusionPipeline",
        _CLIP_L,
        _SD_UNET,
        _SD_VAE,
        {"_class_name": "PNDMScheduler", **_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False},
        512,
    ),
    # stabilityai/stable-diffusion-2-1 (768 px, v-prediction, OpenCLIP ViT-H text tower)
    "sd21": Architecture(
        "StableDiffusionPipeline",
        dict(
            _CLIP_L,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=23,
            num_attention_heads=16,
            hidden_act="gelu",
            projection_dim=512,
        ),
        dict(
            _SD_UNET,
            sample_size=96,
            attention_head_dim=(5, 10, 20, 20),
            cross_attention_dim=1024,
            use_linear_projection=True,
            upcast_attention=True,
        ),
        dict(_SD_VAE, sample_size=768),
        {
            "_class_name": "DDIMScheduler",
            **_BETAS,
            "clip_sample": False,
            "set_alpha_to_one": False,
            "prediction_type": "v_prediction",
        },
        768,
    ),
    # stabilityai/stable-diffusion-xl-base-1.0
    "sdxl": Architecture(
        "StableDiffusionXLPipeline",
        _CLIP_L,
        dict(
            sample_size=128,
            in_channels=4,
            out_channels=4,
            layers_per_block=2,
            block_out_channels=(320, 640, 1280),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            cross_attention_dim=2048,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
            norm_num_groups=32,
        ),
        dict(_SD_VAE, sample_size=1024, scaling_factor=0.13025, force_upcast=True),
        {"_class_name": "EulerDiscreteScheduler", **_BETAS, "timestep_spacing": "leading"},
        1024,
        text_encoder_2=dict(
            _CLIP_L,
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=20,
            hidden_act="gelu",
            projection_dim=1280,
        ),
    ),
    # A seconds-long SD-shaped model for tests.
    "tiny": Architecture(
        "StableDiffusionPipeline",
        dict(
            _CLIP_L, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32
        ),
        dict(
            _SD_UNET,
            sample_size=8,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=4,
            norm_num_groups=8,
        ),
        dict(
            _SD_VAE,
            block_out_channels=(16, 32),
            layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            norm_num_groups=8,
            sample_size=16,
        ),
        {"_class_name": "PNDMScheduler", **_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False},
        16,
    ),
}

_SDXL = ARCHITECTURES["sdxl"]
ARCHITECTURES.update(
    {
        # stable-diffusion-v1-5/stable-diffusion-inpainting: the SD 1.5 UNet with 9 input channels
        "sd15-inpainting": dataclasses.replace(
            ARCHITECTURES["sd15"], pipeline="StableDiffusionInpaintPipeline", unet=dict(_SD_UNET, in_channels=9)
        ),
        # diffusers/stable-diffusion-xl-1.0-inpainting-0.1
        "sdxl-inpainting": dataclasses.replace(
            _SDXL, pipeline="StableDiffusionXLInpaintPipeline", unet=dict(_SDXL.unet, in_channels=9)
        ),
        # stabilityai/stable-diffusion-xl-refiner-1.0: OpenCLIP bigG only, 5 micro-conditioning numbers (aesthetic
        # score instead of the target size), a four-level UNet of 384 channels (sgm's sd_xl_refiner.yaml:
        # model_channels 384, channel_mult [1, 2, 4, 4], num_head_channels 64, transformer_depth 4, context_dim 1280)
        "sdxl-refiner": Architecture(
            "StableDiffusionXLImg2ImgPipeline",
            None,
            dict(
                sample_size=128,
                in_channels=4,
                out_channels=4,
                layers_per_block=2,
                block_out_channels=(384, 768, 1536, 1536),
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                transformer_layers_per_block=4,
                attention_head_dim=(6, 12, 24, 24),
                cross_attention_dim=1280,
                use_linear_projection=True,
                addition_embed_type="text_time",
                addition_time_embed_dim=256,
                projection_class_embeddings_input_dim=2560,
                norm_num_groups=32,
            ),
            _SDXL.vae,
            _SDXL.scheduler,
            1024,
            text_encoder_2=_SDXL.text_encoder_2,
            settings=(("force_zeros_for_empty_prompt", False), ("requires_aesthetics_score", True)),
        ),
    }
)


def random_params(shapes: Any, seed: int, dtype) -> Any:
    """Random weights for a params tree of `jax.ShapeDtypeStruct`: kernels N(0, 1/fan_in) (HWIO / (in, out)),
    embeddings N(0, 0.02), norm scales 1, biases 0; floats in `dtype`. Deterministic from `seed`."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        shape = tuple(leaf.shape)
        if name == "scale":
            x = np.ones(shape, np.float32)
        elif name == "bias":
            x = np.zeros(shape, np.float32)
        elif name == "embedding":
            x = rng.standard_normal(shape, np.float32) * np.float32(0.02)
        else:
            fan_in = max(1, math.prod(shape[:-1]))
            x = rng.standard_normal(shape, np.float32) * np.float32(1 / math.sqrt(fan_in))
        return jnp.asarray(x, dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)
