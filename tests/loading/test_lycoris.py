"""LyCORIS LoHa and LoKr files (`hada_*`, `lokr_*` under kohya's layer names) loaded as parameter deltas.

The files are written here with random factors for UNet and text-encoder layers of the tiny SD 1.x model (Linear,
1x1 and 3x3 convs; LoHa with and without a Tucker core; LoKr with full or factored w1 / w2, a full 4D w2 and a
Tucker w2), in the shapes LyCORIS saves. Each layer's expected delta is computed here from the formulas as
AUTOMATIC1111 (`extensions-builtin/Lora/network_hada.py`, `network_lokr.py`, `network.py` `calc_scale`) and ComfyUI
(`comfy/weight_adapter/loha.py`, `lokr.py`) apply them, in float64 numpy:

- LoHa: `(w1_a @ w1_b) * (w2_a @ w2_b) * alpha / w1_b.shape[0]` reshaped to the weight (Tucker: each product is
  `einsum("ijkl,jr,ip->prkl", t, w_b, w_a)`);
- LoKr: `kron(w1, w2) * alpha / r` reshaped to the weight, `r` the rank of w2 when it is factored, else of w1,
  and a factor of 1 when both are full matrices (`w1` gets two unit axes when `w2` is 4D).

Checked: the fused kernels equal base + those deltas (per layer); the image equals diffusers' (torch) pipeline with
the same deltas added to its modules' weights, run on sdjax's noise (test_lora's helpers); a LoHa file in a
models directory's `Lora/` is found by `<lora:name:w>` in the CLI; DoRA and what sdjax does not apply are refused
naming the key.
"""

from __future__ import annotations

import copy
import re

import jax
import numpy as np
import pytest
from PIL import Image
from test_lora import GENERATE, LATENTS, compare_text, compare_unet

from sdjax.loading import lora as lora_lib
from sdjax.models_dir import ModelsDir

torch = pytest.importorskip("torch")

# (component, diffusers module, PyTorch weight shape, {role: shape}, alpha or None)
LOHA = [
    ("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", (32, 32),
     {"hada_w1_a": (32, 2), "hada_w1_b": (2, 32), "hada_w2_a": (32, 2), "hada_w2_b": (2, 32)}, 1.0),
    ("unet", "down_blocks.0.resnets.0.conv1", (32, 32, 3, 3),
     {"hada_w1_a": (32, 4), "hada_w1_b": (4, 288), "hada_w2_a": (32, 4), "hada_w2_b": (4, 288)}, 2.0),
    ("unet", "down_blocks.0.attentions.0.proj_in", (32, 32, 1, 1),  # rank 8 x 8 >= 32: stored dense
     {"hada_w1_a": (32, 8), "hada_w1_b": (8, 32), "hada_w2_a": (32, 8), "hada_w2_b": (8, 32)}, 4.0),
    ("unet", "mid_block.resnets.0.conv2", (64, 64, 3, 3),  # Tucker
     {"hada_t1": (3, 3, 3, 3), "hada_w1_a": (3, 64), "hada_w1_b": (3, 64),
      "hada_t2": (3, 3, 3, 3), "hada_w2_a": (3, 64), "hada_w2_b": (3, 64)}, 1.5),
    ("unet", "up_blocks.1.attentions.1.transformer_blocks.0.ff.net.0.proj", (256, 32),
     {"hada_w1_a": (256, 3), "hada_w1_b": (3, 32), "hada_w2_a": (256, 2), "hada_w2_b": (2, 32)}, None),
    ("text_encoder", "text_model.encoder.layers.1.self_attn.q_proj", (32, 32),
     {"hada_w1_a": (32, 2), "hada_w1_b": (2, 32), "hada_w2_a": (32, 2), "hada_w2_b": (2, 32)}, 1.0),
    ("text_encoder", "text_model.encoder.layers.1.mlp.fc1", (37, 32),
     {"hada_w1_a": (37, 2), "hada_w1_b": (2, 32), "hada_w2_a": (37, 2), "hada_w2_b": (2, 32)}, 3.0),
]  # fmt: skip
LOKR = [
    ("unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k", (32, 32),
     {"lokr_w1": (4, 4), "lokr_w2_a": (8, 2), "lokr_w2_b": (2, 8)}, 4.0),
    ("unet", "up_blocks.1.resnets.0.conv2", (32, 32, 3, 3),  # both full (4D w2): factor 1, alpha ignored
     {"lokr_w1": (2, 4), "lokr_w2": (16, 8, 3, 3)}, 5.0),
    ("unet", "up_blocks.1.resnets.1.conv2", (32, 32, 3, 3),  # both factored: r of w2
     {"lokr_w1_a": (4, 1), "lokr_w1_b": (1, 2), "lokr_w2_a": (8, 2), "lokr_w2_b": (2, 144)}, 3.0),
    ("unet", "mid_block.resnets.0.conv1", (64, 64, 3, 3),  # Tucker w2
     {"lokr_w1": (4, 4), "lokr_t2": (2, 2, 3, 3), "lokr_w2_a": (2, 16), "lokr_w2_b": (2, 16)}, 1.0),
    ("unet", "up_blocks.1.attentions.1.transformer_blocks.0.ff.net.2", (32, 128),
     {"lokr_w1": (2, 8), "lokr_w2_a": (16, 2), "lokr_w2_b": (2, 16)}, 2.0),
    ("text_encoder", "text_model.encoder.layers.1.mlp.fc2", (32, 37), {"lokr_w1": (2, 1), "lokr_w2": (16, 37)}, None),
    ("text_encoder", "text_model.encoder.layers.1.self_attn.v_proj", (32, 32),  # w1 factored, w2 full: r of w1
     {"lokr_w1_a": (4, 1), "lokr_w1_b": (1, 4), "lokr_w2": (8, 8)}, 0.5),
]  # fmt: skip


def kohya_name(component: str, module: str) -> str:
    return {"unet": "lora_unet_", "text_encoder": "lora_te_"}[component] + module.replace(".", "_")


def flax_path(module: str) -> tuple[str, ...]:
    """`a.b.0.c` -> ("a", "b_0", "c", "kernel") (sdjax names its modules after the PyTorch attributes)."""
    return tuple(re.sub(r"\.(\d+)", r"_\1", module).split(".")) + ("kernel",)


def to_flax(w: np.ndarray) -> np.ndarray:
    return w.T if w.ndim == 2 else w.transpose(2, 3, 1, 0)


def make_layers(table, seed: int, dtype) -> list[tuple[str, str, tuple, dict, float | None]]:
    """Random factors (rounded to `dtype`, held as float64) for each layer of `table`."""
    rng = np.random.default_rng(seed)
    out = []
    for component, module, shape, roles, alpha in table:
        t = {r: (rng.standard_normal(s) * 0.3).astype(dtype).astype(np.float64) for r, s in roles.items()}
        out.append((component, module, shape, t, alpha))
    return out


def save(path, layers, dtype):
    from safetensors.numpy import save_file

    tensors = {}
    for component, module, _, t, alpha in layers:
        name = kohya_name(component, module)
        tensors |= {f"{name}.{role}": v.astype(dtype) for role, v in t.items()}
        if alpha is not None:
            tensors[f"{name}.alpha"] = np.asarray(alpha, dtype)
    save_file(tensors, str(path))
    return path


def tucker(core, w_a, w_b):
    return np.einsum("ijkl,jr,ip->prkl", core, w_b, w_a)


def expected_delta(t: dict, shape: tuple, alpha: float | None) -> np.ndarray:
    """The hand reference: a layer's delta (scale 1) in PyTorch layout, float64."""
    if "hada_w1_a" in t:
        if "hada_t1" in t:
            w1 = tucker(t["hada_t1"], t["hada_w1_a"], t["hada_w1_b"])
            w2 = tucker(t["hada_t2"], t["hada_w2_a"], t["hada_w2_b"])
        else:
            w1, w2 = t["hada_w1_a"] @ t["hada_w1_b"], t["hada_w2_a"] @ t["hada_w2_b"]
        delta, rank = w1 * w2, t["hada_w1_b"].shape[0]
    else:
        rank = None
        if "lokr_w1" in t:
            w1 = t["lokr_w1"]
        else:
            w1, rank = t["lokr_w1_a"] @ t["lokr_w1_b"], t["lokr_w1_b"].shape[0]
        if "lokr_w2" in t:
            w2 = t["lokr_w2"]
        else:
            rank = t["lokr_w2_b"].shape[0]
            w2 = (
                tucker(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])
                if "lokr_t2" in t
                else t["lokr_w2_a"] @ t["lokr_w2_b"]
            )
        if w2.ndim == 4:
            w1 = w1[:, :, None, None]
        delta = np.kron(w1, w2)
    factor = 1.0 if alpha is None or rank is None else alpha / rank
    return (delta * factor).reshape(shape)


@pytest.fixture(scope="module")
def lyco(tmp_path_factory):
    """{"loha": (path, layers)} for a float16 LoHa file and a float32 LoKr file, in a models directory's Lora/."""
    root = tmp_path_factory.mktemp("models")
    (root / "Lora").mkdir()
    (root / "Stable-diffusion").mkdir()
    loha = make_layers(LOHA, 1, np.float16)
    lokr = make_layers(LOKR, 2, np.float32)
    return {
        "loha": (save(root / "Lora" / "loha.safetensors", loha, np.float16), loha),
        "lokr": (save(root / "Lora" / "lokr.safetensors", lokr, np.float32), lokr),
    }


@pytest.fixture(scope="module")
def sd1(sd1_dir):
    from sdjax import StableDiffusionPipeline

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    pipe.devices = jax.devices()[:1]
    return pipe


def component_scale(scale, component):
    return (scale[0] if component == "text_encoder" else scale[1]) if isinstance(scale, tuple) else scale


# ------------------------------------------------------------------------------------------------ fused params
def assert_fused(params, base, layers, scale):
    """Each layer's kernel in `params` is its kernel in `base` plus the hand-computed delta times `scale`."""
    for component, module, shape, t, alpha in layers:
        path = flax_path(module)
        got = np.asarray(_leaf(params[component], path), np.float64)
        delta = to_flax(expected_delta(t, shape, alpha) * component_scale(scale, component))
        want = np.asarray(_leaf(base[component], path), np.float64) + delta
        assert got.shape == want.shape, module
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(delta).max(), err_msg=module)
        assert np.abs(delta).max() > 1e-2, module  # the layer really changes


def test_fused_kernels_are_base_plus_the_deltas(sd1, lyco):
    sd1.unload_loras() if sd1.loaded_loras else None
    base = sd1.params
    scales = {"loha": 0.7, "lokr": (0.5, -0.8)}  # LoKr as <lora:lokr:0.5:-0.8>: text encoder 0.5, UNet -0.8
    for name, scale in scales.items():
        sd1.load_lora(lyco[name][0], scale=scale, adapter_name=name)
    try:
        for name, scale in scales.items():
            factors = sd1.loaded_loras[name].factors
            assert len(factors) == 7 and all(isinstance(f, lora_lib.LycorisFactor) for f in factors.values())
            assert_fused(sd1.params, base, lyco[name][1], scale)
        # A layer neither file touches is the base array itself.
        untouched = ("down_blocks_0", "attentions_0", "transformer_blocks_0", "attn1", "to_v", "kernel")
        assert _leaf(sd1.params["unet"], untouched) is _leaf(base["unet"], untouched)
        # numpy params (no device) get the same sums on the host (`apply_loras`).
        host = {c: jax.tree_util.tree_map(np.asarray, base[c]) for c in ("unet", "text_encoder")}
        on_host = lora_lib.apply_loras(host, [(sd1.loaded_loras["lokr"], (0.5, -0.8))])
        assert isinstance(_leaf(on_host["unet"], flax_path(LOKR[0][1])), np.ndarray)
        assert_fused(on_host, host, lyco["lokr"][1], (0.5, -0.8))
    finally:
        sd1.unload_loras()
    assert sd1.params is base


def _leaf(tree, path):
    for p in path:
        tree = tree[p]
    return tree


# ------------------------------------------------------------------------------------------------ against torch
def torch_with_deltas(torch_pipe, files: list[tuple[list, float]]):
    """A copy of the diffusers pipeline with each layer's expected delta (times its file's scale) added to the
    weight of the module of that diffusers name."""
    ref = copy.deepcopy(torch_pipe)
    for layers, scale in files:
        for component, module, shape, t, alpha in layers:
            model = ref.unet if component == "unet" else ref.text_encoder
            weight = model.get_submodule(module.removeprefix("text_model.")).weight
            assert tuple(weight.shape) == shape
            with torch.no_grad():
                weight += torch.from_numpy(expected_delta(t, shape, alpha) * scale).to(weight.dtype)
    return ref


def test_images_match_diffusers_with_the_deltas_added(sd1, lyco, torch_sd1):
    scales = {"loha": 0.8, "lokr": 0.6}
    for name, scale in scales.items():
        sd1.load_lora(lyco[name][0], scale=scale, adapter_name=name)
    try:
        ref = torch_with_deltas(torch_sd1, [(lyco[n][1], s) for n, s in scales.items()])
        compare_unet(sd1, ref)  # 1e-4 relative to the output's magnitude
        compare_text(sd1, ref)
        prompt = "a photo of an astronaut riding a horse"
        kw = dict(num_inference_steps=2, latents=torch.from_numpy(LATENTS), output_type="np", height=64, width=64)
        with torch.no_grad():
            theirs = ref(prompt=prompt, **kw).images
            plain = torch_sd1(prompt=prompt, **kw).images
        ours = sd1.generate(prompt, **GENERATE)
    finally:
        sd1.unload_loras()
    err = np.abs(ours - theirs).max()
    assert err < 1e-3, f"images: max abs error {err:.2e}"
    assert np.abs(plain - theirs).max() > 2e-2  # the LoHa and LoKr change the image


# ------------------------------------------------------------------------------------------------ A1111 tags
def test_prompt_tag_finds_a_loha_in_the_models_directory(sd1_dir, lyco, tmp_path, monkeypatch):
    """`<lora:loha:0.6>` (--prompt-syntax a1111, --models-dir) gives the Python API's image with the file loaded
    at 0.6; the directory lists the LoHa and LoKr files as LoRAs."""
    from typer.testing import CliRunner

    from sdjax import StableDiffusionPipeline, cli

    path = lyco["loha"][0]
    root = path.parent.parent
    assert ModelsDir(root).names("lora") == ["loha", "lokr"]
    monkeypatch.setattr(
        cli.generate, "load_pipeline", lambda model, dtype: StableDiffusionPipeline.from_pretrained(model)[0]
    )
    ref_pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    ref_pipe.load_lora(path, scale=0.6)
    ref = np.asarray(ref_pipe.generate("a cat", seed=3, steps=2, height=64, width=64)[0], np.int16)
    ref_pipe.unload_loras()
    plain = np.asarray(ref_pipe.generate("a cat", seed=3, steps=2, height=64, width=64)[0], np.int16)
    args = ["generate", "a cat <lora:loha:0.6>", "--prompt-syntax", "a1111", "--models-dir", str(root)]
    args += ["-m", str(sd1_dir), "--seed", "3", "--steps", "2", "-W", "64", "-H", "64", "-o", str(tmp_path)]
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    (png,) = tmp_path.glob("*.png")
    got = np.asarray(Image.open(png).convert("RGB"), np.int16)
    assert np.abs(got - ref).max() <= 1
    assert np.abs(got - plain).max() > 8  # the LoHa was applied


# ------------------------------------------------------------------------------------------------ refusals
def write(path, tensors):
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, str(path))
    return path


Q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
LOHA_Q = {f"{Q}.hada_w1_a": np.ones((32, 2)), f"{Q}.hada_w1_b": np.ones((2, 32))}
LOHA_Q |= {f"{Q}.hada_w2_a": np.ones((32, 2)), f"{Q}.hada_w2_b": np.ones((2, 32))}
LOKR_Q = {f"{Q}.lokr_w1": np.ones((4, 4)), f"{Q}.lokr_w2": np.ones((8, 8))}


@pytest.mark.parametrize(
    "base, extra, pattern",
    [
        (LOHA_Q, {f"{Q}.dora_scale": np.ones((32, 1))}, rf"DoRA \(dora_scale\).*key '{Q}\.dora_scale'"),
        (LOKR_Q, {f"{Q}.dora_scale": np.ones((32, 1))}, rf"DoRA \(dora_scale\).*key '{Q}\.dora_scale'"),
        (
            LOKR_Q,
            {f"{Q}.lokr_t1": np.ones((2, 2, 1, 1))},
            rf"LoHa / LoKr key of a kind sdjax does not apply.*'{Q}\.lokr_t1'",
        ),
        (LOHA_Q, {f"{Q}.lora_down.weight": np.ones((2, 32))}, rf"layer '{Q[10:]}' of unet has both LoRA \(down / up\)"),
        (LOHA_Q, {f"{Q}.lokr_w1": np.ones((4, 4))}, r"has both LoHa \(hada_\*\) and LoKr \(lokr_\*\) tensors"),
        (LOKR_Q, {f"{Q}.hada_w1_a": np.ones((32, 2))}, r"has both LoHa \(hada_\*\) and LoKr \(lokr_\*\) tensors"),
        (
            LOHA_Q,
            {"unet.down_blocks.0.attentions.0.proj_in.hada_w1_a": np.ones((32, 2))},
            r"kohya / LyCORIS names .*not under diffusers / PEFT names \(key 'unet\.down_blocks\.0.*hada_w1_a'\)",
        ),
    ],
    ids=["loha-dora", "lokr-dora", "lokr_t1", "lora+loha", "loha+lokr", "lokr+loha", "peft-names"],
)
def test_dora_and_what_sdjax_does_not_apply_are_refused_naming_the_key(sd1, tmp_path, base, extra, pattern):
    path = write(tmp_path / "bad.safetensors", {**base, **extra})
    with pytest.raises(lora_lib.LoraError, match=rf"bad\.safetensors: .*{pattern}"):
        sd1.load_lora(path)
    assert sd1.loaded_loras == {}


def test_incomplete_or_misfit_layers_are_refused(sd1, tmp_path):
    half = {k: v for k, v in LOHA_Q.items() if "w2" not in k}
    with pytest.raises(lora_lib.LoraError, match=rf"LoHa layer '{Q[10:]}' of unet lacks hada_w2_a, hada_w2_b"):
        sd1.load_lora(write(tmp_path / "half.safetensors", half))
    conv = "lora_unet_mid_block_resnets_0_conv2"
    tucker_half = {f"{conv}.hada_t1": np.ones((2, 2, 3, 3))} | {
        f"{conv}.hada_w{i}_{ab}": np.ones((2, 64)) for i in (1, 2) for ab in "ab"
    }
    with pytest.raises(lora_lib.LoraError, match=r"LoHa layer 'mid_block_resnets_0_conv2' of unet lacks hada_t2"):
        sd1.load_lora(write(tmp_path / "tucker.safetensors", tucker_half))
    no_w2 = {f"{Q}.lokr_w1": np.ones((4, 4)), f"{Q}.lokr_w2_a": np.ones((8, 2))}
    with pytest.raises(lora_lib.LoraError, match=r"LoKr layer .* lacks lokr_w2_b"):
        sd1.load_lora(write(tmp_path / "no_w2.safetensors", no_w2))
    wide = {k: np.ones((64, 2)) if k.endswith("_a") else np.ones((2, 64)) for k in LOHA_Q}  # a 64-wide model's
    with pytest.raises(
        lora_lib.LoraError, match=r"wide\.safetensors: 1 LoRA layer\(s\) do not fit.*LoHa delta \(64, 64\)"
    ):
        sd1.load_lora(write(tmp_path / "wide.safetensors", wide))
    kron = {f"{Q}.lokr_w1": np.ones((4, 4)), f"{Q}.lokr_w2": np.ones((8, 16))}  # (32, 64) on a (32, 32) weight
    with pytest.raises(lora_lib.LoraError, match=r"do not fit.*LoKr delta \(32, 64\).*attn1/to_q/kernel \(32, 32\)"):
        sd1.load_lora(write(tmp_path / "kron.safetensors", kron))
    assert sd1.loaded_loras == {}


def test_flux_reader_still_refuses_lycoris_layers():
    """`group_layers` without `lycoris_layers` (the Flux reader's check) refuses LoHa / LoKr by name; with it, they
    group into layers by role."""
    for key, kind in ((f"{Q}.hada_w1_a", "LoHa"), (f"{Q}.lokr_w1", "LoKr")):
        with pytest.raises(lora_lib.LoraError, match=rf"x: {kind} .*\(key '{re.escape(key)}'\)"):
            lora_lib.group_layers([key], source="x")
    layers, unknown = lora_lib.group_layers([*LOHA_Q, f"{Q}.alpha"], source="x", lycoris_layers=True)
    assert unknown == [] and list(layers) == [("unet", "kohya", Q[10:])]
    assert set(layers[("unet", "kohya", Q[10:])].keys) == {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}
