"""Does a UNet call cost the same inside the generation's denoising loop as compiled alone? (docs/benchmarks.md)

`sdjax bench` times one UNet step compiled alone and the whole generation; their difference mixes the loop's
cost with the text encoders, the sampler and the VAE. This script isolates the loop with ONE compiled generation
(Euler, `--steps` steps): it runs it over the whole schedule and over its first half (`denoising_end=0.5`, the
same executable: the window is a traced input), so the difference is (half the steps) x (one in-loop model call
plus Euler's update); what is left of the whole run (text encoders, VAE decode, the host's work) is set beside
the text encoders and the VAE decoder compiled alone. A third run of the whole schedule returns latents
(`output="latents"`: the same loop without the decode, its own executable), which splits that rest into the decode
as the generation runs it (whole - latents) and everything else (text encoders, noise, host work). The pieces
compiled alone are timed in the same rounds (calls interleaved, so load on the machine slows all of them alike).
`Generator.run` decodes with a second executable (`split_decode`); a fourth run of the whole schedule compiles the
decode into the generation's program instead (`split_decode=False`), the way every run went before 2026-11-26.

    python benchmarks/loop_vs_alone.py --arch sd15 --size 512 --steps 4 --rounds 2
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
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="weights and compute (float32, bfloat16, float16)")
    ap.add_argument("--json")
    ap.add_argument(
        "--split-only",
        action="store_true",
        help="time only the whole generation, split (default) against one program, alternating for --rounds",
    )
    args = ap.parse_args()

    from sdjax import runtime

    runtime.configure_cpu()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdjax import samplers
    from sdjax.core import autoencoder
    from sdjax.core.tasks.base import TaskRequest
    from sdjax.core.tasks.txt2img import Txt2Img
    from sdjax.ops import conv as ops_conv
    from sdjax.pipelines.presets import build_pipeline

    pipe, params = build_pipeline(args.arch, jnp.dtype(args.dtype))
    pipe.devices = jax.devices()[:1]
    gen = pipe.generator
    cond = gen.models.conditioning
    size = args.size
    host = {
        "ids": cond.tokenize(["a photograph of an astronaut riding a horse"]),
        "neg_ids": cond.tokenize([""]),
        **cond.host_inputs(negative_prompts=[None], height=size, width=size, task="txt2img"),
    }
    sampler = samplers.get_sampler("euler", base_config=dict(pipe.scheduler.config))
    base = dict(
        prompts=["a photograph of an astronaut riding a horse"],
        negative_prompts=[""],
        keys=np.zeros((1, 2), np.uint32),
        guidance_scales=[7.5],
        steps=args.steps,
        height=size,
        width=size,
        sampler=sampler,
        params=params,
    )
    tasks = {"whole": TaskRequest(Txt2Img()), "first half": TaskRequest(Txt2Img(), denoising_end=0.5)}
    spec = gen.spec(batch=1, height=size, width=size, steps=args.steps, sampler=sampler)
    calls_in = {k: (lambda w: w[1] - w[0])(gen.window(spec, t)) for k, t in tasks.items()}

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

    z = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, size // f, size // f)), jnp.float32)
    decode = jax.jit(lambda p, z: autoencoder.decode(pipe.vae, p["vae"], z, pipe.dtype)).lower(params, z).compile()
    text = jax.jit(lambda p, i: cond.encode(p, i, cfg=True)).lower(params, inputs).compile()

    def timed(fn):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t0

    def one_program(task):
        gen.split_decode = False
        try:
            return gen.run(**base, task=task)
        finally:
            gen.split_decode = True

    calls = {
        "unet alone": lambda: unet(unet_params, x, t, context, added),
        "vae decode alone": lambda: decode(params, z),
        "text encoders alone": lambda: text(params, inputs),
        **{f"generation, {k}": (lambda task=task: gen.run(**base, task=task)) for k, task in tasks.items()},
        "generation, whole, latents": lambda: gen.run(**base, task=tasks["whole"], output="latents"),
        "generation, whole, one program": lambda: one_program(tasks["whole"]),
    }
    if args.split_only:
        calls = {k: calls[k] for k in ("generation, whole", "generation, whole, one program")}
    for fn in calls.values():  # warm
        timed(fn)
    times = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, fn in calls.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    if args.split_only:
        out = {
            "arch": args.arch,
            "size": size,
            "steps": args.steps,
            "dtype": args.dtype,
            "device": str(jax.devices()[0].device_kind),
            "times_s": times,
            "medians_s": med,
            "split_over_one_program": med["generation, whole"] / med["generation, whole, one program"],
        }
        print(json.dumps(out, indent=2))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=2)
        return
    extra_calls = calls_in["whole"] - calls_in["first half"]
    in_loop = (med["generation, whole"] - med["generation, first half"]) / extra_calls
    out = {
        "arch": args.arch,
        "size": size,
        "steps": args.steps,
        "model_calls": calls_in,
        "medians_s": med,
        "in_loop_call_s": in_loop,
        "alone_call_s": med["unet alone"],
        "in_loop_over_alone": in_loop / med["unet alone"],
        "rest_of_generation_s": med["generation, whole"] - calls_in["whole"] * in_loop,
        "text_and_decode_alone_s": med["vae decode alone"] + med["text encoders alone"],
        # The decode (and the conversion to images) as the generation runs it, against the decoder alone.
        "decode_in_generation_s": med["generation, whole"] - med["generation, whole, latents"],
        "decode_alone_s": med["vae decode alone"],
        # What is left without the decode: text encoders, noise, the sampler's host side, transfers.
        "rest_without_decode_s": med["generation, whole, latents"] - calls_in["whole"] * in_loop,
        "text_alone_s": med["text encoders alone"],
        # The split run (loop's program, then the decode executable) against one program holding both.
        "split_over_one_program": med["generation, whole"] / med["generation, whole, one program"],
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
