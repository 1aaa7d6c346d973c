"""The one denoising loop every model family and every task runs.

`denoise` advances latents through the model calls `[start, end)` of a sampler's schedule (k-diffusion's
"denoiser as a function" in spirit: the loop knows nothing of text, images or masks):

    for i in [start, end):
        x_in   = scale_model_input(x, i), doubled for classifier-free guidance (uncond first)
        x_in   = hook.model_input(i, x_in)          # e.g. concatenate mask + masked-image latents (inpainting models)
        extra  = hook.model_kwargs(i, x_in, t)      # e.g. a conditioning network's residuals
        out    = model(x_in, t, **extra)
        guided = uncond + g (cond - uncond), optionally rescaled (Lin et al. 2023, sec. 3.4)
        x      = sampler.step(x, guided, noise of step i)
        x      = hook.after_step(i, x, state)       # e.g. inpainting's latent blending for plain models

Step indices are absolute (img2img starts at a later index of the full schedule, as diffusers does after
`set_begin_index`), and `start`/`end` may be traced: changing the strength does not recompile. Guidance follows
diffusers: an image whose scale is <= 1 gets the conditional prediction alone. With `cfg=False` (every scale of the
batch <= 1: few-step distilled models) the unconditional half is not computed at all.

A host callback (`on_step(step, total) -> stop`) can report progress and stop the loop between two model calls;
it is fixed at trace time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


class Hook:
    """A per-step extension of the loop. Every method is traced inside the loop body; the defaults do nothing."""

    def model_input(self, step: jax.Array, x_in: jax.Array) -> jax.Array:
        """The model's input after `scale_model_input` (and CFG doubling)."""
        return x_in

    def model_kwargs(self, step: jax.Array, x_in: jax.Array, t: jax.Array) -> dict[str, Any]:
        """Extra keyword arguments for the model call (summed with other hooks' arguments of the same name)."""
        return {}

    def after_step(self, step: jax.Array, x: jax.Array, state: Any) -> jax.Array:
        """The latents after the sampler's step `step`."""
        return x


def guide(out: jax.Array, guidance: jax.Array, *, cfg: bool, rescale: float = 0.0) -> jax.Array:
    """Classifier-free guidance of a model output over the stacked (uncond, cond) batch -> `(B, ...)`.

    `guidance` is `(B,)`; images with a scale <= 1 take the conditional prediction (diffusers' rule).
    """
    if not cfg:
        return out
    uncond, cond = jnp.split(out, 2)
    g = guidance.reshape((-1,) + (1,) * (out.ndim - 1))
    guided = uncond + g * (cond - uncond)
    if rescale > 0:
        guided = rescale_noise_cfg(guided, cond, rescale)
    return jnp.where(g > 1, guided, cond)


def rescale_noise_cfg(guided: jax.Array, cond: jax.Array, rescale: float) -> jax.Array:
    """Rescale guided noise toward the conditional prediction's per-image std (Lin et al. 2023, sec. 3.4)."""
    axes = tuple(range(1, guided.ndim))
    std_cond = jnp.std(cond, axis=axes, keepdims=True)
    std_guided = jnp.std(guided, axis=axes, keepdims=True)
    rescaled = guided * (std_cond / std_guided)
    return rescale * rescaled + (1 - rescale) * guided


def step_noise(sampler, keys: jax.Array, step: jax.Array, state: Any, shape: tuple[int, ...]) -> jax.Array:
    """The noise a stochastic sampler adds at model call `step`: its `draw_noise` (a standard normal from each
    image's key, or a Brownian tree's increment for DPM++ SDE)."""
    return sampler.draw_noise(keys, step, state, shape)


# A host callback's operands reach Python through a copy onto the CPU device; jax makes a copy of 100 KiB or more
# asynchronously, on a thread that, on a CPU mesh using every (simulated) device, the program's collectives all hold
# while they wait for the callback: a deadlock (XLA aborts after 40 s). Latents therefore cross in pieces below that.
_HOST_PIECE = 16384  # float32 elements: 64 KiB


def _pieces(x: jax.Array) -> list[jax.Array]:
    """`x` flattened into pieces of at most `_HOST_PIECE` elements (for a host callback; `_host` joins them)."""
    flat = x.reshape(-1)
    return [flat[i : i + _HOST_PIECE] for i in range(0, flat.shape[0], _HOST_PIECE)]


def _host(fn: Callable[..., bool], n_scalars: int, latents_shape: tuple[int, ...] | None) -> Callable[..., np.bool_]:
    def call(*args):
        scalars = (int(a) for a in args[:n_scalars])
        if latents_shape is None:
            return np.bool_(fn(*scalars))
        latents = np.concatenate([np.asarray(a) for a in args[n_scalars:]]).reshape(latents_shape)
        return np.bool_(fn(*scalars, latents=latents))

    call.on_step = fn  # what it calls, for `core.cache.callback_sites`
    return call


def merge_kwargs(hooks: Sequence[Hook], step, x_in, t) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for hook in hooks:
        for name, value in hook.model_kwargs(step, x_in, t).items():
            if name in merged:
                merged[name] = jax.tree_util.tree_map(jnp.add, merged[name], value)
            else:
                merged[name] = value
    return merged


def denoise(
    *,
    model: Callable[..., jax.Array],
    sampler: Any,
    state: Any,
    latents: jax.Array,
    start: jax.Array | int,
    end: jax.Array | int,
    keys: jax.Array,
    guidance: jax.Array,
    cfg: bool = True,
    guidance_rescale: float = 0.0,
    hooks: Sequence[Hook] = (),
    on_step: Callable[..., bool] | None = None,
    on_step_args: tuple = (),
    on_step_latents: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Run model calls `[start, end)` -> `(latents, stopped)`.

    `model(x_in, t, **kwargs)` returns the prediction for the (doubled, with `cfg`) batch; `state` is the sampler's
    state after `set_timesteps`; `keys` `(B, 2)` are the images' keys (stochastic samplers draw their noise from
    them); `guidance` `(B,)`. `on_step(*on_step_args, step, total)`, if given, is called on the host after each
    model call with the 1-based count within the window and the window's length (as Python ints) and returns
    whether to stop; `stopped` is True when it did. With `on_step_latents` it also gets the current latents
    (`latents=`, a host array), e.g. for previews.
    """
    start = jnp.asarray(start, jnp.int32)
    end = jnp.asarray(end, jnp.int32)

    def body(carry):
        i, x, st, _ = carry
        t = st.timesteps[i]
        x_in = sampler.scale_model_input(st, x, i)
        if cfg:
            x_in = jnp.concatenate([x_in, x_in])
        for hook in hooks:
            x_in = hook.model_input(i, x_in)
        out = model(x_in, t, **merge_kwargs(hooks, i, x_in, t)).astype(jnp.float32)
        guided = guide(out, guidance, cfg=cfg, rescale=guidance_rescale)
        noise = step_noise(sampler, keys, i, st, x.shape) if sampler.stochastic else None
        x, st = sampler.step(st, guided, i, x, noise=noise)
        for hook in hooks:
            x = hook.after_step(i, x, st)
        stop = jnp.zeros((), bool)
        if on_step is not None:
            stop = io_callback(
                _host(on_step, len(on_step_args) + 2, x.shape if on_step_latents else None),
                jax.ShapeDtypeStruct((), jnp.bool_),
                *on_step_args,
                i - start + 1,
                end - start,
                *(_pieces(x) if on_step_latents else ()),
                ordered=False,
            )
        return i + 1, x, st, stop

    def cond(carry):
        i, _, _, stop = carry
        return (i < end) & ~stop

    _, latents, _, stopped = jax.lax.while_loop(cond, body, (start, latents, state, jnp.zeros((), bool)))
    return latents, stopped
