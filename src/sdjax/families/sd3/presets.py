"""The released Stable Diffusion 3 / 3.5 architectures (stabilityai/stable-diffusion-3.5-large, -3.5-medium,
-3-medium-diffusers) as configs, and their pipelines with abstract or random weights: nothing to download.

`SD3_ARCHITECTURES` holds each model's components as the diffusers / transformers `config.json` keys of its folders:
the MMDiT (`SD3Transformer2DModel`; 3.5 large: 38 blocks of width 2432, 8.1e9 parameters; 3.5 medium: 24 blocks of
width 1536 with dual attention in blocks 0..12, 2.5e9; both qk RMS norm), CLIP-L and OpenCLIP bigG with their
projections (`text_encoder`, `text_encoder_2`: SDXL's two text encoders, the `sdxl-base` config set's files), T5
v1.1 XXL's encoder (`text_encoder_3`, as Flux's), the 16-channel VAE (latents `(z - 0.0609) * 1.5305`) and the
`FlowMatchEulerDiscreteScheduler` config (shift 3). "sd3-tiny" is a seconds-long SD 3.5-medium-shaped model for
tests (a dual-attention block, qk RMS norm).

`build_sd3_pipeline(kind, dtype)` -> `(StableDiffusion3Pipeline, params)`; `abstract=True` gives
`jax.ShapeDtypeStruct` params (shapes only: what `sdjax.aot` compiles for a TPU slice). The T5 tokenizer is
`families.flux.presets.shape_t5_tokenizer` (the programs' shapes, not real prompts). `weights_dtype="float8_e4m3fn"`
stores the transformer's and T5's matmul kernels in float8, computed in `dtype` (as Flux's presets).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sdjax.families.flux.presets import FLUX_VAE, T5_XXL, quantized_kernels, shape_t5_tokenizer

# SDXL's text encoders are SD 3's: openai/clip-vit-large-patch14 and laion's OpenCLIP bigG, both with projection.
_SDXL = Path(__file__).resolve().parents[2] / "assets" / "configs" / "sdxl-base"
CLIP_L_CONFIG = _SDXL / "text_encoder" / "config.json"
CLIP_G_CONFIG = _SDXL / "text_encoder_2" / "config.json"

# stabilityai/stable-diffusion-3.5-large `transformer/config.json` (large turbo: the same).
SD35_LARGE_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=38,
    attention_head_dim=64,
    num_attention_heads=38,
    joint_attention_dim=4096,
    caption_projection_dim=2432,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=192,
    qk_norm="rms_norm",
)
# stabilityai/stable-diffusion-3.5-medium `transformer/config.json` (MMDiT-X).
SD35_MEDIUM_TRANSFORMER = dict(
    SD35_LARGE_TRANSFORMER,
    num_layers=24,
    num_attention_heads=24,
    caption_projection_dim=1536,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
)
# stabilityai/stable-diffusion-3-medium-diffusers `transformer/config.json`.
SD3_MEDIUM_TRANSFORMER = dict(
    {k: v for k, v in SD35_MEDIUM_TRANSFORMER.items() if k not in ("dual_attention_layers", "qk_norm")},
    pos_embed_max_size=192,
)
# The `vae/config.json` of all three: Flux's VAE layout with SD 3's latent statistics.
SD3_VAE = dict(FLUX_VAE, scaling_factor=1.5305, shift_factor=0.0609)
SD3_SCHEDULER = dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=3.0)


@dataclasses.dataclass(frozen=True)
class SD3Architecture:
    """An SD 3 / 3.5 pipeline's component configs (`config.json` keys; `text_encoder` / `text_encoder_2` None:
    SDXL's files), its native image size and whether it samples with classifier-free guidance (large turbo: no)."""

    name: str
    transformer: dict
    text_encoder_3: dict
    vae: dict
    scheduler: dict  # with `_class_name`
    text_encoder: dict | None = None
    text_encoder_2: dict | None = None
    size: int = 1024
    cfg: bool = True


def _tiny_clip(width: int) -> dict:
    return dict(
        vocab_size=49408,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        projection_dim=width,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
    )


SD3_ARCHITECTURES: dict[str, SD3Architecture] = {
    "sd35-large": SD3Architecture("sd35-large", SD35_LARGE_TRANSFORMER, T5_XXL, SD3_VAE, SD3_SCHEDULER),
    "sd35-medium": SD3Architecture("sd35-medium", SD35_MEDIUM_TRANSFORMER, T5_XXL, SD3_VAE, SD3_SCHEDULER),
    "sd3-medium": SD3Architecture("sd3-medium", SD3_MEDIUM_TRANSFORMER, T5_XXL, SD3_VAE, SD3_SCHEDULER),
    # Seconds to compile: three blocks (the first with dual attention, the last context pre-only) of width 32, a
    # two-layer T5 and CLIPs (16 + 16 wide, projections 16 + 16 = pooled 32), a two-level VAE (factor 2).
    "sd3-tiny": SD3Architecture(
        "sd3-tiny",
        dict(
            SD35_MEDIUM_TRANSFORMER,
            sample_size=16,
            num_layers=3,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            caption_projection_dim=32,
            pooled_projection_dim=32,
            pos_embed_max_size=32,
            dual_attention_layers=(0,),
        ),
        dict(T5_XXL, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        dict(
            SD3_VAE,
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            layers_per_block=1,
            sample_size=32,
        ),
        SD3_SCHEDULER,
        text_encoder=_tiny_clip(16),
        text_encoder_2=_tiny_clip(16),
        size=32,
    ),
}
ALIASES = {"large": "sd35-large", "medium": "sd35-medium", "tiny": "sd3-tiny"}


def sd3_architecture(kind: str | SD3Architecture) -> SD3Architecture:
    """`"sd35-large"` / `"large"`, `"sd35-medium"` / `"medium"`, `"sd3-medium"`, `"sd3-tiny"`, or an architecture
    -> itself."""
    if isinstance(kind, SD3Architecture):
        return kind
    name = ALIASES.get(str(kind), str(kind))
    if name not in SD3_ARCHITECTURES:
        raise ValueError(f"SD 3 model {kind!r}: expected one of {sorted(SD3_ARCHITECTURES)} (or {sorted(ALIASES)})")
    return SD3_ARCHITECTURES[name]


def folder_architecture(folder: str | Path) -> SD3Architecture:
    """A diffusers SD 3 folder's configs (`model_index.json` + each component's `config.json`; no weights read). A
    folder without T5 (`text_encoder_3` null) is refused: the AOT programs are built with it."""
    from sdjax.config import read_json

    folder = Path(folder)
    index = read_json(folder / "model_index.json")
    if not (index.get("text_encoder_3") or [None])[0] or not (folder / "text_encoder_3" / "config.json").is_file():
        raise ValueError(f"{folder}: an SD 3 folder without text_encoder_3 (T5); compile needs its config")

    def config(name: str, file: str = "config.json") -> dict:
        return read_json(folder / name / file)  # bookkeeping keys (`_class_name`, ...) are ignored by the configs

    scheduler = config("scheduler", "scheduler_config.json")
    scheduler["_class_name"] = index["scheduler"][1]
    return SD3Architecture(
        str(folder),
        config("transformer"),
        config("text_encoder_3"),
        config("vae"),
        scheduler,
        text_encoder=config("text_encoder"),
        text_encoder_2=config("text_encoder_2"),
    )


def build_sd3_pipeline(
    kind: str | SD3Architecture,
    dtype: Any,
    *,
    abstract: bool = True,
    seed: int = 0,
    weights_dtype: Any = None,
):
    """The SD 3 pipeline of an architecture with abstract (`jax.ShapeDtypeStruct`) or random weights ->
    `(StableDiffusion3Pipeline, params)`. `dtype` is the compute dtype and the params' dtype; `weights_dtype` (e.g.
    `"float8_e4m3fn"`) stores the transformer's and T5's matmul kernels in that dtype instead. The sampler state
    (`params["scheduler"]`) is concrete and float32 either way."""
    import jax
    import jax.numpy as jnp

    from sdjax import samplers
    from sdjax.config import read_json
    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline
    from sdjax.models.clip import CLIPTextConfig, CLIPTextModelWithProjection
    from sdjax.models.presets import random_params
    from sdjax.models.sd3 import SD3Transformer2DModel, SD3TransformerConfig
    from sdjax.models.t5 import T5Config, T5EncoderModel
    from sdjax.models.vae import AutoencoderKL, AutoencoderKLConfig
    from sdjax.text.tokenizer import CLIPTokenizer

    a = sd3_architecture(kind)
    dtype = jnp.dtype(dtype)
    clip_l = a.text_encoder or read_json(CLIP_L_CONFIG)
    clip_g = a.text_encoder_2 or read_json(CLIP_G_CONFIG)
    parts = {
        "text_encoder": (CLIPTextModelWithProjection, CLIPTextConfig.from_dict(clip_l, source="text_encoder")),
        "text_encoder_2": (CLIPTextModelWithProjection, CLIPTextConfig.from_dict(clip_g, source="text_encoder_2")),
        "text_encoder_3": (T5EncoderModel, T5Config.from_dict(a.text_encoder_3, source="text_encoder_3")),
        "transformer": (SD3Transformer2DModel, SD3TransformerConfig.from_dict(a.transformer, source="transformer")),
        "vae": (AutoencoderKL, AutoencoderKLConfig.from_dict(a.vae, source="vae")),
    }
    modules, params = {}, {}
    for i, (name, (cls, config)) in enumerate(parts.items()):
        modules[name] = cls(config=config, dtype=dtype)
        shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), cls.init_params_shape(config))
        params[name] = shapes if abstract else random_params(shapes, seed + i, dtype)
    if weights_dtype is not None:
        params = quantized_kernels(params, weights_dtype, components=("transformer", "text_encoder_3"))
    sampler = samplers.get_sampler(dict(a.scheduler))
    params["scheduler"] = sampler.create_state()
    pipe = StableDiffusion3Pipeline(
        tokenizer=CLIPTokenizer.default(),
        text_encoder=modules["text_encoder"],
        tokenizer_2=CLIPTokenizer.default(),
        text_encoder_2=modules["text_encoder_2"],
        tokenizer_3=shape_t5_tokenizer(),
        text_encoder_3=modules["text_encoder_3"],
        transformer=modules["transformer"],
        vae=modules["vae"],
        scheduler=sampler,
        dtype=dtype,
        name=f"{'abstract' if abstract else 'random'} {a.name}",
        params=params,
    )
    return pipe, params


# The names `sdjax.aot` reads from a family's presets module.
ARCHITECTURES = SD3_ARCHITECTURES
Architecture = SD3Architecture
build_pipeline = build_sd3_pipeline
