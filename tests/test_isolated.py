"""`sdjax.isolated.call`: a call in a child process gives back its result or its exception, and a child killed by
a signal (as libtpu's compiler has been, by SIGSEGV) becomes `ChildCrashed` naming the signal instead of killing
the caller; `sdjax compile` reports such a crash with its own exit status."""

import signal

import pytest
from typer.testing import CliRunner

from sdjax import cli, isolated


def _logs_then_returns(x, log):
    log(f"got {x}")
    return {"double": 2 * x}


def test_result_exception_and_log_come_back():
    assert isolated.call(divmod, 7, 2) == (3, 1)
    with pytest.raises(ValueError, match="invalid literal"):
        isolated.call(int, "x")
    seen = []
    assert isolated.call(_logs_then_returns, 21, log=seen.append) == {"double": 42}
    assert seen == ["got 21"]


def test_a_signal_in_the_child_is_named_and_the_caller_lives():
    with pytest.raises(isolated.ChildCrashed, match="compile: the process killed by SIGSEGV") as info:
        isolated.call(signal.raise_signal, signal.SIGSEGV, what="compile")
    assert info.value.exitcode == -signal.SIGSEGV and info.value.signal_name == "SIGSEGV"


def test_sdjax_compile_reports_a_compiler_crash(monkeypatch):
    def crashed(fn, *args, what=None, **kwargs):
        raise isolated.ChildCrashed(what, -signal.SIGSEGV)

    monkeypatch.setattr(isolated, "call", crashed)
    monkeypatch.setattr(cli.compile, "_require_extra", lambda *a: None)  # libtpu or not: the compile is replaced
    r = CliRunner().invoke(cli.app, ["compile", "--target", "v5e-1", "-m", "tiny", "--batch", "8"])
    assert r.exit_code == 3, r.output
    assert "compiler crashed" in r.output and "SIGSEGV" in r.output and "--vae-slicing" in r.output
