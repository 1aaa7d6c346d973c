"""What the 8-bit compute tests share (`test_int8_compute.py`, `test_fp8_compute.py`, `test_conv_compute.py`,
`test_quant_compile.py`): random Dense operands, a three-layer test net with its quantized params and the same net
computed by hand, the embedded model's images with 8-bit compute beside weight-only ones, and a hand count of the
FLOPs of a model's 8-bit layers. The scheme ("int8" or "fp8") is the argument; the tests keep their
checks."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sdjax import quant
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import compute as C
from sdjax.quant import params as P


def as_float64(a) -> np.ndarray:
    """An array of any float dtype (fp8 included) as float64, through float32."""
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def dense_operands(scheme: str):
    """A Dense layer's input `(2, 5, 64)`, kernel `(64, 48)` and bias, float32, and the kernel quantized with
    `scheme` -> `(x, w, b, q, scale)`."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(3.0 * rng.standard_normal((2, 5, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)) / 8, jnp.float32)
    b = jnp.asarray(rng.standard_normal(48), jnp.float32)
    q, scale = quant.scheme.quantize_kernel(w, scheme)
    return x, w, b, q, scale


class ThreeLayerNet(nn.Module):
    """A Dense large enough to be quantized and to compute in 8 bits, a Conv (weight-only) and a small Dense (left
    in float) under `QuantPolicy(min_size=4096)`."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(96, name="big")(x)  # 64 x 96 = 6144 weights: quantized with min_size 4096
        x = nn.Conv(96, (3,), name="conv")(x)  # a 3-D kernel: weight-only
        return nn.Dense(8, name="small")(jax.nn.gelu(x))  # 96 x 8 = 768: below min_size, untouched


def quantized_net(scheme: str):
    """`ThreeLayerNet`, an input `(2, 7, 64)`, its float params and those quantized for `scheme` compute ->
    `(net, x, params, quantized)`."""
    net = ThreeLayerNet()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 64))
    params = net.init(jax.random.PRNGKey(1), x)["params"]
    policy = P.QuantPolicy(scheme, components=("m",), min_size=4096, compute=scheme)
    return net, x, params, P.quantize_tree(params, policy, "m")


def net_by_hand(x, params, quantized, amax=None):
    """`ThreeLayerNet` written out: the big layer's 8-bit product (`amax`: a static input range), then the
    dequantized conv and the float small layer."""
    deq = P.dequantize_tree(quantized, jnp.float32)
    big = quantized["big"]
    h = C.dense_quantized(x, big["kernel"], big["kernel_scale"], params["big"]["bias"], jnp.float32, amax)
    h = nn.Conv(96, (3,)).apply({"params": deq["conv"]}, h)
    return nn.Dense(8).apply({"params": deq["small"]}, jax.nn.gelu(h))


def images_against_weight_only(scheme: str):
    """The embedded model (1 prompt, 6 steps, seed 0) with its UNet quantized to `scheme` and computing in it, and
    with weight-only `scheme` -> `(pipe, images, weight_only_images)`; prints how far apart they are."""
    prompts, kw = ["a red circle on a blue background"], dict(steps=6, seed=0, output_type="np")
    pipe, _ = load_pipeline(None, quantize=P.QuantPolicy(scheme, components=("unet",), compute=scheme))
    ref_pipe, _ = load_pipeline(None, quantize=scheme)
    out, ref = pipe.generate(prompts, **kw), ref_pipe.generate(prompts, **kw)
    err = np.abs(out - ref)
    print(f"{scheme} compute vs weight-only {scheme}: mean abs {err.mean():.4f}, max {err.max():.4f}")
    return pipe, out, ref


# the taps of a conv window that read input, per spatial axis of `o` output pixels, by (kernel, stride): a 3x3 same
# conv 3o - 2 (the first and last output miss one each), a 3x3 stride-2 conv over 2o pixels 3o - 1 (only the first
# misses one), a 1x1 conv o
_TAPS = {(3, 1): lambda o: 3 * o - 2, (3, 2): lambda o: 3 * o - 1, (1, 1): lambda o: o}


def layer_flops_by_hand(module, float_params, args, selected) -> list[float]:
    """FLOPs of each selected layer (`selected`: `compute_kernels` of the module's params, path -> (q, scale)) in one
    call `module.apply({"params": float_params}, *args)` (abstract arrays are fine), from the shapes an interceptor
    sees: a Dense layer 2 * tokens * in * out, a conv 2 * batch * in * out * the taps that read input per axis (`_TAPS`;
    the upsamplers' conv: of the 2x input)."""
    out_flops = []

    def count(next_fun, call_args, kwargs, context):
        m, out = context.module, next_fun(*call_args, **kwargs)
        kernel, _ = selected.get("/".join(m.path) + "/kernel", (None, None))
        if context.method_name == "__call__" and kernel is not None:
            (x,) = call_args
            if len(kernel.shape) == 2:
                out_flops.append(2.0 * np.prod(x.shape[:-1]) * x.shape[-1] * m.features)
            else:
                n, ho, wo = out.shape[:3]
                kh, _, cin, cout = kernel.shape
                per_axis = _TAPS[(kh, m.strides[0])]
                out_flops.append(2.0 * n * cin * cout * per_axis(ho) * per_axis(wo))
        return out

    with nn.intercept_methods(count):
        jax.eval_shape(lambda p, *a: module.apply({"params": p}, *a), float_params, *args)
    return out_flops
