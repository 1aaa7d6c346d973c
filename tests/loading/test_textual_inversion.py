"""Textual-inversion embeddings against diffusers 0.42's `load_textual_inversion` on the tiny models.

Files: a diffusers `learned_embeds.safetensors` (`{token: (D,)}`), an A1111 multi-vector `emb_params` `(3, D)`
(trigger: the file name; diffusers is told the same token) and an SDXL `clip_l` + `clip_g` pair. Compared: the
prompt ids (with diffusers' multi-vector prompt expansion), the text embeddings of prompt and negative prompt, and
one image. Tolerances (float32): embeddings 1e-5 absolute, images 1e-3.
"""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from sdjax.loading import textual_inversion as ti

torch = pytest.importorskip("torch")

ATOL = 1e-5
PROMPT = "a photo of <cat-toy> on a beach, my-style, old-style"
NEGATIVE = "my-style, blurry"


@pytest.fixture(scope="module")
def embeddings(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embeddings")
    rng = np.random.default_rng(0)
    single = tmp / "learned_embeds.safetensors"
    save_file({"<cat-toy>": rng.standard_normal(32).astype(np.float32)}, str(single))
    multi = tmp / "my-style.safetensors"
    save_file({"emb_params": rng.standard_normal((3, 32)).astype(np.float32)}, str(multi))
    xl = tmp / "xl-style.safetensors"
    save_file(
        {
            "clip_l": rng.standard_normal((2, 32)).astype(np.float32),
            "clip_g": rng.standard_normal((2, 48)).astype(np.float32),
        },
        str(xl),
    )
    pickled = tmp / "old-style.pt"  # A1111's torch.save layout (its "name" is not the trigger: the file name is)
    vec = torch.from_numpy(rng.standard_normal((2, 32)).astype(np.float32)).requires_grad_()
    torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": vec}, "name": "other", "step": 3}, pickled)
    return {"single": single, "multi": multi, "xl": xl, "pickled": pickled}


@pytest.fixture(scope="module")
def sd1_ti(sd1_dir, torch_sd1, embeddings):
    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    pipe.devices = jax.devices()[:1]
    assert pipe.load_textual_inversion(embeddings["single"]) == ["<cat-toy>"]
    assert pipe.load_textual_inversion(embeddings["multi"]) == ["my-style", "my-style_1", "my-style_2"]
    assert pipe.load_textual_inversion(embeddings["pickled"], allow_pickle=True) == ["old-style", "old-style_1"]
    ref = copy.deepcopy(torch_sd1)
    ref.load_textual_inversion(str(embeddings["single"]))
    ref.load_textual_inversion(str(embeddings["multi"]), token="my-style")
    ref.load_textual_inversion(str(embeddings["pickled"]), token="old-style")
    return pipe, ref


def encode(pipe, prompts, negatives):
    cond = pipe.generator.models.conditioning
    inputs = {
        "ids": cond.tokenize(prompts),
        "neg_ids": cond.tokenize(negatives),
        **cond.host_inputs(negative_prompts=negatives, height=64, width=64, task="txt2img"),
    }
    return cond.encode(pipe.params, inputs, cfg=True)


def test_sd1_ids_and_embeddings_match_diffusers(sd1_ti):
    pipe, ref = sd1_ti
    expanded = ref.maybe_convert_prompt(PROMPT, ref.tokenizer)
    assert "my-style my-style_1 my-style_2" in expanded
    want = ref.tokenizer(expanded, padding="max_length", max_length=77, truncation=True).input_ids
    got = pipe.tokenizer([PROMPT])[0]
    np.testing.assert_array_equal(got, want)
    assert set(range(49408, 49414)) <= set(got.tolist())  # the new ids are in the prompt
    context, _ = encode(pipe, [PROMPT], [NEGATIVE])
    with torch.no_grad():
        pos, neg = ref.encode_prompt(PROMPT, "cpu", 1, True, NEGATIVE)[:2]
    np.testing.assert_allclose(np.asarray(context), np.concatenate([neg.numpy(), pos.numpy()]), atol=ATOL)
    plain, _ = encode(pipe, ["a photo of a cat on a beach"], [""])
    assert np.abs(np.asarray(plain) - np.asarray(context)).max() > 1e-2


def test_sd1_image_matches_diffusers(sd1_ti):
    pipe, ref = sd1_ti
    latents = np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)
    ours = pipe.generate(
        PROMPT, negative_prompt=NEGATIVE, steps=2, height=64, width=64, output_type="np", noise=latents
    )
    with torch.no_grad():
        theirs = ref(
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            num_inference_steps=2,
            latents=torch.from_numpy(latents),
            output_type="np",
            height=64,
            width=64,
        ).images
    err = np.abs(ours - theirs).max()
    assert err < 1e-3, f"images: max abs error {err:.2e}"


def test_sdxl_embedding_goes_into_both_encoders(sdxl_dir, torch_sdxl, embeddings):
    from safetensors.torch import load_file

    from sdjax import StableDiffusionXLPipeline

    pipe, _ = StableDiffusionXLPipeline.from_pretrained(str(sdxl_dir))
    assert pipe.load_textual_inversion(embeddings["xl"]) == ["xl-style", "xl-style_1"]
    ref = copy.deepcopy(torch_sdxl)
    sd = load_file(str(embeddings["xl"]))
    ref.load_textual_inversion(sd["clip_l"], token="xl-style", text_encoder=ref.text_encoder, tokenizer=ref.tokenizer)
    ref.load_textual_inversion(
        sd["clip_g"], token="xl-style", text_encoder=ref.text_encoder_2, tokenizer=ref.tokenizer_2
    )
    prompt, negative = "xl-style, a castle", "grainy xl-style"
    context, added = encode(pipe, [prompt], [negative])
    with torch.no_grad():
        pos, neg, pooled, neg_pooled = ref.encode_prompt(prompt, negative_prompt=negative, device="cpu")
    np.testing.assert_allclose(np.asarray(context), np.concatenate([neg.numpy(), pos.numpy()]), atol=ATOL)
    want = np.concatenate([neg_pooled.numpy(), pooled.numpy()])
    np.testing.assert_allclose(np.asarray(added["text_embeds"]), want, atol=ATOL)
    assert pipe.text_encoder.config.vocab_size == pipe.text_encoder_2.config.vocab_size == 49408 + 2


def test_lora_base_params_grow_with_the_embedding(sd1_dir, embeddings, tmp_path):
    """Loaded after a LoRA, the embedding is in the fused and the base params alike (unfuse keeps it)."""
    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    name = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    lora = tmp_path / "te.safetensors"
    save_file(
        {
            f"{name}.lora_down.weight": np.ones((1, 32), np.float32),
            f"{name}.lora_up.weight": np.ones((32, 1), np.float32),
        },
        str(lora),
    )
    pipe.load_lora(lora)
    pipe.load_textual_inversion(embeddings["single"])
    rows = pipe.params["text_encoder"]["text_model"]["embeddings"]["token_embedding"]["embedding"]
    assert rows.shape == (49409, 32)
    pipe.unfuse_loras()
    base_rows = pipe.params["text_encoder"]["text_model"]["embeddings"]["token_embedding"]["embedding"]
    np.testing.assert_array_equal(np.asarray(base_rows), np.asarray(rows))


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_embeddings_name_the_file(sd1_ti, embeddings, tmp_path):
    pipe, _ = sd1_ti
    with pytest.raises(ti.TextualInversionError, match=r"learned_embeds\.safetensors: .*already in the tokenizer"):
        pipe.load_textual_inversion(embeddings["single"])
    with pytest.raises(ti.TextualInversionError, match=r"xl-style\.safetensors: .*text_encoder_2.*another base model"):
        pipe.load_textual_inversion(embeddings["xl"])
    wide = tmp_path / "wide.safetensors"
    save_file({"emb_params": np.ones((1, 768), np.float32)}, str(wide))
    with pytest.raises(ti.TextualInversionError, match=r"wide\.safetensors: vectors of width 768 .* width 32"):
        pipe.load_textual_inversion(wide)
    odd = tmp_path / "odd.safetensors"
    save_file({"a": np.ones(32, np.float32), "b": np.ones(32, np.float32)}, str(odd))
    with pytest.raises(ti.TextualInversionError, match=r"odd\.safetensors: not a textual-inversion embedding"):
        pipe.load_textual_inversion(odd)
    with pytest.raises(ti.TextualInversionError, match=r"old-style\.pt: a pickled embedding; pass allow_pickle=True"):
        pipe.load_textual_inversion(embeddings["pickled"], token="again")
    pt = tmp_path / "emb.pt"
    pt.write_bytes(b"PK")
    with pytest.raises(ti.TextualInversionError, match=r"emb\.pt: .*torch\.save"):
        pipe.load_textual_inversion(pt, allow_pickle=True)
    txt = tmp_path / "emb.txt"
    txt.write_text("x")
    with pytest.raises(ti.TextualInversionError, match=r"emb\.txt: embeddings are \.safetensors"):
        pipe.load_textual_inversion(txt)
    with pytest.raises(ti.TextualInversionError, match=r"token=' x' must be"):
        pipe.load_textual_inversion(wide, token=" x")
    with pytest.raises(ti.TextualInversionError, match=r"not found"):
        pipe.load_textual_inversion(tmp_path / "missing.safetensors")


def test_params_from_before_an_embedding_are_refused(sd1_dir, embeddings):
    """Params taken before `load_textual_inversion` lack the new tokens' rows: generate(params=...) refuses them by
    name instead of reading past the table."""
    from sdjax import StableDiffusionPipeline

    pipe, params = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    pipe.load_textual_inversion(embeddings["single"])
    with pytest.raises(ValueError, match=r"params\['text_encoder'\] has a token table of 49408 rows"):
        pipe.generate("a <cat-toy>", params=params, steps=2, height=64, width=64)
