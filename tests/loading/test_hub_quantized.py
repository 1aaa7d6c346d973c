"""Saved quantized params from the Hugging Face Hub: a `quantize=` load of a repo id downloads
`COMPONENT/sdjax_quantized.SCHEME.safetensors` for each component the policy names, where the repo has it, and not
that component's float weights; otherwise the files it always downloaded. The Hub is a local stand-in: the repo is a
copy of the embedded model with its saved int8 UNet, `_list_repo_files` lists it, and `hf_hub_download` /
`snapshot_download` copy the files they are asked for into a snapshot folder (as the HF cache does) and record
the names. A second, offline case reads the HF cache layout with the real `snapshot_download`."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import pytest
from bit_identical import assert_bit_identical

from sdjax.loading import files
from sdjax.loading.components import quantized_file, save_quantized_components
from sdjax.models.presets import EMBEDDED_MODEL
from sdjax.pipelines import load_pipeline
from sdjax.quant import QuantPolicy

REPO = "org/tiny-quantized"
FLOAT_UNET = "unet/diffusion_pytorch_model.safetensors"
SAVED_INT8 = "unet/sdjax_quantized.int8.safetensors"


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The repo's files: the embedded model plus its UNet saved quantized to int8 (float32, no variant)."""
    folder = tmp_path_factory.mktemp("repo") / "tiny"
    shutil.copytree(EMBEDDED_MODEL, folder)
    pipe, params = load_pipeline(str(folder), quantize="int8")
    save_quantized_components(folder, params, pipe.quantization, dtype=pipe.dtype)
    assert (folder / SAVED_INT8).is_file() and (folder / FLOAT_UNET).is_file()
    return folder


@pytest.fixture
def hub(repo, tmp_path, monkeypatch):
    """The Hub calls sdjax makes, served from `repo`; returns the list of file names they delivered."""
    import huggingface_hub

    listing = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())
    snapshot = tmp_path / "snapshot"
    delivered: list[str] = []

    def deliver(name: str) -> None:
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / name, snapshot / name)
        delivered.append(name)

    def list_repo_files(repo_id, revision, token):
        assert repo_id == REPO
        return listing

    def hf_hub_download(repo_id, filename, **kw):
        assert repo_id == REPO and filename in listing
        deliver(filename)
        return str(snapshot / filename)

    def snapshot_download(repo_id, *, allow_patterns=None, **kw):
        assert repo_id == REPO and allow_patterns is not None  # sdjax always names the files it wants
        for name in listing:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                deliver(name)
        return str(snapshot)

    monkeypatch.setattr(files, "_list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return delivered


def test_hub_allow_patterns_take_the_saved_file_instead_of_the_float_weights():
    """The choice alone, on a listing: only the components whose folder has the named file change."""
    listing = [
        "model_index.json",
        "unet/config.json",
        FLOAT_UNET,
        "unet/diffusion_pytorch_model.fp16.safetensors",
        SAVED_INT8,
        "unet/sdjax_quantized.fp8.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/vocab.json",
    ]
    index = {
        "_class_name": "StableDiffusionPipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
    }
    names = ["unet", "text_encoder", "tokenizer"]
    saved = {"unet": "sdjax_quantized.int8.safetensors", "text_encoder": "sdjax_quantized.int8.safetensors"}
    got = files.hub_allow_patterns(listing, index, names, saved_quantized=saved)
    assert sorted(got) == sorted(
        ["model_index.json", "unet/config.json", SAVED_INT8, "text_encoder/config.json",
         "text_encoder/model.safetensors", "tokenizer/vocab.json"]
    )  # fmt: skip
    without = files.hub_allow_patterns(listing, index, names)
    assert FLOAT_UNET in without and not any("sdjax_quantized" in p for p in without)
    fp16 = files.hub_allow_patterns(listing, index, ["unet"], variant="fp16", saved_quantized=saved)
    assert SAVED_INT8 in fp16 and not any(p.startswith("unet/diffusion_pytorch_model") for p in fp16)


def test_a_quantized_load_downloads_the_saved_file_not_the_float_unet(hub, repo):
    pipe, params = load_pipeline(REPO, quantize="int8")
    assert SAVED_INT8 in hub and FLOAT_UNET not in hub
    # the other components' float weights are downloaded as before
    assert {"text_encoder/model.safetensors", "vae/diffusion_pytorch_model.safetensors"} <= set(hub)
    assert pipe.quantization == QuantPolicy("int8", components=("unet",))
    # bit for bit the params of the local folder, and of quantizing the float weights on load (no file involved)
    _, local = load_pipeline(str(repo), quantize="int8")
    _, on_load = load_pipeline(EMBEDDED_MODEL, quantize="int8")
    assert_bit_identical(params, local)
    assert_bit_identical(params, on_load)


def test_without_the_scheme_s_file_or_quantize_the_float_weights_are_downloaded(hub):
    _, fp8 = load_pipeline(REPO, quantize="fp8")  # the repo has no fp8 file: the float UNet is quantized
    assert FLOAT_UNET in hub and not any("sdjax_quantized" in n for n in hub)
    _, reference = load_pipeline(EMBEDDED_MODEL, quantize="fp8")
    assert_bit_identical(fp8, reference)
    hub.clear()
    load_pipeline(REPO)
    assert FLOAT_UNET in hub and not any("sdjax_quantized" in n for n in hub)


def test_a_repo_file_made_otherwise_is_refused_as_a_local_one(hub):
    """Another `min_size`: the file is downloaded (it is what the load would read) and refused naming it; the
    float UNet is never fetched."""
    policy = QuantPolicy("int8", components=("unet",), min_size=4096)
    with pytest.raises(ValueError, match="made for another load of unet") as e:
        load_pipeline(REPO, quantize=policy)
    assert SAVED_INT8 in str(e.value) and "min_size '16384' there, '4096' here" in str(e.value)
    assert "quantize_pipeline" in str(e.value)  # the way out that a repo's file leaves
    assert FLOAT_UNET not in hub


def test_offline_the_cached_saved_file_is_read(repo, tmp_path, monkeypatch):
    """The HF cache layout with the saved file and without the float UNet (what an online quantized load leaves
    there), read through the real `snapshot_download` with `local_files_only=True`."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "cache"
    cached = cache / ("models--" + REPO.replace("/", "--"))
    (cached / "refs").mkdir(parents=True)
    (cached / "refs" / "main").write_text(commit)
    shutil.copytree(repo, cached / "snapshots" / commit)
    (cached / "snapshots" / commit / FLOAT_UNET).unlink()
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # load_pipeline takes no cache_dir=
    monkeypatch.setattr(files, "_list_repo_files", lambda *a: pytest.fail("network call while offline"))
    _, params = load_pipeline(REPO, quantize="int8", local_files_only=True)
    assert quantized_file(cached / "snapshots" / commit, "unet", "int8").is_file()
    _, on_load = load_pipeline(EMBEDDED_MODEL, quantize="int8")
    assert_bit_identical(params, on_load)
