"""Noise schedules as a choice separate from the sampler: AUTOMATIC1111's schedule names (A1111 >= 1.9
`modules/sd_schedulers.py`) mapped onto the diffusers config keys that produce them.

A1111 builds a sigma list per schedule; diffusers builds its schedule from config keys. The mapping follows
diffusers' own table ("Noise schedules and schedule types" in its scheduler overview) and the A1111 formulas:

| A1111 (name / label)        | diffusers config                                        |
|-----------------------------|---------------------------------------------------------|
| uniform / Uniform           | `timestep_spacing="linspace"` (k-diffusion's default: t from T - 1 down to 0) |
| normal / Normal             | `timestep_spacing="linspace"` (the same grid through `t_to_sigma`) |
| karras / Karras             | `use_karras_sigmas=True` (over the full sigma range: linspace spacing) |
| exponential / Exponential   | `use_exponential_sigmas=True` (linspace spacing)         |
| beta / Beta                 | `use_beta_sigmas=True` (alpha = beta = 0.6, linspace spacing) |
| sgm_uniform / SGM Uniform   | `timestep_spacing="trailing"`                            |
| simple / Simple             | `timestep_spacing="trailing"`                            |
| ddim / DDIM                 | `timestep_spacing="leading"`, `steps_offset=1` (A1111's DDIM grid 1, 1 + T/n, ...) |
| polyexponential, kl_optimal, align_your_steps | no diffusers equivalent: refused |

A schedule applies only to a sampler whose diffusers class has the keys: Karras is refused for DDIM, PNDM or
Euler a (their classes have no `use_karras_sigmas`), spacing schedules for LCM/TCD (their grid is the
distillation grid) and for DPM-Solver singlestep beyond its fixed linspace grid. A spacing schedule also turns
off a sigma schedule the base config had (Uniform on a Karras config is uniform). "Automatic" is the sampler's
own choice (A1111's `options["scheduler"]`, e.g. Karras for DPM++ 2M, or Uniform for the other k-diffusion
samplers); the timestep samplers (DDIM, PLMS, UniPC, LCM) keep the model's config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdjax.config import ConfigError
from sdjax.samplers.common import SIGMA_SCHEDULE_KEYS


class UnknownScheduleError(ConfigError, KeyError):
    """A schedule name A1111 does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


class UnsupportedScheduleError(ConfigError):
    """A schedule without a diffusers equivalent, or one the chosen sampler's class cannot express."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One A1111 schedule: its API fields (`name`, `label`, `aliases`, `default_rho`, `need_inner_model`) and the
    diffusers keys it sets (None: no diffusers equivalent, with the reason)."""

    name: str
    label: str
    keys: dict[str, Any] | None
    aliases: tuple[str, ...] | None = None
    default_rho: float = -1
    need_inner_model: bool = False
    reason: str = ""

    def api(self) -> dict[str, Any]:
        """The entry of A1111's `/sdapi/v1/schedulers` response."""
        return {
            "name": self.name,
            "label": self.label,
            "aliases": list(self.aliases) if self.aliases is not None else None,
            "default_rho": self.default_rho,
            "need_inner_model": self.need_inner_model,
        }


LINSPACE = {"timestep_spacing": "linspace"}
TRAILING = {"timestep_spacing": "trailing"}

# A1111 1.10's schedulers, in its order.
SCHEDULES: tuple[Schedule, ...] = (
    Schedule("automatic", "Automatic", {}),
    Schedule("uniform", "Uniform", LINSPACE, need_inner_model=True),
    Schedule("karras", "Karras", {**LINSPACE, "use_karras_sigmas": True}, default_rho=7.0),
    Schedule("exponential", "Exponential", {**LINSPACE, "use_exponential_sigmas": True}),
    Schedule("polyexponential", "Polyexponential", None, default_rho=1.0, reason="no diffusers equivalent"),
    Schedule("sgm_uniform", "SGM Uniform", TRAILING, aliases=("SGMUniform",), need_inner_model=True),
    Schedule("kl_optimal", "KL Optimal", None, reason="no diffusers equivalent"),
    Schedule("align_your_steps", "Align Your Steps", None, reason="no diffusers equivalent (per-model sigma tables)"),
    Schedule("simple", "Simple", TRAILING, need_inner_model=True),
    Schedule("normal", "Normal", LINSPACE, need_inner_model=True),
    Schedule("ddim", "DDIM", {"timestep_spacing": "leading", "steps_offset": 1}, need_inner_model=True),
    Schedule("beta", "Beta", {**LINSPACE, "use_beta_sigmas": True}, need_inner_model=True),
)

# What "Automatic" means for a registry sampler (A1111's `options["scheduler"]`, else k-diffusion's uniform
# sigmas); registry names not listed keep the model's config (timestep samplers).
AUTOMATIC: dict[str, str] = {
    "dpmpp_2m": "karras",
    "dpmpp_sde": "karras",
    "dpmpp_2m_sde": "exponential",
    "dpmpp_2m_sde_heun": "exponential",
    "dpmpp_2s_a": "karras",
    "dpmpp_3m_sde": "exponential",
    "euler_a": "uniform",
    "euler": "uniform",
    "lms": "uniform",
    "heun": "uniform",
    "dpm2": "karras",
    "dpm2_a": "karras",
}


def _fold(name: str) -> str:
    return name.strip().lower().replace(" ", "_").replace("-", "_")


def find_schedule(name: str) -> Schedule:
    """A schedule by A1111 name, label or alias (case-insensitive, spaces or underscores)."""
    if not isinstance(name, str):
        raise TypeError(f"schedule must be a name, got {type(name).__name__} {name!r}")
    key = _fold(name)
    for schedule in SCHEDULES:
        if key in {_fold(schedule.name), _fold(schedule.label), *(_fold(a) for a in schedule.aliases or ())}:
            return schedule
    raise UnknownScheduleError(f"unknown schedule {name!r}; valid: {[s.label for s in SCHEDULES]}")


def schedule_keys(cls, name: str, *, sampler_label: str | None = None) -> dict[str, Any]:
    """The config keys that give sampler class `cls` the schedule `name` (not "Automatic": see `AUTOMATIC`).
    Raises `UnsupportedScheduleError` naming the schedule and the sampler when there is no diffusers equivalent
    or `cls` lacks the keys."""
    schedule = find_schedule(name)
    who = sampler_label or cls.diffusers_class
    if schedule.keys is None:
        raise UnsupportedScheduleError(
            f"schedule {schedule.label!r} has {schedule.reason}; supported: "
            f"{[s.label for s in SCHEDULES if s.keys is not None]}"
        )
    keys = dict(schedule.keys)
    if not keys:
        return {}
    own = set(cls.config_keys())
    fixed = getattr(cls, "fixed_spacing", None)
    out: dict[str, Any] = {}
    for key, value in keys.items():
        if key == "timestep_spacing" and (key not in own or getattr(cls, "ignores_spacing", False)):
            if fixed == value and (key not in own):
                continue  # the class's grid is already this spacing
            raise UnsupportedScheduleError(
                f"schedule {schedule.label!r} sets timestep_spacing={value!r}, but {who} "
                f"({cls.diffusers_class}) uses its own timestep grid"
            )
        if key not in own:
            raise UnsupportedScheduleError(
                f"schedule {schedule.label!r} needs {key}, which {who} ({cls.diffusers_class}) does not have"
            )
        out[key] = value
    # A spacing or sigma schedule replaces any sigma schedule of the base config.
    for flag in SIGMA_SCHEDULE_KEYS:
        if flag in own and flag not in out:
            out[flag] = False
    return out
