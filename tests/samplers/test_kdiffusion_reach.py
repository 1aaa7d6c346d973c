"""The k-diffusion form (`sdjax.samplers.kdiffusion`) reached from the user's side: `generate(sampler=...)`,
`pipe.scheduler = ...`, `samplers.name_of` / `get_sampler` names, the Flux and SD 3 pipelines' sigma grids, and the
A1111/Forge names on flow models (`samplers.a1111.from_a1111_flow`) that no diffusers flow sampler expresses.

The expectations are written out here: the table of which (sampler, schedule) pair gets which sampler on a flow
model (the pairs served before keep their diffusers-parity class), the k-diffusion samplers built by hand with the
documented rule, schedule, grid and timestep mode, and samplers whose numbers must coincide (Euler a with eta = 0 is
FlowMatch Euler; DPM++ 2M SDE takes the sigmas of DPM++ 2M). The tiny-Flux test runs the CLI and the Python API.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import loops
import numpy as np
import pytest

from sdjax import samplers
from sdjax.config import ConfigError
from sdjax.core import loop
from sdjax.samplers import KDiffusionSampler, a1111, kdiffusion_sampler, schedules
from sdjax.samplers import kdiffusion as kd

FLUX_DEV = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
SD35 = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
SD15 = loops.SD15
SHAPE = (1, 16, 16, 16)  # an unpacked Flux latent: 64 tokens

# What every A1111 (sampler, schedule) pair gives on a flow model. Class names: the diffusers-parity sampler that
# served the pair before the k-diffusion form was reachable (unchanged); "kdiffusion:..." the k-diffusion form;
# None refused. Schedules not listed for a sampler are refused.
_GRID = ("Automatic", "Uniform", "Simple", "Normal")
EXPECTED_FLOW: dict[str, dict[str, str | None]] = {
    "Euler": {
        **dict.fromkeys((*_GRID, "Karras", "Exponential", "Beta"), "FlowMatchEuler"),
        "SGM Uniform": "kdiffusion:euler:sgm_uniform",
    },
    "Heun": {
        **dict.fromkeys((*_GRID, "Karras", "Exponential", "Beta"), "FlowMatchHeun"),
        "SGM Uniform": "kdiffusion:heun:sgm_uniform",
    },
    "DPM++ 2M": {
        **dict.fromkeys((*_GRID, "SGM Uniform", "DDIM"), "DPMSolverMultistep"),
        "Karras": "kdiffusion:dpmpp_2m:karras",
        "Exponential": "kdiffusion:dpmpp_2m:exponential",
        "Beta": "kdiffusion:dpmpp_2m:beta",
    },
    "UniPC": dict.fromkeys((*_GRID, "SGM Uniform", "DDIM"), "UniPC"),
    "Euler a": {
        **dict.fromkeys(_GRID, "kdiffusion:euler_ancestral:flow"),
        **{s: f"kdiffusion:euler_ancestral:{s.lower().replace(' ', '_')}" for s in ("Karras", "Exponential", "Beta")},
        "SGM Uniform": "kdiffusion:euler_ancestral:sgm_uniform",
    },
    "DPM++ 2M SDE": {
        **dict.fromkeys(_GRID, "kdiffusion:dpmpp_2m_sde:flow"),
        **{s: f"kdiffusion:dpmpp_2m_sde:{s.lower().replace(' ', '_')}" for s in ("Karras", "Exponential", "Beta")},
        "SGM Uniform": "kdiffusion:dpmpp_2m_sde:sgm_uniform",
    },
}


def _described(sampler) -> str:
    if isinstance(sampler, KDiffusionSampler) and sampler.origin is None:
        return sampler.name
    return type(loops.front(sampler)).__name__  # the front's class, whatever form runs it


@pytest.mark.parametrize("base", [FLUX_DEV, SD35], ids=["flux", "sd3"])
def test_every_a1111_pair_on_a_flow_model(base):
    flow = samplers.get_sampler(base)
    for entry in a1111.A1111_SAMPLERS:
        want_row = EXPECTED_FLOW.get(entry.name, {})
        for schedule in schedules.SCHEDULES:
            want = want_row.get(schedule.label)
            if want is None:
                with pytest.raises(ConfigError, match="sampler|schedule") as err:
                    a1111.from_a1111_flow(entry.name, schedule.label, flow)
                named = entry.name in str(err.value) or schedule.label in str(err.value)
                assert named or "exclusive" in str(err.value), (entry.name, schedule.label, str(err.value))
                continue
            got = a1111.from_a1111_flow(entry.name, schedule.label, flow)
            assert _described(got) == want, (entry.name, schedule.label)
            if isinstance(got, KDiffusionSampler):
                assert got.prediction.flow and got.schedule.shift == 3.0
                assert got.schedule.use_dynamic_shifting == bool(base.get("use_dynamic_shifting"))


def test_k_diffusion_pairs_are_built_as_documented():
    """The grid schedules keep the family grid (FlowMatch's for Euler a, DPM-Solver's for DPM++ 2M SDE, as DPM++ 2M);
    the range schedules run on the shifted table with the timestep sigma * T; the A1111 registry names that requests
    carry (`infotext.sampler_id`: "dpmpp_2m_sde", "dpmpp_2m_karras") mean the same pairs."""
    flux = samplers.get_sampler(FLUX_DEV)
    ancestral = kdiffusion_sampler("euler_ancestral", "flow", "flow", base_config=FLUX_DEV)
    assert a1111.from_a1111_flow("Euler a", "Simple", flux) == ancestral
    assert a1111.from_a1111_flow("euler_a", None, flux) == ancestral
    sde = kdiffusion_sampler("dpmpp_2m_sde", "flow", "flow", base_config=FLUX_DEV, grid="solver", timestep="floor")
    assert a1111.from_a1111_flow("DPM++ 2M SDE", "Automatic", flux) == sde
    assert a1111.from_a1111_flow("dpmpp_2m_sde", "Automatic", flux) == sde
    karras = kdiffusion_sampler("dpmpp_2m", "karras", "flow", base_config=FLUX_DEV)
    assert a1111.from_a1111_flow("DPM++ 2M Karras", None, flux) == karras
    assert a1111.from_a1111_flow("dpmpp_2m_karras", None, flux) == karras
    # The registry names of the other A1111 spellings ("Euler Karras" -> "euler_karras", "Heun Karras" ->
    # "heun_karras": what ComfyUI's karras scheduler becomes) keep their diffusers-parity flow samplers.
    for registry, cls in [("euler_karras", "FlowMatchEuler"), ("heun_karras", "FlowMatchHeun")]:
        got = a1111.from_a1111_flow(registry, None, flux)
        assert type(loops.front(got)).__name__ == cls and got.use_karras_sigmas, registry
    assert type(loops.front(a1111.from_a1111_flow("dpmpp_2m", None, flux))).__name__ == "DPMSolverMultistep"
    half = a1111.from_a1111_flow("Euler a", "Karras", flux, eta=0.5)
    assert (half.eta, half.name) == (0.5, "kdiffusion:euler_ancestral:karras:eta=0.5")
    with pytest.raises(ConfigError, match="only eta"):
        a1111.from_a1111_flow("Euler a", "Karras", flux, use_karras_sigmas=True)
    # DPM++ 2M SDE on the grid DPM++ 2M (diffusers' flow DPM-Solver++) runs on.
    dpm = a1111.from_a1111_flow("DPM++ 2M", "Automatic", flux)
    np.testing.assert_allclose(sde.timesteps_for(8, SHAPE), dpm.timesteps_for(8, SHAPE), rtol=0, atol=0)
    # A variance-preserving model's config is refused, not sampled as a flow model.
    with pytest.raises(ConfigError, match="variance-preserving|flow"):
        a1111.from_a1111_flow("Euler a", "Automatic", samplers.get_sampler(SD15))


def test_unsupported_pairs_name_the_sampler_or_schedule():
    flux = samplers.get_sampler(FLUX_DEV)
    with pytest.raises(a1111.UnsupportedSamplerError, match=r"'DPM\+\+ 2M SDE Heun'.*'Euler a'"):
        a1111.from_a1111_flow("DPM++ 2M SDE Heun", "Automatic", flux)
    with pytest.raises(schedules.UnsupportedScheduleError, match=r"'Euler a'.*'DDIM'"):
        a1111.from_a1111_flow("Euler a", "DDIM", flux)
    with pytest.raises(schedules.UnsupportedScheduleError):
        a1111.from_a1111_flow("Euler a", "Align Your Steps", flux)


def _run(sampler, steps: int, model) -> np.ndarray:
    state = sampler.set_timesteps(sampler.create_state(), steps, SHAPE)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32))
    out, _ = loop.denoise(
        model=model,
        sampler=sampler,
        state=state,
        latents=x * sampler.init_noise_sigma(state),
        start=0,
        end=sampler.num_model_calls(steps),
        keys=jax.random.split(jax.random.PRNGKey(3), SHAPE[0]),
        guidance=jnp.ones((SHAPE[0],)),
        cfg=False,
    )
    return np.asarray(out)


def _toy_velocity(x, t):
    t = jnp.asarray(t, jnp.float32)
    return 0.4 * x * jnp.cos(t / 400) + 0.1 * jnp.sin(x) - 0.05


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_euler_a_with_eta_0_is_the_familys_flow_euler(family):
    """The rectified-flow ancestral step with eta = 0 is a deterministic DDIM step, which on a flow path is the Euler
    step: on each family's grid, "Euler a" (eta 0) samples what the family's FlowMatch Euler ("Euler") samples."""
    from sdjax.families.flux.pipeline import flux_sampler
    from sdjax.families.sd3.pipeline import sd3_sampler

    wrap, base = (flux_sampler, FLUX_DEV) if family == "flux" else (sd3_sampler, SD35)
    flow = samplers.get_sampler(base)
    euler = wrap(a1111.from_a1111_flow("Euler", "Automatic", flow))
    ancestral = wrap(a1111.from_a1111_flow("Euler a", "Automatic", flow, eta=0.0))
    assert ancestral.schedule.grid == ("flux" if family == "flux" else "scheduler")
    np.testing.assert_allclose(ancestral.timesteps_for(7, SHAPE), euler.timesteps_for(7, SHAPE), rtol=1e-6)
    want, got = _run(euler, 7, _toy_velocity), _run(ancestral, 7, _toy_velocity)
    assert float(np.abs(want).max()) > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(np.abs(want).max()))
    # eta = 1 (the default): fresh noise each step, another sample.
    noisy = _run(wrap(a1111.from_a1111_flow("Euler a", "Automatic", flow)), 7, _toy_velocity)
    assert float(np.abs(noisy - want).max()) > 1e-2


def test_family_grids_touch_only_flowmatch_grids():
    from sdjax.families.flux.pipeline import flux_sampler
    from sdjax.families.sd3.pipeline import sd3_sampler

    on_scheduler = kdiffusion_sampler("euler", base_config=SD35)
    assert flux_sampler(on_scheduler).schedule.grid == "flux"
    assert sd3_sampler(flux_sampler(on_scheduler)) == on_scheduler
    solver = kdiffusion_sampler("dpmpp_2m_sde", base_config=SD35, grid="solver")
    karras = kdiffusion_sampler("dpmpp_2m", "karras", base_config=SD35)
    for sampler in (solver, karras):
        assert flux_sampler(sampler) is sampler and sd3_sampler(sampler) is sampler


def test_names_round_trip_and_key_the_cache():
    sd = samplers.get_sampler(SD15)
    made = [
        kdiffusion_sampler("dpmpp_2m", "karras", base_config=sd),
        kdiffusion_sampler("dpmpp_2m_sde", "exponential", base_config=sd, eta=0.5),
        kdiffusion_sampler("euler_ancestral", "flow", base_config=FLUX_DEV),
        kd.from_diffusers(samplers.get_sampler("heun_karras", sd)),
    ]
    names = [samplers.name_of(s) for s in made]
    assert names == [
        "kdiffusion:dpmpp_2m:karras",
        "kdiffusion:dpmpp_2m_sde:exponential:eta=0.5",
        "kdiffusion:euler_ancestral:flow",
        "kdiffusion:heun:karras",
    ]
    for sampler, name in zip(made, names):
        assert samplers.get_sampler(name, sampler) == sampler  # on its own model: the same object
        assert samplers.get_sampler(sampler) is sampler and samplers.is_sampler(sampler)
    assert len({hash(s) for s in made}) == len(made)
    # The infotext carries the name as the sampler (a default scheduler's name, e.g. `from_pretrained(scheduler=)`).
    from sdjax import metadata

    written = metadata.GenerationRequest(prompt="a cat", steps=5, sampler=names[1]).images()[0].infotext()
    assert f'Sampler: "{names[1]}",' in written  # quoted: the value holds colons
    assert metadata.parameters_from_text(written).sampler == names[1]
    # A name on a diffusers config builds the documented defaults for that model.
    assert samplers.get_sampler("kdiffusion:euler_ancestral:karras", sd) == kdiffusion_sampler(
        "euler_ancestral", "karras", base_config=SD15
    )
    # Swapping away from a k-diffusion scheduler starts from the model's keys it knows.
    swapped = samplers.get_sampler("euler_a", made[0])
    assert type(loops.front(swapped)).__name__ == "EulerAncestral" and swapped.beta_schedule == "scaled_linear"
    assert type(loops.front(samplers.get_sampler("flow_dpmpp_2m", made[2]))).__name__ == "DPMSolverMultistep"
    with pytest.raises(ConfigError, match="kdiffusion:RULE:SCHEDULE"):
        samplers.get_sampler("kdiffusion:euler", sd)
    with pytest.raises(ConfigError, match="step rule"):
        samplers.get_sampler("kdiffusion:lms:karras", sd)
    with pytest.raises(ConfigError, match="no schedule"):
        samplers.get_sampler(made[0], schedule="Karras")


def test_generate_takes_a_k_diffusion_sampler_on_a_tiny_sd_model():
    """`generate(sampler=KDiffusionSampler)` on SD: the k-diffusion form of DPM++ 2M Karras gives the latents of
    the diffusers-parity "dpmpp_2m_karras"; `pipe.scheduler = ...` runs the same compiled program, and its
    `default_sampler` name resolves to it; another k-diffusion sampler compiles another program."""
    from sdjax.pipelines.presets import build_pipeline

    pipe, params = build_pipeline("tiny", jnp.float32)
    kw = dict(steps=5, seed=0, output_type="latent", height=32, width=32, params=params)
    want = np.asarray(pipe.generate("a cat", sampler="dpmpp_2m_karras", **kw))
    mine = kd.from_diffusers(samplers.get_sampler("dpmpp_2m_karras", pipe.scheduler))
    pipe.validate(sampler=mine)
    got = np.asarray(pipe.generate("a cat", sampler=mine, **kw))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    compiles = pipe.generator.cache.stats.compiles
    # The name on the model's own (PNDM) config: the k-diffusion defaults for it (timesteps interpolated in log sigma,
    # where the form of diffusers' DPM-Solver rounds them), so a name describes, the object is exact.
    by_name = kdiffusion_sampler("dpmpp_2m", "karras", base_config=pipe.scheduler)
    assert pipe._sampler(samplers.name_of(mine)) == by_name != mine
    default, pipe.scheduler = pipe.scheduler, mine
    try:
        assert pipe.default_sampler == "kdiffusion:dpmpp_2m:karras"
        assert pipe._sampler(pipe.default_sampler) == mine
        as_scheduler = np.asarray(pipe.generate("a cat", **kw))
        assert type(loops.front(pipe._sampler("euler"))).__name__ == "Euler"  # a swap from the k-diffusion scheduler
    finally:
        pipe.scheduler = default
    assert pipe.generator.cache.stats.compiles == compiles
    np.testing.assert_array_equal(as_scheduler, got)
    ancestral = kdiffusion_sampler("euler_ancestral", "karras", base_config=pipe.scheduler)
    other = np.asarray(pipe.generate("a cat", sampler=ancestral, **kw))
    assert pipe.generator.cache.stats.compiles == compiles + 1
    assert np.isfinite(other).all() and float(np.abs(other - got).max()) > 1e-3
    with pytest.raises(TypeError, match="sampler must be"):
        pipe.validate(sampler=3)


def test_sd3_takes_k_diffusion_samplers_on_its_grid():
    """SD 3 passes a k-diffusion sampler object or name through, its "flow" schedule on diffusers' own grid. The
    pipeline's sampler lookup only reads `scheduler`, so an instance without weights serves."""
    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline, sd3_sampler

    pipe = StableDiffusion3Pipeline.__new__(StableDiffusion3Pipeline)
    pipe.scheduler = sd3_sampler(samplers.get_sampler(SD35))
    ancestral = kdiffusion_sampler("euler_ancestral", "flow", "flow", base_config=SD35)
    on_flux_grid = kdiffusion_sampler("euler_ancestral", "flow", base_config=SD35, grid="flux")
    assert pipe._sampler(on_flux_grid) == ancestral and ancestral.schedule.grid == "scheduler"
    assert pipe._sampler(samplers.name_of(ancestral)) == ancestral
    assert not ancestral.schedule.use_dynamic_shifting
    karras = kdiffusion_sampler("dpmpp_2m_sde", "karras", base_config=SD35)
    assert pipe._sampler(karras) is karras
    pipe.scheduler = karras  # a k-diffusion scheduler: None and its own name give it back
    assert pipe._sampler(None) is karras and pipe._sampler(pipe.default_sampler) == karras
