"""`sdjax generate` with an AUTOMATIC1111 models directory on the embedded model: `--model`, `--vae`, `--embedding`
and `<lora:...>` names from the directory and `--clip-skip` give the Python API's image with the same weights loaded
by path; the PNG's infotext keeps the tag and says "Clip skip" and "VAE" as A1111 writes them. Bad names exit with
status 2 naming the option before any model loads."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

import sdjax
from sdjax import cli, infotext, metadata
from sdjax.cli import models as cli_models

pytestmark = pytest.mark.skipif(
    not (Path(sdjax.EMBEDDED_MODEL) / "model_index.json").is_file(), reason="the embedded model is not in this checkout"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A models directory around a copy of the embedded model (its VAE shifted in VAE/, an embedding, a LoRA)."""
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(sdjax.EMBEDDED_MODEL, root / "Stable-diffusion" / "sd" / "tiny")
    shutil.copytree(Path(sdjax.EMBEDDED_MODEL) / "vae", root / "VAE" / "shift")
    weights = root / "VAE" / "shift" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state["decoder.conv_out.bias"] = state["decoder.conv_out.bias"] + 0.2
    save_file(state, str(weights))
    rng = np.random.default_rng(0)
    (root / "embeddings").mkdir()
    inky = {"emb_params": rng.standard_normal((2, 64)).astype(np.float32)}
    save_file(inky, str(root / "embeddings" / "inky.safetensors"))
    (root / "Lora").mkdir()
    layer = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"  # kohya's name of a text-encoder layer
    lora = {
        f"{layer}.lora_down.weight": rng.standard_normal((4, 64)).astype(np.float32),
        f"{layer}.lora_up.weight": rng.standard_normal((64, 4)).astype(np.float32),
        f"{layer}.alpha": np.asarray(4.0, np.float32),
    }
    save_file(lora, str(root / "Lora" / "ink-lora.safetensors"))
    (root / "Stable-diffusion" / "single.safetensors").write_bytes(b"a single-file checkpoint stand-in")
    return root


def run(*args):
    return CliRunner().invoke(cli.app, ["generate", *args])


def test_names_from_the_models_directory_give_the_python_apis_image(models, tmp_path):
    from sdjax.pipelines import load_pipeline

    prompt = "an inky cat <lora:ink-lora:0.8>"
    names = ["--models-dir", str(models), "-m", "sd/tiny", "--vae", "shift", "--embedding", "inky", "--clip-skip", "2"]
    r = run(prompt, "--prompt-syntax", "a1111", *names, "--steps", "2", "--seed", "3", "-q", "-o", str(tmp_path))
    assert r.exit_code == 0, r.output
    (png,) = tmp_path.glob("*.png")
    text = infotext.read_parameters(png)
    assert text.startswith(prompt + "\n")  # the tag stays in the prompt, as A1111 writes it
    assert "Model: tiny, VAE: shift" in text and "Clip skip: 2" in text
    data = (models / "Lora" / "ink-lora.safetensors").read_bytes()
    addnet = hashlib.sha256(data[8 + int.from_bytes(data[:8], "little") :]).hexdigest()[:12]
    assert f'Lora hashes: "ink-lora: {addnet}"' in text  # A1111's field
    ti = hashlib.sha256((models / "embeddings" / "inky.safetensors").read_bytes()).hexdigest()[:12]
    assert f'TI hashes: "inky: {ti}"' in text  # the embedding's whole-file SHA-256, as A1111 writes it
    p = metadata.parameters_from_text(text)
    assert (p.clip_skip, p.vae, p.seed, p.steps) == (2, "shift", 3, 2)

    ref, _ = load_pipeline(str(models / "Stable-diffusion" / "sd" / "tiny"), vae=str(models / "VAE" / "shift"))
    ref.load_textual_inversion(models / "embeddings" / "inky.safetensors", token="inky")
    ref.load_lora(models / "Lora" / "ink-lora.safetensors", scale=0.8)
    want = np.asarray(ref.generate("an inky cat", seed=3, steps=2, clip_skip=2, prompt_syntax="a1111")[0], np.int16)
    got = np.asarray(Image.open(png).convert("RGB"), np.int16)
    assert np.abs(got - want).max() <= 1


def test_bad_names_exit_2_naming_the_option_before_loading(models, tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cli.generate, "load_pipeline", no_load)
    monkeypatch.setattr(cli.generate, "_load_with_vae", no_load)
    d = ["--models-dir", str(models)]
    for args, option, words in (
        ([*d, "-m", "sd/tny"], "--model", "did you mean ['sd/tiny']"),
        ([*d, "-m", "../Lora/ink-lora"], "--model", "not a name inside the models directory"),
        ([*d, "-m", "/no/such/model.safetensors"], "--model", "not a name inside"),  # (a path that exists is a path)
        ([*d, "--vae", "shfit"], "--vae", "did you mean ['shift']"),
        ([*d, "--embedding", "inkk"], "--embedding", "did you mean ['inky']"),
        ([*d, "--lora", "nope:0.5"], "--lora", "no LoRA 'nope'"),
        ([*d, "--prompt-syntax", "a1111", "-n", "<lora:nope:1>"], "--negative-prompt", "no LoRA 'nope'"),
        (["--models-dir", str(tmp_path / "missing")], "--models-dir", "is not a folder"),
        (["--vae", "shift"], "--vae", "--models-dir"),
        ([*d, "--clip-skip", "0"], "--clip-skip", ""),
    ):
        r = run("a cat", *args, "-q", "-o", str(tmp_path))
        assert r.exit_code == 2, (args, r.output)
        flat = " ".join(r.output.split())
        assert option in flat and words in flat, (args, flat)


def test_a_single_file_checkpoint_by_name_is_hashed_for_the_infotext(models):
    weights = cli_models.resolve_weights(
        models_dir=models, model="single", vae=None, embeddings=None, loras=None, lora_dir=None, prompt="x",
        negative_prompt="", a1111_syntax=False,
    )  # fmt: skip
    path = (models / "Stable-diffusion" / "single.safetensors").resolve()
    assert (weights.model, weights.model_label, weights.model_file) == (str(path), "single", path)
    short = hashlib.sha256(path.read_bytes()).hexdigest()[:10]
    assert cli_models.model_hash(weights) == short
    params = metadata.ImageParameters("x", "", 2, "euler", 7.0, 1, 64, 64, model="single", model_hash=short)
    assert f"Model hash: {short}, Model: single" in params.infotext()
    assert metadata.parameters_from_text(params.infotext()).model_hash == short
    # a Hub id is still a Hub id when the directory has no folder of that name
    hub = cli_models.resolve_model(cli_models.open_models_dir(models), "org/some-model")
    assert hub == ("org/some-model", None, None)


def test_ti_hashes_name_the_embeddings_a_prompt_uses(tmp_path):
    files = []
    for name in ("inky", "blue", "a:b"):
        (tmp_path / f"{name}.pt").write_bytes(name.encode())
        files.append((name, tmp_path / f"{name}.pt"))
    h = {name: hashlib.sha256(name.encode()).hexdigest()[:12] for name in ("inky", "blue", "a:b")}
    texts = ["an inky, (inky:1.2) cat", "inkyness; not blue-ish", "a:b"]
    # "blue-ish" holds "blue" as a word (A1111's tokenizer splits at "-"); "inkyness" does not hold "inky"
    assert infotext.ti_hashes(texts, files) == f"inky: {h['inky']}, blue: {h['blue']}, ab: {h['a:b']}"
    assert infotext.ti_hashes(["inkyness", "bluer"], files[:2]) == ""


def test_infotext_fields_and_batch_keys_of_model_settings():
    from fake_pipeline import FakePipeline

    base = metadata.ImageParameters("a cat <lora:ink:0.5>", "", 4, "euler_a", 7.0, 1, 64, 64, model="m")
    p = metadata.dataclasses.replace(base, clip_skip=2, vae="v.safetensors", model_hash="0123456789",
                                     loras=(("ink", 0.5),), lora_hashes="ink: 0123456789ab")  # fmt: skip
    text = p.infotext()
    assert text.startswith("a cat <lora:ink:0.5>\n")
    assert "Size: 64x64, Model hash: 0123456789, Model: m, VAE: v.safetensors, Clip skip: 2" in text
    back = metadata.parameters_from_text(text)
    assert (back.clip_skip, back.vae, back.model_hash) == (2, "v.safetensors", "0123456789")
    assert back.lora_hashes == "ink: 0123456789ab" and 'Lora hashes: "ink: 0123456789ab"' in text
    assert "Clip skip" not in base.infotext()  # A1111 writes it only above 1
    # CLIP skip is an input of the program: batch-mates may differ; a LoRA set or a VAE is a batch of its own
    assert metadata.dataclasses.replace(base, clip_skip=2).shape_key == base.shape_key
    assert p.shape_key != metadata.dataclasses.replace(p, loras=()).shape_key
    assert p.shape_key != metadata.dataclasses.replace(p, vae="").shape_key
    # generate_images takes out the tags of the applied LoRAs (and refuses any other)
    fake = FakePipeline()
    tagged = metadata.dataclasses.replace(base, loras=(("ink", 0.5),))
    metadata.generate_images(fake, [tagged])
    assert fake.calls[-1]["prompts"] == ["a cat "]
    with pytest.raises(ValueError, match="<lora:ink:...> is not among the applied LoRAs"):
        metadata.generate_images(fake, [metadata.dataclasses.replace(base, loras=(("other", 1.0),))])
