"""Scale-out with Ray Serve (`sdjax.server.ray_serve`): two replicas on CPU behind one endpoint, on a local Ray
node started on 127.0.0.1 without the dashboard. The Ray driver runs in a subprocess (Ray installs its own signal
handlers and processes); it checks that every Ray process of the node listens on loopback addresses only.

Both tests share one Ray node and one Serve instance (a module fixture; Ray's start is most of the fake-pipeline
test's time): the fake pipeline's application, deleted, then the embedded model's on the same HTTP proxy. The
fake-pipeline test runs in the suite whenever `ray[serve]` is installed (the `ray` extra). The embedded-model test
loads and compiles the model in both replicas (with the suite's compile flags) and is marked `ray_model`: deselect
it with `-m "not ray_model"` on a busy machine (the node then runs the fake pipeline's deployment only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the ray extra installs ray[serve]")

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

DRIVER = textwrap.dedent("""
    import concurrent.futures, functools, ipaddress, json, sys, time
    sys.path[:0] = [{here!r}, {src!r}]
    import httpx, psutil, ray
    from ray import serve
    from fake_pipeline import FakePipeline
    from server_helpers import check_image, free_port
    from sdjax.server import ServerConfig
    from sdjax.server.ray_serve import APP_NAME, run

    # A proxy actor that takes over 5 s to answer its ready check (importing uvicorn and FastAPI on a 2-core machine
    # busy with the rest of the suite) is restarted, then killed: Ray's own timeouts, raised for the test's machine.
    SLOW_MACHINE = {{"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}}
    ray.init(address="local", include_dashboard=False, num_cpus=2, log_to_driver=False,
             runtime_env={{"env_vars": {{"PYTHONPATH": {pythonpath!r}, "JAX_PLATFORMS": "cpu",
                                        "XLA_FLAGS": {xla_flags!r}, **SLOW_MACHINE}}}})

    # One Serve instance (controller and HTTP proxy on one port) for every phase: a phase deletes its application
    # and the next one deploys its own (`run` again) on the same proxy, not a restart of Serve.
    port = free_port()
    url = f"http://127.0.0.1:{{port}}"

    def phase(factory, config, steps, check):
        out = {{}}
        t0 = time.monotonic()
        run(None, factory=factory, config=ServerConfig(model_name="replicated", max_batch=2, **config),
            num_replicas=2, ray_actor_options={{"num_cpus": 0.5}}, host="127.0.0.1", port=port)
        deadline = time.monotonic() + 600
        while httpx.get(url + "/health/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        out["deploy_s"] = time.monotonic() - t0

        def post(i):
            body = {{"prompt": f"request {{i}}", "seed": i, "steps": steps}}
            return httpx.post(url + "/v1/images/generations", json=body, timeout=600)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(post, range(12)))
        out["status"] = [r.status_code for r in responses]
        out["replicas"] = sorted({{r.headers.get("x-replica") for r in responses}})
        if check:
            for i, r in enumerate(responses):
                check_image(r.json()["data"][0]["b64_json"], prompt=f"request {{i}}", seed=i, model="replicated")
        out["images_ok"] = all(r.status_code == 200 and r.json()["data"][0]["b64_json"] for r in responses)
        bad = httpx.post(url + "/v1/images/generations", json={{"prompt": "x", "n": 0}})
        out["bad"] = [bad.status_code, bad.json()["error"]["param"]]
        # every listening socket of the Ray node's processes (this driver's children)
        pids = {{p.pid for p in psutil.Process().children(recursive=True)}}
        listening = [c for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN" and c.pid in pids]
        out["listening"] = len(listening)
        out["non_loopback"] = sorted({{f"{{c.laddr.ip}}:{{c.laddr.port}}" for c in listening
                                     if not ipaddress.ip_address(c.laddr.ip.removeprefix("::ffff:")).is_loopback}})
        serve.delete(APP_NAME)  # the next phase deploys on the same Serve instance (the replicas are gone)
        return out

    results = {{}}
    try:
        for name, factory, config, steps, check in {phases}:
            results[name] = phase(eval(factory), config, steps, check)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("RESULT " + json.dumps(results))
""")

# The phases one Ray node runs in turn (Ray's start is paid once): name, factory, extra config, steps, check images.
FAKE = ("fake", "functools.partial(FakePipeline, delay_s=0.5)", {"warm": False}, 4, True)
# Two steps: the embedded model's replicas compile and run the whole loop (a program per step count); more steps
# cost compile and run time and prove nothing more about replication.
EMBEDDED = ("embedded", "None", {"default_steps": 2, "batch_sizes": (2,)}, 2, False)


def drive(phases: list[tuple]) -> dict:
    pythonpath = os.pathsep.join([str(HERE), str(SRC)])
    # The replicas compile as the rest of the suite does (tests/conftest.py), on one CPU device each.
    xla_flags = os.environ.get("SDJAX_TEST_COMPILE_FLAGS", "")
    script = DRIVER.format(
        here=str(HERE), src=str(SRC), pythonpath=pythonpath, xla_flags=xla_flags, phases=repr(phases)
    )
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath}
    env.update(RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S="60", RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S="60")
    # No idle workers started ahead of need: Serve's actors run in workers of the job's runtime environment, so
    # the raylet's prestarted default workers would only be started, then killed unused.
    env.update(RAY_prestart_worker_first_driver="0", RAY_enable_worker_prestart="0")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def results(request) -> dict:
    """One Ray node for the module: the fake pipeline's deployment, then (when its test is selected) the embedded
    model's."""
    with_model = any(item.get_closest_marker("ray_model") for item in request.session.items)
    return drive([FAKE, EMBEDDED] if with_model else [FAKE])


def check(result: dict) -> None:
    assert result["status"] == [200] * 12, result
    assert result["images_ok"] and len(result["replicas"]) == 2, result  # both replicas answered
    assert result["bad"] == [422, "n"]
    assert result["listening"] > 5 and result["non_loopback"] == [], result


def test_two_replicas_of_the_fake_pipeline(results):
    check(results["fake"])


@pytest.mark.ray_model
def test_two_replicas_of_the_embedded_model(results):
    result = results["embedded"]
    check(result)
    print(f"two embedded-model replicas ready in {result['deploy_s']:.0f} s")
