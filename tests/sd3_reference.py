"""The Stable Diffusion 3 / 3.5 reference for tests: a tiny diffusers `StableDiffusion3Pipeline` from the real
configs, shrunk.

CLIP-L and CLIP-G (`CLIPTextModelWithProjection`: the SDXL tiny text encoders, 32 and 48 wide, projections 32 and 40;
CLIP-G's tokenizer pads with "!"), a tiny T5 v1.1 (`t5_reference`) 96 wide (the transformer's `joint_attention_dim`:
at least the two CLIP widths together, as 4096 >= 768 + 1280), a 16-channel VAE with SD 3's shift and scaling
factors and no quant convs, FlowMatchEulerDiscreteScheduler with SD 3's shift 3.0, and an `SD3Transformer2DModel`
shaped like SD 3.5 medium: qk_norm "rms_norm", a dual-attention first block, three blocks (the last context
pre-only), a `pos_embed_max_size` 12 table cropped for the 8x8 patches of a 32-pixel image.
"""

from __future__ import annotations

import reference
import t5_reference

SD3_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    norm_num_groups=32,
    sample_size=32,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
    force_upcast=True,
)
CLIP_L = reference.CLIP_SDXL_1
CLIP_G = reference.CLIP_SDXL_2
T5_SD3 = {**t5_reference.T5_TINY, "d_model": 96}

TRANSFORMER = dict(
    sample_size=16,
    patch_size=2,
    in_channels=16,
    num_layers=3,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=T5_SD3["d_model"],
    caption_projection_dim=32,
    pooled_projection_dim=CLIP_L["projection_dim"] + CLIP_G["projection_dim"],
    out_channels=16,
    pos_embed_max_size=12,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)  # stabilityai SD 3 / 3.5 scheduler_config.json


def sd3_pipeline(seed: int = 0, tokenizer_dir=None, t5: bool = True):
    """A tiny diffusers StableDiffusion3Pipeline; `tokenizer_dir` holds the T5 tokenizer folder (unused without
    `t5`: `text_encoder_3=None`)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5TokenizerFast

    reference.seed_everything(seed + 3)
    transformer = SD3Transformer2DModel(**TRANSFORMER).eval()
    g = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():  # non-trivial q/k RMSNorm scales (ones would hide a missing norm), a random table
        for name, p in transformer.named_parameters():
            if "norm_q" in name or "norm_k" in name or "norm_added" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        table = transformer.pos_embed.pos_embed
        table.copy_(0.5 * torch.randn(table.shape, generator=g))
    reference.seed_everything(seed + 5)
    vae = AutoencoderKL(**SD3_VAE).eval()
    reference.perturb_norms(vae, seed + 5)
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        text_encoder=reference.text_encoder(CLIP_L, with_projection=True, seed=seed),
        tokenizer=reference.clip_tokenizer(),
        text_encoder_2=reference.text_encoder(CLIP_G, with_projection=True, seed=seed + 1),
        tokenizer_2=reference.clip_tokenizer(pad_token="!"),
        text_encoder_3=t5_reference.t5_encoder(T5_SD3, seed=seed + 2) if t5 else None,
        tokenizer_3=T5TokenizerFast.from_pretrained(str(tokenizer_dir)) if t5 else None,
        transformer=transformer,
        vae=vae,
    )
