"""Shared fixtures: tiny diffusers model folders saved the way real checkpoints are, and 8 simulated devices."""

import os
import pathlib
import sys

# Eight simulated CPU devices for every test (set before JAX is imported anywhere).
# The tests' models are tiny, so most tests' time is XLA:CPU compilation (LLVM). The suite compiles with LLVM's
# optimisation off (JAX's `jax_disable_most_optimizations`: XLA backend optimisation level 0, no expensive LLVM
# passes): about 40% less CPU per compile-bound file (tests/core/test_generator.py: 109 -> 56 s of CPU time), the
# same HLO, the same library kernels (Eigen/oneDNN convolutions and dots), only slower elementwise loops. Results
# may differ from an optimised build by float rounding (summation order), which every tolerance here allows for.
# Tests marked `xla_optimized` run many generations on few programs (the embedded model's quality checks): they
# compile with the default optimisation (tests/evaluation/test_quality.py: 111 -> 47 s of CPU time).
# SDJAX_TEST_XLA_OPT=1 runs the whole suite with XLA's default (optimised) compilation.
_OPTIMISED = os.environ.get("SDJAX_TEST_XLA_OPT") == "1"
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "0" if _OPTIMISED else "1")  # inherited by subprocesses
# The same as XLA flags, for subprocesses that set their own XLA_FLAGS (tests/parallel/multihost_worker.py).
# XLA:CPU's older loop emitters compile the suite's fusions faster than its MLIR fusion emitters (tests/core/
# test_generator.py, test_img2img_inpaint_parity.py and models/test_unet.py: 248 -> 174 s of CPU time, 212 -> 159 s
# wall, one process). A release of XLA that drops the flag would abort on it, so the first process of a run asks a
# throw-away interpreter whether XLA still knows it (0.7 s); the workers and subprocesses inherit the answer.
_CODEGEN_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    import subprocess

    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


if "SDJAX_TEST_CODEGEN_FLAG" not in os.environ:
    os.environ["SDJAX_TEST_CODEGEN_FLAG"] = "" if _OPTIMISED or not _xla_accepts(_CODEGEN_FLAG) else _CODEGEN_FLAG
os.environ["SDJAX_TEST_COMPILE_FLAGS"] = " ".join(
    ([] if _OPTIMISED else ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"])
    + [os.environ["SDJAX_TEST_CODEGEN_FLAG"]]
).strip()
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {os.environ['SDJAX_TEST_CODEGEN_FLAG']}".strip()
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Pipelines, fine-tuning and training run on the first simulated device by default (`SDJAX_DEVICES`, read by
# `parallel.sharding.default_devices`): a batch of one over eight devices is padded to eight images and compiled
# as an eight-way SPMD program, 9% more CPU over seven generation-heavy files (17-29% for some). Tests of
# several devices give their devices or mesh, or are marked `all_devices`; `SDJAX_DEVICES=all` runs every test
# on all eight.
os.environ.setdefault("SDJAX_DEVICES", "1")
# PyTorch references on one thread: the tiny reference models run hundreds of small ops, and with two test workers
# on two cores each intra-op thread hand-off costs more than the op (tests/controlnet_cases.py measured 8-25 s of
# CPU for one 5-step reference call under load, 0.25 s on one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The models' traced param trees (`sdjax.models.shapes_cache`) go to a folder of this test process (its subprocesses
# inherit it), not to the user's cache: a run neither reads trees an older checkout wrote nor leaves files behind.
if "SDJAX_SHAPE_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["SDJAX_SHAPE_CACHE"] = _SHAPES = tempfile.mkdtemp(prefix="sdjax-test-shapes-")
    atexit.register(shutil.rmtree, _SHAPES, ignore_errors=True)
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import pytest


def _without_flax_param_shape_check() -> None:
    """Flax re-traces every parameter's initializer (`jax.eval_shape`) at each `apply` to check the parameter's
    shape: 0.67 of the 1.75 s of tracing in one tiny-pipeline compile (docs/benchmarks.md), paid by every compile
    of the suite. The tests skip that check (sdjax's loader checks every shape against the config itself, and
    `tests/loading` tests those errors); SDJAX_TEST_FLAX_CHECKS=1 keeps Flax's check."""
    from flax.core import meta
    from flax.core.scope import Scope

    checked = Scope.param

    def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
        if not self.has_variable("params", name):
            return checked(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)
        self.reserve(name, "params")
        value = self.get_variable("params", name)
        return meta.unbox(value) if unbox else value

    Scope.param = param


if os.environ.get("SDJAX_TEST_FLAX_CHECKS") != "1":
    _without_flax_param_shape_check()

# Python's cyclic garbage collector: tracing a program allocates millions of short-lived objects, and each full
# collection walks every object alive (JAX, Flax, pytest, later torch). The objects imported so far are frozen out
# of the collections and the first generation's threshold is raised: 4% less CPU time on tests/core/test_generator.py
# (193, 198 -> 185, 191 s, alternating runs), the same peak RSS (1.91 GB). SDJAX_TEST_GC_DEFAULT=1 keeps Python's
# defaults.
if os.environ.get("SDJAX_TEST_GC_DEFAULT") != "1":
    import gc

    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


# Tried for the suite's time on a 2-core Zen 4 machine (2026-11-26), neither kept: one JAX persistent compilation
# cache shared by the workers for the run (compile-bound files that repeat programs gained 10-15 s each, others lost
# as much; 2359 -> 2368 worker-seconds in all), and three xdist workers (1208 -> 1486 s of wall time, with two
# short profiling runs beside it). Kept: the older CPU loop emitters (above): 2359 -> 1920 worker-seconds, 1209 ->
# 988 s of wall time.
# The longest files (worker-seconds in a full run) are handed out first: with `--dist loadfile
# --no-loadscope-reorder` (scripts/test.sh) xdist gives files to the workers in collection order, so a long file
# collected last would keep one worker busy after the other has finished. Ordered by a full run of 2026-11-29
# (one default device); a file added here must already be left out of `--quick` (QUICK_SKIPS), or it leaves it.
LONGEST_FIRST = (
    "tests/finetune/test_fsdp_runs.py",
    "tests/finetune/test_multihost_training.py",
    "tests/finetune/test_full_finetune.py",
    "tests/families/test_controlnet_parity.py",
    "tests/training/test_train.py",
    "tests/finetune/test_train_tpu_compile.py",
    "tests/evaluation/test_quality.py",
    "tests/finetune/test_flux_lora_train.py",
    "tests/loading/test_single_file.py",
    "tests/aot/test_calibrated_aot.py",
    "tests/core/test_generator.py",
    "tests/finetune/test_finetune_textual_inversion.py",
    "tests/core/test_sdxl_tasks_parity.py",
    "tests/finetune/test_run.py",
    "tests/quant/test_quant_compile.py",
    "tests/server/test_ray_serve.py",
    "tests/aot/test_flux_tpu.py",
    "tests/core/test_img2img_inpaint_parity.py",
    "tests/server/test_soak.py",
    "tests/pipelines/test_guide_controlnet.py",
    "tests/finetune/test_it_learns.py",
    "tests/finetune/test_cache_latents.py",
    "tests/cli/test_bench.py",
    "tests/finetune/test_flow_dreambooth.py",
    "tests/pipelines/test_devices.py",
    "tests/server/test_schemathesis.py",
    "tests/models/test_unet.py",
    "tests/finetune/test_flow_multihost.py",
    "tests/aot/test_aot.py",
    "tests/families/test_flux_pipeline.py",
    "tests/server/test_comfy_two_stage.py",
    "tests/server/test_comfy_real.py",
    "tests/quant/test_pipeline.py",
    "tests/pipelines/test_guide_img2img_inpaint.py",
    "tests/families/test_sd3_pipeline.py",
    "tests/server/test_sd3_controlnet_file_server.py",
    "tests/finetune/test_step_parity.py",
    "tests/finetune/test_train_sharding.py",
    "tests/server/test_sd3_controlnet_server.py",
)


# What `--quick` leaves out besides LONGEST_FIRST: the folders and files of minutes-long model comparisons.
QUICK_SKIPS = ("tests/families/", "tests/finetune/", "tests/aot/", "tests/quant/", "tests/training/", "_parity.py",
               "tests/server/test_real_model.py", "tests/server/test_flux_server.py", "tests/server/test_web_page.py",
               "tests/server/test_sd3_server.py", "tests/server/test_comfy_families.py", "tests/server/test_soak.py",
               "tests/models/",
               # seconds-long files that the full suite covers (quantized faces, benches, second and multi-host
               # paths of features the quick subset tests in their main form)
               "tests/cli/test_cli_quant_compute.py", "tests/loading/test_saved_quantized_load.py",
               "tests/samplers/test_kdiffusion_reach.py", "tests/cli/test_bench_samplers.py",
               "tests/cli/test_bench_controlnet.py", "tests/evaluation/test_quality.py",
               "tests/pipelines/test_guide_sdxl.py", "tests/parallel/test_multihost.py",
               "tests/server/test_models_real.py", "tests/pipelines/test_safety_checker_pipeline.py",
               "tests/pipelines/test_vae_tiling_pipeline.py",
               # the longest of the rest (2026-11-28: the subset took 12.6 minutes on a machine where the whole suite
               # takes about twice CI's time): device meshes, the ControlNet guide, recipes, transformer sharding, the
               # quantized models folder, the kept-kernel budget
               "tests/pipelines/test_devices.py", "tests/pipelines/test_guide_controlnet.py",
               "tests/pipelines/test_recipes.py", "tests/parallel/test_transformer_sharding.py",
               "tests/server/test_models_dir_quant.py", "tests/core/test_prepared_kernels.py",
               # 2026-11-29 (the subset took 7.2 minutes on this machine): second forms of samplers (scheduler-config
               # swaps, the torchsde reference of the SDE samplers, k-diffusion's form) and Flux nodes of ComfyUI
               "tests/samplers/test_swap_configs.py", "tests/samplers/test_dpm_sde.py",
               "tests/samplers/test_kdiffusion_form.py", "tests/server/test_comfy_flux_nodes.py")  # fmt: skip


# Single tests `--quick` leaves out from files it keeps: the longest of the subset (10-22 s each, 2026-11-29), whose
# feature the subset still reaches by a shorter test (named after each).
QUICK_SKIP_TESTS = (
    "tests/pipelines/test_guide_sd.py::test_guide_cells",  # the old API: test_summary_pmap_of_call
    "tests/cli/test_cli_embedded.py::test_generate_with_the_embedded_model",  # the CLI: tests/cli/test_cli_tasks.py
    "tests/core/test_features.py::test_zero_params_give_the_controlnet_only_generation",  # test_features' others
    "tests/core/test_shared_compile.py::test_a_second_pipeline_of_the_model_runs_the_first_ones_executables",  # ditto
    "tests/ops/test_conv.py::test_unet_and_vae_with_winograd_everywhere_match_direct",  # the per-layer conv tests
    "tests/server/test_image_endpoints.py::test_webuiapi_img2img_and_inpainting",  # test_openai_edits_and_variations
    "tests/server/test_image_endpoints.py::test_txt2img_hires_fix",  # tests/cli/test_cli_tasks.py's hires fix
    "tests/test_planning.py::test_the_hires_pass_is_planned_with_its_own_first_step",  # the planning file's others
    # 2026-11-30 (the subset took 311 s of pytest from a fresh clone): 14-21 s each
    "tests/parallel/test_sharding.py::test_model_axis_gives_the_same_images",  # test_shard_params_places_by_spec
    "tests/server/test_infotext_conditioning.py::test_flux_image_regenerates_from_its_png",  # the round trips
    "tests/cli/test_cli_models.py::test_names_from_the_models_directory_give_the_python_apis_image",  # by-name hash
)
# `--quick` hands its longest files out first (the reason of LONGEST_FIRST), measured in a full run of 2026-11-29.
QUICK_FIRST = (
    "tests/samplers/test_samplers.py",
    "tests/loading/test_lora.py",
    "tests/core/test_features.py",
    "tests/server/test_image_endpoints.py",
    "tests/server/test_cancellation.py",
    "tests/core/test_tasks.py",
    "tests/cli/test_cli_tasks.py",
    "tests/pipelines/test_guide_sd.py",
    "tests/core/test_shared_compile.py",
    "tests/samplers/test_a1111.py",
)


def _long(path: str) -> bool:
    return path in LONGEST_FIRST or any(part in path for part in QUICK_SKIPS)


def pytest_collection_modifyitems(config, items):
    first = LONGEST_FIRST
    if os.environ.get("SDJAX_TEST_QUICK") == "1":  # `scripts/test.sh --quick`: leave out the long files and `slow`
        first = QUICK_FIRST
        slow = [
            i
            for i in items
            if _long(i.nodeid.split("::")[0]) or i.nodeid in QUICK_SKIP_TESTS or i.get_closest_marker("slow")
        ]
        if slow:
            config.hook.pytest_deselected(items=slow)
            dropped = set(map(id, slow))
            items[:] = [i for i in items if id(i) not in dropped]
    rank = {name: i for i, name in enumerate(first)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Compile with XLA's default optimisation while an `xla_optimized` test (and its fixtures) runs; an
    `all_devices` test (and its fixtures) runs with every simulated device by default."""
    if item.get_closest_marker("all_devices") is not None:
        before = os.environ["SDJAX_DEVICES"]
        os.environ["SDJAX_DEVICES"] = "all"
        try:
            return (yield from _optimised(item))
        finally:
            os.environ["SDJAX_DEVICES"] = before
    return (yield from _optimised(item))


def _optimised(item):
    if _OPTIMISED or item.get_closest_marker("xla_optimized") is None:
        return (yield)
    import jax

    jax.config.update("jax_disable_most_optimizations", False)
    try:
        return (yield)
    finally:
        jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1")


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
