"""Which parameters are quantized (`QuantPolicy`) and the params-tree transformation both ways.

A quantized kernel keeps its path: the `kernel` leaf becomes the int8 / float8_e4m3fn values and a sibling leaf
`kernel_scale` (float32, one per output channel) is added next to it. Sharding rules, LoRA key matching and every
other consumer that finds a layer by its `.../kernel` path see the same path and shape; only the dtype changed.
Flax modules never see the pair: `dequantize_params` (inside the jitted program, `sdjax.quant.modules`) turns it back
into a float kernel of the compute dtype and drops `kernel_scale`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax.quant import scheme as scheme_lib
from sdjax.quant.calibration import as_calibration
from sdjax.quant.scheme import KERNEL, SCALE, SCALE_SUFFIX, is_quantized_node, quantized_kernels  # noqa: F401

# Below this many weights a kernel stays in high precision: SD's conv_in / conv_out (3x3x4x320 = 11,520), LCM's
# guidance projection; the memory they would save is negligible and the first and last layers are the most
# sensitive ones.
DEFAULT_MIN_SIZE = 16_384
# The params key of a pipeline's ControlNets: one tree, or a list / tuple of trees (one per net). ControlNets run
# weight-only (their families dequantize a net's kernels where it is applied; no module is wrapped for them).
CONTROLNET = "controlnet"
COMPUTE_MODES = ("int8", "fp8")  # QuantPolicy.compute besides None (weight-only); each needs its own scheme


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    """What `quantize_params` quantizes: every floating `kernel` leaf with at least `min_size` weights and two or
    more axes, in the params components named in `components`, whose path (`component/.../kernel`) matches none of
    the `exclude` regexes. Norms, biases, embeddings (`embedding` leaves), position tables and the VAE stay as they
    are."""

    scheme: str
    components: tuple[str, ...] = ("unet", "transformer")
    min_size: int = DEFAULT_MIN_SIZE
    exclude: tuple[str, ...] = ()
    # None: weight-only (kernels dequantized to the compute dtype in the program); "int8" / "fp8": Dense layers and
    # 2-D convs multiply 8-bit x 8-bit, their inputs quantized per call (`sdjax.quant.compute`; needs the same scheme)
    compute: str | None = None
    # with `compute`: False keeps the convolutions weight-only (only the Dense layers multiply 8-bit x 8-bit)
    compute_convs: bool = True
    # static input ranges of the compute layers (`sdjax.quant.calibration.Calibration`, or the path of its file);
    # None: each call's own max|x|. Needs `compute`; checked against the model by `quantize_pipeline`.
    calibration: Any = None

    def __post_init__(self):
        scheme_lib.check_scheme(self.scheme, "QuantPolicy.scheme")
        if self.compute is not None and self.compute not in COMPUTE_MODES:
            raise ValueError(
                f"QuantPolicy.compute={self.compute!r}: expected None (weight-only) or one of {COMPUTE_MODES}"
            )
        if self.compute is not None and self.scheme != self.compute:
            raise ValueError(
                f"QuantPolicy.compute={self.compute!r} needs scheme={self.compute!r} kernels, got "
                f"scheme={self.scheme!r}"
            )
        if not isinstance(self.compute_convs, bool):
            raise TypeError(f"QuantPolicy.compute_convs={self.compute_convs!r}: expected True or False")
        if self.calibration is not None:
            calibration = as_calibration(self.calibration)
            if self.compute is None:
                raise ValueError(
                    "QuantPolicy.calibration needs compute='int8' or 'fp8' (weight-only layers take no input scales)"
                )
            if calibration.compute != self.compute:
                raise ValueError(
                    f"QuantPolicy.calibration: {calibration.name} was recorded for compute={calibration.compute!r}, "
                    f"this policy has compute={self.compute!r}"
                )
            object.__setattr__(self, "calibration", calibration)
        if isinstance(self.components, str) or not all(isinstance(c, str) for c in self.components):
            raise TypeError(f"QuantPolicy.components={self.components!r} must be a tuple of params component names")
        if self.compute is not None and CONTROLNET in self.components:
            raise ValueError(
                f"QuantPolicy(components={self.components!r}, compute={self.compute!r}): ControlNets run weight-only; "
                f"leave {CONTROLNET!r} out of a compute policy (a pipeline's ControlNets loaded by name or path are "
                "then quantized weight-only with its scheme) or quantize them with their own weight-only policy"
            )

    def selects(self, path: str, kernel: Any) -> bool:
        shape = tuple(np.shape(kernel))
        return (
            len(shape) >= 2
            and int(np.prod(shape)) >= self.min_size
            and jnp.issubdtype(kernel.dtype, jnp.floating)
            and not any(re.fullmatch(p, path) for p in self.exclude)
        )


def check_quantize(quantize: Any) -> str | QuantPolicy | None:
    """`quantize=` as the loaders take it: None (no quantization), `"int8"`, `"fp8"` (the denoiser's kernels with the
    default policy) or a `QuantPolicy`; anything else raises a ValueError naming the argument and the allowed
    values (the loaders call it before anything loads)."""
    if quantize is None or isinstance(quantize, QuantPolicy):
        return quantize
    if not isinstance(quantize, str) or quantize not in scheme_lib.SCHEMES:
        raise ValueError(
            f"quantize={quantize!r}: expected one of {sorted(scheme_lib.SCHEMES)}, a sdjax.quant.QuantPolicy, "
            "or None (no quantization)"
        )
    return quantize


def resolve_policy(quantize: Any, denoiser_component: str) -> QuantPolicy | None:
    """`quantize=` as a `QuantPolicy`: `"int8"` / `"fp8"` -> the default policy over the denoiser's params
    (`denoiser_component`: "unet", "transformer"); a `QuantPolicy` as it is; None -> None. The one place a scheme
    name becomes a policy (`quantize_pipeline` and the loaders that quantize while converting use it)."""
    quantize = check_quantize(quantize)
    if isinstance(quantize, str):
        return QuantPolicy(quantize, components=(denoiser_component,))
    return quantize


def controlnet_policy(policy: QuantPolicy | None, denoiser_component: str) -> QuantPolicy | None:
    """The weight-only policy of a ControlNet that a pipeline quantized with `policy` loads by name or path (or
    `sdjax compile` adds): a ControlNet is quantized as the denoiser it steers (`policy` names the denoiser's
    component or "controlnet"): the same scheme, `min_size` and `exclude` over the "controlnet" params; None when
    `policy` is None or leaves the denoiser in full precision. A `(module, params)` pair the caller passes keeps
    the params it has (`load_controlnet(..., quantize=)` quantizes one)."""
    if policy is None or not ({denoiser_component, CONTROLNET} & set(policy.components)):
        return None
    return QuantPolicy(policy.scheme, components=(CONTROLNET,), min_size=policy.min_size, exclude=policy.exclude)


def quantize_tree(tree: Any, policy: QuantPolicy, path: str = "") -> Any:
    """One component's params with the selected kernels quantized (a new tree; other leaves are the same objects)."""
    if not isinstance(tree, Mapping):
        return tree
    if is_quantized_node(tree):
        return tree  # already quantized: kept as it is
    out = {k: quantize_tree(v, policy, f"{path}/{k}" if path else str(k)) for k, v in tree.items()}
    kernel = tree.get(KERNEL)
    if kernel is not None:
        quantized = quantize_selected(policy, f"{path}/{KERNEL}", kernel)
        if quantized is not None:
            out[KERNEL], out[SCALE] = quantized
    return out


def quantize_selected(policy: QuantPolicy, path: str, kernel: Any) -> tuple[Any, Any] | None:
    """`(q, scale)` of the `kernel` leaf at `path` (`component/.../kernel`) when `policy` selects it, else None.
    `quantize_tree` calls it for every kernel of a loaded tree, the loaders' per-tensor hook
    (`sdjax.quant.loading`) for each kernel as it is converted: the same rule and arithmetic, so both give the
    same values. A `jax.ShapeDtypeStruct` (abstract params, AOT compiles) gives the quantized shapes only."""
    if isinstance(kernel, Mapping) or not policy.selects(path, kernel):
        return None
    if isinstance(kernel, jax.ShapeDtypeStruct):
        qtype = scheme_lib.SCHEMES[policy.scheme]
        return (
            jax.ShapeDtypeStruct(kernel.shape, qtype, sharding=kernel.sharding),
            jax.ShapeDtypeStruct(kernel.shape[-1:], jnp.float32),
        )
    return scheme_lib.quantize_kernel(kernel, policy.scheme)


def quantize_params(params: Mapping[str, Any], policy: QuantPolicy) -> dict[str, Any]:
    """A pipeline's params (component -> tree) with the policy's components quantized; the others unchanged. A
    component held as a list or tuple of trees (several ControlNets under "controlnet") has each tree quantized."""

    def component(k: str, v: Any) -> Any:
        if k not in policy.components:
            return v
        if isinstance(v, (list, tuple)):
            return type(v)(quantize_tree(t, policy, k) for t in v)
        return quantize_tree(v, policy, k)

    return {k: component(k, v) for k, v in params.items()}


def dequantize_tree(tree: Any, dtype: Any) -> Any:
    """Every `{kernel, kernel_scale}` pair -> a float `kernel` of `dtype` (the scale dropped); anything else as is."""
    if not isinstance(tree, Mapping):
        return tree
    out = {k: dequantize_tree(v, dtype) for k, v in tree.items() if k != SCALE}
    if is_quantized_node(tree):
        out[KERNEL] = scheme_lib.dequantize_kernel(tree[KERNEL], tree[SCALE], dtype)
    return out


def has_quantized(tree: Any) -> bool:
    if not isinstance(tree, Mapping):
        return False
    return is_quantized_node(tree) or any(has_quantized(v) for v in tree.values())


def nbytes(tree: Any) -> int:
    """Bytes of every array leaf of `tree` (arrays or ShapeDtypeStructs)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def fuse_delta(q: Any, scale: Any, fuse, *args) -> tuple[jax.Array, jax.Array]:
    """A LoRA delta on a quantized kernel: dequantize to float32, `fuse(kernel_f32, *args)` (the caller's
    `base + delta`, in float32), quantize again with a new per-channel scale (same scheme). The delta is added in
    float32; the result carries one more rounding, at most half a (new) scale step per weight for int8."""
    merged = fuse(scheme_lib.dequantize_kernel(q, scale, jnp.float32), *args)
    return scheme_lib.quantize_kernel(merged, scheme_lib.scheme_of(q.dtype))
