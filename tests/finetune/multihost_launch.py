"""The launcher of the multi-host training tests (test_multihost_training.py: SD; test_flow_multihost.py: Flux;
imported by this unique name, as tests/server's helpers are), one copy so that both compare runs made the same way:
`sdjax train COMMAND` on one process of 4 simulated devices, then on two processes of 2 devices each
(`jax.distributed` on 127.0.0.1, gloo on CPU), each process logging the images it decodes; and what the tests read
back of the two runs."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where conftest.py is

# `sdjax train ...` with every decode of a training example (`data.crop_example`: the sampler's, a latent cache's)
# written to the file $SDJAX_TEST_LOADS, one image name a line, in call order. The process first imports
# tests/conftest.py for the suite's settings (no Flax re-trace of each parameter's initializer at every `apply`, the
# GC thresholds), as the test process has them, and draws no loss.png (matplotlib's import and a plot: about 2 s of
# CPU in each writing process; tests/finetune/test_run.py checks that plot).
_COUNTED_CLI = f"""
import os, sys
sys.path.insert(0, {_TESTS!r})
import conftest
from sdjax.finetune import data, run
run.plot_losses = lambda log, png: False
crop = data.crop_example
def counted(item, *args):
    with open(os.environ["SDJAX_TEST_LOADS"], "a") as f:
        f.write(item.path.name + "\\n")
    return crop(item, *args)
data.crop_example = counted
from sdjax.cli import main
sys.exit(main())
"""


def _train(devices: int, argv: list[str], loads, command: str) -> subprocess.Popen:
    flags = f"--xla_force_host_platform_device_count={devices} {os.environ.get('SDJAX_TEST_COMPILE_FLAGS', '')}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu", "SDJAX_TEST_LOADS": str(loads)}
    env["SDJAX_DEVICES"] = "all"  # one program over every process's devices
    cmd = [sys.executable, "-c", _COUNTED_CLI, "train", command, *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen]) -> None:
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            assert p.returncode == 0, out[-3000:]
    finally:  # a failed or hung process leaves no other waiting for it at the coordinator
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_and_two(command: str, common: list[str], tmp_path, suffix: str = ".safetensors") -> None:
    """`sdjax train COMMAND` on one process of 4 devices (out `one`, its decodes in loads-one.txt), then on two
    processes of 2 devices each on 127.0.0.1 (out `two`, decodes in loads-0.txt and loads-1.txt)."""
    one = _train(4, [*common, "--out", str(tmp_path / f"one{suffix}")], tmp_path / "loads-one.txt", command)
    _wait([one])
    port = str(_free_port())
    hosts = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    two = [
        _train(
            2,
            [*common, "--out", str(tmp_path / f"two{suffix}"), *hosts, "--process-id", str(i)],
            tmp_path / f"loads-{i}.txt",
            command,
        )
        for i in range(2)
    ]
    _wait(two)


def read_loads(path) -> list[str]:
    """The image names a process logged to `path` (none when it decoded nothing)."""
    return path.read_text().splitlines() if path.exists() else []


def read_losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "loss.jsonl").read_text().splitlines()]


def worst_tensor(a: dict, b: dict) -> float:
    """The worst relative L2 difference of two files' tensors (Adam divides each gradient by its own running size,
    so an element whose gradient is only summation noise can move by up to lr either way: whole tensors, not
    elements)."""
    assert a.keys() == b.keys()
    return max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(a[k]), 1e-12)) for k in a)
