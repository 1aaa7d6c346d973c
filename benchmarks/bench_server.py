"""Throughput and latency of the HTTP server under concurrent load, against calling the pipeline directly.

    python benchmarks/bench_server.py                          # the embedded model
    python benchmarks/bench_server.py --model /tmp/sd15-random --size 512x512 --steps 20 --max-batch 8
    python benchmarks/bench_server.py --fake-delay 0.05        # the tests' fake pipeline: server overhead only

Phases, all on one pipeline object in this process (compiled executables are shared, so only the first phase
that meets a shape pays its compilation, and it is excluded from every timing by a warm-up call):
1. direct, batch 1: `generate_arrays` for one image at a time, back to back (what a naive server does);
2. direct, batch B: `generate_arrays` for B images per call (the ceiling for batching);
3. server at each concurrency C: uvicorn on 127.0.0.1 in a thread, C clients (asyncio + httpx) each sending
   one-image requests back to back (closed loop) until R requests are answered; latency is per request as the
   client sees it (queueing, batching window, generation, PNG encoding, base64, HTTP), throughput counts images.
   Batch sizes come from the server's own /metrics.

Prints a table and one JSON object (also written to --json-out). All traffic goes to 127.0.0.1; every loop is
bounded by the request count and a time limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def load(args):
    if args.fake_delay is not None:
        sys.path.insert(0, str(ROOT / "tests" / "server"))
        from fake_pipeline import FakePipeline

        h, w = args.size
        return FakePipeline(delay_s=args.fake_delay, size=(h, w)), "fake"
    from sdjax import cli, infotext

    return cli.load_pipeline(args.model, args.dtype), infotext.model_label(args.model)


def direct(pipe, *, batch: int, images: int, steps: int, height: int, width: int, sampler: str) -> dict:
    from sdjax.metadata import GenerationRequest, generate_images

    def run(k: int, n: int):
        request = GenerationRequest(
            prompt=f"direct {k}", num_images=n, seed=k * 1000, steps=steps, width=width, height=height, sampler=sampler
        )
        return generate_images(pipe, request.images(), pad_to=batch)

    t0 = time.perf_counter()
    run(-1, batch)  # compile (or hit the cache)
    warm = time.perf_counter() - t0
    latencies = []
    t0 = time.perf_counter()
    done = 0
    k = 0
    while done < images:
        t = time.perf_counter()
        run(k, batch)
        latencies.append(time.perf_counter() - t)
        done += batch
        k += 1
    wall = time.perf_counter() - t0
    return {
        "mode": f"direct, batch {batch}",
        "images": done,
        "seconds": wall,
        "images_per_s": done / wall,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p90_s": percentile(latencies, 0.9),
        "latency_p99_s": percentile(latencies, 0.99),
        "mean_batch": batch,
        "rejected": 0,
        "first_call_s": warm,
    }


class Server:
    def __init__(self, pipe, config):
        import uvicorn

        from sdjax.server import build_asgi, uvicorn_config

        self.app = build_asgi(pipe, config)
        # the protocol, limits and timeouts `sdjax serve` uses
        self.server = uvicorn.Server(uvicorn_config(self.app, config, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 1800
        while not (self.server.started and self.app.state.batcher.ready):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=60)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def load_test(url: str, *, concurrency: int, requests: int, body: dict, time_limit: float) -> dict:
    import httpx

    latencies: list[float] = []
    statuses: dict[int, int] = {}
    issued = 0
    deadline = time.monotonic() + time_limit

    async with httpx.AsyncClient(
        base_url=url, timeout=time_limit, limits=httpx.Limits(max_connections=concurrency + 2)
    ) as client:
        before = (await client.get("/metrics")).text

        async def worker(w: int):
            nonlocal issued
            while issued < requests and time.monotonic() < deadline:
                k = issued
                issued += 1
                t = time.perf_counter()
                r = await client.post("/v1/images/generations", json={**body, "prompt": f"load {w} {k}", "seed": k})
                latencies.append(time.perf_counter() - t)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 429:
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
        after = (await client.get("/metrics")).text

    batches = metric(after, "sdjax_batch_images_count") - metric(before, "sdjax_batch_images_count")
    batch_images = metric(after, "sdjax_batch_images_sum") - metric(before, "sdjax_batch_images_sum")
    fill = metric(after, "sdjax_batch_fill_ratio_sum") - metric(before, "sdjax_batch_fill_ratio_sum")
    ok = statuses.get(200, 0)
    return {
        "mode": f"server, {concurrency} clients",
        "images": ok,
        "seconds": wall,
        "images_per_s": ok / wall,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p90_s": percentile(latencies, 0.9),
        "latency_p99_s": percentile(latencies, 0.99),
        "mean_batch": batch_images / batches if batches else 0,
        "mean_fill": fill / batches if batches else 0,
        "rejected": statuses.get(429, 0),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="diffusers folder or Hub id (default: the embedded model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="sampling steps (default: the pipeline's)")
    p.add_argument("--sampler", default=None)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--window-ms", type=float, default=10.0)
    p.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests (= images) per phase")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds per server phase at most")
    p.add_argument(
        "--fake-delay",
        type=float,
        default=None,
        help="use the tests' fake pipeline taking this many seconds per batch (measures the server)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="serve without per-step progress callbacks (the direct phases never use them)",
    )
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    args.size = tuple(int(x) for x in args.size.split("x")) if args.size else (64, 64)
    size_given = "--size" in " ".join(argv or sys.argv)

    import jax

    from sdjax.server import Limits, ServerConfig

    t0 = time.perf_counter()
    pipe, model_name = load(args)
    load_s = time.perf_counter() - t0
    height, width = (args.size[1], args.size[0]) if size_given else pipe.default_size
    steps = args.steps or pipe.default_steps
    sampler = args.sampler or pipe.default_sampler
    rows = [
        direct(pipe, batch=1, images=args.requests, steps=steps, height=height, width=width, sampler=sampler),
        direct(
            pipe, batch=args.max_batch, images=args.requests, steps=steps, height=height, width=width, sampler=sampler
        ),
    ]
    config = ServerConfig(
        model_name=model_name,
        max_batch=args.max_batch,
        batch_window_s=args.window_ms / 1000,
        max_queue_images=max(64, 4 * args.max_batch),
        request_timeout_s=args.time_limit,
        warm_sizes=((width, height),),
        limits=Limits(max_size=max(1024, width, height)),
        progress=not args.no_progress,
        default_steps=steps,
        default_sampler=sampler,
    )
    body = {"n": 1, "size": f"{width}x{height}", "steps": steps, "sampler": sampler}
    with Server(pipe, config) as server:
        for c in [int(x) for x in args.concurrency.split(",")]:
            asyncio.run(
                load_test(
                    server.url,
                    concurrency=c,
                    requests=min(args.max_batch, args.requests),
                    body=body,
                    time_limit=args.time_limit,
                )
            )  # warm: compiles any batch size not yet compiled
            rows.append(
                asyncio.run(
                    load_test(server.url, concurrency=c, requests=args.requests, body=body, time_limit=args.time_limit)
                )
            )
    result = {
        "model": model_name,
        "size": f"{width}x{height}",
        "steps": steps,
        "sampler": sampler,
        "dtype": args.dtype,
        "max_batch": args.max_batch,
        "window_ms": args.window_ms,
        "requests_per_phase": args.requests,
        "server_progress_callbacks": not args.no_progress,
        "load_s": load_s,
        "device": str(jax.devices()[0].device_kind),
        "devices": jax.device_count(),
        "host": f"{platform.machine()}, {os.cpu_count()} cpus",
        "rows": rows,
    }
    header = f"{'mode':<22}{'images/s':>10}{'p50 s':>9}{'p90 s':>9}{'p99 s':>9}{'batch':>7}{'429':>6}"
    print(f"{model_name} {width}x{height}, {steps} steps, {sampler}, {result['device']} x{result['devices']}")
    print(header)
    for r in rows:
        print(
            f"{r['mode']:<22}{r['images_per_s']:>10.2f}{r['latency_p50_s']:>9.3f}{r['latency_p90_s']:>9.3f}"
            f"{r['latency_p99_s']:>9.3f}{r['mean_batch']:>7.2f}{r['rejected']:>6}"
        )
    print(json.dumps(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
