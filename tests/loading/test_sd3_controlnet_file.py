"""SD 3.5 ControlNet single files in Stability AI's layout (`sdjax.loading.sd3_controlnet_file`, read by
`load_controlnet(FILE)`) against diffusers 0.42.1.

diffusers 0.42.1 has no `SD3ControlNetModel.from_single_file`; it converts these files once with
`scripts/convert_sd3_controlnet_to_diffusers.py`. The test writes its files by inverting that script's mapping
(tests/sd3_controlnet_builders.py's `to_sai`, from a tiny random diffusers `SD3ControlNetModel`'s state dict) and
checks the inversion against the script's forward mapping (`from_sai`, which reads the key names of the released
`sd3.5_large_controlnet_*.safetensors`: `transformer_blocks.N.attn.qkv`, `.adaLN_modulation.1`, ...). The file then
loads to the folder net's config and params exactly, and to diffusers' block samples (the net run with the
transformer's patch embedding, as diffusers' pipeline runs it) to 1e-5 relative.

The tiny net keeps the released nets' structure (single blocks, no text, the transformer's patch embedding) with
heads 64 wide, as the released nets (no tensor stores the head count; 2 heads here, so a wrong head split shows).
"""

from __future__ import annotations

import copy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from sd3_controlnet_builders import SCRIPT_BLOCK, randomized, rel_err, tiny_transformer, write_sai_file

from sdjax.loading.controlnet import load_controlnet
from sdjax.loading.single_file import UnknownArchitectureError
from sdjax.models import sd3 as S
from sdjax.models import sd3_controlnet as C
from sdjax.models.convert import WeightLoadError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

REL_TOL = 1e-5
TRANSFORMER = tiny_transformer(num_layers=1, attention_head_dim=64)
# What diffusers' converter builds (its fixed numbers scaled down; `caption_projection_dim` the pooled width as there).
NET = dict(
    patch_size=2,
    in_channels=4,
    num_layers=3,
    attention_head_dim=64,
    num_attention_heads=2,
    joint_attention_dim=None,
    caption_projection_dim=24,
    pooled_projection_dim=24,
    out_channels=4,
    pos_embed_max_size=None,
    pos_embed_type=None,
    use_pos_embed=False,
    force_zeros_for_pooled_projection=False,
)
LATENT_H, LATENT_W = 16, 12


def from_sai(sd: dict, num_layers: int) -> dict:
    """diffusers' `convert_sd3_controlnet_checkpoint_to_diffusers` (the script's mapping, restated): what it reads from
    a released file, under the names it reads."""
    out = {}
    for i in range(num_layers):
        for leaf in ("weight", "bias"):
            out[f"controlnet_blocks.{i}.{leaf}"] = sd[f"controlnet_blocks.{i}.{leaf}"]
            q, k, v = torch.chunk(sd[f"transformer_blocks.{i}.attn.qkv.{leaf}"], 3, dim=0)
            for name, part in (("to_q", q), ("to_k", k), ("to_v", v)):
                out[f"transformer_blocks.{i}.attn.{name}.{leaf}"] = part
            for src, dst in SCRIPT_BLOCK.items():
                out[f"transformer_blocks.{i}.{dst}.{leaf}"] = sd[f"transformer_blocks.{i}.{src}.{leaf}"]
    for leaf in ("weight", "bias"):
        out[f"pos_embed_input.proj.{leaf}"] = sd[f"pos_embed_input.proj.{leaf}"]
        for emb in ("timestep_embedder", "text_embedder"):
            for lin in ("linear_1", "linear_2"):
                key = f"time_text_embed.{emb}.{lin}.{leaf}"
                out[key] = sd[key]
    return out


def _flat(tree) -> dict:
    return {"/".join(k): np.asarray(v) for k, v in flatten_dict(tree).items()}


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """(diffusers net, its diffusers folder, its file in Stability's layout)."""
    torch.manual_seed(3)
    model = randomized(diffusers.SD3ControlNetModel(**NET), 3)
    root = tmp_path_factory.mktemp("sd35-controlnet")
    model.save_pretrained(root / "folder", safe_serialization=True)
    return model, root / "folder", write_sai_file(model, root / "sd3.5_tiny_controlnet_canny.safetensors")


def test_file_has_the_released_layout(net):
    model, _, path = net
    sd = safetensors_torch.load_file(str(path))
    released = {  # names the script reads from sd3.5_large_controlnet_*.safetensors (block 0 and the rest)
        "control_type", "pos_embed_input.proj.weight", "controlnet_blocks.0.bias",
        "time_text_embed.timestep_embedder.linear_1.weight", "time_text_embed.text_embedder.linear_2.bias",
        "transformer_blocks.0.attn.qkv.weight", "transformer_blocks.0.attn.proj.bias",
        "transformer_blocks.0.mlp.fc1.weight", "transformer_blocks.0.mlp.fc2.bias",
        "transformer_blocks.0.adaLN_modulation.1.weight",
    }  # fmt: skip
    assert released <= set(sd)
    assert not any(".to_q." in k or "norm1." in k or ".ff." in k for k in sd)
    back, want = from_sai(sd, NET["num_layers"]), model.state_dict()
    assert set(back) == set(want)  # the script reads every tensor of the net, and nothing else but control_type
    for k, v in want.items():
        assert torch.equal(back[k], v), k


def test_diffusers_reads_no_such_file_itself_yet(net):
    """diffusers 0.42.1's `from_single_file` refuses SD3ControlNetModel (hence the folder comparison below); a
    diffusers that reads these files must read this one as the net it was written from."""
    model, _, path = net
    try:
        theirs = diffusers.SD3ControlNetModel.from_single_file(str(path), local_files_only=True)
    except ValueError as e:
        assert "FromOriginalModelMixin" in str(e)
        return
    want = model.state_dict()
    assert set(theirs.state_dict()) == set(want)
    assert all(torch.equal(v, want[k]) for k, v in theirs.state_dict().items())


def test_file_loads_as_the_folder_net(net):
    _, folder, path = net
    module, params = load_controlnet(path)
    ref_module, ref_params = load_controlnet(folder)
    assert isinstance(module, C.SD3ControlNetModel)
    assert module.config == ref_module.config  # the inferred config is the one diffusers' converter writes
    got, want = _flat(params), _flat(ref_params)
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        assert np.array_equal(got[k], want[k]), k
    half_module, half_params = load_controlnet(path, dtype=jnp.bfloat16)
    assert half_module.dtype == jnp.bfloat16
    assert {a.dtype for a in jax.tree_util.tree_leaves(half_params)} == {jnp.dtype(jnp.bfloat16)}


def test_file_net_gives_diffusers_block_samples(net, tmp_path):
    """The file's net with a transformer's patch embedding (as StableDiffusion3ControlNetPipeline runs it)."""
    from safetensors.numpy import load_file

    from sdjax.config import read_json

    shared, _, path = net
    model = copy.deepcopy(shared)  # the fixture's net keeps no patch embedding
    torch.manual_seed(4)
    transformer = diffusers.SD3Transformer2DModel(**TRANSFORMER).eval()
    transformer.save_pretrained(tmp_path, safe_serialization=True)
    t_config = S.SD3TransformerConfig.from_dict(read_json(tmp_path / "config.json"))
    t_params = S.convert_sd3_transformer(load_file(str(tmp_path / "diffusion_pytorch_model.safetensors")), t_config)
    model.pos_embed = model._get_pos_embed_from_transformer(transformer)

    module, params = load_controlnet(path)
    module = module.clone(pos_embed_config=t_config)
    params = {**params, "pos_embed": t_params["pos_embed"]}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, LATENT_H, LATENT_W)).astype(np.float32)
    cond = rng.standard_normal((2, 4, LATENT_H, LATENT_W)).astype(np.float32)
    pooled = rng.standard_normal((2, 24)).astype(np.float32)
    t = np.array([700.0, 250.0], np.float32)
    with torch.no_grad():
        ref = model(
            hidden_states=torch.from_numpy(x),
            controlnet_cond=torch.from_numpy(cond),
            pooled_projections=torch.from_numpy(pooled),
            timestep=torch.from_numpy(t),
            conditioning_scale=0.7,
        ).controlnet_block_samples
    out = jax.jit(lambda p: module.apply({"params": p}, x, cond, None, pooled, t, 0.7))(params)
    assert len(out) == len(ref) == NET["num_layers"]
    for k, (a, b) in enumerate(zip(out, ref)):
        err = rel_err(a, b.numpy())
        print(f"block sample {k}: max rel err {err:.2e}")
        assert err < REL_TOL


def test_config_of_the_released_shapes():
    """The shapes of sd3.5_large_controlnet_canny.safetensors -> the config diffusers' converter writes for it."""
    from sdjax.loading import sd3_controlnet_file as sai

    d = 2432
    shapes = {"control_type": (1,), "pos_embed_input.proj.weight": (d, 16, 2, 2), "pos_embed_input.proj.bias": (d,)}
    shapes.update({f"time_text_embed.timestep_embedder.linear_{j}.weight": (d, 256 if j == 1 else d) for j in (1, 2)})
    shapes.update({f"time_text_embed.text_embedder.linear_{j}.weight": (d, 2048 if j == 1 else d) for j in (1, 2)})
    shapes.update({f"transformer_blocks.{i}.attn.qkv.weight": (3 * d, d) for i in range(19)})
    raw = sai.infer_config(shapes, component="sd3.5_large_controlnet_canny.safetensors")
    cfg = C.SD3ControlNetConfig.from_dict(raw)
    script = dict(patch_size=2, in_channels=16, num_layers=19, attention_head_dim=64, num_attention_heads=38,
                  joint_attention_dim=None, caption_projection_dim=2048, pooled_projection_dim=2048, out_channels=16,
                  pos_embed_max_size=None, pos_embed_type=None, use_pos_embed=False,
                  force_zeros_for_pooled_projection=False)  # fmt: skip
    assert cfg == C.SD3ControlNetConfig(**script)
    full = sai.expected_shapes(cfg)
    assert len(full) == 2 + 8 + 19 * 12 and full["transformer_blocks.18.adaLN_modulation.1.weight"] == (6 * d, d)
    sai.check_keys({**full, "control_type": (1,)}, cfg, component="released")


def _save(tensors: dict, path: Path) -> Path:
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_malformed_file_names_the_file_and_keys(net, tmp_path):
    model, _, path = net
    sd = safetensors_torch.load_file(str(path))
    bad = dict(sd)
    del bad["transformer_blocks.1.mlp.fc2.weight"]
    bad["transformer_blocks.0.attn.ln_q.weight"] = torch.ones(64)
    bad["controlnet_blocks.2.bias"] = torch.zeros(5)
    file = _save(bad, tmp_path / "broken.safetensors")
    with pytest.raises(WeightLoadError) as e:
        load_controlnet(file)
    message = str(e.value)
    assert str(file) in message
    assert e.value.missing == ["transformer_blocks.1.mlp.fc2.weight"]
    assert e.value.unexpected == ["transformer_blocks.0.attn.ln_q.weight"]
    assert e.value.misshaped == ["controlnet_blocks.2.bias: file (5,) vs model (128,)"]
    no_pooled = {k: v for k, v in sd.items() if not k.startswith("time_text_embed.text_embedder.linear_1.")}
    with pytest.raises(WeightLoadError, match=r"no_pooled.safetensors.*\n.*missing \(1\): time_text_embed"):
        load_controlnet(_save(no_pooled, tmp_path / "no_pooled.safetensors"))
    own = {**sd, "pos_embed.proj.weight": torch.zeros(128, 4, 2, 2), "pos_embed.proj.bias": torch.zeros(128)}
    with pytest.raises(ValueError, match="own_patch.safetensors.*a patch embedding of its own"):
        load_controlnet(_save(own, tmp_path / "own_patch.safetensors"))


def test_width_not_in_64_wide_heads_needs_config(tmp_path):
    config = {**NET, "attention_head_dim": 16, "num_attention_heads": 2}
    torch.manual_seed(5)
    model = randomized(diffusers.SD3ControlNetModel(**config), 5)
    model.save_pretrained(tmp_path / "folder", safe_serialization=True)
    path = write_sai_file(model, tmp_path / "narrow.safetensors")
    with pytest.raises(ValueError, match=r"narrow.safetensors.*32 wide.*pass config="):
        load_controlnet(path)
    module, params = load_controlnet(path, config=tmp_path / "folder")
    ref_module, ref_params = load_controlnet(tmp_path / "folder")
    assert module.config == ref_module.config
    got, want = _flat(params), _flat(ref_params)
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="config for a ControlNetModel"):
        load_controlnet(path, config={"_class_name": "ControlNetModel"})


def test_diffusers_layout_file_needs_its_config(net, tmp_path):
    model, folder, _ = net
    path = _save(dict(model.state_dict()), tmp_path / "diffusers_layout.safetensors")
    with pytest.raises(ValueError, match="diffusers_layout.safetensors: an SD 3 ControlNet in the diffusers layout"):
        load_controlnet(path)
    module, params = load_controlnet(path, config=folder)
    assert module.config == load_controlnet(folder)[0].config


def test_other_files_are_named(tmp_path):
    """A Flux ControlNet and an SD 3 model given as ControlNets fail naming the file and what it is."""
    torch.manual_seed(6)
    flux = diffusers.FluxControlNetModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    path = _save(dict(flux.state_dict()), tmp_path / "flux_canny.safetensors")
    with pytest.raises(
        UnknownArchitectureError, match=r"flux_canny.safetensors: not a ControlNet.*a Flux.1 ControlNet"
    ):
        load_controlnet(path)
    mmdit = {
        "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(12, 4),
        "model.diffusion_model.x_embedder.proj.weight": torch.zeros(4, 16, 2, 2),
    }
    path = _save(mmdit, tmp_path / "sd3.5_medium.safetensors")
    with pytest.raises(UnknownArchitectureError, match=r"sd3.5_medium.safetensors: .*Stable Diffusion 3 / 3.5 model"):
        load_controlnet(path)


def test_folder_config_class_is_checked(net, tmp_path):
    """A config.json of another class than the file holds is named (the SD layout's check too)."""
    _, _, path = net
    config = {**NET, "_class_name": "FluxControlNetModel"}
    with pytest.raises(ValueError, match="config for a FluxControlNetModel, but .* holds SD3ControlNetModel weights"):
        load_controlnet(path, config=config)


def test_sd_file_whose_heads_the_shapes_do_not_tell_needs_config(tmp_path):
    """An original-layout SD 2.x/SDXL-like net narrower than one 64-channel head: a named error (was a division by
    zero inside the config check), and its config.json loads it."""
    from ldm_fixtures import controlnet_to_original

    config = dict(
        block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), norm_num_groups=8,
    )  # fmt: skip
    torch.manual_seed(7)
    model = diffusers.ControlNetModel(**config).eval()
    model.save_pretrained(tmp_path / "folder", safe_serialization=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = _save(controlnet_to_original(state, dict(model.config)), tmp_path / "narrow_sd.safetensors")
    with pytest.raises(UnknownArchitectureError, match=r"narrow_sd.safetensors.*\[32, 64\].*pass config="):
        load_controlnet(path)
    module, _ = load_controlnet(path, config=tmp_path / "folder")
    assert module.config == load_controlnet(tmp_path / "folder")[0].config
