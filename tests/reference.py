"""The PyTorch reference: tiny diffusers/transformers models with real configs, built from a fixed seed.

Test-only: sdjax never imports torch, diffusers or transformers. Every config below is a real diffusers or
transformers config shrunk in width and depth; the key set is the one the full checkpoints use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parents[1] / "src" / "sdjax" / "assets" / "clip_tokenizer"

CLIP_SD1 = dict(
    vocab_size=49408,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=5,
    num_attention_heads=4,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    projection_dim=32,
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=1,
)
CLIP_SD2 = {**CLIP_SD1, "hidden_act": "gelu", "num_attention_heads": 2}
CLIP_SDXL_1 = {**CLIP_SD1, "hidden_act": "quick_gelu"}
CLIP_SDXL_2 = {
    **CLIP_SD1,
    "hidden_act": "gelu",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "projection_dim": 40,
}

# One layer per block for SD 1.x, the suite's most used model (training steps: 36% less XLA compile, measured on
# tests/finetune/test_step_parity.py); the two-layer layout of released checkpoints (the `input_blocks` numbering of
# single files, `resnets.1`, three up-block layers) stays held by SD 2.x's and SDXL's tiny UNets below.
UNET_SD1 = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=32,
)
UNET_SD2 = {
    **UNET_SD1,
    "layers_per_block": 2,
    "attention_head_dim": (2, 4),
    "use_linear_projection": True,
    "upcast_attention": True,
}
UNET_SDXL = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(32, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    projection_class_embeddings_input_dim=88,
    cross_attention_dim=80,
    norm_num_groups=32,
)  # 88 = 6 * addition_time_embed_dim + text_encoder_2 projection_dim; 80 = 32 + 48 hidden sizes

VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(32, 32, 64, 64),
    layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    norm_num_groups=32,
    sample_size=64,
    scaling_factor=0.18215,
)
VAE_SDXL = {**VAE, "scaling_factor": 0.13025, "force_upcast": True}


def seed_everything(seed: int = 0) -> None:
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed)


def state_dict_numpy(module) -> dict[str, np.ndarray]:
    """A torch module's state dict as float32 numpy arrays (what a safetensors file holds)."""
    return {k: v.detach().float().numpy() for k, v in module.state_dict().items()}


def perturb_norms(module, seed: int = 0) -> None:
    """Give every norm layer a non-trivial scale and bias: a fresh model's ones/zeros would hide a swapped
    scale/bias or a missing norm."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)) and m.weight is not None:
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))


def clip_tokenizer(pad_token: str = "<|endoftext|>"):
    from transformers import CLIPTokenizer

    return CLIPTokenizer(
        str(ASSETS / "vocab.json"), str(ASSETS / "merges.txt"), pad_token=pad_token, model_max_length=77
    )


def text_encoder(config: dict, with_projection: bool = False, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    seed_everything(seed)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    model = cls(CLIPTextConfig(**config)).eval()
    perturb_norms(model, seed)
    return model


def unet(config: dict, seed: int = 0):
    from diffusers import UNet2DConditionModel

    seed_everything(seed)
    model = UNet2DConditionModel(**config).eval()
    perturb_norms(model, seed)
    return model


def vae(config: dict, seed: int = 0):
    from diffusers import AutoencoderKL

    seed_everything(seed)
    model = AutoencoderKL(**config).eval()
    perturb_norms(model, seed)
    return model


def sd_pipeline(kind: str = "sd1", seed: int = 0):
    """A tiny diffusers StableDiffusionPipeline: kind "sd1" (epsilon, PNDM) or "sd2" (v-prediction, DDIM)."""
    from diffusers import DDIMScheduler, PNDMScheduler, StableDiffusionPipeline

    beta = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
    if kind == "sd1":
        sched = PNDMScheduler(**beta, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1)
        te, un = text_encoder(CLIP_SD1, seed=seed), unet(UNET_SD1, seed=seed + 1)
    elif kind == "sd2":
        sched = DDIMScheduler(
            **beta, prediction_type="v_prediction", set_alpha_to_one=False, steps_offset=1, clip_sample=False
        )
        te, un = text_encoder(CLIP_SD2, seed=seed), unet(UNET_SD2, seed=seed + 1)
    else:
        raise ValueError(kind)
    return StableDiffusionPipeline(
        vae=vae(VAE, seed=seed + 2),
        text_encoder=te,
        tokenizer=clip_tokenizer(),
        unet=un,
        scheduler=sched,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def sdxl_pipeline(seed: int = 0):
    """A tiny diffusers StableDiffusionXLPipeline (Euler, two text encoders, second tokenizer pads with '!')."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    sched = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        steps_offset=1,
        timestep_spacing="leading",
    )
    return StableDiffusionXLPipeline(
        vae=vae(VAE_SDXL, seed=seed + 2),
        text_encoder=text_encoder(CLIP_SDXL_1, seed=seed),
        text_encoder_2=text_encoder(CLIP_SDXL_2, with_projection=True, seed=seed + 3),
        tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(pad_token="!"),
        unet=unet(UNET_SDXL, seed=seed + 1),
        scheduler=sched,
        force_zeros_for_empty_prompt=True,
    )


UNET_SDXL_REFINER = {
    **UNET_SDXL,
    "cross_attention_dim": CLIP_SDXL_2["hidden_size"],
    "projection_class_embeddings_input_dim": 5 * UNET_SDXL["addition_time_embed_dim"] + CLIP_SDXL_2["projection_dim"],
}  # the refiner: OpenCLIP bigG's hidden states only, 5 micro-conditioning numbers (aesthetic score, no target size)


def sdxl_refiner_pipeline(seed: int = 0, base=None):
    """A tiny diffusers SDXL refiner (`StableDiffusionXLImg2ImgPipeline` with text_encoder_2 only,
    `requires_aesthetics_score`), sharing the VAE, second text encoder and scheduler of `base` if given."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline

    if base is not None:
        vae_, te2, sched = base.vae, base.text_encoder_2, base.scheduler
    else:
        vae_, te2 = vae(VAE_SDXL, seed=seed + 2), text_encoder(CLIP_SDXL_2, with_projection=True, seed=seed + 3)
        sched = EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            num_train_timesteps=1000,
            steps_offset=1,
            timestep_spacing="leading",
        )
    return StableDiffusionXLImg2ImgPipeline(
        vae=vae_,
        text_encoder=None,
        text_encoder_2=te2,
        tokenizer=None,
        tokenizer_2=clip_tokenizer(pad_token="!"),
        unet=unet(UNET_SDXL_REFINER, seed=seed + 5),
        scheduler=sched,
        requires_aesthetics_score=True,
        force_zeros_for_empty_prompt=False,
    )
