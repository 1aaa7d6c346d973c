"""The launcher of the multi-host training tests (test_multihost_training.py: SD; test_flow_multihost.py: Flux;
imported by this unique name, as tests/server's helpers are), one copy so that both compare runs made the same way:
one or more `sdjax train COMMAND` runs, one after the other, on one process of 4 simulated devices, then the same
runs on two processes of 2 devices each (`jax.distributed` on 127.0.0.1, gloo on CPU), each process logging the
images it decodes; and what the tests read back of the two launches."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where conftest.py is

# `sdjax train ...` for each run of the JSON list argv[1] ([loads file, arguments] a run), one after the other in
# this process (its start and the imports of JAX and sdjax paid once for all of them), with every decode of a
# training example (`data.crop_example`: the sampler's, a latent cache's) written to the run's loads file, one image
# name a line, in call order. The process first imports tests/conftest.py for the suite's settings (no Flax re-trace
# of each parameter's initializer at every `apply`, the GC thresholds), as the test process has them, and draws no
# loss.png (matplotlib's import and a plot: about 2 s of CPU in each writing process; tests/finetune/test_run.py
# checks that plot). `jax.distributed` starts once, at the first run (every run names the same coordinator and
# process id: a later run's start is checked to be the same one, then skipped).
# Of two processes, only process 0 compiles each program over both processes' devices (the training steps); process 1
# waits and loads it from the coordinator's key-value store (JAX's `jax_share_binary_between_hosts`; host-callback
# programs and programs of one process's devices are compiled by each, as before). JAX shares a program under its
# compilation-cache key, which is computed whenever `jax_enable_compilation_cache` is on (the default; no cache
# directory is needed, nothing is written to disk), but on CPU the key's "accelerator config" (the devices'
# topology fingerprint) differs between the processes, so process 1 would wait for a key that never comes: the
# key hashes the devices' kind instead (the compile options in the key still hold the global device assignment).
# The same losses and bit-identical LoRA tensors as with each process compiling its own (one lora run of
# test_multihost_training's on two processes: process 1's backend compiles 8.4 -> 0.4 s of CPU, the pair's CPU
# 34.5 -> 22.7 s). CPU time (user + sys) of `/usr/bin/time python -m pytest -q -p no:cacheprovider FILE`, a loaded
# 2-core machine, 2026-11-30: test_multihost_training.py 155 -> 136 s, test_flow_multihost.py 82 -> 56 s (paired).
# The waiting process gives up after 300 s (JAX's default: 20 minutes), within `_wait`'s 600 s.
_SHARE_COMPILES = """
from jax._src import cache_key
if hasattr(cache_key, "_hash_accelerator_config") and hasattr(cache_key, "_hash_devices"):
    cache_key._hash_accelerator_config = cache_key._hash_devices
    jax.config.update("jax_share_binary_between_hosts", True)
    jax.config.update("jax_share_binary_between_hosts_timeout_ms", 300_000)
"""
_COUNTED_CLI = f"""
import json, os, sys
sys.path.insert(0, {_TESTS!r})
import conftest
import jax
{_SHARE_COMPILES}
from sdjax.finetune import data, run
run.plot_losses = lambda log, png: False
crop = data.crop_example
def counted(item, *args):
    with open(os.environ["SDJAX_TEST_LOADS"], "a") as f:
        f.write(item.path.name + "\\n")
    return crop(item, *args)
data.crop_example = counted
start, started = jax.distributed.initialize, []
def once(*args, **kwargs):
    assert started in ([], [(args, kwargs)]), (started, args, kwargs)
    if not started:
        start(*args, **kwargs)
        started.append((args, kwargs))
jax.distributed.initialize = once
from sdjax.cli import main
for loads, argv in json.loads(sys.argv[1]):
    os.environ["SDJAX_TEST_LOADS"] = loads
    sys.argv = ["sdjax", "train", *argv]
    print("=== sdjax train", *argv, flush=True)
    try:
        main()
    except SystemExit as e:
        if e.code:
            raise
"""


def _train(devices: int, runs: list[tuple[str, list[str]]]) -> subprocess.Popen:
    """One process of `devices` simulated devices running `runs` (`(loads file, train arguments)` each)."""
    flags = f"--xla_force_host_platform_device_count={devices} {os.environ.get('SDJAX_TEST_COMPILE_FLAGS', '')}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
    env["SDJAX_DEVICES"] = "all"  # one program over every process's devices
    cmd = [sys.executable, "-c", _COUNTED_CLI, json.dumps(runs)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen]) -> None:
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            runs = [line for line in out.splitlines() if line.startswith("=== sdjax train")]  # the run that failed
            assert p.returncode == 0, f"{runs[-1] if runs else 'before any run'}\n{out[-3000:]}"
    finally:  # a failed or hung process leaves no other waiting for it at the coordinator
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_and_two(runs: list[tuple[str, list[str], Path]], suffix: str = ".safetensors") -> None:
    """Each `(COMMAND, arguments, folder)` of `runs`, in order, as `sdjax train COMMAND arguments`: on one process of
    4 devices (out `folder/one`, its decodes in folder/loads-one.txt), then on two processes of 2 devices each on
    127.0.0.1 (out `folder/two`, decodes in folder/loads-0.txt and folder/loads-1.txt). Each process runs every run
    of `runs` (its start, its imports and `jax.distributed`'s start paid once, not once a run)."""

    def launch(devices: int, name: str, loads: str, hosts: list[str]) -> subprocess.Popen:
        out = [
            (folder, [command, *args, "--out", str(folder / f"{name}{suffix}"), *hosts])
            for command, args, folder in runs
        ]
        return _train(devices, [(str(folder / loads), argv) for folder, argv in out])

    _wait([launch(4, "one", "loads-one.txt", [])])
    hosts = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
    _wait([launch(2, "two", f"loads-{i}.txt", [*hosts, "--process-id", str(i)]) for i in range(2)])


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
