"""The methods the generation core calls on every sampler, against diffusers (PyTorch, float32).

- `order`: diffusers' `scheduler.order` (img2img starts at model call `t_start * order`);
- `timesteps_for(n)`: diffusers' `scheduler.timesteps` after `set_timesteps(n)`, one per model call;
- `add_noise_at(state, x0, noise, index)`: diffusers' `add_noise(x0, noise, timesteps[index:index + 1])` after
  `set_begin_index(index)` -- checked at several indices, including Karras schedules whose rounded timesteps
  repeat (where a lookup by value would pick another step) and the end of the schedule where diffusers has a
  sigma there;
- `draw_noise(keys, i, state, shape)`: standard normal noise from each image's key (`sdjax.rng.step_noise`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import loops
import numpy as np
import pytest
from test_flow_match import FLUX_SCHNELL, SD35
from test_samplers import SD1, SD2, SDXL, torch_scheduler

from sdjax import rng, samplers

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*expects a model distilled for it:UserWarning"),
]

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

# (registry name, base config, overrides, steps, whether rounded Karras timesteps repeat in that schedule).
CASES = [
    ("pndm", SD1, {}, 20, True),  # PLMS calls the model twice at its second timestep
    ("pndm_prk", SD2, {}, 20, True),  # PRK's half steps repeat timesteps too
    ("ddim", SD2, {}, 20, False),
    ("ddpm", SD1, {"timestep_spacing": "trailing"}, 20, False),
    ("euler", SDXL, {}, 20, False),
    ("euler_karras", SDXL, {}, 50, False),
    ("euler_a", SD1, {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}, 20, False),
    ("lms_karras", SD1, {}, 50, False),
    ("dpmpp_2m", SD1, {}, 20, False),
    ("dpmpp_2m_karras", SD1, {}, 50, True),
    ("dpmpp_2m_sde_karras", SD1, {"final_sigmas_type": "sigma_min"}, 50, True),
    ("heun", SDXL, {}, 10, True),  # two model calls per step: timesteps repeat by design
    ("dpm2_karras", SD1, {}, 30, False),
    ("dpm2_a", SD2, {}, 8, None),  # its last midpoint may round onto an earlier timestep (torch build dependent)
    ("dpmpp_sde_karras", SD1, {}, 8, False),
    ("dpmpp_2s_a_karras", SD1, {}, 50, True),
    ("unipc", SD1, {"use_karras_sigmas": True}, 50, True),
    ("deis", SD2, {}, 20, False),
    ("lcm", SD1, {}, 4, False),
    ("tcd", SD1, {}, 6, False),
    # Flow models (static shift: diffusers' own `set_timesteps(n)`; the shape-dependent schedules and Heun, whose
    # diffusers `scale_noise` keeps a stale step index, are in test_flow_match.py).
    ("flow_euler", SD35, {}, 20, False),
    ("flow_dpmpp_2m", SD35, {}, 20, False),
    ("flow_unipc", FLUX_SCHNELL, {}, 20, False),
]


def _sigma_space(ref) -> bool:
    return hasattr(ref, "sigmas")


@pytest.fixture(scope="module")
def add_noise_at():
    return jax.jit(lambda sampler, state, x0, noise, i: sampler.add_noise_at(state, x0, noise, i), static_argnums=0)


@pytest.mark.parametrize("name, base, extra, n, repeats", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_order_timesteps_and_add_noise_at_match_diffusers(name, base, extra, n, repeats, add_noise_at):
    sampler = samplers.get_sampler(name, base, **extra)
    ref = torch_scheduler(sampler)
    ref.set_timesteps(n)
    calls = sampler.num_model_calls(n)

    assert sampler.order == ref.order
    timesteps = sampler.timesteps_for(n)
    assert timesteps.dtype == np.float32 and timesteps.shape == (calls,)
    # DPM2's midpoint timesteps come through float32 log-sigma interpolation (DPM2 a's also through a cancelling
    # sigma_down; see test_samplers.test_timesteps_and_sigmas_match_diffusers): a few float32 ulps apart.
    atol = {"dpm2_a": 2e-2, "dpm2": 1e-4}.get(name.removesuffix("_karras"), 0)
    np.testing.assert_allclose(timesteps, ref.timesteps.numpy().astype(np.float32), rtol=1e-6, atol=atol)
    timesteps[0] = -1  # a copy: the cached schedule is not touched
    assert sampler.timesteps_for(n)[0] != -1

    x0, noises = loops.inputs(1, seed=5)
    noise = noises[0]
    state = sampler.set_timesteps(sampler.create_state(), n, x0.shape)
    values = ref.timesteps.numpy()
    repeated = [i for i in range(1, calls) if values[i] in values[:i]]
    if repeats is not None:
        assert bool(repeated) == repeats, repeated
    indices = sorted({0, 1, calls // 2, calls - 1, *repeated[:2]})
    if _sigma_space(ref):
        indices.append(calls)  # diffusers holds the final sigma there (begin_index = calls)
    for index in indices:
        if hasattr(ref, "set_begin_index"):
            ref.set_begin_index(index)
        t = ref.timesteps[min(index, calls - 1) :][:1]
        if hasattr(ref, "add_noise"):
            expect = ref.add_noise(torch.from_numpy(x0), torch.from_numpy(noise), t).numpy()
        else:  # flow matching: diffusers' `scale_noise(sample, timestep, noise)`
            expect = ref.scale_noise(torch.from_numpy(x0), t, torch.from_numpy(noise)).numpy()
        ours = np.asarray(add_noise_at(sampler, state, x0, noise, jnp.int32(index)))
        scale = float(np.abs(expect).max())
        np.testing.assert_allclose(ours, expect, rtol=1e-6, atol=1e-6 * scale, err_msg=f"index {index}")
    if not _sigma_space(ref):  # no step left: diffusers' pipelines refuse, sdjax returns the sample itself
        np.testing.assert_array_equal(np.asarray(add_noise_at(sampler, state, x0, noise, jnp.int32(calls))), x0)


def test_add_noise_at_end_of_schedule_is_clean_for_sigma_samplers(add_noise_at):
    sampler = samplers.get_sampler("euler", SDXL)
    state = sampler.set_timesteps(sampler.create_state(), 4, (1, 4, 2, 2))
    x0, eps = jnp.full((1, 4, 2, 2), 0.5), jnp.ones((1, 4, 2, 2))
    np.testing.assert_array_equal(np.asarray(add_noise_at(sampler, state, x0, eps, jnp.int32(4))), np.asarray(x0))


def test_add_noise_at_needs_set_timesteps():
    sampler = samplers.get_sampler("ddim", SD1)
    with pytest.raises(ValueError, match="set_timesteps"):
        sampler.add_noise_at(sampler.create_state(), jnp.ones(3), jnp.ones(3), 0)


def test_draw_noise_is_the_per_image_step_noise():
    sampler = samplers.get_sampler("euler_a", SD1)
    state = sampler.set_timesteps(sampler.create_state(), 5, (3, 4, 2, 2))
    keys = rng.image_keys(jax.random.key(7), 3)
    raw = jax.random.key_data(keys)
    for i in (0, 4):
        noise = sampler.draw_noise(raw, jnp.int32(i), state, (3, 4, 2, 2))
        assert noise.shape == (3, 4, 2, 2) and noise.dtype == jnp.float32
        np.testing.assert_array_equal(noise, rng.step_noise(raw, i, (4, 2, 2)))
        np.testing.assert_array_equal(noise, sampler.draw_noise(keys, i, state, (3, 4, 2, 2)))  # typed keys
    # Image 1's noise does not depend on the batch it is in.
    alone = sampler.draw_noise(raw[1:2], 2, state, (1, 4, 2, 2))
    np.testing.assert_array_equal(alone[0], sampler.draw_noise(raw, 2, state, (3, 4, 2, 2))[1])
    assert not np.allclose(
        sampler.draw_noise(raw, 0, state, (3, 4, 2, 2)), sampler.draw_noise(raw, 1, state, (3, 4, 2, 2))
    )
    with pytest.raises(ValueError, match="3 keys for a batch of 2"):
        sampler.draw_noise(raw, 0, state, (2, 4, 2, 2))
