"""SD3ControlNetModel vs diffusers 0.42.1 on tiny random nets saved as diffusers folders and loaded back with
`load_controlnet`, and the transformer's `controlnet_block_samples` vs diffusers' `block_controlnet_hidden_states`.

The tiny nets keep each released kind's structure at a width of 32 (2 heads of 16), patch size 2, 4 latent
channels, text width 40, pooled width 24:
- "instantx": joint blocks (InstantX's SD 3 nets), here with a dual-attention block, q/k RMSNorm, a
  `pos_embed_max_size` 12 table and one extra conditioning channel (an inpainting net's mask);
- "sd35-large": single blocks, no text, `use_pos_embed` false (the transformer's patch embedding borrowed, as
  diffusers' pipeline copies it in), `pos_embed_type` null, `force_zeros_for_pooled_projection` false;
- "no-positions": joint blocks with its own patch embedding but `pos_embed_type` null.
Every zero-initialised layer (`pos_embed_input`, `controlnet_blocks_i`) gets random weights (zeros would hide them),
RMSNorms non-trivial weights and position tables random values. Errors are relative to the largest output
magnitude; float32 parity is measured at 1.5e-7 .. 2.9e-7.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sd3_controlnet_builders import randomized, rel_err, tiny_transformer

from sdjax.config import ConfigError
from sdjax.loading.controlnet import load_controlnet
from sdjax.models import sd3 as S
from sdjax.models import sd3_controlnet as C

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

REL_TOL = 1e-5
TRANSFORMER = tiny_transformer(num_layers=5, attention_head_dim=16, qk_norm="rms_norm")
NET = {k: v for k, v in TRANSFORMER.items() if k != "num_layers"}
TINY = {
    "instantx": {**NET, "num_layers": 2, "dual_attention_layers": (0,), "extra_conditioning_channels": 1},
    "sd35-large": {
        **NET,
        "num_layers": 3,
        "joint_attention_dim": None,
        "qk_norm": None,
        "pos_embed_max_size": None,
        "pos_embed_type": None,
        "use_pos_embed": False,
        "force_zeros_for_pooled_projection": False,
    },
    "no-positions": {**NET, "num_layers": 2, "qk_norm": None, "pos_embed_type": None},
}
LATENT_H, LATENT_W = 16, 12


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    """A tiny diffusers SD3Transformer2DModel (5 blocks) and its sdjax (config, params)."""
    from safetensors.numpy import load_file

    from sdjax.config import read_json

    torch.manual_seed(1)
    model = randomized(diffusers.SD3Transformer2DModel(**TRANSFORMER), 1, norms=0.2, table=1.0)
    folder = tmp_path_factory.mktemp("sd3-transformer")
    model.save_pretrained(folder, safe_serialization=True)
    config = S.SD3TransformerConfig.from_dict(read_json(folder / "config.json"))
    params = S.convert_sd3_transformer(load_file(str(folder / "diffusion_pytorch_model.safetensors")), config)
    return model, config, params


class Case:
    """One tiny net: the diffusers model, the sdjax module and params from its saved folder, inputs."""

    def __init__(self, kind: str, folder, transformer, seed: int = 0):
        torch_t, t_config, t_params = transformer
        torch.manual_seed(seed)
        model = randomized(diffusers.SD3ControlNetModel(**TINY[kind]), seed, norms=0.2, table=1.0)
        self.torch_model = model
        model.save_pretrained(folder, safe_serialization=True)
        if not model.config.use_pos_embed:  # what StableDiffusion3ControlNetPipeline does with such a net
            model.pos_embed = model._get_pos_embed_from_transformer(torch_t)
        self.module, self.params = load_controlnet(folder)
        assert isinstance(self.module, C.SD3ControlNetModel)
        if not self.module.config.use_pos_embed:
            self.module = self.module.clone(pos_embed_config=t_config)
            self.params = {**self.params, "pos_embed": t_params["pos_embed"]}
        cfg = self.module.config
        rng = np.random.default_rng(seed)
        self.inputs = dict(
            hidden_states=rng.standard_normal((2, 4, LATENT_H, LATENT_W)).astype(np.float32),
            controlnet_cond=rng.standard_normal((2, cfg.cond_channels, LATENT_H, LATENT_W)).astype(np.float32),
            encoder_hidden_states=rng.standard_normal((2, 7, 40)).astype(np.float32) if cfg.joint else None,
            pooled_projections=rng.standard_normal((2, 24)).astype(np.float32),
            timestep=np.array([700.0, 250.0], np.float32),
        )

    def torch_run(self, scale: float) -> list[np.ndarray]:
        kwargs = {k: None if v is None else torch.from_numpy(v) for k, v in self.inputs.items()}
        with torch.no_grad():
            out = self.torch_model(**kwargs, conditioning_scale=scale).controlnet_block_samples
        return [o.numpy() for o in out]

    def run(self, scale, dtype=jnp.float32, **options) -> list[np.ndarray]:
        module = self.module.clone(dtype=dtype, **options)
        i = self.inputs
        names = ("hidden_states", "controlnet_cond", "encoder_hidden_states", "pooled_projections", "timestep")
        args = [None if i[k] is None else jnp.asarray(i[k]) for k in names]
        out = jax.jit(lambda p, *a: module.apply({"params": p}, *a, scale))(self.params, *args)
        return [np.asarray(o.astype(jnp.float32)) for o in out]


_cases: dict[str, Case] = {}


@pytest.fixture(params=list(TINY))
def case(request, tmp_path_factory, transformer):
    if request.param not in _cases:
        folder = tmp_path_factory.mktemp("sd3-controlnet") / request.param
        _cases[request.param] = Case(request.param, folder, transformer)
    return _cases[request.param]


def test_block_samples_match_diffusers(case):
    ref = case.torch_run(0.7)
    out = case.run(0.7)
    assert len(out) == len(ref) == case.module.config.num_layers
    for k, (a, b) in enumerate(zip(out, ref)):
        assert a.shape == b.shape == (2, (LATENT_H // 2) * (LATENT_W // 2), 32)
        err = rel_err(a, b)
        print(f"{case.module.config.num_layers} blocks, sample {k}: max rel err {err:.2e}")
        assert err < REL_TOL
    # per-sample scales are the scalar's products; remat and another attention keep the numbers
    per = case.run(jnp.asarray([0.7, 0.0]), attention="chunked", remat=True)
    assert rel_err(per[0][:1], ref[0][:1]) < REL_TOL and not np.any(per[0][1:])


def test_transformer_adds_block_samples_at_diffusers_interval(transformer):
    """5 blocks and 2 samples: interval 2.5, blocks 0-2 add sample 0, block 3 sample 1, the last block none."""
    torch_t, config, params = transformer
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, LATENT_H, LATENT_W)).astype(np.float32)
    ctx = rng.standard_normal((2, 7, 40)).astype(np.float32)
    pooled = rng.standard_normal((2, 24)).astype(np.float32)
    t = np.array([600.0, 100.0], np.float32)
    samples = [rng.standard_normal((2, 48, 32)).astype(np.float32) for _ in range(2)]
    assert [S.controlnet_sample_index(i, 5, 2) for i in range(4)] == [0, 0, 0, 1]
    model = S.SD3Transformer2DModel(config)
    for skip in ((), (1,)):
        with torch.no_grad():
            ref = torch_t(
                hidden_states=torch.from_numpy(x),
                encoder_hidden_states=torch.from_numpy(ctx),
                pooled_projections=torch.from_numpy(pooled),
                timestep=torch.from_numpy(t),
                block_controlnet_hidden_states=[torch.from_numpy(s) for s in samples],
                skip_layers=list(skip) or None,
            ).sample.numpy()
        out = model.apply({"params": params}, x, ctx, pooled, t, skip, controlnet_block_samples=samples)
        err = rel_err(out, ref)
        print(f"transformer with block samples, skip {skip}: max rel err {err:.2e}")
        assert err < REL_TOL
    plain = model.apply({"params": params}, x, ctx, pooled, t)
    assert rel_err(plain, ref) > 1e-2  # the samples did change the output
    with pytest.raises(ValueError, match=r"controlnet_block_samples\[1\] must be \(2, 48, 32\)"):
        model.apply({"params": params}, x, ctx, pooled, t, controlnet_block_samples=[samples[0], samples[1][:, :5]])


def test_config_and_inputs_errors_are_named(tmp_path, transformer):
    with pytest.raises(ConfigError, match="pos_embed_type='rope'"):
        C.SD3ControlNetConfig(**{**NET, "pos_embed_type": "rope"})
    with pytest.raises(ConfigError, match="dual_attention_layers and qk_norm apply to joint blocks"):
        C.SD3ControlNetConfig(**{**NET, "joint_attention_dim": None})
    with pytest.raises(ConfigError, match="unknown config key"):
        C.SD3ControlNetConfig.from_dict({**NET, "num_single_layers": 3}, source="x/config.json")
    config = C.SD3ControlNetConfig(**TINY["sd35-large"])
    params = C.init_params_shape(config)
    assert "pos_embed" not in params and "context_embedder" not in params
    x = jnp.zeros((1, 4, 4, 4))
    with pytest.raises(ValueError, match="use_pos_embed=false and borrows the transformer's patch embedding"):
        C.SD3ControlNetModel(config).init(jax.random.key(0), x, x, None, jnp.zeros((1, 24)), jnp.zeros((1,)))
    joint = C.SD3ControlNetModel(C.SD3ControlNetConfig(**TINY["instantx"]))
    with pytest.raises(ValueError, match=r"controlnet_cond must be \(1, 5, 4, 4\)"):
        joint.init(jax.random.key(0), x, x, jnp.zeros((1, 3, 40)), jnp.zeros((1, 24)), jnp.zeros((1,)))
