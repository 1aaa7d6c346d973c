"""Samplers: pure functions over a float32 state pytree, one file per family, each matching the diffusers
scheduler of the same name and config (see docs/DEVELOPING.md for the contract).

`get_sampler(name_or_config, base_config=None, **overrides)` builds one by registry name (`"euler_a"`), by
diffusers class name (`"EulerAncestralDiscreteScheduler"`) or by AUTOMATIC1111 name (`"Euler a"`), starting from
a pipeline's existing scheduler config the way diffusers' `Scheduler.from_config(pipe.scheduler.config)` swaps
schedulers; or from a `scheduler_config.json` dict (dispatching on `_class_name`).
"""

from __future__ import annotations

from typing import Any

from sdjax.config import ConfigError
from sdjax.samplers.common import Sampler
from sdjax.samplers.ddim import DDIM, DDIMState
from sdjax.samplers.ddpm import DDPM, DDPMState
from sdjax.samplers.dpm_solver import DPMSolverMultistep, DPMSolverState
from sdjax.samplers.euler import Euler, EulerAncestral, SigmaState
from sdjax.samplers.lms import LMS, LMSState
from sdjax.samplers.pndm import PNDM, PNDMState

__all__ = [
    "DDIM",
    "DDIMState",
    "DDPM",
    "DDPMState",
    "DPMSolverMultistep",
    "DPMSolverState",
    "Euler",
    "EulerAncestral",
    "LMS",
    "LMSState",
    "PNDM",
    "PNDMState",
    "Sampler",
    "SigmaState",
    "UnknownSamplerError",
    "available",
    "get_sampler",
    "name_of",
    "SAMPLERS",
    "CLASSES",
    "ALIASES",
    "A1111_NAMES",
]

# diffusers class name -> sampler class.
CLASSES: dict[str, type[Sampler]] = {
    cls.diffusers_class: cls for cls in (PNDM, DDIM, DDPM, Euler, EulerAncestral, LMS, DPMSolverMultistep)
}

# Registry name -> (sampler class, the config keys the name fixes). Order matters for `name_of`.
SAMPLERS: dict[str, tuple[type[Sampler], dict[str, Any]]] = {
    "pndm": (PNDM, {"skip_prk_steps": True}),
    "pndm_prk": (PNDM, {"skip_prk_steps": False}),
    "ddim": (DDIM, {}),
    "ddpm": (DDPM, {}),
    "euler": (Euler, {"use_karras_sigmas": False}),
    "euler_karras": (Euler, {"use_karras_sigmas": True}),
    "euler_a": (EulerAncestral, {}),
    "lms": (LMS, {"use_karras_sigmas": False}),
    "lms_karras": (LMS, {"use_karras_sigmas": True}),
    "dpmpp_2m": (DPMSolverMultistep, {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": False}),
    "dpmpp_2m_karras": (
        DPMSolverMultistep,
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
    ),
    "dpmpp_2m_sde": (
        DPMSolverMultistep,
        {"algorithm_type": "sde-dpmsolver++", "solver_order": 2, "use_karras_sigmas": False},
    ),
    "dpmpp_2m_sde_karras": (
        DPMSolverMultistep,
        {"algorithm_type": "sde-dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
    ),
}

# AUTOMATIC1111's sampler names -> registry name.
A1111_NAMES: dict[str, str] = {
    "PLMS": "pndm",
    "DDIM": "ddim",
    "Euler": "euler",
    "Euler a": "euler_a",
    "LMS": "lms",
    "LMS Karras": "lms_karras",
    "DPM++ 2M": "dpmpp_2m",
    "DPM++ 2M Karras": "dpmpp_2m_karras",
    "DPM++ 2M SDE": "dpmpp_2m_sde",
    "DPM++ 2M SDE Karras": "dpmpp_2m_sde_karras",
}
# Every other spelling -> registry name (names also match case-insensitively, with spaces or hyphens for "_").
ALIASES: dict[str, str] = {
    **A1111_NAMES,
    "plms": "pndm",
    "DDPM": "ddpm",
    "Euler Karras": "euler_karras",
    "euler_ancestral": "euler_a",
}


class UnknownSamplerError(ConfigError, KeyError):
    """A sampler name that is neither a registry name, a diffusers class name nor an A1111 name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def available() -> list[str]:
    """The registry names, in registry order."""
    return list(SAMPLERS)


def _valid_names() -> str:
    return (
        f"registry names {list(SAMPLERS)}, AUTOMATIC1111 names {list(A1111_NAMES)} or diffusers classes {list(CLASSES)}"
    )


def _resolve(name: str) -> tuple[type[Sampler], dict[str, Any]]:
    if name in SAMPLERS:
        return SAMPLERS[name]
    if name in ALIASES:
        return SAMPLERS[ALIASES[name]]
    if name in CLASSES:
        return CLASSES[name], {}
    folded = {
        k.lower().replace("-", "_").replace(" ", "_"): v
        for k, v in [
            *((k, SAMPLERS[k]) for k in SAMPLERS),
            *((k, SAMPLERS[v]) for k, v in ALIASES.items()),
            *((k, (c, {})) for k, c in CLASSES.items()),
        ]
    }
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key in folded:
        return folded[key]
    raise UnknownSamplerError(f"unknown sampler {name!r}; valid: {_valid_names()}")


def _base_dict(base_config: Any) -> dict[str, Any]:
    if base_config is None:
        return {}
    if isinstance(base_config, Sampler):
        return base_config.config
    if isinstance(base_config, dict):
        return dict(base_config)
    raise TypeError(f"base_config must be a Sampler, a scheduler config dict or None, got {type(base_config).__name__}")


def _swap_config(base: dict[str, Any]) -> dict[str, Any]:
    """What diffusers' `X.from_config(base)` starts from: the base config minus the keys it holds only at their
    defaults (`_use_default_values`). `Sampler.from_config` then takes every key X's constructor takes (also keys
    the base's own class ignored: SD 1.5's PNDM config's `clip_sample: false` reaches DDIM) and keeps the rest as
    hidden config for the next swap; schedule-defining keys a sampler lacks are refused instead of dropped."""
    defaults = set(base.get("_use_default_values", ()))
    return {k: v for k, v in base.items() if k not in defaults and k != "_class_name"}


def get_sampler(
    name_or_config: str | dict[str, Any] | Sampler, base_config: dict[str, Any] | Sampler | None = None, **overrides
) -> Sampler:
    """Build a sampler.

    - `name_or_config` a name: the registry name (`available()`), an AUTOMATIC1111 name ("DPM++ 2M Karras") or
      a diffusers class name ("EulerDiscreteScheduler"); the config starts from `base_config` (a pipeline's
      sampler or its scheduler config dict: the beta schedule, prediction type, timestep spacing, ... carry
      over as in diffusers' `from_config(pipe.scheduler.config)`), then the keys the name fixes (Karras sigmas,
      algorithm) and `overrides` apply. Without `base_config`, diffusers' defaults of that class.
    - a `scheduler_config.json` dict: built by its `_class_name` (`base_config` must be None).
    - a Sampler: returned as is, or rebuilt with `overrides`.

    `overrides` are config keys, plus runtime options such as DDIM's `eta`. Raises `UnknownSamplerError` (a
    `ConfigError`) listing the valid names for an unknown name, `ConfigError` for bad config keys.
    """
    if isinstance(name_or_config, Sampler):  # used as given (diffusers' from_pretrained(scheduler=object))
        if not overrides:
            return name_or_config
        name_or_config = name_or_config.config | {k: v for k, v in _options(name_or_config).items()}
    if isinstance(name_or_config, dict):  # a whole scheduler config: built by its own _class_name
        raw = dict(name_or_config)
        class_name = raw.get("_class_name")
        if class_name not in CLASSES:
            raise UnknownSamplerError(
                f"scheduler config has _class_name={class_name!r}; sdjax implements {list(CLASSES)}"
            )
        cls, fixed = CLASSES[class_name], {}
    elif isinstance(name_or_config, str):
        cls, fixed = _resolve(name_or_config)
        raw = _swap_config(_base_dict(base_config))
    else:
        raise TypeError(
            f"get_sampler: expected a name, a config dict or a Sampler, got {type(name_or_config).__name__}"
        )
    options = {k: overrides.pop(k) for k in list(overrides) if k in cls.options}
    options.update({k: raw.pop(k) for k in list(raw) if k in cls.options})
    return cls.from_config({**raw, **fixed, **overrides}, **options)


def _options(sampler: Sampler) -> dict[str, Any]:
    return {k: getattr(sampler, k) for k in sampler.options}


def name_of(sampler: Sampler) -> str:
    """The registry name that describes `sampler` (the first whose fixed keys it has), else its diffusers class
    name."""
    for name, (cls, fixed) in SAMPLERS.items():
        if type(sampler) is cls and all(getattr(sampler, k) == v for k, v in fixed.items()):
            return name
    return sampler.diffusers_class
