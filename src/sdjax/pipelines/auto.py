"""Pick the pipeline class from a model's `model_index.json`, and the names sdjax knows without a download."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sdjax.models.presets import ALIASES, EMBEDDED_MODEL, resolve_alias  # noqa: F401 (re-exported)


def pipeline_class_name(path_or_repo_id: str, **resolve_kwargs: Any) -> str:
    """The `_class_name` of a local folder's or Hub repo's `model_index.json`."""
    from sdjax.loading.files import resolve_model_dir

    folder = Path(resolve_alias(path_or_repo_id))
    if not folder.is_dir():
        folder = Path(resolve_model_dir(str(path_or_repo_id), components=[], **resolve_kwargs))
    index = folder / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{folder}: no model_index.json; is this a diffusers pipeline folder?")
    return json.loads(index.read_text()).get("_class_name", "")


def load_pipeline(model: str | None = None, dtype: Any = "float32", **kwargs: Any):
    """Load a model of any family (`sdjax.families.FAMILIES`) by what it says it is -> `(pipeline, params)`;
    `None` is the embedded model.

    `model` is a diffusers folder, a Hub repo id, or a single checkpoint file (`.safetensors`; see
    `from_single_file`). `dtype` may be a string ("bf16", "float32", ...) or a jnp dtype.
    """
    from sdjax.families import family_of_file, family_of_pipeline_class, pipeline_classes
    from sdjax.precision import resolve_dtype
    from sdjax.quant import check_quantize

    check_quantize(kwargs.get("quantize"))
    model = resolve_alias(model or EMBEDDED_MODEL)
    family = family_of_file(model) if os.path.isfile(model) else None
    if family is not None:
        config = kwargs.pop("config", None)
        if config is None:
            parts = ", ".join(f"{p}=" for p in family.single_file_parts)
            raise ValueError(
                f"{model}: a {family.title} transformer file (a single file, without tokenizers and configs): give "
                f"config= a diffusers {family.title} folder for what the file lacks "
                f"({family.pipeline_class().__name__}.from_single_file also takes {parts} files)"
            )
        for part in ("t5", "clip_l", "clip_g"):
            if kwargs.get(part) is not None and part not in family.single_file_parts:
                raise ValueError(
                    f"{part}={kwargs[part]!r}: a {family.title} model has no such encoder file (it takes "
                    f"{', '.join(f'{p}=' for p in family.single_file_parts)})"
                )
        return family.pipeline_class().from_single_file(model, config=config, dtype=resolve_dtype(dtype), **kwargs)
    if os.path.isfile(model):
        from sdjax.loading.single_file import load_single_file

        single = {k: kwargs.pop(k) for k in ("prediction_type", "config", "extract_ema", "allow_pickle") if k in kwargs}
        scheduler = kwargs.pop("scheduler", None)
        quantize = kwargs.pop("quantize", None)
        loaded, params, model_index = load_single_file(
            model,
            dtype=resolve_dtype(dtype),
            vae=kwargs.pop("vae", None),
            overrides=kwargs,
            quantize=quantize,
            **single,
        )
        name = model_index.get("_class_name", "")
        classes = pipeline_classes()
        if name not in classes:
            raise ValueError(f"{model}: a {name!r} checkpoint; sdjax loads {sorted(classes)}")
        return classes[name]._assemble(
            loaded, params, model_index, dtype=resolve_dtype(dtype), name=model, scheduler=scheduler, quantize=quantize
        )
    resolve_kwargs = {k: kwargs[k] for k in ("revision", "local_files_only") if k in kwargs}
    name = pipeline_class_name(model, **resolve_kwargs)
    try:
        family = family_of_pipeline_class(name)
    except ValueError as e:
        raise ValueError(f"{model}: model_index.json names pipeline class {name!r}; {e}") from None
    return family.pipeline_class().from_pretrained(model, dtype=resolve_dtype(dtype), **kwargs)
