"""CLIP skip (A1111's "Clip skip", `CLIP_stop_at_last_layers`): condition on an earlier layer of the text encoder.

`clip_skip = N` counts layers from the end, A1111's way: 1 is the model's usual output, 2 the layer before it.

- SD 1.x/2.x: the context is `final_layer_norm(hidden_states[-N])` (N = 1: `last_hidden_state`), as A1111 and
  diffusers' `clip_skip = N - 1` (diffusers counts skipped layers: its 1 is A1111's 2).
- SDXL already conditions on the penultimate layer; N moves both encoders back by N - 1 layers,
  `hidden_states[-(N + 1)]`, without a final layer norm: diffusers' `clip_skip = N - 1`. The pooled embedding stays
  the last layer's. (A1111 itself ignores Clip skip for SDXL unless its "sdxl_clip_l_skip" option is set.)

Unlike diffusers, which skips layers for the prompt only, the negative prompt is encoded the same way (as A1111
does). The value is a per-image int32 input of the program, not part of it: changing it never recompiles, and one
batch may mix values.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np


def clip_skip_input(clip_skip: int | Sequence[int], n: int, num_layers: int) -> np.ndarray:
    """Per-image `clip_skip` `(n,)` int32 from one int or one per image; raises ValueError naming the argument."""
    values = list(clip_skip) if isinstance(clip_skip, (list, tuple, np.ndarray)) else [clip_skip] * n
    if len(values) != n:
        raise ValueError(f"clip_skip: got {len(values)} values for {n} images; pass one int, or one per image")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= num_layers:
            raise ValueError(
                f"clip_skip={v!r} must be an int from 1 (the last layer) to {num_layers} (this text encoder's "
                f"number of layers)"
            )
    return np.asarray(values, np.int32)


def select_layer(hidden_states: Sequence, skip_b, offset: int = 0):
    """Per image, `hidden_states[-(skip + offset)]` -> `(B, T, D)`; `skip_b` `(B,)` int32."""
    stacked_lbtd = jnp.stack(hidden_states)
    index_b = len(hidden_states) - skip_b.astype(jnp.int32) - offset
    return jnp.take_along_axis(stacked_lbtd, index_b[None, :, None, None], axis=0)[0]
