"""AUTOMATIC1111 semantics: every (sampler, schedule) row of `sdjax.samplers.a1111` against diffusers, the
schedule formulas against A1111's own, the API response shapes, name parsing and bad input.

Each supported row is built on SD 1.5's released scheduler config (loaded as `from_pretrained` does, then swapped)
and compared with diffusers' scheduler swapped in the same way with the same keys: config key by key, timesteps and
sigmas for several step counts, and for the "Automatic" row of every sampler the whole sampling loop. Rows refused
are refused because diffusers' class has no key for the schedule (checked against its constructor). Independently,
the schedules are checked against A1111's definitions: Uniform is k-diffusion's t = linspace(T - 1, 0, n), Karras
spans the model's full sigma range, the DDIM schedule is 1, 1 + T/n, ...
"""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path

import jax
import loops
import numpy as np
import pytest
from test_samplers import assert_trajectory_close, diffusers_nan_last

from sdjax import samplers
from sdjax.config import ConfigError
from sdjax.samplers import a1111, schedules

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*expects a model distilled for it:UserWarning"),
]
diffusers = pytest.importorskip("diffusers")

CONFIGS = Path(__file__).resolve().parents[2] / "src" / "sdjax" / "assets" / "configs"
SD15 = json.loads((CONFIGS / "sd15" / "scheduler" / "scheduler_config.json").read_text())
SUPPORTED = [s.name for s in a1111.A1111_SAMPLERS if s.registry is not None]
SCHEDULES = [s.label for s in schedules.SCHEDULES]


def _diffusers_swap(registry: str, keys: dict):
    cls, fixed = samplers.SAMPLERS[registry]
    loaded = getattr(diffusers, SD15["_class_name"]).from_config(SD15)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(diffusers, cls.diffusers_class).from_config(loaded.config, **{**fixed, **keys})


def _norm(v):
    return tuple(v) if isinstance(v, list) else v


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("sampler_name", SUPPORTED)
def test_every_row_builds_and_matches_diffusers(sampler_name, schedule):
    found = schedules.find_schedule(schedule)
    base = samplers.get_sampler(SD15)
    if found.keys is None:
        with pytest.raises(schedules.UnsupportedScheduleError, match="no diffusers equivalent"):
            samplers.from_a1111(sampler_name, schedule, base)
        return
    registry = a1111.find_sampler(sampler_name).registry
    cls = samplers.SAMPLERS[registry][0]
    try:
        ours = samplers.from_a1111(sampler_name, schedule, base)
    except schedules.UnsupportedScheduleError as e:
        # Refused only where diffusers' class cannot express it: a missing key, or a grid it does not space.
        init_keys = set(inspect.signature(getattr(diffusers, cls.diffusers_class).__init__).parameters)
        missing = [k for k in found.keys if k not in init_keys]
        assert missing or cls.ignores_spacing or cls.fixed_spacing, (sampler_name, schedule, str(e))
        assert sampler_name in str(e) and found.label in str(e)
        return
    _, keys = a1111.config_keys(sampler_name, schedule)
    ref = _diffusers_swap(registry, keys)
    for key in loops.front(ours).config_keys():
        if key in ref.config:
            assert _norm(getattr(ours, key)) == _norm(ref.config[key]), key
    for n in (4, 10, 25):
        ref.set_timesteps(n)
        tables = loops.tables(ours, n)
        atol = 2e-2 if registry.startswith("dpm2_a") else 1e-4  # see test_samplers: DPM2 midpoints
        np.testing.assert_allclose(tables["timesteps"], ref.timesteps.numpy().astype(np.float32), rtol=1e-6, atol=atol)
        if hasattr(ref, "sigmas"):
            np.testing.assert_allclose(tables["sigmas"], ref.sigmas.numpy(), rtol=1e-6, err_msg=str(n))


@pytest.mark.parametrize("sampler_name", SUPPORTED)
def test_automatic_rows_sample_like_diffusers(sampler_name):
    """The whole loop for each sampler with A1111's "Automatic" schedule on SD 1.5's config."""
    ours = samplers.from_a1111(sampler_name, "Automatic", samplers.get_sampler(SD15))
    registry, keys = a1111.config_keys(sampler_name, "Automatic")
    ref = _diffusers_swap(registry, keys)
    n = 4 if registry in ("lcm", "tcd") else 8
    x0, noises = loops.inputs(ours.num_model_calls(n))
    _, sigma, traj = jax.device_get(loops.run_jax(ours, n, x0, noises))
    options = {"eta": ours.eta} if "eta" in getattr(ours, "options", ()) else {}
    _, _, traj_ref = loops.run_torch(ref, n, x0, noises, float(sigma), **options)
    assert_trajectory_close(traj, traj_ref, x0 * sigma, sampler_name, nan_last=diffusers_nan_last(ours))


# ------------------------------------------------------------------------------------- A1111's semantics
def test_automatic_is_the_samplers_own_schedule():
    base = samplers.get_sampler(SD15)
    expect = {
        "DPM++ 2M": {"use_karras_sigmas": True},
        "DPM++ SDE": {"use_karras_sigmas": True},
        "DPM++ 2M SDE": {"use_exponential_sigmas": True, "solver_type": "midpoint"},
        "DPM++ 2M SDE Heun": {"use_exponential_sigmas": True, "solver_type": "heun"},
        "DPM++ 3M SDE": {"use_exponential_sigmas": True, "solver_order": 3},
        "DPM2": {"use_karras_sigmas": True},
        "DPM2 a": {"use_karras_sigmas": True},
        "DPM++ 2S a": {"use_karras_sigmas": True, "algorithm_type": "sde-dpmsolver++"},
        "Euler": {"use_karras_sigmas": False, "timestep_spacing": "linspace"},
        "Heun": {"use_karras_sigmas": False, "timestep_spacing": "linspace"},
        "Euler a": {"timestep_spacing": "linspace"},
        "UniPC": {"solver_type": "bh1", "solver_order": 3, "timestep_spacing": "linspace"},
        # Timestep samplers keep the model's grid (SD 1.5: leading, steps_offset 1).
        "DDIM": {"timestep_spacing": "leading", "steps_offset": 1, "clip_sample": False},
        "PLMS": {"timestep_spacing": "leading", "steps_offset": 1, "skip_prk_steps": True},
    }
    for name, keys in expect.items():
        sampler = samplers.from_a1111(name, "Automatic", base)
        for key, value in keys.items():
            assert getattr(sampler, key) == value, (name, key)
        assert samplers.from_a1111(name, None, base) == sampler  # no scheduler given = Automatic


def test_schedules_follow_a1111s_formulas():
    base = samplers.get_sampler(SD15)
    n = 20
    # Uniform / Normal: k-diffusion's get_sigmas, t = linspace(T - 1, 0, n).
    for label in ("Uniform", "Normal"):
        t = samplers.from_a1111("Euler", label, base).timesteps_for(n)
        np.testing.assert_allclose(t, np.linspace(999, 0, n), rtol=1e-6)
    # Karras: get_sigmas_karras(n, sigma_min = the model's sigma at t = 0, sigma_max = at t = T - 1), rho 7.
    euler = samplers.from_a1111("Euler", "Karras", base)
    train = np.sqrt((1 - euler.alphas_cumprod.astype(np.float64)) / euler.alphas_cumprod)
    ramp = np.linspace(0, 1, n)
    karras = (train[-1] ** (1 / 7) + ramp * (train[0] ** (1 / 7) - train[-1] ** (1 / 7))) ** 7
    np.testing.assert_allclose(loops.tables(euler, n)["sigmas"][:-1], karras, rtol=1e-5)
    # Exponential: log-uniform over the same range.
    expo = loops.tables(samplers.from_a1111("Euler", "Exponential", base), n)["sigmas"][:-1]
    np.testing.assert_allclose(expo, np.exp(np.linspace(np.log(train[-1]), np.log(train[0]), n)), rtol=1e-5)
    # DDIM schedule: A1111's sigmas at t = 1, 1 + T // n, ... (diffusers' leading spacing with steps_offset 1).
    t = samplers.from_a1111("Euler", "DDIM", base).timesteps_for(n)
    np.testing.assert_array_equal(t, (np.arange(n) * (1000 // n) + 1)[::-1])
    # SGM Uniform / Simple: trailing, the top timestep T - 1 and uniform steps of T / n.
    t = samplers.from_a1111("Euler", "SGM Uniform", base).timesteps_for(n)
    np.testing.assert_array_equal(t, np.arange(1000, 0, -1000 / n).round() - 1)
    # Beta (alpha = beta = 0.6): dense at both ends of the sigma range.
    beta = loops.tables(samplers.from_a1111("Euler", "Beta", base), n)["sigmas"][:-1].astype(np.float64)
    steps = -np.diff(beta)
    assert beta[0] == pytest.approx(train[-1], rel=1e-5) and beta[-1] == pytest.approx(train[0], rel=1e-5)
    assert steps[0] < steps[n // 2] and steps[-1] < steps[n // 2]
    # A spacing schedule switches off a sigma schedule of the base config.
    karras_base = samplers.get_sampler("euler_karras", base)
    assert not samplers.from_a1111("Euler", "Uniform", karras_base).use_karras_sigmas


def test_legacy_names_aliases_and_case():
    base = samplers.get_sampler(SD15)
    same = [
        (("DPM++ 2M Karras", None), ("DPM++ 2M", "Karras")),
        (("DPM++ 2M SDE Karras", "Uniform"), ("DPM++ 2M SDE", "Karras")),  # the suffix wins, as in A1111
        (("DPM++ 2M SDE Heun Exponential", None), ("DPM++ 2M SDE Heun", "Exponential")),
        (("LMS Karras", None), ("LMS", "Karras")),
        (("k_dpmpp_2m", "karras"), ("DPM++ 2M", "Karras")),
        (("dpm++ 2m", "sgm_uniform"), ("DPM++ 2M", "SGM Uniform")),
        (("Euler", "SGMUniform"), ("Euler", "SGM Uniform")),
        (("k_euler_ancestral", None), ("Euler a", "Automatic")),
    ]
    for given, canonical in same:
        assert samplers.from_a1111(*given, base) == samplers.from_a1111(*canonical, base), given
    assert a1111.split_name("DPM++ 2M Karras") == (a1111.find_sampler("DPM++ 2M"), "Karras")


def test_get_sampler_schedule_matches_from_a1111():
    base = samplers.get_sampler(SD15)
    assert samplers.get_sampler("dpmpp_2m", base, schedule="Automatic") == samplers.from_a1111("DPM++ 2M", None, base)
    assert samplers.get_sampler("dpmpp_2m_karras", base, schedule="automatic").use_karras_sigmas
    assert samplers.get_sampler("ddim", base, schedule="Automatic") == samplers.get_sampler("ddim", base)
    assert samplers.get_sampler("euler", base, schedule="Beta").use_beta_sigmas
    expo = samplers.get_sampler(samplers.get_sampler("euler", base), schedule="Exponential")
    assert expo.use_exponential_sigmas and expo.timestep_spacing == "linspace"


def test_api_shapes():
    listed = samplers.a1111_samplers()
    assert [s["name"] for s in listed] == SUPPORTED
    for entry in listed:
        assert set(entry) == {"name", "aliases", "options"} and isinstance(entry["aliases"], list)
        samplers.from_a1111(entry["name"], None, samplers.get_sampler(SD15))  # every listed sampler builds
    assert listed[0] == {"name": "DPM++ 2M", "aliases": ["k_dpmpp_2m"], "options": {"scheduler": "karras"}}
    assert not {"DPM fast", "DPM adaptive", "Restart", "DDIM CFG++"} & {s["name"] for s in listed}
    scheds = samplers.a1111_schedulers()
    assert [s["label"] for s in scheds] == [
        "Automatic",
        "Uniform",
        "Karras",
        "Exponential",
        "SGM Uniform",
        "Simple",
        "Normal",
        "DDIM",
        "Beta",
    ]
    for entry in scheds:
        assert set(entry) == {"name", "label", "aliases", "default_rho", "need_inner_model"}
    assert scheds[2] == {
        "name": "karras",
        "label": "Karras",
        "aliases": None,
        "default_rho": 7.0,
        "need_inner_model": False,
    }
    json.dumps([listed, scheds])  # plain JSON


# --------------------------------------------------------------------------------------------- bad input
def test_unknown_and_unsupported_names_list_the_valid_ones():
    with pytest.raises(a1111.UnsupportedSamplerError, match="DPM\\+\\+ 2M") as info:
        samplers.from_a1111("Euler b")
    assert isinstance(info.value, ConfigError) and "Euler b" in str(info.value)
    for name in ("DPM fast", "DPM adaptive", "Restart", "DDIM CFG++"):
        with pytest.raises(a1111.UnsupportedSamplerError, match="no diffusers equivalent"):
            samplers.from_a1111(name)
    with pytest.raises(schedules.UnknownScheduleError, match="SGM Uniform") as info:
        samplers.from_a1111("Euler", "Karas")
    assert isinstance(info.value, ConfigError)
    for name in ("Polyexponential", "KL Optimal", "Align Your Steps"):
        with pytest.raises(schedules.UnsupportedScheduleError, match="no diffusers equivalent"):
            samplers.from_a1111("Euler", name)
    with pytest.raises(schedules.UnsupportedScheduleError, match="use_karras_sigmas.*Euler a"):
        samplers.from_a1111("Euler a", "Karras")
    with pytest.raises(schedules.UnsupportedScheduleError, match="own timestep grid"):
        samplers.from_a1111("LCM", "SGM Uniform")
    with pytest.raises(schedules.UnsupportedScheduleError, match="own timestep grid"):
        samplers.from_a1111("DPM++ 2S a", "Simple")
    with pytest.raises(schedules.UnknownScheduleError):
        samplers.get_sampler("euler", SD15, schedule="karas")
    with pytest.raises(a1111.UnsupportedSamplerError, match="non-empty"):
        samplers.from_a1111("  ")


def test_lcm_and_tcd_warn_on_models_not_distilled_for_them():
    lcm_config = {**SD15, "_class_name": "LCMScheduler", "timestep_spacing": "leading"}
    for name in ("lcm", "tcd"):
        with pytest.warns(UserWarning, match="distilled"):
            samplers.get_sampler(name, SD15)
    with pytest.warns(UserWarning, match="distilled"):
        samplers.from_a1111("LCM", None, samplers.get_sampler(SD15))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        samplers.get_sampler("lcm", lcm_config)  # an LCM model: no warning
        samplers.get_sampler("tcd", samplers.get_sampler(lcm_config))
        samplers.get_sampler("lcm")  # no model: diffusers' defaults, nothing to warn about


def test_steps_outside_a_samplers_range_raise():
    with pytest.raises(ValueError, match="num_inference_steps >= 4"):
        samplers.get_sampler("pndm_prk", SD15).num_model_calls(3)
    lcm = samplers.get_sampler("lcm", {**SD15, "_class_name": "LCMScheduler"})
    with pytest.raises(ValueError, match="original_inference_steps=50"):
        lcm.num_model_calls(51)
    assert lcm.num_model_calls(50) == 50
    with pytest.raises(ValueError, match="positive int"):
        samplers.get_sampler("heun", SD15).num_model_calls(0)


def test_prediction_types_a_sampler_lacks_are_refused():
    v_config = {**SD15, "prediction_type": "sample"}
    for name in ("dpm2", "dpm2_a", "dpmpp_sde", "euler_a"):
        with pytest.raises(ConfigError, match="prediction_type='sample'"):
            samplers.get_sampler(name, v_config)
    for name in ("heun", "dpmpp_2s", "unipc", "deis", "lcm", "tcd"):  # these do support x0 prediction
        assert samplers.get_sampler(name, v_config).prediction_type == "sample"
    with pytest.raises(ConfigError, match="flow_prediction"):
        samplers.get_sampler("unipc", {**SD15, "prediction_type": "flow_prediction"})
