"""Save a full-size SD 1.5 or SDXL diffusers folder with random weights (the released configs), for benchmarks.

    python benchmarks/make_random_model.py sd15 /tmp/sd15-random
    python benchmarks/make_random_model.py sdxl /tmp/sdxl-random

Needs torch, diffusers and transformers (test extras). SD 1.5 takes about 4 GB on disk, SDXL about 10 GB (fp32).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import full_size


def main(kind: str, out: str) -> None:
    import reference
    from diffusers import EulerDiscreteScheduler, PNDMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    beta = dict(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000, steps_offset=1
    )
    text = {**full_size.SD15_TEXT, "bos_token_id": 49406, "eos_token_id": 49407}
    if kind == "sd15":
        pipe = StableDiffusionPipeline(
            vae=full_size.torch_vae(full_size.SD15_VAE),
            text_encoder=full_size.torch_text(text),
            tokenizer=reference.clip_tokenizer(),
            unet=full_size.torch_unet(full_size.SD15_UNET),
            scheduler=PNDMScheduler(**beta, skip_prk_steps=True, set_alpha_to_one=False),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    elif kind == "sdxl":
        big_g = dict(
            text,
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=20,
            hidden_act="gelu",
            projection_dim=1280,
        )
        vae = {**full_size.SD15_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}
        pipe = StableDiffusionXLPipeline(
            vae=full_size.torch_vae(vae),
            text_encoder=full_size.torch_text({**text, "projection_dim": 768}),
            text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**big_g)).eval(),
            tokenizer=reference.clip_tokenizer(),
            tokenizer_2=reference.clip_tokenizer(pad_token="!"),
            unet=full_size.torch_unet(full_size.SDXL_UNET),
            scheduler=EulerDiscreteScheduler(**beta, timestep_spacing="leading"),
            force_zeros_for_empty_prompt=True,
        )
    else:
        raise SystemExit(f"kind must be sd15 or sdxl, got {kind!r}")
    pipe.save_pretrained(out, safe_serialization=True)
    print(f"saved {kind} with random weights to {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
