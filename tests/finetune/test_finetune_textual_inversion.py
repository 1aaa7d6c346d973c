"""Textual inversion (`sdjax train textual-inversion`): one step against PyTorch (diffusers' UNet and transformers'
CLIPTextModel with only the new token rows trained, as diffusers' examples/textual_inversion does), the trained
files loading in sdjax and diffusers alike, and a short run on the embedded model that changes only the token's
rows."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from finetune_helpers import ddpm_forward, min_snr_loss
from PIL import Image
from safetensors.numpy import load_file
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import step as step_lib
from sdjax.finetune import textual_inversion as ti_lib
from sdjax.pipelines import load_pipeline

TOKEN, INIT, VECTORS, GAMMA = "<star>", "star", 2, 5.0
TOKENS = [TOKEN, f"{TOKEN}_1"]
PROMPTS = [f"a photo of {TOKEN}", f"a red {TOKEN} on a blue background"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("ti-stars")
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(root / f"s{i}.png")
    (root / "s0.txt").write_text(f"a red {TOKEN} on a blue background")  # s1, s2: no caption -> templates
    return root


def _torch_reference(torch_pipe, prediction_type, batch):
    """diffusers' textual_inversion.py: new tokens added and initialised from the init word, the whole embedding
    table trainable, everything else frozen; the loss with Min-SNR-gamma as the LoRA examples weight it."""
    import torch

    tokenizer = copy.deepcopy(torch_pipe.tokenizer)
    encoder = copy.deepcopy(torch_pipe.text_encoder)
    assert tokenizer.add_tokens(TOKENS) == VECTORS
    init_ids = tokenizer.encode(INIT, add_special_tokens=False)
    assert len(init_ids) == 1
    new_ids = tokenizer.convert_tokens_to_ids(TOKENS)
    encoder.resize_token_embeddings(len(tokenizer))
    table = encoder.get_input_embeddings().weight
    with torch.no_grad():
        for i in new_ids:
            table[i] = table[init_ids[0]].clone()
    encoder.requires_grad_(False)
    encoder.get_input_embeddings().weight.requires_grad_(True)
    unet = copy.deepcopy(torch_pipe.unet).requires_grad_(False)
    prompts = [p.replace(TOKEN, " ".join(TOKENS)) for p in PROMPTS]  # diffusers' multi-vector prompts
    ids = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    context = encoder(ids)[0]
    pred, target, sched, t = ddpm_forward(unet, torch_pipe.scheduler.config, prediction_type, batch, context)
    loss = min_snr_loss(pred, target, sched, t, prediction_type, GAMMA)
    loss.backward()
    grad = table.grad.numpy()
    old_rows = np.delete(np.arange(len(tokenizer)), new_ids)
    assert np.abs(grad[old_rows]).max() > 0  # diffusers' table gradient touches every used row; it restores them
    return float(loss.detach()), grad[new_ids], ids.numpy(), table.detach().numpy()[new_ids]


def test_step_matches_diffusers_textual_inversion(sd1_dir, torch_sd1, tmp_path):
    """Epsilon and v-prediction, both losses and token-row gradients from one compiled program (the text encoder
    and UNet forward passes are the same; one compile instead of two)."""
    rng = np.random.default_rng(0)
    batch = {
        "latents": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
        "noise": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
        "timesteps": np.asarray([37, 811], np.int32),  # SNR above and below gamma
    }
    prediction_types = ("epsilon", "v_prediction")
    refs = {p: _torch_reference(torch_sd1, p, batch) for p in prediction_types}

    pipe, _ = load_pipeline(str(sd1_dir))
    base, rows = ti_lib.add_token(pipe, TOKEN, INIT, VECTORS, tmp_path / "init.safetensors")
    assert base == {"text_encoder": 49408} and rows["text_encoder"].shape == (VECTORS, 32)
    conditioning = pipe.generator.models.conditioning
    ids = conditioning.tokenize(PROMPTS)
    frozen = {c: pipe.params[c] for c in ("unet", "vae", "text_encoder")}
    models = step_lib.Models(conditioning, pipe.unet, pipe.vae)
    objectives = [step_lib.Objective(prediction_type=p, min_snr_gamma=GAMMA) for p in prediction_types]
    ac = jnp.asarray(pipe.scheduler.alphas_cumprod)
    inputs = {k: jnp.asarray(v) for k, v in batch.items()} | {
        "ids": jnp.asarray(ids),
        "clip_skip": jnp.ones((2,), jnp.int32),
        "time_ids": jnp.zeros((2, 6), jnp.float32),
        "perturbation": None,
    }

    def losses(r):
        return [jax.value_and_grad(lambda r, o=o: ti_lib.embedding_loss(r, frozen, models, o, ac, inputs))(r) for o in
                objectives]  # fmt: skip

    results = jax.jit(losses)(jax.tree_util.tree_map(jnp.asarray, rows))
    for prediction_type, (value, grads) in zip(prediction_types, results, strict=True):
        ref_loss, ref_grad, ref_ids, ref_init = refs[prediction_type]
        np.testing.assert_array_equal(rows["text_encoder"], ref_init)
        np.testing.assert_array_equal(ids, ref_ids)  # the token expands to its rows as diffusers' prompts spell them
        loss_rel = abs(float(value) - ref_loss) / abs(ref_loss)
        grad = np.asarray(grads["text_encoder"])
        grad_rel = np.linalg.norm(grad - ref_grad) / np.linalg.norm(ref_grad)
        print(
            f"{prediction_type}: loss relative error {loss_rel:.2e}, token-row gradient relative error {grad_rel:.2e}",
        )
        assert loss_rel <= 1e-5, prediction_type
        assert np.linalg.norm(ref_grad) > 0 and grad_rel <= 1e-4, prediction_type


def _train(images, out, model, **options):
    from sdjax.finetune.textual_inversion import train_textual_inversion

    return train_textual_inversion(
        images, out, model=model, token=TOKEN, init_word=INIT, vectors=VECTORS, resolution=64, **options
    )


# Micro-batches of 2, 2 per update, flips, noise offset, bfloat16 compute and Min-SNR-gamma weighting.
RUN_OPTIONS = dict(
    steps=3, lr=1e-2, batch_size=2, accumulation=2, flip=True, noise_offset=0.05, mixed_precision="bf16",
    min_snr_gamma=GAMMA,
)  # fmt: skip


@pytest.fixture(scope="module")
def sd1_runs(sd1_dir, images, tmp_path_factory):
    """Three runs on the tiny SD 1.x model with `RUN_OPTIONS`: (the unbroken 3-update run, a run stopped after one
    update, whether that stopped run wrote its file, the stopped run resumed to the end, the resumed run's file).
    The unbroken run's files are also the ones `test_trained_files_load_in_sdjax_and_diffusers` loads (one training
    run and its compile fewer than a run of its own)."""
    tmp = tmp_path_factory.mktemp("ti-sd1-runs")
    full = _train(images, tmp / "full.safetensors", str(sd1_dir), **RUN_OPTIONS)
    part_out = tmp / "part.safetensors"
    first = _train(images, part_out, str(sd1_dir), stop_after=1, **RUN_OPTIONS)
    part_written_early = part_out.exists()
    rest = _train(images, part_out, str(sd1_dir), **RUN_OPTIONS)
    return full, first, part_written_early, rest, part_out


def test_trained_files_load_in_sdjax_and_diffusers(sd1_dir, torch_sd1, sd1_runs):
    """A 3-update run on the tiny SD 1.x model (`sd1_runs`' unbroken run): the A1111 file and diffusers' file load
    with sdjax's and diffusers' `load_textual_inversion` and give the same text-encoder output for a prompt using
    the token."""
    import torch

    result = sd1_runs[0]
    out = result.out
    assert len(result.losses) == RUN_OPTIONS["steps"] and all(np.isfinite(result.losses))
    a1111 = load_file(str(out))
    diffusers_file = result.run_dir / "learned_embeds.safetensors"
    learned = load_file(str(diffusers_file))
    assert list(a1111) == ["emb_params"] and list(learned) == [TOKEN]
    np.testing.assert_array_equal(a1111["emb_params"], learned[TOKEN])
    init = load_file(str(result.run_dir / "init.safetensors"))["emb_params"]
    assert a1111["emb_params"].shape == (VECTORS, 32) and not np.allclose(a1111["emb_params"], init)

    prompt = f"a photo of {TOKEN}"
    outputs = []
    for path, token in ((out, TOKEN), (diffusers_file, None)):
        pipe, _ = load_pipeline(str(sd1_dir))
        assert pipe.load_textual_inversion(path, token=token) == TOKENS
        cond = pipe.generator.models.conditioning
        ids = cond.tokenize([prompt])
        inputs = {"ids": jnp.asarray(ids), "clip_skip": jnp.ones((1,), jnp.int32)}
        context, _ = cond.encode(pipe.params, inputs, cfg=False)
        outputs.append(np.asarray(context))
    np.testing.assert_array_equal(outputs[0], outputs[1])

    torch_pipe = copy.deepcopy(torch_sd1)
    torch_pipe.load_textual_inversion(str(diffusers_file))
    prompt_t = torch_pipe.maybe_convert_prompt(prompt, torch_pipe.tokenizer)
    t_ids = torch_pipe.tokenizer(prompt_t, padding="max_length", max_length=77, return_tensors="pt").input_ids
    np.testing.assert_array_equal(t_ids.numpy(), ids)
    with torch.no_grad():
        reference = torch_pipe.text_encoder(t_ids)[0].numpy()
    err = np.abs(outputs[0] - reference).max() / np.abs(reference).max()
    print(f"text encoder output with the token: sdjax vs diffusers, relative error {err:.2e}")
    assert err <= 1e-5


def test_embedded_run_changes_only_the_token_rows(images, tmp_path):
    """`sdjax train textual-inversion` on the embedded model (CLI): the file loads, the embedding table keeps
    every old row and gains exactly the trained rows; `sdjax generate --embedding` uses it (its file name)."""
    out = tmp_path / "star-emb.safetensors"
    args = ["train", "textual-inversion", "--data", str(images), "--token", TOKEN, "--init-word", INIT]
    args += ["--vectors", str(VECTORS), "--out", str(out), "--steps", "2", "--resolution", "64", "--lr", "1e-2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + str(result.exception)
    assert result.stdout.strip().splitlines()[-1] == str(out)
    run = tmp_path / "star-emb-run"
    assert (run / "learned_embeds.safetensors").is_file() and (run / "loss.jsonl").is_file()
    trained = load_file(str(out))["emb_params"]

    pipe, _ = load_pipeline(None)
    before = np.asarray(ti_lib._table(pipe.params["text_encoder"]))
    init = ti_lib.init_vectors(pipe.tokenizer, before, INIT, VECTORS)
    assert pipe.load_textual_inversion(out, token=TOKEN) == TOKENS
    after = np.asarray(ti_lib._table(pipe.params["text_encoder"]))
    assert after.shape == (before.shape[0] + VECTORS, before.shape[1])
    np.testing.assert_array_equal(after[: before.shape[0]], before)
    np.testing.assert_array_equal(after[before.shape[0] :], trained)
    assert np.abs(trained - init).max() > 0  # the token's rows moved

    generate = ["generate", "a photo of star-emb", "--embedding", str(out), "--steps", "2", "-q", "-o", str(tmp_path)]
    result = CliRunner().invoke(app, generate)
    assert result.exit_code == 0, result.output + str(result.exception)
    assert len(list(tmp_path.glob("*.png"))) == 1


def test_a_process_rows_keep_their_templates(sd1_dir, images):
    """`row_batches(...).load(micro, rows)` (what one process of several builds) equals those rows of the whole
    micro-batch: the same pixels and the same prompts, an uncaptioned row's template chosen by its row in the whole
    batch (were it chosen by its place among the rows asked for, some would differ)."""
    from sdjax.finetune import data as data_lib

    cfg = ti_lib.TextualInversionConfig(data=str(images), out="x.safetensors", token=TOKEN, init_word=INIT, flip=True)
    data_cfg = cfg.data_config(64)
    sampler = data_lib.Sampler(data_lib.scan(images, data_cfg), data_cfg, 3, seed=5)
    pipe, _ = load_pipeline(str(sd1_dir))
    batches = ti_lib.row_batches(cfg, sampler, pipe.generator.models.conditioning)
    differs = False
    for micro in range(4):
        whole = batches(micro)
        for rows in ([0], [1, 2], [2]):
            part = batches.load(micro, rows)
            for key in ("pixels", "time_ids", "ids"):
                np.testing.assert_array_equal(part[key], whole[key][rows], err_msg=f"{key} rows {rows}")
        # rows 1 and 2 prompted as if they were rows 0 and 1 (a split blind to the rows) get other templates
        blind = ti_lib.prompts(["", ""], TOKEN, cfg.seed, micro)
        differs |= blind != ti_lib.prompts(["", ""], TOKEN, cfg.seed, micro, [1, 2])
    assert differs


def test_bad_settings_fail_before_loading(images, tmp_path):
    from sdjax.finetune.textual_inversion import train_textual_inversion

    with pytest.raises(ValueError, match="token"):
        train_textual_inversion(images, tmp_path / "x.safetensors", token="two words", init_word=INIT)
    with pytest.raises(ValueError, match="vectors"):
        train_textual_inversion(images, tmp_path / "x.safetensors", token=TOKEN, init_word=INIT, vectors=0)
    with pytest.raises(TypeError, match="conv_rank"):  # LoCon is a LoRA setting: no such option here
        train_textual_inversion(images, tmp_path / "x.safetensors", token=TOKEN, init_word=INIT, conv_rank=4)
    result = CliRunner().invoke(
        app,
        ["train", "textual-inversion", "--data", str(tmp_path / "none"), "--token", TOKEN, "--init-word", INIT]
        + ["--out", "x.safetensors"],
    )
    assert result.exit_code == 2 and "none does not exist" in result.output


def test_sdxl_embedding_for_both_encoders(sdxl_dir, torch_sdxl, images, tmp_path):
    """SDXL: one update trains rows in both text encoders; `clip_l` / `clip_g` (A1111) load in sdjax and
    `learned_embeds.safetensors` / `learned_embeds_2.safetensors` in diffusers, with the same hidden states."""
    import torch

    out = tmp_path / "xl.safetensors"
    result = _train(images, out, str(sdxl_dir), steps=1, lr=1e-2)
    tensors = load_file(str(out))
    assert sorted(tensors) == ["clip_g", "clip_l"]
    assert tensors["clip_l"].shape == (VECTORS, 32) and tensors["clip_g"].shape == (VECTORS, 48)
    pipe, _ = load_pipeline(str(sdxl_dir))
    assert pipe.load_textual_inversion(out, token=TOKEN) == TOKENS
    cond = pipe.generator.models.conditioning
    prompt = f"a photo of {TOKEN}"
    ids = cond.tokenize([prompt])
    inputs = {"ids": jnp.asarray(ids), "clip_skip": jnp.ones((1,), jnp.int32), "time_ids": jnp.zeros((1, 6))}
    context, _ = cond.encode(pipe.params, inputs, cfg=False)

    torch_pipe = copy.deepcopy(torch_sdxl)
    for name, encoder, tokenizer in (
        ("learned_embeds.safetensors", torch_pipe.text_encoder, torch_pipe.tokenizer),
        ("learned_embeds_2.safetensors", torch_pipe.text_encoder_2, torch_pipe.tokenizer_2),
    ):
        torch_pipe.load_textual_inversion(str(result.run_dir / name), text_encoder=encoder, tokenizer=tokenizer)
    hidden = []
    for k, (encoder, tokenizer) in enumerate(
        ((torch_pipe.text_encoder, torch_pipe.tokenizer), (torch_pipe.text_encoder_2, torch_pipe.tokenizer_2))
    ):
        text = torch_pipe.maybe_convert_prompt(prompt, tokenizer)
        t_ids = tokenizer(text, padding="max_length", max_length=77, return_tensors="pt").input_ids
        np.testing.assert_array_equal(t_ids.numpy(), ids[:, k])
        with torch.no_grad():
            hidden.append(encoder(t_ids, output_hidden_states=True).hidden_states[-2].numpy())
    reference = np.concatenate(hidden, axis=-1)
    err = np.abs(np.asarray(context) - reference).max() / np.abs(reference).max()
    print(f"SDXL hidden states with the token: sdjax vs diffusers, relative error {err:.2e}")
    assert err <= 1e-5


def test_prompts_and_resume(sd1_dir, images, sd1_runs):
    """Captions naming the token stay, others get it in front, missing ones a template; a run stopped after one
    update and resumed repeats the unbroken run's losses and embedding exactly (`sd1_runs`)."""
    got = ti_lib.prompts([f"a {TOKEN}", "a red shape", ""], TOKEN, seed=0, step=3)
    assert got[:2] == [f"a {TOKEN}", f"{TOKEN}, a red shape"]
    assert got[2] in [t.format(TOKEN) for t in ti_lib.OBJECT_TEMPLATES]
    assert got == ti_lib.prompts([f"a {TOKEN}", "a red shape", ""], TOKEN, seed=0, step=3)

    full, first, part_written_early, rest, part_out = sd1_runs
    assert first.losses == full.losses[:1] and not part_written_early
    assert rest.start_step == 1 and rest.losses == full.losses[1:]
    a, b = load_file(str(full.out)), load_file(str(part_out))
    np.testing.assert_array_equal(a["emb_params"], b["emb_params"])
    with pytest.raises(ValueError, match="init_word"):
        ti_lib.train_textual_inversion(images, part_out, model=str(sd1_dir), token=TOKEN, init_word="moon", steps=4)
