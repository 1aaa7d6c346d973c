"""Full-size Stable Diffusion architectures (diffusers configs, random weights) for checks and benchmarks.

The configs are those of the released checkpoints (stable-diffusion-v1-5, stable-diffusion-xl-base-1.0); weights
are random because nothing can be downloaded here. Test/benchmark only: imports torch and diffusers.
"""

from __future__ import annotations

SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32, act_fn="silu", center_input_sample=False,
    downsample_padding=1, flip_sin_to_cos=True, freq_shift=0, mid_block_scale_factor=1, norm_eps=1e-5,
)
SD15_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    sample_size=512, act_fn="silu", scaling_factor=0.18215,
)
SD15_TEXT = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=768,
    bos_token_id=0, eos_token_id=2, pad_token_id=1,
)
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816, norm_num_groups=32,
)


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
