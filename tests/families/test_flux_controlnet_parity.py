"""Flux.1 ControlNet generation against PyTorch diffusers 0.42.1's `FluxControlNetPipeline`, and the inputs it
refuses.

The tiny Flux.1-dev-like pipeline of tests/flux_reference.py (2 double and 2 single blocks) and three tiny random
`FluxControlNetModel`s with the guidance embedding (as the dev nets), all saved as real diffusers folders and given
to `generate(controlnet=FOLDER)`:
- "instantx": 1 double and 2 single blocks (InstantX's kind): with 2 transformer blocks of each kind the double
  interval is 2 (both double blocks add sample 0), the single interval 1;
- "union": the same with `num_mode` 3 (a ControlNet-Union net; `control_mode` is a program input);
- "union-pro-2": a union net with 2 double blocks and no single blocks (Shakker-Labs' Union-Pro-2.0 has none).
Their zero-initialised layers get random weights (else the samples are 0 and the comparison proves nothing).
"union-pro-2" alone (mode 1) with true classifier-free guidance (a negative prompt, `true_cfg_scale` 4: diffusers
runs the net on the positive prompt only and gives both transformer calls its samples),
`controlnet_conditioning_scale` 0.7 and the window [0.2, 0.8] of 4 steps (the net acts on steps 1-2); "instantx"
and "union" at once (diffusers' list of nets, `FluxMultiControlNetModel`) with modes [None, 2], each its own image,
scale and window. diffusers gets sdjax's
initial noise and the VAE posterior noise of each control image (stream `rng.ENCODE_CONTROL + k`; tests/inject.py).
Images in [0, 1] agree to 1e-3 absolute in float32, as the other Flux pipeline tests; the nets change them by far
more.
"""

from __future__ import annotations

import types

import flux_reference
import inject
import jax.numpy as jnp
import numpy as np
import pytest
import t5_reference
from controlnet_cases import control_images, one_torch_thread

from sdjax import rng
from sdjax.models.flux_controlnet import FluxControlNetConfig, FluxControlNetModel

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

ATOL = 1e-3
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
NEGATIVE = ["blurry, low quality", "green"]
STEPS = 4
SIZE = 32  # 16x16 latents (VAE factor 2), 64 image tokens
MAX_SEQ = 24
GUIDANCE = 3.5  # dev's distilled guidance, embedded by the transformer and the nets
WINDOW = dict(controlnet_conditioning_scale=0.7, control_guidance_start=0.2, control_guidance_end=0.8)
_T = flux_reference.transformer_config(True)
NETS = {
    "instantx": {**_T, "num_layers": 1, "num_single_layers": 2},
    "union": {**_T, "num_layers": 1, "num_single_layers": 2, "num_mode": 3},
    "union-pro-2": {**_T, "num_layers": 2, "num_single_layers": 0, "num_mode": 3},
}
for _net in NETS.values():
    del _net["out_channels"]  # a transformer key, not a ControlNet's


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(torch Flux pipeline, sdjax pipeline, {kind: (torch net, folder)})."""
    from sdjax.families.flux.pipeline import FluxPipeline

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    torch_pipe = flux_reference.flux_pipeline("dev", seed=0, tokenizer_dir=tok)
    folder = tmp_path_factory.mktemp("tiny-flux-dev")
    torch_pipe.save_pretrained(folder, safe_serialization=True)
    pipe, _ = FluxPipeline.from_pretrained(str(folder))
    nets = {}
    for seed, (kind, config) in enumerate(NETS.items()):
        torch.manual_seed(20 + seed)
        net = flux_reference.randomized_controlnet(diffusers.FluxControlNetModel(**config), 20 + seed)
        net_folder = tmp_path_factory.mktemp(f"flux-controlnet-{kind}")
        net.save_pretrained(net_folder, safe_serialization=True)
        nets[kind] = (net, net_folder)
    return torch_pipe, pipe, nets


def _torch(torch_pipe, net, keys, images, **kwargs):
    pipe = diffusers.FluxControlNetPipeline(**torch_pipe.components, controlnet=net)
    shape = (16, SIZE // 2, SIZE // 2)
    count = len(net) if isinstance(net, list) else 1
    with (
        inject.prescribed(
            pipe,
            latents_noise=inject.stream(keys, rng.LATENTS, shape),
            encode_eps=[inject.stream(keys, rng.ENCODE_CONTROL + k, shape) for k in range(count)],
        ),
        torch.no_grad(),
    ):
        return pipe(
            prompt=PROMPTS,
            control_image=images,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            max_sequence_length=MAX_SEQ,
            output_type="np",
            **kwargs,
        ).images


def _sdjax(pipe, seed, **kwargs):
    return pipe.generate(
        PROMPTS,
        steps=STEPS,
        height=SIZE,
        width=SIZE,
        seed=seed,
        guidance_scale=GUIDANCE,
        max_sequence_length=MAX_SEQ,
        output_type="np",
        **kwargs,
    )


def test_controlnet_with_true_cfg_matches_diffusers(models):
    torch_pipe, pipe, nets = models
    net, folder = nets["union-pro-2"]
    images = control_images(3)
    cfg = dict(negative_prompt=NEGATIVE, true_cfg_scale=4.0)
    ref = _torch(torch_pipe, net, inject.image_keys(6, 2), images, control_mode=1, **cfg, **WINDOW)
    out = _sdjax(pipe, 6, control_image=images, controlnet=str(folder), control_mode=1, **cfg, **WINDOW)
    assert out.shape == ref.shape == (2, SIZE, SIZE, 3)
    err = float(np.abs(out - ref).max())
    print(f"one net, true CFG: max abs image error {err:.2e}")
    assert err < ATOL
    # scale 0: the net is skipped (the same program, scales are inputs); the net changed the image by far more
    before = pipe.generator.cache.stats.compiles
    off = _sdjax(
        pipe, 6, control_image=images, controlnet=str(folder), control_mode=1, controlnet_conditioning_scale=0.0, **cfg
    )
    assert pipe.generator.cache.stats.compiles == before
    effect = float(np.abs(out - off).max())
    print(f"one net: the net changes the image by {effect:.2e}")
    assert effect > 20 * ATOL
    plain = _sdjax(pipe, 6, **cfg)
    assert float(np.abs(off - plain).max()) < 1e-5


def test_two_nets_with_a_union_mode_match_flux_multicontrolnet(models):
    """Both nets (diffusers: a list, `FluxMultiControlNetModel`), the union net with mode 2, each with its own image,
    scale and window; compiled ahead with `compile(controlnet=)`, generate runs that very program, and another
    mode changes the image without compiling."""
    torch_pipe, pipe, nets = models
    (a, folder_a), (b, folder_b) = nets["instantx"], nets["union"]
    maps = control_images(5)
    per_net = [maps[0], maps[1]]  # one image per net, for both generated images
    window = dict(
        controlnet_conditioning_scale=[0.7, 1.2], control_guidance_start=[0.2, 0.0], control_guidance_end=[0.8, 0.6]
    )
    ref = _torch(torch_pipe, [a, b], inject.image_keys(8, 2), per_net, control_mode=[None, 2], **window)
    folders = [str(folder_a), str(folder_b)]
    pipe.compile(batch_size=2, height=SIZE, width=SIZE, steps=STEPS, guidance=False, controlnet=folders)
    before = pipe.generator.cache.stats.compiles
    out = _sdjax(pipe, 8, control_image=per_net, controlnet=folders, control_mode=[None, 2], **window)
    err = float(np.abs(out - ref).max())
    print(f"two nets, union mode 2: max abs image error {err:.2e}")
    assert err < ATOL
    other = _sdjax(pipe, 8, control_image=per_net, controlnet=folders, control_mode=[None, 0], **window)
    assert pipe.generator.cache.stats.compiles == before  # the modes are inputs of the program compiled ahead
    # The mode is one more text token (after its LayerNorm, one of 25 about equal tokens), so another mode moves
    # the tiny model's image by little (1.1e-4 measured), yet by far more than the measured error (~1e-6): the
    # comparison resolves it. tests/models/test_flux_controlnet.py checks the modes' samples at 1e-5 relative.
    change = float(np.abs(out - other).max())
    print(f"two nets: mode 0 instead of 2 changes the image by {change:.2e}")
    assert change > max(50 * err, 2e-5)
    one = {k: [v[0], 0.0] if k == "controlnet_conditioning_scale" else v for k, v in window.items()}
    alone = _sdjax(pipe, 8, control_image=per_net, controlnet=folders, control_mode=[None, 2], **one)
    assert float(np.abs(out - alone).max()) > 20 * ATOL  # the second net counted


def test_quantized_net(models):
    """A net loaded with int8 kernels (those of 256 or more weights: every Linear of the tiny net) runs dequantized
    inside the program; the image equals the one of the same quantized weights dequantized on the host."""
    from sdjax.loading.controlnet import load_controlnet
    from sdjax.quant import params as P

    _, pipe, nets = models
    _, folder = nets["union-pro-2"]
    policy = P.QuantPolicy("int8", components=(P.CONTROLNET,), min_size=256)
    module, net_params = load_controlnet(folder, quantize=policy)
    assert "transformer_blocks_0/attn/to_q/kernel" in P.quantized_kernels(net_params)
    images = control_images(3)
    call = dict(control_image=images, control_mode=1, negative_prompt=NEGATIVE, true_cfg_scale=4.0, **WINDOW)
    out = _sdjax(pipe, 6, controlnet=(module, net_params), **call)
    ref = _sdjax(pipe, 6, controlnet=(module, P.dequantize_tree(net_params, jnp.float32)), **call)
    err = float(np.abs(out - ref).max())
    print(f"int8 net: max abs difference to the host-dequantized weights {err:.2e}")
    assert err < 1e-5


def _pair(kind: str = "instantx", **overrides):
    """An sdjax Flux ControlNet module (params are never read: the checks come first)."""
    return FluxControlNetModel(FluxControlNetConfig(**{**NETS[kind], **overrides})), {}


def _refused(pipe, match: str, error=ValueError, **kwargs):
    before = pipe.generator.cache.stats.compiles
    call = dict(control_image=control_images(3)[0], controlnet=_pair(), height=SIZE, width=SIZE)
    with pytest.raises(error, match=match):
        pipe.generate("a cat", steps=2, **{**call, **kwargs})
    assert pipe.generator.cache.stats.compiles == before  # refused before anything was compiled


def test_bad_controlnets_and_modes_are_refused_before_compiling(models):
    from sdjax.models.sd3_controlnet import SD3ControlNetConfig, SD3ControlNetModel

    _, pipe, _ = models
    sd3 = SD3ControlNetModel(SD3ControlNetConfig(num_layers=1)), {}
    _refused(pipe, r"controlnet is a SD3ControlNetModel \(a ControlNet of another model family\)", controlnet=sd3)
    d = NETS["instantx"]["joint_attention_dim"]
    _refused(pipe, f"joint_attention_dim is 16 in the ControlNet, {d} in", controlnet=_pair(joint_attention_dim=16))
    _refused(
        pipe,
        r"num_attention_heads \* attention_head_dim is 48 in the ControlNet, 32",
        controlnet=_pair(num_attention_heads=3),
    )
    _refused(pipe, "in_channels is 16 in the ControlNet, 64", controlnet=_pair(in_channels=16))
    two = dict(control_image=control_images(3))
    mixed = [_pair(), _pair("union-pro-2")]
    _refused(
        pipe, r"controlnet\[1\] has num_layers=2, controlnet\[0\] 1", controlnet=mixed, control_mode=[None, 1], **two
    )
    # control modes: needed by a union net, in its range, for union nets only, ints, one per net
    _refused(pipe, r"control_mode: controlnet is a ControlNet-Union net \(num_mode=3\)", controlnet=_pair("union"))
    _refused(pipe, r"control_mode=3 must lie in \[0, 3\)", controlnet=_pair("union"), control_mode=3)
    _refused(pipe, "control_mode=1: controlnet is not a ControlNet-Union net", control_mode=1)
    _refused(pipe, "control_mode must be an int or None", TypeError, controlnet=_pair("union"), control_mode=1.0)
    _refused(pipe, r"control_mode: got 2 value\(s\) for 1 ControlNet", controlnet=_pair("union"), control_mode=[1, 2])
    # arguments diffusers' FluxControlNetPipeline does not take
    _refused(pipe, "guess_mode: Flux ControlNets have no guess mode", guess_mode=True)
    _refused(pipe, "text-to-image only", image=control_images(4)[0], strength=0.5)
    with pytest.raises(ValueError, match="control_mode= needs control_image="):
        pipe.generate("a cat", steps=2, height=SIZE, width=SIZE, control_mode=1)


def test_flux_controlnet_is_refused_by_other_families():
    from sdjax.families.sd3.controlnet import check_nets as check_sd3_nets
    from sdjax.pipelines.controlnet import control_request, control_spec

    on_sd3 = r"controlnet is a FluxControlNetModel \(a Flux.1 ControlNet\) but the pipeline is Stable Diffusion 3"
    with pytest.raises(ValueError, match=on_sd3):
        check_sd3_nets([_pair()[0]], None)
    sd_like = types.SimpleNamespace(unet=types.SimpleNamespace(config=None), dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"controlnet is a FluxControlNetModel \(a Flux.1 ControlNet\)"):
        control_spec(sd_like, _pair(), None)
    with pytest.raises(ValueError, match="control_mode=1: only ControlNet-Union nets of Flux take a control mode"):
        kwargs = dict(params=None, count=1, height=SIZE, width=SIZE, task="txt2img")
        control_request(sd_like, control_image=None, controlnet=_pair(), control_mode=1, **kwargs)
