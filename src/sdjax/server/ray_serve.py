"""Several sdjax servers behind one endpoint: a Ray Serve deployment wrapping the same app (`pip install
'sdjax[ray]'`).

Each replica is a Ray actor (its own process) that loads its own pipeline and runs the app of `build_asgi`
(batcher, limits, auth, every route) under Ray Serve's HTTP proxy, which spreads requests over the replicas. A
replica owns the devices Ray gives it: with `ray_actor_options={"num_gpus": 1}` Ray sets CUDA_VISIBLE_DEVICES per
replica, so each one's JAX sees only its GPU; on CPU each replica is a process with its own JAX CPU device. One
model over many hosts (multi-host JAX) is a different thing and stays as `docs/scaling.md` describes.

On one machine, for a test or a small deployment (everything on 127.0.0.1, no dashboard)::

    import ray
    from sdjax.server import ServerConfig
    from sdjax.server.ray_serve import run

    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    run(None, config=ServerConfig(model_name="sdjax/embedded"), num_replicas=2, host="127.0.0.1", port=8000)
    # ... POST http://127.0.0.1:8000/v1/images/generations ...
    ray.serve.shutdown(); ray.shutdown()

On a cluster, `ray start --head` on one machine and `ray start --address=HEAD:6379` on the others, then
`ray.init(address="auto")` and `run(..., host="0.0.0.0")` from any of them (a public address only if you mean it,
with `config.api_key` set). Every response names the replica that answered in `X-Replica`.

Loopback only: Ray turns a node address of 127.0.0.1 into the machine's outward address unless the environment
has `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (set it before `import ray`, as tests/server/test_ray_serve.py does);
then every Ray process listens on 127.0.0.1 except Ray Serve's inter-deployment gRPC port of each replica, which
Ray binds to all interfaces. On a node whose address is a loopback one, each replica here rebinds that port to
127.0.0.1 (a guarded patch of Ray's replica module; a no-op on real clusters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sdjax.server.app import ServerConfig, build_asgi

APP_NAME = "sdjax"


def _with_replica_header(asgi, replica: str):
    """`asgi` with an `X-Replica` header on every HTTP response (which replica answered)."""
    tag = replica.encode("latin-1", "replace")

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return await asgi(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-replica", tag)]}
            await send(message)

        return await asgi(scope, receive, tagged)

    app.state = asgi.state
    return app


def _keep_replica_grpc_on_loopback() -> None:
    """On a loopback-only Ray node, make this replica's inter-deployment gRPC server listen on 127.0.0.1 instead
    of every interface (Ray binds "[::]:0" unconditionally). Runs in the replica before Ray starts that server."""
    import ipaddress

    import ray

    try:
        if not ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback:
            return
        from ray.serve._private import replica as replica_module
    except (ImportError, ValueError):
        return
    original = getattr(replica_module, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "sdjax_loopback", False):
        return

    def loopback(server, address):
        if isinstance(address, str) and address.startswith("[::]:"):
            address = "127.0.0.1:" + address.removeprefix("[::]:")
        return original(server, address)

    loopback.sdjax_loopback = True
    replica_module.add_port_to_grpc_server = loopback


def deployment(
    model: str | None = None,
    *,
    config: ServerConfig | None = None,
    dtype: str = "float32",
    factory: Callable[[], Any] | None = None,
    num_replicas: int = 2,
    ray_actor_options: dict | None = None,
    max_ongoing_requests: int | None = None,
):
    """A bound Ray Serve application of `num_replicas` replicas, each loading `model` (a diffusers folder, Hub id,
    or None for the embedded model) in `dtype`, or calling `factory()` for its pipeline, and serving it with
    `config`. Pass it to `ray.serve.run`."""
    from ray import serve

    config = config or ServerConfig()
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} must be at least 1")
    options = {"num_cpus": 1} if ray_actor_options is None else dict(ray_actor_options)
    # A replica takes as many requests as its own limits admit (its queue answers 429 beyond them).
    ongoing = max_ongoing_requests or config.max_queue_images + config.max_batch + 8

    @serve.deployment(
        name="SdjaxServer", num_replicas=num_replicas, ray_actor_options=options, max_ongoing_requests=ongoing
    )
    @serve.ingress()
    class SdjaxServer:
        def __init__(self, model: str | None, config: ServerConfig, dtype: str, factory):
            _keep_replica_grpc_on_loopback()
            if factory is not None:
                self.pipeline = factory()
            else:
                from sdjax.pipelines import load_pipeline

                self.pipeline, _ = load_pipeline(model, dtype=dtype)
            self.config = config

        def __serve_build_asgi_app__(self):
            replica = serve.get_replica_context().replica_id.unique_id
            return _with_replica_header(build_asgi(self.pipeline, self.config), replica)

    return SdjaxServer.bind(model, config, dtype, factory)


def run(
    model: str | None = None,
    *,
    config: ServerConfig | None = None,
    dtype: str = "float32",
    factory: Callable[[], Any] | None = None,
    num_replicas: int = 2,
    ray_actor_options: dict | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
):
    """Start Ray Serve's HTTP proxy on `host:port` (127.0.0.1 unless told otherwise) and deploy the replicas;
    returns when the replicas run (each compiles its warm shapes in the background: GET /health/ready says when
    it is done). Needs `ray.init(...)` first."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    app = deployment(
        model,
        config=config,
        dtype=dtype,
        factory=factory,
        num_replicas=num_replicas,
        ray_actor_options=ray_actor_options,
    )
    return serve.run(app, name=APP_NAME, route_prefix="/")
