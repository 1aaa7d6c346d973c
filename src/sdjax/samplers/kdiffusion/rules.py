"""Step rules acting on sigmas only: (x, denoised, sigma, sigma_next, memory, noise) -> (x_next, memory).

Every rule sees the sample on the path x = alpha(sigma) x0 + sigma eps of the model wrapper (`path.alpha`: 1 for a
variance-preserving model in k-diffusion's VE form, 1 - sigma for a flow model) and the denoised estimate the
wrapper made; none knows the prediction type. Where a rule needs the path (exponential integrators, the ancestral
re-noising), it takes alpha from `path`, so the same rule is exact on both paths:

- `euler`: x + (sigma_next - sigma) (x - x0) / sigma (Karras et al. 2022, Algorithm 1 without churn). On a flow path
  (x - x0) / sigma is the velocity, so this is FlowMatch Euler.
- `euler_ancestral`: a deterministic step down to sigma_down, then fresh noise up to sigma_next. VE form
  (k-diffusion): sigma_up = min(sigma_next, eta sqrt(sigma_next^2 (sigma^2 - sigma_next^2) / sigma^2)),
  sigma_down^2 = sigma_next^2 - sigma_up^2. Flow form (ComfyUI's RF variant): a DDIM step to
  sigma_down = sigma_next (1 + (sigma_next / sigma - 1) eta), then the sample rescaled by (1 - sigma_next) /
  (1 - sigma_down) and noise added to bring its noise level to sigma_next.
- `heun`: two model calls per step (Euler, then the average of the two slopes), the last step to 0 plain Euler; the
  sampler interleaves the two stages in its tables, one model call per loop iteration, and `stage` says which.
- `dpmpp_2m`, `dpmpp_2m_sde`, `dpmpp_2m_sde_heun`: DPM-Solver++(2M) (Lu et al. 2022) and its SDE form (`eta`;
  the second-order correction midpoint, or heun: k-diffusion's `sample_dpmpp_2m_sde(solver_type=...)`) in the half
  log-SNR lambda = log(alpha / sigma) of the path, first order on the first step and on the step to 0. On the VE
  path lambda = -log sigma (k-diffusion's `sample_dpmpp_2m`); on a flow path lambda = log((1 - sigma) / sigma), which
  is diffusers' flow DPM-Solver++ and ComfyUI's flow form of `dpmpp_2m_sde` (ComfyUI's `dpmpp_2m` keeps -log sigma
  on flow models: its first-order steps agree, its second-order correction differs).

`memory` is a dict of arrays in the sampler state: "x" (the sample a two-stage step started from), "d" (its first
slope), "denoised" (the previous step's estimate), "sigma" (the previous step's sigma), "count" (steps taken).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from sdjax.config import ConfigError
from sdjax.samplers.common import ancestral_down


def _safe(sigma):
    """`sigma` where it is > 0, else 1 (keeps logs and divisions finite in the branch a `where` discards)."""
    return jnp.where(sigma > 0, sigma, 1.0)


def half_log_snr(path, sigma):
    """lambda = log(alpha / sigma) of the path (-log sigma on the VE path)."""
    return jnp.log(path.alpha(sigma)) - jnp.log(sigma)


def euler(path, x, denoised, sigma, sigma_next, memory, *, noise, stage, eta):
    d = (x - denoised) / sigma
    return x + d * (sigma_next - sigma), memory


def euler_ancestral(path, x, denoised, sigma, sigma_next, memory, *, noise, stage, eta):
    if path.flow:
        ratio = 1.0 + (sigma_next / sigma - 1.0) * eta
        sigma_down = sigma_next * ratio
        alpha_next, alpha_down = 1.0 - sigma_next, 1.0 - sigma_down
        renoise = jnp.sqrt(jnp.maximum(sigma_next**2 - (sigma_down * alpha_next / alpha_down) ** 2, 0.0))
        x_down = sigma_down / sigma * x + (1.0 - sigma_down / sigma) * denoised
        out = alpha_next / alpha_down * x_down + renoise * noise
        return jnp.where(sigma_next > 0, out, denoised), memory
    sigma_up = jnp.minimum(sigma_next, eta * jnp.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2))
    sigma_down = ancestral_down(sigma, sigma_next, sigma_up, jnp)
    d = (x - denoised) / sigma
    return x + d * (sigma_down - sigma) + noise * sigma_up, memory


def heun(path, x, denoised, sigma, sigma_next, memory, *, noise, stage, eta):
    first = stage == 0
    dt = sigma_next - sigma
    slope = (x - denoised) / jnp.where(first, sigma, _safe(sigma_next))  # at the call's sigma
    euler_x = x + slope * dt
    heun_x = memory["x"] + (memory["d"] + slope) / 2 * dt
    memory = {**memory, "x": jnp.where(first, x, memory["x"]), "d": jnp.where(first, slope, memory["d"])}
    return jnp.where(first, euler_x, heun_x), memory


def _multistep(path, x, denoised, sigma, sigma_next, memory, *, noise, eta, sde: bool, heun: bool = False):
    sn = _safe(sigma_next)
    lam, lam_next = half_log_snr(path, sigma), half_log_snr(path, sn)
    h = lam_next - lam
    r = (lam - half_log_snr(path, memory["sigma"])) / h  # the previous step's length over this one's
    second = memory["count"] > 0
    alpha_next = path.alpha(sn)
    if sde:
        decay = -jnp.expm1(-h - eta * h)  # 1 - e^{-(1 + eta) h}
        out = sn / sigma * jnp.exp(-eta * h) * x + alpha_next * decay * denoised
        # the second-order correction: midpoint, or heun (k-diffusion's solver_type="heun", diffusers' solver_type)
        weight = decay / (-(1.0 + eta) * h) + 1.0 if heun else 0.5 * decay
        out = out + jnp.where(second, alpha_next * weight / r, 0.0) * (denoised - memory["denoised"])
        out = out + sn * jnp.sqrt(-jnp.expm1(-2.0 * eta * h)) * noise
    else:
        k = jnp.where(second, 1.0 / (2.0 * r), 0.0)
        corrected = (1.0 + k) * denoised - k * memory["denoised"]
        out = sn / sigma * x - alpha_next * jnp.expm1(-h) * corrected
    memory = {**memory, "denoised": denoised, "sigma": sigma, "count": memory["count"] + 1}
    return jnp.where(sigma_next > 0, out, denoised), memory


def dpmpp_2m(path, x, denoised, sigma, sigma_next, memory, *, noise, stage, eta):
    return _multistep(path, x, denoised, sigma, sigma_next, memory, noise=noise, eta=eta, sde=False)


def dpmpp_2m_sde(path, x, denoised, sigma, sigma_next, memory, *, noise, stage, eta):
    return _multistep(path, x, denoised, sigma, sigma_next, memory, noise=noise, eta=eta, sde=True)


def dpmpp_2m_sde_heun(path, x, denoised, sigma, sigma_next, memory, *, noise, stage, eta):
    return _multistep(path, x, denoised, sigma, sigma_next, memory, noise=noise, eta=eta, sde=True, heun=True)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A step rule and what the sampler needs to know about it: model calls per step (`stages`), whether it takes
    noise, and which memory entries it keeps."""

    name: str
    fn: Callable = dataclasses.field(compare=False, repr=False)
    stages: int = 1
    stochastic: bool = False
    memory: tuple[str, ...] = ()


_HISTORY = ("denoised", "sigma", "count")
RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule("euler", euler),
        Rule("euler_ancestral", euler_ancestral, stochastic=True),
        Rule("heun", heun, stages=2, memory=("x", "d")),
        Rule("dpmpp_2m", dpmpp_2m, memory=_HISTORY),
        Rule("dpmpp_2m_sde", dpmpp_2m_sde, stochastic=True, memory=_HISTORY),
        Rule("dpmpp_2m_sde_heun", dpmpp_2m_sde_heun, stochastic=True, memory=_HISTORY),
    )
}


def get_rule(name: str) -> Rule:
    if name not in RULES:
        raise ConfigError(f"unknown step rule {name!r}; valid: {list(RULES)}")
    return RULES[name]


def init_memory(rule: Rule, shape: tuple[int, ...]) -> dict:
    """The rule's memory before its first step (float32)."""
    out = {}
    for key in rule.memory:
        if key in ("x", "d", "denoised"):
            out[key] = jnp.zeros(shape, jnp.float32)
        elif key == "sigma":
            out[key] = jnp.ones((), jnp.float32)
        else:
            out[key] = jnp.zeros((), jnp.float32)
    return out
