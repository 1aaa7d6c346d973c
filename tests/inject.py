"""Give a PyTorch diffusers pipeline exactly the noise sdjax draws, so images can be compared number by number.

sdjax draws every random array from per-image keys and named streams (`sdjax.rng`): the initial noise, the VAE
posterior sample of each encoded image, the noise of each stochastic step. These helpers compute those arrays
with sdjax's own functions and make diffusers use them: its pipeline module's `randn_tensor` returns the initial
noise, `retrieve_latents` returns `mean + std * eps` with sdjax's eps (in the order the pipeline encodes images),
and the scheduler module's `randn_tensor` returns the step noise of each call in turn.
"""

from __future__ import annotations

import contextlib
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from sdjax import rng


def image_keys(seed: int, n: int) -> np.ndarray:
    """The keys `generate(seed=seed)` gives images 0..n-1."""
    return np.stack([np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), i)) for i in range(n)])


def stream(keys: np.ndarray, which: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(rng.per_image_normal(jnp.asarray(keys), which, shape))


def step_noises(sampler, keys: np.ndarray, shape: tuple[int, ...], start: int, end: int) -> list[np.ndarray]:
    """The step noise of model calls start..end-1, as sdjax's loop draws it."""
    from sdjax.core.loop import step_noise

    out = []
    for i in range(start, end):
        out.append(np.asarray(step_noise(sampler, jnp.asarray(keys), jnp.int32(i), None, (len(keys), *shape))))
    return out


@contextlib.contextmanager
def prescribed(
    pipe,
    *,
    latents_noise: np.ndarray | None = None,
    encode_eps: list[np.ndarray] = (),
    step_noise: list[np.ndarray] = (),
):
    """Patch `pipe`'s module (randn_tensor, retrieve_latents) and its scheduler's module (randn_tensor)."""
    import torch

    module = importlib.import_module(type(pipe).__module__)
    sched_module = importlib.import_module(type(pipe.scheduler).__module__)
    eps_queue = [torch.from_numpy(np.array(e)) for e in encode_eps]
    steps_queue = [torch.from_numpy(np.array(e)) for e in step_noise]
    used = {"latents": 0, "encode": 0, "steps": 0}

    def fake_randn(shape, *args, dtype=None, **kwargs):
        assert latents_noise is not None, "the pipeline drew initial noise; the test gave none"
        assert tuple(shape) == latents_noise.shape, (shape, latents_noise.shape)
        used["latents"] += 1
        return torch.from_numpy(np.array(latents_noise)).to(dtype or torch.float32)

    def fake_retrieve(encoder_output, generator=None, sample_mode="sample"):
        dist = encoder_output.latent_dist
        eps = eps_queue[used["encode"]]
        used["encode"] += 1
        assert tuple(eps.shape) == tuple(dist.mean.shape), (eps.shape, dist.mean.shape)
        return dist.mean + dist.std * eps.to(dist.mean.dtype)

    def fake_step_randn(shape, *args, dtype=None, **kwargs):
        noise = steps_queue[used["steps"]]
        used["steps"] += 1
        assert tuple(shape) == tuple(noise.shape), (shape, noise.shape)
        return noise.to(dtype or torch.float32)

    saved = (
        getattr(module, "randn_tensor", None),
        getattr(module, "retrieve_latents", None),
        getattr(sched_module, "randn_tensor", None),
    )
    module.randn_tensor = fake_randn
    module.retrieve_latents = fake_retrieve
    if hasattr(sched_module, "randn_tensor"):
        sched_module.randn_tensor = fake_step_randn
    try:
        yield used
    finally:
        module.randn_tensor, module.retrieve_latents = saved[0], saved[1]
        if saved[2] is not None:
            sched_module.randn_tensor = saved[2]
    assert used["encode"] == len(eps_queue), f"diffusers encoded {used['encode']} images, expected {len(eps_queue)}"
    assert used["steps"] == len(steps_queue), f"diffusers drew {used['steps']} step noises, expected {len(steps_queue)}"
