"""The A1111-layout models directory (`sdjax.models_dir`): listing, name resolution, refusal of names that would
leave it, close matches, the older flat layout, hashes. Files are empty stand-ins: nothing is loaded."""

from __future__ import annotations

import hashlib
import os

import pytest

from sdjax.models_dir import ModelsDir


def touch(path, data: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "models"
    sd = r / "Stable-diffusion"
    touch(sd / "base.safetensors", b"base weights")
    touch(sd / "anime" / "waifu.safetensors", b"other weights")
    touch(sd / "anime" / "waifu.vae.safetensors")  # A1111's VAE beside a checkpoint: not a checkpoint
    touch(sd / "notes.txt")
    touch(sd / "xl" / "model_index.json", b"{}")
    touch(sd / "xl" / "unet" / "diffusion_pytorch_model.safetensors")  # inside a model folder: not listed
    touch(r / "Lora" / "detail.safetensors")
    touch(r / "Lora" / "styles" / "ink.safetensors")
    touch(r / "embeddings" / "bad-hands.safetensors")
    touch(r / "embeddings" / "old.pt")
    touch(r / "VAE" / "mse.safetensors")
    touch(r / "VAE" / "xl-vae" / "config.json", b"{}")
    touch(r / "ControlNet" / "canny" / "config.json", b"{}")
    touch(r / "ControlNet" / "control_v11p_sd15_depth.safetensors")
    outside = tmp_path / "outside"
    touch(outside / "secret.safetensors")
    (outside / "model_index.json").write_text("{}")
    os.symlink(outside / "secret.safetensors", sd / "leak.safetensors")
    os.symlink(outside, sd / "leakdir")
    os.symlink(outside / "secret.safetensors", r / "Lora" / "leak.safetensors")
    return r


def test_listing_follows_a1111(root):
    md = ModelsDir(root)
    assert md.a1111
    assert [e.name for e in md.list("checkpoint")] == ["anime/waifu.safetensors", "base.safetensors", "xl"]
    waifu = md.list("checkpoint")[0]
    assert (waifu.stem, waifu.model_name, waifu.short_name) == ("anime/waifu", "anime_waifu", "waifu")
    assert md.names("lora") == ["detail", "styles/ink"]
    assert md.names("embedding") == ["bad-hands", "old"]
    assert [e.name for e in md.list("vae")] == ["mse.safetensors", "xl-vae"]
    assert [e.name for e in md.list("controlnet")] == ["canny", "control_v11p_sd15_depth.safetensors"]


@pytest.mark.parametrize(
    "kind,name,expected",
    [
        ("checkpoint", "base", "base.safetensors"),
        ("checkpoint", "base.safetensors", "base.safetensors"),
        ("checkpoint", "anime/waifu", "anime/waifu.safetensors"),
        ("checkpoint", "anime\\waifu.safetensors", "anime/waifu.safetensors"),  # a Windows client's name
        ("checkpoint", "anime_waifu", "anime/waifu.safetensors"),  # A1111's model_name
        ("checkpoint", "xl", "xl"),
        ("checkpoint", "BASE", "base.safetensors"),
        ("lora", "ink", "styles/ink.safetensors"),  # <lora:ink:1> as A1111 names it
        ("lora", "styles/ink", "styles/ink.safetensors"),
        ("embedding", "old", "old.pt"),
        ("vae", "mse", "mse.safetensors"),
        ("vae", "xl-vae", "xl-vae"),
        ("lora", "ink.safetensors", "styles/ink.safetensors"),  # a file name alone, as A1111's VAE names
    ],
)
def test_names_with_and_without_extension(root, kind, name, expected):
    entry = ModelsDir(root).resolve(kind, name)
    assert entry.name == expected
    assert entry.path == root.resolve() / {"checkpoint": "Stable-diffusion", "lora": "Lora", "embedding": "embeddings",
                                           "vae": "VAE"}[kind] / expected  # fmt: skip


@pytest.mark.parametrize(
    "name",
    ["../Lora/detail", "../../outside/secret", "anime/../../Lora/detail.safetensors", "/etc/passwd",
     "/tmp/x.safetensors", "..", "a\x00b"],
)  # fmt: skip
def test_names_never_leave_the_directory(root, name):
    with pytest.raises(ValueError, match="not a name inside the models directory") as e:
        ModelsDir(root).resolve("checkpoint", name)
    assert repr(name) in str(e.value)


@pytest.mark.parametrize("kind,name", [("checkpoint", "leak"), ("checkpoint", "leakdir"), ("lora", "leak")])
def test_links_pointing_outside_are_refused_by_name(root, kind, name):
    md = ModelsDir(root)
    assert name not in md.names(kind) and f"{name}.safetensors" not in md.names(kind)
    with pytest.raises(ValueError, match=f"'{name}' is a link pointing outside"):
        md.resolve(kind, name)


def test_links_inside_are_served_and_cycles_end(root):
    os.symlink(root / "Stable-diffusion" / "base.safetensors", root / "Stable-diffusion" / "alias.safetensors")
    os.symlink(root / "Stable-diffusion", root / "Stable-diffusion" / "anime" / "loop")  # a cycle
    md = ModelsDir(root)
    assert md.resolve("checkpoint", "alias").path.name == "alias.safetensors"
    assert md.names("checkpoint") == ["alias.safetensors", "anime/waifu.safetensors", "base.safetensors", "xl"]


def test_unknown_names_list_close_matches_or_what_exists(root):
    md = ModelsDir(root)
    with pytest.raises(LookupError, match=r"no model 'wiafu'.*did you mean \['anime/waifu.safetensors'\]"):
        md.resolve("checkpoint", "wiafu")
    with pytest.raises(LookupError, match=r"no LoRA 'zzz'.*available: \['detail', 'styles/ink'\]"):
        md.resolve("lora", "zzz")
    with pytest.raises(ValueError, match="must be a non-empty string"):
        md.resolve("vae", " ")
    empty = root.parent / "empty"
    (empty / "Stable-diffusion").mkdir(parents=True)
    with pytest.raises(LookupError, match="has no Lora/ folder"):
        ModelsDir(empty).resolve("lora", "detail")
    with pytest.raises(ValueError, match="is not a folder"):
        ModelsDir(root / "nope")


def test_ambiguous_short_names_ask_for_the_full_name(root):
    touch(root / "Lora" / "more" / "ink.safetensors")
    with pytest.raises(LookupError, match="ambiguous"):
        ModelsDir(root).resolve("lora", "ink")
    assert ModelsDir(root).resolve("lora", "more/ink").name == "more/ink.safetensors"


def test_listing_is_cached_until_refresh_and_a_miss_rescans(root):
    md = ModelsDir(root)
    assert md.names("lora") == ["detail", "styles/ink"]
    touch(root / "Lora" / "new.safetensors")
    assert md.names("lora") == ["detail", "styles/ink"]  # cached, as A1111 until its refresh endpoint
    md.refresh("lora")
    assert md.names("lora") == ["detail", "new", "styles/ink"]
    touch(root / "Lora" / "newer.safetensors")
    assert md.resolve("lora", "newer").name == "newer.safetensors"  # a miss rescans


def test_titles_and_hashes(root):
    md = ModelsDir(root)
    base = md.resolve("checkpoint", "base")
    assert md.title(base) == "base.safetensors"  # the hash is not known until the file is read
    digest = md.hashes.sha256(base.path)
    assert digest == hashlib.sha256(b"base weights").hexdigest()
    assert md.title(base) == f"base.safetensors [{digest[:10]}]"
    assert md.resolve("checkpoint", f"base.safetensors [{digest[:10]}]") == base  # A1111's title
    assert md.resolve("checkpoint", digest[:10]) == base  # and its short hash
    touch(base.path, b"replaced")  # another file: its hash is read again
    assert md.hashes.known(base.path) is None


def test_webui_folder_and_embeddings_beside_models(tmp_path):
    touch(tmp_path / "webui" / "models" / "Stable-diffusion" / "a.safetensors")
    touch(tmp_path / "webui" / "embeddings" / "e.safetensors")
    md = ModelsDir(tmp_path / "webui")
    assert md.root == (tmp_path / "webui" / "models").resolve()
    assert md.names("checkpoint") == ["a.safetensors"] and md.names("embedding") == ["e"]


def test_flat_folder_of_diffusers_models_still_works(tmp_path):
    for name in ("small", "wide"):
        touch(tmp_path / name / "model_index.json", b"{}")
    (tmp_path / "not-a-model").mkdir()
    touch(tmp_path / "loose.safetensors")
    md = ModelsDir(tmp_path)
    assert not md.a1111
    assert md.names("checkpoint") == ["small", "wide"]
    assert md.resolve("checkpoint", "wide").path == (tmp_path / "wide").resolve()
    assert md.folder("lora") is None and md.list("vae") == []
    for bad in ("../small", "small/../wide"):
        with pytest.raises(ValueError):
            md.resolve("checkpoint", bad)
    with pytest.raises(LookupError):
        md.resolve("checkpoint", "not-a-model")


def test_network_hash_skips_the_safetensors_header(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / "x.safetensors"
    save_file({"w": np.arange(6, dtype=np.float32)}, str(path), metadata={"ss_output_name": "x"})
    data = path.read_bytes()
    body = data[8 + int.from_bytes(data[:8], "little") :]
    md_hashes = ModelsDir(tmp_path).hashes
    assert md_hashes.network_hash(path) == hashlib.sha256(body).hexdigest()  # A1111's "addnet" hash
    save_file({"w": np.arange(6, dtype=np.float32)}, str(path), metadata={"ss_output_name": "renamed"})
    assert md_hashes.network_hash(path) == hashlib.sha256(body).hexdigest()  # metadata edits keep it
