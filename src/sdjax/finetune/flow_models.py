"""What a flow-matching LoRA run needs of each family (Flux.1, SD 3 / 3.5): the denoiser call of the training
step, the LoRA targets, the captions' text states, and the LoRA file.

- `FluxAdapter.predict`: diffusers' `train_dreambooth_lora_flux.py` call of `FluxTransformer2DModel`: the noisy
  latents packed into 2x2 patches (`_pack_latents`), image ids of that grid (`_prepare_latent_image_ids`), zero
  text ids, `timestep / 1000`, dev's guidance input (the script's `--guidance_scale`, 3.5; schnell has none), the
  prediction unpacked.
- `SD3Adapter.predict`: `train_dreambooth_lora_sd3.py`'s call of `SD3Transformer2DModel`: the latents as they are,
  the timestep in [0, T].
- Targets: PEFT's `target_modules` rule on diffusers' module names (a module is adapted when its name is a target
  or ends with "." + a target), the scripts' defaults: Flux's attention projections of both streams
  (`attn.to_q/k/v`, `attn.to_out.0`, `attn.add_q/k/v_proj`, `attn.to_add_out`; the single blocks' `attn.to_q/k/v`)
  and the double blocks' MLPs (`ff.net.0.proj`, `ff.net.2`, `ff_context.*`); SD 3's attention projections. Only
  Linear layers can be targets; a target that matches nothing is an error naming it.
- Initialisation: the scripts' `init_lora_weights="gaussian"`: down ~ N(0, 1/r), up = 0.
- Text: each distinct caption is encoded once (`TextStates`, the family's conditioning `encode` under `jit`, one
  caption at a time so it compiles once) and kept on the host in the compute dtype; the step gets the states.
- Text-encoder LoRA (the scripts' `--train_text_encoder`): PEFT's LoRA on the CLIP encoders' attention projections
  (`q_proj`, `k_proj`, `v_proj`, `out_proj`; Flux: CLIP-L, SD 3: CLIP-L and CLIP-G), T5 frozen. The step then
  gets the CLIP ids and the (frozen) T5 states of each caption (`TextInputs`) and runs the CLIP encoders itself
  (`encode_text`, the adapters' part of `FluxPipeline.encode_prompt` / `StableDiffusion3Pipeline.encode_prompt`:
  Flux's pooled CLIP-L output; SD 3's penultimate CLIP-L / CLIP-G states padded to T5's width before the T5
  states, and their projected pooled outputs).
- Files: diffusers' `pytorch_lora_weights.safetensors` layout (`transformer.<module>.lora_A.weight` `(r, in)`,
  `.lora_B.weight` `(out, r)`, float32; `text_encoder.` / `text_encoder_2.` + the CLIP module names for a
  text-encoder LoRA) with each component's alpha, rank and targets in its `lora_adapter_metadata`, as
  `FluxPipeline.save_lora_weights` writes them: `load_lora_weights` of diffusers and sdjax's readers
  (`families.flux.lora`, `families.sd3.lora`) read it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from sdjax.finetune import lora as lora_lib
from sdjax.finetune.lora import LoraConfigError
from sdjax.loading.lora import METADATA_KEY
from sdjax.models.convert import LIST_ATTRIBUTES, torch_key_to_path

COMPONENT = "transformer"
FLUX_TARGETS = (  # train_dreambooth_lora_flux.py's default `--lora_layers`
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")  # the scripts' text_lora_config
SD3_TARGETS = (  # train_dreambooth_lora_sd3.py's default `--lora_layers`
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)
_LISTS = LIST_ATTRIBUTES | {"single_transformer_blocks"}
_INDEXED = re.compile(r"^(.+)_(\d+)$")
_BLOCK = re.compile(r"^\w*transformer_blocks\.\d+\.")  # a block's prefix, for the names in an error


# ------------------------------------------------------------------------------------------------ adapters
@dataclasses.dataclass(frozen=True, eq=False)
class FluxAdapter:
    """The Flux.1 transformer as the training scripts call it (see the module docstring)."""

    transformer: Any  # models.flux.FluxTransformer2DModel
    dtype: Any = jnp.float32
    guidance_scale: float = 3.5

    family = "flux"
    component = COMPONENT
    default_targets = FLUX_TARGETS
    default_weighting = "none"
    default_precondition = False
    latent_multiple = 2  # latents are packed in 2x2 patches
    text_encoders = ("text_encoder",)  # CLIP-L takes the text-encoder LoRA; T5 (text_encoder_2) stays frozen

    def encode_text(self, conditioning, params: dict, lora: dict, scale: float, batch: dict, rate=0.0, key=None):
        """`(text, pooled)`: the frozen T5 states `batch["t5"]` and CLIP-L's pooled output of `batch["ids"]` with
        its LoRA (`_encoder`)."""
        clip = _encoder(conditioning.text_encoder, "text_encoder", params, lora, scale, batch["ids"], rate, key)
        return batch["t5"], clip.pooler_output

    def predict(self, params: dict, x_bchw: jax.Array, timesteps_b: jax.Array, cond: dict) -> jax.Array:
        from sdjax.models import flux as flux_model

        b, _, h, w = x_bchw.shape
        text = cond["text"].astype(self.dtype)
        tokens = flux_model.pack_latents(x_bchw.astype(self.dtype))
        img_ids = jnp.asarray(flux_model.image_ids(h, w))
        txt_ids = jnp.asarray(flux_model.text_ids(text.shape[1]))
        timestep = (timesteps_b.astype(jnp.float32) / 1000.0).astype(self.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = jnp.full((b,), self.guidance_scale, jnp.float32)
        out = self.transformer.apply(
            {"params": params}, tokens, text, cond["pooled"].astype(self.dtype), timestep, img_ids, txt_ids, guidance
        )
        return flux_model.unpack_latents(out.astype(jnp.float32), h, w)


@dataclasses.dataclass(frozen=True, eq=False)
class SD3Adapter:
    """The SD 3 / 3.5 transformer as `train_dreambooth_lora_sd3.py` calls it."""

    transformer: Any  # models.sd3.SD3Transformer2DModel
    dtype: Any = jnp.float32
    guidance_scale: float = 0.0  # unused: SD 3 has no guidance input

    family = "sd3"
    component = COMPONENT
    default_targets = SD3_TARGETS
    default_weighting = "logit_normal"
    default_precondition = True
    text_encoders = ("text_encoder", "text_encoder_2")  # CLIP-L, CLIP-G; T5 (text_encoder_3) stays frozen

    def encode_text(self, conditioning, params: dict, lora: dict, scale: float, batch: dict, rate=0.0, key=None):
        """`(text, pooled)`: [CLIP-L, CLIP-G penultimate states padded to T5's width; the frozen T5 states
        `batch["t5"]`] along tokens, and [CLIP-L, CLIP-G `text_embeds`], each CLIP with its LoRA (`_encoder`)."""
        enc = (conditioning.text_encoder, conditioning.text_encoder_2)
        outs = [
            _encoder(e, c, params, lora, scale, batch[ids], rate, key)
            for e, c, ids in zip(enc, self.text_encoders, ("ids", "ids_2"))
        ]
        clip = jnp.concatenate([o.hidden_states[-2] for o in outs], axis=-1)
        t5 = batch["t5"].astype(clip.dtype)
        clip = jnp.pad(clip, ((0, 0), (0, 0), (0, t5.shape[-1] - clip.shape[-1])))
        return jnp.concatenate([clip, t5], axis=1), jnp.concatenate([o.text_embeds for o in outs], axis=-1)

    @property
    def latent_multiple(self) -> int:
        return int(self.transformer.config.patch_size)

    def predict(self, params: dict, x_bchw: jax.Array, timesteps_b: jax.Array, cond: dict) -> jax.Array:
        out = self.transformer.apply(
            {"params": params},
            x_bchw.astype(self.dtype),
            cond["text"].astype(self.dtype),
            cond["pooled"].astype(self.dtype),
            timesteps_b.astype(jnp.float32),
        )
        return out.astype(jnp.float32)


def _encoder(module, component: str, params: dict, lora: dict, scale: float, ids, rate: float, key):
    """One CLIP encoder's output on `ids` with PEFT's LoRA branch on its adapted layers (`finetune.lora.branch`:
    float32 LoRA matmuls beside the frozen, maybe bfloat16, kernels; dropout `rate` from `key` folded with the
    component's index, so CLIP-L and CLIP-G draw apart)."""
    index = 1 + int(component.removeprefix("text_encoder").removeprefix("_") or 0)
    k = None if key is None else jax.random.fold_in(key, index)
    with lora_lib.branch(lora.get(component, {}), scale, rate, k):
        return module.apply({"params": params[component]}, ids)


def adapter_for(pipe: Any, dtype: Any, *, guidance_scale: float, remat: bool = False) -> FluxAdapter | SD3Adapter:
    """The adapter of a loaded Flux or SD 3 pipeline (its transformer with per-block remat when asked)."""
    transformer = pipe.transformer.clone(remat=True) if remat else pipe.transformer
    name = type(pipe).__name__
    if name == "FluxPipeline":
        return FluxAdapter(transformer, dtype, guidance_scale)
    if name == "StableDiffusion3Pipeline":
        return SD3Adapter(transformer, dtype)
    raise ValueError(f"flow-matching LoRA training supports Flux.1 and SD 3 / 3.5 models, not a {name}")


# ------------------------------------------------------------------------------------------------ targets
def diffusers_module(path: Sequence[str]) -> str:
    """A kernel path's diffusers module name: `("single_transformer_blocks_0", "attn", "to_q", "kernel")` ->
    `"single_transformer_blocks.0.attn.to_q"` (list indices dotted, other underscores kept)."""
    parts: list[str] = []
    for segment in path[:-1]:
        m = _INDEXED.match(segment)
        parts += [m.group(1), m.group(2)] if m and m.group(1) in _LISTS else [segment]
    name = ".".join(parts)
    if torch_key_to_path(name + ".weight")[:-1] != tuple(path[:-1]):
        raise ValueError(f"cannot name {'/'.join(path)} as a diffusers module (got {name!r})")
    return name


def matches(module: str, target: str) -> bool:
    """PEFT's list rule (`check_target_module_exists`): the name itself or a dotted suffix."""
    return module == target or module.endswith("." + target)


def target_paths(params: Mapping[str, Any], targets: Sequence[str], *, source: str = "the transformer") -> list:
    """The kernel paths of `params` whose diffusers module name matches one of `targets`, sorted; a
    `LoraConfigError` names a target that matches nothing or matches a layer that is not a Linear."""
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t.strip() for t in targets):
        raise LoraConfigError(f"lora_layers={targets!r} (--lora-layers) must be module names such as 'attn.to_q'")
    kernels = {p: tuple(v.shape) for p, v in flatten_dict(dict(params)).items() if p[-1] == "kernel"}
    names = {p: diffusers_module(p) for p in kernels}
    found: set[tuple[str, ...]] = set()
    for target in targets:
        hits = [p for p, name in names.items() if matches(name, target)]
        if not hits:
            examples = sorted({_BLOCK.sub("", n) for n in names.values()})[:16]
            raise LoraConfigError(
                f"lora_layers: {target!r} names no layer of {source} (its Linear and other layers, without the "
                f"block prefix: {examples})"
            )
        convs = [names[p] for p in hits if len(kernels[p]) != 2]
        if convs:
            raise LoraConfigError(f"lora_layers: {target!r} matches {convs[0]}, not a Linear layer (no LoRA target)")
        found.update(hits)
    return sorted(found)


def init_lora(
    key: jax.Array, params: Mapping[str, Any], targets: Sequence[str], rank: int, *, component: str = COMPONENT, **kw
) -> dict:
    """A fresh LoRA `{component: {"a/b/kernel": {"down" (r, in), "up" (out, r)}}}` (float32 numpy) with the
    scripts' gaussian init: down ~ N(0, 1/r), up = 0."""
    if int(rank) != rank or rank < 1:
        raise LoraConfigError(f"rank={rank!r}: a LoRA rank must be a positive integer")
    flat = flatten_dict(dict(params))
    layers = {}
    for i, path in enumerate(target_paths(params, targets, **kw)):
        fan_in, fan_out = flat[path].shape
        down = jax.random.normal(jax.random.fold_in(key, i), (rank, fan_in), jnp.float32) / rank
        layers["/".join(path)] = {"down": np.asarray(down), "up": np.zeros((fan_out, rank), np.float32)}
    return {component: layers}


def init_text_lora(key: jax.Array, params: Mapping[str, Any], components: Sequence[str], rank: int) -> dict:
    """Fresh LoRAs of the CLIP encoders `components` on `TEXT_TARGETS` (the scripts' `text_lora_config`, gaussian
    init), each from its own key (`fold_in(key, 1 + index)`; the transformer's is `key` itself)."""
    lora = {}
    for i, c in enumerate(components):
        if params.get(c) is None:
            raise LoraConfigError(f"train_text_encoder (--train-text-encoder): this pipeline has no {c} (CLIP) params")
        k = jax.random.fold_in(key, 1 + i)
        lora |= init_lora(k, params[c], TEXT_TARGETS, rank, component=c, source=f"the {c} (CLIP)")
    return lora


# ------------------------------------------------------------------------------------------------ text
class TextStates:
    """The text states of each caption, `{"text": (L, D), "pooled": (P,)}` (`_states` names them), encoded once
    (the family's conditioning under `jit`, one caption per call, so it compiles once) and kept on the host in
    `dtype`. `finetune.cache.TextEncoderCache` is the SD 1.x / 2.x / XL form (other inputs and names)."""

    def __init__(self, conditioning: Any, params: Mapping[str, Any], dtype: Any = jnp.float32):
        self.conditioning = conditioning
        self.params = {c: params[c] for c in conditioning.components if c in params}
        self.dtype = np.dtype(dtype)
        self.cache: dict[str, dict[str, np.ndarray]] = {}
        self._encode = jax.jit(lambda p, inputs: self._states(conditioning.encode(p, inputs, cfg=False)))

    @staticmethod
    def _states(encoded: Any) -> dict[str, jax.Array]:
        """The kept arrays of the conditioning's `encode` output (batch first)."""
        return {"text": encoded["text"], "pooled": encoded["pooled"]}

    def _inputs(self, caption: str) -> dict[str, np.ndarray]:
        inputs = dict(self.conditioning.text_inputs([caption], [""]))
        inputs = {k: v for k, v in inputs.items() if not k.startswith("neg_")}
        if getattr(self.conditioning, "name", "") == "flux":
            inputs["embedded_guidance"] = np.zeros((1,), np.float32)  # read by encode, unused here
        return inputs

    def one(self, caption: str) -> dict[str, np.ndarray]:
        if caption not in self.cache:
            states = self._encode(self.params, self._inputs(caption))
            self.cache[caption] = {k: np.asarray(v[0]).astype(self.dtype) for k, v in states.items()}
        return self.cache[caption]

    def __call__(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        return _stacked([self.one(c) for c in captions])


class TextInputs:
    """What a step with text-encoder LoRA gets of each caption: the CLIP ids (`ids`, SD 3's `ids_2`; int32 `(77,)`)
    and the frozen T5 states `t5` `(L, D)` (the T5 part of `TextStates`' text: all of Flux's, SD 3's after its 77
    CLIP tokens; zeros for an SD 3 pipeline without T5, as its conditioning gives)."""

    def __init__(self, states: TextStates, adapter: Any):
        self.states = states
        self.id_keys = ("ids", "ids_2")[: len(adapter.text_encoders)]
        self.cache: dict[str, dict[str, np.ndarray]] = {}

    def one(self, caption: str) -> dict[str, np.ndarray]:
        if caption not in self.cache:
            inputs = self.states._inputs(caption)
            ids = {k: np.asarray(inputs[k][0], np.int32) for k in self.id_keys}
            text = self.states.one(caption)["text"]
            clip_tokens = ids["ids"].shape[0] if "ids_2" in ids else 0  # SD 3: [CLIP (77), T5 (L)] along tokens
            self.cache[caption] = {**ids, "t5": text[clip_tokens:]}
        return self.cache[caption]

    def __call__(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        return _stacked([self.one(c) for c in captions])


def _stacked(rows: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-caption arrays stacked into batch arrays, by name."""
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


# ------------------------------------------------------------------------------------------------ files
def peft_state_dict(
    lora: Mapping[str, Mapping[str, Mapping[str, Any]]],
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] | Mapping[str, Sequence[str]],
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The LoRA as diffusers writes it: `<component>.<module>.lora_A.weight` / `.lora_B.weight` float32
    (`transformer`, `text_encoder`, `text_encoder_2`), and the `lora_adapter_metadata` (`transformer.r`,
    `transformer.lora_alpha`, `transformer.target_modules`, ..., the same under `text_encoder.`) from which
    `load_lora_weights` builds each component's `LoraConfig`; `targets`: the transformer's, or per component."""
    tensors: dict[str, np.ndarray] = {}
    for component, layers in lora.items():
        for name, ab in layers.items():
            module = diffusers_module(tuple(name.split("/")))
            tensors[f"{component}.{module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(ab["down"], np.float32))
            tensors[f"{component}.{module}.lora_B.weight"] = np.ascontiguousarray(np.asarray(ab["up"], np.float32))
    per = targets if isinstance(targets, Mapping) else {COMPONENT: targets}
    config = {
        "r": int(rank),
        "lora_alpha": float(alpha),
        "init_lora_weights": "gaussian",
        "lora_dropout": 0.0,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
    }
    meta = {}
    for c in lora:
        modules = per.get(c, TEXT_TARGETS if c != COMPONENT else ())
        meta |= {f"{c}.{k}": v for k, v in (config | {"target_modules": sorted(modules)}).items()}
    return tensors, {METADATA_KEY: json.dumps(meta, indent=2, sort_keys=True), "format": "pt"}
