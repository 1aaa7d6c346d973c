"""Pipelines of the preset architectures (`sdjax.models.presets`) with random weights: nothing to download."""

from __future__ import annotations

from sdjax.models.presets import ARCHITECTURES, Architecture, random_params


def build_pipeline(arch: str | Architecture, dtype, *, abstract: bool = False, seed: int = 0):
    """The sdjax pipeline of an architecture with random weights -> `(pipeline, params)`.

    `abstract=True`: params are `jax.ShapeDtypeStruct` (nothing allocated) except the small sampler state."""
    import jax
    import jax.numpy as jnp

    from sdjax import samplers
    from sdjax.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel
    from sdjax.models.vae import AutoencoderKL, AutoencoderKLConfig
    from sdjax.pipelines import StableDiffusionPipeline
    from sdjax.pipelines.stable_diffusion_xl import StableDiffusionXLPipeline
    from sdjax.text.tokenizer import CLIPTokenizer

    a = ARCHITECTURES[arch] if isinstance(arch, str) else arch
    dtype = jnp.dtype(dtype)
    parts = {}
    if a.text_encoder is not None:
        parts["text_encoder"] = (CLIPTextModel, CLIPTextConfig.from_dict(a.text_encoder, source="text_encoder"))
    parts["unet"] = (UNet2DConditionModel, UNet2DConditionConfig(**a.unet))
    parts["vae"] = (AutoencoderKL, AutoencoderKLConfig(**a.vae))
    if a.text_encoder_2 is not None:
        parts["text_encoder_2"] = (
            CLIPTextModelWithProjection,
            CLIPTextConfig.from_dict(a.text_encoder_2, source="text_encoder_2"),
        )
    modules, params = {}, {}
    for i, (name, (cls, config)) in enumerate(parts.items()):
        modules[name] = cls(config=config, dtype=dtype)
        shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), cls.init_params_shape(config))
        params[name] = shapes if abstract else random_params(shapes, seed + i, dtype)
    sampler = samplers.get_sampler(dict(a.scheduler))
    params["scheduler"] = sampler.create_state()
    common = dict(
        tokenizer=CLIPTokenizer.default() if a.text_encoder is not None else None,
        text_encoder=modules.get("text_encoder"),
        scheduler=sampler,
        dtype=dtype,
        name=f"random {a.pipeline}",
        params=params,
        unet=modules["unet"],
        vae=modules["vae"],
        **dict(a.settings),
    )
    if a.text_encoder_2 is not None:
        pipe = StableDiffusionXLPipeline(
            tokenizer_2=CLIPTokenizer.default(pad_token="!"), text_encoder_2=modules["text_encoder_2"], **common
        )
    else:
        pipe = StableDiffusionPipeline(**common)
    return pipe, params
