"""Loading a ControlNet on its own (a folder or Hub repo with `config.json` and weights, or a component folder of a
pipeline repo) through the same loader as a pipeline's models: the guides' `FlaxControlNetModel.from_pretrained`.

The `_class_name` of its `config.json` picks the model: `ControlNetModel` (SD 1.x/2.x, SDXL; the default),
`SD3ControlNetModel` (SD 3 / 3.5, `models.sd3_controlnet`) or `FluxControlNetModel` (Flux.1,
`models.flux_controlnet`). Single files: `controlnet_file`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from sdjax.config import read_json
from sdjax.loading.components import (
    CONTROLNET,
    FLUX_CONTROLNET,
    SD3_CONTROLNET,
    LoadRequest,
    ModelSpec,
    load_model,
    resolve_model_folder,
)
from sdjax.loading.controlnet_file import load_controlnet_file
from sdjax.models.controlnet import ControlNetModel

CONTROLNET_KEY = "controlnet"  # the component name of a ControlNet's params (`quant.params.CONTROLNET`)
CONTROLNET_CLASSES = {  # config `_class_name`
    "ControlNetModel": CONTROLNET,
    "SD3ControlNetModel": SD3_CONTROLNET,
    "FluxControlNetModel": FLUX_CONTROLNET,
}


def load_controlnet(
    path_or_repo_id: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    revision: str | None = None,
    variant: str | None = None,
    local_files_only: bool = False,
    subfolder: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    from_pt: bool = False,
    config: Any = None,
    allow_pickle: bool = False,
    quantize: Any = None,
) -> tuple[Any, dict]:
    """A diffusers ControlNet folder or Hub repo id (`config.json` + `diffusion_pytorch_model[.V].safetensors`,
    shards, old Flax msgpack) -> `(module, params)`, params cast to `dtype`. `from_pt` is accepted for the old
    guides and has no effect (PyTorch weights are always converted); `subfolder` reads a component folder of a
    pipeline repo (e.g. "controlnet"). The module is a `ControlNetModel` or, for an `SD3ControlNetModel` config, a
    `models.sd3_controlnet.SD3ControlNetModel`, for a `FluxControlNetModel` config a
    `models.flux_controlnet.FluxControlNetModel`. A FILE is read by `controlnet_file.load_controlnet_file` (`config`,
    `allow_pickle` apply there): SD 1.x/2.x and SDXL nets in the original or diffusers layout
    (`control_v11p_sd15_canny.safetensors`), SD 3.5 nets as Stability AI released them
    (`sd3.5_large_controlnet_canny.safetensors`, `sd3_controlnet_file`), Flux nets in the diffusers layout with
    `config`.

    `quantize` ("int8", "fp8" or a `sdjax.quant.QuantPolicy` naming "controlnet"; docs/quantization.md): the net's
    kernels stored quantized (weight-only), each quantized as it is converted, so the float net is never held
    whole; pipelines dequantize them where the net runs. A pipeline loaded with `quantize=` quantizes the nets it
    loads by name or path itself (`quant.params.controlnet_policy`)."""
    del from_pt
    policy = _quant_policy(quantize)
    if Path(os.fspath(path_or_repo_id)).expanduser().is_file():
        module, params = load_controlnet_file(
            path_or_repo_id, dtype=dtype, config=config, allow_pickle=allow_pickle, quantize=policy
        )
        return module, _quantized_rest(params, policy)
    if config is not None or allow_pickle:
        raise ValueError("config= and allow_pickle= apply to a ControlNet single file; a folder has its config.json")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    folder = resolve_model_folder(
        path_or_repo_id,
        revision=revision,
        variant=variant,
        local_files_only=local_files_only,
        subfolder=subfolder,
        cache_dir=cache_dir,
        token=token,
    )
    spec = _spec_of(folder)
    module, params = load_model(spec, LoadRequest(CONTROLNET_KEY, folder, variant, dtype, quantize=policy))
    return module, _quantized_rest(params, policy)


def _quant_policy(quantize: Any):
    """`quantize=` of `load_controlnet` as a policy over the "controlnet" params (checked before anything loads)."""
    if quantize is None:
        return None
    from sdjax.quant.params import resolve_policy

    policy = resolve_policy(quantize, CONTROLNET_KEY)
    if CONTROLNET_KEY not in policy.components:
        raise ValueError(
            f"quantize=QuantPolicy(components={policy.components!r}): a ControlNet's params are "
            f"{CONTROLNET_KEY!r}; name it in components (or pass 'int8' / 'fp8')"
        )
    return policy


def _quantized_rest(params: dict, policy: Any) -> dict:
    """`params` with the selected kernels a loader read whole (old Flax msgpack weights, no per-tensor hook)
    quantized too; kernels quantized while converting are kept as they are."""
    if policy is None:
        return params
    from sdjax.quant.params import quantize_tree

    return quantize_tree(params, policy, CONTROLNET_KEY)


def _spec_of(folder: Path) -> ModelSpec:
    """The model a ControlNet folder holds, by its config's `_class_name` (a `Flax` prefix is ignored; none:
    `ControlNetModel`, as the old Flax exports wrote)."""
    path = folder / "config.json"
    if not path.is_file():
        return CONTROLNET  # the loader names the missing file
    name = str(read_json(path).get("_class_name") or "ControlNetModel").removeprefix("Flax")
    if name not in CONTROLNET_CLASSES:
        known = sorted(CONTROLNET_CLASSES)
        raise ValueError(f"{path}: _class_name {name!r} is not a ControlNet sdjax loads (known: {known})")
    return CONTROLNET_CLASSES[name]


class FlaxControlNetModel(ControlNetModel):
    """The old guides' name: `controlnet, controlnet_params = FlaxControlNetModel.from_pretrained(repo,
    from_pt=True, dtype=jnp.float32)`. The module it returns is a `ControlNetModel`."""

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, **kwargs: Any) -> tuple[ControlNetModel, dict]:
        return load_controlnet(path_or_repo_id, **kwargs)
