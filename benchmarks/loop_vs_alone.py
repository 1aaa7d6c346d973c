"""Does a UNet call cost the same inside the generation's denoising loop as compiled alone? (docs/benchmarks.md)

`sdjax bench` times one UNet step compiled alone and the whole generation; their difference mixes the loop's
cost with the text encoders, the sampler and the VAE. This script isolates the loop: it compiles the whole
generation at two step counts and takes the difference, which is (extra model calls) x (one in-loop call plus the
sampler's update), and times the UNet alone in the same rounds (calls interleaved, so load on the machine slows
all three alike).

    python benchmarks/loop_vs_alone.py --arch sd15 --size 512 --steps 2 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sd15")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, nargs=2, default=[2, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sampler", default=None)
    ap.add_argument("--json")
    args = ap.parse_args()

    from sdjax import runtime

    runtime.configure_cpu()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdjax import samplers
    from sdjax.ops import conv as ops_conv
    from sdjax.pipelines.presets import build_pipeline

    pipe, params = build_pipeline(args.arch, jnp.float32)
    pipe.devices = jax.devices()[:1]
    gen = pipe.generator
    cond = gen.models.conditioning
    size = args.size
    host = {
        "ids": cond.tokenize(["a photograph of an astronaut riding a horse"]),
        "neg_ids": cond.tokenize([""]),
        **cond.host_inputs(negative_prompts=[None], height=size, width=size, task="txt2img"),
    }
    extra = {k: v for k, v in host.items() if k not in ("ids", "neg_ids")}
    keys = np.zeros((1, 2), np.uint32)
    guidance = np.full((1,), 7.5, np.float32)

    runs = {}
    for steps in args.steps:
        fn = pipe.aot_compile(batch_size=1, height=size, width=size, steps=steps, sampler=args.sampler, params=params)
        sampler = gen.sampler if args.sampler is None else samplers.get_sampler(args.sampler)
        runs[steps] = (fn, int(sampler.num_model_calls(steps)))

    unet_params = jax.jit(ops_conv.prepare)(params["unet"])
    inputs = {k: jnp.asarray(v) for k, v in host.items()}
    context, added = jax.jit(lambda p, i: cond.encode(p, i, cfg=True))(params, inputs)
    f = pipe.vae_scale_factor
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, size // f, size // f)), jnp.float32)
    t = jnp.full((2,), 500.0, jnp.float32)
    unet = (
        jax.jit(lambda p, x, t, c, a: pipe.unet.apply({"params": p}, x, t, c, **a))
        .lower(unet_params, x, t, context, added)
        .compile()
    )

    def timed(fn):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t0

    calls = {
        "unet alone": lambda: unet(unet_params, x, t, context, added),
        **{
            f"generation {s} steps": (lambda fn=fn: fn(host["ids"], host["neg_ids"], keys, guidance, extra))
            for s, (fn, _) in runs.items()
        },
    }
    for fn in calls.values():  # warm
        timed(fn)
    times = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, fn in calls.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    (s0, (_, c0)), (s1, (_, c1)) = sorted(runs.items())
    in_loop = (med[f"generation {s1} steps"] - med[f"generation {s0} steps"]) / (c1 - c0)
    out = {
        "arch": args.arch,
        "size": size,
        "medians_s": med,
        "model_calls": {s: c for s, (_, c) in runs.items()},
        "in_loop_call_s": in_loop,
        "alone_call_s": med["unet alone"],
        "in_loop_over_alone": in_loop / med["unet alone"],
        "rest_of_generation_s": med[f"generation {s0} steps"] - c0 * in_loop,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
