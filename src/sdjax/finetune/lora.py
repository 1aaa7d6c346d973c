"""Trainable LoRA (Hu et al. 2021) as a parameter delta on frozen sdjax params, and its files.

The LoRA is a pytree `{component: {"a/b/to_q/kernel": {"down": (r, in), "up": (out, r)}}}` in float32, the
PyTorch layout of PEFT's `lora_A.weight` / `lora_B.weight` (kohya's `lora_down` / `lora_up`). A convolution's entry
(Flax kernel `(kh, kw, in, out)`) holds `down` `(r, in, kh, kw)` (a conv of the layer's own kernel size) and `up`
`(out, r, 1, 1)` (a 1x1 conv), kohya's "LoCon" shapes. `merge` adds `alpha / r * (up @ down)` (in the kernel's Flax
layout) to each targeted kernel inside the traced loss, so the frozen base params never change and one compiled step
serves every run with the same ranks. With LoRA dropout, `branch` runs PEFT's form instead
(`W x + s * up(down(dropout(x)))`, by a flax method interceptor). Initialisation is PEFT's default (kohya's too):
`down` Kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in * kh * kw), `up` zeros.

Targets mirror diffusers' `train_text_to_image_lora.py` (UNet attention `to_q`, `to_k`, `to_v`, `to_out.0`) and
`train_dreambooth_lora.py` for the text encoders (`q_proj`, `k_proj`, `v_proj`, `out_proj`). With a conv rank
(kohya's `conv_dim`, "LoCon" / "LoRA-C3Lier") the UNet's ResNet blocks, downsamplers and upsamplers are adapted too,
by sd-scripts' rule (`networks/lora.py`: with `conv_dim` it adds the module classes `ResnetBlock2D`, `Downsample2D`,
`Upsample2D` to the searched ones and adapts every Linear and Conv2d inside them): their 3x3 convolutions (`conv1`,
`conv2`, the samplers' `conv`) at the conv rank and alpha, their Linear `time_emb_proj` and 1x1 `conv_shortcut` at
the linear rank and alpha; `conv_in`, `conv_out`, the time embedding and the transformers' 1x1 `proj_in` /
`proj_out` are outside those modules and stay frozen (`conv_paths`).

Files: `kohya_state_dict` names layers with the key maps `loading.lora` reads (kohya's underscore spelling of the
diffusers module names for SD 1.x/2.x, the original SGM names from `loading.ldm_keys` for SDXL UNets, as
sd-scripts writes them), `peft_state_dict` writes diffusers' `pytorch_lora_weights.safetensors` layout with the
alpha (and the conv layers' rank and alpha as `rank_pattern` / `alpha_pattern`) in its `lora_adapter_metadata`.
"""

from __future__ import annotations

import json
import re
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
# The Flax modules of the UNet classes sd-scripts adapts with `conv_dim` (ResnetBlock2D, Downsample2D, Upsample2D),
# by their names in the params tree: `resnets_0`, `downsamplers_0`, `upsamplers_0` under a block (`conv_paths`).
CONV_MODULES = re.compile(r"(resnets|downsamplers|upsamplers)_\d+")
# kohya's conv_alpha when conv_dim is given without it (sd-scripts' networks/lora.py `create_network`).
KOHYA_CONV_ALPHA = 1.0


class LoraConfigError(ValueError):
    """A LoRA setting that cannot train (rank 0, no targets, ...)."""


def target_paths(params: Mapping[str, Any], targets: Sequence[str]) -> list[tuple[str, ...]]:
    """The `kernel` paths of `params` whose module name is one of `targets`, sorted."""
    found = [p for p in flatten_dict(dict(params)) if p[-1] == "kernel" and len(p) > 1 and p[-2] in targets]
    return sorted(found)


def conv_paths(unet_params: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The kernel paths kohya's `conv_dim` adds (module docstring): every Dense and Conv kernel directly inside a
    `resnets_N`, `downsamplers_N` or `upsamplers_N` module of the UNet, sorted."""
    found = [
        p for p in flatten_dict(dict(unet_params)) if p[-1] == "kernel" and len(p) > 2 and CONV_MODULES.fullmatch(p[-3])
    ]
    return sorted(found)


def _is_spatial(ab: Mapping[str, Any]) -> bool:
    """A LoRA entry of a convolution wider than 1x1 (`down` `(r, in, kh, kw)` with kh * kw > 1)."""
    shape = tuple(np.shape(ab["down"]))
    return len(shape) == 4 and shape[2:] != (1, 1)


def _layer_scale(ab: Mapping[str, Any], scale: float, conv_scale: float | None) -> float:
    return conv_scale if conv_scale is not None and _is_spatial(ab) else scale


def init_lora(
    key: jax.Array,
    params: Mapping[str, Mapping[str, Any]],
    targets: Mapping[str, Sequence[str]],
    rank: int,
    conv_rank: int | None = None,
) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """A fresh LoRA over `targets` (`{component: module names}`) of `params` (`{component: tree}`), float32
    numpy; with `conv_rank` the UNet's ResNet blocks and samplers too (`conv_paths`: convolutions wider than 1x1 at
    `conv_rank`, the rest at `rank`). Raises `LoraConfigError` for a rank below 1 or targets that match nothing."""
    for what, r in (("rank", rank), ("conv rank", conv_rank)):
        if r is not None and (isinstance(r, bool) or int(r) != r or r < 1):
            raise LoraConfigError(f"LoRA {what} must be a positive integer, got {r!r}")
    lora: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for c_index, (component, names) in enumerate(sorted(targets.items())):
        paths = target_paths(params[component], names)
        if conv_rank is not None and component == "unet":
            paths = sorted(set(paths) | set(conv_paths(params[component])))
        if not paths:
            raise LoraConfigError(f"no layer named {list(names)} in {component}: nothing to train")
        flat = flatten_dict(dict(params[component]))
        lora[component] = {}
        for i, path in enumerate(paths):
            shape = flat[path].shape
            k = jax.random.fold_in(jax.random.fold_in(key, c_index), i)
            if len(shape) == 2:  # Dense (in, out)
                fan_in, fan_out = shape
                r = rank
                down_shape, up_shape = (r, fan_in), (fan_out, r)
            else:  # Conv (kh, kw, in, out): a conv of the same kernel size down, a 1x1 conv up
                kh, kw, cin, fan_out = shape
                fan_in = cin * kh * kw
                r = conv_rank if conv_rank is not None and (kh, kw) != (1, 1) else rank
                down_shape, up_shape = (r, cin, kh, kw), (fan_out, r, 1, 1)
            bound = 1.0 / np.sqrt(fan_in)
            down = jax.random.uniform(k, down_shape, jnp.float32, -bound, bound)
            lora[component]["/".join(path)] = {"down": np.asarray(down), "up": np.zeros(up_shape, np.float32)}
    return lora


def delta(ab: Mapping[str, Any], kernel_shape: Sequence[int]):
    """`up @ down` of one LoRA entry in the Flax layout of its kernel (Dense `(in, out)`, Conv `(kh, kw, in, out)`),
    float32 at full matmul precision; traceable."""
    up, down = ab["up"], ab["down"]
    r = down.shape[0]
    w = jnp.matmul(up.reshape(up.shape[0], r), down.reshape(r, -1), precision=jax.lax.Precision.HIGHEST)
    if len(kernel_shape) == 2:
        return w.T
    kh, kw, cin, cout = kernel_shape
    return w.reshape(cout, cin, kh, kw).transpose(2, 3, 1, 0)


def merge(
    params: Mapping[str, Any],
    lora_c: Mapping[str, Mapping[str, Any]],
    scale: float,
    dtype=None,
    conv_scale: float | None = None,
) -> dict:
    """One component's params with `scale * up @ down` (`delta`, in the kernel's layout) added to the LoRA's
    kernels (float32 sum, cast to `dtype` or the kernel's dtype); a convolution wider than 1x1 takes `conv_scale`
    (its conv_alpha / conv_rank) when given. Traceable, differentiable in `lora_c`."""
    flat = flatten_dict(dict(params))
    for name, ab in lora_c.items():
        path = tuple(name.split("/"))
        base = flat[path]
        d = _layer_scale(ab, scale, conv_scale) * delta(ab, base.shape)
        flat[path] = (base.astype(jnp.float32) + d).astype(dtype or base.dtype)
    return unflatten_dict(flat)


def branch(
    lora_c: Mapping[str, Mapping[str, Any]],
    scale: float,
    rate: float = 0.0,
    key: jax.Array | None = None,
    conv_scale: float | None = None,
):
    """A context in which every Dense and Conv layer the LoRA adapts returns `W x + scale * up (down (dropout(x)))`,
    PEFT's formulation (a flax method interceptor; the layers are found by their module path). For a convolution,
    `down` is a conv of the layer's kernel size, strides and padding and `up` a 1x1 conv, on the layer's input as
    PyTorch's layer sees it (an upsampler's after the 2x nearest upsampling its conv does inside, `ops.conv.Conv`);
    a convolution wider than 1x1 takes `conv_scale` when given. `rate` is LoRA dropout (inverted dropout on the
    branch's input, one draw per layer from `key`); with rate 0 it equals `merge`."""
    import flax.linen as nn

    from sdjax.ops import conv as ops_conv

    index = {name: i for i, name in enumerate(sorted(lora_c))}

    def intercept(call, args, kwargs, context):
        y = call(*args, **kwargs)
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, nn.Dense | ops_conv.Conv):
            return y
        name = "/".join(module.path) + "/kernel"
        if name not in lora_c:
            return y
        x = args[0].astype(jnp.float32)
        if getattr(module, "upsample2x", False):
            x = ops_conv.upsample2x_nearest(x)
        if rate > 0:
            keep = jax.random.bernoulli(jax.random.fold_in(key, index[name]), 1.0 - rate, x.shape)
            x = jnp.where(keep, x / (1.0 - rate), 0.0)
        ab = lora_c[name]
        r = ab["down"].shape[0]
        if isinstance(module, nn.Dense):
            h = jnp.matmul(x, ab["down"].T, precision=jax.lax.Precision.HIGHEST)
        else:  # NHWC input, the down conv's kernel in HWIO
            h = jax.lax.conv_general_dilated(
                x,
                ab["down"].transpose(2, 3, 1, 0),
                tuple(module.strides),
                tuple(tuple(p) for p in module.padding),
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
                precision=jax.lax.Precision.HIGHEST,
            )
        out = jnp.matmul(h, ab["up"].reshape(-1, r).T, precision=jax.lax.Precision.HIGHEST)
        return y + (_layer_scale(ab, scale, conv_scale) * out).astype(y.dtype)

    return nn.intercept_methods(intercept)


# ------------------------------------------------------------------------------------------------ files
def _kohya_module(component: str, path: tuple[str, ...], unet_config: Any) -> str:
    """sd-scripts' module name of a kernel path (without the component prefix)."""
    if component == "unet" and unet_config is not None and unet_config.addition_embed_type == "text_time":
        source = ldm_keys.unet_source(path_to_torch_key(path), unet_config)  # SDXL: the SGM names
        return source.key.removesuffix(".weight").replace(".", "_")
    return "_".join(path[:-1])


def kohya_state_dict(
    lora: Mapping[str, Mapping[str, Mapping[str, Any]]],
    alpha: float,
    unet_config: Any = None,
    conv_alpha: float | None = None,
) -> dict[str, np.ndarray]:
    """The LoRA as kohya / A1111 keys: `<prefix><module>.lora_down.weight` `(r, in)` (a conv's `(r, in, kh, kw)`),
    `.lora_up.weight` `(out, r)` (a conv's `(out, r, 1, 1)`), `.alpha` (a scalar: `conv_alpha` for convolutions
    wider than 1x1 when given, else `alpha`), float32. SDXL (a UNet with `text_time` embedding) uses `lora_te1_` /
    `lora_te2_` and the SGM UNet names."""
    xl = unet_config is not None and unet_config.addition_embed_type == "text_time"
    prefixes = KOHYA_PREFIX_XL if xl else KOHYA_PREFIX
    out: dict[str, np.ndarray] = {}
    for component, layers in lora.items():
        for name, ab in layers.items():
            module = prefixes[component] + _kohya_module(component, tuple(name.split("/")), unet_config)
            out[f"{module}.lora_down.weight"] = np.ascontiguousarray(np.asarray(ab["down"], np.float32))
            out[f"{module}.lora_up.weight"] = np.ascontiguousarray(np.asarray(ab["up"], np.float32))
            a = conv_alpha if conv_alpha is not None and _is_spatial(ab) else alpha
            out[f"{module}.alpha"] = np.asarray(a, np.float32)
    return out


def kohya_metadata(
    *,
    rank: int,
    alpha: float,
    base_model_version: str,
    comment: str = "",
    extra: Mapping[str, Any] | None = None,
    conv_rank: int | None = None,
    conv_alpha: float | None = None,
) -> dict[str, str]:
    """The `ss_*` metadata sd-scripts writes (the part UIs read: network module, dim, alpha, base model); with
    `conv_rank`, `ss_network_args` as sd-scripts records `--network_args conv_dim=R conv_alpha=A` (a JSON object of
    the arguments' strings; `conv_alpha` None: `alpha`)."""
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
    if conv_rank is not None:
        alpha_c = alpha if conv_alpha is None else conv_alpha
        meta["ss_network_args"] = json.dumps({"conv_dim": str(int(conv_rank)), "conv_alpha": f"{float(alpha_c):g}"})
    for k, v in (extra or {}).items():
        meta[k] = v if isinstance(v, str) else json.dumps(v)
    return meta


def peft_state_dict(
    lora: Mapping[str, Mapping[str, Mapping[str, Any]]],
    alpha: float,
    rank: int,
    conv_rank: int | None = None,
    conv_alpha: float | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The LoRA as diffusers' `pytorch_lora_weights.safetensors`: `unet.<module>.lora_A.weight` / `lora_B.weight`
    (`text_encoder.`, `text_encoder_2.`; a conv's `(r, in, kh, kw)` / `(out, r, 1, 1)`, PEFT's conv layout), and
    the `lora_adapter_metadata` (r, lora_alpha, target modules): the attention layers by their module names
    (`to_q`, ...), the ResNet and sampler layers by their full paths (a sampler's is plain `conv`), and with
    `conv_rank` the convolutions wider than 1x1 in `rank_pattern` / `alpha_pattern` (`conv_alpha`; None: `alpha`),
    which `LoraConfig(**metadata)` in diffusers' `load_lora_weights` rebuilds them with."""
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    alpha_c = float(alpha if conv_alpha is None else conv_alpha)
    for component, layers in lora.items():
        modules = set()
        rank_pattern: dict[str, int] = {}
        alpha_pattern: dict[str, float] = {}
        for name, ab in layers.items():
            path = tuple(name.split("/"))
            module = path_to_torch_key(path).removesuffix(".weight")
            if component == "unet" and CONV_MODULES.fullmatch(path[-3] if len(path) > 2 else ""):
                modules.add(module)
                if conv_rank is not None and _is_spatial(ab):
                    rank_pattern[module], alpha_pattern[module] = int(conv_rank), alpha_c
            else:
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
        if rank_pattern:
            meta[f"{component}.rank_pattern"] = rank_pattern
            meta[f"{component}.alpha_pattern"] = alpha_pattern
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
