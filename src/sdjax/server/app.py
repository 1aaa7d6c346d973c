"""The HTTP server: FastAPI routes over one pipeline and a `Batcher`; `serve()` runs it under uvicorn.

Endpoints:
- `GET /` the web page; `GET /health` (200 ready, 503 while compiling at start-up or draining);
  `GET /metrics` Prometheus text; `GET /v1/config` what the page needs (defaults, limits, samplers);
- `POST /v1/images/generations` (OpenAI images API), `GET /v1/models`;
- `POST /sdapi/v1/txt2img`, `GET /sdapi/v1/samplers`, `GET /sdapi/v1/progress`, `GET /sdapi/v1/sd-models`,
  `GET /sdapi/v1/options` (AUTOMATIC1111 API).

Errors: invalid input 422 naming the field (`{"error": {"message", "type", "param", "code"}, "detail": [...]}`,
OpenAI's error shape plus FastAPI's `detail`), body over the limit 413, queue full 429 with `Retry-After`, no result
within the request timeout 504, pipeline failure 500, draining 503. A request never takes the server down, and on
SIGTERM uvicorn stops accepting connections, lets in-flight requests finish, then the batcher stops.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import importlib.resources
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response

from sdjax.metadata import GenerationRequest, ImageParameters, png_bytes, sampler_display_name, sampler_id
from sdjax.server.batching import Batcher, QueueFull, ShuttingDown
from sdjax.server.metrics import Metrics
from sdjax.server.schemas import (
    A1111Txt2ImgRequest,
    A1111Txt2ImgResponse,
    Defaults,
    FieldError,
    Limits,
    OpenAIImageRequest,
    OpenAIImageResponse,
    resolve_a1111,
    resolve_openai,
)

log = logging.getLogger("sdjax.server")

ENDPOINTS = (
    "/",
    "/health",
    "/metrics",
    "/v1/config",
    "/v1/models",
    "/v1/images/generations",
    "/sdapi/v1/txt2img",
    "/sdapi/v1/samplers",
    "/sdapi/v1/progress",
    "/sdapi/v1/sd-models",
    "/sdapi/v1/options",
)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Batching, limits and start-up compilation of one server."""

    model_name: str = ""
    max_batch: int = 8
    batch_sizes: tuple[int, ...] = ()  # compiled batch sizes; default: powers of two up to max_batch
    batch_window_s: float = 0.01
    max_queue_images: int = 64
    request_timeout_s: float = 300.0
    max_body_bytes: int = 64 * 1024
    warm_sizes: tuple[tuple[int, int], ...] = ()  # (width, height) compiled at start-up; () = the model's size
    warm: bool = True
    limits: Limits = Limits()
    progress: bool = True  # per-step progress from the pipeline (for /sdapi/v1/progress)
    default_steps: int | None = None  # for requests without steps, and compiled at start-up; None: the pipeline's
    default_sampler: str | None = None  # likewise for the sampler


# ---------------------------------------------------------------------------------------------- middleware
class _Guard:
    """Outermost ASGI layer: request count/latency metrics by endpoint and status, and the body size limit
    (413 before the body reaches the app; bodies are read whole here, they are small JSON)."""

    def __init__(self, app, metrics: Metrics, max_body_bytes: int):
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        status = {"code": 500}
        t0 = time.perf_counter()

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        self.metrics.in_flight.inc()
        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(receive)
                if body is None:
                    await _send_json(
                        send_status,
                        413,
                        _error_body(f"request body exceeds {self.max_body_bytes} bytes", "body", "request_too_large"),
                    )
                    return
                replayed = False

                async def replay():
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": body, "more_body": False}
                    return await receive()

                await self.app(scope, replay, send_status)
            else:
                await self.app(scope, receive, send_status)
        except Exception as e:  # the app's handlers answered already if they could; never let it reach uvicorn
            if status["code"] == 500 and not status.get("started"):
                log.exception("unhandled error")
                await _send_json(
                    send_status,
                    500,
                    _error_body(f"{type(e).__name__}: {e}", None, "internal_error", kind="server_error"),
                )
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)

    async def _read_body(self, receive) -> bytes | None:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


async def _send_json(send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _error_body(
    message: str, param: str | None, code: str, kind: str = "invalid_request_error", detail: Any = None
) -> dict:
    return {
        "error": {"message": message, "type": kind, "param": param, "code": code},
        "detail": detail if detail is not None else message,
    }


def _field_of(loc: Sequence[Any]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


# ---------------------------------------------------------------------------------------------- app
def create_app(pipeline: Any, config: ServerConfig = ServerConfig()) -> FastAPI:
    """A FastAPI app serving `pipeline`. Its batcher starts and stops with the app's lifespan."""
    metrics = Metrics(config.max_batch)
    defaults = Defaults.of(pipeline, steps=config.default_steps, sampler=config.default_sampler)
    warm_sizes = config.warm_sizes or ((defaults.width, defaults.height),)
    warm_shapes = [(defaults.steps, hh, ww, defaults.sampler) for ww, hh in warm_sizes] if config.warm else []
    batcher = Batcher(
        pipeline,
        metrics=metrics,
        max_batch=config.max_batch,
        batch_sizes=config.batch_sizes,
        window_s=config.batch_window_s,
        max_queue_images=config.max_queue_images,
        warm_shapes=warm_shapes,
        progress=config.progress,
    )
    state = {"draining": False}
    page = _page()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        try:
            yield
        finally:
            state["draining"] = True
            await batcher.stop(timeout_s=config.request_timeout_s)

    app = FastAPI(
        title="sdjax",
        version=_version(),
        lifespan=lifespan,
        description="Stable Diffusion in JAX: OpenAI- and AUTOMATIC1111-compatible image generation",
    )
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.state.pipeline = pipeline
    app.state.config = config

    # ------------------------------------------------------------------ errors
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = _field_of(first.get("loc", ()))
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message, field = f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}", "body"
        elif field is None:
            message, field = f"body: {msg}; send a JSON object", "body"
        else:
            message = f"{field}: {msg}"
        return JSONResponse(
            _error_body(
                message, field, first.get("type", "invalid"), detail=jsonable_encoder(errors, exclude={"input", "url"})
            ),
            status_code=422,
        )

    @app.exception_handler(FieldError)
    async def on_field_error(request: Request, exc: FieldError):
        detail = [{"loc": ["body", exc.field], "msg": exc.message, "type": "value_error"}]
        return JSONResponse(_error_body(str(exc), exc.field, "invalid_value", detail=detail), status_code=422)

    @app.exception_handler(QueueFull)
    async def on_queue_full(request: Request, exc: QueueFull):
        metrics.rejected.labels("queue_full").inc()
        return JSONResponse(
            _error_body(str(exc), None, "queue_full", kind="rate_limit_error"),
            status_code=429,
            headers={"Retry-After": str(exc.retry_after)},
        )

    @app.exception_handler(ShuttingDown)
    async def on_shutting_down(request: Request, exc: ShuttingDown):
        return JSONResponse(
            _error_body(str(exc), None, "shutting_down", kind="server_error"),
            status_code=503,
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(
            _error_body(f"{type(exc).__name__}: {exc}", None, "internal_error", kind="server_error"), status_code=500
        )

    # ------------------------------------------------------------------ generation
    async def run(request: GenerationRequest, task_id: str | None = None) -> tuple[list[ImageParameters], list[bytes]]:
        images = request.images()
        job = batcher.submit(images, task_id)
        try:
            arrays = await asyncio.wait_for(asyncio.shield(job.future), config.request_timeout_s)
        except TimeoutError:
            batcher.cancel(job)
            metrics.rejected.labels("timeout").inc()
            raise _Timeout(config.request_timeout_s) from None
        except ShuttingDown:
            raise
        except Exception as e:  # the pipeline raised for this batch; it was logged by the batcher
            raise _PipelineError(f"generation failed: {type(e).__name__}: {e}") from None
        metrics.images.inc(len(images))
        pngs = await asyncio.to_thread(_encode, arrays, images)
        return images, pngs

    @app.exception_handler(_Timeout)
    async def on_timeout(request: Request, exc: _Timeout):
        return JSONResponse(_error_body(str(exc), None, "timeout", kind="server_error"), status_code=504)

    @app.exception_handler(_PipelineError)
    async def on_pipeline_error(request: Request, exc: _PipelineError):
        return JSONResponse(_error_body(str(exc), None, "generation_failed", kind="server_error"), status_code=500)

    @app.post("/v1/images/generations", response_model=OpenAIImageResponse, summary="Create images (OpenAI images API)")
    async def openai_generations(body: OpenAIImageRequest) -> dict:
        request = resolve_openai(body, pipeline, config.limits, defaults, config.model_name)
        _, pngs = await run(request)
        return {"created": int(time.time()), "data": [{"b64_json": _b64(p)} for p in pngs]}

    @app.post(
        "/sdapi/v1/txt2img", response_model=A1111Txt2ImgResponse, summary="Text to image (AUTOMATIC1111 web UI API)"
    )
    async def a1111_txt2img(body: A1111Txt2ImgRequest) -> dict:
        request = resolve_a1111(body, pipeline, config.limits, defaults, config.model_name)
        images, pngs = await run(request, body.force_task_id)
        info = _a1111_info(request, images, body)
        return {
            "images": [_b64(p) for p in pngs] if body.send_images else [],
            "parameters": body.model_dump(),
            "info": json.dumps(info),
        }

    # ------------------------------------------------------------------ the rest
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse(page)

    @app.get("/health", summary="Readiness: 200 when compiled and serving")
    async def health():
        ready = batcher.ready and not state["draining"]
        body = {
            "status": "ok" if ready else ("draining" if state["draining"] else "warming"),
            "model": config.model_name,
            "queue_depth": batcher.queued_images,
            "busy": batcher.current is not None,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/config", summary="Defaults, limits and samplers (used by the web page)")
    async def server_config():
        return {
            "model": config.model_name,
            "samplers": list(pipeline.sampler_names),
            "sampler_labels": {name: sampler_display_name(name) for name in pipeline.sampler_names},
            "default_sampler": sampler_id(defaults.sampler),
            "default_steps": defaults.steps,
            "default_guidance_scale": defaults.guidance_scale,
            "default_width": defaults.width,
            "default_height": defaults.height,
            "limits": dataclasses.asdict(config.limits),
            "max_batch": config.max_batch,
            "batch_sizes": list(batcher.batch_sizes),
            "warm_sizes": [list(s) for s in warm_sizes] if config.warm else [],
        }

    @app.get("/v1/models", summary="The served model (OpenAI models API)")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "owned_by": "sdjax"}]}

    @app.get("/sdapi/v1/samplers", summary="Samplers (AUTOMATIC1111 API)")
    async def samplers():
        return [
            {"name": sampler_display_name(name), "aliases": [name], "options": {}} for name in pipeline.sampler_names
        ]

    @app.get("/sdapi/v1/sd-models", summary="The served model (AUTOMATIC1111 API)")
    async def sd_models():
        return [
            {
                "title": config.model_name,
                "model_name": config.model_name,
                "hash": None,
                "sha256": None,
                "filename": config.model_name,
                "config": None,
            }
        ]

    @app.get("/sdapi/v1/options", summary="Current options (AUTOMATIC1111 API; read-only here)")
    async def options():
        return {"sd_model_checkpoint": config.model_name, "samples_format": "png"}

    @app.get("/sdapi/v1/progress", summary="Progress of the running batch or of one task (AUTOMATIC1111 API)")
    async def progress(id_task: str | None = None):
        return _progress(batcher, id_task)

    return app


class _PipelineError(Exception):
    pass


class _Timeout(Exception):
    def __init__(self, seconds: float):
        super().__init__(f"no result within the request timeout of {seconds:g} s; the request was dropped")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _encode(arrays: np.ndarray, images: list[ImageParameters]) -> list[bytes]:
    return [png_bytes(a, im.infotext()) for a, im in zip(arrays, images)]


def _version() -> str:
    try:
        import sdjax

        return getattr(sdjax, "__version__", "0")
    except ImportError:
        return "0"


def _page() -> str:
    return importlib.resources.files("sdjax.server").joinpath("static/index.html").read_text("utf-8")


def _a1111_info(request: GenerationRequest, images: list[ImageParameters], body: A1111Txt2ImgRequest) -> dict:
    """The `info` object of AUTOMATIC1111's `Processed.js()`, with the keys clients read."""
    n = len(images)
    return {
        "prompt": request.prompt,
        "all_prompts": [im.prompt for im in images],
        "negative_prompt": request.negative_prompt,
        "all_negative_prompts": [im.negative_prompt for im in images],
        "seed": request.seed,
        "all_seeds": [im.seed for im in images],
        "subseed": -1,
        "all_subseeds": [-1] * n,
        "subseed_strength": 0,
        "width": request.width,
        "height": request.height,
        "sampler_name": sampler_display_name(request.sampler),
        "cfg_scale": request.guidance_scale,
        "steps": request.steps,
        "batch_size": body.batch_size,
        "restore_faces": False,
        "face_restoration_model": None,
        "sd_model_name": request.model,
        "sd_model_hash": None,
        "sd_vae_name": None,
        "sd_vae_hash": None,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": None,
        "extra_generation_params": {},
        "index_of_first_image": 0,
        "infotexts": [im.infotext() for im in images],
        "styles": [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
        "clip_skip": 1,
        "is_using_inpainting_conditioning": False,
        "version": f"sdjax {_version()}",
    }


def _progress(batcher: Batcher, id_task: str | None) -> dict:
    """AUTOMATIC1111's `ProgressResponse` (`progress`, `eta_relative`, `state`, `current_image`, `textinfo`),
    plus `stage` and `queue_position` (images ahead of the task)."""
    current = batcher.current
    where, ahead = (
        ("running", 0)
        if id_task is None and current is not None
        else (batcher.position(id_task) if id_task is not None else ("idle", 0))
    )
    fraction, eta, stage, step, total = 0.0, 0.0, where, 0, 0
    if where == "running" and current is not None:
        stage, step, total = current.stage, current.step, current.total
        fraction = step / total if total else 0.0
        if stage == "decode":
            fraction = 1.0
        elapsed = time.monotonic() - current.started
        eta = elapsed / fraction - elapsed if fraction > 0 else 0.0
    text = {
        "queued": f"queued: {ahead} images ahead",
        "running": f"{stage} {step}/{total}",
        "idle": "idle",
        "unknown": "no such task (finished or never queued)",
    }.get(where, where)
    return {
        "progress": round(fraction, 4),
        "eta_relative": round(eta, 3),
        "state": {
            "skipped": False,
            "interrupted": False,
            "job": id_task or "",
            "job_count": 1 if current else 0,
            "job_timestamp": "",
            "job_no": 0,
            "sampling_step": step,
            "sampling_steps": total,
        },
        "current_image": None,
        "textinfo": text,
        "stage": stage,
        "queue_position": ahead,
        "queue_depth": batcher.queued_images,
    }


# ---------------------------------------------------------------------------------------------- running
def build_asgi(pipeline: Any, config: ServerConfig = ServerConfig()):
    """The app wrapped in the metrics and body-limit layer: what uvicorn serves."""
    app = create_app(pipeline, config)
    guarded = _Guard(app, app.state.metrics, config.max_body_bytes)
    guarded.state = app.state  # for tests and callers
    guarded.fastapi = app
    return guarded


def serve(
    pipeline: Any,
    config: ServerConfig = ServerConfig(),
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests finish first (up to the request timeout)."""
    import uvicorn

    uv_config = uvicorn.Config(
        build_asgi(pipeline, config),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(config.request_timeout_s) + 5,
        access_log=False,
    )
    server = uvicorn.Server(uv_config)
    server.run()
