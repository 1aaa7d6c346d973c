"""LoRA files against diffusers 0.42 + peft: the same file loaded by both, outputs compared.

The LoRAs are made with peft on copies of the tiny reference models (`add_adapter` with random A and B; peft
zero-inits B otherwise) and written the ways real files come: diffusers' `save_lora_weights` (PEFT keys, or the
older `lora.down` / `lora_linear_layer` keys, with the adapter config as metadata: alpha != rank) and kohya/A1111
names with `.alpha` tensors in float16 (SDXL's UNet under the original SGM block names kohya trains with). Conv
layers get LoCon factors (3x3 down, 1x1 up). diffusers loads each file with `load_lora_weights` and weighs them with
`set_adapters`; sdjax with `load_lora` / `set_loras`.

diffusers 0.42 on transformers 5 silently drops layers of two formats it converts (kohya text-encoder self-attention,
old-style `to_q.lora.down` UNet names): for those files it reads a PEFT-format twin holding the same weights and
alphas, and a separate test feeds it the kohya UNet part itself, so that its own kohya (and SGM) name conversion is
what sdjax is compared with.

Tolerances (float32): UNet and text-encoder outputs 1e-4 relative to their largest magnitude (measured ~1e-6);
images 1e-3 absolute.
"""

from __future__ import annotations

import copy
import re
import warnings

import jax
import numpy as np
import pytest
from compile_counter import counting_compiles
from PIL import Image

from sdjax.loading import lora as lora_lib

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

REL = 1e-4
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1"]
UNET_TARGETS_B = ["to_q", "to_v", "conv2", "conv_shortcut", "time_emb_proj", "conv_in", "conv_out"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
SDXL_ATTN = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out"]


# ------------------------------------------------------------------------------------------------ making LoRAs
def peft_lora(model, targets, *, rank, alpha, seed):
    """A random LoRA for `model` (a copy gets the adapter): (peft state dict as numpy, LoraConfig)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    model.add_adapter(config)
    state = get_peft_model_state_dict(model)
    # Rounded to float16 values, so the float16 kohya files hold exactly the weights of their float32 twins.
    return {k: (v.detach().float() * (0.5 if "lora_B" in k else 1.0)).half().float() for k, v in state.items()}, config


def save_diffusers(path, cls, layers: dict, configs: dict | None, *, old_names=False):
    """diffusers' writer: `layers` / `configs` by component ("unet", "text_encoder", "text_encoder_2"); without
    `configs` no metadata is written (alpha = rank)."""
    from diffusers.utils import convert_state_dict_to_diffusers

    kwargs = {}
    for component, sd in layers.items():
        kwargs[f"{component}_lora_layers"] = convert_state_dict_to_diffusers(sd) if old_names else sd
        if configs:
            kwargs[f"{component}_lora_adapter_metadata"] = configs[component].to_dict()
    cls.save_lora_weights(str(path.parent), weight_name=path.name, **kwargs)
    return path


def kohya_name(component: str, module: str, sgm: dict | None = None) -> str:
    """kohya's name of a diffusers module (test-side table, independent of sdjax's)."""
    if component == "unet":
        if sgm is not None:
            for pattern, repl in sgm.items():
                module = re.sub(pattern, repl, module)
        return "lora_unet_" + module.replace(".", "_")
    if not module.startswith("text_model."):  # transformers 5 drops CLIPTextModel's prefix; kohya files keep it
        module = "text_model." + module
    prefix = {"text_encoder": "lora_te_", "text_encoder_1": "lora_te1_", "text_encoder_2": "lora_te2_"}[component]
    return prefix + module.replace(".", "_")


def save_kohya(path, layers: dict, configs: dict, *, sgm=None):
    """kohya/A1111 layout: `<name>.lora_down.weight`, `.lora_up.weight`, `.alpha`, float16."""
    from safetensors.numpy import save_file

    out = {}
    for component, sd in layers.items():
        for key, value in sd.items():
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0]
            name = kohya_name(component, module, sgm)
            out[f"{name}.lora_down.weight"] = value.numpy().astype(np.float16)
            out[f"{name}.lora_up.weight"] = sd[key.replace("lora_A", "lora_B")].numpy().astype(np.float16)
            out[f"{name}.alpha"] = np.asarray(configs[component].lora_alpha, np.float16)
    save_file(out, str(path))
    return path


# SGM block names of the tiny SDXL UNet (layers_per_block=2; only down block 1 and up block 0 have attentions).
SDXL_SGM = {
    r"^down_blocks\.1\.attentions\.(\d)": lambda m: f"input_blocks.{4 + int(m.group(1))}.1",
    r"^up_blocks\.0\.attentions\.(\d)": lambda m: f"output_blocks.{int(m.group(1))}.1",
    r"^mid_block\.attentions\.0": "middle_block.1",
    # resnet conv1 = in_layers.2 (LoCon)
    r"^down_blocks\.(\d)\.resnets\.(\d)\.conv1$": lambda m: (
        f"input_blocks.{1 + 3 * int(m[1]) + int(m[2])}.0.in_layers.2"
    ),
    r"^up_blocks\.(\d)\.resnets\.(\d)\.conv1$": lambda m: f"output_blocks.{3 * int(m[1]) + int(m[2])}.0.in_layers.2",
    r"^mid_block\.resnets\.(\d)\.conv1$": lambda m: f"middle_block.{2 * int(m[1])}.in_layers.2",
}


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def sd1_loras(torch_sd1, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loras-sd1")
    from diffusers import StableDiffusionPipeline

    unet_a, cfg_a = peft_lora(torch_sd1.unet, UNET_TARGETS, rank=4, alpha=8, seed=1)
    te_a, tcfg_a = peft_lora(torch_sd1.text_encoder, TE_TARGETS, rank=2, alpha=3, seed=2)
    unet_b, cfg_b = peft_lora(torch_sd1.unet, UNET_TARGETS_B, rank=3, alpha=1, seed=3)
    te_b, tcfg_b = peft_lora(torch_sd1.text_encoder, ["q_proj", "fc2"], rank=2, alpha=4, seed=4)
    a = save_diffusers(
        tmp / "a.safetensors",
        StableDiffusionPipeline,
        {"unet": unet_a, "text_encoder": te_a},
        {"unet": cfg_a, "text_encoder": tcfg_a},
    )
    b_layers, b_configs = {"unet": unet_b, "text_encoder": te_b}, {"unet": cfg_b, "text_encoder": tcfg_b}
    b = save_kohya(tmp / "b.safetensors", b_layers, b_configs)
    # The older diffusers key names (`to_q.lora.down.weight`, `q_proj.lora_linear_layer.up.weight`), no metadata.
    unet_c, _ = peft_lora(torch_sd1.unet, ["to_k", "to_out.0", "proj_out"], rank=2, alpha=2, seed=11)
    te_c, _ = peft_lora(torch_sd1.text_encoder, ["k_proj", "out_proj", "fc1"], rank=2, alpha=2, seed=12)
    c_layers = {"unet": unet_c, "text_encoder": te_c}
    c = save_diffusers(tmp / "c.safetensors", StableDiffusionPipeline, c_layers, None, old_names=True)
    # diffusers 0.42 on transformers 5 drops some layers of the formats above when it converts them (kohya text
    # encoder self_attn, old-style UNet attention names): it reads the same weights from PEFT-format twins.
    twins = {
        "b": save_diffusers(tmp / "b-peft.safetensors", StableDiffusionPipeline, b_layers, b_configs),
        "c": save_diffusers(tmp / "c-peft.safetensors", StableDiffusionPipeline, c_layers, None),
        # ... and its own kohya conversion of the UNet part (kohya's names read by diffusers, not by sdjax).
        "b-unet": save_kohya(tmp / "b-unet.safetensors", {"unet": unet_b}, b_configs),
    }
    return {"a": a, "b": b, "c": c}, twins


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    pipe.devices = jax.devices()[:1]  # one program, no batch padding to the 8 simulated devices
    return pipe


LATENTS = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
GENERATE = dict(steps=2, height=64, width=64, output_type="np", noise=LATENTS)  # one compiled program for all


def diffusers_with(torch_pipe, loras, scales: dict):
    """A copy of `torch_pipe` with the LoRAs named in `scales` (their PEFT twins where they have one)."""
    files, twins = loras
    ref = copy.deepcopy(torch_pipe)
    for name in scales:
        path = twins.get(name, files[name])
        ref.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    ref.set_adapters(list(scales), list(scales.values()))
    return ref


# ------------------------------------------------------------------------------------------------ comparisons
def unet_inputs(config, seed=0):
    rng = np.random.default_rng(seed)
    sample = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    t = np.array([37, 981])
    context = rng.standard_normal((2, 7, config.cross_attention_dim)).astype(np.float32)
    kwargs = {}
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        kwargs = {
            "text_embeds": rng.standard_normal((2, pooled)).astype(np.float32),
            "time_ids": np.array([[64, 64, 0, 0, 64, 64], [48, 32, 4, 8, 64, 64]], np.float32),
        }
    return sample, t, context, kwargs


_JITTED: dict = {}


def jitted_apply(module):
    """`module.apply`, compiled once per module (the params are arguments: every LoRA reuses it)."""
    if module not in _JITTED:
        _JITTED[module] = jax.jit(module.apply)
    return _JITTED[module]


def compare_unet(pipe, ref):
    sample, t, context, kwargs = unet_inputs(pipe.unet.config)
    ours = np.asarray(jitted_apply(pipe.unet)({"params": pipe.params["unet"]}, sample, t, context, **kwargs))
    with torch.no_grad():
        added = {"added_cond_kwargs": {k: torch.from_numpy(v) for k, v in kwargs.items()}} if kwargs else {}
        theirs = ref.unet(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context), **added).sample
    theirs = theirs.numpy()
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err < REL, f"UNet: relative error {err:.2e}"
    return theirs


def compare_text(pipe, ref, component="text_encoder"):
    ids = np.asarray(pipe.generator.models.conditioning.tokenize(["a photo of a cat", "blue"]))
    if ids.ndim == 3:  # SDXL: one row per text encoder
        ids = ids[:, 0 if component == "text_encoder" else 1]
    module = getattr(pipe, component)
    ours = jitted_apply(module)({"params": pipe.params[component]}, ids)
    with torch.no_grad():
        theirs = getattr(ref, component)(torch.from_numpy(ids.astype(np.int64)), output_hidden_states=True)
    for a, b in (
        (ours.last_hidden_state, theirs.last_hidden_state),
        (ours.hidden_states[-2], theirs.hidden_states[-2]),
    ):
        b = b.numpy()
        err = np.abs(np.asarray(a) - b).max() / np.abs(b).max()
        assert err < REL, f"{component}: relative error {err:.2e}"
    return theirs.last_hidden_state.numpy()


@pytest.mark.parametrize("scales", [{"a": 0.7, "b": 0.4}, {"a": -0.5, "c": 0.8}])
def test_sd1_loras_match_diffusers(sd1, sd1_loras, torch_sd1, scales):
    for name, path in sd1_loras[0].items():
        sd1.load_lora(path, adapter_name=name)
    sd1.set_loras(scales)
    ref = diffusers_with(torch_sd1, sd1_loras, scales)
    assert sd1.active_loras == scales
    with_lora = compare_unet(sd1, ref)
    te = compare_text(sd1, ref)
    # The LoRAs matter: the base model is far from these outputs.
    sd1.set_loras({})
    assert np.abs(compare_unet(sd1, torch_sd1) - with_lora).max() > 100 * REL * np.abs(with_lora).max()
    assert np.abs(compare_text(sd1, torch_sd1) - te).max() > 1e-2


def test_text_encoder_and_unet_weights_match_diffusers(sd1, sd1_loras, torch_sd1):
    """A1111's `<lora:a:0.3:0.9>`: one LoRA at 0.3 in the text encoder and 0.9 in the UNet, as diffusers'
    per-component adapter weights."""
    sd1.load_lora(sd1_loras[0]["a"], scale=(0.3, 0.9), adapter_name="a")
    sd1.set_loras({"a": (0.3, 0.9)})
    assert sd1.active_loras == {"a": (0.3, 0.9)}
    files, _ = sd1_loras
    ref = copy.deepcopy(torch_sd1)
    ref.load_lora_weights(str(files["a"].parent), weight_name=files["a"].name, adapter_name="a")
    ref.set_adapters(["a"], [{"unet": 0.9, "text_encoder": 0.3}])
    unet = compare_unet(sd1, ref)
    text = compare_text(sd1, ref)
    # Each half of the pair is used where it belongs: one scale everywhere gives other outputs.
    sd1.set_loras({"a": 0.9})
    assert np.abs(compare_text(sd1, diffusers_with(torch_sd1, sd1_loras, {"a": 0.9})) - text).max() > 1e-2
    sd1.set_loras({"a": 0.3})
    assert np.abs(compare_unet(sd1, diffusers_with(torch_sd1, sd1_loras, {"a": 0.3})) - unet).max() > 100 * REL
    with pytest.raises(TypeError, match="'a'.*pair"):
        sd1.set_loras({"a": (0.3, 0.9, 1.0)})
    sd1.set_loras({})


def test_sd1_images_match_diffusers(sd1, sd1_loras, torch_sd1):
    scales = {"a": 0.7, "b": 0.4}
    for name, path in sd1_loras[0].items():
        sd1.load_lora(path, adapter_name=name)
    sd1.set_loras(scales)
    ref = diffusers_with(torch_sd1, sd1_loras, scales)
    prompt = "a photo of an astronaut riding a horse"
    kw = dict(num_inference_steps=2, latents=torch.from_numpy(LATENTS), output_type="np", height=64, width=64)
    with torch.no_grad():
        theirs = ref(prompt=prompt, **kw).images
        plain = torch_sd1(prompt=prompt, **kw).images
    ours = sd1.generate(prompt, **GENERATE)
    err = np.abs(ours - theirs).max()
    assert err < 1e-3, f"images: max abs error {err:.2e}"
    assert np.abs(plain - theirs).max() > 2e-2


def test_lcm_lora_style_use_matches_diffusers(sd1, sd1_loras, torch_sd1):
    """The LCM-LoRA recipe (a kohya file over convolutions, resnets' time projections and attention, the LCM
    sampler, guidance 1 = one branch) gives diffusers' image: `load_lora_weights` + `LCMScheduler.from_config`.
    One step (LCM adds fresh noise between steps, which the two libraries draw differently)."""
    from diffusers import LCMScheduler

    sd1.load_lora(sd1_loras[0]["b"], adapter_name="lcm")
    sd1.set_loras({"lcm": 1.0})
    ref = diffusers_with(torch_sd1, sd1_loras, {"b": 1.0})
    ref.scheduler = LCMScheduler.from_config(ref.scheduler.config)
    kw = dict(num_inference_steps=1, guidance_scale=1.0, output_type="np", height=64, width=64)
    with torch.no_grad():
        theirs = ref(prompt="a red boat", latents=torch.from_numpy(LATENTS), **kw).images
    run = dict(sampler="lcm", guidance_scale=1.0, **{**GENERATE, "steps": 1})
    ours = sd1.generate("a red boat", **run)
    sd1.set_loras({})
    without = sd1.generate("a red boat", **run)
    err = np.abs(ours - theirs).max()
    assert err < 1e-3, f"images: max abs error {err:.2e}"
    assert np.abs(without - theirs).max() > 2e-2  # the LoRA changes the image


# ------------------------------------------------------------------------------------------------ SDXL
@pytest.fixture(scope="module")
def sdxl_loras(torch_sdxl, tmp_path_factory):
    from diffusers import StableDiffusionXLPipeline

    tmp = tmp_path_factory.mktemp("loras-sdxl")
    unet_a, cfg_a = peft_lora(torch_sdxl.unet, SDXL_ATTN + ["conv1"], rank=4, alpha=2, seed=5)
    te1_a, tcfg1_a = peft_lora(torch_sdxl.text_encoder, TE_TARGETS, rank=2, alpha=2, seed=6)
    te2_a, tcfg2_a = peft_lora(torch_sdxl.text_encoder_2, TE_TARGETS, rank=3, alpha=6, seed=7)
    unet_b, cfg_b = peft_lora(
        torch_sdxl.unet, SDXL_ATTN + ["ff.net.0.proj", "ff.net.2", "conv1"], rank=2, alpha=1, seed=8
    )
    te1_b, tcfg1_b = peft_lora(torch_sdxl.text_encoder, ["q_proj", "v_proj"], rank=2, alpha=2, seed=9)
    te2_b, tcfg2_b = peft_lora(torch_sdxl.text_encoder_2, ["k_proj", "fc1"], rank=2, alpha=3, seed=10)
    a = save_diffusers(
        tmp / "xl_peft.safetensors",
        StableDiffusionXLPipeline,
        {"unet": unet_a, "text_encoder": te1_a, "text_encoder_2": te2_a},
        {"unet": cfg_a, "text_encoder": tcfg1_a, "text_encoder_2": tcfg2_a},
    )
    b_layers = {"unet": unet_b, "text_encoder_1": te1_b, "text_encoder_2": te2_b}
    b_configs = {"unet": cfg_b, "text_encoder_1": tcfg1_b, "text_encoder_2": tcfg2_b}
    b = save_kohya(tmp / "xl_kohya.safetensors", b_layers, b_configs, sgm=SDXL_SGM)
    peft_names = {"unet": "unet", "text_encoder_1": "text_encoder", "text_encoder_2": "text_encoder_2"}
    twins = {
        "xb": save_diffusers(
            tmp / "xl_kohya-peft.safetensors",
            StableDiffusionXLPipeline,
            {peft_names[k]: v for k, v in b_layers.items()},
            {peft_names[k]: v for k, v in b_configs.items()},
        ),
        "xb-unet": save_kohya(tmp / "xl_kohya-unet.safetensors", {"unet": unet_b}, b_configs, sgm=SDXL_SGM),
    }
    return {"xa": a, "xb": b}, twins


@pytest.fixture(scope="module")
def sdxl(sdxl_dir):
    """One SDXL pipeline for the module (one load; the LoRA tests unload what they load)."""
    from sdjax import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(str(sdxl_dir))[0]


def test_sdxl_loras_match_diffusers(sdxl, sdxl_loras, torch_sdxl):
    from safetensors.numpy import load_file

    kohya_keys = load_file(str(sdxl_loras[0]["xb"]))  # the kohya file really uses SGM block names
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya_keys
    assert "lora_unet_output_blocks_5_0_in_layers_2.lora_down.weight" in kohya_keys
    pipe = sdxl
    scales = {"xa": 0.8, "xb": 0.6}
    for name, path in sdxl_loras[0].items():
        pipe.load_lora(path, scale=scales[name], adapter_name=name)
    try:
        ref = diffusers_with(torch_sdxl, sdxl_loras, scales)
        compare_unet(pipe, ref)
        compare_text(pipe, ref, "text_encoder")
        compare_text(pipe, ref, "text_encoder_2")
    finally:
        pipe.unload_loras()


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_kohya_unet_names_as_diffusers_converts_them(family, request, sd1):
    """diffusers' own kohya -> diffusers conversion (SGM block names for SDXL) puts the UNet layers where sdjax
    does."""
    files, twins = request.getfixturevalue(f"{family}_loras")
    torch_pipe = request.getfixturevalue(f"torch_{family}")
    if family == "sd1":
        pipe, key = sd1, "b"
    else:
        pipe, key = request.getfixturevalue("sdxl"), "xb"
    pipe.load_lora(twins[f"{key}-unet"], scale=0.9, adapter_name="kohya-unet")
    pipe.set_loras({"kohya-unet": 0.9})
    ref = copy.deepcopy(torch_pipe)
    ref.load_lora_weights(str(twins[f"{key}-unet"]), adapter_name="k")
    ref.set_adapters(["k"], [0.9])
    compare_unet(pipe, ref)
    pipe.unload_loras("kohya-unet")


# ------------------------------------------------------------------------------------------------ no recompiles
def test_switching_loras_and_scales_never_recompiles(sd1, sd1_loras):

    for name, path in sd1_loras[0].items():
        sd1.load_lora(path, adapter_name=name)
    sd1.set_loras({"a": 0.3})
    base_images = None
    kw = GENERATE
    sd1.generate("a cat", **kw)  # compiles the program (and the small add of each kernel shape)
    sd1.set_loras({"b": 0.3})
    sd1.generate("a cat", **kw)
    with counting_compiles() as compiles:
        seen = []
        for name in ("a", "b"):
            for scale in (0.5, 1.0, -0.7):
                sd1.set_loras({name: scale})
                seen.append(sd1.generate("a cat", **kw))
        sd1.unfuse_loras()
        base_images = sd1.generate("a cat", **kw)
    assert compiles == [], f"{len(compiles)} compilations while switching LoRAs"
    for i, img in enumerate(seen):  # every setting gives other images
        assert np.abs(img - base_images).max() > 1e-3
        for other in seen[:i]:
            assert np.abs(img - other).max() > 1e-3


def test_unfuse_restores_the_very_base_weights(sd1, sd1_loras):
    sd1.unload_loras() if sd1.loaded_loras else None
    sd1.unfuse_loras() if getattr(sd1, "_lora_state", None) else None
    base = sd1.params
    before = jax.tree_util.tree_map(np.array, base)
    sd1.load_lora(sd1_loras[0]["a"], scale=0.9)
    sd1.load_lora(sd1_loras[0]["b"], scale=-0.4)
    assert sd1.params is not base
    changed = sd1.params["unet"]["down_blocks_0"]["attentions_0"]["proj_in"]["kernel"]
    assert not np.array_equal(np.asarray(changed), before["unet"]["down_blocks_0"]["attentions_0"]["proj_in"]["kernel"])
    # Untouched leaves are the base arrays themselves (no copy to place again).
    assert sd1.params["vae"] is base["vae"]
    assert sd1.params["unet"]["conv_norm_out"]["scale"] is base["unet"]["conv_norm_out"]["scale"]
    sd1.unfuse_loras()
    assert sd1.params is base and sd1.active_loras == {}
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), sd1.params, before)
    sd1.fuse_loras()
    np.testing.assert_array_equal(
        np.asarray(sd1.params["unet"]["down_blocks_0"]["attentions_0"]["proj_in"]["kernel"]), np.asarray(changed)
    )
    sd1.set_loras({})
    assert sd1.params is base
    sd1.unload_loras()
    assert sd1.loaded_loras == {} and sd1.params is base


def test_bfloat16_params_keep_their_dtype(sd1_dir, sd1_loras):
    """In a bfloat16 pipeline the touched kernels stay bfloat16: base + delta computed in float32, rounded once
    (within half a bfloat16 step of the exact sum)."""
    import jax.numpy as jnp

    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir), dtype=jnp.bfloat16)
    base = pipe.params["unet"]["down_blocks_0"]["resnets_0"]["conv1"]["kernel"]
    pipe.load_lora(sd1_loras[0]["a"], scale=0.8)
    fused = pipe.params["unet"]["down_blocks_0"]["resnets_0"]["conv1"]["kernel"]
    assert fused.dtype == base.dtype == jnp.bfloat16
    factor = pipe.loaded_loras["a"].factors[("unet", ("down_blocks_0", "resnets_0", "conv1", "kernel"))]
    assert factor.torch_shape[2:] == (3, 3)  # a LoCon 3x3 factor
    want = np.asarray(base, np.float32) + factor.delta(base.shape, 0.8)
    np.testing.assert_allclose(np.asarray(fused, np.float32), want, rtol=2**-8, atol=1e-6)  # rounded once to bf16
    assert np.abs(np.asarray(fused, np.float32) - np.asarray(base, np.float32)).max() > 1e-2


def test_apply_loras_is_functional(sd1, sd1_loras):
    """`apply_loras` for the guide API: a new dict, `params` untouched, scale 0 a no-op."""
    base = sd1.params
    lora = lora_lib.load_lora(sd1_loras[0]["b"], {"unet": base["unet"], "text_encoder": base["text_encoder"]})
    out = lora_lib.apply_loras(base, [(lora, 1.0)])
    assert out is not base and out["unet"] is not base["unet"]
    assert lora_lib.apply_loras(base, [(lora, 0.0)])["unet"] is base["unet"]
    path = ("unet", ("conv_in", "kernel"))
    assert path in lora.factors
    want = np.asarray(base["unet"]["conv_in"]["kernel"]) + lora.factors[path].delta(
        base["unet"]["conv_in"]["kernel"].shape
    )
    np.testing.assert_allclose(np.asarray(out["unet"]["conv_in"]["kernel"]), want, rtol=1e-6, atol=1e-7)
    # Two halves add up to the whole; numpy params (no device) take the same sums on the host.
    halves = lora_lib.apply_loras(base, [(lora, 0.5), (lora, 0.5)])
    np.testing.assert_allclose(np.asarray(halves["unet"]["conv_in"]["kernel"]), want, rtol=1e-6, atol=1e-6)
    host = {c: jax.tree_util.tree_map(np.asarray, base[c]) for c in ("unet", "text_encoder")}
    on_host = lora_lib.apply_loras(host, [(lora, 1.0)])["unet"]["conv_in"]["kernel"]
    assert isinstance(on_host, np.ndarray)
    np.testing.assert_allclose(on_host, want, rtol=1e-6, atol=1e-6)


def test_peft_metadata_alpha_pattern_and_rslora(torch_sd1, sd1, tmp_path):
    """alpha per layer from diffusers' metadata (`alpha_pattern`, `rank_pattern`, rsLoRA's alpha / sqrt(r)) equals
    the scaling peft gives each layer."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict

    model = copy.deepcopy(torch_sd1.unet)
    config = LoraConfig(
        r=4,
        lora_alpha=3,
        rank_pattern={"proj_out": 2},
        alpha_pattern={"proj_in": 16, "attn2.to_k": 5},
        use_rslora=True,
        target_modules=["proj_in", "proj_out", "to_k", "to_v"],
        init_lora_weights=False,
    )
    model.add_adapter(config)
    want = {name: m.scaling["default"] for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert len(set(want.values())) >= 3
    path = save_diffusers(
        tmp_path / "meta.safetensors",
        StableDiffusionPipeline,
        {"unet": get_peft_model_state_dict(model)},
        {"unet": config},
    )
    lora = lora_lib.load_lora(path, {"unet": sd1.params["unet"]}, unet_config=sd1.unet.config)
    got = {
        f.name.removeprefix("unet.").removesuffix(".lora_A.weight"): f.alpha_over_rank for f in lora.factors.values()
    }
    assert got.keys() == want.keys()
    for name, scaling in want.items():
        assert got[name] == pytest.approx(scaling, rel=1e-6), name


# ------------------------------------------------------------------------------------------------ bad input
def test_sdxl_lora_on_sd1_is_a_clear_error(sd1, sdxl_loras):
    with pytest.raises(lora_lib.LoraError, match=r"xl_kohya\.safetensors.*text_encoder_2.*another base model"):
        sd1.load_lora(sdxl_loras[0]["xb"])
    with pytest.raises(lora_lib.LoraError, match=r"xl_peft\.safetensors.*text_encoder_2"):
        sd1.load_lora(sdxl_loras[0]["xa"])


def write(path, tensors):
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, str(path))
    return path


def test_shape_mismatch_names_the_file_and_layer(sd1, tmp_path):
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    path = write(
        tmp_path / "wide.safetensors",
        {f"{name}.lora_down.weight": np.ones((2, 320)), f"{name}.lora_up.weight": np.ones((320, 2))},
    )
    with pytest.raises(lora_lib.LoraError, match=r"wide\.safetensors.*do not fit.*attn1/to_q/kernel.*\(32, 32\)"):
        sd1.load_lora(path)


def test_unmatched_keys_warn_with_count_and_examples(sd1, tmp_path):
    good = "lora_unet_down_blocks_0_attentions_0_proj_in"
    bad = "lora_unet_down_blocks_7_attentions_0_proj_in"
    tensors = {f"{good}.lora_down.weight": np.ones((2, 32, 1, 1)), f"{good}.lora_up.weight": np.ones((32, 2, 1, 1))}
    tensors |= {f"{bad}.lora_down.weight": np.ones((2, 32)), f"{bad}.lora_up.weight": np.ones((32, 2))}
    path = write(tmp_path / "partial.safetensors", tensors)
    with pytest.warns(lora_lib.UnmatchedLoraKeysWarning, match=r"partial\.safetensors: 2 LoRA key\(s\).*down_blocks_7"):
        sd1.load_lora(path, adapter_name="partial")
    sd1.unload_loras("partial")
    only_bad = write(tmp_path / "nothing.safetensors", {k: v for k, v in tensors.items() if bad in k})
    with pytest.raises(lora_lib.LoraError, match=r"nothing\.safetensors: none of the 1 LoRA layers matches"):
        sd1.load_lora(only_bad)
    not_lora = write(tmp_path / "weights.safetensors", {"conv_in.weight": np.ones((2, 2))})
    with pytest.raises(lora_lib.LoraError, match=r"weights\.safetensors: not a LoRA file"):
        sd1.load_lora(not_lora)


def test_unsupported_adapters_and_arguments(sd1, sd1_loras, tmp_path):
    name = "lora_unet_down_blocks_0_attentions_0_proj_in"
    loha = write(
        tmp_path / "loha.safetensors", {f"{name}.hada_w1_a": np.ones((2, 2)), f"{name}.hada_w1_b": np.ones((2, 2))}
    )
    # LoHa files load (tests/loading/test_lycoris.py); a LoHa layer without its second product does not
    with pytest.raises(lora_lib.LoraError, match=r"loha\.safetensors: LoHa layer .*proj_in.* lacks hada_w2_a"):
        sd1.load_lora(loha)
    both = {f"{name}.lora_down.weight": np.ones((2, 32, 1, 1)), f"{name}.lora_up.weight": np.ones((32, 2, 1, 1))}
    ldm = "lora_unet_input_blocks_1_1_proj_in"  # the same layer under its LDM name
    both |= {f"{ldm}.lora_down.weight": np.ones((2, 32, 1, 1)), f"{ldm}.lora_up.weight": np.ones((32, 2, 1, 1))}
    with pytest.raises(lora_lib.LoraError, match=r"twice\.safetensors: two LoRA layers adapt unet .*proj_in/kernel"):
        sd1.load_lora(write(tmp_path / "twice.safetensors", both))
    half = write(tmp_path / "half.safetensors", {f"{name}.lora_down.weight": np.ones((2, 32))})
    with pytest.raises(lora_lib.LoraError, match=r"half\.safetensors: layer .*proj_in.* lacks its down or up"):
        sd1.load_lora(half)
    with pytest.raises(lora_lib.LoraError, match=r"'no-such-lora' not found"):
        sd1.load_lora("no-such-lora")
    with pytest.raises(ValueError, match=r"scale=nan"):
        sd1.load_lora(sd1_loras[0]["a"], scale=float("nan"))
    with pytest.raises(TypeError, match=r"scale must be a number"):
        sd1.load_lora(sd1_loras[0]["a"], scale="high")
    sd1.load_lora(sd1_loras[0]["a"], adapter_name="a")
    with pytest.raises(KeyError, match=r"\['zzz'\] are not loaded; loaded: .*'a'"):
        sd1.set_loras({"zzz": 1.0})
    with pytest.raises(TypeError, match=r"set_loras takes a dict"):
        sd1.set_loras(["a"])


def test_named_lora_from_search_dirs(sd1, sd1_loras):
    sd1.lora_search_dirs = (str(sd1_loras[0]["b"].parent),)
    try:
        assert sd1.load_lora("b", scale=0.5) == "b"
        assert sd1.active_loras["b"] == 0.5
    finally:
        del sd1.lora_search_dirs
        warnings.simplefilter("default")


# ------------------------------------------------------------------------------------------------ key layouts
def test_key_layouts_group_into_layers():
    keys = [
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight",
        "lora_unet_down_blocks_0_attentions_0_proj_in.alpha",
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
        "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
        "unet.mid_block.attentions.0.transformer_blocks.0.attn1.processor.to_out_lora.down.weight",
        "text_encoder.text_model.encoder.layers.1.self_attn.to_q_lora.up.weight",
        "text_encoder_2.encoder.layers.1.self_attn.q_proj.lora_linear_layer.down.weight",
        "unet.conv_in.lora_B.weight",
        "up_blocks.1.attentions.0.transformer_blocks.0.attn2.processor.to_k_lora.up.weight",  # no prefix: UNet
        "model.diffusion_model.something.weight",  # a checkpoint key: unknown, not an unsupported ".diff"
    ]
    layers, unknown = lora_lib.group_layers(keys, source="x")
    assert unknown == ["model.diffusion_model.something.weight"]
    assert set(layers) == {
        ("unet", "kohya", "down_blocks_0_attentions_0_proj_in"),
        ("text_encoder", "kohya", "text_model_encoder_layers_0_mlp_fc1"),
        ("text_encoder_2", "kohya", "text_model_encoder_layers_0_mlp_fc1"),
        ("unet", "dotted", "mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0"),
        ("text_encoder", "dotted", "text_model.encoder.layers.1.self_attn.q_proj"),
        ("text_encoder_2", "dotted", "encoder.layers.1.self_attn.q_proj"),
        ("unet", "dotted", "conv_in"),
        ("unet", "dotted", "up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k"),
    }
    assert layers[("unet", "kohya", "down_blocks_0_attentions_0_proj_in")].keys.keys() == {"down", "alpha"}
    for key, kind in (  # LoHa / LoKr: refused without `lycoris_layers` (the Flux reader), read with it
        ("lora_unet_conv_in.hada_w1_a", "LoHa"),
        ("lora_unet_conv_in.lokr_w1", "LoKr"),
        ("lora_unet_conv_in.lora_mid.weight", "Tucker"),
        ("lora_unet_conv_in.dora_scale", "DoRA"),
        ("lora_unet_conv_in.diff", "full weight difference"),
        ("lora_unet_conv_in.diff_b", "full weight difference"),
    ):
        with pytest.raises(lora_lib.LoraError, match=rf"x: .*{kind}.* \(key '{re.escape(key)}'\)"):
            lora_lib.group_layers([key], source="x")


def test_linear_and_conv_weights_fit_each_others_kernels():
    w = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)  # (out, in)
    dense = lora_lib.to_flax_kernel(w, (4, 6))
    np.testing.assert_array_equal(dense, w.T)
    conv1x1 = lora_lib.to_flax_kernel(w, (1, 1, 4, 6))  # a Linear LoRA on a 1x1 conv
    np.testing.assert_array_equal(conv1x1[0, 0], w.T)
    np.testing.assert_array_equal(lora_lib.to_flax_kernel(w.reshape(6, 4, 1, 1), (4, 6)), w.T)
    w3 = np.random.default_rng(0).standard_normal((6, 4, 3, 3)).astype(np.float32)
    np.testing.assert_array_equal(lora_lib.to_flax_kernel(w3, (3, 3, 4, 6))[1, 2], w3[:, :, 1, 2].T)
    for shape in ((6, 4), (3, 3, 4, 6), (1, 1, 6, 4)):
        with pytest.raises(ValueError, match=r"does not fit a Flax kernel"):
            lora_lib.to_flax_kernel(w, shape)
    with pytest.raises(ValueError, match=r"does not fit"):
        lora_lib.to_flax_kernel(w3, (1, 1, 4, 6))


def test_cli_lora_options_and_prompt_tags(sd1_dir, sd1_loras, tmp_path, monkeypatch):
    """`--lora NAME:SCALE` and A1111's `<lora:name:scale>` (with --prompt-syntax a1111) give the Python API's image
    with that LoRA loaded at that scale."""
    from typer.testing import CliRunner

    from sdjax import StableDiffusionPipeline, cli

    files, _ = sd1_loras
    monkeypatch.setattr(
        cli.generate, "load_pipeline", lambda model, dtype: StableDiffusionPipeline.from_pretrained(model)[0]
    )
    ref_pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    ref_pipe.load_lora(files["b"], scale=0.6)
    ref = np.asarray(ref_pipe.generate("a cat", seed=3, steps=2, height=64, width=64)[0], np.int16)
    common = ["generate", "-m", str(sd1_dir), "--seed", "3", "--steps", "2", "-W", "64", "-H", "64"]
    for i, extra in enumerate(
        [
            ["a cat", "--lora", f"{files['b']}:0.6"],
            ["a cat <lora:b:0.6>", "--prompt-syntax", "a1111", "--lora-dir", str(files["b"].parent)],
        ]
    ):
        out = tmp_path / str(i)
        r = CliRunner().invoke(cli.app, [*common, *extra, "-o", str(out)])
        assert r.exit_code == 0, r.output
        (png,) = out.glob("*.png")
        got = np.asarray(Image.open(png).convert("RGB"), np.int16)
        assert np.abs(got - ref).max() <= 1, i
    r = CliRunner().invoke(cli.app, [*common, "x <lora:nope:1>", "--prompt-syntax", "a1111", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "nope" in r.output and "PROMPT" in r.output  # before the model loads


def test_params_passed_to_generate_get_the_active_loras(sd1, sd1_loras):
    """Regression (issue 35): `pipe, params = from_pretrained(...)`, `pipe.load_lora(...)`, then
    `pipe.generate(prompt, params=params)` ran the base model. The active LoRAs now apply to params a user passes."""
    sd1.unload_loras() if sd1.loaded_loras else None
    sd1.unfuse_loras() if getattr(sd1, "_lora_state", None) else None
    base = sd1.params
    plain = sd1.generate("a photo of a cat", params=base, **GENERATE)
    sd1.load_lora(sd1_loras[0]["a"], scale=0.9)
    try:
        fused = sd1.generate("a photo of a cat", **GENERATE)
        passed = sd1.generate("a photo of a cat", params=base, **GENERATE)
        copy = jax.tree_util.tree_map(lambda x: x, base)  # another tree of the same weights: the deltas are added
        copied = sd1.generate("a photo of a cat", params=copy, **GENERATE)
    finally:
        sd1.unload_loras()
    assert float(np.abs(fused - plain).max()) > 1e-3
    np.testing.assert_array_equal(passed, fused)
    np.testing.assert_allclose(copied, fused, atol=1e-6)
