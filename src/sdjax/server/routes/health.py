"""Health, metrics and the web page: `GET /` the page; `GET /health/live` (the process answers), `GET /health/ready`
and `GET /health` (200 when serving; 503 while compiling at start-up, switching models, draining, or when the
running batch has shown no progress for `stuck_after_s`); `GET /metrics` Prometheus text; `GET /v1/config` what
the page needs; `GET /docs` the API explorer from the locally installed `swagger-ui-bundle` (`install_docs`)."""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response

from sdjax.infotext import sampler_display_name, sampler_id
from sdjax.server.state import ServerState


def router(state: ServerState) -> APIRouter:
    """The page, health, metrics and configuration routes over `state`."""
    api = APIRouter()
    config, batcher, metrics = state.config, state.batcher, state.metrics
    page = _page()

    @api.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse(page)

    async def ready_response():
        ok, status = state.readiness()
        body = {
            "status": status,
            "model": state.served().model_name,
            "queue_depth": batcher.queued_images,
            "busy": batcher.current is not None,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    api.add_api_route("/health/ready", ready_response, methods=["GET"], summary="Readiness: 200 when serving")
    api.add_api_route("/health", ready_response, methods=["GET"], summary="Readiness (same as /health/ready)")

    @api.get("/health/live", summary="Liveness: the process answers")
    async def live():
        return {"status": "alive"}

    @api.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @api.get("/v1/config", summary="Defaults, limits and samplers (used by the web page)")
    async def server_config():
        now = state.served()
        return {
            "model": now.model_name,
            "samplers": list(now.pipeline.sampler_names),
            "sampler_labels": {name: sampler_display_name(name) for name in now.pipeline.sampler_names},
            "default_sampler": sampler_id(now.defaults.sampler),
            "default_steps": now.defaults.steps,
            "default_guidance_scale": now.defaults.guidance_scale,
            "default_width": now.defaults.width,
            "default_height": now.defaults.height,
            "limits": dataclasses.asdict(now.limits),
            "max_batch": config.max_batch,
            "batch_sizes": list(batcher.batch_sizes),
            "warm_sizes": [list(s) for s in now.warm_sizes] if config.warm else [],
            "pinned": config.pin,
        }

    return api


def install_docs(app: FastAPI, assets: str) -> None:
    """`GET /docs`: swagger-ui over /openapi.json, its JS and CSS served from `assets` (`swagger_assets()`)."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount("/docs/assets", StaticFiles(directory=assets), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="sdjax API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon-32x32.png",
        )


def swagger_assets() -> str | None:
    """The folder of swagger-ui's JS and CSS from the `swagger-ui-bundle` package, if installed."""
    try:
        import swagger_ui_bundle
    except ImportError:
        return None
    folder = Path(swagger_ui_bundle.swagger_ui_path)
    return str(folder) if (folder / "swagger-ui-bundle.js").is_file() else None


def _page() -> str:
    return importlib.resources.files("sdjax.server").joinpath("static/index.html").read_text("utf-8")
