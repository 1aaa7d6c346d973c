"""Flux.1 weights as people have them (`sdjax.families.flux.weights`) against diffusers 0.42.1 / transformers 5.

- BFL layout: diffusers' own `convert_flux_transformer_checkpoint_to_diffusers` gives every tensor of a one-block
  BFL state dict whose single block has diffusers' hard-coded width (3072 rows per q/k/v in `linear1`; the other
  tensors small); a tiny diffusers model written in BFL naming (this file's `to_bfl`, the inverse of diffusers'
  table) loads back to its own params; the full-size FLUX.1 dev key set (meta tensors) maps and configures.
- float8: plain, scaled (ComfyUI `scale_weight`), kept float8 (`keep_fp8`): the tiny model runs with float8 params.
- GGUF: files written with the `gguf` package's writer and quantizer; diffusers' `from_single_file` with
  `GGUFQuantizationConfig` is the reference. diffusers cannot load a tiny BFL-layout Flux file (its converter
  hard-codes Flux.1's width 3072), so the reference reads a diffusers-named GGUF whose rows are quantized exactly
  as the BFL-named one's (GGML blocks run along rows; splitting a fused qkv or swapping the adaLN halves moves
  whole rows).
- The text encoders' own files (T5, CLIP-L), and files of the wrong kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from sdjax.config import ConfigError, read_json
from sdjax.families.flux import weights as W
from sdjax.models import clip as clip_model
from sdjax.models import flux as F
from sdjax.models import t5 as t5_model
from sdjax.models.convert import WeightLoadError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")
gguf = pytest.importorskip("gguf")  # the `gguf` extra

ROPE = {"axes_dims_rope": (4, 6, 6)}  # what the tensors cannot tell: the tiny heads' rotary axes
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
)
FLUX_DEV = dict(  # black-forest-labs/FLUX.1-dev transformer/config.json
    attention_head_dim=128,
    guidance_embeds=True,
    in_channels=64,
    joint_attention_dim=4096,
    num_attention_heads=24,
    num_layers=19,
    num_single_layers=38,
    patch_size=1,
    pooled_projection_dim=768,
    axes_dims_rope=(16, 56, 56),
)


# ---------------------------------------------------------------------------------------------- references
def tiny_model(guidance: bool = True, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(**{**TINY, **overrides}, guidance_embeds=guidance).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
    return model


def numpy_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def to_bfl(sd: dict, cat=np.concatenate) -> dict:
    """A diffusers-named Flux state dict in Black Forest Labs' naming (`flux/model.py` of the BFL repository):
    q/k/v fused, a single block's q/k/v/MLP fused into `linear1`, the final modulation's halves (shift, scale)."""
    out = {}
    n = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    s = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_blocks."))
    leaf = ("weight", "bias")
    for i in range(n):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for x in leaf:
            out[f"{b}img_attn.qkv.{x}"] = cat([sd[f"{d}attn.to_{c}.{x}"] for c in "qkv"])
            out[f"{b}txt_attn.qkv.{x}"] = cat([sd[f"{d}attn.add_{c}_proj.{x}"] for c in "qkv"])
            for src, dst in (
                ("attn.to_out.0", "img_attn.proj"),
                ("attn.to_add_out", "txt_attn.proj"),
                ("ff.net.0.proj", "img_mlp.0"),
                ("ff.net.2", "img_mlp.2"),
                ("ff_context.net.0.proj", "txt_mlp.0"),
                ("ff_context.net.2", "txt_mlp.2"),
                ("norm1.linear", "img_mod.lin"),
                ("norm1_context.linear", "txt_mod.lin"),
            ):
                out[f"{b}{dst}.{x}"] = sd[f"{d}{src}.{x}"]
        for src, dst in (("q", "img_attn.norm.query"), ("k", "img_attn.norm.key")):
            out[f"{b}{dst}_norm.scale"] = sd[f"{d}attn.norm_{src}.weight"]
        for src, dst in (("q", "txt_attn.norm.query"), ("k", "txt_attn.norm.key")):
            out[f"{b}{dst}_norm.scale"] = sd[f"{d}attn.norm_added_{src}.weight"]
    for i in range(s):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for x in leaf:
            out[f"{b}linear1.{x}"] = cat([sd[f"{d}attn.to_{c}.{x}"] for c in "qkv"] + [sd[f"{d}proj_mlp.{x}"]])
            out[f"{b}linear2.{x}"] = sd[f"{d}proj_out.{x}"]
            out[f"{b}modulation.lin.{x}"] = sd[f"{d}norm.linear.{x}"]
        out[f"{b}norm.query_norm.scale"] = sd[f"{d}attn.norm_q.weight"]
        out[f"{b}norm.key_norm.scale"] = sd[f"{d}attn.norm_k.weight"]
    top = {
        "x_embedder": "img_in",
        "context_embedder": "txt_in",
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "proj_out": "final_layer.linear",
    }
    for src, dst in top.items():
        for x in leaf:
            if f"{src}.{x}" in sd:
                out[f"{dst}.{x}"] = sd[f"{src}.{x}"]
    for x in leaf:
        w = sd[f"norm_out.linear.{x}"]
        half = w.shape[0] // 2
        out[f"final_layer.adaLN_modulation.1.{x}"] = cat([w[half:], w[:half]])  # (scale, shift) -> (shift, scale)
    assert len(out) == len(sd) - 8 * n - 6 * s, "every diffusers tensor placed once (fused ones counted once)"
    return out


def flat(params) -> dict[str, np.ndarray]:
    return {"/".join(k): np.asarray(v) for k, v in flatten_dict(params).items()}


def assert_same_params(got, want, *, atol=0.0):
    got, want = flat(got), flat(want)
    assert sorted(got) == sorted(want)
    worst = max(float(np.max(np.abs(got[k].astype(np.float32) - want[k].astype(np.float32)))) for k in got)
    assert worst <= atol, worst
    return worst


def save(path, tensors: dict, metadata=None):
    safetensors_torch.save_file(
        {k: v.clone() if isinstance(v, torch.Tensor) else torch.tensor(np.asarray(v)) for k, v in tensors.items()},
        str(path),
        metadata=metadata,
    )
    return path


@pytest.fixture(scope="module")
def dev():
    """A tiny Flux dev model: `(torch model, diffusers state dict, config, params)`."""
    model = tiny_model(True)
    sd = numpy_state(model)
    config = F.FluxTransformerConfig(**TINY, guidance_embeds=True)
    return model, sd, config, F.convert_flux_transformer(sd, config)


# ---------------------------------------------------------------------------------------------- the BFL layout
def test_bfl_conversion_equals_diffusers_converter():
    """Every key and value of diffusers' converter on a BFL state dict of one double and one single block: the
    single block's `linear1` has diffusers' hard-coded split (3 x 3072 + 12288 rows), `img_in` the width 3072 sdjax
    infers it from; the other tensors are small (the converter does not look at their sizes)."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    rng = np.random.default_rng(0)
    model = tiny_model(True, num_layers=1, num_single_layers=1)
    bfl = {k: v.copy() for k, v in to_bfl(numpy_state(model)).items()}
    bfl["img_in.weight"] = rng.standard_normal((3072, 4)).astype(np.float32)
    bfl["img_in.bias"] = rng.standard_normal(3072).astype(np.float32)
    bfl["single_blocks.0.linear1.weight"] = rng.standard_normal((3 * 3072 + 12288, 3)).astype(np.float32)
    bfl["single_blocks.0.linear1.bias"] = rng.standard_normal(3 * 3072 + 12288).astype(np.float32)
    want = convert_flux_transformer_checkpoint_to_diffusers({k: torch.from_numpy(v) for k, v in bfl.items()})
    got = W.flux_transformer_state_dict({f"model.diffusion_model.{k}": v for k, v in bfl.items()})
    assert sorted(got) == sorted(want)
    for k in want:
        assert got.shape(k) == tuple(want[k].shape), k
        np.testing.assert_array_equal(got[k], want[k].numpy(), err_msg=k)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_bfl_file_loads_to_the_diffusers_params(tmp_path, prefix, guidance):
    model = tiny_model(guidance, seed=1)
    sd = numpy_state(model)
    config = F.FluxTransformerConfig(**TINY, guidance_embeds=guidance)
    tensors = {prefix + k: v for k, v in to_bfl(sd).items()}
    if prefix:  # a ComfyUI checkpoint bundles the VAE and the text encoders; they are not the transformer's
        tensors["vae.encoder.conv_in.weight"] = np.zeros((4, 3, 3, 3), np.float32)
        tensors["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"] = np.ones(8, np.float32)
    path = save(tmp_path / "flux1-tiny.safetensors", tensors)
    assert W.detect_flux(tensors) == ("dev" if guidance else "schnell")
    module, params = W.load_flux_transformer_file(path, dtype=jnp.float32, config=ROPE)
    assert module.config == config and module.dtype == jnp.float32
    assert_same_params(params, F.convert_flux_transformer(sd, config))
    # the diffusers layout loads through the same entry point
    module2, params2 = W.load_flux_transformer_file(save(tmp_path / "d.safetensors", sd), dtype="bf16", config=ROPE)
    assert module2.config == config and module2.dtype == jnp.bfloat16
    assert {v.dtype for v in jax.tree_util.tree_leaves(params2)} == {jnp.dtype(jnp.bfloat16)}


def test_full_size_bfl_key_set_maps_and_configures():
    """FLUX.1 dev's whole BFL key set (meta tensors: shapes without memory) -> exactly diffusers' keys and shapes,
    and the released config from the shapes alone."""
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(**FLUX_DEV)
    sd = dict(model.state_dict())
    bfl = to_bfl(sd, cat=torch.cat)
    assert len(bfl) == 780 and W.detect_flux(bfl) == "dev"
    view = W.flux_transformer_state_dict(bfl)
    assert {k: view.shape(k) for k in view} == {k: tuple(v.shape) for k, v in sd.items()}
    assert (
        W.flux_config_from_shapes({k: view.shape(k) for k in view}) == W.FLUX_DEV == F.FluxTransformerConfig(**FLUX_DEV)
    )
    schnell = {k: view.shape(k) for k in view if "guidance" not in k}
    assert W.flux_config_from_shapes(schnell) == W.FLUX_SCHNELL


def test_config_must_agree_with_the_tensors(tmp_path, dev):
    _, sd, config, _ = dev
    path = save(tmp_path / "f.safetensors", to_bfl(sd))
    module, _ = W.load_flux_transformer_file(path, dtype=jnp.float32, config=config)
    assert module.config == config
    with pytest.raises(ConfigError, match=r"num_layers=19 \(the tensors say 2\)"):
        W.load_flux_transformer_file(path, dtype=jnp.float32, config={**FLUX_DEV, "num_attention_heads": 2})
    with pytest.raises(ConfigError, match=r"heads of 16: pass config=\{'axes_dims_rope'"):
        W.load_flux_transformer_file(path, dtype=jnp.float32)


def test_detect_flux_and_wrong_files(tmp_path):
    assert W.detect_flux(["transformer_blocks.0.attn.to_q.weight", "x_embedder.weight"]) == "schnell"
    assert W.detect_flux(["model.diffusion_model.input_blocks.0.0.weight"]) is None
    chroma = ["double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight", "img_in.weight"]
    assert W.detect_flux(chroma) == "schnell"
    assert W.detect_flux([*chroma, "distilled_guidance_layer.in_proj.weight"]) is None
    z = np.zeros((4, 4), np.float32)
    sd15 = save(
        tmp_path / "v1-5.safetensors",
        {"model.diffusion_model.input_blocks.0.0.weight": z, "cond_stage_model.transformer.text_model.x.weight": z},
    )
    with pytest.raises(W.FluxWeightsError, match=r"v1-5.safetensors: not a Flux.1 transformer; .*Stable Diffusion 1"):
        W.load_flux_transformer_file(sd15, dtype=jnp.float32)
    t5 = save(tmp_path / "t5.safetensors", {"encoder.block.0.layer.0.SelfAttention.q.weight": z})
    with pytest.raises(W.FluxWeightsError, match="t5.safetensors: not a Flux.1 transformer; it looks like a T5"):
        W.load_flux_transformer_file(t5, dtype=jnp.float32)


# ---------------------------------------------------------------------------------------------- float8
def _fp8_file(path, sd: dict, *, scaled: bool, prefix="model.diffusion_model.") -> tuple[dict, dict]:
    """`sd` (BFL names) as a ComfyUI float8 file: matrices float8 e4m3fn (scaled: divided by a per-layer scale
    first, `scale_weight` beside them), vectors bfloat16. Returns what each diffusers-named float32 weight must
    load as, BFL-named."""
    out, expect = {}, {}
    for k, v in sd.items():
        if v.ndim == 2:
            scale = np.float32(np.abs(v).max() / 200.0) if scaled else np.float32(1)
            q = torch.from_numpy(v / scale).to(torch.float8_e4m3fn)
            out[prefix + k] = q
            expect[k] = q.float().numpy() * scale
            if scaled:
                out[prefix + k.removesuffix("weight") + "scale_weight"] = torch.tensor(scale)
                out[prefix + k.removesuffix("weight") + "scale_input"] = torch.tensor(1.0)
        else:
            out[prefix + k] = torch.from_numpy(v).to(torch.bfloat16)
            expect[k] = out[prefix + k].float().numpy()
    if scaled:
        out[prefix + "scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save(path, out)
    return expect


def _run(module, params, guidance=True):
    rng = np.random.default_rng(3)
    h, w = 8, 6
    x = F.pack_latents(rng.standard_normal((2, 4, h, w)).astype(np.float32))
    ctx = rng.standard_normal((2, 5, 32)).astype(np.float32)
    pooled = rng.standard_normal((2, 24)).astype(np.float32)
    t = np.array([0.7, 0.3], np.float32)
    g = np.array([3.5, 4.0], np.float32) if guidance else None
    fn = jax.jit(lambda p: module.apply({"params": p}, x, ctx, pooled, t, F.image_ids(h, w), F.text_ids(5), g))
    return np.asarray(fn(params), np.float32)


def test_fp8_upcast_and_kept(tmp_path, dev):
    """A float8 file loads upcast (exactly the float8 values) or kept float8 (1 byte per matrix weight); the model
    runs on float8 params with the same numbers: each Dense casts its kernel to the compute dtype."""
    _, sd, config, _ = dev
    expect = _fp8_file(tmp_path / "flux1-dev-fp8.safetensors", to_bfl(sd), scaled=False)
    want = F.convert_flux_transformer(W.flux_transformer_state_dict(expect), config)
    module, up = W.load_flux_transformer_file(tmp_path / "flux1-dev-fp8.safetensors", dtype=jnp.float32, config=ROPE)
    assert_same_params(up, want)
    module8, kept = W.load_flux_transformer_file(
        tmp_path / "flux1-dev-fp8.safetensors", dtype=jnp.float32, keep_fp8=True, config=ROPE
    )
    dtypes = {k: v.dtype for k, v in flat(kept).items()}
    assert all(d == ml_dtypes.float8_e4m3fn for k, d in dtypes.items() if k.endswith("kernel"))
    assert all(d == np.float32 for k, d in dtypes.items() if not k.endswith("kernel"))
    assert_same_params(kept, want)
    bytes_up, bytes_kept = W.param_bytes(up), W.param_bytes(kept)
    print(f"tiny Flux params: upcast float32 {bytes_up} bytes, kept float8 {bytes_kept} bytes")
    matrices = sum(v.size for k, v in flat(want).items() if k.endswith("kernel"))
    assert bytes_up - bytes_kept == 3 * matrices
    a, b = _run(module, up), _run(module8, kept)
    print(f"float8 params vs upcast params: max |diff| {np.max(np.abs(a - b)):.2e} (max |out| {np.abs(a).max():.2f})")
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    # bfloat16 compute, the usual choice for Flux: float8 kept vs upcast to bfloat16
    path = tmp_path / "flux1-dev-fp8.safetensors"
    m16, up16 = W.load_flux_transformer_file(path, dtype=jnp.bfloat16, config=ROPE)
    m8, kept16 = W.load_flux_transformer_file(path, dtype=jnp.bfloat16, config=ROPE, keep_fp8=True)
    c, d = _run(m16, up16), _run(m8, kept16)
    print(
        f"bfloat16 compute: params {W.param_bytes(up16)} bytes upcast, {W.param_bytes(kept16)} kept float8; "
        f"outputs max |diff| {np.max(np.abs(c - d)):.2e}"
    )
    np.testing.assert_allclose(d, c, rtol=0, atol=1e-6)


def test_scaled_fp8(tmp_path, dev):
    _, sd, config, _ = dev
    path = tmp_path / "flux1-dev-fp8-scaled.safetensors"
    expect = _fp8_file(path, to_bfl(sd), scaled=True)
    _, params = W.load_flux_transformer_file(path, dtype=jnp.float32, config=ROPE)
    worst = assert_same_params(params, F.convert_flux_transformer(W.flux_transformer_state_dict(expect), config))
    assert worst == 0.0
    err = assert_same_params(params, F.convert_flux_transformer(sd, config), atol=0.1)
    print(f"scaled float8 vs the float32 weights: max |diff| {err:.3e}")
    with pytest.raises(ValueError, match="scaled float8 file .* keep_fp8=False"):
        W.load_flux_transformer_file(path, dtype=jnp.float32, keep_fp8=True, config=ROPE)
    newer = save(tmp_path / "mixed.safetensors", {"a.weight": np.zeros(2, np.float32), "a.comfy_quant": np.zeros(2)})
    with pytest.raises(W.FluxWeightsError, match="mixed.safetensors: a ComfyUI mixed-precision"):
        W.load_flux_transformer_file(newer, dtype=jnp.float32)


# ---------------------------------------------------------------------------------------------- GGUF
Q = gguf.GGMLQuantizationType
# Per diffusers-named weight, its quantization: every block-quantized type gguf can write, and unquantized.
LEGACY = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16, Q.F16)


def _quant_plan(sd: dict) -> dict:
    plan, i = {}, 0
    for k, v in sd.items():
        if v.ndim == 2 and v.shape[1] % 32 == 0:
            plan[k] = LEGACY[i % len(LEGACY)]
            i += 1
        else:
            plan[k] = Q.F32
    return plan


def _write_gguf(path, tensors: dict, types: dict, arch="flux"):
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in tensors.items():
        q = types[k]
        if q == Q.F32:
            w.add_tensor(k, np.ascontiguousarray(v, np.float32))
        elif q == Q.F16:
            w.add_tensor(k, np.ascontiguousarray(v, np.float16))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(v, np.float32), q)
            w.add_tensor(k, data, raw_shape=data.shape, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_matches_diffusers(tmp_path, dev):
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    model, sd, config, _ = dev
    folder = tmp_path / "transformer"
    model.save_config(folder)
    bfl = to_bfl(sd)
    bfl_plan = _quant_plan(bfl)
    plan = {}  # each diffusers tensor quantized as its BFL source: the same rows, the same blocks
    for b, q in bfl_plan.items():
        module, _, leaf = b.rpartition(".")
        for target, _ in W.bfl_module_targets(module):
            plan[f"{target}.{'weight' if leaf == 'scale' else leaf}"] = q
    assert sorted(plan) == sorted(sd)
    d_path = _write_gguf(tmp_path / "flux1-tiny-diffusers.gguf", sd, plan)
    b_path = _write_gguf(tmp_path / "flux1-tiny-Q8_0.gguf", bfl, bfl_plan)

    ref_model = diffusers.FluxTransformer2DModel.from_single_file(
        str(d_path), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), config=str(folder)
    )
    ref = {k: dequantize_gguf_tensor(p).float().numpy() for k, p in ref_model.state_dict().items()}
    ref_params = flat(F.convert_flux_transformer(ref, config))
    module, got_d = W.load_flux_gguf(d_path, dtype=jnp.float32, config=ROPE)
    _, got_b = W.load_flux_gguf(b_path, dtype=jnp.float32, config=ROPE)
    assert module.config == config
    assert_same_params(got_b, got_d)  # the BFL file loads to exactly the diffusers-named file's values
    # sdjax dequantizes as ggml does (float32); diffusers' CPU path computes in float16: the same values rounded to
    # float16. Q4_1 / Q5_1 round the product and then the sum with the block's offset: within a float16 step of the
    # block's magnitude (the bound below is relative to the row's largest weight).
    d_tensors, worst = W.GGUFTensors(d_path), 0.0
    for k, r in ref.items():
        v, kind = d_tensors[k], d_tensors.quant_type(k)
        if kind in ("F32", "F16", "BF16"):
            np.testing.assert_array_equal(v, r, err_msg=k)
        elif kind in ("Q4_1", "Q5_1"):
            err = float(np.max(np.abs(v - r) / np.abs(r).max(axis=-1, keepdims=True)))
            assert err <= 2.0**-9, (k, err)
            worst = max(worst, err)
        else:
            np.testing.assert_array_equal(v.astype(np.float16), r.astype(np.float16), err_msg=k)
    print(f"GGUF Q4_1/Q5_1 vs diffusers' float16 arithmetic: worst |diff| / row max {worst:.2e}")
    assert_same_params(got_d, ref_params, atol=2e-3)
    types = {W.GGUFTensors(b_path).quant_type(k) for k in W.GGUFTensors(b_path)}
    assert types == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
    tensors = W.GGUFTensors(b_path)
    for k in tensors:  # exactly gguf's dequantizer
        t = next(t for t in gguf.GGUFReader(str(b_path)).tensors if t.name == k)
        np.testing.assert_array_equal(
            tensors[k], gguf.quants.dequantize(t.data, t.tensor_type).reshape(tensors.shape(k))
        )


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_gguf_k_quants_against_diffusers_dequantizer(tmp_path, qtype):
    """Random blocks of the types gguf reads but cannot write, against diffusers' dequantizer computing in float32."""
    from diffusers.quantizers.gguf.utils import dequantize_functions

    q = Q[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (6, 2 * size), dtype=np.uint8)
    raw[:, 1::2] &= 0xBB  # every float16 field finite and below 2 (exponent bit 4 clear)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "flux")
    w.add_tensor("t.weight", raw, raw_shape=raw.shape, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors = W.GGUFTensors(tmp_path / "k.gguf")
    assert tensors.shape("t.weight") == (6, 2 * block) and tensors.quant_type("t.weight") == qtype
    got = tensors["t.weight"]
    blocks = torch.from_numpy(raw.reshape(-1, size))
    want = dequantize_functions[q](blocks, block, size, dtype=torch.float32).reshape(6, 2 * block).numpy()
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, want)


def test_gguf_refusals(tmp_path):
    v = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)  # TQ2_0 blocks are 256 wide
    path = _write_gguf(tmp_path / "tq.gguf", {"img_in.weight": v}, {"img_in.weight": Q.TQ2_0})
    with pytest.raises(W.FluxWeightsError, match=r"tq.gguf: GGUF quantization type\(s\) .*TQ2_0 \(img_in.weight\)"):
        W.load_flux_gguf(path, dtype=jnp.float32)
    llama = _write_gguf(tmp_path / "llama.gguf", {"blk.0.attn_q.weight": v}, {"blk.0.attn_q.weight": Q.Q8_0}, "llama")
    with pytest.raises(W.FluxWeightsError, match="llama.gguf: a GGUF file of architecture 'llama'"):
        W.load_flux_transformer_file(llama, dtype=jnp.float32)


# ---------------------------------------------------------------------------------------------- text encoders
def test_t5_files(tmp_path):
    from t5_reference import T5_TINY, t5_encoder

    model = t5_encoder(T5_TINY, seed=2)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    config = t5_model.T5Config.from_dict(T5_TINY)
    want = t5_model.convert_t5_encoder(sd, config)
    # t5xxl_fp16-style: float16, the token table as the tied copy only
    half = {k: v.astype(np.float16) for k, v in sd.items() if k != "shared.weight"}
    half["encoder.embed_tokens.weight"] = sd["shared.weight"].astype(np.float16)
    path = save(tmp_path / "t5xxl_fp16.safetensors", half)
    module, params = W.load_t5_file(path, dtype=jnp.float32, config=T5_TINY)
    assert module.config == config
    assert_same_params(params, want, atol=2e-3)
    # a ComfyUI checkpoint's float8 T5, kept float8
    fp8 = {f"text_encoders.t5xxl.transformer.{k}": torch.from_numpy(v).to(torch.float8_e4m3fn) for k, v in sd.items()}
    path8 = save(tmp_path / "flux1-dev-fp8.safetensors", fp8)
    _, p8 = W.load_t5_file(path8, dtype=jnp.bfloat16, config=config, keep_fp8=True)
    assert {v.dtype for v in jax.tree_util.tree_leaves(p8)} == {jnp.dtype(ml_dtypes.float8_e4m3fn)}
    ids = np.array([[5, 9, 1, 0]], np.int32)
    up = W.load_t5_file(path8, dtype=jnp.float32, config=config)[1]
    a = module.apply({"params": up}, ids)
    b = module.apply({"params": p8}, ids)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    with pytest.raises(WeightLoadError, match=r"(?s)built as T5 v1.1 XXL.*mis-shaped"):
        W.load_t5_file(path, dtype=jnp.float32)


def test_clip_l_files(tmp_path):
    from reference import CLIP_SD1, text_encoder

    model = text_encoder(CLIP_SD1)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    config = clip_model.CLIPTextConfig.from_dict(CLIP_SD1)
    want = clip_model.convert_clip_text(sd, config, with_projection=False)
    prefixed = {(k if k.startswith("text_model.") else f"text_model.{k}"): v for k, v in sd.items()}
    prefixed["text_projection.weight"] = np.eye(32, dtype=np.float32)  # ComfyUI's clip_l.safetensors carries one
    bare = {k.removeprefix("text_model."): v for k, v in sd.items()}
    for name, tensors in (("clip_l.safetensors", prefixed), ("bare.safetensors", bare)):
        module, params = W.load_clip_l_file(save(tmp_path / name, tensors), dtype=jnp.float32, config=CLIP_SD1)
        assert module.config == config
        assert_same_params(params, want)
    t5 = save(tmp_path / "t5xxl_fp16.safetensors", {"encoder.block.0.layer.0.SelfAttention.q.weight": np.zeros(4)})
    with pytest.raises(W.FluxWeightsError, match="t5xxl_fp16.safetensors: not a CLIP text-encoder file; .* a T5"):
        W.load_clip_l_file(t5, dtype=jnp.float32)
    clip = tmp_path / "clip_l.safetensors"
    with pytest.raises(W.FluxWeightsError, match="clip_l.safetensors: not a T5 encoder file; .* a CLIP text encoder"):
        W.load_t5_file(clip, dtype=jnp.float32)


def test_released_text_encoder_configs():
    assert t5_model.T5Config.from_dict(W.T5_XXL).inner_dim == 4096
    config = clip_model.CLIPTextConfig.from_dict(read_json(W.CLIP_L_CONFIG))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (768, 12, 12)
