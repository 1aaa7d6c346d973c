"""LoRA on a pipeline: `load_lora`, `set_loras`, `fuse_loras` / `unfuse_loras`, `unload_loras`.

The active LoRAs are applied as parameter deltas outside `jit` (`loading.lora.apply_loras`): `pipe.params` becomes
the base params with `base + sum(scale * alpha / r * up @ down)` in every touched kernel and the base leaves
everywhere else. The generation program takes params as arguments, so loading, switching or re-weighting LoRAs
never recompiles it. The base leaves are kept, not recovered by subtraction, so `unfuse_loras()` (or
`set_loras({})`) gives back bit-identical base weights.

Unlike diffusers, where PEFT layers add the LoRA branch at run time and `fuse_lora` is an optimisation, sdjax always
runs fused weights; `unfuse_loras()` runs the base model until `fuse_loras()` or `set_loras()` applies the active
set again. Explicit `params=` passed to `generate` / `generate_arrays` get the active LoRAs too (`with_active_loras`:
the base params returned by `from_pretrained` become `pipe.params`, any other tree gets the deltas added), so a
LoRA is never dropped silently; the old Flax guide API (`__call__`, `_generate`, replicated params) uses its params
as given: take `pipe.params` after loading LoRAs (or `loading.lora.apply_loras(params, ...)`) there.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sdjax.loading import lora as lora_lib


@dataclasses.dataclass
class _LoraState:
    base: dict  # the params the LoRAs are added to (their leaves kept as they are)
    current: dict  # what this state last set as `pipe.params`
    loaded: dict[str, lora_lib.Lora] = dataclasses.field(default_factory=dict)
    active: dict[str, lora_lib.Scale] = dataclasses.field(default_factory=dict)
    fused: bool = False
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)  # one change at a time


class LoraMixin:
    """The LoRA methods of `DiffusionPipeline` (see the module docstring)."""

    # Folders where `load_lora("name")` looks for `name.safetensors` (the CLI / server set them).
    lora_search_dirs: tuple[str | Path, ...] = ()

    def _lora_targets(self) -> tuple[str, ...]:
        return tuple(c for c in self.generator.models.components() if c != "vae")

    def _read_lora(self, path: Path, targets: dict, name: str) -> lora_lib.Lora:
        """A LoRA file matched against this family's params (`targets`: component -> params). SD 1.x/2.x and
        SDXL: kohya/A1111 and diffusers/PEFT layouts (`loading.lora`); other families override it."""
        return lora_lib.load_lora(path, targets, name=name, unet_config=self.unet.config)

    def _lora(self) -> _LoraState:
        params = self.params
        if params is None:
            raise ValueError("no params: load the pipeline with from_pretrained before loading LoRAs")
        state: _LoraState | None = getattr(self, "_lora_state", None)
        if state is None:
            state = self._lora_state = _LoraState(base=params, current=params)
        elif params is not state.current and params is not state.base:  # params replaced: they are the new base
            state.base = state.current = params
            state.fused = False
        return state

    def load_lora(self, path_or_name: str | Path, scale: lora_lib.Scale = 1.0, adapter_name: str | None = None) -> str:
        """Load a LoRA (`.safetensors` path, a folder holding one, or a name in `lora_search_dirs`) and activate
        it at `scale` (a number, or a pair `(text encoders, UNet)` as A1111's `<lora:name:te:unet>`), keeping the
        other active LoRAs. Returns its adapter name (default: the file's stem); loading
        under a name already in use replaces that LoRA. Raises `loading.lora.LoraError` naming the file when it
        does not fit this model."""
        _check_scale(adapter_name or str(path_or_name), scale)
        if adapter_name is not None and (not isinstance(adapter_name, str) or not adapter_name):
            raise ValueError(f"adapter_name={adapter_name!r} must be a non-empty str")
        state = self._lora()
        path = lora_lib.resolve_lora_path(path_or_name, self.lora_search_dirs)
        name = adapter_name or path.stem
        with state.lock:
            targets = {c: state.base[c] for c in self._lora_targets()}
            lora = self._read_lora(path, targets, name)
            state.loaded[name] = lora
            active = {k: v for k, v in state.active.items() if k != name}
            active[name] = _check_scale(name, scale)
            self._set_active(state, active)
        return name

    def set_loras(self, scales: Mapping[str, lora_lib.Scale]) -> None:
        """Make exactly these loaded LoRAs active, with these scales (`{}`: none), and fuse them."""
        if not isinstance(scales, Mapping):
            raise TypeError(f"set_loras takes a dict {{adapter_name: scale}}, got {type(scales).__name__}")
        state = self._lora()
        unknown = [k for k in scales if k not in state.loaded]
        if unknown:
            raise KeyError(f"LoRA(s) {unknown} are not loaded; loaded: {sorted(state.loaded)} (use load_lora)")
        for k, v in scales.items():
            _check_scale(k, v)
        self._set_active(state, {k: _check_scale(k, v) for k, v in scales.items()})

    def fuse_loras(self) -> None:
        """Apply the active LoRAs to `pipe.params` again (after `unfuse_loras`)."""
        state = self._lora()
        self._set_active(state, dict(state.active))

    def unfuse_loras(self) -> None:
        """Give `pipe.params` its base weights back (the very arrays, bit-identical); the LoRAs stay loaded and
        their scales remembered for `fuse_loras`."""
        state = self._lora()
        with state.lock:
            self.params = state.current = state.base
            state.fused = False

    def unload_loras(self, names: str | list[str] | None = None) -> None:
        """Forget the named LoRAs (default: all) and re-apply the others."""
        state = self._lora()
        names = list(state.loaded) if names is None else [names] if isinstance(names, str) else list(names)
        unknown = [k for k in names if k not in state.loaded]
        if unknown:
            raise KeyError(f"LoRA(s) {unknown} are not loaded; loaded: {sorted(state.loaded)}")
        with state.lock:
            for k in names:
                del state.loaded[k]
            self._set_active(state, {k: v for k, v in state.active.items() if k in state.loaded})

    @property
    def active_loras(self) -> dict[str, lora_lib.Scale]:
        """Active LoRAs and their scales (empty when none or after `unfuse_loras`)."""
        state: _LoraState | None = getattr(self, "_lora_state", None)
        if state is None or not state.fused or self.params is not state.current:
            return {}
        return dict(state.active)

    def with_active_loras(self, params: dict | None) -> dict | None:
        """`params` with the active LoRAs applied (see the module docstring); None stays None (the pipeline's)."""
        state: _LoraState | None = getattr(self, "_lora_state", None)
        if params is None or state is None or not state.fused or not state.active:
            return params
        if params is state.current or params is self.params:
            return params
        if params is state.base:
            return state.current
        with state.lock:
            weighted = [(state.loaded[k], v) for k, v in state.active.items()]
            return lora_lib.apply_loras(params, weighted)

    @property
    def loaded_loras(self) -> dict[str, Any]:
        """Loaded LoRAs by adapter name (`loading.lora.Lora`: source file, adapted layers)."""
        state: _LoraState | None = getattr(self, "_lora_state", None)
        return dict(state.loaded) if state is not None else {}

    def _set_active(self, state: _LoraState, active: dict[str, lora_lib.Scale]) -> None:
        with state.lock:
            weighted = [(state.loaded[k], v) for k, v in active.items()]
            state.current = lora_lib.apply_loras(state.base, weighted) if weighted else state.base
            state.active = active
            state.fused = True
            self.params = state.current


def _check_scale(name: str, scale: Any) -> lora_lib.Scale:
    return lora_lib.check_scale(name, scale)
