"""The contracts the generation core speaks to: a family's `Denoiser` and its `Conditioning`, and `Feature`s
(conditioning or task features that join the loop as hooks) with the `FeatureRequest`s that carry their per-call
params and arrays.

The core (`generator.program`, `loop.denoise`, the tasks) never names a model architecture. A model family
(`sdjax.families`) supplies:

- a `Conditioning`: prompts -> host arrays (`text_inputs`, `host_inputs`), and inside the program those arrays ->
  an opaque conditioning value `cond` (`encode`), which only the family's own denoiser (and its own features)
  reads. It also says which prompt syntaxes it reads (`accepts_prompt_syntax`) and which options take one value
  per image (`per_image_options`, padded with the batch by the generator);
- a `Denoiser`: the network that predicts from noisy latents, behind one call. `bind(params, cond, inputs, cfg=)`
  runs once per program, outside the loop (preparing kernels, embeddings, packing ids), and returns
  `model(x_in, t, **kwargs)`: latents `(rows, in_channels, h, w)` in the sampler's layout (NCHW, unpacked) and the
  sampler's timestep `t` -> the model output in the same layout (epsilon, v, sample or flow velocity: the sampler
  knows which). Packing to tokens, timestep scaling and guidance embeddings are the denoiser's business.

This is k-diffusion's "one denoiser contract" for a jitted world: everything family-specific is decided when the
program is traced, nothing at run time.

A `Feature` is everything one conditioning feature adds to a program, in one object: it is hashable and sits in
`ProgramSpec.features` (the compile key); inside the program it reads its own params entry
(`params[feature.params_key]`) and its own input arrays and returns a loop `Hook`; `example_inputs` gives the
shapes of those arrays for compiling ahead. The per-call side is a `FeatureRequest`: the feature (`spec`), its
params, and `arrays(start=, end=, calls=)`, the host arrays of one call. The generator checks both before
anything is compiled: names and params keys unique among a program's features, every params key present, and no
input array named twice (by two features, or by a feature and the program's own inputs).

A conditioning that reads `prompt_syntax="a1111"` (`accepts_prompt_syntax("a1111")`) returns from
`text_inputs(..., syntax="a1111")` the token weights too (`weights`, `neg_weights`) and the chunk count (`chunks`,
0 for the plain program), and its `encode` reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import numpy as np

if TYPE_CHECKING:
    from sdjax.core.loop import Hook

PROMPT_SYNTAXES = ("plain", "a1111")  # how prompt text is read: as it is, or with AUTOMATIC1111's weights and BREAK


@runtime_checkable
class Conditioning(Protocol):
    """Text (and family micro-) conditioning of one model."""

    name: str  # the family's name (its key in `sdjax.families.FAMILIES`), for messages
    components: tuple[str, ...]  # the params keys `encode` reads (e.g. ("text_encoder", "text_encoder_2"))
    # `host_inputs` options that may be given as one value per image (a list of N); the generator pads such a list
    # to the padded batch by repeating its last value (padding images are dropped, so any valid value does)
    per_image_options: tuple[str, ...]

    def accepts_prompt_syntax(self, syntax: str) -> bool:
        """Whether prompts may be read with `syntax` (one of `PROMPT_SYNTAXES`; every conditioning reads "plain")."""
        ...

    def text_inputs(
        self, prompts: Sequence[str], negative_prompts: Sequence[str], *, syntax: str = "plain"
    ) -> dict[str, np.ndarray]:
        """Host arrays of the prompts and negative prompts (token ids), each with a leading batch dimension, read
        with `syntax` (one it accepts; see the module docstring for "a1111")."""
        ...

    def host_inputs(
        self, *, negative_prompts: Sequence[str], height: int, width: int, task: str, **options: Any
    ) -> dict[str, np.ndarray]:
        """Per-image conditioning beyond the prompt text (options a family takes by name; unknown ones raise)."""
        ...

    def encode(self, params: dict, inputs: dict, *, cfg: bool) -> Any:
        """Inside the program: host arrays -> the denoiser's conditioning (stacked uncond, cond with `cfg`)."""
        ...


@runtime_checkable
class Denoiser(Protocol):
    """The network of a family behind one call (see the module docstring)."""

    component: str  # the params key of its weights (e.g. "transformer")
    in_channels: int  # channels of the latents it takes (more than the VAE's for inpainting models)
    distilled_guidance: bool  # the guidance scale is an input of the network (one branch, no CFG)

    def bind(self, params: dict, cond: Any, inputs: dict, *, cfg: bool) -> Callable[..., jax.Array]:
        """`model(x_in, t, **kwargs) -> output`, everything constant over the loop computed once."""
        ...

    def with_attention(self, attention: str) -> Denoiser:
        """The same denoiser traced with another attention implementation (`sdjax.ops.attention`)."""
        ...


@runtime_checkable
class Feature(Protocol):
    """A conditioning or task feature that joins the program as a loop hook (see the module docstring).

    Hashable and static: it is part of the compile key (`ProgramSpec.features`). Its params are `params[params_key]`
    (given with the model's params, or by its `FeatureRequest`); its per-image arrays are program inputs (the
    request's `arrays`), of the shapes `example_inputs` gives, under keys no other feature and no program input use."""

    name: str  # for messages; unique among the features of one program
    params_key: str  # the params entry its hook reads; unique among the features of one program

    def hook(
        self,
        params: Any,
        inputs: dict,
        *,
        cond: Any,
        cfg: bool,
        latent_channels: int,
        encode: Callable[[jax.Array, int], jax.Array] | None = None,
    ) -> Hook:
        """Inside the program: the loop hook, from the feature's params, the program inputs and the family's
        `cond` (which a feature made for that family may read). `encode(images_nchw, stream)` is the program's
        VAE encoder (images in [-1, 1] -> the denoiser's latents, the posterior sample drawn from each image's key
        and the noise stream `stream`), for a feature that conditions on latents."""
        ...

    def example_inputs(self, *, batch: int, height: int, width: int, calls: int) -> dict[str, np.ndarray]:
        """Zero program inputs of the shapes a program of `calls` model calls takes (for compiling ahead)."""
        ...


Control = Feature  # the earlier name of the single feature slot (kept for code that imports it)


@runtime_checkable
class FeatureRequest(Protocol):
    """One call's side of a `Feature`: the feature, its params (put in the program's params under
    `spec.params_key`) and its per-image host arrays (leading dimension the batch)."""

    spec: Feature
    params: Any

    def arrays(self, *, start: int, end: int, calls: int) -> dict[str, Any]:
        """The program inputs for the window `[start, end)` of a schedule of `calls` model calls."""
        ...
