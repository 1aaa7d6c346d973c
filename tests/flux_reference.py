"""The Flux.1 reference for tests: a tiny diffusers `FluxPipeline` from the real configs, shrunk.

CLIP-L (the SD 1.x tiny text encoder: its hidden size is the transformer's `pooled_projection_dim`), a tiny T5 v1.1
(`t5_reference`: `d_model` is the transformer's `joint_attention_dim`), a 16-channel VAE with Flux's shift and
scaling factors and no quant convs, and a `FluxTransformer2DModel` with two double- and two single-stream blocks.
"dev" has the guidance embedding and dynamic shifting (FLUX.1-dev's scheduler config); "schnell" neither.

`randomized_controlnet`: a diffusers `FluxControlNetModel` (or transformer) with random weights where diffusers
starts at zero (`controlnet_x_embedder`, `controlnet_blocks`, `controlnet_single_blocks`: else a net adds nothing and
a comparison proves nothing) and non-trivial q/k RMSNorm scales.
"""

from __future__ import annotations

import reference
import t5_reference

FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    norm_num_groups=32,
    sample_size=32,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    force_upcast=True,
)


def transformer_config(guidance: bool) -> dict:
    return dict(
        patch_size=1,
        in_channels=64,  # 16 latent channels in 2x2 patches
        out_channels=None,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5_reference.T5_TINY["d_model"],
        pooled_projection_dim=reference.CLIP_SD1["hidden_size"],
        guidance_embeds=guidance,
        axes_dims_rope=(4, 6, 6),
    )


SCHEDULERS = {  # FLUX.1-dev's and FLUX.1-schnell's scheduler_config.json
    "dev": dict(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
    ),
    "schnell": dict(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=False,
    ),
}


def flux_pipeline(kind: str = "dev", seed: int = 0, tokenizer_dir=None):
    """A tiny diffusers FluxPipeline ("dev" or "schnell"); `tokenizer_dir` holds the T5 tokenizer folder."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5TokenizerFast

    reference.seed_everything(seed + 3)
    transformer = FluxTransformer2DModel(**transformer_config(kind == "dev")).eval()
    g = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():  # non-trivial q/k RMSNorm scales (ones would hide a missing norm)
        for name, p in transformer.named_parameters():
            if "norm_q" in name or "norm_k" in name or "norm_added" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    reference.seed_everything(seed + 5)
    vae = AutoencoderKL(**FLUX_VAE).eval()
    reference.perturb_norms(vae, seed + 5)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS[kind]),
        text_encoder=reference.text_encoder(reference.CLIP_SD1, seed=seed),
        tokenizer=reference.clip_tokenizer(),
        text_encoder_2=t5_reference.t5_encoder(seed=seed + 1),
        tokenizer_2=T5TokenizerFast.from_pretrained(str(tokenizer_dir)),
        transformer=transformer,
        vae=vae,
    )


CONTROLNET_ZERO_INIT = ("controlnet_x_embedder.", "controlnet_blocks.", "controlnet_single_blocks.")


def randomized_controlnet(model, seed: int, *, scale: float = 0.3, norms: float = 0.1):
    """`model` in eval mode with, drawn from `seed`, the layers diffusers starts at zero set to `scale` x N(0, 1)
    and the q/k RMSNorm scales 1 + `norms` x N(0, 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(CONTROLNET_ZERO_INIT):
                p.copy_(scale * torch.randn(p.shape, generator=g))
            elif norms and ("norm_q" in name or "norm_k" in name or "norm_added" in name):
                p.copy_(1 + norms * torch.randn(p.shape, generator=g))
    return model.eval()
