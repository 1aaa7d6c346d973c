"""The installed `sdjax` command, as a user runs it: a real process on the embedded model (the default)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sdjax
from sdjax import infotext, metadata

pytestmark = pytest.mark.skipif(
    not (Path(sdjax.EMBEDDED_MODEL) / "model_index.json").is_file(),
    reason=f"the embedded model is not in this checkout ({sdjax.EMBEDDED_MODEL})",
)


def sdjax_command() -> list[str]:
    script = Path(sys.executable).parent / "sdjax"  # the [project.scripts] entry point
    return [str(script)] if script.is_file() else [sys.executable, "-m", "sdjax.cli"]


def test_generate_with_the_embedded_model(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one device, as a user has
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)  # and XLA's default compilation (tests/conftest.py turns it off)
    args = [*sdjax_command(), "generate", "a red circle", "--steps", "2", "--seed", "4", "--out", str(tmp_path)]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.glob("*.png")
    assert r.stdout.strip() == str(path)
    assert "Denoising" in r.stderr and "total" in r.stderr
    p = metadata.parameters_from_text(infotext.read_parameters(path))
    assert (p.prompt, p.steps, p.seed, p.model) == ("a red circle", 2, 4, "sdjax/embedded")
    info = subprocess.run(
        [*sdjax_command(), "pnginfo", str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert info.returncode == 0 and info.stdout.startswith("a red circle\nSteps: 2")


def test_samplers_swapped_onto_the_embedded_model_read_its_config_as_sd15s():
    """`--sampler DDIM` (and the server's and web page's "DDIM") on the embedded model: A1111's DDIM never clips x0
    and ends on alpha_bar_0, as diffusers' DDIM does from SD 1.5's scheduler config (`clip_sample: false`,
    `set_alpha_to_one: false`); the embedded config carries those keys as SD 1.5's does."""
    import json

    from sdjax.cli import _a1111_sampler
    from sdjax.samplers import get_sampler

    raw = json.loads((Path(sdjax.EMBEDDED_MODEL) / "scheduler" / "scheduler_config.json").read_text())
    base = get_sampler(raw)  # what loading the model folder builds (loading.components.load_scheduler)
    ddim = get_sampler(_a1111_sampler("DDIM", "Automatic"), base)
    assert (ddim.clip_sample, ddim.set_alpha_to_one, ddim.steps_offset) == (False, False, 1)
    plms = get_sampler(_a1111_sampler("PLMS", "Automatic"), base)
    assert (plms.skip_prk_steps, plms.set_alpha_to_one, plms.steps_offset) == (True, False, 1)
    # The model's own sampler (DPM++ 2M) has none of these keys: its images do not change.
    own = {k: v for k, v in raw.items() if k not in ("clip_sample", "set_alpha_to_one", "skip_prk_steps")}
    assert base == get_sampler(own)
