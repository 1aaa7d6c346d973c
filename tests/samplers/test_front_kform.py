"""The diffusers-config front (`samplers.get_sampler`, a `scheduler_config.json`, A1111 names) hands out the
k-diffusion form wherever it expresses the config exactly, and that form steps like diffusers' own scheduler (PyTorch,
diffusers 0.42.1): the same timesteps, the same initial noise scale, the same sample after every model call.

The expectation is diffusers itself, run step by step on the same toy model, initial noise and per-step noise
(`loops.prescribed_noise`), not the diffusers-parity classes the front used to return. Configs the form cannot express
keep their diffusers-parity class (listed in `sdjax.samplers`' docstring).
"""

from __future__ import annotations

import diffusers
import jax
import loops
import numpy as np
import pytest

from sdjax import samplers
from sdjax.samplers import KDiffusionSampler, a1111

SD15 = loops.SD15
SDXL = {
    "_class_name": "EulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "timestep_spacing": "leading",
    "steps_offset": 1,
    "interpolation_type": "linear",
}
SD3 = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
FLUX_DEV = {
    **SD3,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
SHAPE = loops.SHAPE  # (2, 4, 8, 8): 16 image tokens, mu from the Flux pipelines' rule
V = {"prediction_type": "v_prediction"}

# (registry or diffusers class name, base config, overrides, steps)
CASES = [
    ("euler", SD15, {}, 10),
    ("euler", SDXL, {}, 10),  # leading spacing: init sqrt(sigma^2 + 1)
    ("euler", SD15, {"timestep_spacing": "trailing", **V}, 9),
    ("euler_karras", SDXL, {}, 10),  # Karras between the ends of the leading grid
    ("euler", SD15, {"use_exponential_sigmas": True, "timestep_spacing": "linspace"}, 8),
    ("euler", SD15, {"use_beta_sigmas": True, "timestep_spacing": "linspace"}, 8),
    ("euler_a", SD15, {"timestep_spacing": "linspace"}, 10),
    ("euler_a", SD15, {"timestep_spacing": "trailing", **V}, 7),
    ("heun", SD15, {"timestep_spacing": "linspace"}, 6),
    ("heun_karras", SDXL, V, 6),
    ("dpmpp_2m_karras", SD15, {}, 10),
    ("dpmpp_2m_karras", SD15, {"beta_schedule": "squaredcos_cap_v2", **V}, 10),
    ("dpmpp_2m", SD15, {"use_exponential_sigmas": True}, 10),
    ("dpmpp_2m_sde_karras", SD15, {}, 10),
    ("dpmpp_2m_sde", SD15, {"use_beta_sigmas": True}, 10),
    ("dpmpp_2m_sde_heun_karras", SD15, {}, 10),  # A1111's "DPM++ 2M SDE Heun Karras"
    ("dpmpp_2m_sde_heun", SD15, {"use_exponential_sigmas": True, **V}, 10),
    ("FlowMatchEulerDiscreteScheduler", SD3, {}, 8),
    ("FlowMatchEulerDiscreteScheduler", FLUX_DEV, {}, 8),
    ("FlowMatchHeunDiscreteScheduler", SD3, {}, 5),
    ("flow_dpmpp_2m", SD3, {}, 8),
    ("flow_dpmpp_2m", FLUX_DEV, {}, 8),
]


def _mu(raw: dict) -> float:
    """The Flux pipelines' mu for SHAPE (calculate_shift of the packed token count)."""
    seq = (SHAPE[2] // 2) * (SHAPE[3] // 2)
    m = (raw["max_shift"] - raw["base_shift"]) / (raw["max_image_seq_len"] - raw["base_image_seq_len"])
    return seq * m + raw["base_shift"] - m * raw["base_image_seq_len"]


def diffusers_run(sampler, raw: dict, n: int, x0: np.ndarray, noises: np.ndarray):
    """diffusers' scheduler of the sampler's config, its own loop: (timesteps, init_noise_sigma, trajectory)."""
    config = dict(sampler.config)
    ref = getattr(diffusers, config.pop("_class_name")).from_config(config)
    kwargs = {"mu": _mu(raw)} if raw.get("use_dynamic_shifting") else {}
    timesteps, init, traj = loops.run_torch(ref, n, x0, noises, timestep_kwargs=kwargs)
    return timesteps.astype(np.float32), init, traj


@pytest.mark.parametrize("name, base, extra, n", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_front_gives_the_k_form_and_it_steps_like_diffusers(name, base, extra, n):
    sampler = samplers.get_sampler(name, base, **extra)
    assert isinstance(sampler, KDiffusionSampler) and sampler.origin is not None, name
    x0, noises = loops.inputs(sampler.num_model_calls(n))
    t_ours, sigma_ours, traj = jax.device_get(loops.run_jax(sampler, n, x0, noises))
    raw = dict(base, **extra)
    t_ref, sigma_ref, traj_ref = diffusers_run(sampler, raw, n, x0, noises)
    np.testing.assert_allclose(t_ours, t_ref, rtol=1e-6, atol=0)
    np.testing.assert_allclose(sigma_ours, sigma_ref, rtol=1e-6)
    assert traj.shape == traj_ref.shape and np.isfinite(traj).all()
    # Every step: within float32 rounding of diffusers relative to the step's largest value (measured: <= 1.0e-6 for
    # DPM-Solver++ 2M / 2M SDE, whose update the form computes on the VE sample; <= 2.2e-7 for the others).
    scale = np.maximum(1.0, np.abs(traj_ref).reshape(len(traj_ref), -1).max(axis=1))
    err = (np.abs(traj - traj_ref).reshape(len(traj), -1).max(axis=1) / scale).max()
    assert err <= 4e-6, f"{name} {extra}: max step error {err:.2e} relative to the step's largest value"


def test_names_configs_and_cache_keys_are_the_fronts():
    """What users see stays: the registry / A1111 name, the diffusers config (swaps carry it), one hash per config."""
    base = samplers.get_sampler(SD15)
    for a1111_name, registry in [("Euler a", "euler_a"), ("DPM++ 2M", "dpmpp_2m_karras"), ("Heun", "heun")]:
        sampler = samplers.from_a1111(a1111_name, "Automatic", base)
        assert isinstance(sampler, KDiffusionSampler)
        assert samplers.name_of(sampler) == registry
        assert samplers.get_sampler(samplers.name_of(sampler), base, **_schedule(a1111_name)) == sampler
        assert hash(samplers.from_a1111(a1111_name, "Automatic", base)) == hash(sampler)
    sdxl = samplers.get_sampler(SDXL)
    assert isinstance(sdxl, KDiffusionSampler) and sdxl.config["_class_name"] == "EulerDiscreteScheduler"
    assert samplers.get_sampler(sdxl.config) == sdxl
    assert samplers.name_of(samplers.get_sampler("EulerDiscreteScheduler", SD15, use_karras_sigmas=True)) == (
        "euler_karras"
    )
    assert sdxl.timestep_spacing == "leading" and sdxl.prediction_type == "epsilon"  # config keys as attributes
    flux = samplers.get_sampler(FLUX_DEV)
    assert samplers.name_of(flux) == "flow_euler" and flux.shift == 3.0 and flux.use_dynamic_shifting
    assert samplers.get_sampler(sdxl, use_karras_sigmas=True).schedule.name == "karras"  # rebuilt from its config


def _schedule(a1111_name: str) -> dict:
    _, keys = a1111.config_keys(a1111_name, "Automatic")
    return keys


@pytest.mark.parametrize(
    "name, base, extra, cls",
    [
        ("euler", SD15, {"interpolation_type": "log_linear"}, "Euler"),
        ("euler", SD15, {"final_sigmas_type": "sigma_min"}, "Euler"),
        ("euler", SD15, {"rescale_betas_zero_snr": True}, "Euler"),
        ("euler", SD15, {"timestep_type": "continuous", **V}, "Euler"),
        ("euler_karras", SD15, {"sigma_min": 0.1}, "Euler"),
        ("euler_a", SD15, {"rescale_betas_zero_snr": True}, "EulerAncestral"),
        ("heun", SD15, {"clip_sample": True}, "Heun"),
        ("dpmpp_2m", SD15, {}, "DPMSolverMultistep"),  # its integer timestep grid
        ("dpmpp_2m_karras", SD15, {"final_sigmas_type": "sigma_min"}, "DPMSolverMultistep"),
        ("dpmpp_2m_karras", SD15, {"solver_type": "heun"}, "DPMSolverMultistep"),  # no k-diffusion ODE heun form
        ("dpmpp_3m_sde_karras", SD15, {}, "DPMSolverMultistep"),
        ("FlowMatchEulerDiscreteScheduler", SD3, {"stochastic_sampling": True}, "FlowMatchEuler"),
        ("FlowMatchEulerDiscreteScheduler", SD3, {"use_karras_sigmas": True}, "FlowMatchEuler"),
    ],
)
def test_configs_the_form_cannot_express_keep_their_class(name, base, extra, cls):
    sampler = samplers.get_sampler(name, base, **extra)
    assert type(sampler).__name__ == cls, (name, extra)
