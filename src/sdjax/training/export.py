"""Write trained sdjax params as a real diffusers `StableDiffusionPipeline` folder.

The inverse of `sdjax.models.convert`: a Flax param path becomes the PyTorch state-dict key
(`down_blocks_0/resnets_1/conv1/kernel` -> `down_blocks.0.resnets.1.conv1.weight`) and the layout goes back
to PyTorch's (Dense `kernel (in, out)` -> `weight (out, in)`; Conv `kernel (H, W, I, O)` -> `weight (O, I, H, W)`;
norm `scale` and Embed `embedding` -> `weight`). Which `name_N` segments were list indices (`nn.ModuleList`
in PyTorch: `resnets.1`) and which are plain attribute names (`linear_1`, `conv_norm_out`) is not recoverable
from the path, so `LIST_ATTRIBUTES` names the ModuleLists of the diffusers and transformers classes sdjax
mirrors.

The folder holds `model_index.json`, `text_encoder/` (transformers `CLIPTextModel`: `config.json`,
`model.safetensors`), `tokenizer/` (CLIP `vocab.json`, `merges.txt`, `tokenizer_config.json`,
`special_tokens_map.json`), `unet/` and `vae/` (`config.json`, `diffusion_pytorch_model.safetensors`) and
`scheduler/scheduler_config.json`: what `diffusers.StableDiffusionPipeline.from_pretrained` and
`sdjax.StableDiffusionPipeline.from_pretrained` both read.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from sdjax.models.convert import (  # noqa: F401 (re-exported: the export's key and layout rules)
    LIST_ATTRIBUTES,
    ExportError,
    params_to_state_dict,
    path_to_torch_key,
)

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "embedded"
CLIP_VOCAB_DIR = Path(__file__).resolve().parents[1] / "assets" / "clip_tokenizer"

# The library versions whose file formats the folder follows (written into the configs, as the libraries do).
DIFFUSERS_VERSION = "0.42.1"
TRANSFORMERS_VERSION = "5.23.0"


def _config_dict(config: Any) -> dict[str, Any]:
    """A frozen config dataclass -> JSON-ready dict (tuples become lists)."""

    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_diffusers_model(folder: Path, class_name: str, config: Any, params: Mapping[str, Any]) -> None:
    """One diffusers model component: `config.json` + `diffusion_pytorch_model.safetensors`."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(
        folder / "config.json",
        {"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION, **_config_dict(config)},
    )
    save_file(
        params_to_state_dict(params), str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"}
    )


def save_clip_text_model(folder: Path, config: Any, params: Mapping[str, Any]) -> None:
    """A transformers `CLIPTextModel`: `config.json` + `model.safetensors` (keys `text_model.*`, as SD ships)."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(
        folder / "config.json",
        {
            "architectures": ["CLIPTextModel"],
            "model_type": "clip_text_model",
            "dtype": "float32",
            "transformers_version": TRANSFORMERS_VERSION,
            **_config_dict(config),
        },
    )
    save_file(params_to_state_dict(params), str(folder / "model.safetensors"), metadata={"format": "pt"})


def save_clip_tokenizer(folder: Path, model_max_length: int = 77) -> None:
    """CLIP's vocabulary and merges (the ones sdjax ships) with SD 1.x's special tokens (pads with EOS)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(CLIP_VOCAB_DIR / name, folder / name)
    specials = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    _write_json(folder / "special_tokens_map.json", specials)
    _write_json(
        folder / "tokenizer_config.json",
        {
            **specials,
            "tokenizer_class": "CLIPTokenizer",
            "model_max_length": model_max_length,
            "do_lower_case": True,
            "errors": "replace",
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": True,
        },
    )


def export_pipeline(
    out: str | Path,
    *,
    text_config: Any,
    unet_config: Any,
    vae_config: Any,
    scheduler_config: Mapping[str, Any],
    params: Mapping[str, Any],
) -> Path:
    """Write a complete `StableDiffusionPipeline` folder at `out` (replacing the components it writes).

    `params` holds `text_encoder`, `unet` and `vae` Flax params; `scheduler_config` is a diffusers
    `scheduler_config.json` dict with its `_class_name`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    missing = [k for k in ("text_encoder", "unet", "vae") if k not in params]
    if missing:
        raise ExportError(f"export_pipeline: params lack component(s) {missing}")
    if "_class_name" not in scheduler_config:
        raise ExportError("export_pipeline: scheduler_config needs its diffusers `_class_name`")
    save_clip_text_model(out / "text_encoder", text_config, params["text_encoder"])
    save_clip_tokenizer(out / "tokenizer", text_config.max_position_embeddings)
    save_diffusers_model(out / "unet", "UNet2DConditionModel", unet_config, params["unet"])
    save_diffusers_model(out / "vae", "AutoencoderKL", vae_config, params["vae"])
    _write_json(
        out / "scheduler" / "scheduler_config.json", {"_diffusers_version": DIFFUSERS_VERSION, **scheduler_config}
    )
    _write_json(
        out / "model_index.json",
        {
            "_class_name": "StableDiffusionPipeline",
            "_diffusers_version": DIFFUSERS_VERSION,
            "feature_extractor": [None, None],
            "image_encoder": [None, None],
            "requires_safety_checker": False,
            "safety_checker": [None, None],
            "scheduler": ["diffusers", scheduler_config["_class_name"]],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )
    return out
