"""AUTOMATIC1111 semantics: its sampler names (as `/sdapi/v1/samplers` lists them, A1111 1.10), its schedule
names (`/sdapi/v1/schedulers`) and what a (sampler, schedule) pair means as a diffusers scheduler config.

`from_a1111(sampler_name, scheduler_name, base_config)` is what the server and the CLI call; `a1111_samplers()` and
`a1111_schedulers()` give A1111's response shapes. Sampler names resolve as A1111's `get_sampler_and_scheduler`
does: the label or an alias, and a legacy name with a schedule suffix ("DPM++ 2M Karras", "DPM++ 2M SDE Heun
Exponential") splits into the sampler and that schedule (the suffix wins over `scheduler_name`). Matching is
case-insensitive. Samplers A1111 has but diffusers does not ("DPM fast", "DPM adaptive", "Restart", "DDIM CFG++")
are refused with the list of supported names, instead of A1111's silent fallback to its first sampler.

Differences from A1111 that come from following diffusers: "DPM++ 2S a" is diffusers' singlestep DPM-Solver++ with
SDE noise (one model call per step; A1111's makes two per step), DPM2/DPM2 a/DPM++ 3M SDE keep the next-to-last
sigma A1111 discards, the SDE samplers of `DPMSolverMultistepScheduler` draw independent noise per step where A1111
uses a Brownian tree (DPM++ SDE does use one), and "UniPC" is diffusers' UniPC with A1111's defaults (bh1, order 3).

Flow-matching models (Flux, SD 3): the names above are the variance-preserving samplers and would sample a flow
model as an epsilon model. `from_a1111_flow` is the flow families' mapping (Forge's names on Flux): "Euler", "Heun",
"DPM++ 2M" and "UniPC" (A1111's bh1, order 3) are diffusers' flow samplers (`samplers.FLOW_SAMPLERS`); the schedules
"Automatic", "Simple", "Normal" and "Uniform" keep the family's own sigma grid (Forge's "Simple" on Flux picks the
shifted sigmas at t = 1 - i/n: FluxPipeline's grid, `sigma_grid="flux"`, though Forge fixes the shift where diffusers
computes mu from the resolution); "Karras", "Exponential" and "Beta" are the FlowMatch classes' `use_*_sigmas` (refused
for DPM-Solver++/UniPC with flow sigmas, as diffusers has no such combination). The pairs no diffusers flow sampler
expresses but the k-diffusion form runs (`FLOW_KDIFFUSION`: "Euler a" as the rectified-flow ancestral sampler of
ComfyUI and Forge, "DPM++ 2M SDE", "DPM++ 2M" with Karras / Exponential / Beta, "Euler" and "Heun" with SGM Uniform)
are `samplers.kdiffusion.KDiffusionSampler`s on the model's shifted sigmas; the family grids stay the family's
(FluxPipeline's or diffusers' for "Euler a"; "DPM++ 2M SDE" takes DPM-Solver's flow grid, the one "DPM++ 2M" runs
on). Every other pair is refused, naming the sampler or the schedule.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from sdjax.config import ConfigError
from sdjax.samplers import schedules
from sdjax.samplers.common import Sampler

if TYPE_CHECKING:
    from sdjax.samplers.kdiffusion import KDiffusionSampler


@dataclasses.dataclass(frozen=True)
class A1111Sampler:
    """One A1111 sampler: its API fields and the sdjax registry name (+ fixed keys) it maps to (None: no
    diffusers equivalent)."""

    name: str
    aliases: tuple[str, ...]
    options: dict[str, Any]
    registry: str | None
    keys: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def default_schedule(self) -> str | None:
        """A1111's "Automatic" for this sampler: its `options["scheduler"]`, k-diffusion's uniform sigmas for the
        other k-diffusion samplers, None (the model's own grid) for the timestep samplers."""
        return schedules.AUTOMATIC.get(self.registry) if self.registry else None

    def api(self) -> dict[str, Any]:
        """The entry of A1111's `/sdapi/v1/samplers` response."""
        return {"name": self.name, "aliases": list(self.aliases), "options": dict(self.options)}


def _s(name, aliases, options, registry, **keys) -> A1111Sampler:
    return A1111Sampler(name, tuple(aliases), options, registry, keys)


_K = "karras"
_E = "exponential"
# A1111 1.10's `all_samplers` (k-diffusion, then timestep samplers, then LCM), in its order, then sdjax's
# additions (diffusers schedulers A1111 does not list).
A1111_SAMPLERS: tuple[A1111Sampler, ...] = (
    _s("DPM++ 2M", ["k_dpmpp_2m"], {"scheduler": _K}, "dpmpp_2m"),
    _s("DPM++ SDE", ["k_dpmpp_sde"], {"scheduler": _K, "second_order": True, "brownian_noise": True}, "dpmpp_sde"),
    _s("DPM++ 2M SDE", ["k_dpmpp_2m_sde"], {"scheduler": _E, "brownian_noise": True}, "dpmpp_2m_sde"),
    _s(
        "DPM++ 2M SDE Heun",
        ["k_dpmpp_2m_sde_heun"],
        {"scheduler": _E, "brownian_noise": True, "solver_type": "heun"},
        "dpmpp_2m_sde_heun",
    ),
    _s("DPM++ 2S a", ["k_dpmpp_2s_a"], {"scheduler": _K, "uses_ensd": True, "second_order": True}, "dpmpp_2s_a"),
    _s(
        "DPM++ 3M SDE",
        ["k_dpmpp_3m_sde"],
        {"scheduler": _E, "discard_next_to_last_sigma": True, "brownian_noise": True},
        "dpmpp_3m_sde",
    ),
    _s("Euler a", ["k_euler_a", "k_euler_ancestral"], {"uses_ensd": True}, "euler_a"),
    _s("Euler", ["k_euler"], {}, "euler"),
    _s("LMS", ["k_lms"], {}, "lms"),
    _s("Heun", ["k_heun"], {"second_order": True}, "heun"),
    _s("DPM2", ["k_dpm_2"], {"scheduler": _K, "discard_next_to_last_sigma": True, "second_order": True}, "dpm2"),
    _s(
        "DPM2 a",
        ["k_dpm_2_a"],
        {"scheduler": _K, "discard_next_to_last_sigma": True, "uses_ensd": True, "second_order": True},
        "dpm2_a",
    ),
    _s("DPM fast", ["k_dpm_fast"], {"uses_ensd": True}, None),
    _s("DPM adaptive", ["k_dpm_ad"], {"uses_ensd": True}, None),
    _s("Restart", ["restart"], {"scheduler": _K, "second_order": True}, None),
    _s("DDIM", ["ddim"], {}, "ddim"),
    _s("DDIM CFG++", ["ddim_cfgpp"], {}, None),
    _s("PLMS", ["plms"], {}, "pndm"),
    _s("UniPC", ["unipc"], {}, "unipc_bh1", solver_order=3),
    _s("LCM", ["k_lcm"], {}, "lcm"),
    # sdjax's additions
    _s("DDPM", ["ddpm"], {}, "ddpm"),
    _s("DEIS", ["deis"], {}, "deis"),
    _s("TCD", ["tcd"], {}, "tcd"),
)


class UnsupportedSamplerError(ConfigError, KeyError):
    """An A1111 sampler name that is unknown, or known but without a diffusers equivalent."""

    def __str__(self) -> str:
        return str(self.args[0])


def _fold(name: str) -> str:
    return " ".join(name.strip().lower().replace("_", " ").split())


def supported_names() -> list[str]:
    return [s.name for s in A1111_SAMPLERS if s.registry is not None]


def find_sampler(name: str) -> A1111Sampler:
    """An A1111 sampler by label or alias (case-insensitive); raises `UnsupportedSamplerError` listing the
    supported names."""
    key = _fold(name)
    for sampler in A1111_SAMPLERS:
        if key in {_fold(sampler.name), *(_fold(a) for a in sampler.aliases)}:
            if sampler.registry is None:
                raise UnsupportedSamplerError(
                    f"A1111 sampler {sampler.name!r} has no diffusers equivalent; supported: {supported_names()}"
                )
            return sampler
    raise UnsupportedSamplerError(f"unknown A1111 sampler {name!r}; supported: {supported_names()}")


def split_name(sampler_name: str, scheduler_name: str | None = None) -> tuple[A1111Sampler, str]:
    """(sampler, schedule label) as A1111's `get_sampler_and_scheduler`: a name ending in a schedule's label or
    alias ("DPM++ 2M Karras") is that sampler with that schedule, whatever `scheduler_name` says."""
    if not isinstance(sampler_name, str) or not sampler_name.strip():
        raise UnsupportedSamplerError(f"sampler name must be a non-empty string, got {sampler_name!r}")
    schedule = schedules.find_schedule(scheduler_name or "Automatic")
    name = sampler_name.strip()
    for candidate in schedules.SCHEDULES:
        for option in (candidate.label, *(candidate.aliases or ())):
            if name.lower().endswith(" " + option.lower()) and candidate.name != "automatic":
                head = name[: -(len(option) + 1)]
                try:
                    sampler = find_sampler(head)
                except UnsupportedSamplerError:
                    continue
                return sampler, candidate.label
    return find_sampler(name), schedule.label


def _schedule_for(sampler: A1111Sampler, label: str) -> str | None:
    schedule = schedules.find_schedule(label)
    if schedule.name == "automatic":
        return sampler.default_schedule
    return schedule.name


def config_keys(sampler_name: str, scheduler_name: str | None = None) -> tuple[str, dict[str, Any]]:
    """(registry name, config keys) of an A1111 (sampler, schedule) pair: the keys the registry name fixes are
    applied by `get_sampler`; these are the sampler's extra keys and the schedule's."""
    from sdjax.samplers import SAMPLERS

    sampler, label = split_name(sampler_name, scheduler_name)
    cls, _ = SAMPLERS[sampler.registry]
    keys = dict(sampler.keys)
    schedule = _schedule_for(sampler, label)
    if schedule is not None:
        keys.update(schedules.schedule_keys(cls, schedule, sampler_label=f"A1111 sampler {sampler.name!r}"))
    return sampler.registry, keys


def from_a1111(
    sampler_name: str, scheduler_name: str | None = "Automatic", base_config: Any = None, **overrides
) -> Sampler:
    """The sdjax sampler for A1111's `sampler_name` and `scheduler_name` ("Automatic" when None), swapped in on
    `base_config` (the model's scheduler config or sampler) as diffusers' `from_config` does; `overrides` are
    further config keys or runtime options (`eta`). Raises `UnsupportedSamplerError`,
    `schedules.UnknownScheduleError` or `schedules.UnsupportedScheduleError` (all `ConfigError`s) with the valid
    names."""
    from sdjax.samplers import get_sampler

    registry, keys = config_keys(sampler_name, scheduler_name)
    return get_sampler(registry, base_config, **{**keys, **overrides})


# A1111 label -> (flow registry name, the A1111 row's own keys) on flow-matching models.
FLOW_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "Euler": ("flow_euler", {}),
    "Heun": ("flow_heun", {}),
    "DPM++ 2M": ("flow_dpmpp_2m", {}),
    "UniPC": ("flow_unipc", {"solver_type": "bh1", "solver_order": 3}),
}
FLOW_GRID_SCHEDULES = ("automatic", "simple", "normal", "uniform")
_RANGE = ("karras", "exponential", "beta")
# A1111 label -> (k-diffusion step rule, the schedules it takes) for the pairs on flow-matching models that no
# diffusers flow sampler expresses; `from_a1111_flow` serves them with the k-diffusion form. Pairs `FLOW_NAMES`
# serves are absent (they keep their diffusers-parity sampler); tests/samplers/test_kdiffusion_reach.py checks every
# (sampler, schedule) pair against a written-out table.
FLOW_KDIFFUSION: dict[str, tuple[str, tuple[str, ...]]] = {
    "Euler": ("euler", ("sgm_uniform",)),
    "Heun": ("heun", ("sgm_uniform",)),
    "Euler a": ("euler_ancestral", (*FLOW_GRID_SCHEDULES, *_RANGE, "sgm_uniform")),
    "DPM++ 2M": ("dpmpp_2m", _RANGE),
    "DPM++ 2M SDE": ("dpmpp_2m_sde", (*FLOW_GRID_SCHEDULES, *_RANGE, "sgm_uniform")),
}


def _flow_kdiffusion(rule: str, schedule: str, base_config: Any, overrides: dict[str, Any]) -> KDiffusionSampler:
    """The k-diffusion form of a `FLOW_KDIFFUSION` pair: a family-grid schedule is the "flow" schedule (DPM-Solver's
    grid and truncated timesteps for DPM++ 2M SDE, as diffusers' flow DPM-Solver++ that "DPM++ 2M" is; otherwise
    FlowMatch's grid, which the Flux and SD 3 pipelines set to their own), any other the named sigma schedule on the
    shifted table with the timestep sigma * T. `overrides` may hold `eta` only."""
    from sdjax.samplers.kdiffusion import kdiffusion_sampler

    extra = sorted(set(overrides) - {"eta"})
    if extra:
        raise ConfigError(f"the k-diffusion form of {rule!r} on a flow model takes only eta; got {extra}")
    eta = float(overrides.get("eta", 1.0))
    if schedule not in FLOW_GRID_SCHEDULES:
        return kdiffusion_sampler(rule, schedule, "flow", base_config=base_config, eta=eta)
    if rule == "dpmpp_2m_sde":
        solver = {"grid": "solver", "timestep": "floor"}
        return kdiffusion_sampler(rule, "flow", "flow", base_config=base_config, eta=eta, **solver)
    return kdiffusion_sampler(rule, "flow", "flow", base_config=base_config, eta=eta)


def from_a1111_flow(
    sampler_name: str, scheduler_name: str | None = "Automatic", base_config: Any = None, **overrides
) -> Sampler | KDiffusionSampler:
    """The flow-matching sampler for an A1111/Forge (sampler, schedule) pair on a flow model (see the module
    docstring), swapped in on `base_config` (the model's FlowMatch config or sampler): a diffusers flow sampler
    (`FLOW_NAMES`), or for the pairs of `FLOW_KDIFFUSION` a `KDiffusionSampler`. Raises `UnsupportedSamplerError`
    for a sampler without a flow equivalent, `schedules.UnsupportedScheduleError` or `ConfigError` for a schedule
    the sampler cannot express."""
    from sdjax.samplers import FLOW_SAMPLERS, get_sampler

    sampler, label = split_name(_a1111_label(sampler_name), scheduler_name)
    schedule = schedules.find_schedule(label)
    rule, kd_schedules = FLOW_KDIFFUSION.get(sampler.name, (None, ()))
    if schedule.name in kd_schedules:
        return _flow_kdiffusion(rule, schedule.name, base_config, dict(overrides))
    if sampler.name not in FLOW_NAMES:
        if rule is not None:
            raise schedules.UnsupportedScheduleError(
                f"A1111 sampler {sampler.name!r} on a flow model takes the schedules "
                f"{[schedules.find_schedule(k).label for k in kd_schedules]}, not {schedule.label!r}"
            )
        raise UnsupportedSamplerError(
            f"A1111 sampler {sampler.name!r} has no flow-matching equivalent; on flow models: {flow_names()}"
        )
    registry, keys = FLOW_NAMES[sampler.name]
    if schedule.name not in FLOW_GRID_SCHEDULES:
        cls = FLOW_SAMPLERS[registry][0]
        keys = {**keys, **schedules.schedule_keys(cls, schedule.name, sampler_label=f"A1111 sampler {sampler.name!r}")}
    return get_sampler(registry, base_config, **{**keys, **overrides})


def _a1111_label(name: Any) -> Any:
    """The A1111 name of an sdjax registry name that stands for one ("dpmpp_2m_sde" -> "DPM++ 2M SDE",
    "dpmpp_2m_karras" -> "DPM++ 2M Karras", "heun_karras" -> "Heun Karras": the form `infotext.sampler_id` gives
    requests); other names unchanged."""
    from sdjax.samplers import A1111_NAMES, ALIASES

    for table in (A1111_NAMES, ALIASES):
        for label, registry in table.items():
            if registry == name and label != name:
                return label
    if isinstance(name, str) and name.endswith("_karras"):  # "heun_karras": a registry variant without an alias
        stem = _a1111_label(name[: -len("_karras")])
        return f"{stem} Karras" if stem != name[: -len("_karras")] else name
    return name


def flow_names() -> list[str]:
    """The A1111 sampler names `from_a1111_flow` serves (with some schedule)."""
    return list(dict.fromkeys([*FLOW_NAMES, *FLOW_KDIFFUSION]))


def a1111_samplers() -> list[dict[str, Any]]:
    """A1111's `/sdapi/v1/samplers` response for the samplers sdjax runs: `[{name, aliases, options}]`."""
    return [s.api() for s in A1111_SAMPLERS if s.registry is not None]


def a1111_schedulers() -> list[dict[str, Any]]:
    """A1111's `/sdapi/v1/schedulers` response for the schedules sdjax supports:
    `[{name, label, aliases, default_rho, need_inner_model}]`."""
    return [s.api() for s in schedules.SCHEDULES if s.keys is not None]


def canonical(sampler_name: str, scheduler_name: str | None = "Automatic") -> str:
    """One string for an A1111 (sampler, schedule) pair with "Automatic" resolved: the sampler's label followed by
    the schedule's label ("DPM++ 2M" + "Automatic" -> "DPM++ 2M Karras", "Euler a" + "Automatic" -> "Euler a
    Uniform"), or the label alone where the sampler keeps the model's grid ("DDIM"). `get_sampler` builds the same
    sampler from this string as `from_a1111` from the pair; requests that spell a pair differently share it."""
    sampler, label = split_name(sampler_name, scheduler_name)
    schedule = _schedule_for(sampler, label)
    if schedule is not None:
        from sdjax.samplers import SAMPLERS

        schedules.schedule_keys(
            SAMPLERS[sampler.registry][0], schedule, sampler_label=f"A1111 sampler {sampler.name!r}"
        )
        return f"{sampler.name} {schedules.find_schedule(schedule).label}"
    return sampler.name


def describe(spec: str) -> tuple[str, str | None]:
    """(sampler label, schedule label or None) of a string `canonical` wrote, for the infotext's "Sampler" and
    "Schedule type"; a string that is no A1111 pair comes back whole with None."""
    try:
        sampler, label = split_name(spec)
    except (UnsupportedSamplerError, schedules.UnknownScheduleError):
        return spec, None
    return sampler.name, (None if label == "Automatic" else label)
