"""Weight-only quantization (int8 per channel, float8 e4m3 per channel) for every family, and 8-bit x 8-bit compute
for Dense layers and 2-D convolutions: docs/quantization.md.

`scheme`: one kernel's quantize / dequantize (qwix's arithmetic); `params`: which kernels (`QuantPolicy`) and the
params-tree transformation; `loading`: the same quantization applied per tensor while a loader converts (so a
quantized load never holds the denoiser in full precision); `modules`: the dequantizing module wrapper and
`quantize_pipeline`, which `Pipeline.from_pretrained(..., quantize=)` calls; `compute`: int8 x int8 / fp8 x fp8
Dense layers and convolutions (`QuantPolicy(compute=)`); `calibration`: their static input ranges (`calibrate`,
`Calibration`); `files`: quantized params saved and read back (`save_quantized`, `load_quantized`).
"""

from sdjax.quant.calibration import CALIBRATION_FILE, Calibration
from sdjax.quant.files import load_quantized, save_quantized
from sdjax.quant.modules import DequantizingModule, calibrate, quantize_pipeline, use_calibration
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
    "CALIBRATION_FILE",
    "Calibration",
    "SCHEMES",
    "calibrate",
    "DequantizingModule",
    "QuantPolicy",
    "check_quantize",
    "dequantize_kernel",
    "dequantize_tree",
    "has_quantized",
    "load_quantized",
    "nbytes",
    "quantize_kernel",
    "quantize_params",
    "quantize_pipeline",
    "quantize_tree",
    "resolve_policy",
    "save_quantized",
    "use_calibration",
]
