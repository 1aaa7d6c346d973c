"""Sigma schedules as functions: `n` steps -> `n + 1` descending sigmas ending in 0 (float64 numpy), computed on the
host once per (schedule, step count, latent shape). The step rules only ever see these sigmas.

The functions take what they need explicitly (a sigma range, the model's table of training sigmas, a shift);
`Schedule` is the hashable handle a sampler keeps, and `Schedule.sigmas(n, prediction, shape)` feeds a function
from the model wrapper (`prediction.Prediction`):

- "karras", "exponential", "beta": between the model's smallest and largest sigma (Karras et al. 2022 eq. 5;
  log-uniform; Beta(0.6, 0.6) quantiles as diffusers' `use_beta_sigmas`), reusing `samplers.common`; with
  `sigma_range="spaced"` between the ends of the "spaced" grid instead (diffusers' Euler and Heun convert the sigmas
  of their `timestep_spacing` grid, whose ends depend on the spacing and the step count);
- "normal" (A1111's Uniform/Normal, ComfyUI's normal), "sgm_uniform", "simple": on the model's own table;
- "spaced": diffusers' `timestep_spacing` grids (linspace/leading/trailing) with sigmas interpolated linearly at
  the (fractional) timesteps, as diffusers' Euler builds them;
- "flow": the FlowMatch grids ("scheduler": diffusers' `FlowMatchEulerDiscreteScheduler.set_timesteps`; "flux":
  FluxPipeline's `linspace(1, 1/n, n)`; "solver": DPM-Solver/UniPC's `use_flow_sigmas` grid) with the static shift or
  the resolution-dependent one (mu from the latent's token count, as the Flux and SD 3 pipelines compute it).

On a flow model every schedule but "flow" runs on the shifted training table shift(t / T), t = 1..T (ComfyUI's
`ModelSamplingDiscreteFlow` / `ModelSamplingFlux`), so Karras or "simple" sigmas of Flux follow its shift too; "normal"
and "sgm_uniform" there space the timesteps sigma * T between the table's ends and shift t / T again, as ComfyUI's
flow model sampling maps timesteps and sigmas (so its low end is shifted twice, as in diffusers' FlowMatch grid).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdjax.config import ConfigError
from sdjax.samplers.common import F32, beta_sigmas, exponential_sigmas, karras_sigmas, spaced_timesteps
from sdjax.samplers.flow_match import (
    TIME_SHIFT_TYPES,
    calculate_shift,
    image_seq_len,
    static_shift,
    stretch_to_terminal,
    time_shift,
)
from sdjax.samplers.kdiffusion.prediction import Prediction

FLOW_GRIDS = ("scheduler", "flux", "solver")
SIGMA_RANGES = ("table", "spaced")


def _with_zero(sigmas) -> np.ndarray:
    return np.concatenate([np.asarray(sigmas, dtype=np.float64), [0.0]])


# ------------------------------------------------------------------------------------------ range schedules
def karras(n: int, sigma_min: float, sigma_max: float, rho: float = 7.0) -> np.ndarray:
    return _with_zero(karras_sigmas(sigma_min, sigma_max, n, rho))


def exponential(n: int, sigma_min: float, sigma_max: float) -> np.ndarray:
    return _with_zero(exponential_sigmas(sigma_min, sigma_max, n))


def beta(n: int, sigma_min: float, sigma_max: float, alpha: float = 0.6, beta_: float = 0.6) -> np.ndarray:
    return _with_zero(beta_sigmas(sigma_min, sigma_max, n, alpha, beta_))


# ------------------------------------------------------------------------------------ table schedules
def _log_interp(table: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Sigma at fractional training timesteps `t`: linear interpolation of log sigma (k-diffusion's t_to_sigma)."""
    return np.exp(np.interp(t, np.arange(len(table)), np.log(np.asarray(table, dtype=np.float64))))


def normal(n: int, table: np.ndarray, sgm: bool = False) -> np.ndarray:
    """Timesteps evenly spaced from the last training timestep to the first (`sgm`: n of n + 1 points, the last
    dropped), their sigmas interpolated in log sigma."""
    T = len(table)
    t = np.linspace(T - 1, 0, n + 1)[:-1] if sgm else np.linspace(T - 1, 0, n)
    return _with_zero(_log_interp(table, t))


def sgm_uniform(n: int, table: np.ndarray) -> np.ndarray:
    return normal(n, table, sgm=True)


def simple(n: int, table: np.ndarray) -> np.ndarray:
    """Every (T / n)-th training sigma from the top (ComfyUI's "simple")."""
    T = len(table)
    stride = T / n
    return _with_zero([table[T - 1 - int(i * stride)] for i in range(n)])


def spaced(n: int, table: np.ndarray, spacing: str = "linspace", steps_offset: int = 0) -> np.ndarray:
    """diffusers' spaced timestep grid (float32, as its Euler makes it), sigmas interpolated linearly in sigma."""
    t = spaced_timesteps(spacing, n, len(table), steps_offset, kind="float")
    return _with_zero(np.interp(t, np.arange(len(table)), table))


# -------------------------------------------------------------------------------------------------- flow
def flow_shift(sigmas: np.ndarray, shift: float, mu: float | None, time_shift_type: str = "exponential"):
    """The static shift (mu None) or the resolution-dependent one, in the dtype of `sigmas`."""
    return static_shift(shift, sigmas) if mu is None else time_shift(time_shift_type, mu, sigmas)


def flow(
    n: int,
    *,
    shift: float = 1.0,
    mu: float | None = None,
    time_shift_type: str = "exponential",
    grid: str = "scheduler",
    num_train_timesteps: int = 1000,
    shift_terminal: float | None = None,
) -> np.ndarray:
    """Flow-matching sigmas from 1 towards 0 on one of `FLOW_GRIDS`, shifted, with diffusers' arithmetic (float32
    for the "flux" grid and the training range, float64 for the "scheduler" grid, rounded to float32 at the end;
    the "solver" grid float64 throughout)."""
    T = num_train_timesteps
    if grid == "flux":
        sigmas = flow_shift(np.linspace(1.0, 1 / n, n).astype(F32), shift, mu, time_shift_type)
    elif grid == "scheduler":
        # diffusers' constructor shifts its training range statically unless the shift is dynamic; set_timesteps
        # then spaces between its ends and shifts again (twice at the low end, as diffusers does).
        train = np.linspace(1, T, T, dtype=F32)[::-1] / T
        if mu is None:
            train = static_shift(shift, train)
        hi, lo = float(train[0]), float(train[-1])
        sigmas = flow_shift(np.linspace(hi * T, lo * T, n) / T, shift, mu, time_shift_type)
    elif grid == "solver":  # DPM-Solver/UniPC: a dynamic shift is the static one with shift = e^mu
        s = shift if mu is None else np.exp(mu)
        sigmas = np.flip(static_shift(s, 1.0 - np.linspace(1, 1 / T, n + 1)))[:-1]
    else:
        raise ConfigError(f"flow grid {grid!r} is not one of {list(FLOW_GRIDS)}")
    if shift_terminal:
        sigmas = stretch_to_terminal(sigmas, shift_terminal)
    # The solver grid stays float64 (diffusers truncates its timesteps from the float64 sigmas).
    return _with_zero(np.asarray(sigmas) if grid == "solver" else np.asarray(sigmas).astype(F32))


def dynamic_mu(shape, base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15) -> float:
    """mu of the resolution-dependent shift for an unpacked latent `(B, C, h, w)` (2x2 patches)."""
    return calculate_shift(image_seq_len(shape), base_image_seq_len, max_image_seq_len, base_shift, max_shift)


# ------------------------------------------------------------------------------------------------ handle
SCHEDULES = ("normal", "karras", "exponential", "beta", "sgm_uniform", "simple", "spaced", "flow")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A named schedule and its options (hashable: part of a sampler, a static argument under `jit`).

    `rho` (Karras), `spacing`/`steps_offset` ("spaced", and the range of Karras/exponential/beta with
    `sigma_range="spaced"`), `grid`/`shift_terminal` ("flow"); the flow shift: `shift`, or with
    `use_dynamic_shifting` mu from the latent shape through the four pipeline keys."""

    name: str = "normal"
    rho: float = 7.0
    spacing: str = "linspace"
    steps_offset: int = 0
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    time_shift_type: str = "exponential"
    grid: str = "scheduler"
    shift_terminal: float | None = None
    sigma_range: str = "table"

    def __post_init__(self):
        if self.name not in SCHEDULES:
            raise ConfigError(f"schedule {self.name!r} is not one of {list(SCHEDULES)}")
        if self.time_shift_type not in TIME_SHIFT_TYPES:
            raise ConfigError(f"time_shift_type={self.time_shift_type!r} is not one of {list(TIME_SHIFT_TYPES)}")
        if self.grid not in FLOW_GRIDS:
            raise ConfigError(f"flow grid {self.grid!r} is not one of {list(FLOW_GRIDS)}")
        if self.sigma_range not in SIGMA_RANGES:
            raise ConfigError(f"sigma_range={self.sigma_range!r} is not one of {list(SIGMA_RANGES)}")

    @property
    def needs_shape(self) -> bool:
        return self.use_dynamic_shifting

    def mu(self, shape) -> float | None:
        if not self.use_dynamic_shifting:
            return None
        if shape is None:
            raise ValueError(
                "this schedule shifts by resolution (use_dynamic_shifting): pass the latent shape (B, C, h, w)"
            )
        keys = (self.base_image_seq_len, self.max_image_seq_len, self.base_shift, self.max_shift)
        return dynamic_mu(shape, *keys)

    def check(self, prediction: Prediction) -> None:
        """Refuse combinations that would sample another process than the model's."""
        shifted = self.shift != 1.0 or self.use_dynamic_shifting
        if not prediction.flow and (shifted or self.name == "flow"):
            raise ConfigError(
                f"schedule {self.name!r} with a flow shift is for flow-matching models; this model predicts "
                f"{prediction.kind!r} (variance-preserving)"
            )
        if prediction.flow and self.name == "spaced":
            raise ConfigError("the 'spaced' schedule is diffusers' variance-preserving timestep grid; use 'flow'")

    def steps(self, n: int, prediction: Prediction) -> int:
        """How many steps `n` requested steps make: `n`, except on a "spaced" trailing grid, where diffusers' rounding
        may give one more."""
        if self.name != "spaced":
            return n
        return len(spaced_timesteps(self.spacing, n, prediction.num_train_timesteps, self.steps_offset, kind="float"))

    def grid_timesteps(self, n: int, prediction: Prediction) -> np.ndarray | None:
        """The timesteps a "spaced" grid is made of (float32, diffusers' own: fed to the network as they are, the
        -1 an odd trailing grid ends in included); None for the other schedules (their timesteps come from sigma)."""
        if self.name != "spaced":
            return None
        return spaced_timesteps(self.spacing, n, prediction.num_train_timesteps, self.steps_offset, kind="float")

    def table(self, prediction: Prediction, shape=None) -> np.ndarray:
        """The model's training sigmas, ascending; shifted for a flow model."""
        table = np.asarray(prediction.train_sigmas(), dtype=np.float64)
        if prediction.flow:
            table = flow_shift(table, self.shift, self.mu(shape), self.time_shift_type)
        return table

    def sigmas(self, n: int, prediction: Prediction, shape=None) -> np.ndarray:
        """`n + 1` descending sigmas ending in 0, float64."""
        self.check(prediction)
        if self.name == "flow":
            return flow(
                n,
                shift=self.shift,
                mu=self.mu(shape),
                time_shift_type=self.time_shift_type,
                grid=self.grid,
                num_train_timesteps=prediction.num_train_timesteps,
                shift_terminal=self.shift_terminal,
            )
        table = self.table(prediction, shape)
        lo, hi = float(table[0]), float(table[-1])
        if self.sigma_range == "spaced" and not prediction.flow:
            grid = spaced(n, table, self.spacing, self.steps_offset)[:-1]
            lo, hi = float(grid[-1]), float(grid[0])
        if self.name == "karras":
            return karras(n, lo, hi, self.rho)
        if self.name == "exponential":
            return exponential(n, lo, hi)
        if self.name == "beta":
            return beta(n, lo, hi)
        if self.name == "spaced":
            return spaced(n, table, self.spacing, self.steps_offset)
        if self.name == "simple":
            return simple(n, table)
        if prediction.flow:  # the timestep of a flow sigma is sigma * T, the sigma of a timestep shift(t / T)
            T = prediction.num_train_timesteps
            sgm = self.name == "sgm_uniform"
            t = np.linspace(hi * T, lo * T, n + 1)[:-1] if sgm else np.linspace(hi * T, lo * T, n)
            return _with_zero(flow_shift(t / T, self.shift, self.mu(shape), self.time_shift_type))
        return normal(n, table, sgm=self.name == "sgm_uniform")
