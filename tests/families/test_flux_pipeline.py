"""Flux.1 end to end against PyTorch diffusers 0.42.1: `FluxPipeline` (dev-like: guidance embedding, dynamic
shift; schnell-like), true CFG with a negative prompt, `FluxImg2ImgPipeline` and `FluxInpaintPipeline`, on tiny
random models saved as real diffusers folders and loaded by sdjax's own loader (tests/flux_reference.py).

diffusers gets sdjax's noise (tests/inject.py: the initial noise unpacked `(N, 16, h, w)`, which FluxPipeline packs
2x2, and the VAE posterior samples). Images in [0, 1] agree to 1e-3 absolute in float32; a wrong sigma, shift,
packing or position id moves them by 1e-2 or more.
"""

import flux_reference
import inject
import numpy as np
import pytest
import t5_reference
import torch

from sdjax import rng

ATOL = 1e-3
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
NEGATIVE = ["blurry, low quality", "green"]
STEPS = 4
SIZE = 32  # pixels: 16x16 latents (VAE factor 2), 8x8 = 64 image tokens
MAX_SEQ = 24


@pytest.fixture(scope="module")
def flux_models(tmp_path_factory):
    """kind -> (torch pipeline, sdjax pipeline) for "dev" and "schnell"."""
    from sdjax.families.flux.pipeline import FluxPipeline

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    out = {}
    for kind in ("dev", "schnell"):
        torch_pipe = flux_reference.flux_pipeline(kind, seed=0, tokenizer_dir=tok)
        folder = tmp_path_factory.mktemp(f"tiny-flux-{kind}")
        torch_pipe.save_pretrained(folder, safe_serialization=True)
        pipe, _ = FluxPipeline.from_pretrained(str(folder))
        pipe.folder = folder
        out[kind] = (torch_pipe, pipe)
    return out


def _latent_shape():
    return (16, SIZE // 2, SIZE // 2)


def _torch(pipe, keys, *, encode_streams=(), **kwargs):
    with (
        inject.prescribed(
            pipe,
            latents_noise=inject.stream(keys, rng.LATENTS, _latent_shape()),
            encode_eps=[inject.stream(keys, s, _latent_shape()) for s in encode_streams],
        ),
        torch.no_grad(),
    ):
        return pipe(
            height=SIZE, width=SIZE, num_inference_steps=STEPS, max_sequence_length=MAX_SEQ, output_type="np", **kwargs
        ).images


def _images(seed: int) -> list:
    from PIL import Image

    r = np.random.default_rng(seed)
    base = np.zeros((SIZE, SIZE, 3), np.uint8)
    base[..., 0] = np.linspace(0, 255, SIZE, dtype=np.uint8)[None]
    base[8:24, 8:24] = (30, 200, 90)
    noisy = np.clip(base.astype(int) + r.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    return [Image.fromarray(noisy), Image.fromarray(255 - noisy)]


def _masks() -> list:
    from PIL import Image

    a = np.zeros((SIZE, SIZE), np.uint8)
    a[4:20, 12:28] = 255
    b = np.zeros((SIZE, SIZE), np.uint8)
    b[16:, :] = 255
    return [Image.fromarray(a), Image.fromarray(b)]


@pytest.mark.parametrize("kind", ["dev", "schnell"])
def test_txt2img_matches_diffusers(kind, flux_models):
    torch_pipe, pipe = flux_models[kind]
    keys = inject.image_keys(7, 2)
    ref = _torch(torch_pipe, keys, prompt=PROMPTS, guidance_scale=3.5)
    out = pipe.generate(
        PROMPTS,
        steps=STEPS,
        guidance_scale=3.5,
        height=SIZE,
        width=SIZE,
        seed=7,
        max_sequence_length=MAX_SEQ,
        output_type="np",
    )
    assert out.shape == ref.shape == (2, SIZE, SIZE, 3)
    err = float(np.abs(out - ref).max())
    assert err < ATOL, f"{kind}: max abs image error {err}"


def test_true_cfg_with_a_negative_prompt_matches_diffusers(flux_models):
    torch_pipe, pipe = flux_models["dev"]
    keys = inject.image_keys(2, 2)
    ref = _torch(torch_pipe, keys, prompt=PROMPTS, negative_prompt=NEGATIVE, true_cfg_scale=4.0, guidance_scale=2.0)
    out = pipe.generate(
        PROMPTS,
        negative_prompt=NEGATIVE,
        true_cfg_scale=4.0,
        steps=STEPS,
        guidance_scale=2.0,
        height=SIZE,
        width=SIZE,
        seed=2,
        max_sequence_length=MAX_SEQ,
        output_type="np",
    )
    plain = pipe.generate(PROMPTS, steps=STEPS, guidance_scale=2.0, height=SIZE, width=SIZE, seed=2, output_type="np")
    assert float(np.abs(out - ref).max()) < ATOL
    assert float(np.abs(out - plain).max()) > 1e-2  # the negative branch did something


def test_img2img_matches_diffusers(flux_models):
    import diffusers

    torch_pipe, pipe = flux_models["dev"]
    torch_i2i = diffusers.FluxImg2ImgPipeline(**torch_pipe.components)
    keys = inject.image_keys(4, 2)
    images = _images(0)
    for strength in (0.6, 1.0):
        ref = _torch(
            torch_i2i,
            keys,
            encode_streams=[rng.ENCODE_IMAGE],
            prompt=PROMPTS,
            image=images,
            strength=strength,
            guidance_scale=3.5,
        )
        out = pipe.generate(
            PROMPTS,
            image=images,
            strength=strength,
            steps=STEPS,
            guidance_scale=3.5,
            seed=4,
            max_sequence_length=MAX_SEQ,
            output_type="np",
        )
        assert float(np.abs(out - ref).max()) < ATOL, strength


def test_inpaint_matches_diffusers(flux_models):
    import diffusers

    torch_pipe, pipe = flux_models["dev"]
    torch_inp = diffusers.FluxInpaintPipeline(**torch_pipe.components)
    keys = inject.image_keys(3, 2)
    images, masks = _images(1), _masks()
    ref = _torch(
        torch_inp,
        keys,
        encode_streams=[rng.ENCODE_IMAGE, rng.ENCODE_MASKED_IMAGE],  # diffusers encodes the masked image too, unused
        prompt=PROMPTS,
        image=images,
        mask_image=masks,
        strength=0.7,
        guidance_scale=3.5,
    )
    out = pipe.generate(
        PROMPTS,
        image=images,
        mask_image=masks,
        strength=0.7,
        steps=STEPS,
        guidance_scale=3.5,
        seed=3,
        max_sequence_length=MAX_SEQ,
        output_type="np",
    )
    assert float(np.abs(out - ref).max()) < ATOL


def test_sampler_names_on_a_flux_model(flux_models):
    """A1111/Forge names map to the flow samplers ("Euler" is flow Euler on FluxPipeline's grid, the default);
    a sampler with no flow form is refused naming it, before anything compiles."""
    _, pipe = flux_models["dev"]
    assert pipe._sampler("Euler") == pipe._sampler(None)
    assert type(pipe._sampler("DPM++ 2M").origin).__name__ == "DPMSolverMultistep"  # its k-diffusion form
    assert pipe._sampler("DPM++ 2M").use_flow_sigmas
    kwargs = dict(steps=3, height=SIZE, width=SIZE, seed=1, max_sequence_length=MAX_SEQ, output_type="np")
    euler = pipe.generate(PROMPTS[:1], sampler="Euler", **kwargs)
    dpm = pipe.generate(PROMPTS[:1], sampler="DPM++ 2M", **kwargs)
    assert np.isfinite(dpm).all() and float(np.abs(euler - dpm).max()) > 1e-3
    compiles = pipe.generator.cache.stats.compiles
    with pytest.raises(ValueError, match="DDIM"):
        pipe.generate(PROMPTS[:1], sampler="DDIM", **kwargs)
    assert pipe.generator.cache.stats.compiles == compiles


def test_bad_input_is_refused_by_name(flux_models):
    _, pipe = flux_models["dev"]
    with pytest.raises(ValueError, match="max_sequence_length"):
        pipe.generate("a cat", max_sequence_length=513, height=SIZE, width=SIZE)
    with pytest.raises(ValueError, match="prompt_2"):
        pipe.generate(["a", "b"], prompt_2=["x", "y", "z"], height=SIZE, width=SIZE)
    with pytest.raises(ValueError, match="prompt_syntax='a1111'"):
        pipe.generate("a (cat:1.2)", prompt_syntax="a1111", height=SIZE, width=SIZE)
    with pytest.raises(ValueError, match="height=36"):
        pipe.generate("a cat", height=36, width=SIZE)


def test_cli_generates_with_forge_guidance_semantics(flux_models, tmp_path):
    """`sdjax generate --model FLUX_DIR`: the CFG scale defaults to 1 (one branch, as Forge for Flux) and
    `--distilled-guidance` is dev's embedded guidance; the PNG equals `pipe.generate` with the same settings."""
    from PIL import Image
    from typer.testing import CliRunner

    from sdjax import cli

    _, pipe = flux_models["dev"]
    args = ["generate", PROMPTS[0], "--model", str(pipe.folder), "--steps", "3", "--width", str(SIZE)]
    args += ["--height", str(SIZE), "--seed", "11", "--distilled-guidance", "2.5", "--out", str(tmp_path)]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    (png,) = sorted(tmp_path.glob("*.png"))
    from sdjax import infotext, metadata

    params = metadata.parameters_from_text(infotext.read_parameters(png))
    assert params.distilled_guidance == 2.5 and params.guidance_scale == 1.0  # as Forge writes them
    got = np.asarray(Image.open(png).convert("RGB"), np.int16)
    same = dict(steps=3, height=SIZE, width=SIZE, seed=11, max_sequence_length=512)  # the CLI's: dev's default
    want = pipe.generate(PROMPTS[0], guidance_scale=2.5, **same)[0]
    other = pipe.generate(PROMPTS[0], guidance_scale=3.5, **same)[0]
    assert np.abs(got - np.asarray(want, np.int16)).max() <= 1
    assert np.abs(got - np.asarray(other, np.int16)).max() > 1  # the distilled guidance reached the model


def test_load_lora_on_the_pipeline_matches_diffusers(flux_models, tmp_path):
    """`pipe.load_lora(file, scale)` on a Flux pipeline (diffusers/PEFT layout) gives diffusers'
    `load_lora_weights` + `fuse_lora(lora_scale=)` image; `unload_loras` gives the base image back."""
    from safetensors.numpy import save_file

    torch_pipe, pipe = flux_models["dev"]
    r = np.random.default_rng(0)
    inner = 32  # heads x head dim of the tiny transformer
    tensors = {}
    for module in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_v_proj",
                   "single_transformer_blocks.0.attn.to_k"):  # fmt: skip
        tensors[f"transformer.{module}.lora_A.weight"] = (0.5 * r.standard_normal((4, inner))).astype(np.float32)
        tensors[f"transformer.{module}.lora_B.weight"] = (0.5 * r.standard_normal((inner, 4))).astype(np.float32)
    path = tmp_path / "tiny_flux_lora.safetensors"
    save_file(tensors, str(path))
    keys = inject.image_keys(9, 1)
    kwargs = dict(steps=STEPS, guidance_scale=3.5, height=SIZE, width=SIZE, seed=9, max_sequence_length=MAX_SEQ)
    base = pipe.generate(PROMPTS[:1], output_type="np", **kwargs)
    torch_pipe.load_lora_weights(str(path), adapter_name="tiny")
    try:
        torch_pipe.fuse_lora(lora_scale=0.7)
        ref = _torch(torch_pipe, keys, prompt=PROMPTS[:1], guidance_scale=3.5)
    finally:
        torch_pipe.unfuse_lora()
        torch_pipe.unload_lora_weights()
    pipe.load_lora(path, scale=0.7)
    try:
        out = pipe.generate(PROMPTS[:1], output_type="np", **kwargs)
    finally:
        pipe.unload_loras()
    again = pipe.generate(PROMPTS[:1], output_type="np", **kwargs)
    assert float(np.abs(out - ref).max()) < ATOL
    assert float(np.abs(out - base).max()) > 5e-3  # the LoRA changed the image
    assert float(np.abs(again - base).max()) == 0.0


def test_single_files_with_a_config_folder_give_the_folders_image(flux_models, tmp_path):
    """`FluxPipeline.from_single_file(transformer file, config=folder, t5=, clip_l=)`: the separate files people
    keep (here each component's weights as one safetensors file) load to the same image as the folder."""
    from safetensors.numpy import save_file

    from sdjax.families.flux.pipeline import FluxPipeline

    torch_pipe, pipe = flux_models["dev"]
    files = {}
    for name, module in (("transformer", torch_pipe.transformer), ("t5", torch_pipe.text_encoder_2),
                         ("clip_l", torch_pipe.text_encoder)):  # fmt: skip
        files[name] = tmp_path / f"{name}.safetensors"
        save_file({k: v.detach().numpy().copy() for k, v in module.state_dict().items()}, str(files[name]))
    single, params = FluxPipeline.from_single_file(
        str(files["transformer"]), config=str(pipe.folder), t5=str(files["t5"]), clip_l=str(files["clip_l"])
    )
    assert set(params) >= {"transformer", "text_encoder", "text_encoder_2", "vae", "scheduler"}
    kwargs = dict(steps=3, guidance_scale=3.5, height=SIZE, width=SIZE, seed=5, max_sequence_length=MAX_SEQ)
    want = pipe.generate(PROMPTS[:1], output_type="np", **kwargs)
    got = single.generate(PROMPTS[:1], output_type="np", **kwargs)
    # (the torch weights went through fuse/unfuse in the LoRA test: they may differ from the folder's by an ulp)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_cli_takes_a_flux_transformer_file_with_its_config_folder(flux_models, tmp_path):
    """`sdjax generate --model flux-transformer.safetensors`: refused naming what is missing (a Flux file holds the
    transformer only); with `--config FOLDER` it generates."""
    from safetensors.numpy import save_file
    from typer.testing import CliRunner

    from sdjax import cli

    torch_pipe, pipe = flux_models["dev"]
    path = tmp_path / "flux-transformer.safetensors"
    save_file({k: v.detach().numpy().copy() for k, v in torch_pipe.transformer.state_dict().items()}, str(path))
    args = ["generate", "a cat", "--model", str(path), "--steps", "2", "--width", str(SIZE), "--height", str(SIZE)]
    refused = CliRunner().invoke(cli.app, [*args, "--out", str(tmp_path / "a")])
    assert refused.exit_code != 0 and "Flux.1 transformer file" in refused.output
    ok = CliRunner().invoke(cli.app, [*args, "--config", str(pipe.folder), "--out", str(tmp_path / "b")])
    assert ok.exit_code == 0, ok.output
    assert len(list((tmp_path / "b").glob("*.png"))) == 1
