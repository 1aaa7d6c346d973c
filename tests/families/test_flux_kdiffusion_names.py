"""A1111/Forge sampler names that only the k-diffusion form runs on Flux ("Euler a": rectified-flow ancestral;
"DPM++ 2M SDE"), through the faces: `sdjax generate --sampler ...` and `pipe.generate(sampler=...)` on a tiny random
Flux dev model (tests/flux_reference.py) give the image of the `KDiffusionSampler` built by hand with the rule,
schedule, grid and timestep mode docs/samplers.md documents for the name; a pair with no flow form is refused naming
the sampler, before anything compiles.
"""

import flux_reference
import numpy as np
import pytest
import t5_reference

from sdjax.samplers import KDiffusionSampler, kdiffusion_sampler

PROMPT = "a red circle on a blue background"
SIZE = 32  # 16x16 latents, 64 image tokens
STEPS = 3
# The CLI's T5 length for dev (512); the Python calls use it too so that equal samplers share one program.
SAME = dict(steps=STEPS, height=SIZE, width=SIZE, seed=11, max_sequence_length=512, guidance_scale=2.5)


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    from sdjax.families.flux.pipeline import FluxPipeline

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("tiny-flux-dev")
    flux_reference.flux_pipeline("dev", seed=0, tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    pipe, _ = FluxPipeline.from_pretrained(str(folder))
    pipe.folder = folder
    return pipe


def _cli(pipe, out, *sampler_args):
    from typer.testing import CliRunner

    from sdjax import cli

    args = ["generate", PROMPT, "--model", str(pipe.folder), "--steps", str(STEPS), "--width", str(SIZE)]
    args += ["--height", str(SIZE), "--seed", "11", "--distilled-guidance", "2.5", "--out", str(out), *sampler_args]
    return CliRunner().invoke(cli.app, args)


def test_cli_dpmpp_2m_sde_on_flux_is_the_k_diffusion_sampler(flux_dev, tmp_path):
    """`--sampler "DPM++ 2M SDE"`: DPM-Solver++(2M) SDE on DPM-Solver's flow grid (the one "DPM++ 2M" runs on, with
    truncated timesteps), the model's dynamic shift; the infotext keeps the A1111 name."""
    from PIL import Image

    from sdjax import infotext, metadata

    result = _cli(flux_dev, tmp_path, "--sampler", "DPM++ 2M SDE")
    assert result.exit_code == 0, result.output
    (png,) = sorted(tmp_path.glob("*.png"))
    params = metadata.parameters_from_text(infotext.read_parameters(png))
    assert infotext.sampler_display_name(params.sampler) == "DPM++ 2M SDE"
    got = np.asarray(Image.open(png).convert("RGB"), np.int16)
    by_hand = kdiffusion_sampler(
        "dpmpp_2m_sde", "flow", "flow", base_config=flux_dev.scheduler, grid="solver", timestep="floor"
    )
    assert by_hand.schedule.use_dynamic_shifting
    want = np.asarray(flux_dev.generate(PROMPT, sampler=by_hand, **SAME)[0], np.int16)
    assert got.std() > 5 and np.abs(got - want).max() <= 1
    compiles = flux_dev.generator.cache.stats.compiles
    named = np.asarray(flux_dev.generate(PROMPT, sampler="DPM++ 2M SDE", **SAME)[0], np.int16)
    assert flux_dev.generator.cache.stats.compiles == compiles  # the name is that very sampler: the same program
    np.testing.assert_array_equal(named, want)


def test_python_api_euler_a_on_flux_is_the_k_diffusion_sampler(flux_dev):
    """`sampler="Euler a"`: the rectified-flow ancestral rule on FluxPipeline's sigma grid, as flow Euler samples;
    the fresh noise per step makes another image than "DPM++ 2M SDE"."""
    sampler = flux_dev._sampler("Euler a")
    assert isinstance(sampler, KDiffusionSampler) and sampler.name == "kdiffusion:euler_ancestral:flow"
    by_hand = kdiffusion_sampler("euler_ancestral", "flow", "flow", base_config=flux_dev.scheduler, grid="flux")
    assert sampler == by_hand
    np.testing.assert_allclose(
        sampler.sigmas_for(STEPS, (1, 16, 16, 16))[:-1],
        np.asarray(flux_dev._sampler("Euler").tables(STEPS, (1, 16, 16, 16))["sigmas"])[:-1],
        rtol=1e-6,
    )
    named = np.asarray(flux_dev.generate(PROMPT, sampler="Euler a", **SAME)[0], np.int16)
    compiles = flux_dev.generator.cache.stats.compiles
    direct = np.asarray(flux_dev.generate(PROMPT, sampler=by_hand, **SAME)[0], np.int16)
    assert flux_dev.generator.cache.stats.compiles == compiles
    np.testing.assert_array_equal(direct, named)
    assert named.std() > 5


def test_pairs_without_a_flow_form_are_refused_by_name(flux_dev, tmp_path):
    compiles = flux_dev.generator.cache.stats.compiles
    with pytest.raises(ValueError, match=r"DPM\+\+ 2M SDE Heun"):
        flux_dev.generate(PROMPT, sampler="DPM++ 2M SDE Heun", **SAME)
    with pytest.raises(ValueError, match=r"Euler a.*DDIM"):
        flux_dev.generate(PROMPT, sampler="Euler a DDIM", **SAME)
    assert flux_dev.generator.cache.stats.compiles == compiles
    result = _cli(flux_dev, tmp_path, "--sampler", "DPM++ 2M SDE Heun")
    assert result.exit_code != 0 and "DPM++ 2M SDE Heun" in result.output, result.output
    assert not list(tmp_path.glob("*.png"))
