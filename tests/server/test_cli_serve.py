"""`sdjax serve`'s options become the server's configuration (the server itself is not started)."""

from __future__ import annotations

from fake_pipeline import FakePipeline
from typer.testing import CliRunner

from sdjax import cli, server


def invoke(monkeypatch, *args, env=None):
    seen = {}
    monkeypatch.setattr(cli.serve, "load_pipeline", lambda model, dtype: FakePipeline())
    monkeypatch.setattr(server, "serve", lambda pipe, config, **kw: seen.update(config=config, **kw))
    r = CliRunner().invoke(cli.app, ["serve", *args], env=env)
    return r, seen


def test_serve_options(monkeypatch, tmp_path):
    r, seen = invoke(
        monkeypatch,
        "--pin", "--warm-size", "64x64", "--warm-size", "32x48", "--warm-steps", "4", "--warm-steps", "8",
        "--warm-sampler", "Euler a", "--max-request-cost", "1.5", "--max-queue-cost", "10",
        "--body-timeout", "2", "--header-timeout", "3", "--shutdown-timeout", "4", "--stuck-after", "50",
        "--api-auth", "alice:pw1,bob:pw:2", "--cors-origins", "http://a.test, http://b.test",
        "--models-dir", str(tmp_path), "--file-ttl", "60", "--no-docs", "--max-connections", "100",
        env={"SDJAX_API_KEY": "sk-env"},
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    config = seen["config"]
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8000)
    assert config.pin and config.warm_sizes == ((64, 64), (32, 48)) and config.warm_steps == (4, 8)
    assert config.warm_samplers == ("Euler a",)
    assert config.limits.max_cost == 1_500_000 and config.max_queue_cost == 10_000_000
    assert (config.body_timeout_s, config.header_timeout_s, config.shutdown_timeout_s, config.stuck_after_s) == (
        2.0,
        3.0,
        4.0,
        50.0,
    )
    assert config.api_key == "sk-env" and config.api_auth == (("alice", "pw1"), ("bob", "pw:2"))
    assert config.cors_origins == ("http://a.test", "http://b.test")
    assert config.models_dir == str(tmp_path) and seen["loader"] is not None
    assert (config.file_ttl_s, config.docs, config.max_connections) == (60.0, False, 100)


def test_serve_option_errors(monkeypatch, tmp_path):
    r, _ = invoke(monkeypatch, "--api-auth", "nopassword")
    assert r.exit_code == 2 and "user:password" in r.output
    r, _ = invoke(monkeypatch, "--models-dir", str(tmp_path / "missing"))
    assert r.exit_code == 2 and "not a folder" in r.output
    r, _ = invoke(monkeypatch, "--warm-sampler", "nope")
    assert r.exit_code == 2 and "--warm-sampler" in r.output
    r, seen = invoke(monkeypatch)
    assert r.exit_code == 0 and seen["config"].api_key is None and seen["loader"] is None


def test_a_bad_device_count_is_refused_before_the_model_loads(monkeypatch):
    """`SDJAX_DEVICES` is checked at start-up (a usage error naming it), not at the first request's mesh."""
    loaded = []
    monkeypatch.setattr(cli.serve, "load_pipeline", lambda model, dtype: loaded.append(model) or FakePipeline())
    monkeypatch.setattr(server, "serve", lambda pipe, config, **kw: None)
    r = CliRunner().invoke(cli.app, ["serve", "--no-warm"], env={"SDJAX_DEVICES": "99"})
    assert r.exit_code == 2 and "SDJAX_DEVICES='99'" in r.output and "from 1 to 8" in r.output
    assert loaded == []
    r = CliRunner().invoke(cli.app, ["serve", "--no-warm"], env={"SDJAX_DEVICES": "2"})
    assert r.exit_code == 0 and len(loaded) == 1
