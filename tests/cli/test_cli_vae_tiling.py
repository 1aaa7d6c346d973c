"""`sdjax generate --vae-tiling`: the pipeline generates with diffusers-style VAE tiling on (its default tiles)."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from sdjax import StableDiffusionPipeline, cli

runner = CliRunner()


@pytest.fixture
def spied(sd1_dir, monkeypatch):
    """The tiny SD 1.x pipeline behind the CLI, with generation replaced by a spy that records the tiling in use."""
    pipe = StableDiffusionPipeline.from_pretrained(str(sd1_dir))[0]
    seen = []

    def generate_images(p, batch, **kwargs):
        seen.append(p.vae_tiling)
        return [np.zeros((r.height, r.width, 3), np.uint8) for r in batch]

    monkeypatch.setattr(cli.generate, "load_pipeline", lambda model, dtype: pipe)
    monkeypatch.setattr(cli.generate.metadata, "generate_images", generate_images)
    return pipe, seen


@pytest.mark.parametrize("flag", [True, False])
def test_vae_tiling_flag(spied, tmp_path, flag):
    pipe, seen = spied
    args = ["generate", "a cat", "--steps", "2", "--quiet", "--out", str(tmp_path)] + (["--vae-tiling"] * flag)
    r = runner.invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    if flag:
        assert seen[0] is not None and seen[0].sample_size == pipe.vae.config.sample_size
        assert seen[0].latent_size == pipe.vae.config.sample_size // 8
    else:
        assert seen == [None]
