"""The generator's contracts: the params given are the params used, the sampler assigned is the sampler run, the
compile cache is bounded and frees what it evicts, and a run can be stopped between two steps."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import StableDiffusionPipeline, replicate, samplers
from sdjax.core import Cancelled, ProgramCache


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))


def _scaled(tree, factor):
    return jax.tree_util.tree_map(lambda x: x * factor, tree)


def test_params_edited_in_place_are_the_params_used(sd):
    """Regression: placed params were cached by `id(params)`, so a dict edited in place (or a new dict that reused
    the id) kept generating with the old weights."""
    pipe, params = sd
    p = dict(params)
    first = pipe.generate("a cat", steps=2, params=p, output_type="np")
    p["unet"] = _scaled(params["unet"], 1.05)  # the same dict object, new weights
    edited = pipe.generate("a cat", steps=2, params=p, output_type="np")
    fresh = pipe.generate("a cat", steps=2, params=dict(p), output_type="np")
    np.testing.assert_array_equal(edited, fresh)
    assert np.abs(edited - first).max() > 1e-2


def test_params_in_another_dtype_get_their_own_program(sd1_dir):
    """Regression: the program cache was keyed by shapes and mesh only, so `params=` in bfloat16 after a float32
    call reused the float32 program and failed ("input pytree does not match"). Each dtype gets its program, and
    the bfloat16 image is the one a fresh pipeline makes from those params."""
    pipe, params = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    half = jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
    )
    kw = dict(steps=2, height=64, width=64, output_type="np")
    full = pipe.generate("a cat", params=params, **kw)
    got = pipe.generate("a cat", params=half, **kw)
    fresh, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    np.testing.assert_array_equal(got, fresh.generate("a cat", params=half, **kw))
    assert 0 < np.abs(got - full).max() < 0.05  # bfloat16 rounding, not another image
    np.testing.assert_array_equal(pipe.generate("a cat", params=params, **kw), full)  # the float32 one still serves


def test_assigning_params_on_the_pipeline_is_used(sd):
    pipe, params = sd
    saved = pipe.params
    try:
        before = pipe.generate("a dog", steps=2, output_type="np")
        pipe.params = {**params, "vae": _scaled(params["vae"], 0.9)}
        after = pipe.generate("a dog", steps=2, output_type="np")
    finally:
        pipe.params = saved
    assert np.abs(after - before).max() > 1e-2


def test_set_attention_changes_what_the_programs_trace(monkeypatch):
    """`Generator.set_attention` (used by `sdjax bench --attention` and `sdjax compile --attention`): the generation
    program traces the chosen attention, and the programs compiled before are dropped. Regression: `sdjax bench
    --attention` replaced only the pipeline's UNet and VAE, so its end-to-end runs kept the generator's "auto"."""
    import jax.numpy as jnp

    from sdjax.ops import attention
    from sdjax.parallel.sharding import make_mesh
    from sdjax.pipelines.presets import build_pipeline

    seen = []
    real = attention.resolve
    monkeypatch.setattr(attention, "resolve", lambda impl, t: seen.append((t, real(impl, t))) or seen[-1][1])
    pipe, params = build_pipeline("tiny", jnp.float32, abstract=True)
    gen = pipe.generator
    mesh = make_mesh(1, 1, jax.devices()[:1])
    gen.cache.get("old program", lambda: None)
    choices = []
    for name in (None, "xla"):
        if name is not None:
            gen.set_attention(name)
        seen.clear()
        gen.lower(gen.spec(batch=1, height=64, width=64, steps=1, mesh=mesh), params=params, mesh=mesh)
        choices.append({choice for tokens, choice in seen if tokens > attention.AUTO_CHUNK_ABOVE})
    assert choices == [{"chunked"}, {"xla"}]  # CPU's "auto" chunks the long attentions; "xla" is set
    assert len(gen.cache) == 0
    with pytest.raises(ValueError, match="attention='flash2'"):
        gen.set_attention("flash2")
    from sdjax import bench

    benched, _ = bench._load(bench.BenchConfig(arch="tiny", attention="xla", memory_only=True), jnp.float32)
    assert benched.unet.attention == benched.generator.models.denoiser.unet.attention == "xla"
    assert benched.generator.models.vae.attention == "xla"


def test_assigning_the_scheduler_after_a_call_takes_effect(sd1_dir):
    """Regression: the guide's jit=True call kept the first sampler, and the next generate() failed with
    `DDIM.set_timesteps: expected a DDIMState ..., got PNDMState`."""
    pipe, params = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    ddim_pipe, ddim_params = StableDiffusionPipeline.from_pretrained(str(sd1_dir), scheduler="ddim")
    ndev = jax.local_device_count()
    ids = pipe.prepare_inputs(["a cat"] * ndev).reshape(ndev, 1, 77)
    keys = jax.random.split(jax.random.PRNGKey(0), ndev)
    p_params = replicate(params)
    pndm = pipe(ids, p_params, keys, num_inference_steps=3, jit=True).images
    pipe.scheduler = samplers.get_sampler("DDIM", base_config=pipe.scheduler)
    ddim = pipe(ids, p_params, keys, num_inference_steps=3, jit=True).images
    expected = ddim_pipe(ids, replicate(ddim_params), keys, num_inference_steps=3, jit=True).images
    np.testing.assert_allclose(ddim, expected, atol=1e-6)
    assert np.abs(ddim - pndm).max() > 1e-3
    # The high-level path runs the assigned sampler too (it used to fail on the cached PNDM state).
    out = pipe.generate("a cat", steps=3, seed=0, output_type="np")
    ref = ddim_pipe.generate("a cat", steps=3, seed=0, output_type="np")
    np.testing.assert_allclose(out, ref, atol=1e-6)


def test_cache_is_bounded_and_evicted_executables_are_freed():
    cache = ProgramCache(max_entries=2)

    class Executable:  # stands in for a jax Compiled object
        def memory_analysis(self):
            return None

    refs = []

    def build():
        exe = Executable()
        refs.append(weakref.ref(exe))
        return exe

    for key in ("a", "b", "a", "c"):
        cache.get(key, build)
    assert cache.keys() == ["a", "c"]  # "b" was least recently used
    assert (cache.stats.compiles, cache.stats.hits, cache.stats.evictions) == (3, 1, 1)
    gc.collect()
    assert refs[1]() is None and refs[0]() is not None


def test_the_byte_budget_counts_a_shared_decode_once():
    """Program pairs of one image shape share their decode executable: the budget counts its code once, so a
    second pair costs only its own loop program."""

    class Executable:
        def __init__(self, size):
            self.size = size

        def memory_analysis(self):
            return type("Analysis", (), {"generated_code_size_in_bytes": self.size})()

    decode = Executable(1000)
    cache = ProgramCache(max_entries=8, max_bytes=1250)
    cache.get("steps=20", lambda: (Executable(100), decode))
    cache.get("steps=30", lambda: (Executable(100), decode))
    assert cache.nbytes == 1200 and len(cache) == 2  # 100 + 100 + the decode once (counted per pair: 2200)
    cache.get("other size", lambda: (Executable(100), Executable(1000)))
    assert cache.keys() == ["other size"] and cache.nbytes == 1100  # over budget: the oldest pairs went


@pytest.mark.all_devices  # on all eight devices no other pipeline of the suite shares its executables
def test_pipeline_cache_evicts_compiled_programs(sd):
    """On the module's pipeline: a 2-step program, then a 3-step one evicts it; freed with the cache."""
    pipe, _ = sd
    cache = pipe.generator.cache
    saved = cache.max_entries
    try:
        cache.max_entries = 1
        pipe.generate("a", steps=2)
        assert len(cache) == 1  # the 2-step program, the only one cached so far
        main, decode = next(iter(cache._entries.values()))[0]  # the loop's program and the VAE decode
        refs = [weakref.ref(main), weakref.ref(decode)]
        del main, decode
        evictions = cache.stats.evictions
        pipe.generate("a", steps=3)  # another program: the first is evicted
        assert len(cache) == 1 and cache.stats.evictions == evictions + 1
        gc.collect()
        assert refs[0]() is None  # the 2-step loop's executable is freed ...
        assert refs[1]() is next(iter(cache._entries.values()))[0][1]  # ... its decode serves the 3-step program
        cache.clear()
        gc.collect()
        assert refs[1]() is None  # freed with the last program that used it
    finally:
        cache.max_entries = saved


def test_the_split_decode_gives_the_one_programs_images(sd):
    """`Generator.run` decodes with a second executable (`split_decode`; the test above checks that programs of one
    image shape share it): the images equal those of the program that holds the decode."""
    pipe, _ = sd
    gen = pipe.generator
    split = pipe.generate("a", steps=2, output_type="np")
    gen.split_decode = False
    try:
        whole = pipe.generate("a", steps=2, output_type="np")
    finally:
        gen.split_decode = True
    np.testing.assert_allclose(split, whole, atol=2e-6)


def test_should_stop_cancels_between_steps(sd):
    pipe, _ = sd
    seen = []

    def progress(stage, step, total):
        seen.append((stage, step, total))

    with pytest.raises(Cancelled):
        pipe.generate_arrays(
            ["a"],
            [""],
            [0],
            [0],
            [7.5],
            steps=6,
            height=64,
            width=64,
            progress=progress,
            should_stop=lambda: len([s for s in seen if s[1] > 0]) >= 2,
        )
    steps = [s for stage, s, _ in seen if stage == "denoise" and s > 0]
    assert max(steps) == 2, seen  # stopped right after the second model call
    # A run that is not stopped reports every step and finishes.
    seen.clear()
    out = pipe.generate_arrays(
        ["a"], [""], [0], [0], [7.5], steps=6, height=64, width=64, progress=progress, should_stop=lambda: False
    )
    assert out.shape == (1, 64, 64, 3)
    assert sorted({s for stage, s, _ in seen if stage == "denoise"}) == list(range(0, 8))  # PNDM: 7 model calls


@pytest.mark.all_devices  # the split batch and the 8-device deadlock are what is tested (not the suite's 1 device)
@pytest.mark.parametrize("size, guidance", [(64, 7.5), (256, 1.0)])
def test_progress_with_latents_gets_each_steps_latents_on_the_mesh(sd, size, guidance):
    """A progress callback that takes `latents` gets the current latents every step (all 8 simulated devices: the
    batch is split, the callback sees the whole batch). At 256 px the latents are 128 KiB, above the size jax copies
    to the host asynchronously: handed over whole, that copy deadlocked the 8-device program (XLA aborted the
    process after 40 s; core/loop.py hands them over in pieces). The latents handed over are the same with or
    without classifier-free guidance, so the 256 px run skips it (guidance 1: half the UNet's work)."""
    pipe, _ = sd
    seen = []

    def progress(stage, step, total, latents=None):
        if latents is not None:
            seen.append((step, np.array(latents)))

    final = pipe.generate_arrays(
        [f"p{i}" for i in range(8)],
        [""] * 8,
        [1] * 8,
        list(range(8)),
        [guidance] * 8,
        steps=3,
        height=size,
        width=size,
        progress=progress,
        output="latents",
    )
    assert [s for s, _ in seen] == [1, 2, 3, 4]  # PNDM: steps + 1 model calls
    assert all(z.shape == (8, 4, size // 8, size // 8) for _, z in seen)
    np.testing.assert_allclose(seen[-1][1], final, atol=1e-6)
    assert np.abs(seen[0][1] - seen[1][1]).max() > 1e-3
    assert len(pipe.latent_rgb_factors) == pipe.vae.config.latent_channels
