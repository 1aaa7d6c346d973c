"""Flow-matching sampling (Flux.1, SD 3/3.5) against diffusers (PyTorch, float32).

Schedules: sdjax's sigmas and timesteps equal diffusers' bit for bit (FlowMatchEuler on both sigma grids, static and
dynamic shift, `shift_terminal`, Karras/exponential/beta, `invert_sigmas`; FlowMatchHeun; DPM-Solver++ and UniPC with
flow sigmas), with mu from the latent shape exactly as FluxPipeline / StableDiffusion3Pipeline compute it.

Loops: the stand-in model of `loops.py` read as a velocity, the same initial noise (batch 2) and, for stochastic
sampling, the same noise; diffusers' loop is the pipelines' (`set_timesteps` with FluxPipeline's sigmas and mu,
`set_begin_index(0)`, `step(v, t, x)`). Every intermediate sample is compared: |sdjax - diffusers| <= 1e-6 * (1 + the
step's largest |value|). Measured (the stand-in does not denoise: latents reach |x| = 5.4): Euler and Heun at most
9.5e-7 absolute, 1.6e-7 of that scale; DPM-Solver++ and UniPC 1.9e-6 absolute, 3.3e-7 of the scale (float32 exp/log
of their lambda steps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import loops
import numpy as np
import pytest

from sdjax import samplers
from sdjax.config import ConfigError
from sdjax.core.tasks.base import window
from sdjax.samplers.flow_match import calculate_shift

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

# The released scheduler_config.json files.
FLUX_DEV = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.30.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
FLUX_SCHNELL = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.29.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
}
SD35 = {  # stabilityai/stable-diffusion-3.5-large (SD 3 medium's is the same)
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.31.0.dev0",
    "num_train_timesteps": 1000,
    "shift": 3.0,
}
SD1 = {"_class_name": "PNDMScheduler", "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}

SMALL = (2, 4, 8, 8)  # loops.SHAPE: 16 tokens (mu extrapolated below base_image_seq_len)
FLUX_512 = (2, 4, 64, 64)  # a 512 x 512 image: 1024 tokens
FLUX_1024x768 = (2, 4, 128, 96)  # 3072 tokens


def pipeline_mu(raw: dict, shape) -> float:
    """FluxPipeline's mu: `calculate_shift(latents.shape[1], config.get(...))` on the packed latents."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as reference

    seq_len = (shape[2] // 2) * (shape[3] // 2)
    get = raw.get
    return reference(
        seq_len, get("base_image_seq_len", 256), get("max_image_seq_len", 4096), get("base_shift", 0.5),
        get("max_shift", 1.15),
    )  # fmt: skip


def reference_scheduler(sampler, shape, n: int):
    """diffusers' scheduler for `sampler` after the pipeline's `set_timesteps`: FluxPipeline's sigmas for the "flux"
    grid, mu whenever the config shifts dynamically (as FluxPipeline and StableDiffusion3Pipeline pass it)."""
    ref = getattr(diffusers, sampler.diffusers_class).from_config(sampler.config)
    kwargs = {}
    if getattr(ref.config, "use_dynamic_shifting", False):
        kwargs["mu"] = pipeline_mu(sampler.config, shape)
    if getattr(loops.front(sampler), "sigma_grid", "scheduler") == "flux":
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), **kwargs)
    else:
        ref.set_timesteps(n, **kwargs)
    return ref


def reference_heun_on(sampler, shape, n: int):
    """diffusers' FlowMatchHeun has no `mu` or `sigmas` (FluxPipeline cannot run it): its step on the schedule of a
    FlowMatchEuler with the same keys, interleaved as its own `set_timesteps` does."""
    euler = samplers.get_sampler(dict(sampler.config, _class_name="FlowMatchEulerDiscreteScheduler"))
    euler = samplers.get_sampler(euler, sigma_grid=loops.front(sampler).sigma_grid)
    src = reference_scheduler(euler, shape, n)
    ref = diffusers.FlowMatchHeunDiscreteScheduler.from_config({"shift": sampler.shift})
    ref.set_timesteps(n)
    t, s = src.timesteps, src.sigmas
    ref.timesteps = torch.cat([t[:1], t[1:].repeat_interleave(2)])
    ref.sigmas = torch.cat([s[:1], s[1:-1].repeat_interleave(2), s[-1:]])
    return ref


def run_torch(ref, x0: np.ndarray, noises: np.ndarray) -> np.ndarray:
    """The pipelines' loop from a scheduler whose timesteps are set -> the trajectory (calls, *shape)."""
    return loops.run_torch(ref, None, x0, noises, init_sigma=1.0)[2]


def inputs(shape, calls: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal((calls, *shape)).astype(np.float32)


def assert_trajectory_close(ours, ref, what=""):
    scale = 1 + np.abs(ref).reshape(len(ref), -1).max(axis=1).reshape((-1,) + (1,) * (ref.ndim - 1))
    err = np.abs(ours - ref) / scale
    assert np.isfinite(ours).all() and err.max() <= 1e-6, f"{what}: {err.max():.3g} of the scale"


def flow(name, raw, *, n=8, shape=SMALL, **extra):
    label = "-".join([name, str(raw.get("shift")), str(raw.get("use_dynamic_shifting", False)), str(n), str(shape[2:])])
    label += "".join(f"-{k}={v}" for k, v in extra.items())
    return pytest.param(name, raw, n, shape, extra, id=label)


LOOPS = [
    flow("flow_euler", SD35, n=10),  # SD 3.5: static shift 3, diffusers' own grid
    flow("flow_euler", FLUX_DEV, shape=FLUX_512, sigma_grid="flux"),  # Flux dev: dynamic shift, two resolutions
    flow("flow_euler", FLUX_DEV, shape=FLUX_1024x768, sigma_grid="flux"),
    flow("flow_euler", FLUX_SCHNELL, n=4, sigma_grid="flux"),  # schnell: shift 1, 4 steps
    flow("flow_euler", FLUX_DEV, shape=FLUX_512, sigma_grid="flux", shift_terminal=0.1),
    flow("flow_euler", SD35, use_karras_sigmas=True, invert_sigmas=True),
    flow("flow_euler", SD35, n=6, stochastic_sampling=True),
    flow("flow_euler", FLUX_DEV, sigma_grid="scheduler", time_shift_type="linear", use_beta_sigmas=True),
    flow("flow_heun", SD35, n=6),
    flow("flow_heun", FLUX_DEV, n=5, shape=FLUX_512, sigma_grid="flux"),
    flow("flow_dpmpp_2m", SD35, n=10),
    flow("flow_dpmpp_2m", FLUX_DEV, n=10, shape=FLUX_512),
    flow("flow_dpmpp_2m", FLUX_DEV, n=10, shape=FLUX_1024x768, solver_order=3, final_sigmas_type="sigma_min"),
    flow("flow_dpmpp_2m", SD35, n=8, algorithm_type="sde-dpmsolver++", solver_type="heun"),
    flow("flow_unipc", SD35, n=10),
    flow("flow_unipc", FLUX_DEV, n=10, shape=FLUX_512),
    flow("flow_unipc", FLUX_SCHNELL, n=6, solver_order=3, shift_terminal=0.2, final_sigmas_type="sigma_min"),
]


@pytest.mark.parametrize("name, raw, n, shape, extra", LOOPS)
def test_loop_matches_diffusers(name, raw, n, shape, extra):
    sampler = samplers.get_sampler(name, raw, **extra)
    calls = sampler.num_model_calls(n)
    x0, noises = inputs(shape, calls)
    timesteps, init_sigma, traj = jax.device_get(loops.run_jax(sampler, n, x0, noises))
    heun_on_flux = name == "flow_heun" and sampler.use_dynamic_shifting
    ref = reference_heun_on(sampler, shape, n) if heun_on_flux else reference_scheduler(sampler, shape, n)
    np.testing.assert_array_equal(timesteps, ref.timesteps.numpy().astype(np.float32))
    np.testing.assert_array_equal(loops.tables(sampler, n, shape)["sigmas"], ref.sigmas.numpy())
    assert float(init_sigma) == 1.0 and len(timesteps) == calls
    assert_trajectory_close(traj, run_torch(ref, x0, noises), f"{name} {extra}")


# -------------------------------------------------------------------------------------------------- schedules
GRIDS = [
    (FLUX_DEV, "flux"),
    (FLUX_DEV, "scheduler"),
    (FLUX_SCHNELL, "flux"),
    (SD35, "scheduler"),
    (SD35, "flux"),
]
EXTRAS = [
    {},
    {"shift_terminal": 0.1},
    {"use_karras_sigmas": True},
    {"use_exponential_sigmas": True},
    {"use_beta_sigmas": True},
    {"invert_sigmas": True},
    {"time_shift_type": "linear"},
]


@pytest.mark.parametrize(
    "raw, grid", GRIDS, ids=[f"{r['shift']}-{r.get('use_dynamic_shifting')}-{g}" for r, g in GRIDS]
)
def test_flow_match_euler_schedule_is_diffusers_bit_for_bit(raw, grid):
    for extra in EXTRAS:
        sampler = samplers.get_sampler(dict(raw, **extra), sigma_grid=grid)
        for n in (2, 3, 4, 8, 28, 50):
            for shape in (SMALL, FLUX_512, FLUX_1024x768):
                ref = reference_scheduler(sampler, shape, n)
                what = f"{extra} n={n} {shape}"
                np.testing.assert_array_equal(loops.tables(sampler, n, shape)["sigmas"], ref.sigmas.numpy(), what)
                np.testing.assert_array_equal(sampler.timesteps_for(n, shape), ref.timesteps.numpy(), what)
                assert sampler.num_model_calls(n) == len(ref.timesteps)
                if not sampler.use_dynamic_shifting:  # the schedule does not depend on the shape
                    np.testing.assert_array_equal(sampler.timesteps_for(n), ref.timesteps.numpy(), what)


@pytest.mark.parametrize("name", ["flow_heun", "flow_dpmpp_2m", "flow_unipc"])
@pytest.mark.parametrize("raw", [FLUX_DEV, FLUX_SCHNELL, SD35], ids=["dev", "schnell", "sd35"])
def test_other_flow_schedules_are_diffusers_bit_for_bit(name, raw):
    extras = [{}, {"final_sigmas_type": "sigma_min"}] if name != "flow_heun" else [{}]
    if name == "flow_unipc":
        extras.append({"shift_terminal": 0.05})
    for extra in extras:
        sampler = samplers.get_sampler(name, raw, **extra)
        for n in (1, 2, 5, 28, 50):
            if n == 1 and extra.get("shift_terminal"):
                with pytest.raises(ValueError, match="at least 2 steps"):
                    sampler.num_model_calls(n)
                continue
            for shape in (SMALL, FLUX_1024x768):
                heun_on_flux = name == "flow_heun" and sampler.use_dynamic_shifting
                ref = reference_heun_on(sampler, shape, n) if heun_on_flux else reference_scheduler(sampler, shape, n)
                what = f"{extra} n={n} {shape}"
                np.testing.assert_array_equal(loops.tables(sampler, n, shape)["sigmas"], ref.sigmas.numpy(), what)
                np.testing.assert_array_equal(sampler.timesteps_for(n, shape), ref.timesteps.numpy(), what)
                assert sampler.num_model_calls(n) == len(ref.timesteps) and sampler.order == ref.order


def test_mu_is_the_pipelines():
    for shape in (SMALL, FLUX_512, FLUX_1024x768, (1, 16, 128, 128)):
        seq_len = (shape[2] // 2) * (shape[3] // 2)
        assert calculate_shift(seq_len, 256, 4096, 0.5, 1.15) == pipeline_mu(FLUX_DEV, shape)
    assert calculate_shift(4096) == pytest.approx(1.15) and calculate_shift(256) == pytest.approx(0.5)


def test_dynamic_schedule_needs_the_shape():
    sampler = samplers.get_sampler(FLUX_DEV)
    assert sampler.num_model_calls(28) == 28
    with pytest.raises(ValueError, match="latent shape"):
        sampler.timesteps_for(28)
    with pytest.raises(ValueError, match="latent shape"):
        sampler.set_timesteps(sampler.create_state(), 28)
    dpm = samplers.get_sampler("flow_dpmpp_2m", FLUX_DEV)
    assert dpm.use_dynamic_shifting and dpm.num_model_calls(28) == 28
    with pytest.raises(ValueError, match="latent shape"):
        dpm.timesteps_for(28)
    # Different resolutions, different schedules.
    assert not np.array_equal(sampler.timesteps_for(28, FLUX_512), sampler.timesteps_for(28, FLUX_1024x768))


# ------------------------------------------------------------------------------------- add_noise_at, contract
@pytest.mark.parametrize(
    "name, raw, extra",
    [
        ("flow_euler", SD35, {}),
        ("flow_euler", FLUX_DEV, {"sigma_grid": "flux"}),
        ("flow_heun", SD35, {}),
        ("flow_dpmpp_2m", FLUX_DEV, {}),
        ("flow_unipc", SD35, {}),
    ],
)
def test_add_noise_at_is_scale_noise(name, raw, extra):
    """`add_noise_at(i)` = diffusers' `scale_noise` (FlowMatch) / `add_noise` (DPM-Solver, UniPC) after
    `set_begin_index(i)`: sigma eps + (1 - sigma) x0 at model call i; the final sigma (0) at i = calls."""
    sampler = samplers.get_sampler(name, raw, **extra)
    n, shape = 10, FLUX_512
    calls = sampler.num_model_calls(n)
    x0, noises = inputs(shape, 1, seed=3)
    state = sampler.set_timesteps(sampler.create_state(), n, shape)
    fn = jax.jit(lambda st, i: sampler.add_noise_at(st, x0, noises[0], i))
    for index in sorted({0, 1, calls // 2, calls - 1, calls}):
        heun_on_flux = name == "flow_heun" and sampler.use_dynamic_shifting
        ref = reference_heun_on(sampler, shape, n) if heun_on_flux else reference_scheduler(sampler, shape, n)
        ref.set_begin_index(index)
        t = ref.timesteps[min(index, calls - 1) :][:1].repeat(2)
        x, eps = torch.from_numpy(x0), torch.from_numpy(noises[0])
        expect = ref.scale_noise(x, t, eps) if hasattr(ref, "scale_noise") else ref.add_noise(x, eps, t)
        np.testing.assert_allclose(np.asarray(fn(state, jnp.int32(index))), expect.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(fn(state, jnp.int32(calls))), x0)


def test_contract():
    for name in samplers.available(flow=True):
        sampler = samplers.get_sampler(name, SD35)
        state = sampler.set_timesteps(sampler.create_state(), 6, SMALL)
        assert float(sampler.init_noise_sigma(state)) == 1.0
        x = jnp.ones(SMALL)
        assert sampler.scale_model_input(state, x, 2) is x
        assert sampler.num_model_calls(6) == (11 if name == "flow_heun" else 6) and sampler.order == (
            2 if name == "flow_heun" else 1
        )
        assert samplers.name_of(sampler) == name
    stochastic = samplers.get_sampler(SD35, stochastic_sampling=True)
    assert stochastic.stochastic and not samplers.get_sampler(SD35).stochastic
    state = stochastic.set_timesteps(stochastic.create_state(), 4, SMALL)
    with pytest.raises(ValueError, match="noise"):
        stochastic.step(state, jnp.ones(SMALL), 0, jnp.ones(SMALL))


# --------------------------------------------------------------------------------------------- img2img window
def flux_get_timesteps(n: int, strength: float, order: int) -> int:
    """FluxImg2ImgPipeline.get_timesteps (and SD 3's): the first model call."""
    init_timestep = min(n * strength, n)
    t_start = int(max(n - init_timestep, 0))
    return t_start * order


# Strengths where n * strength is an integer in float64 (SD's rule, int(n * strength) steps, agrees), and where it
# is not: Flux skips int(n - n * strength) steps, i.e. runs ceil(n * strength) (float rounding: 10 * 0.3 =
# 3.0000000000000004 -> 4 steps).
STRENGTHS = [(28, 1.0), (28, 0.5), (28, 0.75), (10, 0.5), (4, 0.25), (20, 0.6)]
STRENGTHS += [(10, 0.55), (10, 0.3), (28, 0.6), (4, 0.6), (4, 0.1), (10, 0.05)]


@pytest.mark.parametrize("raw", [FLUX_SCHNELL, FLUX_DEV], ids=["schnell", "dev"])
@pytest.mark.parametrize("name", ["flow_euler", "flow_heun"])
def test_window_start_matches_flux_img2img(name, raw):
    """`window(..., strength_rule="float")` (the flow families' img2img/inpainting) starts where
    FluxImg2ImgPipeline.get_timesteps does; it never needs the (shape-dependent) timesteps for a strength."""
    sampler = samplers.get_sampler(name, raw, sigma_grid="flux")
    for n, strength in STRENGTHS:
        start, end = window(sampler, n, strength=strength, strength_rule="float")
        assert start == flux_get_timesteps(n, strength, sampler.order), (n, strength)
        assert end == sampler.num_model_calls(n)


# ---------------------------------------------------------------------------------------- configs and names
def test_released_configs_build():
    dev, schnell, sd35 = (samplers.get_sampler(raw) for raw in (FLUX_DEV, FLUX_SCHNELL, SD35))
    assert isinstance(dev.origin, samplers.FlowMatchEuler) and dev.use_dynamic_shifting and dev.shift == 3.0
    assert (dev.base_shift, dev.max_shift, dev.base_image_seq_len, dev.max_image_seq_len) == (0.5, 1.15, 256, 4096)
    assert not schnell.use_dynamic_shifting and schnell.shift == 1.0
    assert (
        sd35.shift == 3.0 and sd35.origin.sigma_grid == "scheduler" and sd35.origin.prediction_type == "flow_prediction"
    )
    for sampler, raw in ((dev, FLUX_DEV), (schnell, FLUX_SCHNELL), (sd35, SD35)):
        public = {k: v for k, v in raw.items() if not k.startswith("_")}
        assert {k: sampler.config[k] for k in public} == public
        assert samplers.front(type(sampler.origin).from_config(sampler.config)) == sampler
        assert samplers.name_of(sampler) == "flow_euler"
        assert hash(samplers.get_sampler(sampler, sigma_grid="flux")) != hash(sampler)
    assert samplers.get_sampler("FlowMatchHeunDiscreteScheduler", SD35).shift == 3.0
    assert samplers.available(flow=True) == ["flow_euler", "flow_heun", "flow_dpmpp_2m", "flow_unipc"]
    assert not set(samplers.available()) & set(samplers.available(flow=True))


def test_swaps_onto_flow_configs():
    dpm = samplers.get_sampler("flow_dpmpp_2m", SD35)
    assert dpm.use_flow_sigmas and dpm.prediction_type == "flow_prediction" and dpm.flow_shift == 3.0
    ref = diffusers.DPMSolverMultistepScheduler.from_config(SD35, use_flow_sigmas=True, flow_shift=3.0)
    assert ref.config.use_dynamic_shifting is False and not dpm.use_dynamic_shifting
    unipc = samplers.get_sampler("flow_unipc", FLUX_DEV)
    assert unipc.use_dynamic_shifting and unipc.flow_shift == 3.0 and unipc.solver_type == "bh2"
    heun = samplers.get_sampler("flow_heun", samplers.get_sampler(FLUX_DEV))
    assert heun.use_dynamic_shifting and heun.max_shift == 1.15
    # Names fold like the other registry names.
    assert samplers.name_of(samplers.get_sampler("Flow-Euler", SD35)) == "flow_euler"


@pytest.mark.parametrize("name", ["flow_euler", "flow_heun", "flow_dpmpp_2m", "flow_unipc"])
def test_flow_samplers_refuse_a_vp_model(name):
    with pytest.raises(ConfigError, match="variance-preserving"):
        samplers.get_sampler(name, SD1)


@pytest.mark.parametrize(
    "cls, raw, key",
    [
        (samplers.DPMSolverMultistep, {"prediction_type": "flow_prediction"}, "use_flow_sigmas"),
        (samplers.DPMSolverMultistep, {"use_flow_sigmas": True, "use_karras_sigmas": True}, "exclusive"),
        (
            samplers.DPMSolverMultistep,
            {"use_flow_sigmas": True, "use_dynamic_shifting": True, "time_shift_type": "linear"},
            "exponential",
        ),
        (samplers.UniPC, {"use_flow_sigmas": True, "prediction_type": "flow_prediction", "predict_x0": False}, "x0"),
        (samplers.UniPC, {"shift_terminal": 0.1}, "shift_terminal"),
        (samplers.FlowMatchEuler, {"time_shift_type": "cubic"}, "time_shift_type"),
        (samplers.FlowMatchHeun, {"invert_sigmas": True}, "invert_sigmas"),
        (samplers.FlowMatchEuler, {"prediction_type": "epsilon"}, "variance-preserving"),
    ],
)
def test_unsupported_values_raise(cls, raw, key):
    with pytest.raises(ConfigError, match=key):
        cls.from_config(raw)
    with pytest.raises(ConfigError, match="sigma_grid"):
        samplers.get_sampler(SD35, sigma_grid="karras")


def test_a1111_names_on_a_flow_model():
    from sdjax.samplers import a1111, schedules

    dev = samplers.get_sampler(FLUX_DEV)
    for name, schedule, registry in [
        ("Euler", "Simple", "flow_euler"),
        ("Euler", "Automatic", "flow_euler"),
        ("k_euler", "Normal", "flow_euler"),
        ("Heun", "Uniform", "flow_heun"),
        ("DPM++ 2M", "Automatic", "flow_dpmpp_2m"),
        ("UniPC", "Simple", "flow_unipc"),
    ]:
        sampler = a1111.from_a1111_flow(name, schedule, dev)
        parsed = loops.front(sampler)
        assert isinstance(parsed, samplers.FLOW_SAMPLERS[registry][0]) and parsed.prediction_type == "flow_prediction"
        assert sampler.use_dynamic_shifting, (name, schedule)
    unipc = a1111.from_a1111_flow("UniPC", "Automatic", dev)
    assert (unipc.solver_type, unipc.solver_order, unipc.use_flow_sigmas) == ("bh1", 3, True)  # A1111's UniPC
    karras = a1111.from_a1111_flow("Euler Karras", None, dev)
    assert karras.use_karras_sigmas and isinstance(karras, samplers.FlowMatchEuler)
    assert a1111.from_a1111_flow("Euler", "Beta", dev).use_beta_sigmas
    # Pairs no diffusers flow sampler expresses run in the k-diffusion form (tests/samplers/test_kdiffusion_reach.py).
    for name, schedule in [("Euler a", "Automatic"), ("DPM++ 2M Karras", None), ("Euler", "SGM Uniform")]:
        assert isinstance(a1111.from_a1111_flow(name, schedule, dev), samplers.KDiffusionSampler)
    with pytest.raises(a1111.UnsupportedSamplerError, match="flow-matching"):
        a1111.from_a1111_flow("DPM2 a", "Automatic", dev)
    with pytest.raises(ConfigError, match="exclusive"):
        a1111.from_a1111_flow("UniPC Karras", None, dev)
    with pytest.raises(schedules.UnsupportedScheduleError):
        a1111.from_a1111_flow("Euler", "DDIM", dev)
    # The A1111 names themselves still mean the SD samplers.
    assert isinstance(loops.front(a1111.from_a1111("Euler", "Automatic", samplers.get_sampler(SD1))), samplers.Euler)


def test_a1111_unipc_on_flux_matches_diffusers_before_its_nan():
    """A1111's UniPC (bh1, order 3) on Flux dev: diffusers' last step to sigma 0 is NaN (bh1's B(h) is infinite
    there); sdjax returns the limit, the x0 prediction. The steps before match."""
    from sdjax.samplers import a1111

    sampler = a1111.from_a1111_flow("UniPC", "Automatic", samplers.get_sampler(FLUX_DEV))
    n, shape = 8, FLUX_512
    x0, noises = inputs(shape, n)
    timesteps, _, traj = jax.device_get(loops.run_jax(sampler, n, x0, noises))
    ref = run_torch(reference_scheduler(sampler, shape, n), x0, noises)
    assert np.isnan(ref[-1]).any() and np.isfinite(traj).all()
    assert_trajectory_close(traj[:-1], ref[:-1], "UniPC bh1")
    x, sigma = traj[-2], float(loops.tables(sampler, n, shape)["sigmas"][-2])
    v = np.asarray(loops.fake_model_jax(jnp.asarray(x), timesteps[-1]))
    np.testing.assert_allclose(traj[-1], x - sigma * v, rtol=0, atol=1e-6)
