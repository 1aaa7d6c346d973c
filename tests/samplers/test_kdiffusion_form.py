"""The k-diffusion form (`sdjax.samplers.kdiffusion`: one denoiser wrapper, sigma schedules, sigma-only step rules)
against the diffusers-parity samplers, both run through the one loop (`sdjax.core.loop.denoise`) on a fixed toy
model of x and t; and a property every rule must have: with a perfect denoiser of a point-mass data set, sampling
lands on that point.

The diffusers-parity samplers are checked against diffusers itself elsewhere (test_samplers.py, test_flow_match.py),
so agreement here is agreement with diffusers. The two forms keep the sample in different parameterisations where
the model is variance-preserving (DPM-Solver++: the VP sample; k-diffusion: the VE sample x0 + sigma eps); each
starts from the same noise scaled by its own `init_noise_sigma`, and they agree where sigma reaches 0.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax.config import ConfigError
from sdjax.core import loop
from sdjax.samplers import (
    DPMSolverMultistep,
    Euler,
    EulerAncestral,
    FlowMatchEuler,
    FlowMatchHeun,
    Heun,
    kdiffusion_sampler,
)
from sdjax.samplers import kdiffusion as kd

SHAPE = (2, 4, 8, 8)
SD = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "timestep_spacing": "linspace",
    "steps_offset": 1,
}
SD3 = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
FLUX = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def toy_model(x, t):
    """A deterministic stand-in for a network: smooth in x and in the timestep it is fed."""
    t = jnp.asarray(t, jnp.float32)
    return 0.3 * x * jnp.cos(t / 300) + 0.1 * jnp.sin(x) + 0.05 * jnp.sin(t / 77)


def noise() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32))


def sample(sampler, steps: int, start=None, make_model=None) -> np.ndarray:
    """Run the whole schedule through `loop.denoise` from `start` (default: unit noise times the sampler's own
    `init_noise_sigma`) with `toy_model` (or `make_model(state)`); stochastic samplers draw their noise from the
    same per-image keys."""
    state = sampler.set_timesteps(sampler.create_state(), steps, SHAPE)
    latents = noise() * sampler.init_noise_sigma(state) if start is None else start
    keys = jax.random.split(jax.random.PRNGKey(7), SHAPE[0])
    out, _ = loop.denoise(
        model=toy_model if make_model is None else make_model(state),
        sampler=sampler,
        state=state,
        latents=latents,
        start=0,
        end=sampler.num_model_calls(steps),
        keys=keys,
        guidance=jnp.ones((SHAPE[0],)),
        cfg=False,
    )
    return np.asarray(out)


def check_parity(ref, mine, steps: int, *, same_start: bool, rtol: float = 2e-6) -> float:
    """Same model calls, same timesteps, and final latents within `rtol` of the largest value (float32 rounding:
    the two forms order their arithmetic differently). Returns that relative error."""
    np.testing.assert_array_equal(mine.num_model_calls(steps), ref.num_model_calls(steps))
    shaped = "shape" in inspect.signature(ref.timesteps_for).parameters
    want_t = ref.timesteps_for(steps, SHAPE) if shaped else ref.timesteps_for(steps)
    np.testing.assert_allclose(mine.timesteps_for(steps, SHAPE), want_t, rtol=1e-6, atol=1e-4)
    start = None
    if same_start:
        ref_state = ref.set_timesteps(ref.create_state(), steps, SHAPE)
        start = noise() * ref.init_noise_sigma(ref_state)
    want = sample(ref, steps, start)
    got = sample(mine, steps, start)
    assert np.isfinite(got).all()
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= rtol, f"max |k-diffusion form - diffusers form| / max |diffusers form| = {err:.2e}"
    return err


# ------------------------------------------------------------------------------- parity: variance-preserving
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_euler_vp_equals_euler(prediction):
    ref = Euler.from_config({**SD, "prediction_type": prediction})
    mine = kd.from_diffusers(ref)
    assert (mine.rule, mine.schedule.name, mine.prediction.kind) == ("euler", "spaced", prediction)
    check_parity(ref, mine, 12, same_start=True)


def test_euler_karras_equals_euler_karras():
    ref = Euler.from_config({**SD, "use_karras_sigmas": True})
    mine = kd.from_diffusers(ref)
    assert mine.schedule.name == "karras"
    check_parity(ref, mine, 12, same_start=True)


def test_heun_vp_equals_heun():
    ref = Heun.from_config({**SD, "prediction_type": "v_prediction"})
    mine = kd.from_diffusers(ref)
    assert mine.order == ref.order == 2
    check_parity(ref, mine, 8, same_start=True)


def test_euler_ancestral_vp_equals_euler_a():
    ref = EulerAncestral.from_config(SD)
    mine = kd.from_diffusers(ref)
    assert mine.stochastic and ref.stochastic
    check_parity(ref, mine, 12, same_start=True)


@pytest.mark.parametrize("algorithm", ["dpmsolver++", "sde-dpmsolver++"])
def test_dpmpp_2m_karras_equals_dpm_solver(algorithm):
    ref = DPMSolverMultistep.from_config({**SD, "use_karras_sigmas": True, "algorithm_type": algorithm})
    mine = kd.from_diffusers(ref)
    assert mine.rule == ("dpmpp_2m" if algorithm == "dpmsolver++" else "dpmpp_2m_sde")
    assert mine.prediction.timestep == "round"
    # Each from unit noise in its own parameterisation: the VP sample, and its VE image sqrt(sigma_0^2 + 1) times it.
    check_parity(ref, mine, 12, same_start=False)


# ----------------------------------------------------------------------------------------------- parity: flow
@pytest.mark.parametrize("config", [SD3, FLUX], ids=["static_shift", "dynamic_shift"])
def test_flow_euler_equals_flow_match_euler(config):
    grid = "flux" if config.get("use_dynamic_shifting") else "scheduler"
    ref = FlowMatchEuler.from_config(config, sigma_grid=grid)
    mine = kd.from_diffusers(config, grid=grid)
    assert (mine.prediction.kind, mine.schedule.name, mine.schedule.shift) == ("flow", "flow", 3.0)
    check_parity(ref, mine, 10, same_start=False)


def test_flow_heun_equals_flow_match_heun():
    raw = {**SD3, "_class_name": "FlowMatchHeunDiscreteScheduler"}
    ref = FlowMatchHeun.from_config(raw)
    check_parity(ref, kd.from_diffusers(raw), 6, same_start=False)


@pytest.mark.parametrize("dynamic", [False, True])
def test_flow_dpmpp_2m_equals_dpm_solver_flow_sigmas(dynamic):
    raw = {
        "_class_name": "DPMSolverMultistepScheduler",
        "use_flow_sigmas": True,
        "prediction_type": "flow_prediction",
        "flow_shift": 3.0,
        "use_dynamic_shifting": dynamic,
    }
    ref = DPMSolverMultistep.from_config(raw)
    mine = kd.from_diffusers(raw)
    assert (mine.rule, mine.schedule.grid, mine.prediction.timestep) == ("dpmpp_2m", "solver", "floor")
    check_parity(ref, mine, 10, same_start=False)


def test_the_same_rule_runs_a_flow_model_unchanged():
    """One rule object, two models: the flow sampler differs from the VP one only in its prediction and schedule."""
    for rule in kd.RULES:
        vp = kdiffusion_sampler(rule, "karras", "epsilon")
        flow = kdiffusion_sampler(rule, base_config=FLUX)
        assert vp.step_rule is flow.step_rule
        assert flow.schedule.use_dynamic_shifting and flow.prediction.flow
        assert np.isfinite(sample(flow, 6)).all()


# ---------------------------------------------------------------------------------- property: perfect denoiser
X0 = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, SHAPE).astype(np.float32))


def perfect_model(sampler):
    """The network output whose denoised estimate is exactly X0 (the data set is the single point X0): the model
    reads its sigma back from the timestep it is fed (first matching model call of the sampler's table)."""
    prediction = sampler.prediction

    def make(state):
        def model(x_in, t):
            sigma = state.sigmas[jnp.argmax(state.timesteps == t)]
            x = x_in / prediction.input_scale(sigma)
            if prediction.kind == "sample":
                return jnp.broadcast_to(X0, x.shape)
            if prediction.kind in ("epsilon", "flow"):  # eps on the VE path, v = eps - x0 on the flow path
                return (x - X0) / sigma
            c_skip, c_out = 1 / (sigma**2 + 1), -sigma / jnp.sqrt(sigma**2 + 1)  # v-prediction
            return (X0 - c_skip * x) / c_out

        return model

    return make


@pytest.mark.parametrize("rule", list(kd.RULES))
@pytest.mark.parametrize(
    "prediction,schedule",
    [
        ("epsilon", "karras"),
        ("v_prediction", "normal"),
        ("sample", "exponential"),
        ("flow", "flow"),
        ("flow", "simple"),
    ],
)
def test_perfect_denoiser_lands_on_the_data_point(rule, prediction, schedule):
    options = {"shift": 3.0} if prediction == "flow" else {}
    sampler = kdiffusion_sampler(rule, schedule, prediction, **options)
    out = sample(sampler, 7, make_model=perfect_model(sampler))
    np.testing.assert_allclose(out, np.asarray(X0), atol=1e-5)


@pytest.mark.parametrize("rule", ["euler", "heun", "dpmpp_2m"])
@pytest.mark.parametrize("prediction,schedule", [("epsilon", "karras"), ("flow", "flow")])
def test_perfect_denoiser_keeps_deterministic_rules_on_the_exact_path(rule, prediction, schedule):
    """Midway (after any model call, a Heun stage included) the sample is alpha(sigma) x0 + sigma eps of the noise it
    started from: the rules integrate a point mass's probability-flow ODE without error."""
    options = {"shift": 3.0} if prediction == "flow" else {}
    sampler = kdiffusion_sampler(rule, schedule, prediction, **options)
    state = sampler.set_timesteps(sampler.create_state(), 7, SHAPE)
    x_T = noise() * sampler.init_noise_sigma(state)
    eps = (x_T - sampler.prediction.alpha(state.sigmas[0]) * X0) / state.sigmas[0]
    for end in (3, 4, 5):
        out, _ = loop.denoise(
            model=perfect_model(sampler)(state),
            sampler=sampler,
            state=state,
            latents=x_T,
            start=0,
            end=end,
            keys=jax.random.split(jax.random.PRNGKey(0), SHAPE[0]),
            guidance=jnp.ones((SHAPE[0],)),
            cfg=False,
        )
        sigma = state.sigmas[end]
        want = sampler.prediction.alpha(sigma) * X0 + sigma * eps
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_a_window_from_add_noise_at_equals_the_diffusers_form():
    """img2img: the task noises x0 to the window's first model call (`add_noise_at`) and runs [start, end)."""
    for ref, mine in [
        (Euler.from_config(SD), kd.from_diffusers(Euler.from_config(SD))),
        (FlowMatchEuler.from_config(SD3), kd.from_diffusers(SD3)),
    ]:
        outs = []
        for sampler in (ref, mine):
            state = sampler.set_timesteps(sampler.create_state(), 10, SHAPE)
            x = sampler.add_noise_at(state, X0, noise(), 4)
            out, _ = loop.denoise(
                model=toy_model,
                sampler=sampler,
                state=state,
                latents=x,
                start=4,
                end=10,
                keys=jax.random.split(jax.random.PRNGKey(0), SHAPE[0]),
                guidance=jnp.ones((SHAPE[0],)),
                cfg=False,
            )
            outs.append(np.asarray(out))
        scale = max(1.0, float(np.abs(outs[0]).max()))
        assert np.abs(outs[0] - outs[1]).max() / scale < 2e-6


def test_a_pipeline_runs_the_k_diffusion_form_as_its_scheduler():
    """The whole generation program (tiny random SD model): the k-diffusion form of DPM++ 2M Karras assigned as
    `pipe.scheduler` gives the latents of the diffusers-parity sampler."""
    from sdjax import samplers
    from sdjax.pipelines.presets import build_pipeline

    pipe, params = build_pipeline("tiny", jnp.float32)
    ref = samplers.get_sampler("dpmpp_2m_karras", base_config=pipe.scheduler)
    kw = dict(steps=6, seed=0, output_type="latent", height=32, width=32, params=params)
    latents = []
    for sampler in (ref, kd.from_diffusers(ref)):
        pipe.scheduler = sampler
        latents.append(np.asarray(pipe.generate("a cat", **kw)))
    assert latents[0].std() > 0.1
    np.testing.assert_allclose(latents[1], latents[0], atol=1e-5 * max(1.0, float(np.abs(latents[0]).max())))


# ------------------------------------------------------------------------------------------- schedules, errors
def test_schedules_descend_to_zero_and_flow_shift_matches_flow_match():
    pred = kd.Prediction()
    for name in ("normal", "karras", "exponential", "beta", "sgm_uniform", "simple", "spaced"):
        sig = kd.Schedule(name).sigmas(9, pred)
        assert sig.shape == (10,) and sig[-1] == 0 and np.all(np.diff(sig) < 0), name
    ref = FlowMatchEuler.from_config(FLUX, sigma_grid="flux")
    mine = kd.from_diffusers(FLUX, grid="flux")
    np.testing.assert_array_equal(mine.sigmas_for(10, SHAPE), np.asarray(ref._tables(10, SHAPE)["sigmas"]))
    with pytest.raises(ValueError, match="latent shape"):
        mine.timesteps_for(10)


def test_flow_schedules_on_the_shifted_table():
    """Hand-computed: shift 3 maps t = 1, 0.75, 0.5, 0.25 to 1, 0.9, 0.75, 0.5 (3t / (1 + 2t)); "simple" takes every
    (T / n)-th training sigma from the top, "normal" spaces the timesteps sigma * T from 1000 to 1 (shift 1)."""
    flow = kd.Prediction(kind="flow")
    np.testing.assert_allclose(kd.Schedule("simple", shift=3.0).sigmas(4, flow), [1, 0.9, 0.75, 0.5, 0], rtol=1e-12)
    np.testing.assert_allclose(kd.Schedule("normal").sigmas(3, flow), [1, 0.5005, 0.001, 0], rtol=1e-12)
    sigmas = kd.Schedule("karras", shift=3.0).sigmas(5, flow)
    np.testing.assert_allclose(sigmas[[0, -2]], [1.0, 3e-3 / (1 + 2e-3)], rtol=1e-12)  # the shifted table's ends


def test_contract_edges():
    """`add_noise_at` at the end of the schedule is x0 itself; `draw_noise` is per-image standard normal noise;
    Heun's `order` and call count follow diffusers' two-stage layout."""
    for sampler in (kdiffusion_sampler("heun", "karras"), kdiffusion_sampler("euler_ancestral", base_config=SD3)):
        state = sampler.set_timesteps(sampler.create_state(), 5, SHAPE)
        calls = sampler.num_model_calls(5)
        assert state.timesteps.shape == (calls,) and state.sigmas.shape == (calls + 1,)
        np.testing.assert_array_equal(np.asarray(sampler.add_noise_at(state, X0, noise(), calls)), np.asarray(X0))
        drawn = sampler.draw_noise(jax.random.split(jax.random.PRNGKey(0), SHAPE[0]), 2, state, SHAPE)
        assert drawn.shape == SHAPE and abs(float(jnp.std(drawn)) - 1) < 0.1
    assert kdiffusion_sampler("heun").num_model_calls(5) == 9 and kdiffusion_sampler("heun").order == 2


def test_refusals():
    with pytest.raises(ConfigError, match="unknown step rule"):
        kdiffusion_sampler("lms")
    with pytest.raises(ConfigError, match="flow-matching models"):
        kdiffusion_sampler("euler", "karras", "epsilon", shift=3.0)
    with pytest.raises(ConfigError, match="does not match"):
        kdiffusion_sampler("euler", prediction="epsilon", base_config=SD3)
    with pytest.raises(ConfigError, match="no sigma-schedule form"):
        kd.from_diffusers(DPMSolverMultistep.from_config(SD))
    with pytest.raises(ConfigError, match="no k-diffusion form"):
        kd.from_diffusers({"_class_name": "DDIMScheduler"})
