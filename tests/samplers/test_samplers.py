"""Samplers against the diffusers schedulers of the same name and config (PyTorch, float32).

Full sampling loops run in diffusers (Python loop) and in sdjax (one jitted `lax.fori_loop`, traced step index)
with the same stand-in model, initial latents and, for stochastic samplers, the same noise (see `loops.py`).
Every intermediate sample is compared.

Tolerance (float32), every element of every step: |sdjax - diffusers| <= 1e-5 |diffusers| + 1e-5 * scale +
1e-7 * (largest scale so far), where scale = max(1, largest |value| going into or out of that step). Measured:
at most 9e-7 of the scale, except 1.1e-5 for zero-SNR Euler (rounding noise of the first step at 4096 x latents).
The stand-in model does not denoise, so trajectories grow to |x| ~ 100 with epsilon prediction, and zero-SNR
sigma-space samplers start from sigma_max = 4096; float32 rounding scales with the values a step subtracts, hence
the per-step scale. Schedules are built in numpy to match diffusers' float32 torch arithmetic (betas and
alphas_cumprod bit for bit; sigmas within one ulp, as torch's CPU float32 sqrt is not correctly rounded).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import loops
import numpy as np
import pytest

from sdjax import samplers
from sdjax.config import ConfigError

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # numpy 2 `__array__` notes from diffusers
    pytest.mark.filterwarnings("ignore:.*expects a model distilled for it:UserWarning"),  # LCM/TCD on SD configs
]

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

# Stable Diffusion 1.x's scheduler_config.json (PNDM, scaled_linear, epsilon, leading spacing, steps_offset 1).
SD1 = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.6.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
    "clip_sample": False,
}
# Stable Diffusion 2.x (768, v-prediction): a DDIM config.
SD2 = {
    "_class_name": "DDIMScheduler",
    "_diffusers_version": "0.8.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
# Stable Diffusion XL: EulerDiscrete, with leftovers of other schedulers' keys.
SDXL = {
    "_class_name": "EulerDiscreteScheduler",
    "_diffusers_version": "0.19.0.dev0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}
V = {"prediction_type": "v_prediction"}
ZERO_SNR = {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing", "prediction_type": "v_prediction"}


def case(name, base, n=10, **extra):
    options = {k: extra.pop(k) for k in list(extra) if k in ("eta", "s_noise")}
    label = "-".join([name, base["_class_name"][:4], str(n)] + [f"{k}={v}" for k, v in {**extra, **options}.items()])
    return pytest.param(name, base, n, extra, options, id=label)


PARITY = [
    # PNDM / PLMS (SD1 default) and with Runge-Kutta warm-up.
    case("pndm", SD1),
    case("pndm", SD1, 25),
    case("pndm", SD2),
    case("pndm", SD1, timestep_spacing="linspace"),
    case("pndm", SD1, timestep_spacing="trailing"),
    case("pndm_prk", SD1),
    case("pndm_prk", SD2, 25),
    # DDIM
    case("ddim", SD1),
    case("ddim", SD2),
    case("ddim", SD1, 25, timestep_spacing="linspace"),
    case("ddim", SD1, **ZERO_SNR),
    case("ddim", SD1, eta=0.7, clip_sample=True, set_alpha_to_one=True),
    case("ddim", SD1, beta_schedule="squaredcos_cap_v2", prediction_type="sample"),
    # DDPM
    case("ddpm", SD1),
    case("ddpm", SD2, timestep_spacing="trailing"),
    case("ddpm", SD1, variance_type="fixed_small_log", clip_sample=True),
    case("ddpm", SD1, variance_type="fixed_large", beta_schedule="linear", beta_start=0.0001, beta_end=0.02),
    # Euler (SDXL default)
    case("euler", SDXL),
    case("euler", SDXL, 25),
    case("euler", SD2),
    case("euler", SDXL, **ZERO_SNR),
    case("euler_karras", SDXL),
    case("euler", SDXL, timestep_spacing="linspace", final_sigmas_type="sigma_min"),
    case("euler", SDXL, interpolation_type="log_linear", timestep_type="continuous", prediction_type="v_prediction"),
    case("euler", SDXL, use_exponential_sigmas=True, sigma_min=0.1, sigma_max=10.0),
    # Euler ancestral
    case("euler_a", SD1),
    case("euler_a", SD2, timestep_spacing="trailing"),
    case("euler_a", SD1, 25, **ZERO_SNR),
    # LMS
    case("lms", SD1),
    case("lms", SD1, 25, timestep_spacing="linspace"),
    case("lms_karras", SD2),
    case("lms", SD1, use_exponential_sigmas=True),
    # DPM-Solver++
    case("dpmpp_2m", SD1),
    case("dpmpp_2m", SD1, 25),
    case("dpmpp_2m", SD2, timestep_spacing="trailing"),
    case("dpmpp_2m_karras", SD1),
    case("dpmpp_2m_karras", SD1, beta_schedule="squaredcos_cap_v2"),
    case("dpmpp_2m", SD1, 16, solver_type="heun", final_sigmas_type="sigma_min", lower_order_final=False),
    case("dpmpp_2m", SD1, solver_order=3, euler_at_final=True, timestep_spacing="leading"),
    case("dpmpp_2m", SD1, **ZERO_SNR, lambda_min_clipped=-5.1),
    case("dpmpp_2m_sde", SD1),
    case("dpmpp_2m_sde_karras", SD2, 25),
    case("dpmpp_2m_sde", SD1, solver_type="heun", solver_order=3, use_exponential_sigmas=True),
    case("dpmpp_2m", SD1, use_beta_sigmas=True),
    case("dpmpp_2m_sde_heun", SD1),
    case("dpmpp_2m_sde_heun_karras", SD2, 15),
    case("dpmpp_3m_sde", SD1),
    case("dpmpp_3m_sde_karras", SD2, 25),
    case("dpmpp_3m_sde", SD1, **ZERO_SNR),
    # Euler / LMS with beta sigmas
    case("euler", SDXL, use_beta_sigmas=True),
    case("lms", SD1, use_beta_sigmas=True),
    # Heun (two model calls per step, interleaved)
    case("heun", SD1),
    case("heun", SD2, timestep_spacing="trailing"),
    case("heun_karras", SDXL),
    case("heun", SD1, use_exponential_sigmas=True),
    case("heun", SD1, use_beta_sigmas=True),
    case("heun", SD1, prediction_type="sample", clip_sample=True),
    # DPM2 and DPM2 a
    case("dpm2", SD1),
    case("dpm2_karras", SD2),
    case("dpm2", SDXL, use_beta_sigmas=True),
    case("dpm2_a", SD1),
    case("dpm2_a_karras", SD2, 15),
    case("dpm2_a", SD1, timestep_spacing="trailing", use_exponential_sigmas=True),
    # DPM++ SDE (injected noise: the Brownian tree is tested in test_dpm_sde.py)
    case("dpmpp_sde", SD1),
    case("dpmpp_sde_karras", SD2),
    case("dpmpp_sde", SDXL, 15),
    case("dpmpp_sde", SD1, use_beta_sigmas=True, s_noise=0.5),
    # DPM-Solver++ singlestep ("DPM++ 2S a" is its SDE form)
    case("dpmpp_2s_a", SD1),
    case("dpmpp_2s_a_karras", SD2),
    case("dpmpp_2s", SD1, 12, solver_order=3),
    case("dpmpp_2s", SD1, 12, solver_order=3, solver_type="heun", final_sigmas_type="sigma_min"),
    case("dpmpp_2s_a", SD1, 8, solver_type="heun", lower_order_final=False, final_sigmas_type="sigma_min"),
    case("dpmpp_2s", SD1, beta_schedule="squaredcos_cap_v2", lambda_min_clipped=-5.1, use_exponential_sigmas=True),
    # UniPC
    case("unipc", SD1),
    case("unipc", SD2, 25),
    case("unipc", SD1, solver_order=3),
    case("unipc_bh1", SD1, solver_order=3, final_sigmas_type="sigma_min"),
    case("unipc", SD1, **ZERO_SNR),
    case("unipc", SD1, use_karras_sigmas=True, final_sigmas_type="sigma_min"),
    case("unipc", SD1, use_beta_sigmas=True),
    case("unipc", SD1, predict_x0=False, solver_order=3, final_sigmas_type="sigma_min"),
    case("unipc", SD1, disable_corrector=[0, 3], timestep_spacing="leading"),
    case("unipc", SD1, 7, lower_order_final=False, solver_order=3, final_sigmas_type="sigma_min"),
    case("unipc_bh1", SD1, solver_order=3),  # diffusers: NaN on the last step (compared before it)
    case("unipc", SD2, predict_x0=False),  # likewise
    # DEIS
    case("deis", SD1),
    case("deis", SD2, 20),
    case("deis", SD1, solver_order=3),
    case("deis", SD1, use_karras_sigmas=True),
    case("deis", SD1, 16, solver_order=3, timestep_spacing="trailing"),
    # LCM and TCD (few steps)
    case("lcm", SD1, 4),
    case("lcm", SD2, 8),
    case("lcm", SD1, 4, clip_sample=True, original_inference_steps=25),
    case("lcm", SD1, 6, **ZERO_SNR),
    case("tcd", SD1, 4),
    case("tcd", SD2, 8, eta=0.0),
    case("tcd", SD1, 4, eta=1.0, set_alpha_to_one=False),
]


def torch_scheduler(sampler):
    """The diffusers scheduler with the sampler's config (what `name` resolved to)."""
    return getattr(diffusers, sampler.diffusers_class).from_config(sampler.config)


def step_scales(ref, initial):
    """Per step: max(1, largest |value| going into or out of the step), shape (calls, 1, 1, 1, 1)."""
    inputs = np.concatenate([initial[None], ref[:-1]])
    axes = tuple(range(1, ref.ndim))
    scale = np.maximum(np.abs(inputs).max(axis=axes), np.abs(ref).max(axis=axes))
    return np.maximum(1.0, scale).reshape((-1,) + (1,) * (ref.ndim - 1))


def diffusers_nan_last(sampler) -> bool:
    """Whether diffusers' last step is NaN for this config (UniPC bh1 or noise prediction down to sigma 0: an
    infinite factor times zero), where sdjax returns the finite limit (see `sdjax.samplers.unipc`)."""
    return (
        sampler.diffusers_class == "UniPCMultistepScheduler"
        and (sampler.solver_type == "bh1" or not sampler.predict_x0)
        and sampler.final_sigmas_type == "zero"
    )


def assert_trajectory_close(ours, ref, initial, what="", *, nan_last=False):
    """|ours - ref| <= 1e-5 * |ref| + 1e-5 * (the step's scale) + 1e-7 * (largest scale so far), elementwise,
    every step. The last term is about one float32 ulp of the largest value the loop has handled: rounding
    noise made there persists (zero-SNR sigma-space samplers start at 4096 * latents). With `nan_last` (see
    `diffusers_nan_last`) diffusers' last step must be NaN and ours finite; the steps before are compared."""
    if nan_last:
        assert np.isnan(ref[-1]).any() and np.isfinite(ours).all(), what
        ours, ref = ours[:-1], ref[:-1]
    scales = step_scales(ref, initial)
    seen = np.maximum.accumulate(scales, axis=0)
    err = np.abs(ours - ref) - 1e-5 * np.abs(ref) - 1e-5 * scales - 1e-7 * seen
    where = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= 0, f"{what}: exceeds tolerance by {err.max():.3g} at {where}"


@pytest.mark.parametrize("name, base, n, extra, options", PARITY)
def test_full_loop_matches_diffusers(name, base, n, extra, options):
    sampler = samplers.get_sampler(name, base, **extra, **options)
    x0, noises = loops.inputs(sampler.num_model_calls(n))
    t_ours, sigma_ours, traj_ours = jax.device_get(loops.run_jax(sampler, n, x0, noises))
    # Both loops start from x0 * sdjax's init_noise_sigma (compared to diffusers' below): with zero SNR
    # sigma_max = sqrt(2^24 - 1) = 4095.9998 (torch's CPU sqrt rounds it to 4096), and that ulp on a sample
    # of ~16000 would persist through the loop as an absolute error of ~5e-4.
    t_ref, sigma_ref, traj_ref = loops.run_torch(torch_scheduler(sampler), n, x0, noises, float(sigma_ours), **options)

    assert len(t_ours) == len(t_ref) == sampler.num_model_calls(n)
    # Integer timesteps exactly; fractional ones (Karras/exponential/continuous) to float32 rounding.
    np.testing.assert_allclose(t_ours, t_ref.astype(np.float32), rtol=1e-6, atol=0)
    if t_ref.dtype == np.int64:
        np.testing.assert_array_equal(t_ours, t_ref.astype(np.float32))
    np.testing.assert_allclose(sigma_ours, sigma_ref, rtol=1e-6)
    assert np.isfinite(traj_ours).all()
    assert_trajectory_close(
        traj_ours, traj_ref, x0 * sigma_ours, f"{name} {extra}", nan_last=diffusers_nan_last(sampler)
    )


@pytest.mark.parametrize(
    "name",
    [
        "pndm",
        "pndm_prk",
        "ddim",
        "ddpm",
        "euler",
        "euler_karras",
        "euler_a",
        "lms",
        "lms_karras",
        "dpmpp_2m",
        "dpmpp_2m_karras",
        "dpmpp_2m_sde",
        "heun",
        "heun_karras",
        "dpm2",
        "dpm2_karras",
        "dpm2_a",
        "dpm2_a_karras",
        "dpmpp_sde",
        "dpmpp_sde_karras",
        "dpmpp_2s_a",
        "dpmpp_2s_a_karras",
        "unipc",
        "deis",
        "lcm",
        "tcd",
    ],
)
@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing"])
def test_timesteps_and_sigmas_match_diffusers(name, spacing):
    """Schedules only (numpy, no loop) over many step counts, including ones where trailing spacing yields an
    extra timestep in diffusers; step counts a sampler cannot run raise a ValueError naming the limit."""
    sampler = samplers.get_sampler(name, SD1, timestep_spacing=spacing)
    ref = torch_scheduler(sampler)
    for n in (1, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50, 61, 100):
        if (name == "pndm_prk" and n < 4) or (name in ("lcm", "tcd") and n > 50):
            with pytest.raises(ValueError, match="4|original_inference_steps"):
                sampler.num_model_calls(n)
            continue
        ref.set_timesteps(n)
        tables = loops.tables(sampler, n)
        assert sampler.num_model_calls(n) == len(ref.timesteps), n
        # DPM2 a's midpoint timesteps come through sigma_down = sqrt(sigma_next^2 - sigma_up^2), a float32
        # cancellation where torch's and numpy's last-ulp differences move the fractional timestep by up to 1e-2
        # (near t = 0, where the log-sigma grid is finest); the sigmas themselves agree to 1e-6 below.
        atol = 2e-2 if name.startswith("dpm2_a") else 1e-5
        np.testing.assert_allclose(
            tables["timesteps"], ref.timesteps.numpy().astype(np.float32), rtol=1e-6, atol=atol, err_msg=str(n)
        )
        for key in ("sigmas", "sigmas_interpol", "sigmas_up", "sigmas_down"):
            if key not in tables:
                continue
            expect = getattr(ref, key).numpy()
            if name.startswith("dpm2_a") and key != "sigmas":
                _check_ancestral_split(tables, key, expect, n)
            else:
                np.testing.assert_allclose(tables[key], expect, rtol=1e-6, atol=0, equal_nan=True, err_msg=f"{key} {n}")
        if "orders" in tables:
            assert tables["orders"].tolist() == ref.order_list, n


def _split_bound(tables):
    """|error| bound of sigma_down^2 = sigma_next^2 - sigma_up^2 in float32: 16 ulps of sigma^2 (the
    subtraction cancels: sigma_down ~ sigma_next^2 / sigma)."""
    sig = tables["sigmas"].astype(np.float64)
    nxt = np.append(sig[1:], 0.0)  # per interleaved entry: the sigma after it (its step's target on step starts)
    return 16 * 2.0**-23 * np.maximum(sig, nxt) ** 2


def _check_ancestral_split(tables, key, expect, n):
    """DPM2 a's split against diffusers: sigma_up to 1e-5 (sigma^2 - sigma_next^2 cancels on fine grids),
    sigma_down^2 within the cancellation bound (torch's CPU float32 sqrt is off by an ulp at times, amplified:
    1.7% apart on a 2-step Karras schedule), the midpoint sigma as sqrt(sigma sigma_down) of our own split."""
    ours = tables[key].astype(np.float64)
    if key == "sigmas_up":
        np.testing.assert_allclose(ours, expect, rtol=1e-5, atol=0, equal_nan=True, err_msg=f"{key} {n}")
    elif key == "sigmas_down":
        err = np.abs(ours**2 - expect.astype(np.float64) ** 2)
        assert (err <= _split_bound(tables)).all(), (n, err.max())
    else:  # interpol = exp(lerp(log sigma, log sigma_down)), zero on the last entries
        assert np.isfinite(ours).all() and np.isfinite(expect).all()
        np.testing.assert_allclose(ours[:-4] ** 2, (tables["sigmas"] * tables["sigmas_down"])[:-4], rtol=2e-6)


@pytest.mark.parametrize("base", [SD1, SD2], ids=["eps", "v"])
def test_unipc_bh1_last_step_is_the_x0_limit(base):
    """Where diffusers' UniPC bh1 returns NaN on its last step (B(h) infinite at sigma = 0, times a zero
    residual), sdjax returns the limit of the update: the x0 prediction of the last model call."""
    sampler = samplers.get_sampler("unipc_bh1", base, solver_order=3)
    n = 6
    x0, noises = loops.inputs(sampler.num_model_calls(n))
    timesteps, _, traj = jax.device_get(loops.run_jax(sampler, n, x0, noises))
    x = traj[-2].astype(np.float64)  # the sample the last model call sees (UniPC does not scale its input)
    eps = np.asarray(loops.fake_model_jax(jnp.asarray(traj[-2]), timesteps[-1]), np.float64)
    sigma = float(loops.tables(sampler, n)["sigmas"][-2])
    alpha_t, sigma_t = 1 / np.sqrt(sigma**2 + 1), sigma / np.sqrt(sigma**2 + 1)
    if sampler.prediction_type == "epsilon":
        expect = (x - sigma_t * eps) / alpha_t
    else:
        expect = alpha_t * x - sigma_t * eps
    np.testing.assert_allclose(traj[-1], expect, rtol=1e-5, atol=1e-5 * np.abs(expect).max())


def test_dpm2_ancestral_split_is_exact():
    """sigma_up^2 + sigma_down^2 = sigma_next^2 and sigma_down^2 = sigma_next^4 / sigma^2 (eta = 1), within the
    float32 cancellation bound, on schedules where the float32 formula cancels hard (2-step Karras)."""
    for n, extra in [(2, {"use_karras_sigmas": True}), (5, {}), (30, {"timestep_spacing": "trailing"})]:
        tables = loops.tables(samplers.get_sampler("dpm2_a", SD1, **extra), n)
        sig = tables["sigmas"][1::2].astype(np.float64)  # s_1 .. s_n: the interleaved layout's step starts
        up, down = (tables[k][1::2].astype(np.float64) for k in ("sigmas_up", "sigmas_down"))
        nxt = np.append(sig[1:], 0.0)
        bound = 16 * 2.0**-23 * sig**2
        ok = nxt > 0  # the last step targets sigma 0 (no split)
        np.testing.assert_allclose((up**2 + down**2)[ok], (nxt**2)[ok], rtol=1e-6)
        assert (np.abs(down[ok] ** 2 - nxt[ok] ** 4 / sig[ok] ** 2) <= bound[ok]).all()


def test_num_model_calls():
    assert samplers.get_sampler("pndm", SD1).num_model_calls(50) == 51  # PLMS: one more call than steps
    assert samplers.get_sampler("pndm_prk", SD1).num_model_calls(50) == 59  # 12 RK calls replace 3 steps
    for name in ("ddim", "ddpm", "euler", "euler_a", "lms", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2s_a", "unipc", "deis"):
        assert samplers.get_sampler(name, SD1).num_model_calls(30) == 30
    for name in ("heun", "dpm2", "dpm2_a", "dpmpp_sde"):  # two calls per step, the last step one
        sampler = samplers.get_sampler(name, SD1)
        assert sampler.num_model_calls(30) == 59 and sampler.order == 2
    assert samplers.get_sampler("lcm", SD1).num_model_calls(4) == 4


def test_train_schedule_matches_diffusers():
    for extra in [{}, {"beta_schedule": "linear"}, {"beta_schedule": "squaredcos_cap_v2"}]:
        ours = samplers.get_sampler("ddim", SD1, **extra)
        ref = torch_scheduler(ours)
        np.testing.assert_array_equal(ours._train_schedule[0], ref.betas.numpy())  # bit for bit
        np.testing.assert_array_equal(ours.alphas_cumprod, ref.alphas_cumprod.numpy())
    # Zero-SNR rescaling takes square roots, where torch's CPU float32 sqrt is off by an ulp at times; the
    # rescaled betas amplify that (1 - a ratio close to 1), alphas_cumprod does not.
    ours = samplers.get_sampler("ddim", SD1, rescale_betas_zero_snr=True)
    ref = torch_scheduler(ours).alphas_cumprod.numpy()
    assert ours.alphas_cumprod[-1] == ref[-1] == 0
    np.testing.assert_allclose(ours.alphas_cumprod, ref, rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------------ add_noise
@pytest.mark.parametrize(
    "name, extra",
    [
        ("pndm", {}),
        ("ddim", {}),
        ("ddpm", {}),
        ("euler", {}),
        ("euler_karras", {}),
        ("euler_a", {}),
        ("lms", {}),
        ("dpmpp_2m", {}),
        ("dpmpp_2m_karras", {}),
        ("euler", ZERO_SNR),
        ("heun", {}),
        ("dpm2_karras", {}),
        ("dpm2_a", {}),
        ("dpmpp_sde", {}),
        ("dpmpp_2s_a_karras", {}),
        ("unipc", ZERO_SNR),
        ("deis", {}),
        ("lcm", {}),
        ("tcd", {}),
    ],
)
def test_add_noise_matches_diffusers(name, extra):
    # diffusers' add_noise by timestep value: the diffusers-parity config object's (`add_noise_at` is the loop's)
    sampler = loops.front(samplers.get_sampler(name, SD1, **extra))
    ref = torch_scheduler(sampler)
    ref.set_timesteps(20)
    x0, noises = loops.inputs(1, seed=3)
    noise = noises[0]
    state = sampler.set_timesteps(sampler.create_state(), 20, x0.shape)
    # One timestep per sample, taken from the schedule (img2img start points), including the last one where
    # Karras schedules repeat a rounded timestep.
    for idx in ([3, 7], [0, 19], [19, 18]):
        t = ref.timesteps[idx]
        expect = ref.add_noise(torch.from_numpy(x0), torch.from_numpy(noise), t).numpy()
        ours = sampler.add_noise(state, x0, noise, jnp.asarray(t.numpy().astype(np.float32)))
        # atol relative to the largest term: with zero SNR sigma_max = 4096 and x0 + sigma eps cancels.
        atol = 1e-6 * max(1.0, float(np.abs(noise).max() * ref.sigmas.max()) if hasattr(ref, "sigmas") else 1.0)
        np.testing.assert_allclose(np.asarray(ours), expect, rtol=1e-6, atol=atol, err_msg=str(idx))
        # The sampler's own timesteps (what a pipeline passes) find the same steps.
        ours = sampler.add_noise(state, x0, noise, state.timesteps[jnp.asarray(idx)])
        np.testing.assert_allclose(np.asarray(ours), expect, rtol=1e-6, atol=atol, err_msg=str(idx))


def test_add_noise_sigma_space_is_unscaled_img2img_start():
    """For sigma-space samplers add_noise returns x0 + sigma eps: the loop continues from it without another
    init_noise_sigma factor (the old Flax img2img pipeline multiplied by it again)."""
    sampler = samplers.get_sampler("euler", SDXL)
    state = sampler.set_timesteps(sampler.create_state(), 10, (1, 4, 2, 2))
    x0, eps = jnp.zeros((1, 4, 2, 2)), jnp.ones((1, 4, 2, 2))
    noisy = sampler.add_noise_at(state, x0, eps, 0)
    np.testing.assert_allclose(np.asarray(noisy), np.full((1, 4, 2, 2), float(state.sigmas[0])), rtol=1e-6)


# -------------------------------------------------------------------------------------- state, dtype, jit
def _bf16(tree):
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x).astype(jnp.bfloat16), tree)


@pytest.mark.parametrize("name, base", [("pndm", SD1), ("euler", SDXL), ("dpmpp_2m", SD1)])
def test_bf16_cast_state_is_restored(name, base):
    """A user who casts every param (scheduler state included) to bf16 still samples exactly: set_timesteps
    rebuilds the schedule from the config in float32."""
    sampler = samplers.get_sampler(name, base)  # the float32 run is compiled by the parity test already
    x0, noises = loops.inputs(sampler.num_model_calls(10))
    state_bf16 = _bf16(sampler.create_state())
    assert {x.dtype for x in jax.tree_util.tree_leaves(state_bf16)} == {jnp.dtype(jnp.bfloat16)}
    reference = loops.run_jax(sampler, 10, x0, noises)
    recast = loops.run_jax(sampler, 10, x0, noises, state_bf16)
    for a, b in zip(jax.device_get(reference), jax.device_get(recast), strict=True):
        np.testing.assert_array_equal(a, b)
    # A state cast after set_timesteps is cast back to float32 inside every method.
    state = sampler.set_timesteps(sampler.create_state(), 10, x0.shape)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state))
    out, new_state = sampler.step(_bf16(state), jnp.asarray(x0), 1, jnp.asarray(x0))
    assert out.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(new_state))
    assert sampler.scale_model_input(_bf16(state), jnp.asarray(x0), 0).dtype == jnp.float32


def test_step_with_traced_index_and_sampler_as_static_argument():
    sampler = samplers.get_sampler("dpmpp_2m_karras", SD1)
    assert hash(sampler) == hash(samplers.get_sampler("DPM++ 2M Karras", SD1))
    x = jnp.ones((1, 4, 2, 2))

    @jax.jit
    def one(state, i, x):
        return sampler.step(state, x * 0.1, i, x)

    state = sampler.set_timesteps(sampler.create_state(), 10, x.shape)
    for i in range(3):  # one compilation for every index
        x, state = one(state, jnp.int32(i), x)
    assert one._cache_size() == 1
    assert float(state.memory["count"]) == 3  # the k-diffusion form of DPM++ 2M Karras counts its steps


def test_stochastic_samplers_require_noise():
    x = jnp.ones((1, 4, 2, 2))
    for name, stochastic in [
        ("euler_a", True),
        ("ddpm", True),
        ("dpmpp_2m_sde", True),
        ("euler", False),
        ("dpmpp_2m", False),
        ("ddim", False),
        ("pndm", False),
        ("lms", False),
        ("heun", False),
        ("dpm2", False),
        ("dpm2_a", True),
        ("dpmpp_sde", True),
        ("dpmpp_2s", False),
        ("dpmpp_2s_a", True),
        ("unipc", False),
        ("deis", False),
        ("lcm", True),
        ("tcd", True),
    ]:
        sampler = samplers.get_sampler(name, SD1)
        assert sampler.stochastic is stochastic, name
        state = sampler.set_timesteps(sampler.create_state(), 5, x.shape)
        if stochastic:
            with pytest.raises(ValueError, match="noise"):
                sampler.step(state, x, 0, x)
            with pytest.raises(ValueError, match="shape"):
                sampler.step(state, x, 0, x, noise=jnp.ones((4, 2, 2)))
        else:
            sampler.step(state, x, 0, x)
    assert samplers.get_sampler("ddim", SD1, eta=0.5).stochastic
    assert not samplers.get_sampler("tcd", SD1, eta=0.0).stochastic


def test_step_before_set_timesteps_raises():
    sampler = samplers.get_sampler("pndm", SD1)
    with pytest.raises(ValueError, match="set_timesteps"):
        sampler.step(sampler.create_state(), jnp.ones(3), 0, jnp.ones(3))
    with pytest.raises(TypeError, match="PNDMState"):
        sampler.step(samplers.get_sampler("euler", SD1).create_state(), jnp.ones(3), 0, jnp.ones(3))


# --------------------------------------------------------------------------------------- names and configs
def test_unknown_name_lists_valid_names():
    with pytest.raises(samplers.UnknownSamplerError) as info:
        samplers.get_sampler("euler_b", SD1)
    message = str(info.value)
    for valid in (
        "euler_a",
        "dpmpp_2m_karras",
        "DPM++ 2M Karras",
        "Euler a",
        "Euler",
        "PLMS",
        "EulerDiscreteScheduler",
    ):
        assert valid in message
    assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize(
    "alias, expected",
    [
        ("Euler a", ("euler_a", "EulerAncestralDiscreteScheduler")),
        ("DPM++ 2M Karras", ("dpmpp_2m_karras", None)),
        ("DDIM", ("ddim", None)),
        ("PLMS", ("pndm", None)),
        ("LMS", ("lms", None)),
        ("Euler", ("euler", None)),
        ("DPM++ 2M", ("dpmpp_2m", None)),
        ("DPM++ 2M SDE", ("dpmpp_2m_sde", None)),
        ("dpm++ 2m karras", ("dpmpp_2m_karras", None)),
        ("EulerDiscreteScheduler", ("euler", None)),
        ("DPMSolverMultistepScheduler", ("dpmpp_2m", None)),
    ],
)
def test_names_resolve(alias, expected):
    sampler = samplers.get_sampler(alias, SD1)
    assert samplers.name_of(sampler) == expected[0]
    if expected[1]:
        assert sampler.diffusers_class == expected[1]


def test_registry_round_trip():
    assert samplers.available()[:3] == ["pndm", "pndm_prk", "ddim"]
    for name in samplers.available():
        assert samplers.name_of(samplers.get_sampler(name, SD1)) == name
    assert samplers.name_of(samplers.get_sampler("dpmpp_2m", SD1, solver_order=3)) == "DPMSolverMultistepScheduler"


@pytest.mark.parametrize("base", [SD1, SD2, SDXL], ids=["sd1", "sd2", "sdxl"])
@pytest.mark.parametrize(
    "name",
    ["pndm", "ddim", "ddpm", "euler", "euler_karras", "euler_a", "lms", "dpmpp_2m", "dpmpp_2m_karras", "dpmpp_2m_sde"],
)
def test_swap_config_like_diffusers_from_config(base, name):
    """get_sampler(name, pipe_config) == diffusers' Scheduler.from_config(pipe.scheduler.config, **fixed)."""
    ours = samplers.get_sampler(name, base)
    _, fixed = samplers.SAMPLERS[name]
    ref = getattr(diffusers, ours.diffusers_class).from_config(base, **fixed)
    for key in loops.front(ours).config_keys():
        assert getattr(ours, key) == ref.config[key] or (ours.trained_betas is None and key == "trained_betas"), key


def test_swap_respects_use_default_values():
    """A config loaded by diffusers lists keys it did not contain in `_use_default_values`; they do not carry over
    (PNDM's default leading spacing must not replace Euler's linspace)."""
    base = dict(
        SD1,
        timestep_spacing="leading",
        prediction_type="epsilon",
        _use_default_values=["timestep_spacing", "prediction_type"],
    )
    assert samplers.get_sampler("euler", base).timestep_spacing == "linspace"
    assert samplers.get_sampler("euler", dict(SD1, timestep_spacing="leading")).timestep_spacing == "leading"


def test_get_sampler_from_config_dict_and_sampler():
    euler = samplers.get_sampler(SDXL)
    assert isinstance(euler, samplers.KDiffusionSampler) and isinstance(euler.origin, samplers.Euler)
    assert euler.timestep_spacing == "leading" and euler.steps_offset == 1
    assert samplers.get_sampler(euler) is euler
    assert samplers.get_sampler(euler, use_karras_sigmas=True).use_karras_sigmas
    assert samplers.get_sampler("euler_a", euler).beta_schedule == "scaled_linear"
    assert samplers.get_sampler(samplers.get_sampler("ddim", SD1, eta=0.3), clip_sample=True).eta == 0.3
    with pytest.raises(samplers.UnknownSamplerError, match="CMStochasticIterativeScheduler"):
        samplers.get_sampler(dict(SDXL, _class_name="CMStochasticIterativeScheduler"))
    # a flow-matching class on a variance-preserving model's config would drop its beta schedule: refused
    with pytest.raises(ConfigError, match="variance-preserving"):
        samplers.get_sampler(dict(SDXL, _class_name="FlowMatchEulerDiscreteScheduler"))


def test_unknown_config_key_raises():
    with pytest.raises(ConfigError, match="frobnicate"):
        samplers.Euler.from_config(dict(SDXL, frobnicate=1))
    with pytest.raises(ConfigError, match="frobnicate"):
        samplers.get_sampler(dict(SD1, frobnicate=True))
    with pytest.raises(ConfigError, match="frobnicate"):
        samplers.get_sampler("ddim", dict(SDXL, frobnicate=1))
    with pytest.raises(ConfigError, match="eta"):
        samplers.DDIM.from_config(SD1, etaa=0.1)


@pytest.mark.parametrize(
    "cls, raw, key",
    [
        (samplers.DDIM, {"thresholding": True}, "thresholding"),
        (samplers.Euler, {"use_beta_sigmas": True, "use_karras_sigmas": True}, "use_karras_sigmas"),
        (samplers.KDPM2, {"prediction_type": "sample"}, "prediction_type"),
        (samplers.DPMSolverSDE, {"prediction_type": "sample"}, "prediction_type"),
        (samplers.Heun, {"prediction_type": "flow_prediction"}, "prediction_type"),
        (samplers.Heun, {"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),
        (samplers.UniPC, {"solver_p": "DDIMScheduler"}, "solver_p"),
        (samplers.UniPC, {"thresholding": True}, "thresholding"),
        (samplers.DPMSolverSinglestep, {"algorithm_type": "dpmsolver"}, "algorithm_type"),
        (samplers.DPMSolverSinglestep, {"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),
        (samplers.DEIS, {"use_flow_sigmas": True}, "use_flow_sigmas"),
        (samplers.LCM, {"thresholding": True}, "thresholding"),
        (samplers.DPMSolverMultistep, {"algorithm_type": "dpmsolver"}, "algorithm_type"),
        (samplers.DPMSolverMultistep, {"use_lu_lambdas": True}, "use_lu_lambdas"),
        (samplers.DPMSolverMultistep, {"variance_type": "learned_range"}, "variance_type"),
        (samplers.PNDM, {"prediction_type": "sample"}, "prediction_type"),
        (samplers.PNDM, {"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),
        (samplers.LMS, {"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),
        (samplers.EulerAncestral, {"prediction_type": "sample"}, "prediction_type"),
        (samplers.DDPM, {"variance_type": "learned"}, "variance_type"),
        (samplers.Euler, {"timestep_spacing": "uniform"}, "timestep_spacing"),
        (samplers.DDIM, {"beta_schedule": "sigmoid"}, "beta_schedule"),
    ],
)
def test_unsupported_values_raise(cls, raw, key):
    with pytest.raises(ConfigError, match=key):
        cls.from_config(dict(SD1, **raw))


def test_swapping_zero_snr_config_to_sampler_without_it_raises():
    base = samplers.get_sampler("ddim", SD1, **ZERO_SNR)
    assert samplers.get_sampler("euler", base).rescale_betas_zero_snr
    with pytest.raises(ConfigError, match="rescale_betas_zero_snr"):
        samplers.get_sampler("pndm", base)


def test_trained_betas_and_config_round_trip():
    betas = list(np.linspace(0.0001, 0.02, 1000))
    sampler = samplers.get_sampler("ddim", dict(SD1, trained_betas=betas))
    assert isinstance(sampler.trained_betas, tuple) and hash(sampler)
    ref = torch_scheduler(sampler)
    np.testing.assert_array_equal(sampler.alphas_cumprod, ref.alphas_cumprod.numpy())
    for name in samplers.available():
        sampler = samplers.get_sampler(name, SD1)
        parsed = loops.front(sampler)
        options = {k: getattr(parsed, k) for k in parsed.options}
        assert samplers.front(type(parsed).from_config(parsed.config, **options)) == sampler
        assert dataclasses.replace(sampler) == sampler


def test_runtime_never_imports_torch_or_diffusers():
    for module in (
        "common",
        "pndm",
        "ddim",
        "ddpm",
        "euler",
        "lms",
        "dpm_solver",
        "heun",
        "kdpm2",
        "dpm_sde",
        "dpm_singlestep",
        "unipc",
        "deis",
        "lcm",
        "schedules",
        "a1111",
    ):
        source = importlib.util.find_spec(f"sdjax.samplers.{module}").origin
        with open(source, encoding="utf-8") as f:
            text = f.read()
        assert "import torch" not in text and "diffusers import" not in text and "import diffusers" not in text
