"""FluxControlNetModel vs diffusers 0.42.1 on tiny random nets saved as diffusers folders and loaded back with
`load_controlnet`, and the Flux transformer's `controlnet_block_samples` / `controlnet_single_block_samples` vs
diffusers' on the same samples.

The tiny nets keep the released kinds' structure at a width of 32, 16 input channels (4 latent channels packed
2x2), T5 width 32, pooled width 24 (tests/models/test_flux_transformer.py's sizes):
- "instantx": 2 double and 3 single blocks of 2 heads of 16, the guidance embedding (InstantX's dev nets);
- "union": a ControlNet-Union net (`num_mode` 3) with 2 double blocks and no single blocks (Shakker-Labs'
  Union-Pro-2.0 has none), no guidance embedding, 4 heads of 8 (the transformer's width, other heads).
Every layer diffusers starts at zero (`controlnet_x_embedder`, `controlnet_blocks_*`, `controlnet_single_blocks_*`)
gets random weights (zeros would hide them), the q/k RMSNorms non-trivial scales. The text ids are small distinct
integers (the pipeline's are zeros, which would leave the text rotation untested). Errors are relative to the
largest output magnitude.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flux_reference import randomized_controlnet as randomized

from sdjax.config import ConfigError
from sdjax.loading.controlnet import load_controlnet
from sdjax.models import flux as F
from sdjax.models import flux_controlnet as C

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

REL_TOL = 1e-5
_BASE = dict(
    patch_size=1, in_channels=16, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
    pooled_projection_dim=24, axes_dims_rope=(4, 6, 6),
)  # fmt: skip
TRANSFORMER = {**_BASE, "num_layers": 3, "num_single_layers": 3, "guidance_embeds": True, "out_channels": None}
TINY = {
    "instantx": {**_BASE, "num_layers": 2, "num_single_layers": 3, "guidance_embeds": True},
    "union": {
        **_BASE,
        "num_layers": 2,
        "num_single_layers": 0,
        "attention_head_dim": 8,
        "num_attention_heads": 4,
        "axes_dims_rope": (2, 2, 4),
        "num_mode": 3,
    },
}
LATENT_H, LATENT_W = 16, 12  # 8 x 6 = 48 tokens


def _inputs(seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    n = (LATENT_H // 2) * (LATENT_W // 2)
    return dict(
        hidden_states=r.standard_normal((2, n, 16)).astype(np.float32),
        controlnet_cond=r.standard_normal((2, n, 16)).astype(np.float32),
        encoder_hidden_states=r.standard_normal((2, 7, 32)).astype(np.float32),
        pooled_projections=r.standard_normal((2, 24)).astype(np.float32),
        timestep=np.array([0.7, 0.25], np.float32),
        img_ids=F.image_ids(LATENT_H, LATENT_W),
        txt_ids=r.integers(0, 5, (7, 3)).astype(np.float32),
        guidance=np.array([3.5, 5.0], np.float32),
    )


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """kind -> (torch net, folder, sdjax module, params)."""
    out = {}
    for seed, (kind, config) in enumerate(TINY.items()):
        torch.manual_seed(seed)
        net = randomized(diffusers.FluxControlNetModel(**config), seed)
        folder = tmp_path_factory.mktemp(f"flux-controlnet-{kind}")
        net.save_pretrained(folder, safe_serialization=True)
        module, params = load_controlnet(folder)
        assert isinstance(module, C.FluxControlNetModel)
        out[kind] = (net, folder, module, params)
    return out


@pytest.mark.parametrize("kind", list(TINY))
def test_block_samples_match_diffusers(nets, kind):
    net, _, module, params = nets[kind]
    cfg = module.config
    i = _inputs(1)
    mode = np.array([2, 0], np.int32) if cfg.union else None
    guidance = i["guidance"] if cfg.guidance_embeds else None
    with torch.no_grad():
        ref = net(
            **{k: torch.from_numpy(v) for k, v in i.items() if k != "guidance"},
            guidance=None if guidance is None else torch.from_numpy(guidance),
            controlnet_mode=None if mode is None else torch.from_numpy(mode).long()[:, None],
            conditioning_scale=0.7,
            return_dict=False,
        )
    names = ("hidden_states", "controlnet_cond", "encoder_hidden_states", "pooled_projections", "timestep")
    args = [jnp.asarray(i[k]) for k in names] + [jnp.asarray(i["img_ids"]), jnp.asarray(i["txt_ids"])]

    @jax.jit
    def run(p, scale, *a):
        return module.apply({"params": p}, *a, guidance, mode, scale)

    double, single = run(params, 0.7, *args)
    ref_double, ref_single = ref[0] or [], ref[1] or []
    assert len(double) == len(ref_double) == cfg.num_layers
    assert len(single) == len(ref_single) == cfg.num_single_layers
    for what, out, want in (("double", double, ref_double), ("single", single, ref_single)):
        for k, (a, b) in enumerate(zip(out, want)):
            assert a.shape == b.shape == (2, 48, 32)
            err = _rel_err(a, b.numpy())
            print(f"{kind}: {what} sample {k}: max rel err {err:.2e}")
            assert err < REL_TOL
    # per-sample scales are the scalar's products
    per, _ = run(params, jnp.asarray([0.7, 0.0]), *args)
    assert _rel_err(per[0][:1], ref_double[0][:1].numpy()) < REL_TOL and not np.any(per[0][1:])


def test_transformer_adds_the_samples_at_diffusers_interval(tmp_path):
    """3 double and 3 single blocks, 2 samples each: the interval is ceil(3 / 2) = 2, blocks 0 and 1 add sample 0,
    block 2 sample 1 (in both kinds of blocks; the single samples go to the image tokens only)."""
    from safetensors.numpy import load_file

    from sdjax.config import read_json

    torch.manual_seed(5)
    model = randomized(diffusers.FluxTransformer2DModel(**TRANSFORMER), 5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = F.FluxTransformerConfig.from_dict(read_json(tmp_path / "config.json"))
    params = F.convert_flux_transformer(load_file(str(tmp_path / "diffusion_pytorch_model.safetensors")), config)
    i = _inputs(2)
    r = np.random.default_rng(3)
    double = [r.standard_normal((2, 48, 32)).astype(np.float32) for _ in range(2)]
    single = [r.standard_normal((2, 48, 32)).astype(np.float32) for _ in range(2)]
    names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids")
    with torch.no_grad():
        ref = model(
            **{k: torch.from_numpy(i[k]) for k in (*names, "guidance")},
            controlnet_block_samples=[torch.from_numpy(s) for s in double],
            controlnet_single_block_samples=[torch.from_numpy(s) for s in single],
        ).sample.numpy()
    m = F.FluxTransformer2DModel(config)
    args = [jnp.asarray(i[k]) for k in (*names, "guidance")]
    out = m.apply({"params": params}, *args, controlnet_block_samples=double, controlnet_single_block_samples=single)
    err = _rel_err(out, ref)
    print(f"transformer with double and single samples: max rel err {err:.2e}")
    assert err < REL_TOL
    plain = m.apply({"params": params}, *args)
    assert _rel_err(plain, ref) > 1e-2  # the samples did change the output
    only_double = m.apply({"params": params}, *args, controlnet_block_samples=double)
    assert _rel_err(only_double, ref) > 1e-3 and _rel_err(only_double, plain) > 1e-3
    with pytest.raises(ValueError, match=r"controlnet_single_block_samples\[1\] must be \(2, 48, 32\)"):
        m.apply({"params": params}, *args, controlnet_single_block_samples=[single[0], single[1][:, :5]])


def test_single_file_with_its_config(nets, tmp_path):
    """A Flux net's `diffusion_pytorch_model.safetensors` on its own loads with config= (its folder); without it
    the error names the file, what it is and config=."""
    from safetensors.torch import save_file

    from sdjax.loading.ldm_checkpoint import UnknownArchitectureError

    net, folder, module, params = nets["union"]
    path = tmp_path / "flux_union.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    with pytest.raises(UnknownArchitectureError, match=r"flux_union.safetensors: .*a Flux.1 ControlNet .*config="):
        load_controlnet(path)
    got_module, got = load_controlnet(path, config=folder)
    assert got_module.config == module.config
    flat = jax.tree_util.tree_leaves_with_path(params)
    other = dict(jax.tree_util.tree_leaves_with_path(got))
    assert all(np.array_equal(np.asarray(v), np.asarray(other[k])) for k, v in flat)


def test_config_and_input_errors_are_named():
    with pytest.raises(ConfigError, match="conditioning_embedding_channels=16 .* is not supported"):
        C.FluxControlNetConfig(**{**TINY["instantx"], "conditioning_embedding_channels": 16})
    with pytest.raises(ConfigError, match="num_mode must be at least 1"):
        C.FluxControlNetConfig(**{**TINY["union"], "num_mode": 0})
    with pytest.raises(ConfigError, match="axes_dims_rope"):
        C.FluxControlNetConfig(**{**TINY["instantx"], "axes_dims_rope": (4, 4, 4)})
    with pytest.raises(ConfigError, match="unknown config key"):
        C.FluxControlNetConfig.from_dict({**TINY["instantx"], "out_channels": 16}, source="x/config.json")
    union = C.FluxControlNetModel(C.FluxControlNetConfig(**TINY["union"]))
    x, ctx, pooled = jnp.zeros((1, 4, 16)), jnp.zeros((1, 3, 32)), jnp.zeros((1, 24))
    ids, t = jnp.zeros((4, 3)), jnp.zeros((1,))
    with pytest.raises(ValueError, match="ControlNet-Union net .*: pass controlnet_mode_b"):
        union.init(jax.random.key(0), x, x, ctx, pooled, t, ids, jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"controlnet_cond must be \(1, 4, 16\)"):
        union.init(jax.random.key(0), x, x[:, :2], ctx, pooled, t, ids, jnp.zeros((3, 3)), None, 0)
