"""`sdjax.runtime`: recommended XLA:CPU flags never override the user's, and apply per compilation too."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdjax import runtime


def test_merged_flags_keep_the_users():
    assert runtime.merged_xla_flags("") == "--xla_cpu_experimental_ynn_fusion_type="
    user = "--xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type=dot"
    assert runtime.merged_xla_flags(user) == user  # theirs wins, nothing appended twice
    merged = runtime.merged_xla_flags("--xla_force_host_platform_device_count=8")
    assert merged.split() == ["--xla_force_host_platform_device_count=8", "--xla_cpu_experimental_ynn_fusion_type="]


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown CPU mode"):
        runtime.cpu_compiler_options("fast")


def test_after_backend_start_warns_and_changes_nothing(monkeypatch):
    jax.devices()  # the backend is up in the test process
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.warns(RuntimeWarning, match="already initialized"):
        assert runtime.configure_cpu() is False
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_opt_out(monkeypatch):
    monkeypatch.setenv("SDJAX_NO_CPU_TUNING", "1")
    assert runtime.configure_cpu() is False


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU compiler options")
@pytest.mark.parametrize("mode", ["eigen", "ynn-noconv"])
def test_compiler_options_compile_and_agree(mode):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 8, 4), dtype=np.float32))
    k = jnp.asarray(np.random.default_rng(1).standard_normal((3, 3, 4, 4), dtype=np.float32))

    def f(x, k):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.softmax(y.reshape(8, -1) @ y.reshape(8, -1).T, axis=-1)

    tuned = jax.jit(f, compiler_options=runtime.cpu_compiler_options(mode))(x, k)
    np.testing.assert_allclose(np.asarray(tuned), np.asarray(jax.jit(f)(x, k)), rtol=1e-5, atol=1e-6)
    if mode == "eigen":
        assert (
            "__ynn_fusion"
            not in jax.jit(f).lower(x, k).compile(compiler_options=runtime.cpu_compiler_options(mode)).as_text()
        )


def test_configure_before_backend_start_in_a_fresh_process():
    code = textwrap.dedent("""
        import os
        from sdjax import runtime
        assert runtime.configure_cpu() is True
        import jax, jax.numpy as jnp
        print(os.environ["XLA_FLAGS"])
        txt = jax.jit(lambda a, b: a @ b).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
        print("ynn" if "__ynn_fusion" in txt else "no-ynn")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "SDJAX_NO_CPU_TUNING")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["--xla_cpu_experimental_ynn_fusion_type=", "no-ynn"]
