"""Quantizing while loading (`sdjax.quant.loading`, issue 37): `from_pretrained(quantize=)` and
`FluxPipeline.from_single_file(quantize=)` quantize each selected kernel as it is converted.

- The params are bit for bit those of the old way, a full-precision load followed by `quantize_pipeline` (the same
  int8 / float8 values, the same scales, every other leaf the same), for "int8", "fp8" and a policy with its own
  components, threshold and exclusions.
- The float copy of a quantized kernel is not kept: `scheme.quantize_kernel` is instrumented to hold a weak
  reference to every float kernel it is given; at each call, the kernels of earlier calls still alive are counted.
  Loading with `quantize=` never has more alive than the threads casting (`models.convert.CAST_WORKERS`, each
  quantizing the kernel it converted); the old way has every one of them
  (the whole float tree exists when `quantize_tree` runs), which the same probe shows.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
from bit_identical import assert_bit_identical

from sdjax import quant
from sdjax.models import convert
from sdjax.quant import params as P
from sdjax.quant import scheme as scheme_lib

pytest.importorskip("torch")
pytest.importorskip("diffusers")


class AliveProbe:
    """Wraps `scheme.quantize_kernel`: `max_alive` is the most float kernels given to it that were alive at once
    (the current one included), `calls` how often it ran, `float_bytes` the largest float bytes alive at once."""

    def __init__(self, monkeypatch):
        self.refs: list[tuple[weakref.ref, int]] = []
        self.calls = 0
        self.max_alive = 0
        self.float_bytes = 0
        inner = scheme_lib.quantize_kernel

        def probe(kernel, scheme):
            self.calls += 1
            self.refs.append((weakref.ref(kernel), kernel.nbytes))
            alive = [n for r, n in self.refs if r() is not None]
            self.max_alive = max(self.max_alive, len(alive))
            self.float_bytes = max(self.float_bytes, sum(alive))
            return inner(kernel, scheme)

        monkeypatch.setattr(scheme_lib, "quantize_kernel", probe)


def _sd(folder, **kw):
    from sdjax.pipelines.stable_diffusion import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(str(folder), **kw)


@pytest.fixture(scope="module")
def sd_old(sd1_dir):
    """scheme or policy -> (pipe, params) the old way: load in full precision, then `quantize_pipeline`."""
    cache = {}

    def get(quantize):
        if quantize not in cache:
            cache[quantize] = quant.quantize_pipeline(*_sd(sd1_dir), quantize)
        return cache[quantize]

    return get


POLICY = quant.QuantPolicy(
    "int8", components=("unet", "text_encoder"), min_size=256, exclude=(r".*/attn1/to_q/kernel", r"unet/conv_in/.*")
)


@pytest.mark.parametrize("quantize", ["int8", "fp8", POLICY], ids=["int8", "fp8", "policy"])
def test_from_pretrained_quantize_equals_quantize_after_loading(sd1_dir, sd_old, quantize):
    pipe, params = _sd(sd1_dir, quantize=quantize)
    old_pipe, old_params = sd_old(quantize)
    assert_bit_identical(params, old_params, skip=())
    assert pipe.quantization == old_pipe.quantization
    policy = pipe.quantization
    for component in policy.components:
        kernels = P.quantized_kernels(params[component])
        assert kernels, component  # something was quantized, so the comparison means something
        for path, (q, scale) in kernels.items():
            assert q.dtype == quant.SCHEMES[policy.scheme] and scale.shape == q.shape[-1:], path
    assert set(policy.components) == {c for c in params if P.has_quantized(params[c])}
    assert type(pipe.denoiser.unet).__name__ == "DequantizingModule"
    if quantize is POLICY:  # the exclusions and the threshold held while loading
        flat = P.quantized_kernels(params["unet"])
        assert not any(k.endswith("attn1/to_q/kernel") for k in flat) and "conv_in/kernel" not in flat
        assert any(k.endswith("attn2/to_q/kernel") for k in flat)


def test_quantize_while_loading_keeps_one_float_kernel_alive(sd1_dir, monkeypatch):
    probe = AliveProbe(monkeypatch)
    _, params = _sd(sd1_dir, quantize="int8")
    n = len(P.quantized_kernels(params["unet"]))
    assert probe.calls == n > 1  # every quantized kernel went through the per-tensor hook, none after loading
    # one float kernel per cast thread at most (`convert.CAST_WORKERS` cast while the next tensors are read)
    assert 1 <= probe.max_alive <= convert.CAST_WORKERS
    largest = max(int(np.prod(q.shape)) * 4 for q, _ in P.quantized_kernels(params["unet"]).values())
    assert largest <= probe.float_bytes <= convert.CAST_WORKERS * largest  # float32 load


def test_the_probe_sees_the_old_way_hold_every_float_kernel(sd1_dir, monkeypatch):
    pipe, params = _sd(sd1_dir)
    probe = AliveProbe(monkeypatch)
    _, qparams = quant.quantize_pipeline(pipe, params, "int8")
    n = len(P.quantized_kernels(qparams["unet"]))
    assert probe.calls == n and probe.max_alive == n > 1


def test_load_pipeline_components_takes_a_policy_only(sd1_dir):
    from sdjax.loading.components import load_pipeline_components

    with pytest.raises(TypeError, match="QuantPolicy"):
        load_pipeline_components(str(sd1_dir), quantize="int8")


@pytest.fixture(scope="module")
def flux_file(tmp_path_factory):
    """A tiny Flux folder (tests/flux_reference.py) and its transformer's weights as one file (diffusers names)."""
    import flux_reference
    import t5_reference

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    folder = tmp_path_factory.mktemp("tiny-flux-dev")
    flux_reference.flux_pipeline("dev", seed=0, tokenizer_dir=tok).save_pretrained(folder, safe_serialization=True)
    return folder, folder / "transformer" / "diffusion_pytorch_model.safetensors"


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_flux_single_file_quantize_equals_quantize_after_loading(flux_file, scheme, monkeypatch):
    from sdjax.families.flux.pipeline import FluxPipeline

    folder, path = flux_file
    policy = quant.QuantPolicy(scheme, components=("transformer",), min_size=512)  # the tiny model's kernels
    loaded = FluxPipeline.from_single_file(str(path), config=str(folder))
    old_pipe, old_params = quant.quantize_pipeline(*loaded, policy)
    probe = AliveProbe(monkeypatch)
    pipe, params = FluxPipeline.from_single_file(str(path), config=str(folder), quantize=policy)
    n = len(P.quantized_kernels(params["transformer"]))
    assert probe.calls == n > 1 and 1 <= probe.max_alive <= convert.CAST_WORKERS  # one per cast thread at most
    assert_bit_identical(params, old_params, skip=())
    assert pipe.quantization == old_pipe.quantization == policy
