"""SD 3 / 3.5 LoRAs (`sdjax.families.sd3.lora`, `StableDiffusion3Pipeline.load_lora`) against diffusers 0.42.1 +
peft 0.21.2 (`StableDiffusion3Pipeline.load_lora_weights` + `fuse_lora`) on the tiny SD 3.5-medium-shaped pipeline
of tests/sd3_reference.py (a dual-attention block 0, a context pre-only last block), without T5.

The LoRA is written the way diffusers' trainer writes it (PEFT `lora_A` / `lora_B` keys, alpha in the
`lora_adapter_metadata`) on attention q/k/v/out of both streams, `attn2`, the MLPs, the AdaLN linears (the pre-only
block's and `norm_out`), `proj_out`, `context_embedder`, the pooled-text MLP, the patch convolution and both CLIP
text encoders. diffusers gets sdjax's noise (tests/inject.py); images in [0, 1] agree to the SD 3 pipeline tests'
1e-3 and differ from the base image by far more. The same deltas in kohya / ComfyUI's reference MMDiT names (fused
qkv, swapped AdaLN halves, `lora_te1_` / `lora_te2_`) give the same fused params, which are also checked against
the checkpoint loader's own table (`weights.sd3_transformer_state_dict`).
"""

from __future__ import annotations

import inject
import numpy as np
import pytest
import sd3_reference
import torch
from flax.traverse_util import flatten_dict

from sdjax import rng
from sdjax.families.sd3 import lora as SL
from sdjax.families.sd3.weights import sd3_transformer_state_dict
from sdjax.loading.lora import LoraError, apply_loras, to_flax_kernel
from sdjax.models.convert import torch_key_to_path

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from safetensors.numpy import save_file

ATOL = 1e-3  # tests/families/test_sd3_pipeline.py
PROMPTS = ["a photo of an astronaut riding a horse", "a red circle on a blue background"]
NEGATIVE = ["blurry, low quality", "green"]
STEPS, SIZE, MAX_SEQ, GUIDANCE, SEED = 4, 32, 24, 5.0, 11
RANK = 4
ALPHA, TE_ALPHA = 6, 8  # alpha / r: 1.5 on the transformer, 2 on the text encoders
SCALE = 0.8

TRANSFORMER_MODULES = (  # diffusers names -> their reference (single-file) names in `kohya_file`
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.attn2.to_q",
    "transformer_blocks.0.attn2.to_k",
    "transformer_blocks.0.attn2.to_v",
    "transformer_blocks.1.attn.add_q_proj",
    "transformer_blocks.1.attn.add_k_proj",
    "transformer_blocks.1.attn.add_v_proj",
    "transformer_blocks.1.attn.to_add_out",
    "transformer_blocks.1.ff.net.0.proj",
    "transformer_blocks.2.ff.net.2",
    "transformer_blocks.0.ff_context.net.2",
    "transformer_blocks.1.norm1.linear",
    "transformer_blocks.2.norm1_context.linear",
    "norm_out.linear",
    "proj_out",
    "context_embedder",
    "time_text_embed.text_embedder.linear_1",
    "pos_embed.proj",
)
TE_MODULES = {
    "text_encoder": ("text_model.encoder.layers.0.self_attn.q_proj", "text_model.encoder.layers.3.mlp.fc2"),
    "text_encoder_2": ("text_model.encoder.layers.1.self_attn.out_proj", "text_model.encoder.layers.3.mlp.fc1"),
}
# reference module -> (diffusers modules whose deltas it fuses (qkv: stacked rows), rows swapped)
REFERENCE = {
    "joint_blocks.0.x_block.attn.qkv": ([f"transformer_blocks.0.attn.to_{p}" for p in "qkv"], False),
    "joint_blocks.0.x_block.attn2.qkv": ([f"transformer_blocks.0.attn2.to_{p}" for p in "qkv"], False),
    "joint_blocks.1.context_block.attn.qkv": ([f"transformer_blocks.1.attn.add_{p}_proj" for p in "qkv"], False),
    "joint_blocks.0.x_block.attn.proj": (["transformer_blocks.0.attn.to_out.0"], False),
    "joint_blocks.1.context_block.attn.proj": (["transformer_blocks.1.attn.to_add_out"], False),
    "joint_blocks.1.x_block.mlp.fc1": (["transformer_blocks.1.ff.net.0.proj"], False),
    "joint_blocks.2.x_block.mlp.fc2": (["transformer_blocks.2.ff.net.2"], False),
    "joint_blocks.0.context_block.mlp.fc2": (["transformer_blocks.0.ff_context.net.2"], False),
    "joint_blocks.1.x_block.adaLN_modulation.1": (["transformer_blocks.1.norm1.linear"], False),
    "joint_blocks.2.context_block.adaLN_modulation.1": (["transformer_blocks.2.norm1_context.linear"], True),
    "final_layer.adaLN_modulation.1": (["norm_out.linear"], True),
    "final_layer.linear": (["proj_out"], False),
    "context_embedder": (["context_embedder"], False),
    "y_embedder.mlp.0": (["time_text_embed.text_embedder.linear_1"], False),
    "x_embedder.proj": (["pos_embed.proj"], False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(torch pipeline, sdjax pipeline, {component: {module: (down, up)}}, folder with the LoRA files)."""
    from peft import LoraConfig

    from sdjax.families.sd3.pipeline import StableDiffusion3Pipeline

    tmp = tmp_path_factory.mktemp("sd3-lora")
    torch_pipe = sd3_reference.sd3_pipeline(seed=0, t5=False)
    torch_pipe.save_pretrained(tmp / "model", safe_serialization=True)
    pipe, _ = StableDiffusion3Pipeline.from_pretrained(str(tmp / "model"))
    draw = np.random.default_rng(0)
    pairs = {"transformer": {m: _pair(draw, torch_pipe.transformer, m) for m in TRANSFORMER_MODULES}}
    for component, modules in TE_MODULES.items():
        pairs[component] = {m: _pair(draw, getattr(torch_pipe, component), m) for m in modules}
    layers = {
        f"{component}_lora_layers": {
            f"{m}.lora_{ab}.weight": torch.from_numpy(w) for m, pair in mods.items() for ab, w in zip("AB", pair)
        }
        for component, mods in pairs.items()
    }
    metadata = {
        f"{component}_lora_adapter_metadata": LoraConfig(
            r=RANK, lora_alpha=ALPHA if component == "transformer" else TE_ALPHA, target_modules=list(mods)
        ).to_dict()
        for component, mods in pairs.items()
    }
    diffusers.StableDiffusion3Pipeline.save_lora_weights(str(tmp), weight_name="peft.safetensors", **layers, **metadata)
    save_file(kohya_state_dict(pairs), str(tmp / "kohya.safetensors"))
    return torch_pipe, pipe, pairs, tmp


def _pair(draw, model, module: str) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's `(lora_A (r, in[, kh, kw]), lora_B (out, r[, 1, 1]))` for one Linear or Conv2d of `model`."""
    shape = tuple(model.get_submodule(module).weight.shape)
    down = (0.2 * draw.standard_normal((RANK, *shape[1:]))).astype(np.float32)
    up = (0.2 * draw.standard_normal((shape[0], RANK, *[1] * (len(shape) - 2)))).astype(np.float32)
    return down, up


def kohya_state_dict(pairs) -> dict[str, np.ndarray]:
    """The same deltas as kohya / sd-scripts writes them in the reference names: a fused qkv has the three downs
    stacked and the ups block-diagonal (rank 3r), a swapped AdaLN its up's halves exchanged; `.alpha` keeps
    alpha / r."""
    out = {}

    def put(name, down, up, alpha_over_rank):
        out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"] = down, up
        out[f"{name}.alpha"] = np.asarray(alpha_over_rank * down.shape[0], np.float32)

    for ref, (modules, swap) in REFERENCE.items():
        downs, ups = zip(*(pairs["transformer"][m] for m in modules))
        down = np.concatenate(downs, axis=0)
        up = np.zeros((sum(u.shape[0] for u in ups), down.shape[0], *ups[0].shape[2:]), np.float32)
        for i, u in enumerate(ups):
            up[i * u.shape[0] : (i + 1) * u.shape[0], i * RANK : (i + 1) * RANK] = u
        if swap:
            up = np.concatenate([up[len(up) // 2 :], up[: len(up) // 2]])
        put("lora_unet_" + ref.replace(".", "_"), down, up, ALPHA / RANK)
    for component, te in (("text_encoder", "lora_te1_"), ("text_encoder_2", "lora_te2_")):
        for module, (down, up) in pairs[component].items():
            put(te + module.replace(".", "_"), down, up, TE_ALPHA / RANK)
    return out


def _torch(pipe, seed: int):
    keys = inject.image_keys(seed, len(PROMPTS))
    shape = (16, SIZE // 2, SIZE // 2)
    with inject.prescribed(pipe, latents_noise=inject.stream(keys, rng.LATENTS, shape)), torch.no_grad():
        return pipe(
            prompt=PROMPTS,
            negative_prompt=NEGATIVE,
            guidance_scale=GUIDANCE,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            max_sequence_length=MAX_SEQ,
            output_type="np",
        ).images


def _sdjax(pipe, seed: int):
    return pipe.generate(
        PROMPTS,
        negative_prompt=NEGATIVE,
        guidance_scale=GUIDANCE,
        steps=STEPS,
        height=SIZE,
        width=SIZE,
        seed=seed,
        max_sequence_length=MAX_SEQ,
        output_type="np",
    )


def _touched(pipe) -> dict:
    """`{(component, kernel path): array}` of the kernels the loaded LoRAs adapt, from `pipe.params`."""
    flat = {c: flatten_dict(pipe.params[c]) for c in ("transformer", "text_encoder", "text_encoder_2")}
    targets = {t for lora in pipe.loaded_loras.values() for t in lora.factors}
    return {(c, p): np.asarray(flat[c][p], np.float32) for c, p in targets}


def test_peft_lora_matches_diffusers(models):
    torch_pipe, pipe, _, tmp = models
    base = _sdjax(pipe, SEED)
    torch_pipe.load_lora_weights(str(tmp / "peft.safetensors"), adapter_name="peft")
    try:
        torch_pipe.fuse_lora(lora_scale=SCALE, adapter_names=["peft"])
        ref = _torch(torch_pipe, SEED)
    finally:
        torch_pipe.unfuse_lora()
        torch_pipe.unload_lora_weights()
    name = pipe.load_lora(tmp / "peft.safetensors", scale=SCALE)
    try:
        lora = pipe.loaded_loras[name]
        assert len(lora.factors) == len(TRANSFORMER_MODULES) + 4
        assert {f.alpha_over_rank for (c, _), f in lora.factors.items()} == {1.5, 2.0}
        out = _sdjax(pipe, SEED)
        pipe.set_loras({name: (0.0, SCALE)})  # the text encoders' part matters too
        te_part = float(np.abs(out - _sdjax(pipe, SEED)).max())
    finally:
        pipe.unload_loras()
    err, moved = float(np.abs(out - ref).max()), float(np.abs(out - base).max())
    print(
        f"PEFT LoRA, scale {SCALE}: max |sdjax - diffusers| {err:.2e}; the LoRA moves the image by {moved:.2e}, "
        f"its text-encoder layers by {te_part:.2e}"
    )
    assert err < ATOL and moved > 0.1 and te_part > 1e-2


def test_kohya_reference_names_equal_peft(models):
    """kohya / ComfyUI names (fused qkv, swapped halves, lora_te1_/lora_te2_) fuse to the PEFT file's params, give
    its image, and agree with the checkpoint loader's reference -> diffusers table."""
    _, pipe, pairs, tmp = models
    base = {c: flatten_dict(pipe.params[c]) for c in ("transformer", "text_encoder", "text_encoder_2")}
    pipe.load_lora(tmp / "peft.safetensors", scale=SCALE)
    peft_params, peft_image = _touched(pipe), _sdjax(pipe, SEED)
    pipe.unload_loras()
    pipe.load_lora(tmp / "kohya.safetensors", scale=SCALE)
    try:
        kohya_params, kohya_image = _touched(pipe), _sdjax(pipe, SEED)
    finally:
        pipe.unload_loras()
    assert sorted(peft_params) == sorted(kohya_params)
    worst = max(float(np.abs(peft_params[k] - kohya_params[k]).max()) for k in peft_params)
    image = float(np.abs(peft_image - kohya_image).max())
    print(f"kohya vs PEFT: params {worst:.1e}, images {image:.1e}")
    assert worst < 1e-6 and image < 1e-5
    # the checkpoint loader's table, given each reference module's full delta as its weight
    full, raw = {}, kohya_state_dict(pairs)
    for ref in REFERENCE:
        key = "lora_unet_" + ref.replace(".", "_")
        down, up = raw[f"{key}.lora_down.weight"], raw[f"{key}.lora_up.weight"]
        w = SCALE * ALPHA / RANK * (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1))
        full[f"{ref}.weight"] = w.reshape(up.shape[0], *down.shape[1:])
    converted = sd3_transformer_state_dict(full)
    assert len(converted) == len(TRANSFORMER_MODULES)
    for key in converted:
        path = ("transformer", *torch_key_to_path(key)[:-1], "kernel")
        got = kohya_params[(path[0], path[1:])] - np.asarray(base["transformer"][path[1:]], np.float32)
        want = to_flax_kernel(np.asarray(converted[key]), got.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=key)


def _fused(params, lora) -> dict:
    fused = apply_loras(params, [(lora, 1.0)])
    return {(c, p): np.asarray(_leaf(fused, c, p), np.float32) for c, p in lora.factors}


def _leaf(params, component, path):
    node = params[component]
    for key in path:
        node = node[key]
    return node


def test_other_spellings(models):
    """ComfyUI's dotted reference names (`diffusion_model.`, lora_A / lora_B) read as kohya's; OneTrainer's
    `lora_transformer_` and ComfyUI's `text_encoders.clip_l.transformer.` / `base_model.model.` read as PEFT's."""
    _, pipe, pairs, _ = models
    kohya = kohya_state_dict(pairs)
    comfy = {k: v for k, v in kohya.items() if k.startswith("lora_te")}
    for ref in REFERENCE:
        key = "lora_unet_" + ref.replace(".", "_")
        comfy[f"diffusion_model.{ref}.lora_A.weight"] = kohya[f"{key}.lora_down.weight"]
        comfy[f"diffusion_model.{ref}.lora_B.weight"] = kohya[f"{key}.lora_up.weight"]
        comfy[f"diffusion_model.{ref}.alpha"] = kohya[f"{key}.alpha"]
    peft, spelled = {}, {}
    prefixes = {"transformer": ("transformer.", "lora_transformer_"), "text_encoder": ("text_encoder.", None)}
    prefixes["text_encoder_2"] = ("text_encoder_2.", None)
    for component, mods in pairs.items():
        for i, (module, (down, up)) in enumerate(mods.items()):
            alpha = np.asarray(ALPHA if component == "transformer" else TE_ALPHA, np.float32)
            for key, value in ((".lora_A.weight", down), (".lora_B.weight", up), (".alpha", alpha)):
                peft[prefixes[component][0] + module + key] = value
            if component == "transformer":
                other = ("lora_transformer_" + module.replace(".", "_"), "base_model.model." + module)[i % 2]
            else:
                clip = "clip_l" if component == "text_encoder" else "clip_g"
                other = f"text_encoders.{clip}.transformer.{module}"
            for key, value in ((".lora_down.weight", down), (".lora_up.weight", up), (".alpha", alpha)):
                spelled[other + key] = value
    params = {c: pipe.params[c] for c in ("transformer", "text_encoder", "text_encoder_2")}
    for a, b in ((kohya, comfy), (peft, spelled)):
        fa = _fused(params, SL.resolve_sd3_lora(a, params, source="a"))
        fb = _fused(params, SL.resolve_sd3_lora(b, params, source="b"))
        assert sorted(fa) == sorted(fb) and len(fa) == len(TRANSFORMER_MODULES) + 4
        for target, w in fa.items():
            np.testing.assert_array_equal(w, fb[target], err_msg=str(target))


def test_scales_are_linear_and_unfuse_restores(models):
    _, pipe, _, tmp = models
    base = pipe.params
    flat_base = {c: flatten_dict(base[c]) for c in ("transformer", "text_encoder", "text_encoder_2")}
    name = pipe.load_lora(tmp / "peft.safetensors", scale=1.0)
    try:
        one = _touched(pipe)
        pipe.set_loras({name: 0.5})
        half = _touched(pipe)
        for (c, p), w in one.items():
            b = np.asarray(flat_base[c][p], np.float32)
            np.testing.assert_allclose(half[(c, p)] - b, 0.5 * (w - b), rtol=0, atol=1e-6, err_msg=f"{c} {p}")
        pipe.set_loras({name: (0.0, 1.0)})  # A1111's <lora:name:te:unet>: text encoders off, transformer on
        split = _touched(pipe)
        for (c, p), w in one.items():
            want = np.asarray(flat_base[c][p], np.float32) if c.startswith("text_encoder") else w
            np.testing.assert_array_equal(split[(c, p)], want)
        pipe.unfuse_loras()
        assert pipe.params is base and pipe.active_loras == {}
    finally:
        pipe.unload_loras()
    assert pipe.params is base


def _write(path, layers: dict[str, tuple[int, int]]):
    """A kohya-style file: `{module: (out, in)}` -> lora_down / lora_up / alpha."""
    draw = np.random.default_rng(1)
    sd = {}
    for module, (out, inn) in layers.items():
        sd[f"{module}.lora_down.weight"] = draw.standard_normal((RANK, inn)).astype(np.float32)
        sd[f"{module}.lora_up.weight"] = draw.standard_normal((out, RANK)).astype(np.float32)
        sd[f"{module}.alpha"] = np.asarray(RANK, np.float32)
    save_file(sd, str(path))
    return path


def test_refusals_name_the_keys(models, tmp_path):
    _, pipe, _, _ = models
    good = {"lora_unet_joint_blocks_0_x_block_attn_proj": (32, 32)}
    cases = {
        "sd15": ({"lora_unet_down_blocks_0_attentions_0_proj_in": (320, 320)}, r"SD 1\.x/2\.x or SDXL LoRA"),
        "flux": ({"lora_unet_double_blocks_0_img_attn_qkv": (96, 32)}, r"a Flux\.1 LoRA"),
        "flux_peft": ({"transformer.single_transformer_blocks.0.attn.to_q": (32, 32)}, r"a Flux\.1 LoRA"),
        "deeper": ({**good, "lora_unet_joint_blocks_7_x_block_attn_proj": (32, 32)}, r"joint_blocks_7_x_block_attn"),
        "no_attn2": ({**good, "lora_unet_joint_blocks_1_x_block_attn2_qkv": (96, 32)}, r"blocks_1_x_block_attn2_qkv"),
        "pre_only": ({**good, "diffusion_model.joint_blocks.2.context_block.mlp.fc1": (128, 32)}, r"2\.context_block"),
        "t5": ({**good, "lora_te3_encoder_block_0_layer_0_SelfAttention_q": (96, 96)}, r"T5 .* lora_te3_encoder"),
        "unknown": ({**good, "some_other_net.layer": (32, 32)}, r"no SD 3 LoRA layout: some_other_net\.layer"),
        "te_layer": ({**good, "lora_te1_text_model_encoder_layers_9_mlp_fc1": (37, 32)}, r"lora_te1_.*layers_9"),
        "width": ({"transformer.transformer_blocks.0.attn.to_q": (1536, 1536)}, r"\(1536, 1536\) vs transformer_b"),
    }
    before = pipe.params
    for name, (layers, match) in cases.items():
        path = _write(tmp_path / f"{name}.safetensors", layers)
        with pytest.raises(LoraError, match=match):
            pipe.load_lora(path)
        assert pipe.params is before and pipe.loaded_loras == {}
    save_file(
        {"lora_unet_joint_blocks_0_x_block_attn_proj.hada_w1_a": np.zeros((2, 32), np.float32)},
        str(tmp_path / "loha.safetensors"),
    )
    with pytest.raises(LoraError, match="LoHa"):
        pipe.load_lora(tmp_path / "loha.safetensors")
    # a float8 kernel (keep_fp8) would be rounded: refused when read
    import ml_dtypes

    fp8 = dict(pipe.params)
    blocks = dict(fp8["transformer"])
    block = dict(blocks["transformer_blocks_0"])
    attn = dict(block["attn"])
    attn["to_out_0"] = {**attn["to_out_0"], "kernel": np.zeros((32, 32), ml_dtypes.float8_e4m3fn)}
    block["attn"], blocks["transformer_blocks_0"], fp8["transformer"] = attn, block, blocks
    path = _write(tmp_path / "good.safetensors", good)
    with pytest.raises(LoraError, match="keep_fp8"):
        SL.load_sd3_lora(path, fp8)
    lora = SL.load_sd3_lora(path, pipe.params)
    assert list(lora.factors) == [("transformer", ("transformer_blocks_0", "attn", "to_out_0", "kernel"))]
