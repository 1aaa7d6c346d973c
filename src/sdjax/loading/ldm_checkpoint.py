"""Original-layout (LDM) single-file checkpoints: opening one safely and telling what it holds.

`open_checkpoint` reads safetensors through `files.read_safetensors` (header checked against the file size first,
then one tensor per lookup) and refuses PyTorch pickles (`.ckpt`, `.pt`, `.pth`, `.bin`) unless
`allow_pickle=True`, then read by `safe_pickle.read_torch_checkpoint`, which can execute no code.
`infer_architecture` tells the pipeline from the keys and shapes alone (the rules of diffusers'
`infer_diffusers_model_type` restated on the text encoders the file holds), `component_layout` where each model's
keys are, `config_set_for` the embedded config set of an architecture and `prediction_hint` what the file says about
its prediction type. `single_file` turns the checkpoint into pipeline components.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.loading import files, ldm_keys, safe_pickle
from sdjax.loading.files import CheckpointError

# What `infer_architecture` returns.
ARCHITECTURES = ("sd1", "sd1-inpainting", "sd2", "sd2-inpainting", "sdxl-base", "sdxl-refiner", "sdxl-inpainting")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")
# The training step of Stability's `512-base-ema.ckpt`: diffusers' one rule for telling SD 2 base (epsilon) apart.
SD2_BASE_GLOBAL_STEP = 875000


class PickleRefusedError(CheckpointError):
    """A PyTorch pickle checkpoint offered without `allow_pickle=True`."""


class UnknownArchitectureError(ValueError):
    """A checkpoint whose keys do not describe a pipeline sdjax loads; the message lists the key families."""


# ---------------------------------------------------------------------------------------------------- reading


class Checkpoint(Mapping[str, np.ndarray]):
    """One single-file checkpoint: key -> numpy array (read on lookup), with `shape(key)` from the header alone.

    `format` is "safetensors" or "torch"; `metadata` the safetensors `__metadata__` (str -> str); `extras` the plain
    values stored beside a pickle's state dict (`global_step`, `epoch`).
    """

    def __init__(self, path: Path, tensors: Any, *, format: str, metadata: Mapping[str, str], extras: Mapping):
        self.path, self._tensors, self.format = path, tensors, format
        self.metadata, self.extras = dict(metadata), dict(extras)

    def __getitem__(self, key: str) -> np.ndarray:
        try:
            return self._tensors[key]
        except safe_pickle.PickleFormatError as e:
            raise CheckpointError(str(e)) from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors.shape(key))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: self.shape(k) for k in self._tensors}

    def close(self) -> None:
        """Release the open archive of a pickle checkpoint (safetensors readers hold no open file)."""
        if hasattr(self._tensors, "close"):
            self._tensors.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pickle_refusal(path: Path) -> str:
    return (
        f"{path}: is a PyTorch pickle checkpoint. Unpickling runs whatever code the file names, so sdjax does not "
        f"read pickles unless asked: pass allow_pickle=True to read it with sdjax's restricted unpickler (it only "
        f"rebuilds tensors and refuses anything else, so no code in the file can run), or convert it to safetensors "
        f"once where you trust it, e.g.\n"
        f"  python -c \"import torch, safetensors.torch as st; sd = torch.load('{path.name}', weights_only=True); "
        f"sd = sd.get('state_dict', sd); st.save_file({{k: v.contiguous().clone() for k, v in sd.items() "
        f"if isinstance(v, torch.Tensor)}}, '{path.with_suffix('.safetensors').name}')\""
    )


def open_checkpoint(path: str | os.PathLike, *, allow_pickle: bool = False) -> Checkpoint:
    """Open a single-file checkpoint lazily. safetensors always; a PyTorch zip pickle only with `allow_pickle`
    (else `PickleRefusedError` explaining why and how to convert). Truncated or corrupt files raise
    `CheckpointError` naming the file."""
    path = Path(os.fspath(path)).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; load diffusers folders with load_pipeline_components")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with path.open("rb") as f:
        head = f.read(9)
    # safetensors: an 8-byte little-endian header length, then the JSON header. Checked first: the length's low
    # byte may be 0x80, which is also how a raw pickle starts.
    looks_safetensors = (
        len(head) == 9 and head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= path.stat().st_size
    )
    pickled = head[:4] == b"PK\x03\x04" or head[:1] == b"\x80" or path.suffix.lower() in PICKLE_SUFFIXES
    if pickled and not looks_safetensors:
        if not allow_pickle:
            raise PickleRefusedError(_pickle_refusal(path))
        try:
            tensors = safe_pickle.read_torch_checkpoint(path)
        except safe_pickle.PickleFormatError as e:
            raise CheckpointError(str(e)) from e
        return Checkpoint(path, tensors, format="torch", metadata={}, extras=tensors.extras)
    reader = files.read_safetensors(path)
    return Checkpoint(path, reader, format="safetensors", metadata=reader.metadata.get(path.name, {}), extras={})


# ---------------------------------------------------------------------------------------------------- architecture


def key_families(keys: Any, limit: int = 12) -> str:
    """A short census of key prefixes (`model.diffusion_model (686), first_stage_model (248), ...`)."""
    counts: Counter[str] = Counter()
    for k in keys:
        parts = k.split(".")
        depth = 3 if parts[0] == "conditioner" else 2
        counts[".".join(parts[: min(depth, len(parts) - 1)]) or k] += 1
    shown = [f"{name} ({n})" for name, n in counts.most_common(limit)]
    more = len(counts) - limit
    return ", ".join(shown) + (f", ... {more} more" if more > 0 else "") if shown else "(no tensors)"


# Keys of families sdjax does not load, for a better error than "unknown".
_UNSUPPORTED_MARKERS = (
    ("control_model.", "a ControlNet"),
    ("edm_mean", "Playground v2.5"),
    ("depth_model.", "SD 2 depth-to-image"),
    ("model.diffusion_model.joint_blocks.", "SD 3"),
    ("model.diffusion_model.double_blocks.", "Flux"),
    ("lora_unet_", "a LoRA (kohya layout), not a full checkpoint"),
    ("lora_te_", "a LoRA (kohya layout), not a full checkpoint"),
)
_CROSS_ATTENTION_WIDTH = {768: "sd1", 1024: "sd2", 2048: "sdxl-base", 1280: "sdxl-refiner"}


def _has_prefix(keys: Any, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in keys)


def infer_architecture(shapes: Mapping[str, Any], *, source: str = "checkpoint") -> str:
    """The pipeline a `{key: shape}` mapping of an original-layout checkpoint describes, one of `ARCHITECTURES`.

    The text encoders decide the family (SD 1.x: OpenAI CLIP `cond_stage_model.transformer.`; SD 2.x: OpenCLIP
    `cond_stage_model.model.`; SDXL: `conditioner.embedders.1.model.`; SDXL refiner: OpenCLIP bigG alone as
    `conditioner.embedders.0.model.`); a file without one is told by its UNet's cross-attention width (768, 1024,
    2048, 1280), as diffusers does; a 9-channel `conv_in` makes it the inpainting variant. Anything else raises
    `UnknownArchitectureError` listing the key families found.
    """
    keys = list(shapes)
    for marker, name in _UNSUPPORTED_MARKERS:
        if _has_prefix(keys, marker):
            raise UnknownArchitectureError(
                f"{source}: looks like {name} (keys {marker}*), which sdjax does not load; key families: "
                f"{key_families(keys)}"
            )
    conv_in = ldm_keys.UNET_PREFIX + "input_blocks.0.0.weight"
    if conv_in not in shapes:
        hint = ""
        if _has_prefix(keys, "encoder.down.") or any(k.startswith(ldm_keys.VAE_PREFIXES) for k in keys):
            if not _has_prefix(keys, ldm_keys.UNET_PREFIX):
                hint = " It holds only a VAE: load it with load_vae or pass it as vae=."
        elif _has_prefix(keys, "down_blocks.") or _has_prefix(keys, "encoder.down_blocks."):
            hint = " Its keys are in the diffusers layout (one model of a diffusers folder), not a whole checkpoint."
        raise UnknownArchitectureError(
            f"{source}: not a Stable Diffusion checkpoint in the original layout (no UNet "
            f"{ldm_keys.UNET_PREFIX}input_blocks.*).{hint} Key families found: {key_families(keys)}"
        )
    if _has_prefix(keys, ldm_keys.SDXL_OPENCLIP_PREFIX):
        family = "sdxl-base"
    elif _has_prefix(keys, ldm_keys.REFINER_OPENCLIP_PREFIX):
        family = "sdxl-refiner"
    elif _has_prefix(keys, ldm_keys.SD2_OPENCLIP_PREFIX):
        family = "sd2"
    elif _has_prefix(keys, ldm_keys.SD1_CLIP_PREFIX):
        family = "sd1"
    else:
        widths = {
            tuple(shapes[k])[1]
            for k in keys
            if k.startswith(ldm_keys.UNET_PREFIX) and k.endswith(".attn2.to_k.weight") and len(shapes[k]) == 2
        }
        if len(widths) != 1 or next(iter(widths)) not in _CROSS_ATTENTION_WIDTH:
            raise UnknownArchitectureError(
                f"{source}: no known text encoder and UNet cross-attention width(s) {sorted(widths)} (SD 1.x 768, "
                f"SD 2.x 1024, SDXL 2048, SDXL refiner 1280); key families found: {key_families(keys)}"
            )
        family = _CROSS_ATTENTION_WIDTH[next(iter(widths))]
    channels = tuple(shapes[conv_in])[1]
    if channels == 4:
        return family
    if channels == 9 and family != "sdxl-refiner":
        return {"sd1": "sd1-inpainting", "sd2": "sd2-inpainting", "sdxl-base": "sdxl-inpainting"}[family]
    raise UnknownArchitectureError(
        f"{source}: a {family} UNet with {channels} input channels; sdjax loads 4 (text-to-image) and 9 "
        f"(inpainting, not for the SDXL refiner). 8 is InstructPix2Pix, 5 SD 2 depth, 7 the x4 upscaler."
    )


# The params key of the denoiser of every architecture here: a UNet, under `model.diffusion_model.`.
DENOISER = "unet"


def component_layout(architecture: str, keys: Any) -> dict[str, tuple[str, str]]:
    """Component name -> (`ldm_keys` kind, key prefix) for a checkpoint of `architecture`."""
    vae_prefix = next((p for p in ldm_keys.VAE_PREFIXES if _has_prefix(keys, p)), ldm_keys.VAE_PREFIXES[0])
    layout = {DENOISER: ("unet", ldm_keys.UNET_PREFIX), "vae": ("vae", vae_prefix)}
    if architecture.startswith("sd1"):
        layout["text_encoder"] = ("clip", ldm_keys.SD1_CLIP_PREFIX)
    elif architecture.startswith("sd2"):
        layout["text_encoder"] = ("openclip", ldm_keys.SD2_OPENCLIP_PREFIX)
    elif architecture == "sdxl-refiner":
        layout["text_encoder_2"] = ("openclip", ldm_keys.REFINER_OPENCLIP_PREFIX)
    else:
        layout["text_encoder"] = ("clip", ldm_keys.SDXL_CLIP_PREFIX)
        layout["text_encoder_2"] = ("openclip", ldm_keys.SDXL_OPENCLIP_PREFIX)
    return layout


def config_set_for(architecture: str, prediction_type: str | None = None) -> str:
    """The embedded config set of an architecture (SD 2.x: `sd21-base` for epsilon, `sd21` otherwise)."""
    if architecture == "sd2":
        return "sd21-base" if prediction_type == "epsilon" else "sd21"
    return {
        "sd1": "sd15",
        "sd1-inpainting": "sd15-inpainting",
        "sd2-inpainting": "sd2-inpainting",
        "sdxl-base": "sdxl-base",
        "sdxl-refiner": "sdxl-refiner",
        "sdxl-inpainting": "sdxl-inpainting",
    }[architecture]


_PREDICTION_NAMES = {"epsilon": "epsilon", "eps": "epsilon", "v": "v_prediction", "v_prediction": "v_prediction"}


def prediction_hint(ckpt: Checkpoint, architecture: str) -> tuple[str | None, str]:
    """What the file itself says about its prediction type -> (value or None, where it was found)."""
    md = ckpt.metadata
    declared = str(md.get("modelspec.prediction_type", "")).strip().lower()
    if declared in _PREDICTION_NAMES:
        return _PREDICTION_NAMES[declared], "metadata modelspec.prediction_type"
    arch = str(md.get("modelspec.architecture", ""))
    if arch.startswith("stable-diffusion-v2"):
        return ("v_prediction" if "768-v" in arch else "epsilon"), f"metadata modelspec.architecture={arch!r}"
    if "v_pred" in ckpt:
        return "v_prediction", "the v_pred marker tensor"
    if architecture == "sd2" and ckpt.extras.get("global_step") == SD2_BASE_GLOBAL_STEP:
        return "epsilon", f"global_step {SD2_BASE_GLOBAL_STEP} (Stability's 512-base-ema.ckpt)"
    return None, "default"


class _PrefixView(Mapping[str, np.ndarray]):
    def __init__(self, ckpt: Checkpoint, prefix: str):
        self._ckpt, self._prefix = ckpt, prefix
        self._keys = [k[len(prefix) :] for k in ckpt if k.startswith(prefix)]

    def __getitem__(self, key: str) -> np.ndarray:
        return self._ckpt[self._prefix + key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
