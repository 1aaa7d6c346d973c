"""Loading a ControlNet on its own (a folder or Hub repo with `config.json` and weights, or a component folder of a
pipeline repo) through the same loader as a pipeline's models: the guides' `FlaxControlNetModel.from_pretrained`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from sdjax.loading.components import CONTROLNET, load_model_from
from sdjax.models.controlnet import ControlNetModel


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
) -> tuple[ControlNetModel, dict]:
    """A diffusers ControlNet folder or Hub repo id (`config.json` + `diffusion_pytorch_model[.V].safetensors`,
    shards, old Flax msgpack) -> `(module, params)`, params cast to `dtype`. `from_pt` is accepted for the old
    guides and has no effect (PyTorch weights are always converted); `subfolder` reads a component folder of a
    pipeline repo (e.g. "controlnet"). A FILE (`control_v11p_sd15_canny.safetensors`, original or diffusers layout)
    is read by `controlnet_file.load_controlnet_file` (`config`, `allow_pickle` apply there)."""
    del from_pt
    if Path(os.fspath(path_or_repo_id)).expanduser().is_file():
        from sdjax.loading.controlnet_file import load_controlnet_file

        return load_controlnet_file(path_or_repo_id, dtype=dtype, config=config, allow_pickle=allow_pickle)
    if config is not None or allow_pickle:
        raise ValueError("config= and allow_pickle= apply to a ControlNet single file; a folder has its config.json")
    return load_model_from(
        CONTROLNET,
        path_or_repo_id,
        dtype=dtype,
        revision=revision,
        variant=variant,
        local_files_only=local_files_only,
        subfolder=subfolder,
        cache_dir=cache_dir,
        token=token,
    )


class FlaxControlNetModel(ControlNetModel):
    """The old guides' name: `controlnet, controlnet_params = FlaxControlNetModel.from_pretrained(repo,
    from_pt=True, dtype=jnp.float32)`. The module it returns is a `ControlNetModel`."""

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, **kwargs: Any) -> tuple[ControlNetModel, dict]:
        return load_controlnet(path_or_repo_id, **kwargs)
