"""`core.cache.compile_shared`: two pipelines of one model in a process run one executable per program (the second
compiles nothing), on the same devices only, and the shared executables are freed with the last pipeline. (The key
also holds JAX's settings, as `finetune.loop._compiled_once` does for train steps.)"""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from sdjax.core import cache as cache_lib
from sdjax.core.generator import Cancelled
from sdjax.pipelines import StableDiffusionPipeline


def _executables(pipe) -> set[int]:
    return {id(exe) for _, parts in pipe.generator.cache._entries.values() for exe, _ in parts}


def _image(pipe) -> np.ndarray:
    return np.asarray(pipe.generate("a cat", steps=2, seed=0, width=32, height=32, output_type="np"))


def test_a_second_pipeline_of_the_model_runs_the_first_ones_executables(sd1_dir):
    first, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    second, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    other, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    first.devices = second.devices = jax.devices()[:1]
    other.devices = jax.devices()[1:2]  # the same program text on another device: its own executable
    images = [_image(p) for p in (first, second, other)]
    assert _executables(first) and _executables(second) == _executables(first)
    assert not _executables(other) & _executables(first)
    np.testing.assert_array_equal(images[1], images[0])
    np.testing.assert_array_equal(images[2], images[0])
    held = _executables(first) | _executables(other)
    del first, second, other, images
    gc.collect()
    assert not held & {id(exe) for exe in cache_lib._SHARED.values()}  # the weak table kept nothing alive


def test_programs_that_call_back_into_python_are_not_shared():
    """A host callback is named in the program text only by its index, so two lowerings calling different Python
    functions print the same text: each keeps its own executable (found by CI: a server's progress went to an
    earlier pipeline of the same model, and its stream never saw a step)."""
    from jax.experimental import io_callback

    calls = []

    def lowered(tag):
        def report(x):
            calls.append(tag)
            return np.float32(x)

        fn = jax.jit(lambda x: io_callback(report, jax.ShapeDtypeStruct((), np.float32), x) + 1)
        return fn.lower(np.float32(1))

    a, b = lowered("a"), lowered("b")
    assert a.as_text() == b.as_text()
    devices = (jax.devices()[0].id,)
    held = [cache_lib.compile_shared(low, devices) for low in (a, b)]  # both alive, as two pipelines hold theirs
    for tag, exe in zip("ab", held):
        assert float(exe(np.float32(2))) == 3.0
        assert calls[-1] == tag


def test_two_pipelines_of_the_model_report_progress_to_their_own_callbacks(sd1_dir):
    first, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    second, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    first.devices = second.devices = jax.devices()[:1]
    seen = {"first": [], "second": []}
    for name, pipe in (("first", first), ("second", second)):
        progress = lambda stage, step, total, name=name: seen[name].append((stage, step))
        pipe.generate("a cat", steps=2, seed=0, width=32, height=32, output_type="np", progress=progress)
    assert seen["first"] == seen["second"] and ("denoise", 2) in seen["second"], seen
    # ... from one executable: its step callback is the process-wide dispatcher, which finds the run by its id
    assert _executables(first) and _executables(second) == _executables(first)
    stops = []
    should_stop = lambda: stops.append(1) or True  # the second pipeline's stop reaches the shared executable
    with pytest.raises(Cancelled):
        second.generate("a cat", steps=2, seed=0, width=32, height=32, output_type="np", should_stop=should_stop)
    assert stops == [1]


def test_callback_sites_counts_only_callbacks_it_accepts():
    """`callback_sites` walks the traced program (here a while loop's body) and names how many callbacks call the
    accepted function; one other callback anywhere makes the program unshareable (None)."""
    from jax.experimental import io_callback

    def ours(x):
        return np.float32(x)

    def theirs(x):
        return np.float32(x)

    accept = lambda f: f is ours

    def program(*callbacks):
        def f(x):
            def body(c):
                i, x = c
                for cb in callbacks:
                    x = io_callback(cb, jax.ShapeDtypeStruct((), np.float32), x)
                return i + 1, x

            return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]

        return jax.jit(f).trace(np.float32(1))

    assert cache_lib.callback_sites(program().jaxpr, accept) == 0
    assert cache_lib.callback_sites(program(ours, ours).jaxpr, accept) == 2
    assert cache_lib.callback_sites(program(ours, theirs).jaxpr, accept) is None
    traced = program(ours)
    assert cache_lib.host_callback_count(traced.lower()) == 1 == cache_lib.callback_sites(traced.jaxpr, accept)


def test_callbacks_the_caller_vouches_for_are_shared_and_others_are_not():
    from jax.experimental import io_callback

    calls = []

    def shared(x):  # one process-wide function: any lowering may run any executable calling it
        calls.append("shared")
        return np.float32(x)

    def lowered(*callbacks):
        def f(x):
            for cb in callbacks:
                x = io_callback(cb, jax.ShapeDtypeStruct((), np.float32), x)
            return x + 1

        return jax.jit(f).lower(np.float32(1))

    devices = (jax.devices()[0].id,)
    a = cache_lib.compile_shared(lowered(shared), devices, shared_callbacks=1)
    b = cache_lib.compile_shared(lowered(shared), devices, shared_callbacks=1)
    assert a is b and float(b(np.float32(2))) == 3.0 and calls == ["shared"]
    # two callbacks registered, one vouched for: not shared
    c = cache_lib.compile_shared(lowered(shared, shared), devices, shared_callbacks=1)
    d = cache_lib.compile_shared(lowered(shared, shared), devices, shared_callbacks=1)
    assert c is not d
