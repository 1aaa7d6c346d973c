"""`sdjax serve --models-dir` over an AUTOMATIC1111 models folder, on the fake pipeline: the listing endpoints'
shapes against the files made here, refresh, switching to a checkpoint in a sub-folder (title with its hash),
model settings honoured or refused with 422 naming the key. The real model's CLIP skip and embeddings:
test_models_real.py."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from fake_pipeline import FakePipeline
from safetensors.numpy import save_file
from server_helpers import check_image, client, live_server
from test_server_errors import assert_error

A1111 = "/sdapi/v1/txt2img"


def touch(path, data: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def models(tmp_path):
    root = tmp_path / "models"
    touch(root / "Stable-diffusion" / "base.safetensors", b"base")
    touch(root / "Stable-diffusion" / "anime" / "waifu.safetensors", b"waifu")
    touch(root / "Stable-diffusion" / "xl" / "model_index.json", b"{}")
    (root / "Lora").mkdir(parents=True)
    tensor = {"lora_unet_x.lora_down.weight": np.zeros((1, 1), np.float32)}
    save_file(tensor, str(root / "Lora" / "detail.safetensors"), metadata={"ss_output_name": "DetailTweaker"})
    touch(root / "Lora" / "broken.safetensors", b"not a safetensors file")
    touch(root / "embeddings" / "style.safetensors")
    touch(root / "VAE" / "mse.safetensors")
    touch(root / "VAE" / "xl-vae" / "config.json", b"{}")
    return root


@pytest.fixture
def served(models):
    loads = []

    def loader(path: str):
        loads.append(path)
        return FakePipeline(size=(48, 48))

    config = dict(loader=loader, models_dir=str(models), model_name="base", max_batch=1, warm=False,
                  checkpoint="base.safetensors")  # fmt: skip
    with live_server(FakePipeline(), **config) as s, client(s.url) as c:
        yield s, c, loads


def test_listings_match_the_files(served, models):
    _, c, _ = served
    assert c.get("/sdapi/v1/sd-models").json() == [
        {"title": "anime/waifu.safetensors", "model_name": "anime_waifu", "hash": None, "sha256": None,
         "filename": "Stable-diffusion/anime/waifu.safetensors", "config": None},
        {"title": "base.safetensors", "model_name": "base", "hash": None, "sha256": None,
         "filename": "Stable-diffusion/base.safetensors", "config": None},
        {"title": "xl", "model_name": "xl", "hash": None, "sha256": None, "filename": "Stable-diffusion/xl",
         "config": None},
    ]  # fmt: skip
    assert c.get("/sdapi/v1/loras").json() == [
        {"name": "broken", "alias": "broken", "path": "Lora/broken.safetensors", "metadata": {}},
        {"name": "detail", "alias": "DetailTweaker", "path": "Lora/detail.safetensors",
         "metadata": {"ss_output_name": "DetailTweaker"}},
    ]  # fmt: skip
    assert c.get("/sdapi/v1/sd-vae").json() == [
        {"model_name": "mse.safetensors", "filename": "VAE/mse.safetensors"},
        {"model_name": "xl-vae", "filename": "VAE/xl-vae"},
    ]
    # the fake pipeline cannot take embeddings: nothing loaded (the real model: test_models_real.py)
    assert c.get("/sdapi/v1/embeddings").json() == {"loaded": {}, "skipped": {}}


def test_refresh_rescans(served, models):
    _, c, _ = served
    assert len(c.get("/sdapi/v1/loras").json()) == 2
    touch(models / "Lora" / "new.safetensors")
    touch(models / "Stable-diffusion" / "new.safetensors")
    touch(models / "VAE" / "new.safetensors")
    assert len(c.get("/sdapi/v1/loras").json()) == 2  # cached until refreshed, as A1111
    for path in ("/sdapi/v1/refresh-loras", "/sdapi/v1/refresh-checkpoints", "/sdapi/v1/refresh-vae"):
        r = c.post(path)
        assert r.status_code == 200 and r.json() is None
    assert "new" in [x["name"] for x in c.get("/sdapi/v1/loras").json()]
    assert "new.safetensors" in [x["title"] for x in c.get("/sdapi/v1/sd-models").json()]
    assert "new.safetensors" in [x["model_name"] for x in c.get("/sdapi/v1/sd-vae").json()]


def test_switching_to_a_checkpoint_in_a_sub_folder(served, models):
    s, c, loads = served
    assert c.get("/sdapi/v1/options").json()["sd_model_checkpoint"] == "base.safetensors"
    for bad, words in (("../Lora/detail", "not a name inside"), ("/etc/passwd", "not a name inside"),
                       ("wiafu", "did you mean ['anime/waifu.safetensors']")):  # fmt: skip
        assert_error(c.post("/sdapi/v1/options", json={"sd_model_checkpoint": bad}), 422, "sd_model_checkpoint", words)
    assert c.post("/sdapi/v1/options", json={"sd_model_checkpoint": "anime/waifu"}).status_code == 200
    path = models / "Stable-diffusion" / "anime" / "waifu.safetensors"
    assert loads == [str(path.resolve())]
    short = hashlib.sha256(b"waifu").hexdigest()[:10]
    title = f"anime/waifu.safetensors [{short}]"
    assert c.get("/sdapi/v1/options").json()["sd_model_checkpoint"] == title
    listed = {m["model_name"]: m for m in c.get("/sdapi/v1/sd-models").json()}
    assert listed["anime_waifu"]["title"] == title and listed["anime_waifu"]["hash"] == short
    assert listed["anime_waifu"]["sha256"] == hashlib.sha256(b"waifu").hexdigest()
    # any name of the served checkpoint is "the same model"; another one is not switched per request
    for same in (title, "anime/waifu", "anime_waifu", short):
        r = c.post(A1111, json={"prompt": "x", "seed": 2, "override_settings": {"sd_model_checkpoint": same}})
        check_image(r.json()["images"][0], model="waifu", width=48, height=48)
    assert c.post("/sdapi/v1/options", json={"sd_model_checkpoint": "waifu"}).status_code == 200
    assert len(loads) == 1  # already served: not loaded again
    r = c.post(A1111, json={"prompt": "x", "override_settings": {"sd_model_checkpoint": "base"}})
    assert_error(r, 422, "override_settings.sd_model_checkpoint", "cannot be honoured")


def test_model_settings_honoured_or_refused(served):
    _, c, _ = served
    ok = {"sd_vae": "Automatic", "CLIP_stop_at_last_layers": 1}
    r = c.post(A1111, json={"prompt": "x", "seed": 3, "override_settings": ok})
    check_image(r.json()["images"][0])
    assert json.loads(r.json()["info"])["clip_skip"] == 1
    for settings, key, words in (
        ({"sd_vae": "msee"}, "override_settings.sd_vae", "did you mean ['mse.safetensors']"),
        ({"sd_vae": "../VAE/mse"}, "override_settings.sd_vae", "not a name inside"),
        ({"sd_vae": "mse.safetensors"}, "override_settings.sd_vae", "cannot switch VAEs"),  # the fake has no VAE
        ({"CLIP_stop_at_last_layers": 2}, "override_settings.CLIP_stop_at_last_layers", "no CLIP text encoder"),
        ({"CLIP_stop_at_last_layers": True}, "override_settings.CLIP_stop_at_last_layers", "not an int"),
    ):
        assert_error(c.post(A1111, json={"prompt": "x", "override_settings": settings}), 422, key, words)
    assert_error(c.post("/sdapi/v1/options", json={"sd_vae": "xl-vae"}), 422, "sd_vae", "cannot switch VAEs")
    assert c.post("/sdapi/v1/options", json={"sd_vae": "None"}).status_code == 200
    assert_error(
        c.post("/sdapi/v1/options", json={"CLIP_stop_at_last_layers": 3}), 422, "CLIP_stop_at_last_layers", "no CLIP"
    )


def test_prompt_lora_tags_name_what_exists(served):
    _, c, _ = served
    r = c.post(A1111, json={"prompt": "a cat <lora:detial:0.6>"})
    assert_error(r, 422, "prompt", "did you mean ['detail']")
    r = c.post(A1111, json={"prompt": "a cat", "negative_prompt": "<lora:nope:1>"})
    assert_error(r, 422, "negative_prompt", "available: ['broken', 'detail']")
    r = c.post(A1111, json={"prompt": "a cat <lora:../Lora/detail:1>"})
    assert_error(r, 422, "prompt", "not a name inside")
    r = c.post(A1111, json={"prompt": "a cat <hypernet:detail:1>"})
    assert_error(r, 422, "prompt", "only <lora:...> tags")
    r = c.post(A1111, json={"prompt": "a cat <lora:detail:0.6>"})  # the real model: test_models_real.py
    assert_error(r, 422, "prompt", "this pipeline cannot apply LoRAs")


def test_without_a_models_directory_the_served_model_is_listed():
    with live_server(FakePipeline(), warm=False) as s, client(s.url) as c:
        assert [m["title"] for m in c.get("/sdapi/v1/sd-models").json()] == ["fake-model"]
        assert c.get("/sdapi/v1/loras").json() == [] and c.get("/sdapi/v1/sd-vae").json() == []
        assert c.post("/sdapi/v1/refresh-checkpoints").status_code == 200


def test_serve_resolves_names_in_the_models_directory(models, monkeypatch):
    from typer.testing import CliRunner

    from sdjax import cli, server

    loads, seen = [], {}
    monkeypatch.setattr(cli.serve, "load_pipeline", lambda model, dtype: loads.append(model) or FakePipeline())
    monkeypatch.setattr(
        cli.serve, "_load_with_vae", lambda model, dtype, vae: loads.append((model, vae)) or FakePipeline()
    )
    monkeypatch.setattr(server, "serve", lambda pipe, config, **kw: seen.update(config=config, **kw))
    r = CliRunner().invoke(cli.app, ["serve", "--models-dir", str(models), "-m", "anime/waifu", "--vae", "mse"])
    assert r.exit_code == 0, r.output
    path = (models / "Stable-diffusion" / "anime" / "waifu.safetensors").resolve()
    assert loads == [(str(path), str((models / "VAE" / "mse.safetensors").resolve()))]
    config = seen["config"]
    short = hashlib.sha256(b"waifu").hexdigest()[:10]
    assert (config.model_name, config.checkpoint, config.vae_name) == (
        "waifu",
        f"anime/waifu.safetensors [{short}]",
        "mse.safetensors",
    )
    for args, option in ((["-m", "wiafu"], "--model"), (["--vae", "../VAE/mse"], "--vae")):
        r = CliRunner().invoke(cli.app, ["serve", "--models-dir", str(models), *args])
        assert r.exit_code == 2 and option in r.output, r.output


def test_pickled_embeddings_load_only_when_allowed(tmp_path):
    """A1111's `.pt` embeddings in `embeddings/`: skipped by default (pickles are refused), read by the restricted
    unpickler with `serve --allow-pickle`, their vectors appended to the token table under the file's name."""
    torch = pytest.importorskip("torch")
    import sdjax
    from sdjax.loading import textual_inversion as ti
    from sdjax.models_dir import ModelsDir
    from sdjax.pipelines import load_pipeline
    from sdjax.server import models_api

    for sub in ("Stable-diffusion", "embeddings"):  # the A1111 layout
        (tmp_path / sub).mkdir()
    vectors = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    a1111 = {"string_to_token": {"*": 265}, "string_to_param": {"*": torch.from_numpy(vectors)}, "name": "qzold",
             "step": 1500, "sd_checkpoint": "abcdef", "sd_checkpoint_name": "model"}  # fmt: skip
    torch.save(a1111, tmp_path / "embeddings" / "qzold.pt")
    md = ModelsDir(tmp_path)
    pipe, _ = load_pipeline(sdjax.EMBEDDED_MODEL)
    assert models_api.load_embeddings(pipe, md) == {"loaded": {}, "skipped": {"qzold": dict.fromkeys(
        ("step", "sd_checkpoint", "sd_checkpoint_name", "shape", "vectors"))}}  # fmt: skip
    size = pipe.text_encoder.config.vocab_size
    body = models_api.load_embeddings(pipe, md, allow_pickle=True)
    assert body["loaded"]["qzold"]["vectors"] == 2 and body["loaded"]["qzold"]["shape"] == 64
    assert list(pipe.tokenizer(["qzold"])[0][1:3]) == [size, size + 1]
    table = pipe.params["text_encoder"]
    for k in ti.TOKEN_EMBEDDING:
        table = table[k]
    np.testing.assert_array_equal(np.asarray(table)[size : size + 2], vectors)
