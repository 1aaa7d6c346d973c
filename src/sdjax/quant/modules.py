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
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax

from sdjax.quant import calibration as calibration_lib
from sdjax.quant import compute as compute_lib
from sdjax.quant import params as params_lib


class DequantizingModule:
    """A Flax module that takes params with quantized kernels: `apply(variables, *args, **kwargs)` dequantizes
    `variables["params"]` to `dtype` and calls the wrapped module's `apply`. Everything else (`config`, `clone`,
    fields) is the wrapped module's; `clone` returns a wrapped clone.

    `compute` ("int8" / "fp8", `sdjax.quant.compute`): Dense layers and (with `convs`) 2-D convs whose kernel is
    stored in that type keep it and multiply 8-bit x 8-bit; `amax` (module path -> static input range, from a
    calibration) and `observe` (the calibration pass's recorder) go to its `QuantizedLayers` interceptor."""

    def __init__(
        self,
        module: Any,
        dtype: Any,
        compute: str | None = None,
        *,
        amax: Mapping[str, float] | None = None,
        observe: Callable[[str, Any], None] | None = None,
        convs: bool = True,
    ):
        self.module = module
        self.dtype = dtype
        self.compute = compute
        self.amax = amax
        self.observe = observe
        self.convs = convs

    def apply(self, variables: Mapping[str, Any], *args, **kwargs):
        params = variables["params"]
        if not params_lib.has_quantized(params):
            return self.module.apply(variables, *args, **kwargs)
        arrays = [a for a in args if isinstance(a, jax.Array)]
        params, _ = jax.lax.optimization_barrier((params, arrays))
        if self.compute is not None:
            params = compute_lib.dequantize_except_compute(params, self.dtype, self.compute, self.convs)
            interceptor = compute_lib.QuantizedLayers(self.compute, self.amax, self.observe, self.convs)
            with nn.intercept_methods(interceptor):
                return self.module.apply({**variables, "params": params}, *args, **kwargs)
        params = params_lib.dequantize_tree(params, self.dtype)
        return self.module.apply({**variables, "params": params}, *args, **kwargs)

    def clone(self, **kwargs) -> DequantizingModule:
        return DequantizingModule(
            self.module.clone(**kwargs),
            self.dtype,
            self.compute,
            amax=self.amax,
            observe=self.observe,
            convs=self.convs,
        )

    def __getattr__(self, name: str):
        if name in ("module", "dtype", "compute", "amax", "observe", "convs"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"DequantizingModule({type(self.module).__name__})"


def wrap(module: Any, dtype: Any, compute: str | None = None, **kwargs) -> Any:
    """`module` wrapped in a `DequantizingModule` (a wrapped one is wrapped anew around its Flax module, with these
    options); anything that is not a Flax module as it is. `kwargs`: `amax`, `observe`, `convs`."""
    if isinstance(module, DequantizingModule):
        module = module.module
    if not isinstance(module, nn.Module):
        return module
    return DequantizingModule(module, dtype, compute, **kwargs)


def apply_dequantized(module: Any, variables: Mapping[str, Any], *args, **kwargs):
    """`module.apply(variables, ...)` on params that may hold quantized kernels (weight-only, dequantized to the
    module's `dtype` inside the program, as `DequantizingModule` does); params without any run as they are. The
    ControlNet families call their nets through it, so a quantized net's params work in any pipeline."""
    return DequantizingModule(module, module.dtype).apply(variables, *args, **kwargs)


def install(pipe: Any, policy: params_lib.QuantPolicy, observe: Callable[[str, str, Any], None] | None = None):
    """Wrap the modules of `policy.components` in `pipe` (its attributes `pipe.unet`, `pipe.text_encoder`, ...,
    the denoiser's module fields, named as the components) for `policy`: its compute mode, and the static input
    ranges of its calibration. `observe(component, path, amax)`: the calibration pass's recorder instead. The
    generator's models are rebuilt (the conditioning too when a text encoder is wrapped, the VAE when "vae" is a
    component) and its cache cleared."""
    dtype = pipe.dtype

    def options(component: str) -> dict:
        if observe is not None:
            return {"observe": functools.partial(observe, component), "convs": policy.compute_convs}
        if policy.calibration is not None:
            return {"amax": policy.calibration.amax_for(component), "convs": policy.compute_convs}
        return {"convs": policy.compute_convs}

    for name in policy.components:
        if name == params_lib.CONTROLNET:  # applied through `apply_dequantized` where the family runs the nets
            continue
        if isinstance(getattr(pipe, name, None), (nn.Module, DequantizingModule)):
            setattr(pipe, name, wrap(getattr(pipe, name), dtype, policy.compute, **options(name)))
    denoiser = pipe.denoiser
    changes = {}
    for f in dataclasses.fields(denoiser):
        value = getattr(denoiser, f.name)
        if isinstance(value, (nn.Module, DequantizingModule)):
            mine = f.name in policy.components
            changes[f.name] = wrap(value, dtype, policy.compute if mine else None, **(options(f.name) if mine else {}))
    pipe.denoiser = dataclasses.replace(denoiser, **changes) if changes else denoiser
    gen = pipe.generator
    conditioning = gen.models.conditioning
    if any(c in conditioning.components for c in policy.components):
        conditioning = pipe._conditioning()
    vae = gen.models.vae
    if "vae" in policy.components and isinstance(vae, (nn.Module, DequantizingModule)):
        vae = wrap(vae, dtype, policy.compute, **options("vae"))  # the generator's own VAE (encode and decode)
    gen.models = dataclasses.replace(gen.models, denoiser=pipe.denoiser, conditioning=conditioning, vae=vae)
    gen.cache.clear()


def quantize_pipeline(pipe: Any, params: dict, quantize: str | params_lib.QuantPolicy | None):
    """A loaded pipeline and its params -> `(pipe, params)` with kernels quantized and the modules that read them
    wrapped to dequantize inside the program. `quantize`: `"int8"` / `"fp8"` (the denoiser's kernels,
    `QuantPolicy` defaults), a `QuantPolicy` (e.g. with the text encoders among its `components`, another
    `min_size`, a `compute` mode and its `calibration`), or None (both returned unchanged). Kernels the loader
    already quantized while converting (`sdjax.quant.loading`, `from_pretrained(quantize=)`) are kept as they are.
    A calibration is checked against the quantized params (`Calibration.check`: another model's file is refused,
    naming the file and the first layer that differs). The pipeline is changed in place: its params, its denoiser,
    its module attributes (`pipe.unet`, `pipe.text_encoder`, ...) and, when a text encoder is quantized, its
    conditioning (rebuilt by the family's `_conditioning()` from the wrapped encoders). The params' ControlNet(s)
    ("controlnet", a folder's own), when the denoiser is quantized, are quantized weight-only with its scheme
    (`params_lib.controlnet_policy`; a policy naming "controlnet" decides for them instead)."""
    policy = params_lib.resolve_policy(quantize, pipe.denoiser.component)
    if policy is None:
        return pipe, params
    unknown = [c for c in policy.components if c not in params]
    if unknown:
        raise ValueError(f"QuantPolicy.components names {unknown}, which this model's params lack ({sorted(params)})")
    params = params_lib.quantize_params(params, policy)
    follow = params_lib.controlnet_policy(policy, pipe.denoiser.component)
    if follow is not None and params_lib.CONTROLNET in params and params_lib.CONTROLNET not in policy.components:
        params = params_lib.quantize_params(params, follow)  # a folder's own ControlNet, as its denoiser
    if policy.calibration is not None:
        policy.calibration.check(params, policy)
    install(pipe, policy)
    pipe.params = params
    pipe.quantization = policy
    return pipe, params


# ------------------------------------------------------------------ calibration passes (quant/calibration.py)
def calibrate(
    pipe: Any, prompts: str | Sequence[str], steps: int = 8, **generate_kwargs
) -> calibration_lib.Calibration:
    """Record the input ranges of `pipe`'s compute layers over `prompts` (one `pipe.generate` call, a batch of
    `len(prompts)` images, `steps` sampling steps; `generate_kwargs` pass through, e.g. `seed`, `height`).
    `pipe` must be quantized with a compute mode (`quantize=QuantPolicy(..., compute="int8" | "fp8")`); its
    modules are put back as they were afterwards (and its compiled programs dropped). Returns the `Calibration`;
    `save` it next to the weights, or use it at once with `use_calibration`."""
    policy = getattr(pipe, "quantization", None)
    if policy is None or policy.compute is None:
        raise ValueError(
            "calibrate(pipe): the pipeline has no quantized compute; load it with "
            "quantize=sdjax.quant.QuantPolicy('int8', compute='int8') (or 'fp8')"
        )
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"calibrate(prompts={prompts!r}): expected one or more prompt strings")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"calibrate(steps={steps!r}): expected a positive number of sampling steps")
    seen: dict[str, float] = {}
    lock = threading.Lock()

    def observe(component: str, path: str, amax: Any) -> None:
        key = f"{component}/{path}/{params_lib.KERNEL}"
        with lock:
            seen[key] = max(seen.get(key, 0.0), float(amax))

    install(pipe, dataclasses.replace(policy, calibration=None), observe=observe)
    try:
        generate_kwargs.setdefault("output_type", "np")
        pipe.generate(prompts, steps=steps, **generate_kwargs)
        jax.effects_barrier()
    finally:
        install(pipe, policy)
    layers = {
        path: calibration_lib.LayerRecord(shape, digest, seen.get(path))
        for path, (shape, digest) in calibration_lib.fingerprint(pipe.params, policy).items()
    }
    return calibration_lib.Calibration(policy.compute, layers, tuple(prompts), steps, convs=policy.compute_convs)


def use_calibration(pipe: Any, calibration: calibration_lib.Calibration | str | os.PathLike) -> Any:
    """`pipe` (quantized with a compute mode) running on the static input ranges of `calibration` (a
    `Calibration` or its file), checked against the model first. Returns the pipeline (changed in place)."""
    policy = getattr(pipe, "quantization", None)
    if policy is None or policy.compute is None:
        raise ValueError("use_calibration(pipe): the pipeline has no quantized compute (QuantPolicy.compute)")
    quantize_pipeline(pipe, pipe.params, dataclasses.replace(policy, calibration=calibration))
    return pipe
