"""The files a LoRA run writes load in diffusers + peft and in sdjax, with the same numbers.

- SD 1.x kohya file: diffusers' `load_lora_weights` (its kohya conversion) and sdjax's `pipe.load_lora` (what
  `sdjax generate --lora` calls) give the same UNet output; both equal the training-time merge.
- The PEFT twin (`pytorch_lora_weights.safetensors`, alpha in its metadata) adapts the text encoder in diffusers
  as the kohya file does in sdjax (diffusers 0.42 on transformers 5 drops kohya text-encoder attention layers, see
  tests/loading/test_lora.py, so the text encoder is compared through the PEFT file).
- SDXL kohya file (SGM UNet names, `lora_te1_` / `lora_te2_`), with LoCon layers (`conv_rank`: the ResNet blocks'
  and samplers' layers under their SGM names, `in_layers_2`, `op`, `skip_connection`, ...): diffusers' fused weights
  equal sdjax's.
- SD 1.x LoCon files: kohya's 4-D conv shapes, per-module alphas and `ss_network_args`; sdjax's loader gives the
  training-time merge, and diffusers' `load_lora_weights` of the PEFT file (`rank_pattern` / `alpha_pattern`) and
  of the kohya file fuse to the same weights.
Tolerances (float32): outputs 1e-4 relative to their largest magnitude; fused weights 1e-5 absolute.
"""

import copy
import warnings

import jax
import numpy as np
import pytest
from safetensors import safe_open

from sdjax.finetune import lora as lora_lib
from sdjax.loading import lora as loading_lora
from sdjax.models.convert import path_to_torch_key
from sdjax.pipelines import load_pipeline

torch = pytest.importorskip("torch")
RANK, ALPHA = 4, 2.0  # alpha != rank: a wrong scale fails
CONV_RANK, CONV_ALPHA = 3, 0.75  # LoCon's 3x3 convs: another rank and scale (0.25, not 0.5)


def _random_lora(params, components, seed=0, conv_rank=None):
    targets = {c: lora_lib.UNET_TARGETS if c == "unet" else lora_lib.TEXT_TARGETS for c in components}
    lora = lora_lib.init_lora(jax.random.PRNGKey(seed), params, targets, RANK, conv_rank)
    rng = np.random.default_rng(seed)
    for layers in lora.values():
        for ab in layers.values():
            ab["up"] = (0.2 * rng.standard_normal(ab["up"].shape)).astype(np.float32)
    return lora


def _write(tmp_path, lora, unet_config, name="trained", conv_rank=None):
    """The kohya file and the PEFT file of `lora` (LoCon with `conv_rank`: its 3x3 convs at CONV_ALPHA)."""
    conv = {} if conv_rank is None else {"conv_rank": conv_rank, "conv_alpha": CONV_ALPHA}
    kohya = tmp_path / f"{name}.safetensors"
    meta = lora_lib.kohya_metadata(rank=RANK, alpha=ALPHA, base_model_version="sd_v1", comment="test", **conv)
    tensors = lora_lib.kohya_state_dict(lora, ALPHA, unet_config, conv_alpha=conv.get("conv_alpha"))
    lora_lib.save_safetensors(kohya, tensors, meta)
    peft_dir = tmp_path / f"{name}-peft"
    peft_dir.mkdir()
    tensors, peft_meta = lora_lib.peft_state_dict(lora, ALPHA, RANK, **conv)
    lora_lib.save_safetensors(peft_dir / "pytorch_lora_weights.safetensors", tensors, peft_meta)
    return kohya, peft_dir / "pytorch_lora_weights.safetensors"


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


def test_kohya_file_loads_in_diffusers_and_sdjax_alike(sd1_dir, torch_sd1, tmp_path):
    pipe, params = load_pipeline(str(sd1_dir))
    pipe.devices = jax.devices()[:1]
    lora = _random_lora(params, ["unet", "text_encoder"])
    kohya, peft_file = _write(tmp_path, lora, pipe.unet.config)
    with safe_open(str(kohya), "np") as f:
        meta = f.metadata()
        keys = set(f.keys())
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "2" and meta["ss_network_module"]
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha" in keys

    with warnings.catch_warnings():
        warnings.simplefilter("error", loading_lora.UnmatchedLoraKeysWarning)
        name = pipe.load_lora(kohya)  # what `sdjax generate --lora trained.safetensors` does
    assert pipe.active_loras == {name: 1.0}
    assert len(pipe.loaded_loras[name].factors) == len(lora["unet"]) + len(lora["text_encoder"])

    # sdjax's loaded weights equal the training-time merge (the LoRA as trained is the LoRA as used)
    for component in ("unet", "text_encoder"):
        merged = lora_lib.merge(params[component], lora[component], ALPHA / RANK)
        for path_s in list(lora[component])[:6]:
            path = tuple(path_s.split("/"))
            got, want = pipe.params[component], merged
            for p in path:
                got, want = got[p], want[p]
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)

    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    ctx = rng.standard_normal((1, 7, 32)).astype(np.float32)
    ours = np.asarray(pipe.unet.apply({"params": pipe.params["unet"]}, x, 321, ctx))

    ref = copy.deepcopy(torch_sd1)
    ref.load_lora_weights(str(kohya.parent), weight_name=kohya.name, adapter_name="kohya")
    with torch.no_grad():
        theirs = ref.unet(torch.from_numpy(x), 321, torch.from_numpy(ctx)).sample.numpy()
    base = np.asarray(pipe.unet.apply({"params": params["unet"]}, x, 321, ctx))
    assert _rel(base, theirs) > 1e-2  # the LoRA changes the output
    err = _rel(ours, theirs)
    print(f"kohya file: UNet output relative error sdjax vs diffusers {err:.2e}")
    assert err <= 1e-4

    ref = copy.deepcopy(torch_sd1)
    ref.load_lora_weights(str(peft_file.parent), weight_name=peft_file.name, adapter_name="peft")
    ids = np.asarray(pipe.tokenizer(["a photo of a star"]), np.int32)
    with torch.no_grad():
        theirs_te = ref.text_encoder(torch.from_numpy(ids).long()).last_hidden_state.numpy()
        theirs_unet = ref.unet(torch.from_numpy(x), 321, torch.from_numpy(ctx)).sample.numpy()
    ours_te = np.asarray(pipe.text_encoder.apply({"params": pipe.params["text_encoder"]}, ids).last_hidden_state)
    te_err, unet_err = _rel(ours_te, theirs_te), _rel(ours, theirs_unet)
    print(f"PEFT file: text encoder relative error {te_err:.2e}, UNet {unet_err:.2e}")
    assert te_err <= 1e-4 and unet_err <= 1e-4


def test_sdxl_kohya_file_fuses_to_diffusers_weights(sdxl_dir, torch_sdxl, tmp_path):
    pipe, params = load_pipeline(str(sdxl_dir))
    lora = _random_lora(params, ["unet", "text_encoder", "text_encoder_2"], seed=3, conv_rank=CONV_RANK)
    kohya, _ = _write(tmp_path, lora, pipe.unet.config, name="xl", conv_rank=CONV_RANK)
    with safe_open(str(kohya), "np") as f:
        keys = set(f.keys())
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys  # SGM names
    for module in ("input_blocks_1_0_in_layers_2", "input_blocks_3_0_op", "input_blocks_4_0_skip_connection",
                   "middle_block_2_emb_layers_1", "output_blocks_2_2_conv"):  # fmt: skip
        assert f"lora_unet_{module}.lora_down.weight" in keys, module
    assert any(k.startswith("lora_te1_") for k in keys) and any(k.startswith("lora_te2_") for k in keys)

    with warnings.catch_warnings():
        warnings.simplefilter("error", loading_lora.UnmatchedLoraKeysWarning)
        loaded = loading_lora.load_lora(kohya, params, unet_config=pipe.unet.config)
    fused = loading_lora.apply_loras(params, [(loaded, 1.0)])

    ref = copy.deepcopy(torch_sdxl)
    ref.load_lora_weights(str(kohya.parent), weight_name=kohya.name, adapter_name="kohya")
    ref.fuse_lora(components=["unet"], lora_scale=1.0)
    state = {k.replace(".base_layer", ""): v for k, v in ref.unet.state_dict().items()}
    checked = 0
    for path_s in lora["unet"]:
        path = tuple(path_s.split("/"))
        node = fused["unet"]
        for p in path:
            node = node[p]
        want = state[path_to_torch_key(path)].float().numpy()
        want = want.T if want.ndim == 2 else want.transpose(2, 3, 1, 0)  # Linear / Conv2d -> the Flax layout
        np.testing.assert_allclose(np.asarray(node), want, atol=1e-5, err_msg=path_s)
        checked += 1
    assert checked == len(lora["unet"]) > 0


def test_locon_files_load_in_sdjax_and_diffusers(sd1_dir, torch_sd1, tmp_path):
    """LoCon (`conv_rank`): the kohya file holds kohya's conv shapes, per-module alphas and `ss_network_args`; sdjax's
    loader (what `pipe.load_lora` applies) gives the training-time merge of every layer, and diffusers'
    `load_lora_weights` of the PEFT file and of the kohya file fuse to the same UNet weights."""
    import json

    from safetensors.numpy import load_file

    pipe, params = load_pipeline(str(sd1_dir))
    lora = _random_lora(params, ["unet"], seed=5, conv_rank=CONV_RANK)
    kohya, peft_file = _write(tmp_path, lora, pipe.unet.config, name="locon", conv_rank=CONV_RANK)
    tensors = load_file(str(kohya))
    with safe_open(str(kohya), "np") as f:
        meta = f.metadata()
    assert json.loads(meta["ss_network_args"]) == {"conv_dim": "3", "conv_alpha": "0.75"}
    conv1 = "lora_unet_down_blocks_1_resnets_0_conv1"  # 3x3, 32 -> 64 channels: the conv rank and alpha
    assert tensors[f"{conv1}.lora_down.weight"].shape == (CONV_RANK, 32, 3, 3)
    assert tensors[f"{conv1}.lora_up.weight"].shape == (64, CONV_RANK, 1, 1) and tensors[f"{conv1}.alpha"] == 0.75
    shortcut = "lora_unet_down_blocks_1_resnets_0_conv_shortcut"  # 1x1: the linear rank and alpha, 4-D
    assert tensors[f"{shortcut}.lora_down.weight"].shape == (RANK, 32, 1, 1) and tensors[f"{shortcut}.alpha"] == 2.0
    assert tensors["lora_unet_mid_block_resnets_0_time_emb_proj.lora_down.weight"].shape == (RANK, 128)
    assert tensors["lora_unet_up_blocks_0_upsamplers_0_conv.alpha"] == 0.75
    assert "lora_unet_conv_in.lora_down.weight" not in tensors
    for layer in ("down_blocks_1/resnets_0/conv1", "down_blocks_1/resnets_0/conv_shortcut"):  # init: PEFT's, kohya's
        down = lora["unet"][f"{layer}/kernel"]["down"]
        w = torch.empty(down.shape)  # torch's kaiming_uniform_(a=sqrt(5)) bound for a conv weight of this shape
        fan_in, _ = torch.nn.init._calculate_fan_in_and_fan_out(w)
        bound = torch.nn.init.calculate_gain("leaky_relu", 5**0.5) * (3.0 / fan_in) ** 0.5
        assert 0.95 * bound < np.abs(down).max() <= bound and abs(float(down.mean())) < 0.1 * bound, layer

    merged = lora_lib.merge(params["unet"], lora["unet"], ALPHA / RANK, conv_scale=CONV_ALPHA / CONV_RANK)
    with warnings.catch_warnings():
        warnings.simplefilter("error", loading_lora.UnmatchedLoraKeysWarning)
        fused = {
            which: loading_lora.apply_loras(
                params, [(loading_lora.load_lora(f, params, unet_config=pipe.unet.config), 1.0)]
            )
            for which, f in (("kohya", kohya), ("peft", peft_file))
        }
    state = {}
    for which, f in (("kohya", kohya), ("peft", peft_file)):
        ref = copy.deepcopy(torch_sd1)
        ref.load_lora_weights(str(f.parent), weight_name=f.name, adapter_name=which)
        ref.fuse_lora(components=["unet"], lora_scale=1.0)
        state[which] = {k.replace(".base_layer", ""): v for k, v in ref.unet.state_dict().items()}
    worst = 0.0
    for path_s in lora["unet"]:
        path = tuple(path_s.split("/"))
        want, base = merged, params["unet"]
        for p in path:
            want, base = want[p], base[p]
        want = np.asarray(want)
        assert np.abs(want - np.asarray(base)).max() > 1e-3, path_s  # the LoRA moves every layer
        for which in ("kohya", "peft"):
            got = fused[which]["unet"]
            for p in path:
                got = got[p]
            np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, err_msg=f"sdjax {which}: {path_s}")
            torch_w = state[which][path_to_torch_key(path)].float().numpy()
            torch_w = torch_w.T if torch_w.ndim == 2 else torch_w.transpose(2, 3, 1, 0)
            worst = max(worst, float(np.abs(torch_w - want).max()))
    print(f"LoCon files: diffusers' fused UNet weights vs sdjax's merge, worst {worst:.2e} over {len(lora['unet'])}")
    assert worst <= 1e-5
