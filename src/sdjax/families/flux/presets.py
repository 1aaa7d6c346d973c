"""The released Flux.1 architectures (black-forest-labs/FLUX.1-dev and FLUX.1-schnell) as configs, and their
pipelines with abstract or random weights: nothing to download.

`FLUX_ARCHITECTURES` holds each model's components as the diffusers / transformers `config.json` keys of its
folders: the transformer (`FluxTransformer2DModel`: 19 double- and 38 single-stream blocks of width 3072, 11.9e9
parameters; dev adds the guidance embedding), CLIP ViT-L/14's text model (`text_encoder`, the `sd15` config set's
file: the same model), T5 v1.1 XXL's encoder (`text_encoder_2`: 4.76e9 parameters), the 16-channel VAE (no quant
convs, latents `(z - 0.1159) * 0.3611`) and the `FlowMatchEulerDiscreteScheduler` config (dev: dynamic shift;
schnell: shift 1). "flux-tiny" is a seconds-long Flux-shaped model for tests.

`build_flux_pipeline(kind, dtype)` -> `(FluxPipeline, params)`; `abstract=True` gives `jax.ShapeDtypeStruct`
params (shapes only: what `sdjax.aot` compiles for a TPU slice). The tokenizers are CLIP's shipped vocabulary and
a minimal T5 Unigram vocabulary built in memory (`shape_t5_tokenizer`): enough for the programs' shapes (ids of
`max_sequence_length`), not for real prompts. `weights_dtype="float8_e4m3fn"` stores the transformer's and T5's
matmul kernels in float8 (1 byte a weight); the compute stays `dtype`: every `nn.Dense` casts its kernel to its
compute dtype when used (`flax.linen.dtypes.promote_dtype`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

# the released T5 v1.1 XXL and CLIP-L configs, as the single-file loader knows them
from sdjax.families.flux.weights import CLIP_L_CONFIG, T5_XXL

# black-forest-labs/FLUX.1-dev `transformer/config.json` (schnell: guidance_embeds false).
FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    out_channels=None,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# FLUX.1's `vae/config.json`: SD's VAE layout with 16 latent channels, no quant convs, a shift factor.
FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    norm_num_groups=32,
    act_fn="silu",
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    force_upcast=True,
    mid_block_add_attention=True,
)
_FLOW = dict(
    _class_name="FlowMatchEulerDiscreteScheduler",
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
)
FLUX_DEV_SCHEDULER = dict(_FLOW, shift=3.0, use_dynamic_shifting=True)
FLUX_SCHNELL_SCHEDULER = dict(_FLOW, shift=1.0, use_dynamic_shifting=False)


@dataclasses.dataclass(frozen=True)
class FluxArchitecture:
    """A Flux.1 pipeline's component configs (`config.json` keys; `text_encoder` None: CLIP-L's file) and its
    native image size."""

    name: str
    transformer: dict
    text_encoder_2: dict
    vae: dict
    scheduler: dict  # with `_class_name`
    text_encoder: dict | None = None
    size: int = 1024
    cfg: bool = False  # FluxPipeline runs without true CFG unless given a negative prompt and true_cfg_scale


def _clip_l() -> dict:
    from sdjax.config import read_json

    return read_json(CLIP_L_CONFIG)


FLUX_ARCHITECTURES: dict[str, FluxArchitecture] = {
    "flux-dev": FluxArchitecture("flux-dev", FLUX_TRANSFORMER, T5_XXL, FLUX_VAE, FLUX_DEV_SCHEDULER),
    "flux-schnell": FluxArchitecture(
        "flux-schnell", dict(FLUX_TRANSFORMER, guidance_embeds=False), T5_XXL, FLUX_VAE, FLUX_SCHNELL_SCHEDULER
    ),
    # Seconds to compile: two blocks of each kind, width 32, a two-layer T5 and CLIP, a two-level VAE (factor 2).
    "flux-tiny": FluxArchitecture(
        "flux-tiny",
        dict(
            FLUX_TRANSFORMER,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
        dict(T5_XXL, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        dict(
            FLUX_VAE,
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            layers_per_block=1,
            sample_size=32,
        ),
        FLUX_DEV_SCHEDULER,
        text_encoder=dict(
            vocab_size=49408,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            hidden_act="quick_gelu",
            layer_norm_eps=1e-5,
            projection_dim=32,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        ),
        size=32,
    ),
}
ALIASES = {"dev": "flux-dev", "schnell": "flux-schnell", "tiny": "flux-tiny"}


def flux_architecture(kind: str | FluxArchitecture) -> FluxArchitecture:
    """`"flux-dev"` / `"dev"`, `"flux-schnell"` / `"schnell"`, `"flux-tiny"`, or an architecture -> itself."""
    if isinstance(kind, FluxArchitecture):
        return kind
    name = ALIASES.get(str(kind), str(kind))
    if name not in FLUX_ARCHITECTURES:
        raise ValueError(f"Flux model {kind!r}: expected one of {sorted(FLUX_ARCHITECTURES)} (or {sorted(ALIASES)})")
    return FLUX_ARCHITECTURES[name]


def folder_architecture(folder: str | Path) -> FluxArchitecture:
    """A diffusers Flux folder's configs (`model_index.json` + each component's `config.json`; no weights read)."""
    from sdjax.config import read_json

    folder = Path(folder)

    def config(name: str, file: str = "config.json") -> dict:
        return read_json(folder / name / file)  # bookkeeping keys (`_class_name`, ...) are ignored by the configs

    scheduler = config("scheduler", "scheduler_config.json")
    scheduler["_class_name"] = read_json(folder / "model_index.json")["scheduler"][1]
    return FluxArchitecture(
        str(folder),
        config("transformer"),
        config("text_encoder_2"),
        config("vae"),
        scheduler,
        text_encoder=config("text_encoder"),
    )


def shape_t5_tokenizer(model_max_length: int = 512):
    """A T5 tokenizer with T5's special ids (`<pad>` 0, `</s>` 1, `<unk>` 2) and a handful of pieces: the ids it
    gives have the real tokenizer's shape `(N, max_length)`, not its values. For compiling, not for prompts."""
    from sdjax.text.t5_tokenizer import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(pieces, unk_id=2, model_max_length=model_max_length)


def quantized_kernels(params: dict, weights_dtype: Any, components=("transformer", "text_encoder_2")) -> dict:
    """`params` with the matmul kernels (2-D `kernel` leaves) of `components` in `weights_dtype` (abstract or
    concrete leaves); everything else unchanged. Biases, norms, embeddings and the VAE keep their dtype."""
    import jax
    import jax.numpy as jnp

    wdtype = jnp.dtype(weights_dtype)

    def cast(path, x):
        if str(getattr(path[-1], "key", "")) != "kernel" or len(x.shape) != 2:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, wdtype)
        return x.astype(wdtype)

    return {k: jax.tree_util.tree_map_with_path(cast, v) if k in components else v for k, v in params.items()}


def build_flux_pipeline(
    kind: str | FluxArchitecture,
    dtype: Any,
    *,
    abstract: bool = True,
    seed: int = 0,
    weights_dtype: Any = None,
    max_sequence_length: int | None = None,
):
    """The Flux.1 pipeline of an architecture with abstract (`jax.ShapeDtypeStruct`) or random weights ->
    `(FluxPipeline, params)`. `dtype` is the compute dtype and the params' dtype; `weights_dtype` (e.g.
    `"float8_e4m3fn"`) stores the transformer's and T5's matmul kernels in that dtype instead (module docstring).
    The sampler state (`params["scheduler"]`) is concrete and float32 either way."""
    import jax
    import jax.numpy as jnp

    from sdjax import samplers
    from sdjax.families.flux.pipeline import FluxPipeline
    from sdjax.models.clip import CLIPTextConfig, CLIPTextModel
    from sdjax.models.flux import FluxTransformer2DModel, FluxTransformerConfig
    from sdjax.models.presets import random_params
    from sdjax.models.t5 import T5Config, T5EncoderModel
    from sdjax.models.vae import AutoencoderKL, AutoencoderKLConfig
    from sdjax.text.tokenizer import CLIPTokenizer

    a = flux_architecture(kind)
    dtype = jnp.dtype(dtype)
    parts = {
        "text_encoder": (CLIPTextModel, CLIPTextConfig.from_dict(a.text_encoder or _clip_l(), source="text_encoder")),
        "text_encoder_2": (T5EncoderModel, T5Config.from_dict(a.text_encoder_2, source="text_encoder_2")),
        "transformer": (FluxTransformer2DModel, FluxTransformerConfig.from_dict(a.transformer, source="transformer")),
        "vae": (AutoencoderKL, AutoencoderKLConfig.from_dict(a.vae, source="vae")),
    }
    modules, params = {}, {}
    for i, (name, (cls, config)) in enumerate(parts.items()):
        modules[name] = cls(config=config, dtype=dtype)
        shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), cls.init_params_shape(config))
        params[name] = shapes if abstract else random_params(shapes, seed + i, dtype)
    if weights_dtype is not None:
        params = quantized_kernels(params, weights_dtype)
    sampler = samplers.get_sampler(dict(a.scheduler))
    params["scheduler"] = sampler.create_state()
    pipe = FluxPipeline(
        tokenizer=CLIPTokenizer.default(),
        text_encoder=modules["text_encoder"],
        tokenizer_2=shape_t5_tokenizer(),
        text_encoder_2=modules["text_encoder_2"],
        transformer=modules["transformer"],
        vae=modules["vae"],
        scheduler=sampler,
        dtype=dtype,
        name=f"{'abstract' if abstract else 'random'} {a.name}",
        params=params,
        max_sequence_length=max_sequence_length,
    )
    return pipe, params


# The names `sdjax.aot` reads from a family's presets module.
ARCHITECTURES = FLUX_ARCHITECTURES
Architecture = FluxArchitecture
build_pipeline = build_flux_pipeline
