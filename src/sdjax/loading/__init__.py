"""Checkpoint loading: configs, PyTorch -> Flax conversion, checkpoint files and whole pipeline folders."""

from sdjax.config import ConfigError, config_from_dict
from sdjax.loading.components import load_pipeline_components
from sdjax.loading.files import (
    CheckpointError,
    MissingWeightsError,
    WeightFiles,
    flax_params_to_sdjax,
    read_flax_msgpack,
    read_safetensors,
    resolve_model_dir,
    select_weight_files,
)
from sdjax.models.convert import WeightLoadError, convert_state_dict

__all__ = [
    "CheckpointError",
    "ConfigError",
    "MissingWeightsError",
    "WeightFiles",
    "WeightLoadError",
    "config_from_dict",
    "convert_state_dict",
    "flax_params_to_sdjax",
    "load_pipeline_components",
    "read_flax_msgpack",
    "read_safetensors",
    "resolve_model_dir",
    "select_weight_files",
]
