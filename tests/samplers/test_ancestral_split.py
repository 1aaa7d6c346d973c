"""The ancestral samplers' split of sigma_next into sigma_down and sigma_up stays finite where float32 cancels.

With few steps on a linear-beta schedule (2 steps: sigma 157.4 -> 0.0100013) sigma_to^2 - sigma_up^2 rounds to
<= 0 in float32 and diffusers' sqrt gives NaN (its EulerAncestral and KDPM2Ancestral do); the exact value is
sigma_to^2 / sigma_from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import samplers
from sdjax.samplers.common import ancestral_down

EMBEDDED_LIKE = {
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "timestep_spacing": "linspace",
    "steps_offset": 1,
}


def test_ancestral_down_is_the_exact_split():
    sigma_from = np.array([157.40727, 14.6, 2.0], np.float32)
    sigma_to = np.array([0.0100013, 9.0, 0.0], np.float32)
    up = (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** np.float32(0.5)
    exact = sigma_to.astype(np.float64) ** 2 / sigma_from.astype(np.float64)  # sqrt(s_to^4 / s_from^2)
    for xp in (np, jnp):
        down = np.asarray(ancestral_down(xp.asarray(sigma_from), xp.asarray(sigma_to), xp.asarray(up), xp))
        assert np.isfinite(down).all()
        np.testing.assert_allclose(down, exact, rtol=2e-3, atol=0)
        # where float32 does not cancel, the value is diffusers' formula bit for bit
        np.testing.assert_array_equal(down[1], np.float32(np.sqrt(sigma_to[1] ** 2 - up[1] ** 2)))


@pytest.mark.parametrize("name", ["Euler a", "DPM2 a", "DPM++ SDE", "DPM++ 2S a"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_ancestral_samplers_stay_finite_with_few_steps(name, steps):
    sampler = samplers.get_sampler(name, base_config={"_class_name": "DDIMScheduler", **EMBEDDED_LIKE})
    shape = (1, 4, 4, 4)
    state = sampler.set_timesteps(sampler.create_state(), steps, shape)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape, np.float32)) * float(state.sigmas[0])
    calls = len(np.asarray(state.timesteps))
    step = jax.jit(sampler.step)  # as in a program: XLA's fusion is where Euler a's difference went negative
    for i in range(calls):
        model_in = sampler.scale_model_input(state, x, i)
        assert np.isfinite(np.asarray(model_in)).all(), (name, steps, i)
        v = jnp.asarray(rng.standard_normal(shape, np.float32))
        noise = jnp.asarray(rng.standard_normal(shape, np.float32))
        x, state = step(state, v, i, x, noise=noise)
        assert np.isfinite(np.asarray(x)).all(), (name, steps, i)
