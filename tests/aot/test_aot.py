"""`sdjax.aot` and `sdjax compile`: whole generation compiled for TPU slices with libtpu's compile-only client.

The tiny architecture compiles in tens of seconds on one core; the tests share one compile (a 2 x 2 mesh, so the
weights are split) and one out-of-memory compile, which the TPU compiler refuses within seconds.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from sdjax import aot, cli

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'sdjax[tpu-aot]')")
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not HAS_LIBTPU:
        pytest.skip("libtpu is not installed (pip install 'sdjax[tpu-aot]')")
    folder = tmp_path_factory.mktemp("aot-cache")
    return aot.compile_for("v5e:2x2", model="tiny", size=16, batch=2, steps=2, save_cache=folder), folder


@needs_libtpu
def test_tiny_model_compiles_for_v5e_2x2(tiny):
    r, _ = tiny
    assert (r.topology, r.chip, r.chips, r.devices) == ("v5e:2x2", "TPU v5e", 4, 4)
    # batch 2 over 4 chips: 2 data-parallel replicas of 2 devices each
    assert r.mesh == {"data": 2, "model": 2}
    assert r.fits and r.error is None
    assert r.hbm_bytes == 16 * 2**30 and r.margin_bytes == r.hbm_bytes - r.total_bytes > 0
    assert r.total_bytes == r.argument_bytes + r.output_bytes - r.alias_bytes + r.temp_bytes + r.code_bytes
    # the output: 2 images of 16 x 16 x 3 float32 split over the data axis, + the "stopped" flag
    assert r.output_bytes >= 16 * 16 * 3 * 4


@needs_libtpu
def test_arguments_hold_each_devices_share_of_the_weights(tiny):
    r, _ = tiny
    # the rules split attention/MLP/conv weights over the model axis (2): each device holds more than its 1/4 of
    # the weights and less than all of them
    assert r.weights_bytes / r.devices <= r.argument_bytes < r.weights_bytes
    assert r.argument_bytes >= r.weights_bytes / r.mesh["model"] * 0.5


@needs_libtpu
def test_flops_count_the_loop_body_once_per_model_call(tiny):
    r, _ = tiny
    assert r.model_calls == 3  # PNDM with skip_prk_steps: steps + 1 model calls
    assert r.flops == pytest.approx(r.program_flops + (r.model_calls - 1) * r.unet_call_flops)
    # one UNet call per device, against the unpartitioned call's FLOPs (XLA's count on CPU): at least its share
    # over the 4 devices, at most its share over the 2 data-parallel replicas (model-axis work fully repeated)
    from sdjax.pipelines.presets import build_pipeline

    pipe, params = build_pipeline("tiny", jnp.bfloat16, abstract=True)
    gen = pipe.generator
    spec = gen.spec(batch=2, height=16, width=16, steps=2)
    context, added = jax.eval_shape(
        lambda p, i: gen.models.conditioning.encode(p, i, cfg=True), params, gen.example_inputs(spec)
    )
    x = jax.ShapeDtypeStruct((4, 4, 8, 8), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((4,), jnp.float32)
    lowered = jax.jit(lambda p, x, t, c, a: pipe.unet.apply({"params": p["unet"]}, x, t, c, **a)).lower(
        params, x, t, context, added
    )
    global_flops = lowered.cost_analysis()["flops"]
    assert global_flops / r.devices <= r.unet_call_flops <= global_flops / r.mesh["data"]
    assert r.roofline_s == pytest.approx(
        max(r.flops / (197e12), r.bytes_accessed / 819e9)
    )  # v5e datasheet numbers, one device per chip


@needs_libtpu
def test_saved_executable_holds_the_serialized_program(tiny):
    r, folder = tiny
    name = "tiny-v5e_2x2-16x16-b2-s2"
    assert {p.name for p in folder.iterdir()} == {f"{name}.json", f"{name}.jaxexec"}
    saved = pickle.loads((folder / f"{name}.jaxexec").read_bytes())
    assert saved["meta"]["jax"] == jax.__version__ and saved["meta"]["libtpu"]
    assert isinstance(saved["payload"], bytes) and len(saved["payload"]) > 1000
    # the inputs are (params, inputs, window): the window's three scalars are among the leaves
    assert saved["in_tree"].num_leaves > 3
    assert r.saved == str(folder / f"{name}.jaxexec")
    assert json.loads((folder / f"{name}.json").read_text()) == saved["meta"]


@needs_libtpu
def test_a_program_that_cannot_fit_is_reported_and_the_cli_exits_1():
    # 32 images of 1024 x 1024 on one v5e chip (latents 512 x 512 for this VAE): the UNet's activations exceed 16 GiB
    r = runner.invoke(
        cli.app,
        ["compile", "--target", "v5e-1", "-m", "tiny", "--size", "1024", "--batch", "32", "--steps", "1"]
        + ["--no-unet-cost", "--json"],
    )
    assert r.exit_code == 1, r.output
    report = json.loads(r.stdout)
    assert report["fits"] is False and "RESOURCE_EXHAUSTED" in report["error"]
    assert report["required_bytes"] > report["available_bytes"] > 15 * 2**30
    assert report["margin_bytes"] < 0 and report["argument_bytes"] is None
    assert "does not fit" in r.stderr and "--vae-slicing" in r.stderr  # 32 images on one chip: slicing may help
    assert "--attention chunked" in r.stderr  # and attention without whole score matrices


@needs_libtpu
def test_vae_slicing_reaches_the_program_as_one_image_per_device(monkeypatch):
    """`sdjax compile --vae-slicing` compiles the program whose VAE runs one image per device of the data axis at a
    time (the compile itself is not run here: the spec it would compile is caught)."""
    from sdjax.core.generator import Generator

    seen = []

    class Stop(Exception):
        pass

    def lower(self, spec, **kwargs):
        seen.append((spec, kwargs["mesh"]))
        raise Stop  # before compiling

    monkeypatch.setattr(Generator, "lower", lower)
    for flag in ([], ["--vae-slicing"]):
        r = runner.invoke(
            cli.app,
            ["compile", "--target", "v5e-4", "-m", "tiny", "--batch", "8", "--steps", "1", "--in-process", *flag],
        )
        assert isinstance(r.exception, Stop), r.output
    (plain, _), (sliced, mesh) = seen
    assert plain.vae_slicing == 0 and sliced.vae_slicing == mesh.shape["data"] == 4


@needs_libtpu
def test_a_tpu_slices_program_gets_the_tpus_attention(monkeypatch):
    """Regression: "auto" attention was resolved by the process's default backend, so a program compiled for a TPU
    slice on a CPU host got the CPU's chunked attention (a `lax.map` over heads), not the plain attention a TPU VM
    traces. It follows the platform being lowered for."""
    import jax.numpy as jnp

    from sdjax.ops import attention
    from sdjax.parallel.sharding import make_mesh
    from sdjax.pipelines.presets import build_pipeline

    seen = []
    real = attention.resolve
    monkeypatch.setattr(attention, "resolve", lambda impl, t: seen.append((t, real(impl, t))) or seen[-1][1])
    pipe, params = build_pipeline("tiny", jnp.float32, abstract=True)
    gen = pipe.generator
    choices = {}
    for name, devices in (("tpu", aot.topology_devices("v5e-1")[1]), ("cpu", jax.devices()[:1])):
        mesh = make_mesh(1, 1, devices)
        seen.clear()
        gen.lower(gen.spec(batch=1, height=64, width=64, steps=1, mesh=mesh), params=params, mesh=mesh)
        choices[name] = {choice for tokens, choice in seen if tokens > attention.AUTO_CHUNK_ABOVE}
    assert choices == {"tpu": {"xla"}, "cpu": {"chunked"}}


@needs_libtpu
def test_an_attention_choice_reaches_the_tpu_program(monkeypatch):
    """`compile_for(attention="chunked")` (`sdjax compile --attention chunked`) traces the UNet's and VAE's long
    attentions as chunked for the TPU slice, where "auto" traces the plain one; an unknown name is refused first."""
    from sdjax.core.generator import Generator
    from sdjax.ops import attention

    seen = []
    real = attention.resolve
    monkeypatch.setattr(attention, "resolve", lambda impl, t: seen.append((t, real(impl, t))) or seen[-1][1])

    class Stop(Exception):
        pass

    lower = Generator.lower

    def lower_only(self, *args, **kwargs):
        lower(self, *args, **kwargs)  # traced for the slice (attention resolved), then stopped before compiling
        raise Stop

    monkeypatch.setattr(Generator, "lower", lower_only)
    choices = {}
    for name in ("auto", "chunked", "pallas"):
        seen.clear()
        with pytest.raises(Stop):
            aot.compile_for("v5e-1", model="tiny", size=64, batch=1, steps=1, attention=name, unet_cost=False)
        choices[name] = {choice for tokens, choice in seen if tokens > attention.AUTO_CHUNK_ABOVE}
    assert choices == {"auto": {"xla"}, "chunked": {"chunked"}, "pallas": {"pallas"}}
    with pytest.raises(ValueError, match="attention='flash2'"):
        aot.compile_for("v5e-1", model="tiny", attention="flash2")


@needs_libtpu
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_controlnets_are_in_the_program(monkeypatch, quantize):
    """`sdjax compile --controlnets 1` lowers the generation with the net (the model's own ControlNet architecture)
    in every model call: its abstract params beside the UNet's and a control image per image among the inputs.
    Stopped before the TPU compile (the table's ControlNet rows are the compiled ones, docs/benchmarks.md). With
    `--quantize int8` the net's large kernels are int8 (with float32 scales) as the UNet's, the rest bfloat16."""
    from sdjax.core.generator import Generator
    from sdjax.models.controlnet import ControlNetModel
    from sdjax.quant import params as P

    seen = []

    class Stop(Exception):
        pass

    def lower(self, spec, *, params, mesh, **kwargs):
        seen.append((spec, params, self.example_inputs(spec)))
        raise Stop

    monkeypatch.setattr(Generator, "lower", lower)
    r = runner.invoke(
        cli.app,
        ["compile", "--target", "v5e-4", "-m", "tiny", "--size", "32", "--batch", "4", "--steps", "2"]
        + ["--controlnets", "1", "--no-unet-cost", "--in-process"]
        + (["--quantize", quantize] if quantize else []),
    )
    assert isinstance(r.exception, Stop), r.output
    ((spec, params, inputs),) = seen
    (net,) = spec.control.nets
    want = jax.tree_util.tree_map(lambda x: tuple(x.shape), ControlNetModel.init_params_shape(net.config))
    (tree,) = params["controlnet"]
    kernels = P.quantized_kernels(tree)
    assert bool(kernels) == bool(quantize) and bool(P.quantized_kernels(params["unet"])) == bool(quantize)
    for q, scale in kernels.values():
        assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == q.shape[-1:]

    def unscaled(t):  # the tree without the quantized kernels' scales
        return {k: unscaled(v) for k, v in t.items() if k != P.SCALE} if isinstance(t, dict) else t

    assert jax.tree_util.tree_map(lambda x: tuple(x.shape), unscaled(tree)) == want
    in_kernels = {id(q) for q, _ in kernels.values()}
    rest = [x for x in jax.tree_util.tree_leaves(unscaled(tree)) if id(x) not in in_kernels]
    assert rest and all(x.dtype == jnp.bfloat16 for x in rest)
    assert inputs["control_image"].shape == (4, 1, 3, 32, 32)  # one control image per image, at the image size


def test_a_model_calls_cost_includes_its_controlnets(monkeypatch):
    """The loop-corrected FLOPs of `compile_for` count one model call per step: with ControlNets that call runs
    the nets too (each about the UNet's encoder half), so it costs more than the UNet alone and less than the UNet
    once more per net. Built for this machine's CPU by the same function the TPU report uses, and counted by XLA's
    cost analysis of the lowered call (what is in it; the compile that would follow changes no operand)."""
    from sdjax.parallel import sharding
    from sdjax.pipelines.presets import build_pipeline

    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: self)  # `_cost` reads `cost_analysis()`

    arch = aot.architecture("tiny")
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    flops = {}
    for nets in (0, 2):
        pipe, params = build_pipeline(arch, jnp.bfloat16, abstract=True)
        control = None
        if nets:
            control, params["controlnet"] = aot._abstract_controlnets(arch, jnp.bfloat16, nets)
        gen = pipe.generator
        spec = gen.spec(batch=1, height=32, width=32, steps=1, mesh=mesh, control=control)
        flops[nets], _ = aot._cost(aot._compile_unet_call(gen, spec, params, mesh))
    assert flops[0] < flops[2] < 3 * flops[0]


@needs_libtpu
def test_cpu_path_is_unaffected(tiny):
    assert jax.default_backend() == "cpu"
    assert all(d.platform == "cpu" for d in jax.devices())
    y = jax.jit(lambda a: a * 2)(np.arange(3.0))
    assert next(iter(y.devices())).platform == "cpu"
    np.testing.assert_array_equal(np.asarray(y), [0.0, 2.0, 4.0])


@pytest.mark.parametrize("target", ["v7:2x2", "v5e-3", "tpu", "v5e:2x2x1", "v4:2x2"])
def test_unknown_topology_lists_the_valid_names(target):
    with pytest.raises(ValueError, match="unknown TPU topology|dimensions") as e:
        aot.parse_target(target)
    assert target in str(e.value) and "v5e-4" in str(e.value) and "v4:2x2x1" in str(e.value)


def test_cloud_slice_names_map_to_topologies():
    assert aot.parse_target("v5e-8") == ("v5e", (2, 4))
    assert aot.parse_target("v5litepod-4") == ("v5e", (2, 2))
    assert aot.parse_target("v4-8") == ("v4", (2, 2, 1))  # v4 names count TensorCores: 4 chips
    assert aot.parse_target("V6E:2x2") == ("v6e", (2, 2))


@needs_libtpu
def test_topology_libtpu_rejects_is_a_clear_error():
    with pytest.raises(ValueError, match=r"target='v5e:3x3': libtpu rejected"):
        aot.topology_devices("v5e:3x3")


def test_cli_unknown_topology_exits_2_with_the_names():
    r = runner.invoke(cli.app, ["compile", "--target", "v9-4", "-m", "tiny"])
    assert r.exit_code == 2
    assert "unknown TPU topology" in r.stderr and "v5e-4" in r.stderr


def test_without_libtpu_the_error_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(aot.LibtpuMissing, match=r"pip install 'sdjax\[tpu-aot\]'"):
        aot.compile_for("v5e-4", model="tiny")
    r = runner.invoke(cli.app, ["compile", "--target", "v5e-4", "-m", "tiny"])
    assert r.exit_code == 2 and "pip install 'sdjax[tpu-aot]'" in r.stderr


def test_a_diffusers_folder_gives_the_shapes_its_weights_have(sd1_dir):
    from sdjax.pipelines import load_pipeline
    from sdjax.pipelines.presets import build_pipeline

    arch = aot.architecture(str(sd1_dir))
    _, abstract = build_pipeline(arch, jnp.float32, abstract=True)
    _, loaded = load_pipeline(str(sd1_dir))
    for name in ("text_encoder", "unet", "vae"):
        want = jax.tree_util.tree_map(np.shape, loaded[name])
        got = jax.tree_util.tree_map(lambda s: tuple(s.shape), abstract[name])
        assert got == want, name
    n = sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(loaded["unet"]))
    assert n > 0


def test_bad_model_and_settings_are_named():
    with pytest.raises(ValueError, match="model='nope'.*sd15"):
        aot.architecture("nope")
    with pytest.raises(ValueError, match="batch=0"):
        aot.compile_for("v5e-4", model="tiny", batch=0)
    with pytest.raises(ValueError, match="task='upscale'"):
        aot.compile_for("v5e-4", model="tiny", task="upscale")
    with pytest.raises(ValueError, match="dtype='int8'"):
        aot.compile_for("v5e-4", model="tiny", dtype="int8")
    with pytest.raises(ValueError, match="controlnets=9"):
        aot.compile_for("v5e-4", model="tiny", controlnets=9)


@needs_libtpu
@pytest.mark.parametrize(
    "target, devices, chips", [("v5e-1", 1, 1), ("v5e-8", 8, 8), ("v6e-4", 4, 4), ("v4-8", 8, 4), ("v5p-8", 4, 4)]
)
def test_slices_have_their_chips_on_one_host(target, devices, chips):
    name, devs = aot.topology_devices(target)
    assert name == aot.SLICES[target]
    assert len(devs) == devices and len({tuple(d.coords) for d in devs}) == chips
    assert {d.process_index for d in devs} == {0}  # a single-host slice: one process compiles for all of it


def test_out_of_memory_messages_give_required_and_available_bytes():
    a = "RESOURCE_EXHAUSTED: the total memory required for HLO temporaries (17.89G) exceeds available HBM (15.75G)."
    assert aot._oom_bytes(a) == (int(17.89 * 2**30), int(15.75 * 2**30))
    b = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.50G of 15.75G hbm. Exceeded by 4.75G."
    assert aot._oom_bytes(b) == (int(20.5 * 2**30), int(15.75 * 2**30))
    assert aot._oom_bytes("RESOURCE_EXHAUSTED: something else") == (None, None)
