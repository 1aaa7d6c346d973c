"""Samplers in k-diffusion's form (k-diffusion `sampling.py` / `external.py`, ComfyUI's `comfy/k_diffusion`): one
model wrapper turns the network's output into a denoised estimate (`prediction.py`), schedules are functions that
produce sigmas (`schedules.py`, the flow shifts included), and step rules act on sigmas only (`rules.py`).
`KDiffusionSampler` (`sampler.py`) combines the three into the Sampler contract of `sdjax.core.loop.denoise`.

A flow model is then one prediction ("flow") and one schedule ("flow", or any other on its shifted table), and every
rule runs it unchanged. This layer runs under the diffusers-config front of `sdjax.samplers`: `get_sampler` parses a
config with its diffusers-parity class and hands out `from_diffusers(parsed)` wherever that expresses it exactly
(`samplers.front`; the classes keep the configs it does not). `kdiffusion_sampler(rule, schedule, prediction,
base_config=...)` builds one by hand, reading the model's noise schedule and flow shift from a diffusers scheduler
config; `from_diffusers(config)` gives the k-diffusion form of a diffusers scheduler where one exists (the same
numbers as diffusers step by step: tests/samplers/test_front_kform.py). A sampler's `name`
("kdiffusion:dpmpp_2m:karras") is what `samplers.name_of` reports; `from_name` builds one back from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdjax.config import ConfigError
from sdjax.samplers.common import Sampler
from sdjax.samplers.kdiffusion.prediction import PREDICTIONS, Prediction
from sdjax.samplers.kdiffusion.rules import RULES, Rule
from sdjax.samplers.kdiffusion.sampler import KDiffusionSampler, KState
from sdjax.samplers.kdiffusion.schedules import SCHEDULES, Schedule

__all__ = [
    "PREDICTIONS",
    "RULES",
    "SCHEDULES",
    "KDiffusionSampler",
    "KState",
    "Prediction",
    "Rule",
    "Schedule",
    "from_diffusers",
    "from_name",
    "kdiffusion_sampler",
]

_FLOW_CLASSES = ("FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler")
_BETA_KEYS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas")
_SHIFT_KEYS = (
    "shift",
    "use_dynamic_shifting",
    "base_shift",
    "max_shift",
    "base_image_seq_len",
    "max_image_seq_len",
    "time_shift_type",
    "shift_terminal",
)


def _config_dict(base_config: Any) -> dict[str, Any]:
    if base_config is None:
        return {}
    if isinstance(base_config, dict):
        return dict(base_config)
    config = getattr(base_config, "config", None)  # an sdjax Sampler
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"base_config must be a scheduler config dict, a Sampler or None, got {type(base_config).__name__}")


def _is_flow(raw: dict[str, Any]) -> bool:
    return (
        raw.get("_class_name") in _FLOW_CLASSES
        or raw.get("prediction_type") == "flow_prediction"
        or bool(raw.get("use_flow_sigmas"))
    )


def _prediction(raw: dict[str, Any], kind: str | None, timestep: str | None) -> Prediction:
    if raw.get("rescale_betas_zero_snr"):
        raise ConfigError("rescale_betas_zero_snr=True (an infinite top sigma) is not supported by this form")
    if kind is None:
        kind = "flow" if _is_flow(raw) else raw.get("prediction_type") or "epsilon"
    elif raw and (kind == "flow") != _is_flow(raw):
        raise ConfigError(
            f"prediction {kind!r} does not match the model's scheduler config "
            f"({'a flow-matching' if _is_flow(raw) else 'a variance-preserving'} model)"
        )
    keys = {} if kind == "flow" else {k: raw[k] for k in _BETA_KEYS if raw.get(k) is not None}
    if kind == "flow" and raw.get("num_train_timesteps") is not None:
        keys["num_train_timesteps"] = raw["num_train_timesteps"]
    return Prediction(kind=kind, timestep=timestep, **keys)


def from_name(name: str, base_config: Any = None) -> KDiffusionSampler:
    """The sampler a `KDiffusionSampler.name` describes ("kdiffusion:RULE:SCHEDULE[:eta=X]") for the model of
    `base_config`. A KDiffusionSampler as the base keeps its prediction (timestep mode included) and its schedule's
    options (flow shift, grid, rho), so `from_name(s.name, s) == s`; a diffusers config or sdjax Sampler goes through
    `kdiffusion_sampler`. Raises `ConfigError` naming the malformed part."""
    parts = name.strip().split(":") if isinstance(name, str) else []
    if len(parts) not in (3, 4) or parts[0] != "kdiffusion":
        raise ConfigError(f"k-diffusion sampler name {name!r}: expected 'kdiffusion:RULE:SCHEDULE' or '...:eta=X'")
    _, rule, schedule = parts[:3]
    eta = 1.0
    if len(parts) == 4:
        key, _, value = parts[3].partition("=")
        try:
            eta = float(value) if key == "eta" else None
        except ValueError:
            eta = None
        if eta is None:
            raise ConfigError(f"k-diffusion sampler name {name!r}: the fourth part must be 'eta=NUMBER'")
    if isinstance(base_config, KDiffusionSampler):
        if schedule not in SCHEDULES:
            raise ConfigError(f"k-diffusion sampler name {name!r}: schedule {schedule!r} is not one of {SCHEDULES}")
        kept = dataclasses.replace(base_config.schedule, name=schedule)
        return KDiffusionSampler(
            rule=rule, schedule=kept, prediction=base_config.prediction, eta=eta, form=base_config.form
        )
    return kdiffusion_sampler(rule, schedule, base_config=base_config, eta=eta)


def _flow_keys(raw: dict[str, Any]) -> dict[str, Any]:
    keys = {k: raw[k] for k in _SHIFT_KEYS if raw.get(k) is not None}
    if "flow_shift" in raw and "shift" not in keys:  # DPM-Solver/UniPC spell it flow_shift
        keys["shift"] = raw["flow_shift"]
    return keys


def kdiffusion_sampler(
    rule: str = "euler",
    schedule: str | Schedule | None = None,
    prediction: str | Prediction | None = None,
    *,
    base_config: Any = None,
    eta: float = 1.0,
    timestep: str | None = None,
    **schedule_options,
) -> KDiffusionSampler:
    """A k-diffusion-form sampler: step `rule` (`RULES`) on `schedule` (`SCHEDULES` name or a `Schedule`; None:
    "flow" for a flow model, "normal" otherwise) for a model predicting `prediction` ("epsilon", "v_prediction",
    "sample", "flow" or a `Prediction`; None: from `base_config`, else epsilon).

    `base_config` (a diffusers scheduler config dict or an sdjax Sampler: the model's) gives the beta schedule and
    prediction type of a variance-preserving model, and a flow model's shift keys (FlowMatch's `shift`,
    `use_dynamic_shifting`, ..., or DPM-Solver's `flow_shift`), which apply to the schedule unless
    `schedule_options` override them. `timestep` picks how sigma becomes the network's timestep
    (`prediction.py`)."""
    raw = _config_dict(base_config)
    if not isinstance(prediction, Prediction):
        prediction = _prediction(raw, prediction, timestep)
    elif timestep is not None:
        raise ValueError("timestep is set on the Prediction object itself")
    if not isinstance(schedule, Schedule):
        name = schedule or ("flow" if prediction.flow else "normal")
        options = _flow_keys(raw) if prediction.flow else {}
        schedule = Schedule(name=name, **{**options, **schedule_options})
    elif schedule_options:
        raise ValueError("schedule options apply to a schedule name, not to a Schedule object")
    return KDiffusionSampler(rule=rule, schedule=schedule, prediction=prediction, eta=eta)


_SIGMA_FLAGS = {"use_karras_sigmas": "karras", "use_exponential_sigmas": "exponential", "use_beta_sigmas": "beta"}
_SIMPLE_K = {
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler_ancestral",
    "HeunDiscreteScheduler": "heun",
}
# The pipelines' dynamic-shift keys, which DPM-Solver keeps as hidden config (`flow_match.SHIFT_DEFAULTS`).
_HIDDEN_SHIFT_KEYS = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift", "time_shift_type")


def _front_keys(sampler: Sampler) -> dict[str, Any]:
    """The keys a diffusers-parity sampler acts on: its own config keys (not the hidden keys of the config it was
    swapped from, which its class ignores), plus the pipelines' dynamic-shift keys DPM-Solver reads from them."""
    raw: dict[str, Any] = {"_class_name": sampler.diffusers_class}
    raw.update({k: getattr(sampler, k) for k in sampler.config_keys()})
    hidden = dict(sampler.hidden)
    raw.update({k: hidden[k] for k in _HIDDEN_SHIFT_KEYS if k in hidden and k not in raw})
    return raw


def from_diffusers(config: Any, **options) -> KDiffusionSampler:
    """The k-diffusion form of a diffusers scheduler (config dict or diffusers-parity `Sampler`) that it expresses
    exactly: Euler, Euler a, Heun (epsilon/v/sample, any `timestep_spacing`, Karras/exponential/beta sigmas),
    DPM-Solver++ 2M / 2M SDE (midpoint, final sigma 0) with Karras, exponential or beta sigmas or flow sigmas,
    FlowMatch Euler and Heun (static or dynamic shift, `shift_terminal`). A `Sampler` becomes the result's `origin`
    (its `sigma_grid` the flow grid). `options` go to the Schedule (e.g. the "flux" `grid`). Raises `ConfigError`
    naming what is not mapped for the others (their grids or updates have no sigma-only form here)."""
    origin = config if isinstance(config, Sampler) else None
    raw = _front_keys(config) if origin is not None else _config_dict(config)
    grid = getattr(origin, "sigma_grid", None)
    if grid is not None and "grid" not in options:
        options = {**options, "grid": grid}
    cls = raw.get("_class_name")
    if cls in _FLOW_CLASSES:
        sampler = _flow_match(cls, raw, options)
    elif cls in _SIMPLE_K:
        sampler = _sigma_sampler(cls, raw, options)
    elif cls == "DPMSolverMultistepScheduler":
        sampler = _dpm_solver(raw, options)
    else:
        raise ConfigError(f"{cls!r} has no k-diffusion form here")
    return dataclasses.replace(sampler, origin=origin) if origin is not None else sampler


def _sigma_schedule(raw: dict[str, Any]) -> str | None:
    return next((name for flag, name in _SIGMA_FLAGS.items() if raw.get(flag)), None)


def _flow_match(cls: str, raw: dict[str, Any], options: dict[str, Any]) -> KDiffusionSampler:
    if raw.get("stochastic_sampling") or raw.get("invert_sigmas") or _sigma_schedule(raw):
        raise ConfigError(f"{cls} with stochastic_sampling/invert_sigmas/use_*_sigmas has no k-diffusion form here")
    rule = "euler" if cls == "FlowMatchEulerDiscreteScheduler" else "heun"
    return kdiffusion_sampler(rule, "flow", "flow", base_config=raw, timestep="scaled", **options)


def _sigma_sampler(cls: str, raw: dict[str, Any], options: dict[str, Any]) -> KDiffusionSampler:
    """Euler, Euler a, Heun: the spaced grid (timesteps fed as diffusers computes them) or a sigma schedule between
    the spaced grid's ends; the first sample is sigma times the noise on a linspace/trailing grid (`form="ve_sigma"`,
    diffusers' `init_noise_sigma`)."""
    unmapped = {
        "interpolation_type": ("linear", None),
        "final_sigmas_type": ("zero", None),
        "timestep_type": ("discrete", None),
        "sigma_min": (None,),
        "sigma_max": (None,),
        "clip_sample": (False, None),
    }
    for key, kept in unmapped.items():
        if raw.get(key) not in kept:
            raise ConfigError(f"{cls}: {key}={raw[key]!r} is not mapped to the k-diffusion form")
    spacing = {"spacing": raw.get("timestep_spacing") or "linspace", "steps_offset": raw.get("steps_offset") or 0}
    form = "ve_sigma" if spacing["spacing"] in ("linspace", "trailing") else "ve"
    schedule = _sigma_schedule(raw)
    if schedule:
        made = kdiffusion_sampler(
            _SIMPLE_K[cls], schedule, base_config=raw, timestep="log", sigma_range="spaced", **spacing, **options
        )
    else:
        made = kdiffusion_sampler(_SIMPLE_K[cls], "spaced", base_config=raw, timestep="linear", **spacing, **options)
    return dataclasses.replace(made, form=form)


def _dpm_solver(raw: dict[str, Any], options: dict[str, Any]) -> KDiffusionSampler:
    """DPM-Solver++ 2M (SDE): first order on its first step and on the step to sigma 0, as diffusers with
    `final_sigmas_type="zero"` (where `lower_order_final` and `euler_at_final` change nothing at order 2), on the VP
    sample as diffusers holds it (`form="vp"`)."""
    algorithm = raw.get("algorithm_type", "dpmsolver++")
    solver = raw.get("solver_type", "midpoint")
    if raw.get("solver_order", 2) != 2 or solver not in ("midpoint", "heun"):
        raise ConfigError("DPMSolverMultistepScheduler: only solver_order=2 (midpoint, or heun for SDE) is mapped")
    if solver == "heun" and algorithm != "sde-dpmsolver++":
        raise ConfigError("DPMSolverMultistepScheduler: solver_type='heun' is mapped for sde-dpmsolver++ only")
    if raw.get("final_sigmas_type", "zero") != "zero":
        raise ConfigError("DPMSolverMultistepScheduler: only final_sigmas_type='zero' is mapped")
    rule = {"dpmsolver++": "dpmpp_2m", "sde-dpmsolver++": "dpmpp_2m_sde"}.get(algorithm)
    rule = "dpmpp_2m_sde_heun" if solver == "heun" and rule else rule
    if rule is None:
        raise ConfigError(f"DPMSolverMultistepScheduler: algorithm_type={algorithm!r} is not mapped")
    if raw.get("use_flow_sigmas"):
        if raw.get("prediction_type") != "flow_prediction":
            raise ConfigError("DPMSolverMultistepScheduler: use_flow_sigmas maps with flow_prediction only")
        return kdiffusion_sampler(rule, "flow", "flow", base_config=raw, timestep="floor", grid="solver", **options)
    schedule = _sigma_schedule(raw)
    if schedule:
        rounded = schedule == "karras" and raw.get("beta_schedule") != "squaredcos_cap_v2"
        t = "round" if rounded else "floor"  # diffusers casts the timesteps to int64
        made = kdiffusion_sampler(rule, schedule, base_config=raw, timestep=t, **options)
        return dataclasses.replace(made, form="vp")  # diffusers' DPM-Solver holds the VP sample
    raise ConfigError(
        "DPMSolverMultistepScheduler on its integer timestep grid has no sigma-schedule form here; use "
        "use_karras_sigmas/use_exponential_sigmas/use_beta_sigmas or a k-diffusion schedule"
    )
