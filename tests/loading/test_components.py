"""Whole pipeline folders -> sdjax components and params, compared with the PyTorch weights they came from.

The folders are the tiny diffusers pipelines of `tests/reference.py`, saved with `save_pretrained` (fixtures in
`tests/conftest.py`) and then varied: fp16/bf16 files, shards, old Flax msgpack files, damaged files.
Loaded params must equal the converted PyTorch state dict exactly (float32) or after the same rounding.
"""

import json
import logging
import os
import re
import shutil
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors.numpy import save_file

from sdjax.config import ConfigError, config_from_dict
from sdjax.loading import files
from sdjax.loading.components import load_pipeline_components
from sdjax.loading.files import CheckpointError, MissingWeightsError
from sdjax.models import clip, unet, vae
from sdjax.models.convert import WeightLoadError


def converted(torch_pipe, name: str, round_to=None) -> dict:
    """What sdjax should hold for component `name`: the torch weights (optionally rounded) converted."""
    module = getattr(torch_pipe, name)
    sd = reference.state_dict_numpy(module)
    if round_to is not None:
        sd = {k: v.astype(round_to).astype(np.float32) for k, v in sd.items()}
    if name.startswith("text_encoder"):
        proj = type(module).__name__.endswith("WithProjection")
        return clip.convert_clip_text(
            sd, clip.CLIPTextConfig.from_dict(module.config.to_diff_dict()), with_projection=proj
        )
    raw = dict(module.config)
    if name == "unet":
        return unet.convert_unet(sd, config_from_dict(unet.UNet2DConditionConfig, raw, source=name))
    return vae.convert_vae(sd, config_from_dict(vae.AutoencoderKLConfig, raw, source=name))


def assert_same_params(got, want, *, dtype=np.float32, atol=0.0):
    fg, fw = flatten_dict(got), flatten_dict(want)
    assert fg.keys() == fw.keys(), set(fg) ^ set(fw)
    for k in fw:
        g = np.asarray(fg[k])
        assert g.dtype == dtype, (k, g.dtype)
        np.testing.assert_allclose(
            g.astype(np.float32), np.asarray(fw[k], np.float32), atol=atol, rtol=0, err_msg="/".join(k)
        )


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def listing(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*")}


MODELS = ("text_encoder", "unet", "vae")


# ------------------------------------------------------------------------------------------ real folders
def test_sd1_folder_loads_the_torch_weights(sd1_dir, torch_sd1):
    components, params, model_index = load_pipeline_components(str(sd1_dir), expected_class="StableDiffusionPipeline")
    assert set(components) == {"text_encoder", "tokenizer", "unet", "vae", "scheduler"}
    assert set(params) == {"text_encoder", "unet", "vae", "scheduler"}
    assert model_index["_class_name"] == "StableDiffusionPipeline" and model_index["requires_safety_checker"] is False
    assert isinstance(components["text_encoder"], clip.CLIPTextModel)
    assert isinstance(components["unet"], unet.UNet2DConditionModel)
    assert isinstance(components["vae"], vae.AutoencoderKL)
    assert components["unet"].config.cross_attention_dim == reference.UNET_SD1["cross_attention_dim"]
    assert type(components["scheduler"]).__name__ == "PNDM"
    for name in MODELS:
        assert_same_params(params[name], converted(torch_sd1, name))
    assert {x.dtype for x in jax.tree_util.tree_leaves(params["scheduler"])} == {jnp.dtype(jnp.float32)}
    ids = components["tokenizer"](["a photo of a cat"])
    assert ids.shape == (1, 77)


def test_sdxl_folder_loads_both_text_encoders(sdxl_dir, torch_sdxl):
    components, params, model_index = load_pipeline_components(sdxl_dir, expected_class="StableDiffusionXLPipeline")
    assert isinstance(components["text_encoder_2"], clip.CLIPTextModelWithProjection)
    assert isinstance(components["text_encoder"], clip.CLIPTextModel)
    assert {"tokenizer", "tokenizer_2"} <= set(components)
    assert model_index["force_zeros_for_empty_prompt"] is True
    for name in ("text_encoder", "text_encoder_2", "unet", "vae"):
        assert_same_params(params[name], converted(torch_sdxl, name))
    # SDXL's EulerDiscreteScheduler config, parsed as diffusers does and run in its k-diffusion form
    assert type(components["scheduler"].origin).__name__ == "Euler"


def test_dtype_casts_params_not_the_scheduler_state(sd1_dir, torch_sd1):
    components, params, _ = load_pipeline_components(sd1_dir, dtype=jnp.bfloat16)
    for name in MODELS:
        assert components[name].dtype == jnp.bfloat16
        assert_same_params(params[name], converted(torch_sd1, name, round_to=ml_dtypes.bfloat16), dtype=jnp.bfloat16)
    state_dtypes = {x.dtype for x in jax.tree_util.tree_leaves(params["scheduler"])}
    assert state_dtypes <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}, state_dtypes
    assert jnp.dtype(jnp.float32) in state_dtypes
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        load_pipeline_components(sd1_dir, dtype=jnp.int8)


def test_fp16_variant_saved_by_diffusers(torch_sd1, tmp_path):
    torch_sd1.save_pretrained(tmp_path / "p", variant="fp16")
    names = {p.name for p in (tmp_path / "p" / "unet").iterdir()}
    assert "diffusion_pytorch_model.fp16.safetensors" in names
    _, params, _ = load_pipeline_components(tmp_path / "p", variant="fp16")
    for name in MODELS:
        assert_same_params(params[name], converted(torch_sd1, name))
    with pytest.raises(
        MissingWeightsError,
        match=r"text_encoder: no weight file found.*variant\(s\) \['fp16'\]: pass "
        r"variant=; files present: config\.json, model\.fp16\.safetensors",
    ):
        load_pipeline_components(tmp_path / "p")


def test_fp16_and_bf16_files_load(sd1_dir, torch_sd1, tmp_path):
    """Variant files holding fp16 (unet, vae) and bf16 (text encoder) data, as real fp16/bf16 repos do."""
    import torch
    from safetensors.torch import save_file as torch_save

    folder = copy_folder(sd1_dir, tmp_path / "p")
    for name, fname, dt in (
        ("unet", "diffusion_pytorch_model", torch.float16),
        ("vae", "diffusion_pytorch_model", torch.float16),
        ("text_encoder", "model", torch.bfloat16),
    ):
        sd = {k: v.to(dt).contiguous() for k, v in getattr(torch_sd1, name).state_dict().items()}
        torch_save(sd, folder / name / f"{fname}.half.safetensors")
    _, params, _ = load_pipeline_components(folder, variant="half")
    assert_same_params(params["unet"], converted(torch_sd1, "unet", round_to=np.float16))
    assert_same_params(params["vae"], converted(torch_sd1, "vae", round_to=np.float16))
    assert_same_params(params["text_encoder"], converted(torch_sd1, "text_encoder", round_to=ml_dtypes.bfloat16))


def test_sharded_folder_equals_unsharded(sd1_dir, torch_sd1, tmp_path):
    folder = copy_folder(sd1_dir, tmp_path / "p")
    for name in ("unet", "vae"):
        shutil.rmtree(folder / name)
        getattr(torch_sd1, name).save_pretrained(folder / name, max_shard_size="200KB")
        assert (folder / name / "diffusion_pytorch_model.safetensors.index.json").is_file()
    _, params, _ = load_pipeline_components(folder)
    for name in MODELS:
        assert_same_params(params[name], converted(torch_sd1, name))


# ------------------------------------------------------------------------------------------ old Flax folders
# The inverse of `files.FLAX_RENAMES`, written from the old Flax modules' names (transformers' FlaxCLIPLayerCollection
# named its layers "0", "1", ...; diffusers' Flax VAE attention used query/key/value/proj_attn). The table itself was
# checked against msgpack files written by the real diffusers 0.35 / transformers 4.57 Flax classes.
OLD_NAMES = {
    "text_encoder": ((r"^text_model/encoder/layers_(\d+)/", r"text_model/encoder/layers/\1/"),),
    "unet": (),
    "vae": ((r"/to_q/", "/query/"), (r"/to_k/", "/key/"), (r"/to_v/", "/value/"), (r"/to_out_0/", "/proj_attn/")),
}


def write_old_flax(params: dict, rules, path: Path) -> None:
    out = {}
    for k, v in flatten_dict(params).items():
        name = "/".join(k)
        for pattern, repl in rules:
            name = re.sub(pattern, repl, name)
        out[tuple(name.split("/"))] = np.asarray(v)
    path.write_bytes(flax.serialization.to_bytes(unflatten_dict(out)))


def test_old_flax_pipeline_folder(sd1_dir, torch_sd1, tmp_path):
    """A folder as the old Flax pipelines saved it: Flax class names, msgpack weights with the old param names."""
    folder = copy_folder(sd1_dir, tmp_path / "p")
    for name, fname in (
        ("text_encoder", "flax_model.msgpack"),
        ("unet", "diffusion_flax_model.msgpack"),
        ("vae", "diffusion_flax_model.msgpack"),
    ):
        for f in (folder / name).glob("*.safetensors"):
            f.unlink()
        write_old_flax(converted(torch_sd1, name), OLD_NAMES[name], folder / name / fname)
    index = json.loads((folder / "model_index.json").read_text())
    index.update(
        _class_name="FlaxStableDiffusionPipeline",
        unet=["diffusers", "FlaxUNet2DConditionModel"],
        vae=["diffusers", "FlaxAutoencoderKL"],
        text_encoder=["transformers", "FlaxCLIPTextModel"],
        scheduler=["diffusers", "FlaxPNDMScheduler"],
        safety_checker=["diffusers", "DummyChecker"],
        feature_extractor=["transformers", "CLIPFeatureExtractor"],
    )
    (folder / "model_index.json").write_text(json.dumps(index))
    components, params, _ = load_pipeline_components(
        folder, expected_class="StableDiffusionPipeline", overrides={"safety_checker": None}
    )
    assert "safety_checker" not in components and "feature_extractor" not in components
    for name in MODELS:
        assert_same_params(params[name], converted(torch_sd1, name))
    assert type(components["scheduler"]).__name__ == "PNDM"
    # The guides' variant="bf16" on such a folder: no bf16 files, so the plain weights (rounded by dtype).
    _, p16, _ = load_pipeline_components(folder, variant="bf16", dtype=jnp.bfloat16, overrides={"safety_checker": None})
    assert_same_params(p16["unet"], converted(torch_sd1, "unet", round_to=ml_dtypes.bfloat16), dtype=jnp.bfloat16)


# ------------------------------------------------------------------------------------------ components and overrides
def test_optional_components_are_skipped_with_a_warning(sd1_dir, tmp_path, caplog):
    """An optional component of a class sdjax lacks is skipped with a warning; the safety checker is loaded, so a
    model_index that names it without its folder is an error that says how to go without it."""
    folder = copy_folder(sd1_dir, tmp_path / "p")
    index = json.loads((folder / "model_index.json").read_text())
    index["image_encoder"] = ["transformers", "CLIPVisionModelWithProjection"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="sdjax.loading.components"):
        components, _, _ = load_pipeline_components(folder)
    assert "skipping optional component image_encoder" in caplog.text
    assert "image_encoder" not in components and "safety_checker" not in components
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sdjax.loading.components"):
        load_pipeline_components(folder, overrides={"image_encoder": None})
    assert "skipping" not in caplog.text

    index["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]
    index["feature_extractor"] = ["transformers", "CLIPImageProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"safety_checker/ .*safety_checker=None"):
        load_pipeline_components(folder)
    # Without the checker, its image processor is not needed either.
    components, _, _ = load_pipeline_components(folder, overrides={"safety_checker": None})
    assert "safety_checker" not in components and "feature_extractor" not in components


def test_overrides_replace_and_disable(sd1_dir):
    from sdjax import samplers

    euler = samplers.get_sampler("euler")
    components, params, _ = load_pipeline_components(sd1_dir, overrides={"scheduler": euler, "vae": None})
    assert components["scheduler"] is euler and "vae" not in components and "vae" not in params
    assert type(params["scheduler"]).__name__ == type(euler.create_state()).__name__
    with pytest.raises(ValueError, match=r"override\(s\) \['schedular'\] name no component"):
        load_pipeline_components(sd1_dir, overrides={"schedular": euler})


def test_expected_class_mismatch(sd1_dir):
    with pytest.raises(ValueError, match=r"describes a StableDiffusionPipeline, not a StableDiffusionXLPipeline"):
        load_pipeline_components(sd1_dir, expected_class="StableDiffusionXLPipeline")


def test_hub_repo_downloads_only_what_is_loaded(sd1_dir, torch_sd1, tmp_path, monkeypatch):
    """A repo id goes through `snapshot_download` with the exact files to load: no safety checker weights when it
    is disabled, no `.bin` twins; checks that need only model_index.json fail before any download."""
    import huggingface_hub

    snap = copy_folder(sd1_dir, tmp_path / "snap")
    edit_json(snap / "model_index.json", safety_checker=["stable_diffusion", "StableDiffusionSafetyChecker"])
    (snap / "safety_checker").mkdir()
    (snap / "safety_checker" / "config.json").write_text("{}")
    (snap / "safety_checker" / "model.safetensors").write_bytes(b"not downloaded")
    repo_files = [str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()]
    repo_files += [
        "unet/diffusion_pytorch_model.bin",
        "text_encoder/pytorch_model.bin",
        "vae/diffusion_flax_model.msgpack",
    ]
    calls = []
    monkeypatch.setattr(files, "_list_repo_files", lambda repo_id, revision, token: repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, name, **kw: str(snap / name))
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo_id, **kw: calls.append(kw["allow_patterns"]) or str(snap)
    )
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    components, params, _ = load_pipeline_components(
        "org/tiny-sd1", expected_class="StableDiffusionPipeline", overrides={"safety_checker": None}
    )
    tokenizer_files = {f for f in repo_files if f.startswith("tokenizer/")}
    assert tokenizer_files >= {"tokenizer/vocab.json", "tokenizer/merges.txt"}
    assert set(calls[0]) == tokenizer_files | {
        "model_index.json",
        "scheduler/scheduler_config.json",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
    }
    assert not any(p.startswith("safety_checker") or p.endswith((".bin", ".msgpack")) for p in calls[0])
    assert_same_params(params["unet"], converted(torch_sd1, "unet"))
    calls.clear()
    with pytest.raises(ValueError, match="describes a StableDiffusionPipeline, not a StableDiffusionXLPipeline"):
        load_pipeline_components("org/tiny-sd1", expected_class="StableDiffusionXLPipeline")
    edit_json(snap / "model_index.json", unet=["diffusers", "UNet3DConditionModel"])
    with pytest.raises(ValueError, match="cannot load component"):
        load_pipeline_components("org/tiny-sd1")
    assert calls == []


# ------------------------------------------------------------------------------------------ bad input
@pytest.fixture
def damaged(sd1_dir, tmp_path):
    """A private copy of the SD1 folder to damage."""
    return copy_folder(sd1_dir, tmp_path / "p")


def edit_json(path: Path, **changes) -> None:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _unet_weights(folder: Path) -> Path:
    return folder / "unet" / "diffusion_pytorch_model.safetensors"


def truncate(folder):
    p = _unet_weights(folder)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def corrupt_header(folder):
    p = _unet_weights(folder)
    raw = bytearray(p.read_bytes())
    raw[8:16] = b"\xff\xfe{not js"
    p.write_bytes(bytes(raw))


def shard_and_drop(folder):
    reader = files.read_safetensors(_unet_weights(folder))
    data = {k: reader[k] for k in reader}
    keys = sorted(data)
    _unet_weights(folder).unlink()
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: data[k] for k in part}, folder / "unet" / name)
        weight_map.update({k: name for k in part})
    (folder / "unet" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    (folder / "unet" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()


BAD_INPUT = {
    "missing model_index": (
        lambda f: (f / "model_index.json").unlink(),
        {},
        FileNotFoundError,
        r"/p: not a diffusers pipeline folder: model_index\.json not found",
    ),
    "missing component folder": (
        lambda f: shutil.rmtree(f / "vae"),
        {},
        FileNotFoundError,
        r"/p: component folder\(s\) vae/ \(\[diffusers, AutoencoderKL\]\) "
        r"named in model_index\.json do not exist",
    ),
    "missing weight file": (
        lambda f: _unet_weights(f).unlink(),
        {},
        MissingWeightsError,
        r"/p/unet: no weight file found.*files present: config\.json",
    ),
    "unknown variant": (
        lambda f: None,
        {"variant": "fp16"},
        MissingWeightsError,
        r"/p/text_encoder: no weights of variant 'fp16'.*model\.safetensors",
    ),
    "truncated safetensors": (truncate, {}, CheckpointError, r"unet/diffusion_pytorch_model\.safetensors: truncated"),
    "corrupt header": (corrupt_header, {}, CheckpointError, r"unet/diffusion_pytorch_model\.safetensors: corrupt"),
    "shape disagrees with config": (
        lambda f: edit_json(f / "unet" / "config.json", cross_attention_dim=40),
        {},
        WeightLoadError,
        r"unet \(.*/p/unet\): the weights do not match",
    ),
    "index names a missing shard": (
        shard_and_drop,
        {},
        MissingWeightsError,
        r"index\.json: names shard file\(s\) that do not exist: "
        r"diffusion_pytorch_model-00002-of-00002\.safetensors",
    ),
    "unknown library/class": (
        lambda f: edit_json(f / "model_index.json", unet=["diffusers", "UNet3DConditionModel"]),
        {},
        ValueError,
        r"cannot load component\(s\) unet: \['diffusers', "
        r"'UNet3DConditionModel'\]",
    ),
    "unknown scheduler": (
        lambda f: edit_json(f / "model_index.json", scheduler=["diffusers", "CMStochasticIterativeScheduler"]),
        {},
        ValueError,
        r"scheduler: \['diffusers', 'CMStochasticIterativeScheduler'\].*PNDMScheduler",
    ),
    # a flow-matching scheduler on an SD model's (variance-preserving) config: its betas would be dropped
    "flow scheduler on an SD model": (
        lambda f: edit_json(f / "model_index.json", scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"]),
        {},
        ValueError,
        r"scheduler_config.json: FlowMatchEulerDiscreteScheduler config: .*variance-preserving",
    ),
    "bad config key": (
        lambda f: edit_json(f / "vae" / "config.json", new_arch_knob=3),
        {},
        ConfigError,
        r"vae/config\.json: unknown config key\(s\) \['new_arch_knob'\]",
    ),
    "component entry malformed": (
        lambda f: edit_json(f / "model_index.json", unet=["diffusers"]),
        {},
        ValueError,
        r"component 'unet' must be \[library, class\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_named(damaged, case):
    damage, kwargs, exc, pattern = BAD_INPUT[case]
    damage(damaged)
    before = listing(damaged)
    with pytest.raises(exc, match=pattern) as e:
        load_pipeline_components(damaged, **kwargs)
    if case == "shape disagrees with config":
        assert "to_k/kernel" in str(e.value) and "mis-shaped" in str(e.value)
    assert listing(damaged) == before, "a failed load changed the folder"


# ------------------------------------------------------------------------------------------ memory
_PEAK_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
from sdjax.loading import files
from sdjax.loading.components import make_cast
from sdjax.models.convert import convert_state_dict

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])  # KiB

path, n, rows, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
expected = {f"blocks_{i}": {"proj": {"kernel": jax.ShapeDtypeStruct((1024, rows), jnp.float32)}} for i in range(n)}
jax.block_until_ready(make_cast(dtype)(jnp.zeros((2, 2)).__array__()))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
before = status("VmRSS")
params = convert_state_dict(files.read_safetensors(path), expected, component="big", cast=make_cast(dtype))
jax.block_until_ready(params)
print(json.dumps({"peak_kib": status("VmHWM") - before}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("dtype,limit", [("float32", 1.35), ("bfloat16", 0.85)])
def test_peak_memory_of_a_load_stays_near_one_copy(tmp_path, dtype, limit):
    """Converting a 256 MB checkpoint (64 tensors of 4 MB) grows peak RSS by about the params it produces plus one
    tensor: about 1.1x the file in float32, 0.6x in bfloat16 (never the 2-3x of reading everything first)."""
    import subprocess
    import sys

    n, rows = 64, 1024
    save_file(
        {f"blocks.{i}.proj.weight": np.full((rows, 1024), i, np.float32) for i in range(n)},
        tmp_path / "big.safetensors",
    )
    size_kib = (tmp_path / "big.safetensors").stat().st_size / 1024
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "big.safetensors"), str(n), str(rows), dtype],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"]
    assert peak < limit * size_kib, f"peak RSS grew by {peak / size_kib:.2f}x the checkpoint size"


def test_reads_stay_in_the_calling_thread_while_threads_cast():
    """`convert_state_dict` reads every key in the caller's thread (a state dict need not be thread safe) and casts
    in worker threads, with at most `2 * CAST_WORKERS` tensors read and not yet cast; the params are those of
    casting one tensor at a time, and a failing cast fails the load with its own error."""
    import threading
    import time

    from sdjax.models import convert

    caller = threading.get_ident()
    events = {"read": 0, "cast": 0, "most_waiting": 0, "cast_threads": set()}
    lock = threading.Lock()

    class Recording(dict):
        def __getitem__(self, key):
            assert threading.get_ident() == caller
            with lock:
                events["read"] += 1
                events["most_waiting"] = max(events["most_waiting"], events["read"] - events["cast"])
            return super().__getitem__(key)

    def cast(x):
        time.sleep(0.002)  # slower than a read: the waiting casts pile up to the bound
        with lock:
            events["cast"] += 1
            events["cast_threads"].add(threading.get_ident())
        return jnp.asarray(x * 2)

    rng = np.random.default_rng(0)
    sd = {f"blocks.{i}.proj.weight": rng.standard_normal((3, 2 + i % 3)).astype(np.float32) for i in range(40)}
    expected = {
        f"blocks_{i}": {"proj": {"kernel": jax.ShapeDtypeStruct((2 + i % 3, 3), jnp.float32)}} for i in range(40)
    }
    got = convert.convert_state_dict(Recording(sd), expected, component="c", cast=cast)
    one_by_one = convert.convert_state_dict(sd, expected, component="c")
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(one_by_one)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(one_by_one)):
        np.testing.assert_array_equal(np.asarray(a), 2 * b)
    assert events["read"] == events["cast"] == 40 and caller not in events["cast_threads"]
    assert events["most_waiting"] <= 2 * convert.CAST_WORKERS + 1  # the bound, and the one being read

    def broken(x):
        raise RuntimeError("the device is full")

    with pytest.raises(RuntimeError, match="the device is full"):
        convert.convert_state_dict(sd, expected, component="c", cast=broken)
