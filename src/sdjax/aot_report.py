"""What compiling one generation for one TPU slice says (`sdjax.aot.compile_for`): memory per device against the
chip's HBM, FLOPs and bytes, the roofline bound, as a table and as JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Report:
    """What compiling one generation for one TPU slice says (bytes and FLOPs per device; see the module doc)."""

    target: str
    topology: str
    chip: str
    chips: int
    devices: int
    mesh: dict[str, int]
    model: str
    pipeline: str
    task: str
    dtype: str
    height: int
    width: int
    batch: int
    steps: int
    sampler: str
    model_calls: int
    weights_bytes: int  # all params, unsharded
    argument_bytes: int | None  # None: the compiler ran out of memory (see `error`)
    output_bytes: int | None
    temp_bytes: int | None
    alias_bytes: int | None
    code_bytes: int | None
    hbm_bytes: int  # per device (chip HBM / devices per chip)
    compile_s: float
    unet_compile_s: float | None
    program_flops: float | None  # the program as XLA counts it (loop body once)
    unet_call_flops: float | None
    flops: float | None  # program + (calls - 1) * UNet call
    bytes_accessed: float | None
    peak_flops: float  # per device, datasheet estimate
    hbm_bytes_per_s: float  # per device, datasheet estimate
    saved: str | None = None
    vae_slicing: bool = False  # the VAE ran one image per device at a time
    attention: str = "auto"  # the UNet's and VAE's attention ("auto": the TPU's own choice)
    controlnets: int = 0  # ControlNets in the program (each the UNet's encoder copy; weights counted in weights_bytes)
    error: str | None = None  # the compiler's out-of-memory message: the program does not fit
    required_bytes: int | None = None  # what that message says is needed ...
    available_bytes: int | None = None  # ... and available (libtpu's usable HBM, a little under the datasheet's)
    weights_dtype: str | None = None  # the matmul kernels' storage dtype where it is not `dtype` (float8)
    fsdp: bool = False  # large weights also split over the data axis
    cfg: bool = True  # classifier-free guidance: two rows per image in each model call
    quantize: str | None = None  # the denoiser's kernels quantized (`sdjax.quant`: int8, fp8), dequantized in it
    quant_compute: str | None = None  # its Dense layers and convs multiplied 8-bit x 8-bit (`QuantPolicy.compute`)
    unet_call_quant_flops: float | None = None  # of `unet_call_flops`, those of the 8-bit x 8-bit products
    quant_flops: float | None = None  # of `flops`, those of the 8-bit products: model calls x the call's
    quant_peak_flops: float | None = None  # per device, the 8-bit products' datasheet rate (int8; fp8: bf16's)
    calibration: str | None = None  # static input scales of those products: the file, "placeholder" or "in memory"

    @property
    def total_bytes(self) -> int | None:
        if self.argument_bytes is None:
            return self.required_bytes
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def margin_bytes(self) -> int | None:
        return None if self.total_bytes is None else self.hbm_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.error is None and self.margin_bytes is not None and self.margin_bytes >= 0

    @property
    def compute_s(self) -> float | None:
        """The FLOPs at the datasheet rates: the 8-bit products (`quant_flops`) at theirs, the rest at bf16's."""
        if self.flops is None:
            return None
        quant = self.quant_flops or 0.0
        rest = (self.flops - quant) / self.peak_flops
        return rest + quant / self.quant_peak_flops if quant else rest

    @property
    def roofline_s(self) -> float | None:
        if self.compute_s is None or self.bytes_accessed is None:
            return None
        return max(self.compute_s, self.bytes_accessed / self.hbm_bytes_per_s)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            total_bytes=self.total_bytes,
            margin_bytes=self.margin_bytes,
            fits=self.fits,
            compute_s=self.compute_s,
            roofline_s=self.roofline_s,
            roofline_images_per_s=self.batch / self.roofline_s if self.roofline_s else None,
        )
        return out

    def rows(self) -> list[tuple[str, str]]:
        """(quantity, value) rows of the human-readable table."""

        def gib(n):
            return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"

        rows = []
        if self.argument_bytes is not None:
            rows += [
                ("arguments (params + inputs)", gib(self.argument_bytes)),
                ("outputs", gib(self.output_bytes)),
                ("temporaries", gib(self.temp_bytes)),
                ("generated code", gib(self.code_bytes)),
                ("total", gib(self.total_bytes)),
            ]
        elif self.required_bytes is not None:
            rows.append(("required (compiler's out-of-memory message)", gib(self.required_bytes)))
        rows.append(("HBM per device (datasheet)", gib(self.hbm_bytes)))
        if self.available_bytes is not None:
            rows.append(("HBM available (compiler)", gib(self.available_bytes)))
        if self.margin_bytes is not None:
            rows.append(("margin", f"{gib(self.margin_bytes)} ({100 * self.margin_bytes / self.hbm_bytes:.0f}%)"))
        rows.append(("fits", "yes" if self.fits else "NO: does not fit"))
        unet = f" (+ {self.unet_compile_s:.1f} s UNet call)" if self.unet_compile_s else ""
        rows.append(("compile", f"{self.compile_s:.1f} s{unet}"))
        if self.flops is not None:
            rows.append((f"TFLOP ({self.model_calls} model calls)", f"{self.flops / 1e12:.2f}"))
        if self.quant_flops is not None:
            mode = self.quant_compute
            rows.append((f"  of which {mode} x {mode} products", f"{self.quant_flops / 1e12:.2f}"))
        if self.compute_s is not None and self.quant_flops:
            rows.append(("compute time at peak rates", f"{self.compute_s:.3f} s"))
        if self.bytes_accessed is not None:
            rows.append(("bytes accessed", gib(int(self.bytes_accessed))))
        if self.roofline_s is not None:
            rows.append(
                ("roofline bound (estimate)", f"{self.roofline_s:.3f} s, {self.batch / self.roofline_s:.2f} images/s")
            )
        return rows

    def summary(self) -> str:
        mesh = " x ".join(f"{k} {v}" for k, v in self.mesh.items())
        return (
            f"{self.model} ({self.pipeline}, {self.task}), {self.dtype}, {self.height}x{self.width}, batch "
            f"{self.batch}, {self.steps} steps, {self.sampler} on {self.target} ({self.chips} x {self.chip}, "
            f"{self.devices} devices, mesh {mesh}){', VAE slicing' if self.vae_slicing else ''}"
            f"{'' if self.attention == 'auto' else f', {self.attention} attention'}"
            f"{f', {self.controlnets} ControlNet(s)' if self.controlnets else ''}"
            f"{f', {self.weights_dtype} weights' if self.weights_dtype else ''}{', FSDP' if self.fsdp else ''}"
            f"{f', {self.quantize} denoiser weights' if self.quantize else ''}"
            f"{f', {self.quant_compute} products' if self.quant_compute else ''}"
            f"{f' (static scales: {self.calibration})' if self.calibration else ''}"
            f"{'' if self.cfg else ', no CFG'}; per device:"
        )


# ---------------------------------------------------------------------------------------------- compiling
