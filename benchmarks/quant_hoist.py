"""Does XLA keep a dequantized copy of the weights alive across the sampling loop? (docs/quantization.md)

The embedded UNet in a 4-step `fori_loop` (bfloat16, a tiny 8x8 latent so that weights dominate the temporaries),
compiled for this machine's backend; XLA's `memory_analysis()` per variant: bfloat16 params; int8 params through
`sdjax.quant.DequantizingModule` (the `optimization_barrier` before the dequantization); int8 params dequantized
in the loop body without the barrier; int8 params dequantized once before the loop (by hand).
Run: `python benchmarks/quant_hoist.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sdjax import quant
from sdjax.pipelines.auto import load_pipeline
from sdjax.quant import params as P


def main():
    pipe, params = load_pipeline(None, dtype="bfloat16")
    unet = pipe.unet
    qp = P.quantize_params({"unet": params["unet"]}, P.QuantPolicy("int8"))["unet"]
    x = jnp.zeros((1, unet.config.in_channels, 8, 8), jnp.bfloat16)
    t = jnp.float32(10.0)
    ctx = jnp.zeros((1, 8, unet.config.cross_attention_dim), jnp.bfloat16)
    wrapped = quant.DequantizingModule(unet, jnp.bfloat16)

    def loop(apply, p, x):
        return jax.lax.fori_loop(0, 4, lambda i, x: x + 0.01 * apply(p, x).astype(x.dtype), x)

    def plain(p, x):
        return unet.apply({"params": p}, x, t, ctx)

    variants = {
        "bfloat16 params": (lambda p, x: loop(plain, p, x), params["unet"]),
        "int8, DequantizingModule (barrier)": (
            lambda p, x: loop(lambda p, x: wrapped.apply({"params": p}, x, t, ctx), p, x),
            qp,
        ),
        "int8, dequantized in the body, no barrier": (
            lambda p, x: loop(lambda p, x: plain(P.dequantize_tree(p, jnp.bfloat16), x), p, x),
            qp,
        ),
        "int8, dequantized before the loop": (lambda p, x: loop(plain, P.dequantize_tree(p, jnp.bfloat16), x), qp),
    }
    for name, (fn, p) in variants.items():
        m = jax.jit(fn).lower(p, x).compile().memory_analysis()
        args, temp = m.argument_size_in_bytes / 2**20, m.temp_size_in_bytes / 2**20
        print(f"{name:45s} arguments {args:6.2f} MiB  temp {temp:6.2f} MiB")


if __name__ == "__main__":
    main()
