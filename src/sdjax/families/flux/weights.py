"""Flux.1 weights as people have them: single files in Black Forest Labs' layout, float8 files, GGUF files, and
the separate text-encoder files, loaded into sdjax's models (diffusers `FluxTransformer2DModel.from_single_file`,
its GGUF quantizer, and transformers' text encoders, without torch).

**The BFL layout** (`flux1-dev.safetensors`, `flux1-schnell.safetensors`, fine-tunes and merges; ComfyUI files
prefix the keys with `model.diffusion_model.` and may hold the VAE and text encoders beside them). Its modules map
to diffusers' by one table (`bfl_module_targets`), the rules of diffusers' `convert_flux_transformer_checkpoint_to_
diffusers`: the fused `img_attn.qkv` / `txt_attn.qkv` split in three equal row blocks (`to_q/k/v`,
`add_q/k/v_proj`); a single block's `linear1` in `(inner, inner, inner, rest)` rows (`to_q/k/v`, `proj_mlp`);
`final_layer.adaLN_modulation.1` with its two row halves swapped (BFL splits it into (shift, scale), diffusers'
`AdaLayerNormContinuous` into (scale, shift)); norm `.scale` -> `.weight`. The same table turns BFL-named LoRAs into
diffusers targets (`families.flux.lora`). `flux_transformer_state_dict` is lazy: each diffusers tensor is cut from
its source tensor when looked up, so a 12e9-parameter file converts with about one copy in host memory.

**Architecture from the tensors** (`flux_config_from_shapes`): depth from the block indices, width from `img_in`,
head size from the q norm, text and pooled widths, `guidance_embeds` from `guidance_in` (dev) -- the released
FLUX.1 dev / schnell configs (`FLUX_DEV`, `FLUX_SCHNELL`) give what tensors cannot tell (the rotary axes). A
`config=` that disagrees with the tensors fails naming the field.

**float8** (`flux1-dev-fp8.safetensors`, `t5xxl_fp8_e4m3fn.safetensors`: safetensors `F8_E4M3`/`F8_E5M2`): by
default every float8 tensor is upcast to `dtype` (exact: bfloat16, float16 and float32 hold every e4m3fn/e5m2
value). ComfyUI's scaled files (`*_scaled.safetensors`: a `scaled_fp8` marker, a `<layer>.scale_weight` beside each
float8 weight) are dequantized as ComfyUI does, `weight * scale_weight`, in float32 before the rounding to
`dtype`; their `scale_input` (activation scales for float8 matmuls) is not used. `keep_fp8=True` keeps the float8
tensors float8 in the params (1 byte per weight on the device instead of 2 or 4); the other tensors (biases,
norms, often the embeddings) take `dtype`. Computation is unchanged: every `nn.Dense` / `nn.Embed` of the models
casts its kernel to the compute dtype when it is used (`flax.linen.dtypes.promote_dtype`), inside the jitted
program, so XLA converts one layer's weights at a time into a temporary buffer and the results equal those of the
upcast params (tests/families/test_flux_weights.py measures both). Scaled files cannot be kept in float8 (the
modules have no per-layer scale) and are refused with `keep_fp8=True`; so is a LoRA on float8 kernels
(`families.flux.lora`). ComfyUI's newer mixed-precision files (`comfy_quant`, `weight_scale`) are refused by name.

**GGUF** (city96's `flux1-dev-Q8_0.gguf`, ...: BFL key names, or diffusers names; tensors F32 / F16 / BF16 or
quantized): read with the `gguf` package's `GGUFReader` (memory-mapped) and dequantized one tensor at a time with
`gguf.quants.dequantize` (ggml's reference arithmetic, float32), then rounded to `dtype`. The quantization types
read are `GGUF_TYPES`; any other is refused with its name. A file whose `general.architecture` is not `flux` is
refused naming it. diffusers' CPU path (`dequantize_gguf_tensor`) multiplies in float16, so its weights are these
rounded to float16 (at most one float16 rounding away; the tests measure it).

**Text encoders** (`t5xxl_fp16.safetensors`, `t5xxl_fp8_e4m3fn[_scaled].safetensors`, `clip_l.safetensors`, or the
`text_encoders.t5xxl.transformer.` / `text_encoders.clip_l.transformer.` parts of a ComfyUI checkpoint):
transformers' key names, converted by `models.t5.convert_t5_encoder` and `models.clip.convert_clip_text`; configs
T5 v1.1 XXL (`T5_XXL`) and CLIP ViT-L/14's text model (the `sd15` config set's `text_encoder/config.json`, the same
model FLUX.1 uses), unless `config=` says otherwise.

A file of the wrong kind fails naming the file and what it looks like (`describe_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.config import ConfigError, read_json
from sdjax.loading import files
from sdjax.loading.components import make_cast
from sdjax.loading.files import CheckpointError
from sdjax.loading.single_file import key_families
from sdjax.models import clip as clip_model
from sdjax.models import flux as flux_model
from sdjax.models import t5 as t5_model
from sdjax.models.flux import FluxTransformerConfig
from sdjax.precision import resolve_dtype
from sdjax.quant.loading import convert_quantized

# black-forest-labs/FLUX.1-dev and FLUX.1-schnell `transformer/config.json` (they differ in guidance_embeds only).
FLUX_DEV = FluxTransformerConfig(guidance_embeds=True)
FLUX_SCHNELL = FluxTransformerConfig(guidance_embeds=False)
# google/t5-v1_1-xxl, as FLUX.1-dev's `text_encoder_2/config.json` holds it (encoder keys).
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    dense_act_fn="gelu_new",
    is_gated_act=True,
)
# openai/clip-vit-large-patch14's text model: SD 1.x's text encoder is the same model as FLUX.1's `text_encoder`.
CLIP_L_CONFIG = Path(__file__).resolve().parents[2] / "assets" / "configs" / "sd15" / "text_encoder" / "config.json"

TRANSFORMER_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
T5_PREFIX = "text_encoders.t5xxl.transformer."  # ComfyUI checkpoints that bundle the text encoders
CLIP_L_PREFIX = "text_encoders.clip_l.transformer."
# GGUF tensor types read (F32/F16/BF16 and the quantizations of city96's Flux files and diffusers' GGUF loader),
# each dequantized by `gguf.quants.dequantize`.
GGUF_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q5_1",
    "Q5_0",
    "Q4_1",
    "Q4_0",
    "Q6_K",
    "Q5_K",
    "Q4_K",
    "Q3_K",
    "Q2_K",
    "IQ4_NL",
    "IQ4_XS",
)


class FluxWeightsError(ValueError):
    """A weight file that is not what the loader was asked for (names the file and what it looks like)."""


# ---------------------------------------------------------------------------------------------- lazy tensor views
class TensorView(Mapping[str, np.ndarray]):
    """key -> array computed from a source when looked up (nothing cached); `shape(key)` without reading data."""

    def __init__(self, entries: Mapping[str, tuple[Callable[[], np.ndarray], tuple[int, ...]]]):
        self._entries = dict(entries)

    def __getitem__(self, key: str) -> np.ndarray:
        return self._entries[key][0]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]


def tensor_shape(tensors: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """The shape of `tensors[key]`, from the header when the mapping can tell it (safetensors, GGUF, views)."""
    shape = getattr(tensors, "shape", None)
    return tuple(int(d) for d in (shape(key) if callable(shape) else np.shape(tensors[key])))


def _passthrough(tensors: Mapping[str, Any], key: str) -> tuple[Callable[[], np.ndarray], tuple[int, ...]]:
    return (lambda: tensors[key]), tensor_shape(tensors, key)


def prefix_view(tensors: Mapping[str, Any], prefix: str) -> TensorView:
    """The keys under `prefix`, without it."""
    return TensorView({k[len(prefix) :]: _passthrough(tensors, k) for k in tensors if k.startswith(prefix)})


def _without(tensors: Mapping[str, Any], drop: Callable[[str], bool]) -> TensorView:
    return TensorView({k: _passthrough(tensors, k) for k in tensors if not drop(k)})


# ---------------------------------------------------------------------------------------------- what a file is
_LOOKS_LIKE = (  # (a key that starts or contains this, what the file then is), first match wins
    ("distilled_guidance_layer.", "Chroma (a Flux derivative with its own modulation; not Flux.1)"),
    ("joint_blocks.", "Stable Diffusion 3 (MMDiT joint_blocks.*)"),
    ("double_blocks.", "a Flux.1 transformer (Black Forest Labs layout)"),
    ("single_transformer_blocks.", "a Flux.1 transformer (diffusers layout)"),
    ("model.diffusion_model.input_blocks.", "a Stable Diffusion 1.x/2.x/XL checkpoint (LDM UNet input_blocks.*)"),
    ("conditioner.embedders.", "a Stable Diffusion XL checkpoint"),
    ("cond_stage_model.", "a Stable Diffusion 1.x/2.x checkpoint"),
    ("lora_unet_", "a LoRA (kohya layout)"),
    ("lora_te", "a LoRA (kohya layout)"),
    (".lora_A.", "a LoRA (PEFT layout)"),
    (".lora_down.", "a LoRA"),
    ("encoder.block.0.layer.0.SelfAttention.", "a T5 encoder"),
    ("text_model.encoder.layers.", "a CLIP text encoder"),
    ("encoder.layers.0.self_attn.", "a CLIP text encoder"),
    ("transformer.resblocks.", "an OpenCLIP text encoder"),
    ("encoder.down.", "a VAE (original layout)"),
    ("decoder.up.", "a VAE (original layout)"),
    ("encoder.down_blocks.", "a VAE (diffusers layout)"),
    ("down_blocks.", "a diffusers UNet"),
)


def describe_checkpoint(keys: Iterable[str]) -> str:
    """What a file's keys look like, for error messages: "a T5 encoder", "a Stable Diffusion XL checkpoint", ..."""
    keys = list(keys)
    for marker, what in _LOOKS_LIKE:
        # ".x." markers match anywhere in a key; the others at its start or after a prefix (`model.`, ...)
        if any(marker in k if marker[0] == "." else k.startswith(marker) or f".{marker}" in k for k in keys):
            return f"{what}; key families: {key_families(keys)}"
    return f"nothing sdjax knows; key families: {key_families(keys)}"


def _transformer_part(tensors: Mapping[str, Any]) -> Mapping[str, Any]:
    """The transformer's keys of a file: those under ComfyUI's `model.diffusion_model.` when present (the VAE and
    text encoders beside them are other components), else all."""
    for prefix in TRANSFORMER_PREFIXES:
        if any(k.startswith(prefix) for k in tensors):
            return prefix_view(tensors, prefix)
    return tensors


def _layout(keys: Iterable[str]) -> str | None:
    """ "bfl", "diffusers" or None, from a transformer's keys (prefix removed)."""
    keys = set(keys)
    if any(k.startswith("distilled_guidance_layer.") for k in keys):
        return None  # Chroma
    if any(k.startswith("double_blocks.") for k in keys) and any(k.startswith("single_blocks.") for k in keys):
        return "bfl" if "img_in.weight" in keys else None
    if any(k.startswith("transformer_blocks.") for k in keys) and "x_embedder.weight" in keys:
        return "diffusers"
    return None


def detect_flux(keys: Iterable[str]) -> str | None:
    """ "dev" (guidance embedding present), "schnell" (none), or None when the keys are no Flux.1 transformer; BFL
    or diffusers key names, with or without ComfyUI's `model.diffusion_model.` prefix."""
    keys = list(keys)
    for prefix in TRANSFORMER_PREFIXES:
        if any(k.startswith(prefix) for k in keys):
            keys = [k[len(prefix) :] for k in keys if k.startswith(prefix)]
            break
    layout = _layout(keys)
    if layout is None:
        return None
    marker = "guidance_in." if layout == "bfl" else "time_text_embed.guidance_embedder."
    return "dev" if any(k.startswith(marker) for k in keys) else "schnell"


def safetensors_keys(path: str | Path) -> list[str] | None:
    """The tensor names of a safetensors file (its header only), or None when it is no readable safetensors file
    (the loader that reads it then says why)."""
    if not str(path).endswith(".safetensors"):
        return None
    try:
        infos, _ = files.read_safetensors_header(path)
    except (OSError, ValueError):
        return None
    return list(infos)


def is_flux_file(path: str) -> bool:
    """Whether a file holds a Flux.1 transformer: a `.gguf`, or safetensors whose keys say so (`detect_flux`)."""
    if str(path).endswith(".gguf"):
        return True
    keys = safetensors_keys(path)
    return keys is not None and detect_flux(keys) is not None


# ---------------------------------------------------------------------------------------------- the BFL table
# A target's rows of its source tensor: "all"; ("third", i): the i-th of three equal blocks (fused qkv);
# ("linear1", i): q, k, v (`inner` rows each), then the MLP (the rest); "swap": the two halves exchanged.
Rows = Any


def _split(names: tuple[str, ...], kind: str) -> tuple[tuple[str, Rows], ...]:
    return tuple((n, (kind, i)) for i, n in enumerate(names))


_DOUBLE = {  # double_blocks.{i}.<key> -> transformer_blocks.{i}.<target>
    "img_attn.qkv": _split(("attn.to_q", "attn.to_k", "attn.to_v"), "third"),
    "txt_attn.qkv": _split(("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "third"),
    "img_attn.proj": (("attn.to_out.0", "all"),),
    "txt_attn.proj": (("attn.to_add_out", "all"),),
    "img_attn.norm.query_norm": (("attn.norm_q", "all"),),
    "img_attn.norm.key_norm": (("attn.norm_k", "all"),),
    "txt_attn.norm.query_norm": (("attn.norm_added_q", "all"),),
    "txt_attn.norm.key_norm": (("attn.norm_added_k", "all"),),
    "img_mlp.0": (("ff.net.0.proj", "all"),),
    "img_mlp.2": (("ff.net.2", "all"),),
    "txt_mlp.0": (("ff_context.net.0.proj", "all"),),
    "txt_mlp.2": (("ff_context.net.2", "all"),),
    "img_mod.lin": (("norm1.linear", "all"),),
    "txt_mod.lin": (("norm1_context.linear", "all"),),
}
_SINGLE = {  # single_blocks.{i}.<key> -> single_transformer_blocks.{i}.<target>
    "linear1": _split(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "linear1"),
    "linear2": (("proj_out", "all"),),
    "modulation.lin": (("norm.linear", "all"),),
    "norm.query_norm": (("attn.norm_q", "all"),),
    "norm.key_norm": (("attn.norm_k", "all"),),
}
_TOP = {
    "img_in": (("x_embedder", "all"),),
    "txt_in": (("context_embedder", "all"),),
    "time_in.in_layer": (("time_text_embed.timestep_embedder.linear_1", "all"),),
    "time_in.out_layer": (("time_text_embed.timestep_embedder.linear_2", "all"),),
    "vector_in.in_layer": (("time_text_embed.text_embedder.linear_1", "all"),),
    "vector_in.out_layer": (("time_text_embed.text_embedder.linear_2", "all"),),
    "guidance_in.in_layer": (("time_text_embed.guidance_embedder.linear_1", "all"),),
    "guidance_in.out_layer": (("time_text_embed.guidance_embedder.linear_2", "all"),),
    "final_layer.linear": (("proj_out", "all"),),
    "final_layer.adaLN_modulation.1": (("norm_out.linear", "swap"),),
}
_BLOCK = re.compile(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$")


def bfl_module_targets(module: str) -> tuple[tuple[str, Rows], ...] | None:
    """A BFL module name (`double_blocks.3.img_attn.qkv`) -> its diffusers modules and the rows of the BFL tensor
    each takes (`(("transformer_blocks.3.attn.to_q", ("third", 0)), ...)`); None for a name outside the table."""
    m = _BLOCK.match(module)
    if m is None:
        return _TOP.get(module)
    kind, index, rest = m.groups()
    table, block = (
        (_DOUBLE, "transformer_blocks") if kind == "double_blocks" else (_SINGLE, "single_transformer_blocks")
    )
    targets = table.get(rest)
    return None if targets is None else tuple((f"{block}.{index}.{name}", rows) for name, rows in targets)


def bfl_module_names(num_layers: int, num_single_layers: int) -> list[str]:
    """Every BFL module name of a transformer of this depth that the table maps (`img_in`,
    `double_blocks.0.img_attn.qkv`, `single_blocks.3.linear1`, `final_layer.adaLN_modulation.1`, ...)."""
    double = [f"double_blocks.{i}.{k}" for i in range(num_layers) for k in _DOUBLE]
    single = [f"single_blocks.{i}.{k}" for i in range(num_single_layers) for k in _SINGLE]
    return [*_TOP, *double, *single]


def row_ranges(rows: Rows, n: int, inner: int) -> tuple[tuple[int, int], ...]:
    """The `[start, stop)` row ranges (concatenated in order) a target takes from a source of `n` rows."""
    if rows == "all":
        return ((0, n),)
    if rows == "swap":
        if n % 2:
            raise ValueError(f"an adaLN modulation of {n} rows cannot be split into (shift, scale)")
        return ((n // 2, n), (0, n // 2))
    kind, i = rows
    if kind == "third":
        if n % 3:
            raise ValueError(f"a fused qkv of {n} rows is not three equal parts")
        return ((i * n // 3, (i + 1) * n // 3),)
    if n <= 3 * inner:
        raise ValueError(f"a single block's linear1 of {n} rows has no MLP part after q, k, v of {inner} rows each")
    return ((i * inner, (i + 1) * inner),) if i < 3 else ((3 * inner, n),)


def take_rows(x: np.ndarray, ranges: tuple[tuple[int, int], ...]) -> np.ndarray:
    if len(ranges) == 1:
        (a, b) = ranges[0]
        return x if (a, b) == (0, x.shape[0]) else x[a:b]
    return np.concatenate([x[a:b] for a, b in ranges], axis=0)


def flux_transformer_state_dict(bfl_state_dict: Mapping[str, Any]) -> TensorView:
    """A Flux transformer in BFL naming (ComfyUI's `model.diffusion_model.` prefix optional) -> the same tensors in
    diffusers' `FluxTransformer2DModel` naming, lazily (`bfl_module_targets`). Keys outside the table keep their
    name, so `convert_flux_transformer` reports them as unexpected."""
    sd = _transformer_part(bfl_state_dict)
    inner = tensor_shape(sd, "img_in.weight")[0] if "img_in.weight" in sd else None
    entries: dict[str, tuple[Callable[[], np.ndarray], tuple[int, ...]]] = {}
    for key in sd:
        module, _, leaf = key.rpartition(".")
        targets = bfl_module_targets(module) if leaf in ("weight", "bias", "scale") else None
        if targets is None or (inner is None and any(r != "all" for _, r in targets)):
            entries[key] = _passthrough(sd, key)
            continue
        shape = tensor_shape(sd, key)
        for name, rows in targets:
            ranges = row_ranges(rows, shape[0], inner)

            def get(key=key, ranges=ranges):
                return take_rows(np.asarray(sd[key]), ranges)

            rows_out = sum(b - a for a, b in ranges)
            entries[f"{name}.{'weight' if leaf == 'scale' else leaf}"] = (get, (rows_out, *shape[1:]))
    return TensorView(entries)


# ---------------------------------------------------------------------------------------------- the architecture
def _config_file(config: Any, source: str) -> FluxTransformerConfig:
    if isinstance(config, FluxTransformerConfig):
        return config
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file() and (path.parent / "transformer" / "config.json").is_file():
        path = path.parent / "transformer" / "config.json"
    return FluxTransformerConfig.from_dict(read_json(path), source=str(path))


def _block_count(shapes: Mapping[str, Any], prefix: str) -> int:
    indices = {int(k[len(prefix) :].split(".", 1)[0]) for k in shapes if k.startswith(prefix)}
    return max(indices) + 1 if indices else 0


def flux_config_from_shapes(
    shapes: Mapping[str, tuple[int, ...]], config: Any = None, *, source: str = "checkpoint"
) -> FluxTransformerConfig:
    """The `FluxTransformerConfig` a diffusers-named transformer's `{key: shape}` describes: depth, widths, in/out
    channels and guidance embedding from the tensors, the rest (the rotary axes) from the released FLUX.1 config.
    `config` replaces it: a `FluxTransformerConfig` or a `config.json` file or folder wholly, a dict key by key
    (e.g. `{"axes_dims_rope": [8, 12, 12]}`). A `config` that disagrees with the tensors raises `ConfigError`
    naming the field; so do heads that the rotary axes do not cover (`FluxTransformerConfig`'s own check)."""

    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise FluxWeightsError(f"{source}: a Flux.1 transformer without {key}: truncated or another model")
        return tuple(shapes[key])

    inner, in_channels = need("x_embedder.weight")
    num_layers = _block_count(shapes, "transformer_blocks.")
    num_single = _block_count(shapes, "single_transformer_blocks.")
    norm_q = (
        "transformer_blocks.0.attn.norm_q.weight" if num_layers else "single_transformer_blocks.0.attn.norm_q.weight"
    )
    head_dim = need(norm_q)[0]
    out = need("proj_out.weight")[0]
    guidance = "time_text_embed.guidance_embedder.linear_1.weight" in shapes
    inferred = dict(
        in_channels=in_channels,
        output_channels=out,
        num_layers=num_layers,
        num_single_layers=num_single,
        attention_head_dim=head_dim,
        num_attention_heads=inner // head_dim,
        joint_attention_dim=need("context_embedder.weight")[1],
        pooled_projection_dim=need("time_text_embed.text_embedder.linear_1.weight")[1],
        guidance_embeds=guidance,
    )
    if inner % head_dim:
        raise FluxWeightsError(f"{source}: width {inner} is not a whole number of heads of {head_dim} channels")
    if config is None or isinstance(config, Mapping):  # the released config, the tensors' sizes, then `config`'s keys
        base = FLUX_DEV if guidance else FLUX_SCHNELL
        raw = {**dataclasses.asdict(base), **inferred, "out_channels": None if out == in_channels else out}
        del raw["output_channels"]
        try:
            cfg = FluxTransformerConfig.from_dict({**raw, **(config or {})}, source=f"config= for {source}")
        except ConfigError as e:
            if "axes_dims_rope" not in str(e) or (config and "axes_dims_rope" in config):
                raise
            raise ConfigError(
                f"{e}; the tensors have heads of {head_dim}: pass config={{'axes_dims_rope': ...}}"
            ) from e
    else:
        cfg = _config_file(config, source)
    wrong = [f"{k}={getattr(cfg, k)!r} (the tensors say {v!r})" for k, v in inferred.items() if getattr(cfg, k) != v]
    if wrong:
        raise ConfigError(f"{source}: config= does not describe these weights: {', '.join(wrong)}")
    return cfg


# ---------------------------------------------------------------------------------------------- float8
def _is_float8(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _dequantize_scaled(weight: np.ndarray, scale: np.ndarray, key: str) -> np.ndarray:
    w, s = np.asarray(weight, np.float32), np.asarray(scale, np.float32)
    if s.size == 1:
        return w * s.reshape(())
    if s.size == w.shape[0]:  # one scale per output row
        return w * s.reshape((-1,) + (1,) * (w.ndim - 1))
    raise CheckpointError(f"{key}: a scale_weight of shape {s.shape} fits no weight of shape {w.shape}")


def fp8_view(tensors: Mapping[str, Any], *, source: str, keep_fp8: bool = False) -> Mapping[str, Any]:
    """A file's tensors with ComfyUI's float8 bookkeeping resolved: each `<layer>.weight` that has a
    `<layer>.scale_weight` becomes `weight * scale_weight` (float32), and the `scaled_fp8` marker, the scales and
    the `scale_input`s leave the key set. Plain float8 tensors are passed on as float8 (the cast rounds them to
    the requested dtype, or keeps them with `keep_fp8`). Refuses ComfyUI's `comfy_quant` files and `keep_fp8` for
    scaled files (see the module docstring)."""
    keys = list(tensors)
    newer = [k for k in keys if k.endswith((".comfy_quant", ".weight_scale", ".input_scale"))]
    if newer:
        raise FluxWeightsError(
            f"{source}: a ComfyUI mixed-precision quantized file ({len(newer)} keys such as {newer[0]}): sdjax reads "
            f"plain and scaled (scale_weight) float8 files only"
        )
    scales = {k.removesuffix("scale_weight") + "weight": k for k in keys if k.endswith(".scale_weight")}
    marker = [k for k in keys if k == "scaled_fp8" or k.endswith(".scaled_fp8")]
    if not scales and not marker and not any(k.endswith(".scale_input") for k in keys):
        return tensors
    if keep_fp8 and scales:
        raise ValueError(
            f"{source}: a scaled float8 file ({len(scales)} scale_weight tensors): its weights are float8 values times "
            f"a per-layer scale, which sdjax's layers do not apply; load it with keep_fp8=False (upcast to dtype)"
        )
    entries = {}
    for k in keys:
        if k in marker or k.endswith((".scale_weight", ".scale_input")):
            continue
        if k in scales:

            def get(k=k):
                return _dequantize_scaled(tensors[k], tensors[scales[k]], f"{source}: {k}")

            entries[k] = (get, tensor_shape(tensors, k))
        else:
            entries[k] = _passthrough(tensors, k)
    return TensorView(entries)


def weight_cast(dtype: Any, *, keep_fp8: bool = False) -> Callable[[np.ndarray], Any]:
    """The loaders' per-tensor cast: floating tensors -> device arrays of `dtype`; with `keep_fp8`, float8 tensors
    stay float8."""
    cast = make_cast(dtype)
    if not keep_fp8:
        return cast

    def keep(x: np.ndarray):
        return jax.device_put(np.ascontiguousarray(x)) if _is_float8(x.dtype) else cast(x)

    return keep


def param_bytes(params: Any) -> int:
    """Bytes of every leaf of a params tree (what the device holds for it)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params))


# ---------------------------------------------------------------------------------------------- GGUF
def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the gguf package: pip install 'sdjax[gguf]'") from e
    return gguf


class GGUFTensors(Mapping[str, np.ndarray]):
    """The tensors of a GGUF file, dequantized to float32 numpy one per lookup (`gguf.quants.dequantize`), in numpy
    order (ggml lists dimensions innermost first; `shape(key)` is reversed to PyTorch's order). `quant_type(key)`
    names a tensor's GGML type; `architecture` is the file's `general.architecture` (None when absent)."""

    def __init__(self, path: str | Path):
        gguf = _gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise files.MissingWeightsError(f"GGUF file not found: {self.path}")
        try:
            reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from e
        self._tensors = {t.name: t for t in reader.tensors}
        bad = sorted(
            {
                f"{t.tensor_type.name} ({name})"
                for name, t in self._tensors.items()
                if t.tensor_type.name not in GGUF_TYPES
            }
        )
        if bad:
            raise FluxWeightsError(
                f"{self.path}: GGUF quantization type(s) sdjax does not read: {', '.join(bad[:5])}; "
                f"it reads {', '.join(GGUF_TYPES)}"
            )
        field = reader.get_field("general.architecture")
        self.architecture = None if field is None else str(field.contents())
        # ComfyUI-GGUF records the original shape of tensors it had to reshape to quantize them.
        self._orig = {
            name[len("comfy.gguf.orig_shape.") :]: tuple(int(d) for d in f.contents())
            for name, f in reader.fields.items()
            if name.startswith("comfy.gguf.orig_shape.")
        }
        self._gguf = gguf

    def shape(self, key: str) -> tuple[int, ...]:
        return self._orig.get(key) or tuple(int(d) for d in reversed(self._tensors[key].shape.tolist()))

    def quant_type(self, key: str) -> str:
        return self._tensors[key].tensor_type.name

    def __getitem__(self, key: str) -> np.ndarray:
        t = self._tensors[key]
        out = self._gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(out, np.float32).reshape(self.shape(key))

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


# ---------------------------------------------------------------------------------------------- the transformer
def _load_transformer(
    tensors: Mapping[str, Any], *, source: str, dtype: Any, config: Any, cast, quantize: Any = None
) -> tuple[Any, dict]:
    sd = _transformer_part(tensors)
    layout = _layout(sd)
    if layout is None:
        raise FluxWeightsError(f"{source}: not a Flux.1 transformer; it looks like {describe_checkpoint(tensors)}")
    if layout == "bfl":
        sd = flux_transformer_state_dict(sd)
    cfg = flux_config_from_shapes({k: tensor_shape(sd, k) for k in sd}, config, source=source)
    params = convert_quantized(  # `quantize`: a QuantPolicy whose kernels are quantized as they are converted
        lambda c: flux_model.convert_flux_transformer(sd, cfg, cast=c, component=f"transformer ({source})"),
        cast,
        quantize,
        "transformer",
    )
    return flux_model.FluxTransformer2DModel(cfg, dtype=dtype), params


def load_flux_transformer_file(
    path: str | Path, *, dtype: Any, config: Any = None, keep_fp8: bool = False, quantize: Any = None
) -> tuple[flux_model.FluxTransformer2DModel, dict]:
    """One Flux.1 transformer file -> `(module, params)`: a `.safetensors` in BFL or diffusers naming (ComfyUI's
    prefix and bundled components allowed; bfloat16, float16, float32, float8, scaled float8), or a `.gguf`
    (`load_flux_gguf`). The architecture comes from the tensors (`flux_config_from_shapes`; `config` fills in or
    checks). Each tensor is converted and cast to `dtype` (compute dtype too) one at a time; `keep_fp8` keeps float8
    tensors float8 (module docstring); `quantize` (a `sdjax.quant.QuantPolicy`) quantizes the transformer kernels
    it selects as they are converted. Raises `FluxWeightsError` for a file that is no Flux.1 transformer."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        if keep_fp8:
            raise ValueError(f"{path}: keep_fp8 is for float8 safetensors files; a GGUF file is dequantized to dtype")
        return load_flux_gguf(path, dtype=dtype, config=config, quantize=quantize)
    dtype = resolve_dtype(dtype)
    tensors = fp8_view(files.read_safetensors(path), source=str(path), keep_fp8=keep_fp8)
    return _load_transformer(
        tensors,
        source=str(path),
        dtype=dtype,
        config=config,
        cast=weight_cast(dtype, keep_fp8=keep_fp8),
        quantize=quantize,
    )


def load_flux_gguf(
    path: str | Path, *, dtype: Any, config: Any = None, quantize: Any = None
) -> tuple[flux_model.FluxTransformer2DModel, dict]:
    """A GGUF Flux.1 transformer (city96's layout: BFL names; or diffusers names) -> `(module, params)`, every
    tensor dequantized by `gguf.quants.dequantize` and rounded to `dtype`. Unknown quantization types and files of
    another `general.architecture` are refused by name."""
    dtype = resolve_dtype(dtype)
    tensors = GGUFTensors(path)
    if tensors.architecture not in (None, "flux"):
        raise FluxWeightsError(
            f"{path}: a GGUF file of architecture {tensors.architecture!r}, not a Flux.1 transformer ('flux'); "
            f"it looks like {describe_checkpoint(tensors)}"
        )
    return _load_transformer(
        tensors, source=str(path), dtype=dtype, config=config, cast=make_cast(dtype), quantize=quantize
    )


# ---------------------------------------------------------------------------------------------- text encoders
def _text_encoder_part(tensors: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    return prefix_view(tensors, prefix) if any(k.startswith(prefix) for k in tensors) else tensors


def load_t5_file(
    path: str | Path,
    *,
    dtype: Any,
    config: Any = None,
    keep_fp8: bool = False,
    quantize: Any = None,
    params_key: str = "text_encoder_2",
) -> tuple[t5_model.T5EncoderModel, dict]:
    """A T5 encoder file (`t5xxl_fp16.safetensors`, `t5xxl_fp8_e4m3fn[_scaled].safetensors`; transformers' key names,
    with `shared.weight`, its tied copy `encoder.embed_tokens.weight`, or both) -> `(T5EncoderModel, params)`.
    `config`: a `T5Config` or `config.json` dict; default T5 v1.1 XXL (`T5_XXL`). `keep_fp8` as for the
    transformer. `quantize` (a `sdjax.quant.QuantPolicy`): the kernels it selects under `params_key` (the
    encoder's key in the pipeline's params: Flux's `text_encoder_2`, SD 3's `text_encoder_3`) are quantized as they
    are converted. A file of another kind raises `FluxWeightsError` naming it."""
    dtype = resolve_dtype(dtype)
    source = str(path)
    tensors = fp8_view(files.read_safetensors(path), source=source, keep_fp8=keep_fp8)
    tensors = _text_encoder_part(tensors, T5_PREFIX)
    if "encoder.block.0.layer.0.SelfAttention.q.weight" not in tensors:
        raise FluxWeightsError(f"{source}: not a T5 encoder file; it looks like {describe_checkpoint(tensors)}")
    if config is None or isinstance(config, Mapping):
        config = t5_model.T5Config.from_dict(T5_XXL if config is None else config, source=f"T5 config for {source}")
    component = f"{params_key} ({source}, built as {'T5 v1.1 XXL' if config == _t5_xxl() else 'config='})"
    params = convert_quantized(
        lambda c: t5_model.convert_t5_encoder(tensors, config, cast=c, component=component),
        weight_cast(dtype, keep_fp8=keep_fp8),
        quantize,
        params_key,
    )
    return t5_model.T5EncoderModel(config, dtype=dtype), params


def _t5_xxl() -> t5_model.T5Config:
    return t5_model.T5Config.from_dict(T5_XXL)


# CLIP-L files may carry these beside the text model: ComfyUI's identity `text_projection` (Flux uses the pooled
# output unprojected), the contrastive temperature, the position-id buffer.
_CLIP_EXTRAS = frozenset({"text_projection.weight", "logit_scale", "text_model.embeddings.position_ids"})


def load_clip_l_file(
    path: str | Path, *, dtype: Any, config: Any = None, quantize: Any = None
) -> tuple[clip_model.CLIPTextModel, dict]:
    """A CLIP-L text-encoder file (`clip_l.safetensors`: transformers `CLIPTextModel` keys, with or without the
    `text_model.` prefix) -> `(CLIPTextModel, params)`. `config`: a `CLIPTextConfig` or `config.json` dict;
    default CLIP ViT-L/14's (`CLIP_L_CONFIG`). `quantize` (a `sdjax.quant.QuantPolicy`): the kernels it selects
    under `text_encoder` are quantized as they are converted. A file of another kind raises `FluxWeightsError`
    naming it."""
    dtype = resolve_dtype(dtype)
    source = str(path)
    tensors = fp8_view(files.read_safetensors(path), source=source)
    tensors = _without(_text_encoder_part(tensors, CLIP_L_PREFIX), lambda k: k in _CLIP_EXTRAS)
    if not any(k.endswith("encoder.layers.0.self_attn.q_proj.weight") for k in tensors):
        raise FluxWeightsError(f"{source}: not a CLIP text-encoder file; it looks like {describe_checkpoint(tensors)}")
    if config is None:
        config = clip_model.CLIPTextConfig.from_dict(read_json(CLIP_L_CONFIG), source=str(CLIP_L_CONFIG))
    elif isinstance(config, Mapping):
        config = clip_model.CLIPTextConfig.from_dict(config, source=f"CLIP config for {source}")
    params = convert_quantized(
        lambda c: clip_model.convert_clip_text(
            tensors, config, with_projection=False, cast=c, component=f"text_encoder ({source})"
        ),
        make_cast(dtype),
        quantize,
        "text_encoder",
    )
    return clip_model.CLIPTextModel(config, dtype=dtype), params
