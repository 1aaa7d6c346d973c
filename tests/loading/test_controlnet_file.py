"""ControlNet single files (`sdjax.loading.controlnet_file`): original-layout files (as sd-webui-controlnet users
keep them) load to diffusers' residuals, their architecture is inferred from the shapes as the released configs
say, and what is not a ControlNet is named.

The files are written from diffusers models by the test's own key mapping (`ldm_fixtures.controlnet_to_original`);
diffusers' own `ControlNetModel.from_single_file` reading them back to the same weights checks that mapping."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from ldm_fixtures import controlnet_to_original
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_controlnet import (
    CONFIGS,
    SD15_CANNY_JSON,
    SDXL_CANNY_JSON,
    Case,
    rel_err,
)

from sdjax.loading import controlnet_file as cf
from sdjax.loading.controlnet import load_controlnet
from sdjax.loading.single_file import UnknownArchitectureError


def _write(case: Case, path: Path, prefix: str) -> Path:
    config = json.loads((case.folder / "config.json").read_text())
    state = {k: v.detach().clone() for k, v in case.torch_model.state_dict().items()}
    save_file(controlnet_to_original(state, config, prefix), str(path))
    return path


@pytest.mark.parametrize("name, prefix", [("sd", ""), ("sdxl", "control_model.")])
def test_original_file_gives_diffusers_residuals(name, prefix, tmp_path):
    from diffusers import ControlNetModel

    # The released conditioning embedding (diffusers' reader assumes its 8 convolutions: conv_out at index 14).
    case = Case({**CONFIGS[name], "conditioning_embedding_out_channels": (16, 32, 96, 256)}, tmp_path / "folder")
    path = _write(case, tmp_path / "net.safetensors", prefix)
    if not prefix:  # the fixture's layout is diffusers' own reading of such files
        theirs = ControlNetModel.from_single_file(str(path), config=str(case.folder), local_files_only=True)
        want = case.torch_model.state_dict()
        assert set(theirs.state_dict()) == set(want)
        for k, v in theirs.state_dict().items():
            assert torch.equal(v, want[k]), k
    module, params = load_controlnet(path, config=case.folder)
    assert module.config == case.config
    for scale, guess in [(1.0, False), (0.55, True)]:
        want_down, want_mid = case.expected(scale, guess)
        got_down, got_mid = case.run(scale, guess, params=params)
        assert max(rel_err(g, w) for g, w in zip(got_down, want_down)) <= 1e-5
        assert rel_err(got_mid, want_mid) <= 1e-5
    # The diffusers layout in one file needs its config, which is then enough.
    flat = tmp_path / "diffusers-layout.safetensors"
    save_file({k: v.contiguous() for k, v in case.torch_model.state_dict().items()}, str(flat))
    with pytest.raises(ValueError, match="needs config="):
        load_controlnet(flat)
    _, flat_params = load_controlnet(flat, config=case.folder)
    got_down, _ = case.run(params=flat_params)
    assert max(rel_err(g, w) for g, w in zip(got_down, case.expected()[0])) <= 1e-5


@pytest.mark.parametrize("raw", [SD15_CANNY_JSON, SDXL_CANNY_JSON], ids=["sd15", "sdxl"])
def test_architecture_is_inferred_as_released(raw):
    """The shapes of a released net's original file (built on torch's meta device) give its released config."""
    from diffusers import ControlNetModel

    with torch.device("meta"):
        tm = ControlNetModel(**{k: v for k, v in raw.items() if not k.startswith("_")})
    original = controlnet_to_original(dict(tm.state_dict()), raw)
    inferred = cf.infer_config({k: tuple(v.shape) for k, v in original.items()})
    for key, value in inferred.items():
        if key == "_class_name":
            continue
        want = raw[key]
        if key == "transformer_layers_per_block" and isinstance(want, int):
            want = [want] * len(raw["block_out_channels"])
        if key == "attention_head_dim" and isinstance(value, list) and isinstance(want, int):
            want = [want] * len(value)
        assert value == (list(want) if isinstance(want, (list, tuple)) else want), key


def test_what_is_not_a_controlnet_is_named(tmp_path, sd1_dir):
    unet = next((Path(sd1_dir) / "unet").glob("*.safetensors"))
    with pytest.raises(UnknownArchitectureError, match="not a ControlNet"):
        cf.load_controlnet_file(unet)
    bad = {"input_hint_block.0.weight": torch.zeros(16, 3, 3, 3), "input_hint_block.4.weight": torch.zeros(4, 16, 3, 3)}
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(UnknownArchitectureError, match=r"input_hint_block convolutions \[0, 4\]"):
        cf.load_controlnet_file(tmp_path / "bad.safetensors")
