"""ComfyUI's `euler_ancestral` with `karras` / `exponential` / `beta` on a flow model: A1111's Euler a has no such
sigmas for a variance-preserving model, so the node layer refused the pair before the family was known; Flux and
SD 3 run it in the k-diffusion form (rectified-flow ancestral steps on those sigmas), as ComfyUI does."""

from __future__ import annotations

import pytest

from sdjax import samplers
from sdjax.samplers import KDiffusionSampler, a1111
from sdjax.server.comfy import custom
from sdjax.server.comfy.graph import NodeError

FLUX_DEV = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


@pytest.mark.parametrize("scheduler", ["karras", "exponential", "beta"])
def test_flow_only_pair_reaches_the_kdiffusion_form(scheduler):
    text = custom.sampler_of("euler_ancestral", scheduler, "3", "3")
    got = a1111.from_a1111_flow(text, "Automatic", samplers.get_sampler(FLUX_DEV))
    assert isinstance(got, KDiffusionSampler)
    assert samplers.name_of(got) == f"kdiffusion:euler_ancestral:{scheduler}"
    with pytest.raises(ValueError):  # a variance-preserving model has no such sampler: refused when checked
        samplers.from_a1111(text)


def test_pairs_no_family_runs_stay_refused_by_node():
    with pytest.raises(NodeError) as e:
        custom.sampler_of("euler_ancestral", "kl_optimal", "3", "4")  # sdjax has no KL Optimal sigmas
    assert e.value.node_id == "4"
