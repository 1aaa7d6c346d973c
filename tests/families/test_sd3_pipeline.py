"""Stable Diffusion 3 / 3.5 end to end against PyTorch diffusers 0.42.1: `StableDiffusion3Pipeline` (classifier-free
guidance with a negative prompt and the per-encoder prompts, guidance 1 without CFG, no T5, skip-layer guidance),
`StableDiffusion3Img2ImgPipeline` and `StableDiffusion3InpaintPipeline`, on tiny random models saved as real
diffusers folders and loaded by sdjax's own loader (tests/sd3_reference.py).

diffusers gets sdjax's noise (tests/inject.py: the initial noise and the VAE posterior samples). Images in [0, 1]
agree to 1e-3 absolute in float32; a wrong sigma, shift, text layout or skip-layer step moves them by 1e-2 or more.
"""

import contextlib

import inject
import numpy as np
import pytest
import sd3_reference
import t5_reference
import torch

import sdjax
from sdjax import rng

ATOL = 1e-3
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
NEGATIVE = ["blurry, low quality", "green"]
STEPS = 4
SIZE = 32  # pixels: 16x16 latents (VAE factor 2), 8x8 = 64 patches
MAX_SEQ = 24
GUIDANCE = 5.0


@pytest.fixture(scope="module")
def sd3_models(tmp_path_factory):
    """kind -> (torch pipeline, sdjax pipeline) for "t5" and "no-t5" (`text_encoder_3` null in model_index)."""
    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    out = {}
    for kind in ("t5", "no-t5"):
        torch_pipe = sd3_reference.sd3_pipeline(seed=0, tokenizer_dir=tok, t5=kind == "t5")
        folder = tmp_path_factory.mktemp(f"tiny-sd3-{kind}")
        torch_pipe.save_pretrained(folder, safe_serialization=True)
        pipe, _ = StableDiffusion3Pipeline.from_pretrained(str(folder))
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


def _sdjax(pipe, seed, **kwargs):
    return pipe.generate(
        PROMPTS,
        steps=STEPS,
        height=SIZE,
        width=SIZE,
        seed=seed,
        max_sequence_length=MAX_SEQ,
        output_type="np",
        **kwargs,
    )


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


def _check(out, ref, what: str) -> float:
    assert out.shape == ref.shape == (2, SIZE, SIZE, 3)
    err = float(np.abs(out - ref).max())
    print(f"{what}: max abs image error {err:.2e}")
    assert err < ATOL, f"{what}: max abs image error {err}"
    return err


def test_cfg_with_negative_and_per_encoder_prompts_matches_diffusers(sd3_models):
    torch_pipe, pipe = sd3_models["t5"]
    keys = inject.image_keys(7, 2)
    texts = dict(prompt_3=["a cat on mars", "a forest at night"], negative_prompt_2="dark")
    ref = _torch(torch_pipe, keys, prompt=PROMPTS, negative_prompt=NEGATIVE, guidance_scale=GUIDANCE, **texts)
    out = _sdjax(pipe, 7, negative_prompt=NEGATIVE, guidance_scale=GUIDANCE, **texts)
    _check(out, ref, "cfg")
    plain = _sdjax(pipe, 7, negative_prompt=NEGATIVE, guidance_scale=GUIDANCE)
    assert float(np.abs(out - plain).max()) > 1e-2  # prompt_3 / negative_prompt_2 reached their encoders


def test_guidance_one_without_cfg_matches_diffusers(sd3_models):
    torch_pipe, pipe = sd3_models["t5"]
    keys = inject.image_keys(3, 2)
    ref = _torch(torch_pipe, keys, prompt=PROMPTS, guidance_scale=1.0)
    _check(_sdjax(pipe, 3, guidance_scale=1.0), ref, "guidance 1")


def test_without_t5_matches_diffusers(sd3_models, tmp_path):
    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline

    torch_pipe, pipe = sd3_models["no-t5"]
    assert pipe.text_encoder_3 is None and pipe.generator.models.conditioning.components == (
        "text_encoder",
        "text_encoder_2",
    )
    keys = inject.image_keys(5, 2)
    ref = _torch(torch_pipe, keys, prompt=PROMPTS, negative_prompt=NEGATIVE, guidance_scale=GUIDANCE)
    _check(_sdjax(pipe, 5, negative_prompt=NEGATIVE, guidance_scale=GUIDANCE, prompt_3="ignored"), ref, "no T5")
    # A folder with T5, left out by the caller (diffusers' `text_encoder_3=None`); `load_pipeline` finds the family.
    folder = tmp_path / "with-t5"
    sd3_models["t5"][0].save_pretrained(folder, safe_serialization=True)
    dropped, params = sdjax.load_pipeline(str(folder), text_encoder_3=None)
    assert isinstance(dropped, StableDiffusion3Pipeline)
    assert dropped.text_encoder_3 is None and dropped.tokenizer_3 is None and "text_encoder_3" not in params


def test_img2img_matches_diffusers(sd3_models):
    import diffusers

    torch_pipe, pipe = sd3_models["t5"]
    torch_i2i = diffusers.StableDiffusion3Img2ImgPipeline(**torch_pipe.components)
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
            guidance_scale=GUIDANCE,
        )
        out = _sdjax(pipe, 4, image=images, strength=strength, guidance_scale=GUIDANCE)
        _check(out, ref, f"img2img strength {strength}")


@contextlib.contextmanager
def _decode_with_shift(vae):
    """diffusers 0.42.1's StableDiffusion3InpaintPipeline decodes `latents / scaling_factor` without adding the VAE's
    `shift_factor` back (its encode subtracts it; the text-to-image and img2img pipelines add it:
    huggingface/diffusers#13611, "Issue 1"). sdjax decodes every task alike, so the reference's decode gets the
    shift here."""
    decode = vae.decode
    vae.decode = lambda z, *args, **kwargs: decode(z + vae.config.shift_factor, *args, **kwargs)
    try:
        yield
    finally:
        del vae.decode


def test_inpaint_matches_diffusers(sd3_models):
    import diffusers

    torch_pipe, pipe = sd3_models["t5"]
    torch_inp = diffusers.StableDiffusion3InpaintPipeline(**torch_pipe.components)
    keys = inject.image_keys(3, 2)
    images, masks = _images(1), _masks()
    with _decode_with_shift(torch_inp.vae):
        ref = _torch(
            torch_inp,
            keys,
            encode_streams=[rng.ENCODE_IMAGE, rng.ENCODE_MASKED_IMAGE],  # diffusers encodes the masked image too
            prompt=PROMPTS,
            image=images,
            mask_image=masks,
            strength=0.7,
            guidance_scale=GUIDANCE,
        )
    out = _sdjax(pipe, 3, image=images, mask_image=masks, strength=0.7, guidance_scale=GUIDANCE)
    _check(out, ref, "inpaint")


def test_skip_layer_guidance_matches_diffusers(sd3_models):
    """4 steps, start 0.2, stop 0.6: diffusers' rule `4 * 0.2 < i < 4 * 0.6` covers steps 1 and 2 only. A call
    without it afterwards runs the same program with the scale at 0."""
    torch_pipe, pipe = sd3_models["t5"]
    keys = inject.image_keys(9, 2)
    slg = dict(skip_guidance_layers=[1], skip_layer_guidance_start=0.2, skip_layer_guidance_stop=0.6)
    common = dict(negative_prompt=NEGATIVE, guidance_scale=GUIDANCE)
    ref = _torch(torch_pipe, keys, prompt=PROMPTS, **common, **slg)
    ref_plain = _torch(torch_pipe, keys, prompt=PROMPTS, **common)
    assert float(np.abs(ref - ref_plain).max()) > 1e-2  # the tiny model's SLG changes the image
    try:
        _check(_sdjax(pipe, 9, **common, **slg), ref, "skip-layer guidance")
        assert pipe.skip_guidance_layers == (1,)
        compiles = pipe.generator.cache.stats.compiles
        _check(_sdjax(pipe, 9, **common), ref_plain, "skip-layer guidance compiled, off")
        assert pipe.generator.cache.stats.compiles == compiles
        with pytest.raises(ValueError, match="text-to-image only"):
            _sdjax(pipe, 9, image=_images(0), **common, **slg)
    finally:
        pipe.skip_guidance_layers = ()


def test_bad_arguments_are_named(sd3_models):
    """Checked before anything compiles."""
    _, pipe = sd3_models["no-t5"]
    with pytest.raises(ValueError, match=r"skip_layers: 3 is not a block index in \[0, 3\)"):
        _sdjax(pipe, 0, skip_guidance_layers=[3])
    with pytest.raises(ValueError, match=r"max_sequence_length=513 must be an int in \[1, 512\]"):
        pipe.generate(PROMPTS, max_sequence_length=513)
    with pytest.raises(ValueError, match="prompt_2: got 3 texts for 2 prompts"):
        _sdjax(pipe, 0, prompt_2=["a", "b", "c"])
    with pytest.raises(ValueError, match="skip_layer_guidance_stop=1.5 must lie in"):
        _sdjax(pipe, 0, skip_guidance_layers=[1], skip_layer_guidance_stop=1.5)
    with pytest.raises(TypeError, match=r"unexpected conditioning argument\(s\) \['clip_skip'\] for an SD 3 model"):
        _sdjax(pipe, 0, clip_skip=2)
    assert pipe.skip_guidance_layers == () and pipe.max_sequence_length == MAX_SEQ


def test_a1111_and_registry_sampler_names_sample_as_flow(sd3_models):
    """The A1111/ComfyUI names ("Euler", "euler") on an SD 3 model gave the variance-preserving Euler (an epsilon
    model's sampler) built on the flow config; they must give the model's own flow Euler: the same image as its
    default scheduler, and a name without a flow form is refused naming the sampler."""
    from sdjax import samplers

    _, pipe = sd3_models["t5"]
    base = _sdjax(pipe, 3, guidance_scale=GUIDANCE)
    for name in ("Euler", "euler"):
        sampler = pipe._sampler(name)
        assert isinstance(sampler.origin, samplers.FlowMatchEuler), (name, type(sampler).__name__)  # its k-form
        assert sampler == pipe.scheduler
        np.testing.assert_array_equal(_sdjax(pipe, 3, guidance_scale=GUIDANCE, sampler=name), base)
    assert pipe.sampler_names == samplers.available(flow=True)
    with pytest.raises(ValueError, match="DDIM"):
        pipe._sampler("DDIM")
