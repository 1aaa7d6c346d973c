"""Two local processes on JAX's distributed runtime produce the images of a single-process run."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from sdjax import StableDiffusionPipeline

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_single_process(sd1_dir, tmp_path):
    sys.path.insert(0, str(WORKER.parent))
    from multihost_worker import PROMPTS

    port = free_port()
    out = tmp_path / "images"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["SDJAX_DEVICES"] = "all"  # one program over both processes' devices
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), "2", str(port), str(sd1_dir), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    got = [np.load(f"{out}.{i}.npy") for i in range(2)]
    np.testing.assert_array_equal(got[0], got[1])  # every process holds the whole gathered batch

    pipe, _ = StableDiffusionPipeline.from_pretrained(str(sd1_dir))
    pipe.devices = jax.devices()[:4]
    ref = pipe.generate_arrays(PROMPTS, [""] * 4, [5] * 4, [0, 1, 2, 3], [7.5] * 4, steps=3, height=64, width=64)
    assert np.abs(got[0].astype(int) - ref.astype(int)).max() <= 1
