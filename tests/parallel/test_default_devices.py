"""`SDJAX_DEVICES`: how many of the visible devices pipelines, fine-tuning and training use when none are given."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sdjax.parallel import sharding


@pytest.mark.parametrize("value, n", [("", 8), ("all", 8), ("1", 1), (" 3 ", 3), ("8", 8)])
def test_the_first_n_devices_or_all(monkeypatch, value, n):
    monkeypatch.setenv("SDJAX_DEVICES", value)
    assert sharding.default_devices() == jax.devices()[:n]
    assert sharding.make_mesh().devices.size == n


@pytest.mark.parametrize("value", ["0", "9", "-1", "two", "1.5"])
def test_a_bad_value_is_named(monkeypatch, value):
    monkeypatch.setenv("SDJAX_DEVICES", value)
    with pytest.raises(ValueError, match=rf"SDJAX_DEVICES={value!r}: expected a number of devices from 1 to 8"):
        sharding.default_devices()


def test_a_multi_process_run_refuses_fewer_than_all(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setenv("SDJAX_DEVICES", "4")
    with pytest.raises(ValueError, match="over 2 processes uses all their 8 devices"):
        sharding.default_devices()
    monkeypatch.setenv("SDJAX_DEVICES", "all")
    assert len(sharding.default_devices()) == 8


def test_a_pipeline_pads_its_batch_to_the_devices_it_runs_on(monkeypatch, sd1_dir):
    """The generator's default mesh follows the variable: one image is one image on one device, and the same
    image padded to eight on all eight."""
    from sdjax.pipelines import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    images = {}
    for value in ("1", "all"):
        monkeypatch.setenv("SDJAX_DEVICES", value)
        assert pipe.generator.get_mesh().devices.size == (1 if value == "1" else 8)
        images[value] = np.asarray(pipe.generate("a cat", steps=2, seed=0, width=32, height=32, output_type="np"))
    np.testing.assert_allclose(images["1"], images["all"], atol=1e-5)
