"""Static input ranges for quantized compute (`QuantPolicy(compute=..., calibration=...)`): a calibration pass over
a few prompts records, for every Dense layer and 2-D conv that multiplies 8-bit x 8-bit, the largest `max|x|` of its
input; the program then scales that layer's input by this constant instead of reducing over each call's activation.

```python
policy = QuantPolicy("int8", components=("unet",), compute="int8")
pipe, params = sdjax.load_pipeline(folder, quantize=policy)
calibration = sdjax.quant.calibrate(pipe, ["a photo of a cat", "a watercolor landscape"], steps=8)
calibration.save(f"{folder}/{sdjax.quant.CALIBRATION_FILE}")          # next to the weights
policy = dataclasses.replace(policy, calibration=f"{folder}/{sdjax.quant.CALIBRATION_FILE}")  # or the object
pipe, params = sdjax.load_pipeline(folder, quantize=policy)
```

The pass (`calibrate`) runs the pipeline's own `generate` with each compute layer's `QuantizedLayers` interceptor
reporting its input's `max|x|` to the host (`jax.debug.callback`, every call of every step, both halves of the
classifier-free-guidance batch) under dynamic scales; the range kept is the maximum over all of them.

The file (JSON) carries the model's fingerprint: for each compute layer (`component/.../kernel`, the params path)
its kernel's shape and the SHA-256 of its quantized values and per-channel scales. `Calibration.check` (called by
`quantize_pipeline`) compares it with the loaded model and refuses a calibration recorded for another model,
naming the file and the first layer (in path order) that is missing, extra, shaped differently or holds other
weights. A layer never called during the pass is stored with `amax: null` and keeps per-call scales.

Version 2 files hold the convolutions too (`"convs": true`, unless recorded with `QuantPolicy(compute_convs=False)`);
version 1 files (written when only Dense layers computed in 8 bits) are read as `convs: false`: a policy that
computes its convolutions in 8 bits refuses them with that explanation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from sdjax.quant import compute as compute_lib
from sdjax.quant import scheme as scheme_lib

FORMAT = "sdjax.quant.calibration"
VERSION = 2
READS = (1, 2)  # version 1: Dense layers only (no "convs" field)
CALIBRATION_FILE = "quant_calibration.json"  # the name the docs use next to a model's weights


@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """One compute layer of the calibrated model: its kernel's shape, the SHA-256 of its quantized kernel and
    scale bytes (the fingerprint), and the largest input `max|x|` seen (None: not called during calibration)."""

    shape: tuple[int, ...]
    sha256: str
    amax: float | None


def _layer_hash(q: Any, scale: Any) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(np.asarray(q)).tobytes())
    h.update(np.ascontiguousarray(np.asarray(scale, np.float32)).tobytes())
    return h.hexdigest()


def fingerprint(
    params: Mapping[str, Any], policy: Any, convs: bool | None = None
) -> dict[str, tuple[tuple[int, ...], str]]:
    """`component/.../kernel -> (shape, sha256)` of every kernel `policy.compute` multiplies quantized, in the
    policy's components of `params` (a pipeline's params, already quantized; abstract params give no hash).
    `convs`: whether the 2-D convs count (None: `policy.compute_convs`)."""
    convs = policy.compute_convs if convs is None else convs
    out = {}
    for component in policy.components:
        tree = params.get(component, {})
        kernels = compute_lib.compute_kernels(tree, policy.compute, component, convs)
        for path, (q, scale) in kernels.items():
            abstract = isinstance(q, jax.ShapeDtypeStruct)  # AOT compiles: shapes only, nothing to hash
            out[path] = (tuple(int(d) for d in q.shape), None if abstract else _layer_hash(q, scale))
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True, eq=False)
class Calibration:
    """Static input ranges of a model's compute layers (`layers`: params path -> `LayerRecord`), recorded with
    `compute` ("int8" / "fp8") by `calibrate` on `prompts` with `steps` sampling steps; `convs`: whether its
    layers include the 2-D convs (`QuantPolicy.compute_convs`). `source`: the file it was read from (errors name
    it)."""

    compute: str
    layers: Mapping[str, LayerRecord]
    prompts: tuple[str, ...] = ()
    steps: int = 0
    source: str | None = None
    convs: bool = True
    placeholder: bool = False

    @property
    def name(self) -> str:
        if self.placeholder:
            return "the placeholder calibration"
        return f"calibration file {self.source}" if self.source else "the calibration"

    @classmethod
    def placeholder_for(cls, params: Mapping[str, Any], policy: Any, amax: float = 1.0) -> Calibration:
        """One range `amax` for every compute layer of `params` (quantized by `policy`, abstract or not): a program
        of the same shape as a calibrated one, for off-device cost studies (memory, FLOPs and bytes do not depend
        on the constants; `benchmarks/tpu_aot_table.py --static-scales`). Not for images: its ranges were not
        measured. Refused by `check` against real weights (it records no weight hashes) and by `save`."""
        layers = {path: LayerRecord(shape, "", float(amax)) for path, (shape, _) in fingerprint(params, policy).items()}
        return cls(policy.compute, layers, convs=policy.compute_convs, placeholder=True)

    def amax_for(self, component: str) -> dict[str, float]:
        """`module path inside component -> amax` (the form `QuantizedLayers` looks layers up by) of the recorded
        layers of `component`."""
        prefix, suffix = component + "/", "/" + scheme_lib.KERNEL
        return {
            path[len(prefix) : -len(suffix)]: rec.amax
            for path, rec in self.layers.items()
            if path.startswith(prefix) and path.endswith(suffix) and rec.amax is not None
        }

    def check(self, params: Mapping[str, Any], policy: Any) -> None:
        """Raise a ValueError naming the file and the first differing layer unless this calibration was recorded
        for this model: the same compute layers (paths and kernel shapes) holding the same quantized weights
        (abstract params, as `sdjax compile` builds them, are checked by paths and shapes only), and the same
        kinds of layers (a file of Dense layers only, `convs=False`, for a policy whose convs compute in 8 bits:
        refused after its layers matched, saying so)."""
        if policy.compute != self.compute:
            raise ValueError(f"{self.name} is for compute={self.compute!r}, the policy has {policy.compute!r}")
        self._check_layers(fingerprint(params, policy, convs=self.convs))
        if policy.compute_convs != self.convs:
            raise ValueError(
                f"{self.name} was recorded with compute_convs={self.convs} "
                f"({'Dense layers and convolutions' if self.convs else 'Dense layers only'}), the policy has "
                f"compute_convs={policy.compute_convs}: calibrate again (sdjax calibrate), or set "
                f"QuantPolicy(compute_convs={self.convs})"
            )

    def _check_layers(self, model: Mapping[str, tuple[tuple[int, ...], str | None]]) -> None:
        for path in sorted(set(model) | set(self.layers)):
            if path not in self.layers:
                raise ValueError(
                    f"{self.name} was recorded for another model: it has no layer {path} (kernel {model[path][0]}), "
                    f"which this model multiplies in {self.compute}"
                )
            rec = self.layers[path]
            if path not in model:
                raise ValueError(
                    f"{self.name} was recorded for another model: its layer {path} (kernel {rec.shape}) is not a "
                    f"{self.compute} compute layer of this model"
                )
            shape, digest = model[path]
            if shape != rec.shape:
                raise ValueError(
                    f"{self.name} was recorded for another model: layer {path} has kernel shape {rec.shape} "
                    f"there and {shape} here"
                )
            if digest is not None and self.placeholder:
                raise ValueError(
                    f"{self.name} (one range for every layer, for off-device cost studies) is refused for real "
                    f"weights: record one with sdjax calibrate (layer {path} holds weights)"
                )
            if digest is not None and digest != rec.sha256:
                raise ValueError(
                    f"{self.name} was recorded for other weights: layer {path} (kernel {shape}) holds different "
                    "values (another checkpoint of the same architecture, or LoRAs fused before calibrating)"
                )

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "compute": self.compute,
            "convs": self.convs,
            "prompts": list(self.prompts),
            "steps": self.steps,
            "layers": {
                path: {"shape": list(rec.shape), "sha256": rec.sha256, "amax": rec.amax}
                for path, rec in self.layers.items()
            },
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the calibration as JSON (`CALIBRATION_FILE` next to the model's weights is the convention)."""
        if self.placeholder:
            raise ValueError(f"{self.name} holds no measured ranges: it is not written to {os.fspath(path)}")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """Read a file written by `save`; a missing file, a file that is not a calibration, or one with a missing or
        malformed field raises an error naming the file."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"calibration file {path} does not exist")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"calibration file {path} is not JSON: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"calibration file {path} is not an sdjax calibration (its 'format' is not {FORMAT!r})")
        if raw.get("version") not in READS:
            raise ValueError(f"calibration file {path}: version {raw.get('version')!r}, this sdjax reads {READS}")
        try:
            compute = raw["compute"]
            if compute not in compute_lib.MODES:
                raise ValueError(f"'compute' is {compute!r}, expected one of {sorted(compute_lib.MODES)}")
            layers = {}
            for name, rec in raw["layers"].items():
                amax = rec["amax"]
                if amax is not None and not (isinstance(amax, (int, float)) and np.isfinite(amax) and amax >= 0):
                    raise ValueError(f"layer {name}: 'amax' is {amax!r}, expected a finite number >= 0 or null")
                layers[name] = LayerRecord(tuple(int(d) for d in rec["shape"]), str(rec["sha256"]), amax)
            convs = raw.get("convs", False) if raw["version"] == 1 else raw["convs"]
            if not isinstance(convs, bool):
                raise ValueError(f"'convs' is {convs!r}, expected true or false")
            prompts, steps = tuple(raw.get("prompts", ())), int(raw.get("steps", 0))
            return cls(compute, layers, prompts, steps, source=path, convs=convs)
        except KeyError as e:
            raise ValueError(f"calibration file {path} lacks the field {e.args[0]!r}") from None
        except (TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"calibration file {path}: {e}") from None


def as_calibration(value: Any) -> Calibration:
    """`QuantPolicy.calibration` as a `Calibration`: one as it is, a path read with `Calibration.load`."""
    if isinstance(value, Calibration):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Calibration.load(value)
    raise TypeError(f"QuantPolicy.calibration={value!r}: expected a sdjax.quant.Calibration or the path of its file")
