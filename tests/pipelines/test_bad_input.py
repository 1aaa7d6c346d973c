"""Bad input raises a clear error naming the problem, before anything compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import StableDiffusionPipeline, StableDiffusionXLPipeline, replicate, shard


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))


@pytest.fixture(scope="module")
def sdxl(sdxl_dir):
    return StableDiffusionXLPipeline.from_pretrained(str(sdxl_dir))


@pytest.fixture(autouse=True)
def no_compile(monkeypatch):
    """Fail the test if the generation program reaches XLA compilation (small eager ops may compile)."""
    import jax._src.compiler as compiler

    original = compiler.compile_or_get_cached

    def guarded(backend, computation, *args, **kwargs):
        name = str(computation.operation.attributes["sym_name"]).strip('"')
        if "generate" in name or "sample" in name:
            raise AssertionError(f"compilation of {name} started before the input was rejected")
        return original(backend, computation, *args, **kwargs)

    monkeypatch.setattr(compiler, "compile_or_get_cached", guarded)


def test_height_not_multiple_of_8(sd):
    pipe, params = sd
    with pytest.raises(ValueError, match="height=60"):
        pipe(pipe.prepare_inputs("a"), params, jax.random.PRNGKey(0), height=60, width=64)
    with pytest.raises(ValueError, match="width=100"):
        pipe.generate("a", width=100)


def test_size_not_multiple_of_unet_factor(sd):
    pipe, params = sd
    with pytest.raises(ValueError, match="height=72 must be a multiple of 16"):
        pipe(pipe.prepare_inputs("a"), params, jax.random.PRNGKey(0), height=72, width=64)


def test_prompt_count_not_divisible_by_devices(sd):
    pipe, params = sd
    with pytest.raises(ValueError, match="not divisible by the 8 devices"):
        shard(pipe.prepare_inputs(["a"] * 5))
    ids = pipe.prepare_inputs(["a"] * 4).reshape(4, 1, 77)
    with pytest.raises(ValueError, match="prompt count must be divisible by 8"):
        pipe(ids, replicate(params), jax.random.split(jax.random.PRNGKey(0), 4), jit=True)


def test_guidance_of_wrong_shape(sd):
    pipe, params = sd
    ids = shard(pipe.prepare_inputs(["a"] * 8))
    with pytest.raises(ValueError, match="guidance_scale has shape \\(3,\\)"):
        pipe(ids, replicate(params), jax.random.split(jax.random.PRNGKey(0), 8), guidance_scale=jnp.ones(3), jit=True)
    with pytest.raises(ValueError, match="guidance_scale has shape \\(2, 2\\)"):
        pipe(pipe.prepare_inputs(["a"]), params, jax.random.PRNGKey(0), guidance_scale=np.ones((2, 2)))


def test_negative_prompts_of_different_count(sd):
    pipe, params = sd
    with pytest.raises(ValueError, match="neg_prompt_ids has shape \\(1, 77\\) but prompt_ids has shape \\(2, 77\\)"):
        pipe(pipe.prepare_inputs(["a", "b"]), params, jax.random.PRNGKey(0), neg_prompt_ids=pipe.prepare_inputs(["c"]))
    with pytest.raises(ValueError, match="negative_prompt: got 3 for 2 prompts"):
        pipe.generate(["a", "b"], negative_prompt=["x", "y", "z"])


def test_unknown_sampler(sd, sd1_dir):
    pipe, _ = sd
    with pytest.raises(ValueError, match="no_such_sampler"):
        pipe.generate("a", sampler="no_such_sampler")
    with pytest.raises(ValueError, match="no_such_sampler"):
        StableDiffusionPipeline.from_pretrained(str(sd1_dir), scheduler="no_such_sampler")


def test_unsharded_ids_with_jit(sd):
    pipe, params = sd
    with pytest.raises(ValueError, match="with jit=True"):
        pipe(pipe.prepare_inputs(["a"] * 8), replicate(params), jax.random.split(jax.random.PRNGKey(0), 8), jit=True)
    with pytest.raises(ValueError, match="replicate\\(params\\)"):
        pipe(shard(pipe.prepare_inputs(["a"] * 8)), params, jax.random.split(jax.random.PRNGKey(0), 8), jit=True)


def test_steps_and_types(sd):
    pipe, params = sd
    with pytest.raises(ValueError, match="num_inference_steps=0"):
        pipe(pipe.prepare_inputs("a"), params, jax.random.PRNGKey(0), num_inference_steps=0)
    with pytest.raises(TypeError, match="num_inference_steps must be an int"):
        pipe(pipe.prepare_inputs("a"), params, jax.random.PRNGKey(0), num_inference_steps=2.5)
    with pytest.raises(ValueError, match="num_images"):
        pipe.generate("a", num_images=0)


def test_sdxl_ids_of_sd_shape(sdxl):
    pipe, params = sdxl
    sd_ids = pipe.prepare_inputs(["a"])[:, 0]  # (1, 77), as an SD pipeline would make
    with pytest.raises(ValueError, match="expects \\(N, 2, 77\\)"):
        pipe(sd_ids, params, jax.random.PRNGKey(0))


def test_sdxl_bad_size_guidance_and_negatives(sdxl):
    pipe, params = sdxl
    ids = pipe.prepare_inputs(["a", "b"])
    with pytest.raises(ValueError, match="width=36"):
        pipe(ids, params, jax.random.PRNGKey(0), width=36)
    p_ids = shard(pipe.prepare_inputs(["a"] * 8))
    with pytest.raises(ValueError, match="guidance_scale has shape \\(4, 1\\)"):
        pipe(
            p_ids,
            replicate(params),
            jax.random.split(jax.random.PRNGKey(0), 8),
            guidance_scale=np.ones((4, 1)),
            jit=True,
        )
    with pytest.raises(ValueError, match="neg_prompt_ids has shape"):
        pipe(ids, params, jax.random.PRNGKey(0), neg_prompt_ids=pipe.prepare_inputs(["c"]))
