"""Loading a pipeline class from files: `from_pretrained` (a diffusers folder or Hub repo id) and `from_single_file`
(an original-layout checkpoint), both through `_assemble`. A mixin of `DiffusionPipeline`: the classmethods build
`cls`, the subclass they are called on, from the components `sdjax.loading` returns.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from sdjax import samplers as sampler_lib


class LoadingMixin:
    """The loading classmethods of `DiffusionPipeline` (see the module docstring); they read the class attributes
    `model_index_classes`, `component_loaders` and `pipeline_config_keys` of `cls`."""

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        *,
        revision: str | None = None,
        variant: str | None = None,
        dtype=jnp.float32,
        from_pt: bool = False,
        split_head_dim: bool = False,
        use_memory_efficient_attention: bool = False,
        attention: str | None = None,
        local_files_only: bool = False,
        vae: Any = None,
        quantize: str | None = None,
        **components,
    ):
        """Load a diffusers folder or Hub repo id -> `(pipeline, params)` (a single `.safetensors` checkpoint
        file goes to `from_single_file`).

        `dtype` is the dtype of the stored params and of the computation (the scheduler state stays float32).
        A keyword named like a component (`scheduler=`, `safety_checker=None`, ...) replaces or disables it;
        `scheduler` may be a sampler object (`sdjax.samplers.get_sampler(...)`), a scheduler config dict, or a
        sampler name such as `"euler_a"` or `"DPM++ 2M Karras"` (built from the model's own scheduler config, as
        diffusers' `from_config`). `vae` replaces the VAE: a diffusers VAE folder or Hub repo, a single VAE file,
        or a `(module, params)` pair. `"sdjax/embedded"` names the small model shipped with the package. `from_pt`
        is accepted for compatibility and has no effect: PyTorch-format weights are always converted.
        `quantize="int8"|"fp8"` (or a `sdjax.quant.QuantPolicy`) stores the denoiser's kernels quantized,
        dequantized inside the program (`sdjax.quant`, docs/quantization.md); each selected kernel is quantized as
        it is converted (`sdjax.quant.loading`), so the load never holds the denoiser in full precision.
        """
        from sdjax.loading.components import load_pipeline_components
        from sdjax.loading.single_file import load_vae
        from sdjax.models.presets import resolve_alias
        from sdjax.quant import check_quantize

        del from_pt
        check_quantize(quantize)
        pretrained_model_name_or_path = resolve_alias(pretrained_model_name_or_path)
        if os.path.isfile(pretrained_model_name_or_path):
            return cls.from_single_file(
                pretrained_model_name_or_path,
                dtype=dtype,
                vae=vae,
                split_head_dim=split_head_dim,
                attention=attention or ("chunked" if use_memory_efficient_attention else None),
                quantize=quantize,
                **components,
            )
        scheduler = components.pop("scheduler", None)
        policy = cls._load_time_policy(quantize)
        loaded, params, model_index = load_pipeline_components(
            pretrained_model_name_or_path,
            expected_class=cls.model_index_classes,
            revision=revision,
            variant=variant,
            dtype=dtype,
            local_files_only=local_files_only,
            overrides=components,
            vae=vae,
            vae_loader=load_vae,
            loaders=cls.component_loaders,
            quantize=policy,
        )
        return cls._assemble(
            loaded,
            params,
            model_index,
            dtype=dtype,
            name=str(pretrained_model_name_or_path),
            scheduler=scheduler,
            split_head_dim=split_head_dim,
            attention=attention or ("chunked" if use_memory_efficient_attention else None),
            quantize=quantize if policy is None else policy,
        )

    @classmethod
    def _load_time_policy(cls, quantize: Any):
        """`quantize=` as the `QuantPolicy` the loader applies while converting: a policy as it is; `"int8"` /
        `"fp8"` over the denoiser's params key, which the families table (`sdjax.families.FAMILIES`) gives for the
        pipeline classes `cls` loads; None when that is not one key (the denoiser is then quantized after
        loading, by `quantize_pipeline`, as before)."""
        from sdjax.families import FAMILIES
        from sdjax.quant import QuantPolicy, check_quantize, resolve_policy

        quantize = check_quantize(quantize)
        if quantize is None or isinstance(quantize, QuantPolicy):
            return quantize
        mine = set(cls.model_index_classes)
        keys = {f.denoiser_component for f in FAMILIES.values() if mine & set(f.model_index_classes)}
        return resolve_policy(quantize, keys.pop()) if len(keys) == 1 else None

    @classmethod
    def from_single_file(
        cls,
        path: str,
        *,
        dtype=jnp.float32,
        prediction_type: str | None = None,
        config: str | None = None,
        vae: Any = None,
        extract_ema: bool = False,
        allow_pickle: bool = False,
        split_head_dim: bool = False,
        attention: str | None = None,
        local_files_only: bool = False,
        quantize: str | None = None,
        **components,
    ):
        """Load an original-layout checkpoint file (as civitai ships them: SD 1.x, 2.x, XL base / refiner,
        inpainting) -> `(pipeline, params)`. The architecture is inferred from the tensors; configs and tokenizers
        come from sdjax's embedded config sets (or `config=`, a diffusers folder or Hub repo); `prediction_type`
        overrides what the file says (SD 2.x 512 epsilon vs 768 v-prediction). `.ckpt` pickles are refused unless
        `allow_pickle=True` (read by a restricted unpickler that executes no code). See
        `sdjax.loading.single_file`. `quantize` as for `from_pretrained`."""
        from sdjax.loading.single_file import load_single_file
        from sdjax.quant import check_quantize

        check_quantize(quantize)
        scheduler = components.pop("scheduler", None)
        loaded, params, model_index = load_single_file(
            path,
            dtype=dtype,
            prediction_type=prediction_type,
            config=config,
            vae=vae,
            extract_ema=extract_ema,
            allow_pickle=allow_pickle,
            overrides=components,
            local_files_only=local_files_only,
            quantize=quantize,
        )
        found = model_index.get("_class_name", "")
        if found not in cls.model_index_classes:
            raise ValueError(
                f"{path}: the checkpoint is a {found} model; load it with the matching pipeline class "
                f"(or sdjax.load_pipeline, which picks it)"
            )
        return cls._assemble(
            loaded,
            params,
            model_index,
            dtype=dtype,
            name=str(path),
            scheduler=scheduler,
            split_head_dim=split_head_dim,
            attention=attention,
            quantize=quantize,
        )

    @classmethod
    def _assemble(
        cls,
        loaded: dict,
        params: dict,
        model_index: dict,
        *,
        dtype,
        name: str,
        scheduler=None,
        split_head_dim: bool = False,
        attention: str | None = None,
        quantize: str | None = None,
    ):
        """The pipeline from loaded components: runtime options on the modules, the sampler override, the
        quantized denoiser (`sdjax.quant.quantize_pipeline`)."""
        from sdjax.quant import quantize_pipeline

        runtime = {"split_head_dim": split_head_dim}
        if attention:
            runtime["attention"] = attention
        for component in ("unet", "transformer", "text_encoder", "text_encoder_2", "vae"):
            module = loaded.get(component)
            if module is not None:
                fields = {k: v for k, v in runtime.items() if hasattr(module, k)}
                loaded[component] = module.clone(**fields) if fields else module
        if scheduler is not None:
            loaded["scheduler"] = sampler_lib.get_sampler(scheduler, base_config=loaded["scheduler"])
            params["scheduler"] = loaded["scheduler"].create_state()
        settings = {k: model_index[k] for k in cls.pipeline_config_keys if k in model_index}
        pipe = cls(**loaded, **settings, dtype=dtype, name=name, params=params)
        return quantize_pipeline(pipe, params, quantize)
