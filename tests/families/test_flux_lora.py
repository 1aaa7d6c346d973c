"""Flux LoRAs (`sdjax.families.flux.lora`) against diffusers 0.42.1's `FluxPipeline.load_lora_weights` +
`fuse_lora` on a tiny pipeline (tiny CLIP, T5, transformer and VAE).

LoRA files are written the ways they come: kohya / sd-scripts (`lora_unet_<BFL module>.lora_down.weight`, `.alpha`,
float16), ComfyUI's BFL names (`diffusion_model.<BFL module>`), diffusers' own writer (PEFT keys with the
`lora_adapter_metadata` alpha). diffusers reads BFL names through its kohya converter only, so the `lora_A` /
`lora_B` BFL file sdjax reads is compared with diffusers loading its `lora_down` / `lora_up` twin (same tensors).
The fused transformer weights must agree to 1e-5 (float32; measured below).

Two things diffusers 0.42.1 cannot be the reference for (module docstring of the code): a single block's `linear1`
(its converter splits it at Flux.1's width 3072) and the layers outside the blocks (`img_in`, `time_in`, ...,
`final_layer`: converted, then not loaded). Those are checked against `alpha / r * up @ down` directly.
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from sdjax.families.flux import lora as FL
from sdjax.loading.lora import LoraError, UnmatchedLoraKeysWarning
from sdjax.models import flux as F

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    axes_dims_rope=(4, 6, 6),
    guidance_embeds=True,
)
INNER = 32
TOL = 1e-5  # float32: max |fused sdjax - fused diffusers|


def tiny_pipeline(tmp_path, seed=0):
    from reference import CLIP_SD1, clip_tokenizer, text_encoder
    from t5_reference import t5_encoder, write_t5_tokenizer
    from transformers import T5TokenizerFast

    torch.manual_seed(seed)
    transformer = diffusers.FluxTransformer2DModel(**TINY).eval()
    vae = diffusers.AutoencoderKL(
        latent_channels=4,
        block_out_channels=(32,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        layers_per_block=1,
        norm_num_groups=32,
    )
    folder = tmp_path / "tokenizer_2"
    if not folder.exists():
        write_t5_tokenizer(folder)
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder(CLIP_SD1),
        tokenizer=clip_tokenizer(),
        text_encoder_2=t5_encoder(),
        tokenizer_2=T5TokenizerFast.from_pretrained(str(folder)),
        transformer=transformer,
    )


def state(module) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in module.state_dict().items()}


def params_of(sd) -> dict:
    return F.convert_flux_transformer(sd, F.FluxTransformerConfig(**TINY))


def fused_by_diffusers(tmp_path, files_and_scales) -> dict:
    """The transformer's params after diffusers loads the LoRA files and fuses them with their scales."""
    pipe = tiny_pipeline(tmp_path)
    names = []
    for i, (path, _) in enumerate(files_and_scales):
        pipe.load_lora_weights(str(path), adapter_name=f"l{i}")
        names.append(f"l{i}")
    if len(names) == 1:
        pipe.fuse_lora(lora_scale=files_and_scales[0][1], adapter_names=names)
    else:
        pipe.set_adapters(names, adapter_weights=[s for _, s in files_and_scales])
        pipe.fuse_lora(lora_scale=1.0, adapter_names=names)
    pipe.unload_lora_weights()
    return params_of(state(pipe.transformer))


def pair(rng, out: int, inn: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(down (r, in), up (out, r)) rounded to float16 values, so the float16 files hold exactly these."""
    down = (0.3 * rng.standard_normal((rank, inn))).astype(np.float16).astype(np.float32)
    up = (0.3 * rng.standard_normal((out, rank))).astype(np.float16).astype(np.float32)
    return down, up


def compare(got: dict, want: dict, base: dict) -> tuple[float, int]:
    """Max |got - want| over all leaves, and how many kernels the LoRAs changed."""
    g, w, b = (flatten_dict(t) for t in (got, want, base))
    assert sorted(g) == sorted(w)
    worst = max(float(np.max(np.abs(np.asarray(g[k], np.float32) - np.asarray(w[k], np.float32)))) for k in g)
    changed = sum(not np.array_equal(np.asarray(w[k]), np.asarray(b[k])) for k in w)
    return worst, changed


# BFL modules of the tiny model with (out rows, in) -- D = 32, MLP 128, modulation 6D / 3D.
MODULES = {
    "double_blocks.0.img_attn.qkv": (3 * INNER, INNER),
    "double_blocks.1.txt_attn.qkv": (3 * INNER, INNER),
    "double_blocks.0.img_attn.proj": (INNER, INNER),
    "double_blocks.1.txt_attn.proj": (INNER, INNER),
    "double_blocks.0.img_mlp.0": (4 * INNER, INNER),
    "double_blocks.1.txt_mlp.2": (INNER, 4 * INNER),
    "double_blocks.0.txt_mod.lin": (6 * INNER, INNER),
    "single_blocks.0.linear2": (INNER, 5 * INNER),
    "single_blocks.1.modulation.lin": (3 * INNER, INNER),
}
NAMES = {  # the layouts of one layer: kohya (underscores), ComfyUI (dotted), BFL-named PEFT
    "kohya": lambda m: (f"lora_unet_{m.replace('.', '_')}", "lora_down", "lora_up"),
    "comfy": lambda m: (f"diffusion_model.{m}", "lora_down", "lora_up"),
    "bfl": lambda m: (f"diffusion_model.{m}", "lora_A", "lora_B"),
}


def bfl_lora_file(path, rng, modules=MODULES, *, layout="kohya", rank=4, sparse=("double_blocks.1.txt_attn.qkv",)):
    """A LoRA on BFL modules, float16, alpha = rank / 2 (diffusers' kohya converter multiplies the float16 tensors
    by alpha / r before anything else: a power of two keeps that exact); one up block-diagonal (`sparse`: as
    sd-scripts writes qkv LoRAs trained per projection; diffusers then chunks `down` too)."""
    out = {}
    for module, (rows, inn) in modules.items():
        r = 6 if module in sparse else rank
        down, up = pair(rng, rows, inn, r)
        if module in sparse:
            for i in range(3):  # the rows of part i use only ranks 2i, 2i + 1
                part = up[i * INNER : (i + 1) * INNER]
                keep = np.zeros_like(part)
                keep[:, 2 * i : 2 * i + 2] = part[:, 2 * i : 2 * i + 2]
                up[i * INNER : (i + 1) * INNER] = keep
        key, d, u = NAMES[layout](module)
        out[f"{key}.{d}.weight"] = down.astype(np.float16)
        out[f"{key}.{u}.weight"] = up.astype(np.float16)
        out[f"{key}.alpha"] = np.asarray(r / 2, np.float16)
    save_file(out, str(path))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux_lora")
    return tmp, params_of(state(tiny_pipeline(tmp).transformer))


def test_kohya_lora_matches_diffusers(base):
    tmp, params = base
    path = bfl_lora_file(tmp / "kohya.safetensors", np.random.default_rng(0))
    want = fused_by_diffusers(tmp, [(path, 0.8)])
    lora = FL.load_flux_lora(path, params)
    assert len(lora.factors) == 13  # two qkv LoRAs -> 6 targets, 7 others
    got = FL.apply_loras(params, [lora], [0.8])
    worst, changed = compare(got, want, params)
    print(f"kohya, scale 0.8: {changed} kernels changed, max |sdjax - diffusers| {worst:.1e}")
    assert changed == 13 and worst <= TOL
    untouched = flatten_dict(got)[("x_embedder", "kernel")]
    assert untouched is flatten_dict(params)[("x_embedder", "kernel")]


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")  # diffusers, two adapters
def test_peft_and_bfl_layouts_two_at_once(base):
    """A diffusers-saved PEFT LoRA (alpha from its metadata) and a BFL-named lora_A/lora_B LoRA (ComfyUI/ai-toolkit
    style, `diffusion_model.` prefix, `.alpha`), fused together with scales 0.7 and -0.4, on device arrays."""
    from peft import LoraConfig

    tmp, params = base
    rng = np.random.default_rng(1)
    peft_layers, targets = {}, []
    for module, (rows, inn) in {
        "transformer_blocks.0.attn.to_q": (INNER, INNER),
        "transformer_blocks.1.ff_context.net.0.proj": (4 * INNER, INNER),
        "single_transformer_blocks.0.proj_mlp": (4 * INNER, INNER),
        "single_transformer_blocks.1.attn.to_k": (INNER, INNER),
        "context_embedder": (INNER, 32),
    }.items():
        down, up = pair(rng, rows, inn, 4)
        peft_layers[f"{module}.lora_A.weight"] = torch.from_numpy(down)
        peft_layers[f"{module}.lora_B.weight"] = torch.from_numpy(up)
        targets.append(module)
    config = LoraConfig(r=4, lora_alpha=6, target_modules=targets)
    peft_path = tmp / "peft.safetensors"
    diffusers.FluxPipeline.save_lora_weights(
        str(tmp),
        weight_name=peft_path.name,
        transformer_lora_layers=peft_layers,
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    with safe_open(str(peft_path), "np") as f:
        assert json.loads(f.metadata()["lora_adapter_metadata"])["transformer.lora_alpha"] == 6
    # BFL names with lora_down/up (what diffusers reads) and their lora_A/B twin (what sdjax reads here)
    modules = {k: v for k, v in MODULES.items() if "qkv" in k or "mod" in k or "mlp" in k}
    bfl_lora_file(tmp / "comfy.safetensors", np.random.default_rng(2), modules, layout="comfy")
    bfl_lora_file(tmp / "bfl.safetensors", np.random.default_rng(2), modules, layout="bfl")
    want = fused_by_diffusers(tmp, [(peft_path, 0.7), (tmp / "comfy.safetensors", -0.4)])
    device_params = jax.tree_util.tree_map(jnp.asarray, params)
    a = FL.load_flux_lora(peft_path, device_params)
    b = FL.load_flux_lora(tmp / "bfl.safetensors", device_params)
    assert {f.alpha_over_rank for f in a.factors.values()} == {1.5}
    got = FL.apply_loras(device_params, [a, b], [0.7, -0.4])
    worst, changed = compare(got, want, params)
    print(f"PEFT 0.7 + BFL -0.4: {changed} kernels changed, max |sdjax - diffusers| {worst:.1e}")
    assert changed == 5 + 9 and worst <= TOL


def test_layers_diffusers_does_not_load(base):
    """`linear1` (split at this model's width) and the layers outside the blocks, against the formula; diffusers
    0.42.1 leaves the latter untouched (the reason sdjax cannot use it as the reference here)."""
    tmp, params = base
    rng = np.random.default_rng(3)
    modules = {
        "single_blocks.1.linear1": (3 * INNER + 4 * INNER, INNER),
        "img_in": (INNER, 16),
        "time_in.in_layer": (INNER, 256),
        "guidance_in.out_layer": (INNER, INNER),
        "final_layer.adaLN_modulation.1": (2 * INNER, INNER),
        "final_layer.linear": (16, INNER),
    }
    path = bfl_lora_file(tmp / "outer.safetensors", rng, modules)
    raw = load_file(str(path))
    lora = FL.load_flux_lora(path, params)
    got = flatten_dict(FL.apply_loras(params, [lora], [1.5]))
    flat = flatten_dict(params)

    def delta(name):
        d, u = (raw[f"lora_unet_{name.replace('.', '_')}.lora_{r}.weight"].astype(np.float32) for r in ("down", "up"))
        return 1.5 * 2.0 / 4 * u @ d  # scale * alpha / rank * up @ down, PyTorch layout (out, in)

    expect = {}
    lin1 = delta("single_blocks.1.linear1")
    for i, name in enumerate(("attn/to_q", "attn/to_k", "attn/to_v")):
        expect[("single_transformer_blocks_1", *name.split("/"), "kernel")] = lin1[i * INNER : (i + 1) * INNER]
    expect[("single_transformer_blocks_1", "proj_mlp", "kernel")] = lin1[3 * INNER :]
    expect[("x_embedder", "kernel")] = delta("img_in")
    expect[("time_text_embed", "timestep_embedder", "linear_1", "kernel")] = delta("time_in.in_layer")
    expect[("time_text_embed", "guidance_embedder", "linear_2", "kernel")] = delta("guidance_in.out_layer")
    ada = delta("final_layer.adaLN_modulation.1")
    expect[("norm_out", "linear", "kernel")] = np.concatenate([ada[INNER:], ada[:INNER]])  # (shift, scale) swapped
    expect[("proj_out", "kernel")] = delta("final_layer.linear")
    assert sorted(p for _, p in lora.factors) == sorted(expect)
    for p, d in expect.items():
        np.testing.assert_allclose(got[p] - flat[p], d.T, rtol=0, atol=1e-6, err_msg="/".join(p))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outer = {k: v for k, v in modules.items() if "linear1" not in k}
        want = flatten_dict(fused_by_diffusers(tmp, [(bfl_lora_file(tmp / "outer2.safetensors", rng, outer), 1.0)]))
    assert all(np.array_equal(want[p], flat[p]) for p in expect if p[0] != "single_transformer_blocks_1")


def test_kohya_spelling_of_diffusers_names(base, tmp_path):
    """`lora_transformer_<diffusers module with underscores>` (kohya's files of diffusers-trained LoRAs) reads as
    the PEFT keys of the same layers."""
    _, params = base
    rng = np.random.default_rng(5)
    peft, kohya = {}, {}
    for module, underscored, rows, inn in (
        ("transformer_blocks.0.attn.to_out.0", "transformer_blocks_0_attn_to_out_0", INNER, INNER),
        ("single_transformer_blocks.1.norm.linear", "single_transformer_blocks_1_norm_linear", 3 * INNER, INNER),
        ("time_text_embed.text_embedder.linear_1", "time_text_embed_text_embedder_linear_1", INNER, 24),
    ):
        down, up = pair(rng, rows, inn, 2)
        peft[f"transformer.{module}.lora_A.weight"], peft[f"transformer.{module}.lora_B.weight"] = down, up
        kohya[f"lora_transformer_{underscored}.lora_down.weight"] = down
        kohya[f"lora_transformer_{underscored}.lora_up.weight"] = up
        kohya[f"lora_transformer_{underscored}.alpha"] = np.asarray(2.0, np.float32)
    save_file(peft, str(tmp_path / "peft.safetensors"))
    save_file(kohya, str(tmp_path / "kohya.safetensors"))
    a = FL.load_flux_lora(tmp_path / "peft.safetensors", params)
    b = FL.load_flux_lora(tmp_path / "kohya.safetensors", params)
    assert sorted(a.factors) == sorted(b.factors) and len(a.factors) == 3
    for target, f in a.factors.items():
        kernel = (f.torch_shape[1], f.torch_shape[0])
        np.testing.assert_array_equal(f.delta(kernel), b.factors[target].delta(kernel))


def test_refusals_and_warnings(base, tmp_path):
    _, params = base
    rng = np.random.default_rng(4)
    down, up = pair(rng, 320, 320, 4)
    sd = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": down}
    sd["lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight"] = up
    save_file(sd, str(tmp_path / "sd15.safetensors"))
    with pytest.raises(LoraError, match=r"sd15.safetensors: no layer .* looks like a SD 1.x/2.x or SDXL LoRA"):
        FL.load_flux_lora(tmp_path / "sd15.safetensors", params)
    d, u = pair(rng, 1536, 1536, 4)  # SD 3's width on Flux's names
    sd3 = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": d}
    sd3["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"] = u
    save_file(sd3, str(tmp_path / "sd3.safetensors"))
    with pytest.raises(LoraError, match=r"sd3.safetensors: 1 LoRA layer\(s\) do not fit .* \(1536, 1536\) vs"):
        FL.load_flux_lora(tmp_path / "sd3.safetensors", params)
    d, u = pair(rng, INNER, INNER, 4)
    dt, ut = pair(rng, 32, 32, 4)
    mixed = {
        "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": d,
        "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": u,
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": dt,
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": ut,
        "lora_unet_double_blocks_7_img_attn_proj.lora_down.weight": d,  # a deeper model's block
        "lora_unet_double_blocks_7_img_attn_proj.lora_up.weight": u,
    }
    save_file(mixed, str(tmp_path / "mixed.safetensors"))
    with pytest.warns(UnmatchedLoraKeysWarning) as record:
        lora = FL.load_flux_lora(tmp_path / "mixed.safetensors", params)
    text = " ".join(str(r.message) for r in record)
    assert "2 text-encoder LoRA key(s) are not applied" in text and "double_blocks_7" in text
    assert list(lora.factors) == [("transformer", ("transformer_blocks_0", "attn", "to_out_0", "kernel"))]
    save_file({**mixed, "lora_unet_double_blocks_0_img_attn_proj.hada_w1_a": d}, str(tmp_path / "loha.safetensors"))
    with pytest.raises(LoraError, match="LoHa"):
        FL.load_flux_lora(tmp_path / "loha.safetensors", params)
    fp8 = {**params, "transformer_blocks_0": jax.tree_util.tree_map(lambda x: x, params["transformer_blocks_0"])}
    attn = dict(fp8["transformer_blocks_0"]["attn"])
    attn["to_out_0"] = {**attn["to_out_0"], "kernel": attn["to_out_0"]["kernel"].astype(ml_dtypes.float8_e4m3fn)}
    fp8["transformer_blocks_0"] = {**fp8["transformer_blocks_0"], "attn": attn}
    with pytest.raises(LoraError, match="keep_fp8"):
        FL.apply_loras(fp8, [lora], [1.0])
    with pytest.raises(ValueError, match="1 LoRAs but 2 scales"):
        FL.apply_loras(params, [lora], [1.0, 0.5])
