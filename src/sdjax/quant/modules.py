"""Running a model on quantized params: a module wrapper whose `apply` dequantizes right before the module runs, and
`quantize_pipeline`, which quantizes a loaded pipeline's params and wraps its modules.

Why not qwix's model integration (`qwix.quantize_model(module, PtqProvider(rules))` + `qwix.quantize_params`),
measured on the embedded UNet: weight-only int8 on `dot_general` (the Dense layers) works, but weight-only
convolutions are refused (`conv_general_dilated requires same act_qtype and weight_qtype`: its PTQ conv is int8 x
int8 only), and convolutions hold most of a UNet's weights; its params are qwix pytree nodes (`WithAux` over
`QArray`) that the sharding rules, LoRA fusing and the CPU Winograd preparation do not know. A params transformation
plus this wrapper covers every family's Dense and Conv kernels without touching the modules; qwix does the
quantization arithmetic (`sdjax.quant.scheme`). docs/quantization.md has the details.

Inside `jit` the params arrive as one-byte kernels plus per-channel scales, so device memory holds the quantized
weights; each kernel is dequantized into a temporary of the compute dtype, which XLA fuses into or schedules next to
its consumer. A denoiser's apply runs once per step inside the sampling loop; the quantized leaves pass through an
`optimization_barrier` with the call's array inputs first, which makes their dequantization depend on the loop
iteration, so XLA cannot hoist it out of the loop as loop-invariant code (which would keep a full-precision copy
of every kernel alive for the whole loop).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from sdjax.quant import compute as compute_lib
from sdjax.quant import params as params_lib


class DequantizingModule:
    """A Flax module that takes params with quantized kernels: `apply(variables, *args, **kwargs)` dequantizes
    `variables["params"]` to `dtype` and calls the wrapped module's `apply`. Everything else (`config`, `clone`,
    fields) is the wrapped module's; `clone` returns a wrapped clone."""

    def __init__(self, module: Any, dtype: Any, compute: str | None = None):
        self.module = module
        self.dtype = dtype
        self.compute = compute  # "fp8": Dense layers keep fp8 kernels and multiply in fp8 (`sdjax.quant.compute`)

    def apply(self, variables: Mapping[str, Any], *args, **kwargs):
        params = variables["params"]
        if not params_lib.has_quantized(params):
            return self.module.apply(variables, *args, **kwargs)
        arrays = [a for a in args if isinstance(a, jax.Array)]
        params, _ = jax.lax.optimization_barrier((params, arrays))
        if self.compute == "fp8":
            params = compute_lib.dequantize_except_dense(params, self.dtype)
            with nn.intercept_methods(compute_lib.fp8_dense_interceptor):
                return self.module.apply({**variables, "params": params}, *args, **kwargs)
        params = params_lib.dequantize_tree(params, self.dtype)
        return self.module.apply({**variables, "params": params}, *args, **kwargs)

    def clone(self, **kwargs) -> DequantizingModule:
        return DequantizingModule(self.module.clone(**kwargs), self.dtype, self.compute)

    def __getattr__(self, name: str):
        if name in ("module", "dtype", "compute"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"DequantizingModule({type(self.module).__name__})"


def wrap(module: Any, dtype: Any, compute: str | None = None) -> Any:
    """`module` wrapped (once) in a `DequantizingModule`; anything that is not a Flax module as it is."""
    if isinstance(module, DequantizingModule) or not isinstance(module, nn.Module):
        return module
    return DequantizingModule(module, dtype, compute)


def _wrap_fields(obj: Any, dtype: Any, compute: str | None = None) -> Any:
    """A frozen dataclass (a family's denoiser) with its Flax-module fields wrapped."""
    changes = {f.name: wrap(getattr(obj, f.name), dtype, compute) for f in dataclasses.fields(obj)}
    changes = {k: v for k, v in changes.items() if v is not getattr(obj, k)}
    return dataclasses.replace(obj, **changes) if changes else obj


def quantize_pipeline(pipe: Any, params: dict, quantize: str | params_lib.QuantPolicy | None):
    """A loaded pipeline and its params -> `(pipe, params)` with kernels quantized and the modules that read them
    wrapped to dequantize inside the program. `quantize`: `"int8"` / `"fp8"` (the denoiser's kernels,
    `QuantPolicy` defaults), a `QuantPolicy` (e.g. with the text encoders among its `components`, or another
    `min_size`), or None (both returned unchanged). Kernels the loader already quantized while converting
    (`sdjax.quant.loading`, `from_pretrained(quantize=)`) are kept as they are. The pipeline is changed in place:
    its params, its denoiser, its module attributes (`pipe.unet`, `pipe.text_encoder`, ...) and, when a text
    encoder is quantized, its conditioning (rebuilt by the family's `_conditioning()` from the wrapped encoders)."""
    policy = params_lib.resolve_policy(quantize, pipe.denoiser.component)
    if policy is None:
        return pipe, params
    unknown = [c for c in policy.components if c not in params]
    if unknown:
        raise ValueError(f"QuantPolicy.components names {unknown}, which this model's params lack ({sorted(params)})")
    params = params_lib.quantize_params(params, policy)
    dtype = pipe.dtype
    for name in policy.components:  # the pipeline's own attributes (pipe.unet, pipe.text_encoder, ...)
        if isinstance(getattr(pipe, name, None), nn.Module):
            setattr(pipe, name, wrap(getattr(pipe, name), dtype, policy.compute))
    pipe.denoiser = _wrap_fields(pipe.denoiser, dtype, policy.compute)
    gen = pipe.generator
    conditioning = gen.models.conditioning
    if any(c in conditioning.components for c in policy.components):
        conditioning = pipe._conditioning()
    gen.models = dataclasses.replace(gen.models, denoiser=pipe.denoiser, conditioning=conditioning)
    gen.cache.clear()
    pipe.params = params
    pipe.quantization = policy
    return pipe, params
