"""SD 3 / 3.5 ControlNet generation against PyTorch diffusers 0.42.1's `StableDiffusion3ControlNetPipeline`, and the
inputs it refuses.

The tiny SD 3 pipeline of tests/sd3_reference.py gets a 4-block transformer (blocks 0-2 add ControlNet samples, the
last, context pre-only block none) and one of two tiny random `SD3ControlNetModel`s (`NETS` of
tests/sd3_controlnet_builders.py), both saved as real diffusers folders and given to `generate(controlnet=FOLDER)`:
- "instantx": 2 joint blocks (one dual-attention, q/k RMSNorm) with its own `pos_embed_max_size` table and the
  defaults InstantX's SD 3 nets have: zero pooled embeddings, control latents without the VAE shift; with 4
  transformer blocks the interval is 2 (blocks 0, 1 add sample 0, block 2 sample 1);
- "sd35-large": 3 single blocks without text, the transformer's patch embedding (`use_pos_embed` false), pooled
  embeddings and shifted latents (`force_zeros_for_pooled_projection` false), as Stability AI's SD 3.5 large nets.
Their zero-initialised layers get random weights (else the samples are 0 and the comparison proves nothing).
Two nets at once (a second "instantx" net, each with its own image, scale and window) are compared with diffusers'
list of nets (`SD3MultiControlNetModel`).
Classifier-free guidance with a negative prompt, `controlnet_conditioning_scale` 0.7 and the guidance window
[0.2, 0.8] of 5 steps (the nets act on steps 1-3). diffusers gets sdjax's initial noise (tests/inject.py) and its
VAE posterior noise for the control image (stream `rng.ENCODE_CONTROL`, the same for both CFG halves). Images in
[0, 1] agree to 1e-3 absolute in float32, as the other SD 3 pipeline tests; the nets change them by far more.
"""

from __future__ import annotations

import contextlib
import types

import inject
import jax.numpy as jnp
import numpy as np
import pytest
import sd3_reference
import t5_reference
from controlnet_cases import control_images, one_torch_thread
from sd3_controlnet_builders import NETS, PIPELINE_RANDOM, pipeline_net, randomized

from sdjax import rng
from sdjax.models.sd3_controlnet import SD3ControlNetConfig, SD3ControlNetModel

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

ATOL = 1e-3
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
NEGATIVE = ["blurry, low quality", "green"]
STEPS = 5
SIZE = 32
MAX_SEQ = 24
GUIDANCE = 5.0
WINDOW = dict(controlnet_conditioning_scale=0.7, control_guidance_start=0.2, control_guidance_end=0.8)


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(torch components, sdjax pipeline, {kind: (torch net, folder)})."""
    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    components = sd3_reference.sd3_pipeline(seed=0, tokenizer_dir=tok).components
    torch.manual_seed(11)
    transformer = diffusers.SD3Transformer2DModel(**{**sd3_reference.TRANSFORMER, "num_layers": 4})
    components["transformer"] = randomized(transformer, 11, **PIPELINE_RANDOM)
    folder = tmp_path_factory.mktemp("tiny-sd3-4-blocks")
    diffusers.StableDiffusion3Pipeline(**components).save_pretrained(folder, safe_serialization=True)
    pipe, _ = StableDiffusion3Pipeline.from_pretrained(str(folder))
    nets = {}
    for seed, (kind, config) in enumerate(NETS.items()):
        net = pipeline_net(config, 20 + seed)
        net_folder = tmp_path_factory.mktemp(f"sd3-controlnet-{kind}")
        net.save_pretrained(net_folder, safe_serialization=True)
        nets[kind] = (net, net_folder)
    net = pipeline_net(NETS["instantx"], 30)  # a second InstantX-like net, for two nets at once
    second = tmp_path_factory.mktemp("sd3-controlnet-second")
    net.save_pretrained(second, safe_serialization=True)
    nets["second"] = (net, second)
    return components, pipe, nets


@contextlib.contextmanager
def _posterior_noise(eps: list[np.ndarray]):
    """diffusers' control image encodes (`latent_dist.sample()` on the CFG-doubled batch, one per net) with sdjax's
    noise: each image's sample for both halves."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    calls = []

    def sample(self, generator=None):
        e = torch.from_numpy(np.array(eps[len(calls)]))
        e = torch.cat([e] * (self.mean.shape[0] // e.shape[0]))
        calls.append(1)
        return self.mean + self.std * e.to(self.mean.dtype)

    original = DiagonalGaussianDistribution.sample
    DiagonalGaussianDistribution.sample = sample
    try:
        yield
    finally:
        DiagonalGaussianDistribution.sample = original
    assert len(calls) == len(eps), f"diffusers encoded the control images {len(calls)} times, not {len(eps)}"


def _torch(components, net, keys, images, window=WINDOW):
    pipe = diffusers.StableDiffusion3ControlNetPipeline(**components, controlnet=net)
    shape = (16, SIZE // 2, SIZE // 2)
    count = len(net) if isinstance(net, list) else 1
    with (
        inject.prescribed(pipe, latents_noise=inject.stream(keys, rng.LATENTS, shape)),
        _posterior_noise([inject.stream(keys, rng.ENCODE_CONTROL + k, shape) for k in range(count)]),
        torch.no_grad(),
    ):
        return pipe(
            prompt=PROMPTS,
            negative_prompt=NEGATIVE,
            control_image=images,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            max_sequence_length=MAX_SEQ,
            output_type="np",
            **window,
        ).images


def _sdjax(pipe, seed, size=True, **kwargs):
    return pipe.generate(
        PROMPTS,
        negative_prompt=NEGATIVE,
        steps=STEPS,
        **(dict(height=SIZE, width=SIZE) if size else {}),
        seed=seed,
        guidance_scale=GUIDANCE,
        max_sequence_length=MAX_SEQ,
        output_type="np",
        **kwargs,
    )


@pytest.mark.parametrize("kind", list(NETS))
def test_controlnet_pipeline_matches_diffusers(models, kind):
    components, pipe, nets = models
    net, folder = nets[kind]
    images = control_images(3)
    keys = inject.image_keys(6, 2)
    ref = _torch(components, net, keys, images)
    out = _sdjax(pipe, 6, control_image=images, controlnet=str(folder), **WINDOW)
    assert out.shape == ref.shape == (2, SIZE, SIZE, 3)
    err = float(np.abs(out - ref).max())
    print(f"{kind}: max abs image error {err:.2e}")
    assert err < ATOL
    # scale 0: the net is skipped (the image without it); the net must have changed the image by far more. Without
    # height/width the size is the model's (32 here), not the 80x72 control image's, as in diffusers.
    off = _sdjax(pipe, 6, size=False, control_image=images, controlnet=str(folder), controlnet_conditioning_scale=0.0)
    plain = _sdjax(pipe, 6)
    assert float(np.abs(off - plain).max()) < 1e-5
    effect = float(np.abs(out - off).max())
    print(f"{kind}: the net changes the image by {effect:.2e}")
    assert effect > 20 * ATOL
    # compiling ahead with the net builds the very program generate ran (a cache hit)
    before = pipe.generator.cache.stats.compiles
    pipe.compile(batch_size=2, height=SIZE, width=SIZE, steps=STEPS, controlnet=str(folder))
    assert pipe.generator.cache.stats.compiles == before


def test_quantized_transformer_and_net(models):
    """A pipeline loaded with int8 kernels (those of 256 or more weights, so the tiny model's patch embedding is
    among them) quantizes the SD 3.5 large-like net it loads by path as well; that net runs the transformer's
    quantized patch embedding. The image equals the float pipeline's on the same quantized weights dequantized on
    the host (both the transformer's and the net's)."""
    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline
    from sdjax.loading.controlnet import load_controlnet
    from sdjax.quant import params as P

    _, pipe, nets = models
    _, folder = nets["sd35-large"]
    policy = P.QuantPolicy("int8", components=("transformer",), min_size=256)
    qpipe, qparams = StableDiffusion3Pipeline.from_pretrained(pipe.name, quantize=policy)
    assert "pos_embed/proj/kernel" in P.quantized_kernels(qparams["transformer"])
    images = control_images(3)
    out = _sdjax(qpipe, 6, control_image=images, controlnet=str(folder), **WINDOW)
    module, net_params = load_controlnet(folder, quantize=P.controlnet_policy(policy, "transformer"))
    assert P.quantized_kernels(net_params)
    host = {**pipe.params, "transformer": P.dequantize_tree(qparams["transformer"], jnp.float32)}
    pair = (module, P.dequantize_tree(net_params, jnp.float32))
    ref = _sdjax(pipe, 6, control_image=images, controlnet=pair, params=host, **WINDOW)
    err = float(np.abs(out - ref).max())
    print(f"int8 transformer and net: max abs difference to the host-dequantized weights {err:.2e}")
    assert err < 1e-4


def test_two_nets_match_sd3_multicontrolnet(models):
    """Two nets (diffusers: a list, `SD3MultiControlNetModel`), each with its own image, scale and window."""
    components, pipe, nets = models
    (a, folder_a), (b, folder_b) = nets["instantx"], nets["second"]
    maps = control_images(5)
    per_net = [maps[0], maps[1]]  # one image per net, for both generated images
    window = dict(
        controlnet_conditioning_scale=[0.7, 1.2], control_guidance_start=[0.2, 0.0], control_guidance_end=[0.8, 0.6]
    )
    keys = inject.image_keys(8, 2)
    ref = _torch(components, [a, b], keys, per_net, window)
    out = _sdjax(pipe, 8, control_image=per_net, controlnet=[str(folder_a), str(folder_b)], **window)
    err = float(np.abs(out - ref).max())
    print(f"two nets: max abs image error {err:.2e}")
    assert err < ATOL
    one = {k: [v[0], 0.0] if k == "controlnet_conditioning_scale" else v for k, v in window.items()}
    alone = _sdjax(pipe, 8, control_image=per_net, controlnet=[str(folder_a), str(folder_b)], **one)
    assert float(np.abs(out - alone).max()) > 20 * ATOL  # the second net counted


def _pair(**overrides):
    """An sdjax SD 3 ControlNet module (params are never read: the checks come first)."""
    return SD3ControlNetModel(SD3ControlNetConfig(**{**NETS["instantx"], **overrides})), {}


def _refused(pipe, match: str, **kwargs):
    before = pipe.generator.cache.stats.compiles
    call = dict(control_image=control_images(3)[0], controlnet=_pair(), height=SIZE, width=SIZE)
    with pytest.raises((ValueError, KeyError), match=match):
        pipe.generate("a cat", steps=2, **{**call, **kwargs})
    assert pipe.generator.cache.stats.compiles == before  # refused before anything was compiled


def test_bad_controlnets_are_refused_before_compiling(models, tmp_path):
    _, pipe, _ = models
    # an SD 1.x ControlNet folder (diffusers ControlNetModel) given to SD 3
    sd_net = diffusers.ControlNetModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
        conditioning_embedding_out_channels=(16, 32),
    )
    sd_net.save_pretrained(tmp_path / "sd-controlnet", safe_serialization=True)
    _refused(
        pipe,
        r"controlnet is a ControlNetModel \(a Stable Diffusion 1.x/2.x or SDXL ControlNet\) but the pipeline is "
        r"Stable Diffusion 3",
        controlnet=str(tmp_path / "sd-controlnet"),
    )
    # SD 3 nets that do not fit this transformer, or that this pipeline does not run
    _refused(
        pipe,
        "joint_attention_dim is 64 in the ControlNet, 96 in the transformer",
        controlnet=_pair(joint_attention_dim=64),
    )
    _refused(
        pipe,
        r"num_attention_heads \* attention_head_dim is 48 in the ControlNet, 32",
        controlnet=_pair(num_attention_heads=3, caption_projection_dim=48),
    )
    _refused(pipe, "extra_conditioning_channels=1", controlnet=_pair(extra_conditioning_channels=1))
    _refused(
        pipe,
        r"controlnet\[1\] has num_layers=3, controlnet\[0\] 2",
        controlnet=[_pair(), _pair(num_layers=3)],
        control_image=control_images(3),
    )
    # arguments diffusers' StableDiffusion3ControlNetPipeline does not take
    _refused(pipe, "guess_mode: SD 3 ControlNets have no guess mode", guess_mode=True)
    _refused(pipe, "text-to-image only", image=control_images(4)[0], strength=0.5)
    _refused(pipe, "skip_guidance_layers and control_image cannot be combined", skip_guidance_layers=[1])
    _refused(pipe, r"pos_embed_max_size=12 patches on a side \(at most 48 pixels\)", height=64, width=64)
    _refused(
        pipe,
        r"control_guidance_start=0.5 must be below control_guidance_end=0.5",
        control_guidance_start=0.5,
        control_guidance_end=0.5,
    )


def test_sd3_controlnet_is_refused_by_other_families():
    from sdjax.pipelines.controlnet import control_spec

    sd_like = types.SimpleNamespace(unet=types.SimpleNamespace(config=None), dtype=jnp.float32)
    with pytest.raises(
        ValueError, match=r"controlnet is a SD3ControlNetModel \(a Stable Diffusion 3 / 3.5 ControlNet\)"
    ):
        control_spec(sd_like, _pair(), None)
    with pytest.raises(ValueError, match="takes no ControlNet"):
        control_spec(types.SimpleNamespace(), _pair(), None)


def test_cli_generate_with_an_sd3_controlnet_equals_the_python_api(models, tmp_path):
    """`sdjax generate -m SD3 --controlnet NET --control-image IMG` (the faces' request -> metadata's executor ->
    the family's control request) gives the Python API's image for the same seed, scale and window."""
    from PIL import Image
    from typer.testing import CliRunner

    from sdjax.cli import app

    _, pipe, nets = models
    image = control_images(4)[0]
    image.save(tmp_path / "control.png")
    out = tmp_path / "out"
    args = ["generate", PROMPTS[0], "-m", pipe.name, "--controlnet", str(nets["instantx"][1])]
    args += ["--control-image", str(tmp_path / "control.png"), "--control-scale", "0.7", "--control-start", "0.2"]
    args += ["--control-end", "0.8", "--steps", str(STEPS), "--guidance-scale", str(GUIDANCE), "--seed", "9"]
    args += ["--width", str(SIZE), "--height", str(SIZE), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    ref = pipe.generate(
        PROMPTS[0], control_image=image, controlnet=str(nets["instantx"][1]), steps=STEPS, guidance_scale=GUIDANCE,
        seed=9, height=SIZE, width=SIZE, output_type="np", **WINDOW,
    )[0]  # fmt: skip
    (png,) = sorted(out.glob("*.png"))
    got = np.asarray(Image.open(png).convert("RGB"), np.float32) / 255
    plain = pipe.generate(
        PROMPTS[0], steps=STEPS, guidance_scale=GUIDANCE, seed=9, height=SIZE, width=SIZE, output_type="np"
    )[0]
    # the CLI's program and the Python API's are compiled separately (after this module's other programs, in the
    # suite): float32 rounding differs by up to ~1e-2 here (8.4e-3 seen), while the net moves the image far more
    err = np.abs(got - ref)
    print(
        f"CLI vs Python API: max {err.max():.4f}, mean {err.mean():.5f}; net's effect {np.abs(ref - plain).max():.3f}"
    )
    assert err.mean() <= 2 / 255 and err.max() <= 0.02
    assert np.abs(ref - plain).max() > 10 * err.max()
    assert "ControlNet 0: " in Image.open(png).info["parameters"]
