"""The values a ComfyUI workflow's nodes evaluate to while `comfy.nodes` plans it (a model with its LoRAs, a CLIP
with its LoRAs and clip skip, a conditioning, a latent, an image), and the plan they make."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from sdjax.metadata import ControlUnit, GenerationRequest


@dataclasses.dataclass
class Context:
    """What planning needs from the server (built per prompt by the router)."""

    pipeline: Any
    limits: Any
    model_names: tuple[str, ...]  # names that mean the served model (checkpoint, model name, file names)
    model_name: str
    read_input: Callable[[str], bytes | None]  # an uploaded image by "subfolder/name"
    networks: Any = None  # server.networks.Networks
    controlnets: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> path
    default_vae: str = ""


@dataclasses.dataclass(frozen=True)
class Model:
    loras: tuple[tuple[str, float], ...] = ()
    # ModelSamplingFlux's (node, width, height): the size its schedule shift is for (the sampled latent's must match)
    shift_size: tuple[str, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Clip:
    loras: tuple[tuple[str, float], ...] = ()
    clip_skip: int = 1


@dataclasses.dataclass(frozen=True)
class Vae:
    name: str = ""  # "": the checkpoint's own


@dataclasses.dataclass(frozen=True)
class Cond:
    """A CONDITIONING: the prompt (CLIP-L's text where the encoders read texts of their own), its CLIP settings,
    ControlNets and Flux guidance; `texts` are the other encoders' own texts by ComfyUI's names ("clip_g", "t5xxl":
    CLIPTextEncodeFlux, CLIPTextEncodeSD3; empty: every encoder reads `text`); `zero` is ConditioningZeroOut's
    (zero embeddings and pooled output)."""

    text: str
    clip: Clip
    text_node: str = dataclasses.field(compare=False)  # where the text came from (named in errors)
    control: tuple[ControlUnit, ...] = ()
    guidance: float | None = None
    texts: tuple[tuple[str, str], ...] = ()
    zero: bool = False
    # ConditioningSetTimestepRange's (start, end) percents of the schedule; (0, 1): every step
    span: tuple[float, float] = (0.0, 1.0)
    span_node: str = dataclasses.field(default="", compare=False)
    # ConditioningCombine of two different conditionings: the pair ComfyUI averages (this Cond is the first's)
    parts: tuple[Any, ...] = ()
    parts_node: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class Guider:
    """A GUIDER (BasicGuider: the positive prompt alone, cfg 1; CFGGuider), or a KSampler's own model, prompts and
    cfg: what a sampler node samples with."""

    model: Model
    positive: Cond
    negative: Cond
    cfg: float
    node: str = dataclasses.field(compare=False)  # where the cfg came from (named in errors)


@dataclasses.dataclass(frozen=True)
class Sigmas:
    """A SIGMAS of BasicScheduler: a ComfyUI scheduler's `steps` (of an `int(steps / denoise)`-step schedule), i.e.
    `steps + 1` sigmas; SplitSigmas keeps those of index `start` to `stop` (both included)."""

    model: Model
    scheduler: str
    steps: int
    denoise: float
    node: str = dataclasses.field(compare=False)
    start: int = 0
    stop: int | None = None  # None: `steps`, the last sigma
    split: str = dataclasses.field(default="", compare=False)  # the SplitSigmas that cut them (named in errors)
    split_field: str = dataclasses.field(default="step", compare=False)  # its input that sets `start` / `stop`

    @property
    def schedule(self) -> tuple:
        """What fixes the sigmas before any split: two halves of one schedule share it."""
        return (self.model, self.scheduler, self.steps, self.denoise)

    @property
    def last(self) -> int:
        return self.steps if self.stop is None else self.stop


@dataclasses.dataclass(frozen=True)
class Pick:
    """A SAMPLER of KSamplerSelect, or a NOISE of RandomNoise (`value`: the sampler name, or the seed)."""

    value: Any
    node: str = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A first sampling stage that stops before its schedule's end (SplitSigmas' high_sigmas, KSamplerAdvanced's
    end_at_step with return_with_leftover_noise): its latent keeps the noise of step `sigmas.last` for a second
    sampler that adds none. Nothing runs until that second sampler continues it (`comfy.custom`)."""

    node: str  # the first stage's sampler node
    noise: Pick  # its seed (RandomNoise's, or the node's own noise_seed)
    guider: Guider
    pick: Pick  # its sampler name
    sigmas: Sigmas  # the high part: steps `start` to `last` of the schedule
    source: Any  # the Latent it sampled (empty, or an encoded image)


@dataclasses.dataclass(frozen=True)
class Latent:
    kind: str  # "empty" | "image" | "sampled" | "upscaled" | "partial" (a first stage's, with leftover noise)
    width: int
    height: int
    batch: int = 1
    image: Any = None  # PIL RGB (image latents)
    mask: Any = None  # PIL L, white = repaint (inpainting)
    vae: Vae | None = None
    node: str = ""  # the node that made it
    stage: int = -1  # sampled and upscaled latents: the index of their stage
    second: bool = False  # sampled: made by a second (hires) pass
    upscaler: str = ""  # upscaled: sdjax's hires upscaler ("latent", "latent-nearest")
    handoff: Handoff | None = None  # partial: the first stage a second sampler continues


@dataclasses.dataclass(frozen=True)
class Pixels:
    """An IMAGE: uint8 `(N, H, W, 3)` arrays, or the images of a stage with host operations applied after."""

    arrays: np.ndarray | None = None
    stage: int | None = None
    ops: tuple[Callable[[np.ndarray], np.ndarray], ...] = ()


@dataclasses.dataclass
class Stage:
    node_id: str  # the KSampler
    request: GenerationRequest
    vae_fixed: bool = False  # the VAE is the encoder's (or a decoder's): another decoder must use the same
    inputs: tuple = ()  # (model, positive, negative, cfg, seed) of the first pass: a second pass must share them
    first_decoded: str = ""  # a VAEDecode of the first pass's latent (none may exist when a second pass follows)
    second_pass: str = ""  # the KSampler of the hires pass


@dataclasses.dataclass
class Output:
    node_id: str
    kind: str  # "output" (SaveImage) | "temp" (PreviewImage)
    prefix: str
    pixels: Pixels


@dataclasses.dataclass
class Plan:
    stages: list[Stage]
    outputs: list[Output]
    order: list[str]  # every node the outputs depend on, dependencies first
