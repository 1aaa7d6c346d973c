"""Shared fixtures: tiny diffusers model folders saved the way real checkpoints are, and 8 simulated devices."""

import os
import pathlib
import sys

# Eight simulated CPU devices for every test (set before JAX is imported anywhere).
# The tests' models are tiny, so their time is almost all XLA:CPU compilation (LLVM). The suite compiles with
# LLVM's optimisation off: about 40% less CPU per file (tests/core/test_generator.py: 109 -> 56 s of CPU time),
# the same HLO, the same library kernels (Eigen/oneDNN convolutions and dots), only slower elementwise loops.
# Results may differ from an optimised build by float rounding (summation order), which every tolerance here
# allows for. SDJAX_TEST_XLA_OPT=1 runs the suite with XLA's default (optimised) compilation instead.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Subprocesses that set their own XLA_FLAGS (tests/parallel/multihost_worker.py) add SDJAX_TEST_COMPILE_FLAGS.
os.environ["SDJAX_TEST_COMPILE_FLAGS"] = "" if os.environ.get("SDJAX_TEST_XLA_OPT") == "1" else _FAST_COMPILE
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {os.environ['SDJAX_TEST_COMPILE_FLAGS']}".strip()
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# PyTorch references on one thread: the tiny reference models run hundreds of small ops, and with two test workers
# on two cores each intra-op thread hand-off costs more than the op (tests/controlnet_cases.py measured 8-25 s of
# CPU for one 5-step reference call under load, 0.25 s on one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
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
