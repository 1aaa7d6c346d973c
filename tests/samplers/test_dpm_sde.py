"""DPM++ SDE's noise: the virtual Brownian tree (`sdjax.samplers.dpm_sde.brownian_value`) and `draw_noise`.

The tree cannot reproduce torchsde's numbers (another random generator), so it is tested by what defines a
Brownian motion -- increments over an interval are N(0, length), increments over disjoint intervals are
independent, an increment equals the sum of the increments of its parts, nested increments correlate as
sqrt(shorter / longer) -- and by keying (per image, batch-independent, deterministic under jit). The sampler's
step is tested against diffusers with injected noise in test_samplers.py; here diffusers' loop gets sdjax's tree
as its noise sampler, which checks that `draw_noise` picks the sigma interval diffusers asks for at every call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import loops
import numpy as np
import pytest
from test_samplers import SD1, SD2, assert_trajectory_close, torch_scheduler

from sdjax import rng, samplers
from sdjax.samplers.dpm_sde import brownian_noise, brownian_value

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SHAPE = (4, 64, 64)  # 16384 draws per image and interval
LO, HI = 0.0292, 14.6146  # SD's sigma range


@pytest.fixture(scope="module")
def keys():
    return jax.random.key_data(rng.image_keys(jax.random.key(11), 8))


@pytest.fixture(scope="module")
def noise_fn():
    return jax.jit(lambda k, a, b: brownian_noise(k, a, b, LO, HI, SHAPE))


# brownian_noise with the sample shape static: eager calls would retrace the tree's loop every time.
jitted_noise = jax.jit(brownian_noise, static_argnums=5)


def _corr(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(np.corrcoef(a, b)[0, 1])


@pytest.mark.parametrize("a, b", [(14.6146, 0.0292), (1.0, 0.5), (0.05, 0.0493), (7.3, 7.299)])
def test_increment_is_standard_normal_after_scaling(keys, noise_fn, a, b):
    """(W(b) - W(a)) / sqrt(|b - a|) ~ N(0, 1) over the whole domain, a mid-size, a short and a tiny interval."""
    z = np.asarray(noise_fn(keys, a, b), np.float64)  # 8 images x 16384 draws
    assert z.shape == (8,) + SHAPE
    assert abs(z.mean()) < 0.02 and abs(z.var() - 1) < 0.03, (z.mean(), z.var())
    kurtosis = ((z - z.mean()) ** 4).mean() / z.var() ** 2
    assert abs(kurtosis - 3) < 0.1


def test_increments_add_up_when_the_interval_is_split(keys, noise_fn):
    a, b, c = 9.0, 2.5, 0.3
    whole = np.asarray(noise_fn(keys, a, c)) * np.sqrt(a - c)
    parts = np.asarray(noise_fn(keys, a, b)) * np.sqrt(a - b) + np.asarray(noise_fn(keys, b, c)) * np.sqrt(b - c)
    np.testing.assert_allclose(whole, parts, atol=2e-5)


def test_disjoint_increments_are_independent_and_nested_ones_correlate(keys, noise_fn):
    a, b, c = 5.0, 2.0, 1.0
    first, second = noise_fn(keys, a, b), noise_fn(keys, b, c)
    assert abs(_corr(first, second)) < 0.02
    whole = noise_fn(keys, a, c)
    expect = np.sqrt((a - b) / (a - c))  # Cov(W(a,b), W(a,c)) / sqrt(Var Var)
    assert abs(_corr(first, whole) - expect) < 0.02
    # DPM++ SDE's two stages of a step: [sigma, sigma_mid] inside [sigma, sigma_next].
    sigma, sigma_next = 3.0, 2.0
    mid = np.sqrt(sigma * sigma_next)
    stage1, stage2 = noise_fn(keys, sigma, mid), noise_fn(keys, sigma, sigma_next)
    assert abs(_corr(stage1, stage2) - np.sqrt((sigma - mid) / (sigma - sigma_next))) < 0.02


def test_tree_is_keyed_per_image(keys, noise_fn):
    both = np.asarray(noise_fn(keys, 4.0, 3.0))
    assert abs(_corr(both[0], both[1])) < 0.03  # different images: independent
    alone = np.asarray(noise_fn(keys[5:6], 4.0, 3.0))
    np.testing.assert_array_equal(alone[0], both[5])  # an image's noise does not depend on its batch
    np.testing.assert_array_equal(np.asarray(noise_fn(keys, 4.0, 3.0)), both)  # deterministic
    # The direction of the interval only flips the sign of W(b) - W(a), the normalised value does not change.
    np.testing.assert_allclose(np.asarray(noise_fn(keys, 3.0, 4.0)), -both, atol=1e-6)


def test_brownian_value_is_a_bridge_between_its_ends():
    key = jax.random.key(3)
    at_start = brownian_value(key, LO, LO, HI, (1000,))
    np.testing.assert_array_equal(np.asarray(at_start), 0)
    end = np.asarray(brownian_value(key, HI, LO, HI, (200_000,)), np.float64)
    assert abs(end.var() / (HI - LO) - 1) < 0.02


# ------------------------------------------------------------------------------------------ draw_noise
def test_draw_noise_follows_the_stages():
    """First stage: [sigma_i, sigma_mid]; second: [sigma_i, sigma_next]; the last step (to sigma 0): no noise."""
    sampler = samplers.get_sampler("dpmpp_sde", SD1)
    n, shape = 4, (2, 4, 8, 8)
    state = sampler.set_timesteps(sampler.create_state(), n, shape)
    keys = jax.random.key_data(rng.image_keys(jax.random.key(0), 2))
    sig = np.asarray(state.sigmas)
    lo, hi = sig[sig > 0].min(), sig.max()
    x = jnp.zeros(shape)
    draw = jax.jit(lambda i, st: sampler.draw_noise(keys, i, st, shape))
    for i in range(sampler.num_model_calls(n)):
        noise = draw(i, state)
        first = i % 2 == 0
        sigma = sig[i] if first else sig[i - 1]
        sigma_next = sig[i + 1] if first else sig[i]
        if sigma_next == 0:
            np.testing.assert_array_equal(np.asarray(noise), 0)
        else:
            target = np.exp(-(-np.log(sigma) + (np.log(sigma) - np.log(sigma_next)) * 0.5)) if first else sigma_next
            expect = jitted_noise(keys, sigma, target, lo, hi, shape[1:])
            np.testing.assert_allclose(np.asarray(noise), np.asarray(expect), rtol=1e-4, atol=1e-4)
        _, state = sampler.step(state, x, i, x + 1.0, noise=noise)
    with pytest.raises(ValueError, match="2 keys for a batch of 3"):
        sampler.draw_noise(keys, 0, state, (3, 4, 8, 8))


@pytest.mark.parametrize("base, extra", [(SD1, {}), (SD2, {"use_karras_sigmas": True})], ids=["eps", "v-karras"])
def test_draw_noise_uses_the_intervals_diffusers_asks_for(base, extra):
    """diffusers' DPMSolverSDEScheduler with a noise sampler that records the sigma interval it asks for at each
    call: the tree's domain and the intervals equal sdjax's (`noise_interval`, no noise on the last step to sigma
    0); what sdjax's loop drew with `draw_noise` is the tree's increment over that interval (to the roughness of a
    Brownian path across a float32 ulp of its ends); fed that noise, diffusers' trajectory equals sdjax's."""
    import dataclasses
    import importlib

    import torch

    sampler = samplers.get_sampler("dpmpp_sde", base, **extra)
    n = 6
    x0, _ = loops.inputs(1)
    keys = jax.random.key_data(rng.image_keys(jax.random.key(21), x0.shape[0]))
    _, sigma0, traj, drawn = jax.device_get(loops.run_jax_drawn(sampler, n, x0, keys))
    calls = sampler.num_model_calls(n)
    state = sampler.set_timesteps(sampler.create_state(), n, x0.shape)
    ours = []  # sdjax's interval at each call (the stages alternate from the first)
    for i in range(calls):
        staged = dataclasses.replace(state, second=jnp.float32(i % 2))
        ours.append(tuple(float(v) for v in sampler.noise_interval(staged, i)))
    sig = np.asarray(state.sigmas)
    lo, hi = float(sig[sig > 0].min()), float(sig.max())

    module = importlib.import_module("diffusers.schedulers.scheduling_dpmsolver_sde")
    domains, asked = [], []

    class RecordingTree:
        def __init__(self, x, sigma_min, sigma_max, seed=None):
            domains.append((sigma_min, sigma_max))

        def __call__(self, sigma, sigma_next):
            asked.append((float(sigma), float(sigma_next)))
            return torch.from_numpy(drawn[len(asked) - 1].copy())

    original = module.BrownianTreeNoiseSampler
    module.BrownianTreeNoiseSampler = RecordingTree
    try:
        ref = torch_scheduler(sampler)
        ref.set_timesteps(n)
        ref.set_begin_index(0)
        x = torch.from_numpy(x0.copy()) * float(sigma0)
        out = []
        for t in ref.timesteps:
            eps = loops.fake_model_torch(ref.scale_model_input(x, t), t)
            x = ref.step(eps, t, x).prev_sample
            out.append(x.numpy().copy())
    finally:
        module.BrownianTreeNoiseSampler = original
    np.testing.assert_allclose(domains, [(lo, hi)], rtol=1e-6)  # torch's sigmas are within an ulp of ours
    assert len(asked) == calls - 1 and ours[-1][0] == ours[-1][1]  # the last call (Euler to 0) draws nothing
    np.testing.assert_allclose(asked, ours[:-1], rtol=1e-6)
    np.testing.assert_array_equal(drawn[-1], 0)
    for i, (a, b) in enumerate(asked):
        tree = np.asarray(jitted_noise(keys, a, b, lo, hi, tuple(x0.shape[1:])))
        np.testing.assert_allclose(drawn[i], tree, atol=5e-3, err_msg=f"call {i}")
    assert_trajectory_close(traj, np.stack(out), x0 * sigma0, "dpmpp_sde with sdjax's tree")
