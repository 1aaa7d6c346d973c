"""Conditioning features (`core.protocols.Feature`) beside a ControlNet on the embedded model.

`Shift`, defined here and nowhere in sdjax, is the smallest feature with params, per-image arrays and two hook
points: at model call `i` it adds `params["input"][i] * w_b` to image b's model input (both CFG halves) and
`params["after"][i] * w_b` to its latents after the sampler's step, `w` `(B,)` coming from its request. What it
must do is known without sdjax's feature plumbing:

- all-zero params leave the ControlNet-only generation as it is;
- a shift after the last model call only is added to the final latents and to nothing else;
- a shift of the model input equals the same generation with a denoiser that adds it by hand (the index of the
  call found from the timestep).

Two programs are compared to `ATOL` on the final latents (values of order 1; the ControlNet and the shifts
move them by more than 1e-2): the suite compiles with XLA's optimisation off (tests/conftest.py), under which two
different programs may round differently (1.8e-5 measured between the ControlNet-only program and the one with a
zero shift; 0 with XLA's default optimisation).

And the plumbing's contract: a ControlNet and a `Shift` are one compiled program whose params and arrays change
without recompiling; a shared input key, params key or name and a missing params entry are errors before any
compile.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import load_pipeline
from sdjax.core import Generator, Hook
from sdjax.core.protocols import Feature, FeatureRequest
from sdjax.models.controlnet import ControlNetConfig, ControlNetModel, config_from_unet
from sdjax.models.presets import random_params
from sdjax.pipelines.base import seed_keys
from sdjax.pipelines.controlnet import control_request

STEPS = 3
SIZE = 64
PROMPTS = ["a red square", "a blue circle"]
WEIGHTS = np.array([1.0, -0.5], np.float32)
ATOL = 1e-4  # float rounding of two different programs (module docstring)


@dataclasses.dataclass(frozen=True)
class Shift:
    """The test feature (module docstring); `input_key` names its per-image weights among the program inputs."""

    name: str = "shift"
    params_key: str = "shift"
    input_key: str = "shift_weight"

    def hook(self, params, inputs, *, cond, cfg, latent_channels, encode=None):
        return ShiftHook(params["input"], params["after"], inputs[self.input_key], cfg)

    def example_inputs(self, *, batch, height, width, calls):
        return {self.input_key: np.zeros((batch,), np.float32)}


@dataclasses.dataclass(frozen=True)
class ShiftHook(Hook):
    on_input: jax.Array  # (calls,)
    after: jax.Array  # (calls,)
    weights: jax.Array  # (B,)
    cfg: bool

    def model_input(self, step, x_in):
        w = jnp.concatenate([self.weights, self.weights]) if self.cfg else self.weights
        return x_in + (self.on_input[step] * w).reshape(-1, 1, 1, 1)

    def after_step(self, step, x, state):
        return x + (self.after[step] * self.weights).reshape(-1, 1, 1, 1)


@dataclasses.dataclass
class ShiftRequest:
    spec: Shift
    params: dict
    weights: np.ndarray

    def arrays(self, *, start, end, calls):
        return {self.spec.input_key: np.asarray(self.weights, np.float32)}


def shift(on_input=None, after=None, spec=Shift()) -> ShiftRequest:
    zeros = np.zeros((STEPS,), np.float32)
    params = {
        "input": jnp.asarray(zeros if on_input is None else on_input, jnp.float32),
        "after": jnp.asarray(zeros if after is None else after, jnp.float32),
    }
    return ShiftRequest(spec, params, WEIGHTS)


@pytest.fixture(scope="module")
def embedded():
    pipe, params = load_pipeline()
    raw = config_from_unet(dataclasses.asdict(pipe.unet.config))
    # the embedded VAE downsamples 4x: a control-image embedding of two stages (diffusers' default has three)
    raw["conditioning_embedding_out_channels"] = [16, 32, 32]
    config = ControlNetConfig.from_dict(raw, source="test")
    net = ControlNetModel(config, dtype=jnp.float32)
    net_params = random_params(net.init_params_shape(config), 7, jnp.float32)
    r = np.random.default_rng(0)
    maps = [(r.random((SIZE, SIZE, 3)) > 0.7).astype(np.uint8) * 255 for _ in PROMPTS]
    cn = control_request(
        pipe,
        control_image=maps,
        controlnet=(net, net_params),
        params=None,
        count=len(PROMPTS),
        height=SIZE,
        width=SIZE,
        task="txt2img",
    )
    return pipe, params, cn


def run(gen: Generator, params, features, output="latents"):
    return gen.run(
        prompts=PROMPTS,
        negative_prompts=[None] * len(PROMPTS),
        keys=seed_keys([3] * len(PROMPTS), range(len(PROMPTS))),
        guidance_scales=[7.5] * len(PROMPTS),
        steps=STEPS,
        height=SIZE,
        width=SIZE,
        params=params,
        features=features,
        output=output,
    )


def test_the_features_are_features(embedded):
    _, _, cn = embedded
    assert isinstance(Shift(), Feature) and isinstance(cn.spec, Feature)
    assert isinstance(shift(), FeatureRequest) and isinstance(cn, FeatureRequest)
    assert cn.spec.params_key == "controlnet"


def test_zero_params_give_the_controlnet_only_generation(embedded):
    pipe, params, cn = embedded
    alone = run(pipe.generator, params, [cn])
    with_zero = run(pipe.generator, params, [cn, shift()])
    np.testing.assert_allclose(with_zero, alone, rtol=0, atol=ATOL)
    plain = run(pipe.generator, params, [])
    assert np.abs(alone - plain).max() > 1e-2  # the ControlNet acts


def test_a_shift_after_the_last_call_is_added_to_the_final_latents(embedded):
    pipe, params, cn = embedded
    alone = run(pipe.generator, params, [cn])
    last = np.zeros((STEPS,), np.float32)
    last[-1] = 0.25
    got = run(pipe.generator, params, [cn, shift(after=last)])
    want = alone + (0.25 * WEIGHTS).reshape(-1, 1, 1, 1)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


@dataclasses.dataclass(frozen=True, eq=False)
class ShiftedDenoiser:
    """A denoiser adding `table[i] * w_b` to its input by hand, `i` the index of the timestep it is called with."""

    inner: object
    timesteps: np.ndarray
    table: np.ndarray

    @property
    def component(self):
        return self.inner.component

    @property
    def in_channels(self):
        return self.inner.in_channels

    @property
    def distilled_guidance(self):
        return self.inner.distilled_guidance

    def with_attention(self, attention):
        return dataclasses.replace(self, inner=self.inner.with_attention(attention))

    def bind(self, params, cond, inputs, *, cfg):
        model = self.inner.bind(params, cond, inputs, cfg=cfg)
        padded = np.zeros(inputs["keys"].shape[0], np.float32)  # the batch padded to the mesh (images dropped)
        padded[: len(WEIGHTS)] = WEIGHTS
        w = np.concatenate([padded, padded]) if cfg else padded

        def shifted(x_in, t, **kwargs):
            i = jnp.argmax(jnp.asarray(self.timesteps) == t)
            return model(x_in + (jnp.asarray(self.table)[i] * w).reshape(-1, 1, 1, 1), t, **kwargs)

        return shifted


def test_a_shift_of_the_model_input_equals_the_shift_applied_by_hand(embedded):
    pipe, params, _ = embedded
    gen = pipe.generator
    table = np.array([0.3, -0.2, 0.1], np.float32)
    got = run(gen, params, [shift(on_input=table)])
    m = gen.models
    state = gen.sampler.set_timesteps(gen.sampler.create_state(), STEPS, (2, m.latent_channels, 8, 8))
    timesteps = np.asarray(state.timesteps)
    assert len(np.unique(timesteps)) == STEPS == len(timesteps)
    by_hand = Generator(
        conditioning=m.conditioning,
        denoiser=ShiftedDenoiser(m.denoiser, timesteps, table),
        vae=m.vae,
        sampler=gen.sampler,
        params=params,
        dtype=m.dtype,
    )
    want = run(by_hand, params, [])
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert np.abs(got - run(gen, params, [])).max() > 1e-2  # the shift acts


def test_a_controlnet_and_a_shift_are_one_program(embedded):
    pipe, params, cn = embedded
    gen = pipe.generator
    before = gen.cache.stats.compiles
    first = run(gen, params, [cn, shift(on_input=[0.1, 0.0, 0.0])], output="images")
    compiled = gen.cache.stats.compiles - before
    assert compiled == 1  # the program (with the split decode: its pair, one entry)
    cached = gen.cache.keys()  # (a ProgramCache is not iterable)
    (key,) = [k for k in cached if k[0] == "split" and len(k[1].features) == 2]
    assert key[1].features == (cn.spec, Shift())
    second = run(gen, params, [cn, shift(on_input=[0.0, 0.2, 0.0])], output="images")
    assert gen.cache.stats.compiles - before == compiled  # new params and arrays, the same executable
    assert np.abs(first - second).max() > 1e-3


def test_collisions_and_missing_params_are_errors_before_any_compile(embedded, monkeypatch):
    pipe, params, cn = embedded
    gen = pipe.generator

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(Generator, "lower", no_compile)
    clash = Shift(name="clash", params_key="clash", input_key="control_image")
    with pytest.raises(ValueError, match="'controlnet' and 'clash' both give the input 'control_image'"):
        run(gen, params, [cn, shift(spec=clash)])
    own = Shift(name="own", params_key="own", input_key="keys")
    with pytest.raises(ValueError, match="the own feature's input 'keys' is already one of the program's inputs"):
        run(gen, params, [shift(spec=own)])
    with pytest.raises(ValueError, match=r"both read params\['controlnet'\]"):
        gen.spec(batch=2, height=SIZE, width=SIZE, steps=STEPS, features=(cn.spec, Shift(params_key="controlnet")))
    with pytest.raises(ValueError, match="two features are named 'shift'"):
        gen.spec(batch=2, height=SIZE, width=SIZE, steps=STEPS, features=(Shift(), Shift(params_key="other")))
    with pytest.raises(TypeError, match="not a core.protocols.Feature"):
        gen.spec(batch=2, height=SIZE, width=SIZE, steps=STEPS, features=(object(),))
    spec = gen.spec(batch=2, height=SIZE, width=SIZE, steps=STEPS, features=(cn.spec, Shift()))
    with pytest.raises(KeyError, match="params has no 'shift' entry, which the shift feature reads"):
        gen.compile(spec, params={**params, "controlnet": cn.params})
    with pytest.raises(ValueError, match="params_key 'unet' is a component of the model"):
        run(gen, params, [shift(spec=Shift(params_key="unet"))])
