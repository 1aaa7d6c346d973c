"""Quantizing while loading: the selected kernels of a component are quantized one at a time, as each tensor is
converted, so loading never holds the component's full-precision weights.

The loaders convert a checkpoint tensor by tensor (`sdjax.models.convert.convert_state_dict`: read -> Flax layout
-> `cast` to the params dtype). `QuantizingCast` wraps that cast: for a `kernel` leaf the policy selects
(`QuantPolicy.selects`, the same rule and the same `quantize_selected` as `quantize_tree`) it quantizes the cast
kernel right away (`scheme.quantize_kernel`) and returns the int8 / float8 values in its place; the float kernel is
dropped before the next tensor is read. The per-channel scales are kept aside and put next to their kernels
(`kernel_scale`) when the conversion is done (`convert_quantized`). Host (or device) memory during loading is then
about the quantized component plus one float kernel, instead of the float component plus its quantized copy.

Every loader that converts tensor by tensor goes through `convert_quantized`: diffusers folders
(`loading.components`), SD original-layout single files (`loading.single_file`), Flux transformer, T5 and CLIP-L
files (`families.flux.weights`), SD 3 files (`families.sd3.weights`). A single-file loader that takes some
components from a config folder passes that folder's loader the policy without the components it converted itself
(`policy_without`).

The values are those of loading in full precision and calling `quantize_tree` afterwards: the same kernel (the
cast's output) goes through the same function. `quantize_pipeline` still runs after loading: it keeps the kernels
quantized here (`quantize_tree` leaves a `{kernel, kernel_scale}` pair as it is), quantizes any selected kernel a
loader converted without the per-tensor hook (old Flax msgpack weights, which are read whole anyway), and wraps
the modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from sdjax.quant import params as params_lib


class QuantizingCast:
    """A loader's per-tensor cast that also quantizes the kernels `policy` selects in the params of `component`
    (the params key: "unet", "transformer", ...). `convert_state_dict` calls it as `cast(value, path=...)` (it
    checks `takes_path`) with the leaf's path inside the component; called without a path it only casts.
    `attach_scales` adds the `kernel_scale` leaves to the converted tree."""

    takes_path = True

    def __init__(self, cast: Callable[[Any], Any], policy: params_lib.QuantPolicy, component: str):
        self.cast = cast
        self.policy = policy
        self.component = component
        self.scales: dict[tuple[str, ...], Any] = {}

    def __call__(self, value: Any, path: tuple[str, ...] | None = None) -> Any:
        leaf = self.cast(value)
        if not path or path[-1] != params_lib.KERNEL:
            return leaf
        quantized = params_lib.quantize_selected(self.policy, "/".join((self.component, *path)), leaf)
        if quantized is None:
            return leaf
        del leaf  # the float copy goes here, before the next tensor is read
        q, scale = quantized
        self.scales[tuple(path)] = scale
        return q

    def attach_scales(self, tree: dict) -> dict:
        """`tree` (the converted params, nested dicts) with each quantized kernel's `kernel_scale` beside it."""
        for path, scale in self.scales.items():
            node = tree
            for key in path[:-1]:
                node = node[key]
            node[params_lib.SCALE] = scale
        self.scales = {}
        return tree


def convert_quantized(
    convert: Callable[[Callable[[Any], Any]], dict],
    cast: Callable[[Any], Any],
    policy: params_lib.QuantPolicy | None,
    component: str,
) -> dict:
    """`convert(cast)` (a loader's conversion of one component, taking its per-tensor cast) with the kernels that
    `policy` selects in `component` quantized as they are converted (`QuantizingCast`); `convert(cast)` as it is
    when `policy` is None or does not name `component`."""
    if policy is None or component not in policy.components:
        return convert(cast)
    quantizing = QuantizingCast(cast, policy, component)
    return quantizing.attach_scales(convert(quantizing))


def policy_without(policy: params_lib.QuantPolicy | None, done: Iterable[str]) -> params_lib.QuantPolicy | None:
    """`policy` over only the components that are not in `done`, or None when none is left. A single-file loader
    converts some components from its files (with `policy`) and takes the rest from a config folder: this is the
    policy it passes on to the folder's loader, so that each component is quantized once, while it is converted,
    and the folder's loader does not look for the components it was not asked to load."""
    if policy is None:
        return None
    done = set(done)
    rest = tuple(c for c in policy.components if c not in done)
    return dataclasses.replace(policy, components=rest) if rest else None
