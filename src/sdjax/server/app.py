"""The HTTP server: FastAPI routers over one pipeline and a `Batcher`; `serve()` runs it under uvicorn.

`create_app` builds one `ServerState` (`server.state`: the configuration, the model served, the batcher, files,
metrics) and includes one router per API over it (`server.routes`: `openai`, `a1111`, `controlnet`, `health`;
`server.comfy` and `server.a1111_info`), with the error handlers of `server.handlers`.

Endpoints:
- `GET /` the web page; `GET /health/live` (the process answers), `GET /health/ready` and `GET /health` (200 when
  serving; 503 while compiling at start-up, switching models, draining, or when the running batch has shown no
  progress for `stuck_after_s`); `GET /metrics` Prometheus text; `GET /v1/config` what the page needs;
  `GET /docs` the API explorer from the locally installed `swagger-ui-bundle` (absent: /docs answers 404 and
  the start-up log says so; `/openapi.json` is always there);
- OpenAI: `POST /v1/images/generations` (`response_format` `b64_json` or `url`; `stream`: server-sent events,
  `server.openai_stream`), `GET /v1/files/{id}` (the images behind those urls, for `file_ttl_s`), `GET /v1/models`;
- AUTOMATIC1111: `POST /sdapi/v1/txt2img`, `POST /sdapi/v1/interrupt`, `POST /sdapi/v1/skip`,
  `GET /sdapi/v1/progress` (with a latent preview as `current_image` when the pipeline reports latents; null
  otherwise), `GET /sdapi/v1/samplers`, `GET /sdapi/v1/schedulers`, `GET /sdapi/v1/sd-models`, `/loras`,
  `/embeddings`, `/sd-vae`, `POST /sdapi/v1/refresh-checkpoints`, `/refresh-loras`, `/refresh-vae` (the models
  directory: `server.models_api`), `GET|POST /sdapi/v1/options` (POST switches `sd_model_checkpoint` when the
  server has a models directory, and sets the default `CLIP_stop_at_last_layers` and `sd_vae`; any setting it
  cannot honour answers 422), `POST /sdapi/v1/png-info`, and `GET /sdapi/v1/cmd-flags`, `/upscalers`,
  `/latent-upscale-modes`, `/scripts`, `/memory`, `/prompt-styles` (`server.a1111_info`). `<lora:...>` prompt
  tags and `override_settings.sd_vae` are applied per batch as params (`server.networks`).

Errors have one shape per API (`sdjax.server.errors`): invalid input 422 naming the field, a body too large 413,
truncated 400, too slow 408, bad credentials 401, queue full 429 with `Retry-After`, no result within the request
timeout 504 (and the work is cancelled), pipeline failure or bug 500 naming only a request id, draining 503.
Every response carries `X-Request-ID`. A request never takes the server down. On SIGTERM the server stops
accepting connections and drains for at most `shutdown_timeout_s`, then cancels what is left (503) and exits.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from sdjax.server import a1111_info, comfy, published
from sdjax.server.guard import Auth, Guard, call_when_exiting, protocol_class
from sdjax.server.handlers import install_handlers
from sdjax.server.routes import a1111, controlnet, health, openai
from sdjax.server.routes.a1111 import latent_preview
from sdjax.server.state import Served, ServerConfig, ServerState, served_for, version

__all__ = [
    "ENDPOINTS",
    "IMAGE_ENDPOINTS",
    "Served",
    "ServerConfig",
    "ServerState",
    "build_asgi",
    "create_app",
    "latent_preview",
    "make_server",
    "serve",
    "served_for",
    "uvicorn_config",
]

log = logging.getLogger("sdjax.server")

# Endpoints whose bodies carry images: they may be up to `ServerConfig.max_image_body_bytes` (txt2img: the
# control images of its ControlNet units).
IMAGE_ENDPOINTS = (
    "/sdapi/v1/txt2img",
    "/sdapi/v1/img2img",
    "/sdapi/v1/png-info",
    "/v1/images/edits",
    "/v1/images/variations",
    "/controlnet/detect",
    *comfy.UPLOAD_PATHS,
)

ENDPOINTS = (
    "/",
    "/health",
    "/health/live",
    "/health/ready",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/v1/config",
    "/v1/models",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/images/variations",
    "/sdapi/v1/txt2img",
    "/sdapi/v1/img2img",
    "/sdapi/v1/interrupt",
    "/sdapi/v1/skip",
    "/sdapi/v1/samplers",
    "/sdapi/v1/schedulers",
    "/sdapi/v1/progress",
    "/sdapi/v1/sd-models",
    "/sdapi/v1/loras",
    "/sdapi/v1/embeddings",
    "/sdapi/v1/sd-vae",
    "/sdapi/v1/refresh-checkpoints",
    "/sdapi/v1/refresh-loras",
    "/sdapi/v1/refresh-vae",
    "/sdapi/v1/options",
    "/sdapi/v1/png-info",
    "/controlnet/model_list",
    "/controlnet/module_list",
    "/controlnet/detect",
    "/controlnet/version",
    *a1111_info.PATHS,
    *comfy.PATHS,
)


def create_app(
    pipeline: Any, config: ServerConfig | None = None, *, loader: Callable[[str], Any] | None = None
) -> FastAPI:
    """A FastAPI app serving `pipeline` (`config`: none, the defaults); `loader(path) -> pipeline` lets POST
    /sdapi/v1/options switch to another model of `config.models_dir`. The batcher starts and stops with the app's
    lifespan."""
    config = ServerConfig() if config is None else config
    state = ServerState(pipeline, config, loader=loader)
    docs_assets = health.swagger_assets() if config.docs else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if config.docs and docs_assets is None:
            log.info("/docs is off: the swagger-ui-bundle package is not installed (GET /openapi.json still works)")
        await state.batcher.start()
        try:
            yield
        finally:
            await state.batcher.stop(timeout_s=config.shutdown_timeout_s)

    app = FastAPI(
        title="sdjax",
        version=version(),
        lifespan=lifespan,
        description="Stable Diffusion in JAX: OpenAI- and AUTOMATIC1111-compatible image generation",
        docs_url=None,
        redoc_url=None,
    )
    raw_openapi = app.openapi  # FastAPI's schema (generated once), with this server's limits (`server.published`)
    app.openapi = lambda: published.publish_limits(raw_openapi(), state.served().limits, state.served().defaults)
    app.state.server = state
    app.state.batcher = state.batcher
    app.state.metrics = state.metrics
    app.state.config = config
    app.state.files = state.files
    app.state.box = state.box
    install_handlers(app, state.metrics)

    app.include_router(openai.router(state))
    app.include_router(a1111.router(state))
    app.include_router(health.router(state))
    app.include_router(a1111_info.router(config, lambda: state.served().pipeline))  # cmd-flags, upscalers, ...
    comfy_api = comfy.router(config=config, batcher=state.batcher, served=state.served,
                             wait_for_model=state.wait_for_model, networks=state.networks, md=state.md)  # fmt: skip
    app.include_router(comfy_api)  # ComfyUI's paths at the root, and under /api as ComfyUI serves them too
    app.include_router(comfy_api, prefix="/api", include_in_schema=False)
    app.include_router(controlnet.router(state))
    if docs_assets is not None:
        health.install_docs(app, docs_assets)
    return app


# ---------------------------------------------------------------------------------------------- running
def build_asgi(pipeline: Any, config: ServerConfig | None = None, *, loader: Callable[[str], Any] | None = None):
    """The app inside the guard layer (and CORS when `config.cors_origins` is set): what uvicorn serves."""
    config = ServerConfig() if config is None else config
    app = create_app(pipeline, config, loader=loader)
    auth = Auth(api_key=config.api_key, users=tuple(config.api_auth))
    outer: Any = Guard(
        app,
        metrics=app.state.metrics,
        endpoints=ENDPOINTS,
        max_body_bytes=config.max_body_bytes,
        image_body_bytes=(IMAGE_ENDPOINTS, config.max_image_body_bytes),
        body_timeout_s=config.body_timeout_s,
        auth=auth,
    )
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        outer = CORSMiddleware(
            outer,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID", "Retry-After"],
            allow_credentials=False,
        )
    outer.state = app.state  # for tests and callers
    outer.fastapi = app
    return outer


def uvicorn_config(asgi, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """The uvicorn configuration `serve()` uses (also for tests): guarded protocol, connection bound, timeouts."""
    import uvicorn

    return uvicorn.Config(
        asgi,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol_class(config.header_timeout_s),
        limit_concurrency=config.max_connections,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=int(math.ceil(config.shutdown_timeout_s)) + 5,  # the batcher cancels first
        access_log=False,
    )


def make_server(asgi, config: ServerConfig, **kwargs):
    """A `uvicorn.Server` whose SIGINT/SIGTERM starts the batcher's bounded drain."""
    import uvicorn

    batcher = asgi.state.batcher
    server_cls = call_when_exiting(uvicorn.Server, lambda: batcher.begin_drain(config.shutdown_timeout_s))
    return server_cls(uvicorn_config(asgi, config, **kwargs))


def serve(
    pipeline: Any,
    config: ServerConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    loader: Callable[[str], Any] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; then drain for at most `config.shutdown_timeout_s`, cancel the rest, exit."""
    config = ServerConfig() if config is None else config
    make_server(build_asgi(pipeline, config, loader=loader), config, host=host, port=port, log_level=log_level).run()
