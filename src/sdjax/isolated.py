"""Run one call in a fresh child process, so that a crash of native code inside it cannot kill the caller.

libtpu's compiler has died with SIGSEGV on some shapes (docs/benchmarks.md, the TPU table: SD 1.5 with 8 images
per chip); inside `sdjax compile`'s own process that ends the command with no message. `call(fn, ...)` runs
`fn(*args, **kwargs)` in a `spawn`ed child (a fresh interpreter: nothing of the caller's JAX state is shared) and
gives back its return value, re-raises its exception, or raises `ChildCrashed` naming the signal that killed it.
`log` messages the child emits reach the caller's `log` as they happen. `fn`, its arguments and its result must be
picklable (top-level functions, plain data).
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from typing import Any


class ChildCrashed(RuntimeError):
    """The child process died without answering (a signal, or an exit from native code)."""

    def __init__(self, what: str, exitcode: int | None):
        self.exitcode = exitcode
        self.signal_name: str | None = None
        if exitcode is not None and exitcode < 0:
            try:
                self.signal_name = signal.Signals(-exitcode).name
            except ValueError:
                self.signal_name = f"signal {-exitcode}"
        how = f"killed by {self.signal_name}" if self.signal_name else f"exited with status {exitcode} without a result"
        super().__init__(f"{what}: the process {how}")


def _child(conn, fn, args, kwargs, with_log) -> None:
    if with_log:
        kwargs = {**kwargs, "log": lambda message: conn.send(("log", str(message)))}
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:  # every failure goes back to the caller
        try:
            conn.send(("error", e))
        except Exception:  # an exception that does not pickle: its type and text
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ok", result))


def call(fn: Callable, *args, log: Callable[[str], Any] | None = None, what: str | None = None, **kwargs):
    """`fn(*args, **kwargs)` in a child process; `log` (if given) is passed to `fn` as its `log` argument."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args, kwargs, log is not None), daemon=True)
    proc.start()
    child.close()  # the parent's copy: recv() then sees the end when the child dies
    try:
        while True:
            try:
                kind, value = parent.recv()
            except EOFError:  # the child is gone without a result
                proc.join()
                raise ChildCrashed(what or getattr(fn, "__name__", "call"), proc.exitcode) from None
            if kind == "log":
                log(value)
                continue
            proc.join()
            if kind == "error":
                raise value
            return value
    finally:
        parent.close()
        if proc.is_alive():  # the caller was interrupted: do not leave the compile running
            proc.terminate()
            proc.join()
