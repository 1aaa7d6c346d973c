"""Stability AI's SD 3.5 ControlNet single files (`sd3.5_large_controlnet_canny.safetensors`, `..._depth`,
`..._blur`) read into sdjax's `models.sd3_controlnet.SD3ControlNetModel`, without torch. ComfyUI loads these files
as they are; diffusers converts them once (`scripts/convert_sd3_controlnet_to_diffusers.py`), and this module does
that conversion on load.

**The layout** ("SAI" below; Stability's reference inference code, `sd3_infer.py` of their sd3.5 repository, maps
the embedder names onto its own modules with a short rename table):
- under diffusers' names already: `pos_embed_input.proj.{weight,bias}` (the p x p convolution of the control
  latents), `controlnet_blocks.N.{weight,bias}` (the per-block output Linears) and
  `time_text_embed.timestep_embedder.linear_{1,2}.*`, `time_text_embed.text_embedder.linear_{1,2}.*`;
- per block `transformer_blocks.N.` in the reference MMDiT's names: `attn.qkv` (q, k and v stacked by rows),
  `attn.proj`, `mlp.fc1`, `mlp.fc2`, `adaLN_modulation.1` (the six modulation vectors, in the order diffusers'
  `AdaLayerNormZero` splits them);
- `control_type`: Stability's tag of the net's kind (0 blur, 1 canny, 2 depth). diffusers does not read it and
  neither does sdjax (ComfyUI uses it to change the control image before encoding; diffusers' pipeline does not).

**The conversion**: `attn.qkv` -> `attn.to_q` / `to_k` / `to_v` (three equal row blocks, cut when looked up),
`attn.proj` -> `attn.to_out.0`, `mlp.fc1` -> `ff.net.0.proj`, `mlp.fc2` -> `ff.net.2`, `adaLN_modulation.1` ->
`norm1.linear`; everything else keeps its name.

**The config** (diffusers' converter writes fixed numbers for the released nets: 19 blocks of 38 heads of 64, 16
latent channels, pooled width 2048); here every number the tensors tell is read from them: `num_layers` from the
block indices, the width and `patch_size` from `pos_embed_input.proj.weight` (`in_channels` = its input channels),
`pooled_projection_dim` from `time_text_embed.text_embedder.linear_1.weight`. No tensor tells the head count:
heads are 64 wide, as in every SD 3 / 3.5 MMDiT and in both Stability's and diffusers' code, so the width must be a
multiple of 64 (else pass `config=`). Fixed, as diffusers writes them: `joint_attention_dim` null (single blocks,
no text), `use_pos_embed` false (the net runs the transformer's patch embedding), `pos_embed_type` and
`pos_embed_max_size` null, `force_zeros_for_pooled_projection` false, `out_channels` = `in_channels`,
`caption_projection_dim` the pooled width (unused by a net without text; 2048 in diffusers' config as here).
A `config` (an `SD3ControlNetModel` `config.json`, its folder or a dict) replaces the inference.

Every key the config does not expect, every expected key the file lacks and every tensor of the wrong shape is
reported by its name in the file (`WeightLoadError`, naming the file). A file with a patch embedding of its own
(`pos_embed.proj.*`: the reference code's smaller nets, whose blocks all read the same embedded input instead of
each other's output) is refused: diffusers' `SD3ControlNetModel` does not run such a net.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from sdjax.models.convert import WeightLoadError

HEAD_DIM = 64  # every SD 3 / 3.5 MMDiT's, and what Stability's and diffusers' code build these nets with

PATCH = "pos_embed_input.proj.weight"
POOLED = "time_text_embed.text_embedder.linear_1.weight"
_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")
# The reference MMDiT's names of a block's layers -> diffusers' (`attn.qkv` is split, below).
_BLOCK_RENAMES = {
    "attn.proj": "attn.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm1.linear",
}
_IGNORED = frozenset({"control_type"})


def is_sai_layout(keys: Iterable[str]) -> bool:
    """Whether the keys look like a Stability AI SD 3.5 ControlNet: per-block output Linears beside blocks in the
    reference MMDiT's names (a fused `attn.qkv`, `adaLN_modulation`, `mlp.fc1`). Missing pieces are then reported
    by name by the loader, not taken for another kind of file."""
    keys = list(keys)
    outputs = any(k.startswith("controlnet_blocks.") for k in keys)
    reference = any(
        _BLOCK.match(k) and (".attn.qkv." in k or ".adaLN_modulation." in k or ".mlp.fc1." in k) for k in keys
    )
    return outputs and reference


def _shape_of(shapes: Mapping[str, tuple[int, ...]], key: str, component: str) -> tuple[int, ...]:
    if key not in shapes:
        raise WeightLoadError(component, [key], [], [])
    return tuple(shapes[key])


def infer_config(shapes: Mapping[str, tuple[int, ...]], *, component: str) -> dict[str, Any]:
    """A diffusers `SD3ControlNetModel` config dict from the `{key: shape}` of a file in Stability's layout (module
    docstring). Raises `WeightLoadError` naming `component` and the key that tells a number when it is missing, and
    `ValueError` for a file diffusers' model cannot run or a width that is no whole number of heads."""
    if any(k.startswith("pos_embed.proj.") for k in shapes):
        raise ValueError(
            f"{component}: this SD 3 ControlNet has a patch embedding of its own (pos_embed.proj.*): in Stability's "
            f"reference code such a net's blocks all read the same embedded input instead of each other's output, "
            f"which diffusers' SD3ControlNetModel (and sdjax) does not run; the SD 3.5 large ControlNets borrow the "
            f"transformer's patch embedding and have no pos_embed.proj"
        )
    patch = _shape_of(shapes, PATCH, component)
    if len(patch) != 4 or patch[2] != patch[3]:
        raise WeightLoadError(component, [], [], [f"{PATCH}: {patch} is not a square (out, in, p, p) convolution"])
    width, channels, p = patch[0], patch[1], patch[2]
    pooled = _shape_of(shapes, POOLED, component)
    if len(pooled) != 2:
        raise WeightLoadError(component, [], [], [f"{POOLED}: {pooled} is not a (width, pooled) Linear weight"])
    blocks = {int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))}
    if not blocks:
        raise WeightLoadError(component, ["transformer_blocks.0.attn.qkv.weight"], [], [])
    if width % HEAD_DIM:
        raise ValueError(
            f"{component}: the net is {width} wide, not a whole number of {HEAD_DIM}-wide heads (the head count of "
            f"an SD 3 ControlNet file is not stored in it): pass config= (an SD3ControlNetModel config.json) naming "
            f"num_attention_heads and attention_head_dim"
        )
    return {
        "_class_name": "SD3ControlNetModel",
        "patch_size": p,
        "in_channels": channels,
        "out_channels": channels,
        "num_layers": max(blocks) + 1,
        "attention_head_dim": HEAD_DIM,
        "num_attention_heads": width // HEAD_DIM,
        "joint_attention_dim": None,
        "caption_projection_dim": pooled[1],
        "pooled_projection_dim": pooled[1],
        "pos_embed_max_size": None,
        "pos_embed_type": None,
        "use_pos_embed": False,
        "force_zeros_for_pooled_projection": False,
    }


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor a file in Stability's layout holds for `config` (an `SD3ControlNetConfig` of a
    net without text and without its own patch embedding), `control_type` aside."""
    d, p, c = config.inner_dim, config.patch_size, config.cond_channels
    out: dict[str, tuple[int, ...]] = {PATCH: (d, c, p, p), "pos_embed_input.proj.bias": (d,)}
    for name, fan_in in (
        ("timestep_embedder.linear_1", 256),
        ("timestep_embedder.linear_2", d),
        ("text_embedder.linear_1", config.pooled_projection_dim),
        ("text_embedder.linear_2", d),
    ):
        out[f"time_text_embed.{name}.weight"], out[f"time_text_embed.{name}.bias"] = (d, fan_in), (d,)
    for i in range(config.num_layers):
        for layer, rows, fan_in in (
            ("attn.qkv", 3 * d, d),
            ("attn.proj", d, d),
            ("mlp.fc1", 4 * d, d),
            ("mlp.fc2", d, 4 * d),
            ("adaLN_modulation.1", 6 * d, d),
        ):
            out[f"transformer_blocks.{i}.{layer}.weight"] = (rows, fan_in)
            out[f"transformer_blocks.{i}.{layer}.bias"] = (rows,)
        out[f"controlnet_blocks.{i}.weight"], out[f"controlnet_blocks.{i}.bias"] = (d, d), (d,)
    return out


def check_keys(shapes: Mapping[str, tuple[int, ...]], config: Any, *, component: str) -> None:
    """Raise `WeightLoadError` (file names) for every missing, unexpected and mis-shaped tensor."""
    want = expected_shapes(config)
    have = {k: tuple(s) for k, s in shapes.items() if k not in _IGNORED}
    missing = sorted(k for k in want if k not in have)
    unexpected = sorted(k for k in have if k not in want)
    misshaped = [f"{k}: file {have[k]} vs model {want[k]}" for k in sorted(want) if k in have and have[k] != want[k]]
    if missing or unexpected or misshaped:
        raise WeightLoadError(component, missing, unexpected, misshaped)


class _LazyView(Mapping[str, np.ndarray]):
    """diffusers key -> array, read from the file (and cut) when looked up."""

    def __init__(self, entries: Mapping[str, Callable[[], np.ndarray]]):
        self._entries = dict(entries)

    def __getitem__(self, key: str) -> np.ndarray:
        return self._entries[key]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def diffusers_state_dict(tensors: Mapping[str, Any]) -> Mapping[str, np.ndarray]:
    """A file's tensors in Stability's layout -> a lazy diffusers `SD3ControlNetModel` state dict (module
    docstring); `control_type` is dropped, keys the table does not know pass unchanged."""

    def whole(key: str) -> Callable[[], np.ndarray]:
        return lambda: tensors[key]

    def rows(key: str, part: int) -> Callable[[], np.ndarray]:
        def get() -> np.ndarray:
            x = np.asarray(tensors[key])
            n = x.shape[0] // 3
            return x[part * n : (part + 1) * n]

        return get

    out: dict[str, Callable[[], np.ndarray]] = {}
    for key in tensors:
        if key in _IGNORED:
            continue
        m = _BLOCK.match(key)
        rest = key[m.end() :] if m else ""
        layer, _, leaf = rest.rpartition(".")
        if m and layer == "attn.qkv":
            for part, name in enumerate(("to_q", "to_k", "to_v")):
                out[f"{m.group(0)}attn.{name}.{leaf}"] = rows(key, part)
        elif m and layer in _BLOCK_RENAMES:
            out[f"{m.group(0)}{_BLOCK_RENAMES[layer]}.{leaf}"] = whole(key)
        else:
            out[key] = whole(key)
    return _LazyView(out)
