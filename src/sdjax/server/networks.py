"""Per-request weights on the server: AUTOMATIC1111's `<lora:name:weight>` prompt tags (LoRAs of the models
directory's `Lora/`) and `override_settings.sd_vae` (a VAE of `VAE/`), applied as parameters, never as programs.

A request's LoRA set and VAE are part of its images' `shape_key`, so the batcher groups requests by them; the worker
asks `params_for(pipeline, image)` for the params of a batch: the served params with the LoRA deltas added
(`loading.lora.apply_loras`, the same arithmetic as `pipe.load_lora`) and `params["vae"]` replaced. Structure, shapes
and dtypes never change, so switching LoRAs or VAEs never recompiles (a VAE of another architecture is refused with
422). LoRA files and VAEs are read on the request's thread, so a file that does not fit the model fails its request
(422 naming the field), not a batch; the applied param sets are kept for the most recent `max_sets` combinations
(each holds its own copy of the touched kernels).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from pathlib import Path
from typing import Any

from sdjax.models_dir import ModelsDir
from sdjax.server.schemas import FieldError


def _lora_targets(pipeline: Any) -> tuple[str, ...]:
    return tuple(c for c in pipeline.generator.models.components() if c != "vae")


class Networks:
    """LoRA and VAE files of a models directory, loaded on demand and applied per batch (see the module docstring).
    One instance serves one pipeline at a time; everything it caches is keyed by that pipeline."""

    def __init__(self, md: ModelsDir | None, *, served_vae: str = "", max_sets: int = 4):
        self.md = md
        self.served_vae = served_vae  # the VAE name of the served params themselves (no override)
        self.max_sets = max_sets
        self._lock = threading.Lock()
        self._loras: dict[tuple[int, str], Any] = {}  # (id(pipeline), file) -> loading.lora.Lora
        self._vaes: dict[tuple[int, str], Any] = {}  # (id(pipeline), file) -> VAE params
        self._sets: collections.OrderedDict = collections.OrderedDict()  # (id(params), loras, vae) -> params

    # ------------------------------------------------------------------ request side (422s)
    def prompt_loras(self, pipeline: Any, texts: dict[str, str]) -> tuple[tuple[str, Any], ...]:
        """The `<lora:name:w>` / `<lora:name:te:unet>` tags of the request's texts, each found in `Lora/` and loaded
        against `pipeline` (FieldError naming the field otherwise) -> ((name, scale), ...) in order of appearance,
        a scale being a number or (text encoders, UNet)."""
        from sdjax.text import prompt_syntax

        found: list[tuple[str, float]] = []
        for field, text in texts.items():
            try:
                _, tags = prompt_syntax.extract_networks(text or "")
            except ValueError as e:
                raise FieldError(field, str(e)) from None
            for tag in tags:
                if tag.kind != "lora":
                    raise FieldError(field, f"<{tag.kind}:{tag.name}:...>: only <lora:...> tags are applied here")
                if self.md is None or self.md.folder("lora") is None:
                    raise FieldError(
                        field, f"<lora:{tag.name}:...>: this server has no Lora/ folder (start it with --models-dir)"
                    )
                try:
                    entry = self.md.resolve("lora", tag.name)
                except (ValueError, LookupError) as e:
                    raise FieldError(field, f"<lora:{tag.name}:...>: {e.args[0] if e.args else e}") from None
                if not hasattr(pipeline, "generator") or getattr(pipeline, "params", None) is None:
                    raise FieldError(field, f"<lora:{tag.name}:...>: this pipeline cannot apply LoRAs")
                if any(name == tag.name for name, _ in found):
                    raise FieldError(field, f"<lora:{tag.name}:...> appears more than once")
                scale = tag.lora_scale  # a number, or (text encoders, UNet)
                if not all(-10 <= w <= 10 for w in (scale if isinstance(scale, tuple) else (scale,))):
                    raise FieldError(field, f"<lora:{tag.name}:...>: weights must lie in -10..10, got {scale}")
                try:
                    self._lora(pipeline, str(entry.path), tag.name)
                except ValueError as e:  # LoraError: the file does not fit this model (names file and layer)
                    raise FieldError(field, f"<lora:{tag.name}:...>: {e}") from None
                found.append((tag.name, scale))
        return tuple(found)

    def lora_hashes(self, loras: tuple[tuple[str, float], ...]) -> str:
        """A1111's `Lora hashes` infotext value for the LoRAs `prompt_loras` returned."""
        from sdjax.infotext import lora_hashes

        return lora_hashes([(name, self.md.resolve("lora", name).path) for name, _ in loras], self.md.hashes)

    def vae(self, pipeline: Any, name: str, field: str) -> str:
        """Load the VAE `name` of `VAE/` for `pipeline` (FieldError naming `field` if it is unknown or of another
        architecture) -> its A1111 name (the file name)."""
        if self.md is None or self.md.folder("vae") is None:
            raise FieldError(field, f"{name!r}: this server has no VAE/ folder (start it with --models-dir)")
        try:
            entry = self.md.resolve("vae", name)
        except (ValueError, LookupError) as e:
            raise FieldError(field, str(e.args[0] if e.args else e)) from None
        if getattr(pipeline, "vae", None) is None or getattr(pipeline, "params", None) is None:
            raise FieldError(field, f"{name!r}: this pipeline cannot switch VAEs")
        try:
            self._vae(pipeline, str(entry.path))
        except Exception as e:  # unreadable file, other layout or architecture
            raise FieldError(field, f"{entry.name}: {e}") from None
        return entry.name.rsplit("/", 1)[-1]

    # ------------------------------------------------------------------ worker side
    def params_for(self, pipeline: Any, image: Any) -> dict | None:
        """The params of a batch of `image`'s kind: None (the served params) without LoRAs or another VAE."""
        loras, vae = getattr(image, "loras", ()), getattr(image, "vae", "")
        vae = "" if vae == self.served_vae else vae
        if not loras and not vae:
            return None
        base = pipeline.params
        key = (id(pipeline), id(base), loras, vae)
        with self._lock:
            if key in self._sets:
                self._sets.move_to_end(key)
                return self._sets[key][1]
        from sdjax.loading import lora as lora_lib

        params = dict(base)
        if loras:
            paths = {name: str(self.md.resolve("lora", name).path) for name, _ in loras}
            weighted = [(self._lora(pipeline, paths[name], name), w) for name, w in loras]
            params = lora_lib.apply_loras(params, weighted)
        if vae:
            params["vae"] = self._vae(pipeline, str(self.md.resolve("vae", vae).path))
        with self._lock:
            self._sets[key] = (base, params)  # base kept alive: its id stays unique while the entry lives
            while len(self._sets) > self.max_sets:
                self._sets.popitem(last=False)
        return params

    def clear(self) -> None:
        with self._lock:
            self._loras.clear()
            self._vaes.clear()
            self._sets.clear()

    # ------------------------------------------------------------------ loading
    def _lora(self, pipeline: Any, path: str, name: str):
        key = (id(pipeline), path)
        with self._lock:
            if key in self._loras:
                return self._loras[key]
        # the family's own reader (SD/SDXL: kohya and PEFT UNet layouts; Flux and SD 3: their transformers'):
        # calling the SD reader with `pipeline.unet` failed on every Flux and SD 3 model
        targets = {c: pipeline.params[c] for c in _lora_targets(pipeline)}
        lora = pipeline._read_lora(Path(path), targets, name)
        with self._lock:
            self._loras[key] = lora
        return lora

    def _vae(self, pipeline: Any, path: str):
        key = (id(pipeline), path)
        with self._lock:
            if key in self._vaes:
                return self._vaes[key]
        from sdjax.loading.single_file import load_vae

        own = pipeline.vae.config
        module, params = load_vae(path, pipeline.dtype, config=dataclasses.asdict(own))
        if module.config != own:
            raise ValueError("a VAE of another architecture than the served model's; not served")
        with self._lock:
            self._vaes[key] = params
        return params
