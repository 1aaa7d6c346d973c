"""Full-size Stable Diffusion architectures (diffusers configs, random weights) for checks and benchmarks.

The configs are those of the released checkpoints (stable-diffusion-v1-5, stable-diffusion-xl-base-1.0); weights
are random because nothing can be downloaded here. Test/benchmark only: imports torch and diffusers.
"""

from __future__ import annotations

from sdjax.bench import ARCHITECTURES  # the released configs live in one place: sdjax bench's architectures

SD15_UNET = dict(ARCHITECTURES["sd15"].unet)
SD15_VAE = dict(ARCHITECTURES["sd15"].vae)
SD15_TEXT = dict(ARCHITECTURES["sd15"].text_encoder)
SDXL_UNET = dict(ARCHITECTURES["sdxl"].unet)


def torch_unet(config: dict, seed: int = 0):
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(**config).eval()


def torch_vae(config: dict, seed: int = 0):
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**config).eval()


def torch_text(config: dict, seed: int = 0):
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    return CLIPTextModel(CLIPTextConfig(**config)).eval()


def numpy_state(module) -> dict:
    return {k: v.detach().float().numpy() for k, v in module.state_dict().items()}
