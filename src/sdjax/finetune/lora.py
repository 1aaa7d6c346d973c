"""Trainable LoRA (Hu et al. 2021) as a parameter delta on frozen sdjax params, and its files.

The LoRA is a pytree `{component: {"a/b/to_q/kernel": {"down": (r, in), "up": (out, r)}}}` in float32, the
PyTorch layout of PEFT's `lora_A.weight` / `lora_B.weight` (kohya's `lora_down` / `lora_up`). `merge` adds
`alpha / r * (up @ down).T` to each targeted Dense kernel `(in, out)` inside the traced loss, so the frozen base
params never change and one compiled step serves every run with the same ranks. With LoRA dropout, `branch` runs
PEFT's form instead (`W x + s * up(down(dropout(x)))`, by a flax method interceptor). Initialisation is PEFT's
default: `down` Kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), `up` zeros.

Targets mirror diffusers' `train_text_to_image_lora.py` (UNet attention `to_q`, `to_k`, `to_v`, `to_out.0`) and
`train_dreambooth_lora.py` for the text encoders (`q_proj`, `k_proj`, `v_proj`, `out_proj`).

Files: `kohya_state_dict` names layers with the key maps `loading.lora` reads (kohya's underscore spelling of the
diffusers module names for SD 1.x/2.x, the original SGM names from `loading.ldm_keys` for SDXL UNets, as
sd-scripts writes them), `peft_state_dict` writes diffusers' `pytorch_lora_weights.safetensors` layout with the
alpha in its `lora_adapter_metadata`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from sdjax.loading import ldm_keys
from sdjax.loading.lora import METADATA_KEY
from sdjax.models.convert import path_to_torch_key

UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out_0")
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
KOHYA_PREFIX = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}
KOHYA_PREFIX_XL = {**KOHYA_PREFIX, "text_encoder": "lora_te1_"}


class LoraConfigError(ValueError):
    """A LoRA setting that cannot train (rank 0, no targets, ...)."""


def target_paths(params: Mapping[str, Any], targets: Sequence[str]) -> list[tuple[str, ...]]:
    """The `kernel` paths of `params` whose module name is one of `targets`, sorted."""
    found = [p for p in flatten_dict(dict(params)) if p[-1] == "kernel" and len(p) > 1 and p[-2] in targets]
    return sorted(found)


def init_lora(
    key: jax.Array, params: Mapping[str, Mapping[str, Any]], targets: Mapping[str, Sequence[str]], rank: int
) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """A fresh LoRA over `targets` (`{component: module names}`) of `params` (`{component: tree}`), float32
    numpy; raises `LoraConfigError` for a rank below 1 or targets that match nothing."""
    if int(rank) != rank or rank < 1:
        raise LoraConfigError(f"LoRA rank must be a positive integer, got {rank!r}")
    lora: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for c_index, (component, names) in enumerate(sorted(targets.items())):
        paths = target_paths(params[component], names)
        if not paths:
            raise LoraConfigError(f"no layer named {list(names)} in {component}: nothing to train")
        flat = flatten_dict(dict(params[component]))
        lora[component] = {}
        for i, path in enumerate(paths):
            fan_in, fan_out = flat[path].shape
            bound = 1.0 / np.sqrt(fan_in)
            k = jax.random.fold_in(jax.random.fold_in(key, c_index), i)
            down = jax.random.uniform(k, (rank, fan_in), jnp.float32, -bound, bound)
            lora[component]["/".join(path)] = {
                "down": np.asarray(down),
                "up": np.zeros((fan_out, rank), np.float32),
            }
    return lora


def merge(params: Mapping[str, Any], lora_c: Mapping[str, Mapping[str, Any]], scale: float, dtype=None) -> dict:
    """One component's params with `scale * (up @ down).T` added to the LoRA's kernels (float32 sum, cast to
    `dtype` or the kernel's dtype); traceable, differentiable in `lora_c`."""
    flat = flatten_dict(dict(params))
    for name, ab in lora_c.items():
        path = tuple(name.split("/"))
        base = flat[path]
        delta = scale * jnp.matmul(ab["up"], ab["down"], precision=jax.lax.Precision.HIGHEST).T
        flat[path] = (base.astype(jnp.float32) + delta).astype(dtype or base.dtype)
    return unflatten_dict(flat)


def branch(lora_c: Mapping[str, Mapping[str, Any]], scale: float, rate: float = 0.0, key: jax.Array | None = None):
    """A context in which every Dense layer the LoRA adapts returns `W x + scale * up (down (dropout(x)))`, PEFT's
    formulation (a flax method interceptor; the layers are found by their module path). `rate` is LoRA dropout
    (inverted dropout on the branch's input, one draw per layer from `key`); with rate 0 it equals `merge`."""
    import flax.linen as nn

    index = {name: i for i, name in enumerate(sorted(lora_c))}

    def intercept(call, args, kwargs, context):
        y = call(*args, **kwargs)
        if context.method_name != "__call__" or not isinstance(context.module, nn.Dense):
            return y
        name = "/".join(context.module.path) + "/kernel"
        if name not in lora_c:
            return y
        x = args[0].astype(jnp.float32)
        if rate > 0:
            keep = jax.random.bernoulli(jax.random.fold_in(key, index[name]), 1.0 - rate, x.shape)
            x = jnp.where(keep, x / (1.0 - rate), 0.0)
        ab = lora_c[name]
        h = jnp.matmul(x, ab["down"].T, precision=jax.lax.Precision.HIGHEST)
        out = jnp.matmul(h, ab["up"].T, precision=jax.lax.Precision.HIGHEST)
        return y + (scale * out).astype(y.dtype)

    return nn.intercept_methods(intercept)


# ------------------------------------------------------------------------------------------------ files
def _kohya_module(component: str, path: tuple[str, ...], unet_config: Any) -> str:
    """sd-scripts' module name of a kernel path (without the component prefix)."""
    if component == "unet" and unet_config is not None and unet_config.addition_embed_type == "text_time":
        source = ldm_keys.unet_source(path_to_torch_key(path), unet_config)  # SDXL: the SGM names
        return source.key.removesuffix(".weight").replace(".", "_")
    return "_".join(path[:-1])


def kohya_state_dict(
    lora: Mapping[str, Mapping[str, Mapping[str, Any]]], alpha: float, unet_config: Any = None
) -> dict[str, np.ndarray]:
    """The LoRA as kohya / A1111 keys: `<prefix><module>.lora_down.weight` `(r, in)`, `.lora_up.weight`
    `(out, r)`, `.alpha` (a scalar), float32. SDXL (a UNet with `text_time` embedding) uses `lora_te1_` /
    `lora_te2_` and the SGM UNet names."""
    xl = unet_config is not None and unet_config.addition_embed_type == "text_time"
    prefixes = KOHYA_PREFIX_XL if xl else KOHYA_PREFIX
    out: dict[str, np.ndarray] = {}
    for component, layers in lora.items():
        for name, ab in layers.items():
            module = prefixes[component] + _kohya_module(component, tuple(name.split("/")), unet_config)
            out[f"{module}.lora_down.weight"] = np.ascontiguousarray(np.asarray(ab["down"], np.float32))
            out[f"{module}.lora_up.weight"] = np.ascontiguousarray(np.asarray(ab["up"], np.float32))
            out[f"{module}.alpha"] = np.asarray(alpha, np.float32)
    return out


def kohya_metadata(
    *, rank: int, alpha: float, base_model_version: str, comment: str = "", extra: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """The `ss_*` metadata sd-scripts writes (the part UIs read: network module, dim, alpha, base model)."""
    meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(int(rank)),
        "ss_network_alpha": f"{float(alpha):g}",
        "ss_base_model_version": base_model_version,
        "ss_training_comment": comment,
        "ss_sd_scripts_commit_hash": "",
        "sshs_model_hash": "",
        "modelspec.architecture": f"{base_model_version}/lora",
        "ss_training_by": "sdjax",
    }
    for k, v in (extra or {}).items():
        meta[k] = v if isinstance(v, str) else json.dumps(v)
    return meta


def peft_state_dict(
    lora: Mapping[str, Mapping[str, Mapping[str, Any]]], alpha: float, rank: int
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The LoRA as diffusers' `pytorch_lora_weights.safetensors`: `unet.<module>.lora_A.weight` / `lora_B.weight`
    (`text_encoder.`, `text_encoder_2.`), and the `lora_adapter_metadata` (r, lora_alpha, target modules)."""
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    for component, layers in lora.items():
        modules = set()
        for name, ab in layers.items():
            path = tuple(name.split("/"))
            module = path_to_torch_key(path).removesuffix(".weight")
            modules.add(module.rsplit(".", 1)[-1] if not module.endswith("to_out.0") else "to_out.0")
            tensors[f"{component}.{module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(ab["down"], np.float32))
            tensors[f"{component}.{module}.lora_B.weight"] = np.ascontiguousarray(np.asarray(ab["up"], np.float32))
        meta.update(
            {
                f"{component}.r": int(rank),
                f"{component}.lora_alpha": float(alpha),
                f"{component}.target_modules": sorted(modules),
                f"{component}.init_lora_weights": True,
                f"{component}.use_rslora": False,
                f"{component}.use_dora": False,
            }
        )
    return tensors, {METADATA_KEY: json.dumps(meta), "format": "pt"}


def save_safetensors(path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str], dtype=None) -> None:
    """`tensors` to `path`, the floating ones cast to `dtype` when given (`run.save_dtype`)."""
    from safetensors.numpy import save_file

    if dtype is not None:
        tensors = {
            k: np.ascontiguousarray(np.asarray(v).astype(dtype))
            if np.issubdtype(np.asarray(v).dtype, np.floating)
            else v
            for k, v in tensors.items()
        }
    save_file(dict(tensors), str(path), metadata=dict(metadata))


def base_model_version(unet_config: Any, prediction_type: str) -> str:
    """sd-scripts' `ss_base_model_version`: sd_v1, sd_v2 (768-v for v-prediction), sdxl_base_v1-0."""
    if unet_config.addition_embed_type == "text_time":
        return "sdxl_base_v1-0"
    if unet_config.cross_attention_dim == 1024 or unet_config.use_linear_projection:
        return "sd_v2_768_v" if prediction_type == "v_prediction" else "sd_v2"
    return "sd_v1"
