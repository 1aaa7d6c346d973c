"""Swapping the sampler of a real model keeps what diffusers' `X.from_config(model_scheduler.config)` keeps.

Every registry sampler x every distinct released scheduler config (the embedded config sets in
`src/sdjax/assets/configs`, copied from the released repos): the model's scheduler is loaded as from_pretrained
does, the sampler is swapped in by name, and the result must equal diffusers' swap, key by key and step by step.
The regression this guards: SD 1.5's PNDM config holds `clip_sample: false` (PNDM ignores it), and DDIM swapped in
clipped x0 to [-1, 1] anyway; SD 2.1's DDIM config holds `skip_prk_steps: true`, and PNDM ran the PRK warm-up.
"""

import json
from pathlib import Path

import jax
import loops
import pytest
from test_samplers import assert_trajectory_close, diffusers_nan_last

from sdjax import samplers

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # numpy 2 `__array__` notes from diffusers
    pytest.mark.filterwarnings("ignore:.*expects a model distilled for it:UserWarning"),  # LCM/TCD on SD configs
]

CONFIGS = Path(__file__).resolve().parents[2] / "src" / "sdjax" / "assets" / "configs"
FAMILIES = ["sd15", "sd21", "sdxl-base"]
# Released configs that swap exactly as one above (`test_same_config_as` checks it): sd21-base is sd15's config with
# the default `prediction_type` written out, sdxl-refiner's file is sdxl-base's.
SAME_AS = {"sd21-base": "sd15", "sdxl-refiner": "sdxl-base"}
STEPS = 5


def _raw(family: str) -> dict:
    return json.loads((CONFIGS / family / "scheduler" / "scheduler_config.json").read_text())


def _torch_swap(name: str, raw: dict):
    import diffusers

    cls, fixed = samplers.SAMPLERS[name]
    loaded = getattr(diffusers, raw["_class_name"]).from_config(raw)  # what from_pretrained holds
    return getattr(diffusers, cls.diffusers_class).from_config(loaded.config, **fixed)


def _norm(v):
    return tuple(v) if isinstance(v, list) else v


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(samplers.SAMPLERS))
def test_swap_equals_diffusers_from_config(family, name):
    raw = _raw(family)
    loaded = samplers.get_sampler(raw)
    ours = samplers.get_sampler(name, base_config=loaded)
    ref = _torch_swap(name, raw)
    for key in loops.front(ours).config_keys():
        if key in ref.config:
            assert _norm(getattr(ours, key)) == _norm(ref.config[key]), (family, name, key)
    x0, noises = loops.inputs(ours.num_model_calls(STEPS))
    _, sigma, traj = jax.device_get(loops.run_jax(ours, STEPS, x0, noises))
    _, _, traj_ref = loops.run_torch(ref, STEPS, x0, noises, float(sigma))
    assert_trajectory_close(traj, traj_ref, x0 * sigma, f"{family} {name}", nan_last=diffusers_nan_last(ours))


@pytest.mark.parametrize("family, same_as", sorted(SAME_AS.items()))
def test_same_config_as(family, same_as):
    """Every sampler swapped into `family`'s config is, in diffusers and in sdjax, the one swapped into `same_as`'s."""

    def public(config):
        return {k: v for k, v in dict(config).items() if not k.startswith("_")}

    assert _raw(family)["_class_name"] == _raw(same_as)["_class_name"]
    for name in samplers.SAMPLERS:
        assert public(_torch_swap(name, _raw(family)).config) == public(_torch_swap(name, _raw(same_as)).config), name
        ours = [samplers.get_sampler(name, base_config=samplers.get_sampler(_raw(f))) for f in (family, same_as)]
        assert ours[0] == ours[1], name


def test_the_two_reported_cases():
    sd15_ddim = samplers.get_sampler("ddim", base_config=samplers.get_sampler(_raw("sd15")))
    assert sd15_ddim.clip_sample is False
    sd21_pndm = samplers.get_sampler("pndm", base_config=samplers.get_sampler(_raw("sd21")))
    assert sd21_pndm.skip_prk_steps is True and sd21_pndm.prediction_type == "v_prediction"
    # A chain keeps the keys too, as diffusers' hidden config does: PNDM -> Euler -> DDIM.
    chain = samplers.get_sampler(
        "ddim", base_config=samplers.get_sampler("euler", base_config=samplers.get_sampler(_raw("sd15")))
    )
    assert chain.clip_sample is False


def test_a_sampler_object_or_config_is_used_as_given():
    """`from_pretrained(path, scheduler=obj)` (diffusers' API) with an object or a whole config dict."""
    base = samplers.get_sampler(_raw("sd15"))
    mine = samplers.get_sampler("euler_a", base_config=base)
    assert samplers.get_sampler(mine, base_config=base) is mine
    cfg = {**_raw("sd21"), "_class_name": "EulerDiscreteScheduler"}
    built = samplers.get_sampler(cfg, base_config=base)
    assert type(loops.front(built)).__name__ == "Euler" and built.prediction_type == "v_prediction"
