"""Shared fixtures: tiny diffusers model folders saved the way real checkpoints are, and 8 simulated devices."""

import os
import pathlib
import sys

# Eight simulated CPU devices for every test (set before JAX is imported anywhere).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import pytest


def _save(pipe, path: pathlib.Path, legacy_tokenizer: bool) -> pathlib.Path:
    import shutil

    import reference

    pipe.save_pretrained(path, safe_serialization=True)
    if legacy_tokenizer:  # what real SD checkpoints ship: vocab.json + merges.txt instead of tokenizer.json
        for sub in [p for p in path.iterdir() if p.name.startswith("tokenizer")]:
            (sub / "tokenizer.json").unlink()
            shutil.copy(reference.ASSETS / "vocab.json", sub / "vocab.json")
            shutil.copy(reference.ASSETS / "merges.txt", sub / "merges.txt")
    return path


@pytest.fixture(scope="session")
def torch_sd1():
    import reference

    return reference.sd_pipeline("sd1")


@pytest.fixture(scope="session")
def torch_sd2():
    import reference

    return reference.sd_pipeline("sd2")


@pytest.fixture(scope="session")
def torch_sdxl():
    import reference

    return reference.sdxl_pipeline()


@pytest.fixture(scope="session")
def sd1_dir(torch_sd1, tmp_path_factory):
    return _save(torch_sd1, tmp_path_factory.mktemp("tiny-sd1"), legacy_tokenizer=True)


@pytest.fixture(scope="session")
def sd2_dir(torch_sd2, tmp_path_factory):
    return _save(torch_sd2, tmp_path_factory.mktemp("tiny-sd2"), legacy_tokenizer=False)


@pytest.fixture(scope="session")
def sdxl_dir(torch_sdxl, tmp_path_factory):
    return _save(torch_sdxl, tmp_path_factory.mktemp("tiny-sdxl"), legacy_tokenizer=True)


@pytest.fixture(scope="session")
def torch_sdxl_refiner(torch_sdxl):
    import reference

    return reference.sdxl_refiner_pipeline(base=torch_sdxl)


@pytest.fixture(scope="session")
def sdxl_refiner_dir(torch_sdxl_refiner, tmp_path_factory):
    return _save(torch_sdxl_refiner, tmp_path_factory.mktemp("tiny-sdxl-refiner"), legacy_tokenizer=True)
