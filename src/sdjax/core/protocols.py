"""The two contracts the generation core speaks to: a family's `Denoiser` and its `Conditioning`.

The core (`generator.program`, `loop.denoise`, the tasks) never names a model architecture. A model family
(`sdjax.families`) supplies:

- a `Conditioning`: prompts -> host arrays (`text_inputs`, `host_inputs`), and inside the program those arrays ->
  an opaque conditioning value `cond` (`encode`), which only the family's own denoiser reads;
- a `Denoiser`: the network that predicts from noisy latents, behind one call. `bind(params, cond, inputs, cfg=)`
  runs once per program, outside the loop (preparing kernels, embeddings, packing ids), and returns
  `model(x_in, t, **kwargs)`: latents `(rows, in_channels, h, w)` in the sampler's layout (NCHW, unpacked) and the
  sampler's timestep `t` -> the model output in the same layout (epsilon, v, sample or flow velocity: the sampler
  knows which). Packing to tokens, timestep scaling and guidance embeddings are the denoiser's business.

This is k-diffusion's "one denoiser contract" for a jitted world: everything family-specific is decided when the
program is traced, nothing at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np


@runtime_checkable
class Conditioning(Protocol):
    """Text (and family micro-) conditioning of one model."""

    components: tuple[str, ...]  # the params keys `encode` reads (e.g. ("text_encoder", "text_encoder_2"))

    def text_inputs(self, prompts: Sequence[str], negative_prompts: Sequence[str]) -> dict[str, np.ndarray]:
        """Host arrays of the prompts and negative prompts (token ids), each with a leading batch dimension."""
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

    component: str  # the params key of its weights ("unet", "transformer")
    in_channels: int  # channels of the latents it takes (more than the VAE's for inpainting models)
    distilled_guidance: bool  # the guidance scale is an input of the network (one branch, no CFG)

    def bind(self, params: dict, cond: Any, inputs: dict, *, cfg: bool) -> Callable[..., jax.Array]:
        """`model(x_in, t, **kwargs) -> output`, everything constant over the loop computed once."""
        ...

    def with_attention(self, attention: str) -> Denoiser:
        """The same denoiser traced with another attention implementation (`sdjax.ops.attention`)."""
        ...
