"""Checkpoint files: weight-file choice, safetensors/msgpack readers, Hub resolution (no network: a fake HF cache
and a monkeypatched `snapshot_download`)."""

import json
import logging
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from sdjax.loading import files
from sdjax.loading.files import CheckpointError, MissingWeightsError

RNG = np.random.default_rng(0)


def tensors(n=3, shape=(4, 5), dtype=np.float32):
    return {f"layer.{i}.weight": RNG.standard_normal(shape).astype(dtype) for i in range(n)}


def touch(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_bytes(b"x")
    return folder


def listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


# ------------------------------------------------------------------------------------------ safetensors reading
def test_safetensors_roundtrip_f32_f16(tmp_path):
    data = {
        **tensors(2),
        **{f"h.{i}": v for i, v in enumerate(tensors(2, (3,), np.float16).values())},
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
    }
    save_file(data, tmp_path / "a.safetensors", metadata={"format": "pt"})
    reader = files.read_safetensors(tmp_path / "a.safetensors")
    assert set(reader) == set(data) and len(reader) == len(data)
    for k, v in data.items():
        got = reader[k]
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got, v)
    assert reader.metadata == {"a.safetensors": {"format": "pt"}}
    # Nothing is cached: each lookup is a fresh array.
    a = reader["h.0"]
    a[...] = 0
    np.testing.assert_array_equal(reader["h.0"], data["h.0"])


def test_safetensors_bf16_written_by_torch(tmp_path):
    import torch
    from safetensors.torch import save_file as torch_save

    t = torch.randn(7, 3).to(torch.bfloat16)
    torch_save({"w": t, "e": torch.zeros(0, 4, dtype=torch.bfloat16)}, tmp_path / "b.safetensors")
    reader = files.read_safetensors(tmp_path / "b.safetensors")
    assert reader["w"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(reader["w"].astype(np.float32), t.float().numpy())
    assert reader["e"].shape == (0, 4)


def test_truncated_safetensors_names_the_file(tmp_path):
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(tensors(4, (64, 64)), path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors: truncated"):
        files.read_safetensors(path)
    path.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors: truncated"):
        files.read_safetensors(path)


@pytest.mark.parametrize("damage", ["json", "size", "offsets", "dtype", "duplicate"])
def test_corrupt_header_names_the_file(tmp_path, damage):
    path = tmp_path / "model.safetensors"
    save_file(tensors(2), path)
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    if damage == "json":
        raw[8:12] = b"#!@$"
    elif damage == "size":
        raw[:8] = (10**12).to_bytes(8, "little")
    else:
        key = next(k for k in header if k != "__metadata__")
        if damage == "offsets":
            header[key]["data_offsets"][1] += 4
        elif damage == "dtype":
            header[key]["dtype"] = "C64"
        text = json.dumps(header)
        if damage == "duplicate":
            text = text[:-1] + ", " + json.dumps({key: header[key]})[1:]
        raw = bytearray(len(text).to_bytes(8, "little") + text.encode() + raw[8 + n :])
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt|unsupported dtype C64"):
        files.read_safetensors(path)


def write_shards(folder: Path, data: dict, n: int, index_name: str, shard_fmt: str) -> dict:
    keys = sorted(data)
    weight_map = {}
    for i in range(n):
        name = shard_fmt.format(i + 1, n)
        part = {k: data[k] for k in keys[i::n]}
        save_file(part, folder / name)
        weight_map.update({k: name for k in part})
    (folder / index_name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return weight_map


def test_sharded_equals_unsharded(tmp_path):
    data = tensors(7)
    save_file(data, tmp_path / "model.safetensors")
    sh = tmp_path / "sharded"
    sh.mkdir()
    write_shards(sh, data, 3, "model.safetensors.index.json", "model-{:05d}-of-{:05d}.safetensors")
    chosen = files.select_weight_files(sh)
    assert chosen.format == "safetensors" and chosen.index == sh / "model.safetensors.index.json"
    assert len(chosen.files) == 3
    one, many = files.read_safetensors(tmp_path / "model.safetensors"), files.read_safetensors(chosen.index)
    assert set(one) == set(many)
    for k in one:
        np.testing.assert_array_equal(one[k], many[k])


def test_index_naming_a_missing_shard(tmp_path):
    write_shards(tmp_path, tensors(4), 2, "model.safetensors.index.json", "model-{:05d}-of-{:05d}.safetensors")
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        MissingWeightsError,
        match=r"model\.safetensors\.index\.json: names shard file\(s\) that do "
        r"not exist: model-00002-of-00002\.safetensors",
    ):
        files.select_weight_files(tmp_path)
    with pytest.raises(MissingWeightsError, match="model-00002-of-00002.safetensors"):
        files.read_safetensors(tmp_path / "model.safetensors.index.json")


def test_index_disagreeing_with_shards(tmp_path):
    wm = write_shards(tmp_path, tensors(4), 2, "i.safetensors.index.json", "s-{:05d}-of-{:05d}.safetensors")
    key = next(iter(wm))
    wm[key] = "s-00002-of-00002.safetensors" if wm[key].startswith("s-00001") else "s-00001-of-00002.safetensors"
    (tmp_path / "i.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=rf"do not match the index: {key}"):
        files.read_safetensors(tmp_path / "i.safetensors.index.json")


def test_duplicate_key_across_shards_names_both_files(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, tmp_path / "x.safetensors")
    save_file({"a": np.zeros(2, np.float32), "b": np.ones(1, np.float32)}, tmp_path / "y.safetensors")
    with pytest.raises(CheckpointError, match=r"'a' is stored twice: in .*x\.safetensors and in .*y\.safetensors"):
        files.read_safetensors([tmp_path / "x.safetensors", tmp_path / "y.safetensors"])


def test_reading_holds_one_tensor_at_a_time(tmp_path):
    """Peak traced memory while reading every tensor of a 64 MB file (and dropping each) stays near one tensor."""
    mb = 2**20
    data = {f"t{i}": np.full((mb,), i, np.float64) for i in range(8)}  # 8 x 8 MB
    save_file(data, tmp_path / "big.safetensors")
    del data
    tracemalloc.start()
    try:
        reader = files.read_safetensors(tmp_path / "big.safetensors")
        total = 0.0
        for k in reader:
            total += float(reader[k][0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == sum(range(8))
    assert peak < 2.5 * 8 * mb, f"peak {peak / mb:.1f} MB while reading 8 MB tensors"


# ------------------------------------------------------------------------------------------ choosing weight files
def test_preference_order(tmp_path):
    d = touch(
        tmp_path / "unet",
        "diffusion_pytorch_model.bin",
        "diffusion_flax_model.msgpack",
        "diffusion_pytorch_model.safetensors",
        "config.json",
    )
    w = files.select_weight_files(d)
    assert (w.format, w.files, w.variant) == ("safetensors", (d / "diffusion_pytorch_model.safetensors",), None)
    (d / "diffusion_pytorch_model.safetensors").unlink()
    assert files.select_weight_files(d).format == "flax"
    (d / "diffusion_flax_model.msgpack").unlink()
    assert files.select_weight_files(d).format == "torch"
    te = touch(tmp_path / "te", "flax_model.msgpack", "model.safetensors", "pytorch_model.bin")
    assert files.select_weight_files(te).files == (te / "model.safetensors",)


def test_variant_is_honoured(tmp_path):
    d = touch(
        tmp_path / "vae",
        "diffusion_pytorch_model.safetensors",
        "diffusion_pytorch_model.fp16.safetensors",
        "diffusion_flax_model.msgpack",
    )
    w = files.select_weight_files(d, variant="fp16")
    assert w.files == (d / "diffusion_pytorch_model.fp16.safetensors",) and w.variant == "fp16"
    assert files.select_weight_files(d).files == (d / "diffusion_pytorch_model.safetensors",)


def test_unknown_variant_names_folder_and_files(tmp_path):
    d = touch(tmp_path / "unet", "diffusion_pytorch_model.safetensors", "config.json")
    with pytest.raises(
        MissingWeightsError,
        match=r"unet: no weights of variant 'fp8'.*files present: config\.json, "
        r"diffusion_pytorch_model\.safetensors",
    ):
        files.select_weight_files(d, variant="fp8")


def test_bf16_variant_falls_back_to_plain_weights_with_a_warning(tmp_path, caplog):
    d = touch(tmp_path / "unet", "diffusion_flax_model.msgpack")
    with caplog.at_level(logging.WARNING, logger="sdjax.loading.files"):
        w = files.select_weight_files(d, variant="bf16")
    assert w.files == (d / "diffusion_flax_model.msgpack",) and w.variant is None
    assert "no bf16 variant" in caplog.text and "diffusion_flax_model.msgpack" in caplog.text
    touch(d, "diffusion_flax_model.bf16.msgpack")
    assert files.select_weight_files(d, variant="bf16").variant == "bf16"


@pytest.mark.parametrize(
    "index_name",
    [
        "diffusion_pytorch_model.safetensors.index.fp16.json",
        "diffusion_pytorch_model.safetensors.fp16.index.json",
        "model.fp16.safetensors.index.json",
        "model.safetensors.index.fp16.json",
    ],
)
def test_sharded_variant_index_spellings(tmp_path, index_name):
    stem = index_name.split(".")[0]
    write_shards(tmp_path, tensors(3), 2, index_name, stem + ".fp16-{:05d}-of-{:05d}.safetensors")
    write_shards(tmp_path, tensors(3), 2, f"{stem}.safetensors.index.json", stem + "-{:05d}-of-{:05d}.safetensors")
    w = files.select_weight_files(tmp_path, variant="fp16")
    assert w.index == tmp_path / index_name and all(".fp16-" in p.name for p in w.files)
    assert all(".fp16" not in p.name for p in files.select_weight_files(tmp_path).files)


def test_sharded_variant_saved_by_diffusers(tmp_path):
    """`save_pretrained(variant="fp16", max_shard_size=...)` output is found and equals the unsharded weights."""
    import reference

    model = reference.vae(reference.VAE)
    model.save_pretrained(tmp_path / "sharded", variant="fp16", max_shard_size="50KB")
    model.save_pretrained(tmp_path / "single", variant="fp16")
    w = files.select_weight_files(tmp_path / "sharded", variant="fp16")
    assert w.index is not None and len(w.files) > 2
    with pytest.raises(MissingWeightsError, match="no weight file found"):
        files.select_weight_files(tmp_path / "sharded")
    sharded = files.read_safetensors(w.index)
    single = files.read_safetensors(files.select_weight_files(tmp_path / "single", variant="fp16").files)
    assert set(sharded) == set(single) == set(model.state_dict())
    for k in single:
        np.testing.assert_array_equal(sharded[k], single[k])


def test_bin_without_torch_says_convert(tmp_path, monkeypatch):
    d = touch(tmp_path / "unet", "diffusion_pytorch_model.bin", "config.json")
    monkeypatch.setattr(files, "torch_available", lambda: False)
    with pytest.raises(
        MissingWeightsError,
        match=r"unet: the weights to load are PyTorch pickles "
        r"\(diffusion_pytorch_model\.bin\).*safetensors",
    ):
        files.select_weight_files(d)


def test_bin_with_torch_loads(tmp_path):
    import torch

    sd = {"a.weight": torch.randn(3, 2), "b": torch.randn(4).to(torch.bfloat16)}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    w = files.select_weight_files(tmp_path)
    got = files.read_weights(w)
    np.testing.assert_array_equal(got["a.weight"], sd["a.weight"].numpy())
    np.testing.assert_array_equal(got["b"].astype(np.float32), sd["b"].float().numpy())


def test_no_weights_lists_files(tmp_path):
    d = touch(tmp_path / "unet", "config.json", "README.md")
    with pytest.raises(
        MissingWeightsError,
        match=r"unet: no weight file found.*files present: README\.md, "
        r"config\.json",
    ):
        files.select_weight_files(d)
    with pytest.raises(FileNotFoundError, match="component folder not found: .*nothere"):
        files.select_weight_files(tmp_path / "nothere")


# ------------------------------------------------------------------------------------------ Flax msgpack
def old_flax_clip_tree(state_dict: dict) -> dict:
    """A transformers-4 Flax CLIP params tree, written by the old naming rules (independent of sdjax's table):
    `text_model/encoder/layers/N/...`, Linear kernel (in, out), LayerNorm scale, Embed embedding."""
    from flax.traverse_util import unflatten_dict

    out = {}
    for key, v in state_dict.items():
        if key.endswith("position_ids"):
            continue
        parts = key.split(".")
        leaf = parts[-1]
        if leaf == "weight":
            if "embedding" in parts[-2]:
                leaf = "embedding"
            elif "norm" in parts[-2]:
                leaf = "scale"
            else:
                leaf, v = "kernel", v.T
        out[tuple(parts[:-1] + [leaf])] = v
    return unflatten_dict(out)


def test_msgpack_roundtrip_clip(tmp_path):
    import flax.serialization
    import reference
    from flax.traverse_util import flatten_dict

    from sdjax.models import clip

    torch_model = reference.text_encoder(reference.CLIP_SDXL_2, with_projection=True)
    sd = reference.state_dict_numpy(torch_model)
    (tmp_path / "flax_model.msgpack").write_bytes(flax.serialization.to_bytes(old_flax_clip_tree(sd)))
    config = clip.CLIPTextConfig(**reference.CLIP_SDXL_2)
    expected = clip.CLIPTextModelWithProjection.init_params_shape(config)
    tree = files.read_flax_msgpack(tmp_path / "flax_model.msgpack")
    assert "0" in tree["text_model"]["encoder"]["layers"]  # the old naming really is in the file
    got = files.flax_params_to_sdjax(tree, expected, family="clip", component="text_encoder_2")
    ref = clip.convert_clip_text(sd, config, with_projection=True)
    fg, fr = flatten_dict(got), flatten_dict(ref)
    assert fg.keys() == fr.keys()
    for k in fr:
        np.testing.assert_array_equal(np.asarray(fg[k]), np.asarray(fr[k]))
    # A `{"params": ...}` wrapper is accepted too.
    (tmp_path / "wrapped.msgpack").write_bytes(flax.serialization.to_bytes({"params": old_flax_clip_tree(sd)}))
    assert flatten_dict(files.read_flax_msgpack(tmp_path / "wrapped.msgpack")).keys() == flatten_dict(tree).keys()


def test_msgpack_vae_attention_names_are_renamed():
    expected = {
        "encoder": {
            "mid_block": {
                "attentions_0": {
                    "to_q": {"kernel": np.zeros((4, 4)), "bias": np.zeros(4)},
                    "to_out_0": {"kernel": np.zeros((4, 4)), "bias": np.zeros(4)},
                    "group_norm": {"scale": np.zeros(4), "bias": np.zeros(4)},
                }
            }
        }
    }
    old = {
        "encoder": {
            "mid_block": {
                "attentions_0": {
                    "query": {"kernel": np.eye(4), "bias": np.arange(4.0)},
                    "proj_attn": {"kernel": 2 * np.eye(4), "bias": np.ones(4)},
                    "group_norm": {"scale": np.ones(4), "bias": np.zeros(4)},
                }
            }
        }
    }
    got = files.flax_params_to_sdjax(old, expected, family="vae", component="vae")
    np.testing.assert_array_equal(got["encoder"]["mid_block"]["attentions_0"]["to_out_0"]["kernel"], 2 * np.eye(4))
    np.testing.assert_array_equal(got["encoder"]["mid_block"]["attentions_0"]["to_q"]["bias"], np.arange(4.0))


def test_msgpack_mismatch_is_reported_by_name():
    from sdjax.models.convert import WeightLoadError

    expected = {"conv_in": {"kernel": np.zeros((3, 3, 4, 8)), "bias": np.zeros(8)}, "conv_out": {"bias": np.zeros(4)}}
    tree = {"conv_in": {"kernel": np.zeros((3, 3, 4, 9)), "bias": np.zeros(8)}, "extra": {"bias": np.zeros(1)}}
    with pytest.raises(WeightLoadError) as e:
        files.flax_params_to_sdjax(tree, expected, family="unet", component="unet (here)")
    msg = str(e.value)
    assert "unet (here)" in msg and "conv_out/bias" in msg and "extra/bias" in msg and "conv_in/kernel" in msg
    with pytest.raises(ValueError, match="no old-Flax naming table for model family 'controlnet'"):
        files.flax_params_to_sdjax(tree, expected, family="controlnet", component="controlnet")


def test_corrupt_msgpack_names_the_file(tmp_path):
    import flax.serialization

    raw = flax.serialization.to_bytes({"a": {"kernel": np.ones((64, 64), np.float32)}})
    path = tmp_path / "diffusion_flax_model.msgpack"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match=r"diffusion_flax_model\.msgpack: not a readable Flax msgpack"):
        files.read_flax_msgpack(path)
    path.write_bytes(b"\x00not msgpack at all")
    with pytest.raises(CheckpointError, match=r"diffusion_flax_model\.msgpack"):
        files.read_flax_msgpack(path)


# ------------------------------------------------------------------------------------------ folders and the Hub
MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": "0.30.0",
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "scheduler": ["diffusers", "PNDMScheduler"],
    "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
    "feature_extractor": ["transformers", "CLIPImageProcessor"],
    "image_encoder": [None, None],
    "requires_safety_checker": True,
}

REPO_FILES = [
    "model_index.json",
    "README.md",
    "v1-5-pruned.ckpt",
    ".gitattributes",
    "unet/config.json",
    "unet/diffusion_pytorch_model.bin",
    "unet/diffusion_pytorch_model.safetensors",
    "unet/diffusion_pytorch_model.fp16.bin",
    "unet/diffusion_pytorch_model.fp16.safetensors",
    "unet/diffusion_flax_model.msgpack",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors.index.json",
    "vae/diffusion_pytorch_model-00001-of-00002.safetensors",
    "vae/diffusion_pytorch_model-00002-of-00002.safetensors",
    "vae/diffusion_pytorch_model.safetensors.index.fp16.json",
    "vae/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
    "vae/diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "text_encoder/model.fp16.safetensors",
    "text_encoder/pytorch_model.bin",
    "text_encoder/flax_model.msgpack",
    "tokenizer/merges.txt",
    "tokenizer/vocab.json",
    "tokenizer/special_tokens_map.json",
    "tokenizer/tokenizer_config.json",
    "scheduler/scheduler_config.json",
    "safety_checker/config.json",
    "safety_checker/model.safetensors",
    "safety_checker/pytorch_model.bin",
    "feature_extractor/preprocessor_config.json",
    "unet/onnx/model.onnx",
]


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """Patch the three Hub calls; record what `snapshot_download` was asked for."""
    calls = {}
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "model_index.json").write_text(json.dumps(MODEL_INDEX))

    def list_files(repo_id, revision, token):
        calls["list"] = (repo_id, revision)
        return list(REPO_FILES)

    def hf_hub_download(repo_id, filename, **kw):
        assert filename == "model_index.json"
        return str(tmp_path / "hub" / filename)

    def snapshot_download(repo_id, **kw):
        calls["snapshot"] = kw
        return str(tmp_path / "hub")

    import huggingface_hub

    monkeypatch.setattr(files, "_list_repo_files", list_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def test_hub_downloads_only_needed_files(fake_hub):
    folder = files.resolve_model_dir(
        "org/sd", revision="main", components=lambda idx: ["unet", "vae", "text_encoder", "tokenizer", "scheduler"]
    )
    assert folder.name == "hub"
    got = set(fake_hub["snapshot"]["allow_patterns"])
    assert got == {
        "model_index.json",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors.index.json",
        "vae/diffusion_pytorch_model-00001-of-00002.safetensors",
        "vae/diffusion_pytorch_model-00002-of-00002.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/merges.txt",
        "tokenizer/vocab.json",
        "tokenizer/special_tokens_map.json",
        "tokenizer/tokenizer_config.json",
        "scheduler/scheduler_config.json",
    }
    assert fake_hub["snapshot"]["revision"] == "main" and fake_hub["list"] == ("org/sd", "main")


def test_hub_variant_downloads_only_that_variant(fake_hub):
    files.resolve_model_dir("org/sd", variant="fp16", components=["unet", "vae", "text_encoder"])
    got = set(fake_hub["snapshot"]["allow_patterns"])
    weights = {p for p in got if not p.endswith(("config.json", "model_index.json"))}
    assert weights == {
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "vae/diffusion_pytorch_model.safetensors.index.fp16.json",
        "vae/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "vae/diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
        "text_encoder/model.fp16.safetensors",
    }


def test_hub_default_components_skip_null_entries(fake_hub):
    files.resolve_model_dir("org/sd")
    got = set(fake_hub["snapshot"]["allow_patterns"])
    assert "safety_checker/model.safetensors" in got and "safety_checker/pytorch_model.bin" not in got
    assert "feature_extractor/preprocessor_config.json" in got
    assert not any(p.startswith("image_encoder") or p.endswith((".bin", ".msgpack", ".ckpt", ".onnx")) for p in got)


def test_hub_unknown_variant_fails_before_downloading(fake_hub):
    with pytest.raises(MissingWeightsError, match=r"org/sd@main/unet: no weights of variant 'int8'"):
        files.resolve_model_dir("org/sd", variant="int8", components=["unet"])
    assert "snapshot" not in fake_hub


def make_cached_repo(cache: Path, repo_id: str, snapshot: dict[str, bytes], ref: str = "main") -> Path:
    """The HF cache layout: models--org--name/{refs/<ref>, snapshots/<hash>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(commit)
    root = repo / "snapshots" / commit
    for name, data in snapshot.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_offline_from_fake_cache(tmp_path, monkeypatch):
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("network call while offline")

    monkeypatch.setattr(files, "_list_repo_files", no_network)
    root = make_cached_repo(
        tmp_path / "cache",
        "org/tiny",
        {"model_index.json": json.dumps(MODEL_INDEX).encode(), "unet/config.json": b"{}"},
    )
    got = files.resolve_model_dir("org/tiny", local_files_only=True, cache_dir=tmp_path / "cache")
    assert got == root
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert files.resolve_model_dir("org/tiny", cache_dir=tmp_path / "cache") == root
    with pytest.raises(FileNotFoundError, match=r"org/other@main: not in the Hugging Face cache"):
        files.resolve_model_dir("org/other", cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=r"org/tiny@fp16: not in the Hugging Face cache"):
        files.resolve_model_dir("org/tiny", revision="fp16", cache_dir=tmp_path / "cache")
    assert huggingface_hub.snapshot_download  # the real function was used


def test_local_folder_and_bad_names(tmp_path):
    assert files.resolve_model_dir(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="revision='fp16' applies to Hub repo ids"):
        files.resolve_model_dir(tmp_path, revision="fp16")
    with pytest.raises(FileNotFoundError, match="neither an existing folder nor a valid Hub repo id"):
        files.resolve_model_dir(str(tmp_path / "missing" / "folder"))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match="f.txt is a file"):
        files.resolve_model_dir(tmp_path / "f.txt")


def test_missing_model_index(tmp_path):
    touch(tmp_path / "unet", "config.json")
    with pytest.raises(
        FileNotFoundError,
        match=r"not a diffusers pipeline folder: model_index\.json not found "
        r"\(files present: unet\)",
    ):
        files.read_model_index(tmp_path)


def test_errors_leave_no_files_behind(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(tensors(2), path)
    path.write_bytes(path.read_bytes()[:-3])
    before = listing(tmp_path)
    for call in (
        lambda: files.read_safetensors(path),
        lambda: files.select_weight_files(tmp_path, variant="x"),
        lambda: files.read_flax_msgpack(path),
    ):
        with pytest.raises((CheckpointError, MissingWeightsError)):
            call()
    assert listing(tmp_path) == before
