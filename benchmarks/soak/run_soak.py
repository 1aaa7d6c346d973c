"""Soak the sdjax server with locust: valid (OpenAI, A1111 and ComfyUI workflows over HTTP and the websocket),
invalid, oversized, slow-body and disconnecting clients against the embedded model, on 127.0.0.1 only, bounded in
clients and time.

    python benchmarks/soak/run_soak.py --users 8 --seconds 60          # the short form (tests/server/test_soak.py)
    python benchmarks/soak/run_soak.py --users 64 --seconds 600        # the long form (docs/benchmarks.md)

Starts `sdjax serve` (pinned: 64x64, --steps, --sampler; every batch size compiled first) in a subprocess,
samples its resident memory once a second, runs `locust --headless` with benchmarks/soak/locustfile.py, then checks
that the server drains to idle (its ComfyUI queue too), is ready and serves a request, and stops within its shutdown
timeout on SIGTERM. Prints one JSON report (also --json-out): 0 valid requests or workflows lost or mixed, workflows
completed, every bad request answered as it should be, RSS after warm-up / peak / end, p50/p99 latency of valid
requests and of workflows (and locust's table per request name). Exit status 1 if a check fails.

One sampler is served, so that the three APIs' requests share batches. The model's default ("dpmpp_2m", DPM++ 2M on
the model's own timestep grid) has no ComfyUI sampler/scheduler pair, so --sampler defaults to "DPM++ 2M Karras",
which ComfyUI's `dpmpp_2m` + `karras` is (--comfy-sampler; the same solver, so the same cost per step).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MIB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, timeout: float = 10.0):
    import httpx

    return httpx.get(url, timeout=timeout)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if get(url + "/health/ready", 2).status_code == 200:
                return time.monotonic() - t0
        except Exception:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during start-up:\n{proc.stdout.read()}")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the server was not ready within {timeout_s} s")
        time.sleep(0.5)


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 1.0):
        super().__init__(daemon=True)
        import psutil

        self.process = psutil.Process(pid)
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self):
        t0 = time.monotonic()
        while not self.done.is_set():
            try:
                self.samples.append((time.monotonic() - t0, self.process.memory_info().rss))
            except Exception:
                return
            self.done.wait(self.every_s)


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def locust_table(path: Path) -> dict:
    """Locust's per-name rows (requests, failures, p50/p99 seconds) from its --csv stats file."""
    table = {}
    if not path.exists():
        return table
    with path.open() as f:
        for row in csv.DictReader(f):

            def s(key: str, row=row) -> float | None:
                v = row.get(key, "N/A")
                return None if v in ("N/A", "", None) else round(float(v) / 1000, 3)

            table[f"{row['Type']} {row['Name']}"] = {
                "requests": int(row["Request Count"]),
                "failures": int(row["Failure Count"]),
                "p50_s": s("50%"),
                "p99_s": s("99%"),
            }
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--spawn-rate", type=float, default=4.0)
    p.add_argument("--seconds", type=int, default=60)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--sampler", default="DPM++ 2M Karras", help="the one sampler served (pinned)")
    p.add_argument(
        "--comfy-sampler",
        default="dpmpp_2m:karras",
        help="ComfyUI's sampler_name:scheduler of the workflows; must map onto --sampler (docs/comfyui.md)",
    )
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--max-rss-growth-mib", type=float, default=150.0, help="RSS growth allowed after warm-up")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    body_kb, body_timeout, shutdown_timeout = 16, 3, 5
    serve = [
        sys.executable, "-c", "from sdjax.cli import main; main()", "serve", "--host", "127.0.0.1", "--port",
        str(port), "--pin", "--steps", str(args.steps), "--sampler", args.sampler, "--max-batch", str(args.max_batch),
        "--max-body-kb", str(body_kb), "--body-timeout", str(body_timeout), "--header-timeout", str(body_timeout),
        "--shutdown-timeout", str(shutdown_timeout), "--request-timeout", "600", "--max-queue", "256",
        "--log-level", "warning",
    ]  # fmt: skip
    if args.model:
        serve += ["--model", args.model]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    # The server as users run it: one CPU device. Under the test suite, its compile flags (tests/conftest.py sets
    # SDJAX_TEST_COMPILE_FLAGS: LLVM optimisation off, the start-up compilation in about half the time).
    env["XLA_FLAGS"] = os.environ.get("SDJAX_TEST_COMPILE_FLAGS", "")
    server = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    report: dict = {
        "users": args.users,
        "seconds": args.seconds,
        "steps": args.steps,
        "sampler": args.sampler,
        "comfy_sampler": args.comfy_sampler,
        "max_batch": args.max_batch,
    }
    comfy_sampler, _, comfy_scheduler = args.comfy_sampler.partition(":")
    checks: dict[str, bool] = {}
    try:
        report["startup_s"] = round(wait_ready(url, server, 900), 1)
        sampler = RssSampler(server.pid)
        sampler.start()
        with tempfile.TemporaryDirectory() as tmp:
            result_path = Path(tmp) / "result.json"
            locust = [
                sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "-u",
                str(args.users), "-r", str(args.spawn_rate), "-t", f"{args.seconds}s", "--host", url,
                "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "60", "--csv", str(Path(tmp) / "soak"),
            ]  # fmt: skip
            locust_env = {
                **env,
                "SOAK_RESULT": str(result_path),
                "SOAK_BODY_LIMIT": str(body_kb * 1024),
                "SOAK_STEPS": str(args.steps),
                "SOAK_SLOW_FOR_S": str(body_timeout * 3),
                "SOAK_SIZE": "64",
                "SOAK_COMFY_SAMPLER": comfy_sampler,
                "SOAK_COMFY_SCHEDULER": comfy_scheduler or "normal",
            }
            t0 = time.monotonic()
            run = subprocess.run(locust, capture_output=True, text=True, env=locust_env, timeout=args.seconds + 300)
            report["locust_s"] = round(time.monotonic() - t0, 1)
            if not result_path.exists():
                raise RuntimeError(f"locust wrote no result (exit {run.returncode}):\n{run.stdout}\n{run.stderr}")
            report["clients"] = json.loads(result_path.read_text())
            report["locust"] = locust_table(Path(tmp) / "soak_stats.csv")
            report["locust_summary"] = (run.stdout + run.stderr)[-3000:]
        # drained to idle, ready, serving
        deadline = time.monotonic() + 120
        while True:
            health = get(url + "/health/ready").json()
            if health["queue_depth"] == 0 and not health["busy"]:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        while True:  # the ComfyUI queue: every workflow ended (the runner records it a moment after its jobs)
            comfy_queue = get(url + "/queue").json()
            if not comfy_queue["queue_running"] and not comfy_queue["queue_pending"]:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        report["comfy_queue_end"] = {k: len(v) for k, v in comfy_queue.items()}
        ready = get(url + "/health/ready")
        report["health_end"] = ready.json()
        import httpx

        final = httpx.post(url + "/v1/images/generations", json={"prompt": "after the soak", "seed": 1}, timeout=120)
        checks["serves_after"] = final.status_code == 200
        metrics = get(url + "/metrics").text
        report["server"] = {
            "images_generated": metric(metrics, "sdjax_images_generated_total"),
            "batches": metric(metrics, "sdjax_batches_total"),
            "stopped_batches": metric(metrics, "sdjax_stopped_batches_total"),
            "cancelled": {
                reason: metric(metrics, f'sdjax_cancelled_total{{reason="{reason}"}}')
                for reason in ("timeout", "disconnect", "interrupt", "skip", "shutdown")
            },
            "rejected": {
                reason: metric(metrics, f'sdjax_rejected_total{{reason="{reason}"}}')
                for reason in ("queue_full", "request_too_large", "truncated_body", "body_timeout", "disconnected")
            },
        }
        sampler.done.set()
        sampler.join(5)
        samples = sampler.samples
        rss = [r for _, r in samples]
        quarter = samples[len(samples) // 4][1] if samples else 0
        report["rss_mib"] = {
            "after_warmup": round(rss[0] / MIB, 1) if rss else None,
            "after_first_quarter": round(quarter / MIB, 1),
            "peak": round(max(rss) / MIB, 1) if rss else None,
            "end": round(rss[-1] / MIB, 1) if rss else None,
        }
        growth = (rss[-1] - quarter) / MIB if rss else 0.0
        report["rss_mib"]["growth_after_first_quarter"] = round(growth, 1)
        c = report["clients"]
        checks.update(
            valid_sent=c["valid_sent"] > 0 and c["valid_ok"] > 0,
            none_lost=c["lost"] == 0,
            none_mixed=c["mixed"] == 0,
            invalid_answered=c["invalid_wrong"] == 0,
            oversized_answered=c["oversized_wrong"] == 0,
            slow_cut_off=c["slow_not_cut"] == 0,
            comfy_ok=c["comfy_sent"] > 0 and c["comfy_ok"] > 0,
            comfy_none_lost=c["comfy_lost"] == 0,
            comfy_none_mixed=c["comfy_mixed"] == 0,
            comfy_ws_kept_open=c["comfy_ws_dropped"] == 0,
            ready_at_end=ready.status_code == 200 and report["health_end"]["queue_depth"] == 0,
            comfy_queue_empty_at_end=not any(report["comfy_queue_end"].values()),
            rss_bounded=growth < args.max_rss_growth_mib,
        )
        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=shutdown_timeout + 30)
        report["shutdown_s"] = round(time.monotonic() - t0, 1)
        checks["stops_on_sigterm"] = report["shutdown_s"] < shutdown_timeout + 10
        output = server.stdout.read()
        checks["no_traceback"] = "Traceback" not in output
        if not checks["no_traceback"]:
            report["server_output"] = output[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    report["checks"] = checks
    report["ok"] = all(checks.values())
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        args.json_out.write_text(text)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
