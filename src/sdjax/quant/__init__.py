"""Weight-only quantization (int8 per channel, float8 e4m3 per channel) for every family: docs/quantization.md.

`scheme`: one kernel's quantize / dequantize (qwix's arithmetic); `params`: which kernels (`QuantPolicy`) and the
params-tree transformation; `loading`: the same quantization applied per tensor while a loader converts (so a
quantized load never holds the denoiser in full precision); `modules`: the dequantizing module wrapper and
`quantize_pipeline`, which `Pipeline.from_pretrained(..., quantize=)` calls.
"""

from sdjax.quant.modules import DequantizingModule, quantize_pipeline
from sdjax.quant.params import (
    QuantPolicy,
    check_quantize,
    dequantize_tree,
    has_quantized,
    nbytes,
    quantize_params,
    quantize_tree,
    resolve_policy,
)
from sdjax.quant.scheme import SCHEMES, dequantize_kernel, quantize_kernel

__all__ = [
    "SCHEMES",
    "DequantizingModule",
    "QuantPolicy",
    "check_quantize",
    "dequantize_kernel",
    "dequantize_tree",
    "has_quantized",
    "nbytes",
    "quantize_kernel",
    "quantize_params",
    "quantize_pipeline",
    "quantize_tree",
    "resolve_policy",
]
