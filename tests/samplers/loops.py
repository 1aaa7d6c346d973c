"""The same sampling loop in diffusers (PyTorch, float32) and in sdjax (one jitted `lax.fori_loop`).

The model is a deterministic stand-in, `eps = 0.3 x cos(t / 300) + 0.1 sin(x)`, evaluated identically in both
frameworks on the scaled model input and the timestep the sampler feeds it. Stochastic samplers get prescribed
noise: in diffusers by replacing the scheduler module's `randn_tensor` with a function that returns the noise
of the current step.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np

SHAPE = (2, 4, 8, 8)
# SD 1.5's scheduler_config.json (PNDM, as the released model ships it), the base most sampler tests swap from
SD15 = {
    "_class_name": "PNDMScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "steps_offset": 1,
    "skip_prk_steps": True,
    "set_alpha_to_one": False,
    "clip_sample": False,
}


def tables(sampler, n: int, shape=SHAPE) -> dict[str, np.ndarray]:
    """The per-model-call tables ("timesteps", "sigmas" ending in the final sigma) of a diffusers-parity sampler or
    of a k-diffusion-form one (what the diffusers-config front now hands out for most configs)."""
    if hasattr(sampler, "prediction"):  # a KDiffusionSampler
        return sampler.tables(n, shape)
    shaped = "shape" in inspect.signature(sampler._tables).parameters
    return sampler._tables(n, shape) if shaped else sampler._tables(n)


def front(sampler):
    """The diffusers-parity config object a sampler was built from (itself for one that is that object)."""
    return getattr(sampler, "origin", None) or sampler


def fake_model_torch(x, t):
    import torch

    t = torch.as_tensor(t).to(torch.float32)
    return 0.3 * x * torch.cos(t / 300) + 0.1 * torch.sin(x)


def fake_model_jax(x, t):
    t = jnp.asarray(t, jnp.float32)
    return 0.3 * x * jnp.cos(t / 300) + 0.1 * jnp.sin(x)


def inputs(calls: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Initial latents and one noise array per model call, float32."""
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal(SHAPE).astype(np.float32)
    noises = rng.standard_normal((calls,) + SHAPE).astype(np.float32)
    return x0, noises


@contextlib.contextmanager
def prescribed_noise(scheduler):
    """Make `randn_tensor` inside the scheduler's module return `current[0]` (set before each step)."""
    import torch

    module = importlib.import_module(type(scheduler).__module__)
    current = [None]
    original = getattr(module, "randn_tensor", None)

    def fake_randn(shape, *args, dtype=None, **kwargs):
        assert tuple(shape) == tuple(current[0].shape), (shape, current[0].shape)
        return torch.from_numpy(current[0].copy()).to(dtype or torch.float32)

    def fake_tree(*args, **kwargs):  # DPMSolverSDE's Brownian-tree noise sampler: the same prescribed noise
        return lambda sigma, sigma_next: torch.from_numpy(current[0].copy())

    tree = getattr(module, "BrownianTreeNoiseSampler", None)
    module.randn_tensor = fake_randn
    if tree is not None:
        module.BrownianTreeNoiseSampler = fake_tree
    try:
        yield current
    finally:
        module.randn_tensor = original
        if tree is not None:
            module.BrownianTreeNoiseSampler = tree


def run_torch(
    scheduler,
    num_inference_steps,
    x0: np.ndarray,
    noises: np.ndarray,
    init_sigma=None,
    timestep_kwargs=None,
    **step_kwargs,
):
    """diffusers' loop -> (timesteps, init_noise_sigma, trajectory (calls, *shape)), float32 numpy.

    `num_inference_steps=None` keeps the timesteps the scheduler has (set by the caller), else `set_timesteps(n,
    **timestep_kwargs)` (e.g. FlowMatch's `mu`). `init_sigma` (if given) replaces the scheduler's
    `init_noise_sigma` (1 where it has none: the flow pipelines start from unit noise) as the factor on `x0`, so
    that both loops start from the same sample (compare the two init sigmas separately)."""
    import torch

    if num_inference_steps is not None:
        scheduler.set_timesteps(num_inference_steps, **(timestep_kwargs or {}))
    if hasattr(scheduler, "set_begin_index"):
        # Step by position, as sdjax does. Without it diffusers finds the first step by value and takes the
        # second match when the first timestep repeats (Karras schedules on a cosine beta schedule), then
        # runs past the end of its sigmas.
        scheduler.set_begin_index(0)
    own = getattr(scheduler, "init_noise_sigma", 1.0)
    factor = own if init_sigma is None else torch.tensor(init_sigma, dtype=torch.float32)
    x = torch.from_numpy(x0.copy()) * factor
    out = []
    with prescribed_noise(scheduler) as current:
        for i, t in enumerate(scheduler.timesteps):
            current[0] = noises[i]
            x_in = scheduler.scale_model_input(x, t) if hasattr(scheduler, "scale_model_input") else x
            eps = fake_model_torch(x_in, t)
            x = scheduler.step(eps, t, x, **step_kwargs).prev_sample
            out.append(x.numpy().copy())
    return scheduler.timesteps.numpy().copy(), float(own), np.stack(out)


@functools.partial(jax.jit, static_argnums=(0, 1))
def run_jax(sampler, num_inference_steps: int, x0, noises, state=None):
    """sdjax's loop (jitted, traced step index) -> (timesteps, init_noise_sigma, trajectory (calls, *shape))."""
    state = sampler.create_state() if state is None else state
    state = sampler.set_timesteps(state, num_inference_steps, x0.shape)
    x = x0 * sampler.init_noise_sigma(state)
    calls = sampler.num_model_calls(num_inference_steps)

    def body(i, carry):
        x, st, traj = carry
        t = st.timesteps[i]
        x_in = sampler.scale_model_input(st, x, i)
        eps = fake_model_jax(x_in, t)
        x, st = sampler.step(st, eps, i, x, noise=noises[i] if sampler.stochastic else None)
        return x, st, traj.at[i].set(x)

    traj = jnp.zeros((calls,) + x0.shape, jnp.float32)
    _, _, traj = jax.lax.fori_loop(0, calls, body, (x, state, traj))
    return state.timesteps, sampler.init_noise_sigma(state), traj


@functools.partial(jax.jit, static_argnums=(0, 1))
def run_jax_drawn(sampler, num_inference_steps: int, x0, keys):
    """sdjax's loop as the generation core runs it: a stochastic sampler's noise comes from its own
    `draw_noise(keys, i, state, shape)` (one key per image). -> (timesteps, init_noise_sigma, trajectory, the
    noise drawn at each call)."""
    state = sampler.set_timesteps(sampler.create_state(), num_inference_steps, x0.shape)
    x = x0 * sampler.init_noise_sigma(state)
    calls = sampler.num_model_calls(num_inference_steps)

    def body(i, carry):
        x, st, traj, drawn = carry
        x_in = sampler.scale_model_input(st, x, i)
        eps = fake_model_jax(x_in, st.timesteps[i])
        noise = sampler.draw_noise(keys, i, st, x.shape) if sampler.stochastic else jnp.zeros_like(x)
        x, st = sampler.step(st, eps, i, x, noise=noise if sampler.stochastic else None)
        return x, st, traj.at[i].set(x), drawn.at[i].set(noise)

    traj = jnp.zeros((calls,) + x0.shape, jnp.float32)
    _, _, traj, drawn = jax.lax.fori_loop(0, calls, body, (x, state, traj, traj))
    return state.timesteps, sampler.init_noise_sigma(state), traj, drawn
