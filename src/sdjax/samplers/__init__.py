"""Samplers: pure functions over a float32 state pytree, one file per family, each matching the diffusers
scheduler of the same name and config (see docs/DEVELOPING.md for the contract).

`get_sampler(name_or_config, base_config=None, *, schedule=None, **overrides)` builds one by registry name
(`"euler_a"`), by diffusers class name (`"EulerAncestralDiscreteScheduler"`) or by AUTOMATIC1111 name (`"Euler a"`),
starting from a pipeline's existing scheduler config the way diffusers' `Scheduler.from_config(pipe.scheduler.config)`
swaps schedulers; or from a `scheduler_config.json` dict (dispatching on `_class_name`). `schedule` applies an A1111
schedule name (`sdjax.samplers.schedules`). `from_a1111(sampler_name, scheduler_name, base_config)` applies A1111's
own semantics (its "Automatic" schedule per sampler, legacy names such as "DPM++ 2M Karras"); `a1111_samplers()` and
`a1111_schedulers()` are A1111's `/sdapi/v1/samplers` and `/sdapi/v1/schedulers` responses (`sdjax.samplers.a1111`).

Families: PNDM/PLMS (pndm.py), DDIM, DDPM, Euler and Euler a (euler.py), LMS, DPM-Solver++ multistep incl. the SDE
variants (dpm_solver.py), singlestep (dpm_singlestep.py), DPM++ SDE with its Brownian tree (dpm_sde.py), Heun,
DPM2 and DPM2 a (kdpm2.py), UniPC, DEIS, LCM and TCD (lcm.py); for flow-matching models (Flux, SD 3) Euler and Heun
(flow_match.py), and DPM-Solver++ and UniPC with flow sigmas.

Two registries: `SAMPLERS` for the variance-preserving models (SD 1/2, SDXL: what `available()` lists, what A1111's
names map to) and `FLOW_SAMPLERS` for flow models (`available(flow=True)`). A flow registry name swapped onto a flow
model's config (`get_sampler("flow_dpmpp_2m", flux_config)`) takes the model's `shift` as `flow_shift` (diffusers'
users pass it by hand); flow samplers refuse a variance-preserving model's config (its beta schedule or prediction
type would be dropped, and the model sampled as a flow model).

The k-diffusion form (`sdjax.samplers.kdiffusion`: one denoiser wrapper, sigma schedules, sigma-only step rules) runs
under this front: `get_sampler` (and so `from_a1111`, `from_a1111_flow`, a `scheduler_config.json`, `pipe.scheduler =
"name"`) parses and validates the diffusers config with the class of that name, then hands out `front(parsed)`: the
`KDiffusionSampler` of `kdiffusion.from_diffusers(parsed)` where the form expresses the config exactly (its `origin` is
the parsed config object: `name_of`, `config` and the config keys as attributes are the origin's, so names, infotext,
swaps and compile-cache keys are what they were), else the parsed object itself. The form takes:
- EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, HeunDiscreteScheduler: epsilon / v (/ sample), any
  `timestep_spacing`, Karras / exponential / beta sigmas;
- DPMSolverMultistepScheduler: `solver_order=2`, `solver_type="midpoint"`, "dpmsolver++" or "sde-dpmsolver++", with
  Karras / exponential / beta sigmas or flow sigmas (flow prediction), `final_sigmas_type="zero"` (where
  `lower_order_final` and `euler_at_final` change nothing), on the VP sample as diffusers holds it;
- FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler: static or dynamic shift, `shift_terminal`, both
  FlowMatch grids.
These configs keep their diffusers-parity class, because the form has no exact equivalent: Euler's
`interpolation_type="log_linear"`, `final_sigmas_type="sigma_min"` (a schedule that does not end in 0),
`timestep_type="continuous"`, explicit `sigma_min`/`sigma_max`; `rescale_betas_zero_snr` (Euler, Euler a: diffusers'
2^-24 stand-in for an infinite top sigma); Heun's `clip_sample`; DPM-Solver on its integer timestep grid (no sigma
schedule: the registry's plain "dpmpp_2m"/"dpmpp_2m_sde"), `solver_order` 1 or 3, `solver_type="heun"`,
`final_sigmas_type="sigma_min"`; FlowMatch Euler's `stochastic_sampling`, `invert_sigmas` and `use_*_sigmas` (diffusers
converts between the ends of its shifted grid, not the model's table). A `KDiffusionSampler` built by hand (or from
a "kdiffusion:RULE:SCHEDULE" name, which `name_of` gives it) has no origin; `get_sampler` builds that name back on a
model's config ("kdiffusion:euler_ancestral:karras"). Every sampler object is accepted where a Sampler is
(`is_sampler`).
"""

from __future__ import annotations

import warnings
from typing import Any

from sdjax.config import ConfigError
from sdjax.samplers import schedules
from sdjax.samplers.common import Sampler
from sdjax.samplers.ddim import DDIM, DDIMState
from sdjax.samplers.ddpm import DDPM, DDPMState
from sdjax.samplers.deis import DEIS, DEISState
from sdjax.samplers.dpm_sde import DPMSolverSDE, DPMSolverSDEState
from sdjax.samplers.dpm_singlestep import DPMSolverSinglestep, DPMSolverSinglestepState
from sdjax.samplers.dpm_solver import DPMSolverMultistep, DPMSolverState
from sdjax.samplers.euler import Euler, EulerAncestral, SigmaState
from sdjax.samplers.flow_match import FlowHeunState, FlowMatchEuler, FlowMatchHeun, FlowState, check_flow_config
from sdjax.samplers.heun import Heun, HeunState
from sdjax.samplers.kdpm2 import KDPM2, KDPM2Ancestral, KDPM2State
from sdjax.samplers.lcm import LCM, TCD, ConsistencyState
from sdjax.samplers.lms import LMS, LMSState
from sdjax.samplers.pndm import PNDM, PNDMState
from sdjax.samplers.unipc import UniPC, UniPCState

__all__ = [
    "DEIS",
    "DEISState",
    "DPMSolverSDE",
    "DPMSolverSDEState",
    "DPMSolverSinglestep",
    "DPMSolverSinglestepState",
    "Heun",
    "HeunState",
    "KDiffusionSampler",
    "KDPM2",
    "KDPM2Ancestral",
    "KDPM2State",
    "LCM",
    "TCD",
    "ConsistencyState",
    "UniPC",
    "UniPCState",
    "a1111_samplers",
    "a1111_schedulers",
    "from_a1111",
    "schedules",
    "DDIM",
    "DDIMState",
    "DDPM",
    "DDPMState",
    "DPMSolverMultistep",
    "DPMSolverState",
    "Euler",
    "EulerAncestral",
    "FlowHeunState",
    "FlowMatchEuler",
    "FlowMatchHeun",
    "FlowState",
    "LMS",
    "LMSState",
    "PNDM",
    "PNDMState",
    "Sampler",
    "SigmaState",
    "UnknownSamplerError",
    "available",
    "get_sampler",
    "is_sampler",
    "kdiffusion_sampler",
    "name_of",
    "SAMPLERS",
    "FLOW_SAMPLERS",
    "CLASSES",
    "ALIASES",
    "A1111_NAMES",
]

# diffusers class name -> sampler class.
CLASSES: dict[str, type[Sampler]] = {
    cls.diffusers_class: cls
    for cls in (
        PNDM,
        DDIM,
        DDPM,
        Euler,
        EulerAncestral,
        LMS,
        DPMSolverMultistep,
        Heun,
        KDPM2,
        KDPM2Ancestral,
        DPMSolverSDE,
        DPMSolverSinglestep,
        UniPC,
        DEIS,
        LCM,
        TCD,
        FlowMatchEuler,
        FlowMatchHeun,
    )
}

_SDE2 = {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}
_SDE3 = {"algorithm_type": "sde-dpmsolver++", "solver_order": 3}
_SINGLE_SDE = {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}

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
    "dpmpp_2m_sde": (DPMSolverMultistep, {**_SDE2, "solver_type": "midpoint", "use_karras_sigmas": False}),
    "dpmpp_2m_sde_karras": (DPMSolverMultistep, {**_SDE2, "solver_type": "midpoint", "use_karras_sigmas": True}),
    "dpmpp_2m_sde_heun": (DPMSolverMultistep, {**_SDE2, "solver_type": "heun", "use_karras_sigmas": False}),
    "dpmpp_2m_sde_heun_karras": (DPMSolverMultistep, {**_SDE2, "solver_type": "heun", "use_karras_sigmas": True}),
    "dpmpp_3m_sde": (DPMSolverMultistep, {**_SDE3, "use_karras_sigmas": False}),
    "dpmpp_3m_sde_karras": (DPMSolverMultistep, {**_SDE3, "use_karras_sigmas": True}),
    "heun": (Heun, {"use_karras_sigmas": False}),
    "heun_karras": (Heun, {"use_karras_sigmas": True}),
    "dpm2": (KDPM2, {"use_karras_sigmas": False}),
    "dpm2_karras": (KDPM2, {"use_karras_sigmas": True}),
    "dpm2_a": (KDPM2Ancestral, {"use_karras_sigmas": False}),
    "dpm2_a_karras": (KDPM2Ancestral, {"use_karras_sigmas": True}),
    "dpmpp_sde": (DPMSolverSDE, {"use_karras_sigmas": False}),
    "dpmpp_sde_karras": (DPMSolverSDE, {"use_karras_sigmas": True}),
    "dpmpp_2s_a": (DPMSolverSinglestep, {**_SINGLE_SDE, "use_karras_sigmas": False}),
    "dpmpp_2s_a_karras": (DPMSolverSinglestep, {**_SINGLE_SDE, "use_karras_sigmas": True}),
    "dpmpp_2s": (DPMSolverSinglestep, {"solver_order": 2, "algorithm_type": "dpmsolver++", "use_karras_sigmas": False}),
    "unipc": (UniPC, {"solver_type": "bh2"}),
    "unipc_bh1": (UniPC, {"solver_type": "bh1"}),
    "deis": (DEIS, {}),
    "lcm": (LCM, {}),
    "tcd": (TCD, {}),
}

_FLOW = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
# Registry name -> (sampler class, fixed keys) for flow-matching models (Flux, SD 3/3.5): the velocity-predicting
# samplers. Kept apart from `SAMPLERS`, whose names apply to the variance-preserving models.
FLOW_SAMPLERS: dict[str, tuple[type[Sampler], dict[str, Any]]] = {
    "flow_euler": (FlowMatchEuler, {}),
    "flow_heun": (FlowMatchHeun, {}),
    "flow_dpmpp_2m": (
        DPMSolverMultistep,
        {**_FLOW, "algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": False},
    ),
    "flow_unipc": (UniPC, {**_FLOW, "solver_type": "bh2"}),
}

# AUTOMATIC1111's sampler names (current and the pre-1.9 ones with a schedule suffix) -> registry name: the
# diffusers class the name describes. `from_a1111` adds A1111's schedule semantics.
A1111_NAMES: dict[str, str] = {
    "PLMS": "pndm",
    "DDIM": "ddim",
    "Euler": "euler",
    "Euler a": "euler_a",
    "LMS": "lms",
    "LMS Karras": "lms_karras",
    "Heun": "heun",
    "DPM2": "dpm2",
    "DPM2 Karras": "dpm2_karras",
    "DPM2 a": "dpm2_a",
    "DPM2 a Karras": "dpm2_a_karras",
    "DPM++ 2S a": "dpmpp_2s_a",
    "DPM++ 2S a Karras": "dpmpp_2s_a_karras",
    "DPM++ 2M": "dpmpp_2m",
    "DPM++ 2M Karras": "dpmpp_2m_karras",
    "DPM++ SDE": "dpmpp_sde",
    "DPM++ SDE Karras": "dpmpp_sde_karras",
    "DPM++ 2M SDE": "dpmpp_2m_sde",
    "DPM++ 2M SDE Karras": "dpmpp_2m_sde_karras",
    "DPM++ 2M SDE Heun": "dpmpp_2m_sde_heun",
    "DPM++ 2M SDE Heun Karras": "dpmpp_2m_sde_heun_karras",
    "DPM++ 3M SDE": "dpmpp_3m_sde",
    "DPM++ 3M SDE Karras": "dpmpp_3m_sde_karras",
    "UniPC": "unipc",
    "LCM": "lcm",
}
# Every other spelling -> registry name (names also match case-insensitively, with spaces or hyphens for "_").
ALIASES: dict[str, str] = {
    **A1111_NAMES,
    "plms": "pndm",
    "DDPM": "ddpm",
    "Euler Karras": "euler_karras",
    "euler_ancestral": "euler_a",
    "DEIS": "deis",
    "TCD": "tcd",
}


class UnknownSamplerError(ConfigError, KeyError):
    """A sampler name that is neither a registry name, a diffusers class name nor an A1111 name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def available(flow: bool = False) -> list[str]:
    """The registry names, in registry order: of the variance-preserving models' samplers, or with `flow=True` of the
    flow-matching models' (`FLOW_SAMPLERS`)."""
    return list(FLOW_SAMPLERS if flow else SAMPLERS)


def _valid_names() -> str:
    return (
        f"registry names {list(SAMPLERS)}, flow-model registry names {list(FLOW_SAMPLERS)}, AUTOMATIC1111 names "
        f"{list(A1111_NAMES)} or diffusers classes {list(CLASSES)}"
    )


def _resolve_named(name: str) -> tuple[str | None, type[Sampler], dict[str, Any]]:
    """(registry name or None for a class name, class, fixed keys) of a sampler name."""
    if name in SAMPLERS:
        return (name, *SAMPLERS[name])
    if name in FLOW_SAMPLERS:
        return (name, *FLOW_SAMPLERS[name])
    if name in ALIASES:
        return (ALIASES[name], *SAMPLERS[ALIASES[name]])
    if name in CLASSES:
        return None, CLASSES[name], {}
    folded = {
        k.lower().replace("-", "_").replace(" ", "_"): v
        for k, v in [
            *((k, (k, *SAMPLERS[k])) for k in SAMPLERS),
            *((k, (k, *FLOW_SAMPLERS[k])) for k in FLOW_SAMPLERS),
            *((k, (v, *SAMPLERS[v])) for k, v in ALIASES.items()),
            *((k, (None, c, {})) for k, c in CLASSES.items()),
        ]
    }
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key in folded:
        return folded[key]
    from sdjax.samplers import a1111

    try:  # an A1111 sampler followed by a schedule label ("Euler a Uniform", "DPM++ 2M SDE Heun Exponential")
        registry, keys = a1111.config_keys(name)
    except (a1111.UnsupportedSamplerError, schedules.UnknownScheduleError):
        raise UnknownSamplerError(f"unknown sampler {name!r}; valid: {_valid_names()}") from None
    cls, fixed = SAMPLERS[registry]
    return registry, cls, {**fixed, **keys}


def _resolve(name: str) -> tuple[type[Sampler], dict[str, Any]]:
    _, cls, fixed = _resolve_named(name)
    return cls, fixed


def is_sampler(obj: Any) -> bool:
    """A sampler object the loop runs: a diffusers-parity `Sampler` or a k-diffusion-form `KDiffusionSampler`."""
    return isinstance(obj, (Sampler, KDiffusionSampler))


def _base_dict(base_config: Any) -> dict[str, Any]:
    if base_config is None:
        return {}
    if is_sampler(base_config):  # a KDiffusionSampler's `config` is the model's scheduler keys it knows
        return dict(base_config.config)
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
    name_or_config: str | dict[str, Any] | Sampler | KDiffusionSampler,
    base_config: dict[str, Any] | Sampler | None = None,
    *,
    schedule: str | None = None,
    **overrides,
) -> Sampler | KDiffusionSampler:
    """Build a sampler.

    - `name_or_config` a name: the registry name (`available()`), an AUTOMATIC1111 name ("DPM++ 2M Karras") or
      a diffusers class name ("EulerDiscreteScheduler"); the config starts from `base_config` (a pipeline's
      sampler or its scheduler config dict: the beta schedule, prediction type, timestep spacing, ... carry
      over as in diffusers' `from_config(pipe.scheduler.config)`), then the keys the name fixes (Karras sigmas,
      algorithm), the schedule's keys and `overrides` apply. Without `base_config`, diffusers' defaults of that
      class. An A1111 name here is the diffusers class the name describes; `from_a1111` applies A1111's own
      semantics (its "Automatic" schedule per sampler, its UniPC defaults).
    - a `scheduler_config.json` dict: built by its `_class_name` (`base_config` is then not used: the config
      is the whole scheduler, as diffusers' `from_pretrained(..., scheduler=obj)`).
    - a Sampler: used as given (`base_config` likewise unused), or rebuilt with a schedule or `overrides`; a
      `KDiffusionSampler` only as given.
    - a k-diffusion-form name, "kdiffusion:RULE:SCHEDULE[:eta=X]" (what `name_of` gives for a `KDiffusionSampler`):
      that sampler on `base_config`'s model (`kdiffusion.from_name`); `schedule` and `overrides` do not apply.

    `schedule` is an A1111 schedule name ("Karras", "Exponential", "SGM Uniform", ...; see
    `sdjax.samplers.schedules`), "Automatic" being A1111's choice for the named sampler. `overrides` are config
    keys, plus runtime options such as DDIM's `eta`. Raises `UnknownSamplerError` (a `ConfigError`) listing the
    valid names for an unknown name, `ConfigError` for bad config keys or a schedule the sampler cannot express.
    Warns when LCM or TCD is swapped onto a model whose own scheduler is neither (a model not distilled for them).
    """
    registry = None
    if isinstance(name_or_config, KDiffusionSampler) and name_or_config.origin is not None:
        if not overrides and schedule is None:
            return name_or_config
        name_or_config = name_or_config.origin  # rebuilt from the diffusers config it stands for
    if isinstance(name_or_config, KDiffusionSampler) or _is_kdiffusion_name(name_or_config):
        if overrides or schedule is not None:
            raise ConfigError(
                f"get_sampler: the k-diffusion form {_name_of_any(name_or_config)!r} takes no schedule or config "
                "overrides here; build it with samplers.kdiffusion_sampler(rule, schedule, ..., eta=)"
            )
        if isinstance(name_or_config, KDiffusionSampler):
            return name_or_config
        return kdiffusion.from_name(name_or_config, base_config)
    if isinstance(name_or_config, Sampler):  # used as given (diffusers' from_pretrained(scheduler=object))
        if not overrides and schedule is None:
            return name_or_config
        registry = name_of(name_or_config)
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
        registry, cls, fixed = _resolve_named(name_or_config)
        raw = _swap_config(_base_dict(base_config))
        _warn_if_not_distilled(cls, base_config)
        if registry in FLOW_SAMPLERS:
            raw = _flow_swap(cls, raw, name_or_config)
    else:
        raise TypeError(
            f"get_sampler: expected a name, a config dict or a Sampler, got {type(name_or_config).__name__}"
        )
    scheduled = _schedule_keys(cls, registry, schedule) if schedule is not None else {}
    options = {k: raw.pop(k) for k in list(raw) if k in cls.options}  # a Sampler's runtime options...
    options.update({k: overrides.pop(k) for k in list(overrides) if k in cls.options})  # ...unless overridden
    return front(cls.from_config({**raw, **fixed, **scheduled, **overrides}, **options))


# The classes whose configs may have a k-diffusion form (`kdiffusion.from_diffusers` decides per config).
K_FORM_CLASSES = ("Euler", "EulerAncestral", "Heun", "FlowMatchEuler", "FlowMatchHeun", "DPMSolverMultistep")


def front(sampler: Sampler) -> Sampler | KDiffusionSampler:
    """What the diffusers-config front hands out for a parsed config: its k-diffusion form (a `KDiffusionSampler`
    whose `origin` is `sampler`) where `kdiffusion.from_diffusers` expresses the config exactly, else `sampler`
    itself (the configs each class keeps: module docstring)."""
    if type(sampler).__name__ not in K_FORM_CLASSES:
        return sampler
    try:
        return kdiffusion.from_diffusers(sampler)
    except ConfigError:
        return sampler


def _flow_swap(cls: type[Sampler], raw: dict[str, Any], name: str) -> dict[str, Any]:
    """A flow registry sampler's start config: the base must be a flow model's, and a FlowMatch `shift` becomes the
    `flow_shift` of DPM-Solver++/UniPC (what `DPMSolverMultistepScheduler.from_config(flux.config,
    use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=flux.config.shift)` needs by hand)."""
    check_flow_config(raw, f"sampler {name!r} on the base config")
    if "flow_shift" in cls.config_keys() and "flow_shift" not in raw and "shift" in raw:
        raw = {**raw, "flow_shift": raw["shift"]}
    return raw


def _schedule_keys(cls: type[Sampler], registry: str | None, schedule: str) -> dict[str, Any]:
    found = schedules.find_schedule(schedule)
    if found.name != "automatic":
        return schedules.schedule_keys(cls, found.name)
    if registry is None:
        return {}
    for suffix in ("", "_karras"):  # "dpmpp_2m_karras" is A1111's DPM++ 2M (Automatic: Karras)
        if registry.endswith(suffix) and registry[: len(registry) - len(suffix)] in schedules.AUTOMATIC:
            return schedules.schedule_keys(cls, schedules.AUTOMATIC[registry[: len(registry) - len(suffix)]])
    return {}


_DISTILLED = {"LCMScheduler", "TCDScheduler"}


def _warn_if_not_distilled(cls: type[Sampler], base_config: Any) -> None:
    if cls.diffusers_class not in _DISTILLED or base_config is None:
        return
    base = _base_dict(base_config).get("_class_name")
    if base not in _DISTILLED:
        warnings.warn(
            f"{cls.diffusers_class} expects a model distilled for it (an LCM/TCD checkpoint or LoRA); this model's "
            f"scheduler is {base}: images will be poor unless such a LoRA is loaded",
            UserWarning,
            stacklevel=3,
        )


def _options(sampler: Sampler) -> dict[str, Any]:
    return {k: getattr(sampler, k) for k in sampler.options}


def _is_flow(sampler: Sampler) -> bool:
    if isinstance(sampler, KDiffusionSampler):
        return sampler.prediction.flow
    return isinstance(sampler, (FlowMatchEuler, FlowMatchHeun)) or bool(getattr(sampler, "use_flow_sigmas", False))


def _is_kdiffusion_name(name: Any) -> bool:
    return isinstance(name, str) and name.strip().lower().startswith("kdiffusion:")


def _name_of_any(sampler_or_name: Any) -> str:
    return sampler_or_name if isinstance(sampler_or_name, str) else name_of(sampler_or_name)


def name_of(sampler: Sampler | KDiffusionSampler) -> str:
    """The registry name that describes `sampler` (the first whose fixed keys it has: in `FLOW_SAMPLERS` for a flow
    sampler), else its diffusers class name; a `KDiffusionSampler` built from a diffusers config is named as that
    config (its `origin`), any other by its `name` ("kdiffusion:dpmpp_2m:karras")."""
    if isinstance(sampler, KDiffusionSampler):
        if sampler.origin is None:
            return sampler.name
        sampler = sampler.origin  # the diffusers config it was built from names it
    for name, (cls, fixed) in (FLOW_SAMPLERS if _is_flow(sampler) else SAMPLERS).items():
        if type(sampler) is cls and all(getattr(sampler, k) == v for k, v in fixed.items()):
            return name
    return sampler.diffusers_class


# The A1111 layer sits on the registry above (it imports `SAMPLERS` and `get_sampler` lazily); the k-diffusion form
# (one denoiser wrapper, sigma schedules, sigma-only step rules) beside it.
from sdjax.samplers import kdiffusion  # noqa: E402
from sdjax.samplers.a1111 import a1111_samplers, a1111_schedulers, from_a1111  # noqa: E402
from sdjax.samplers.kdiffusion import KDiffusionSampler, kdiffusion_sampler  # noqa: E402
