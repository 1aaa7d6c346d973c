"""The app's exception handlers: every error answered in the shape of its API (`server.errors`), counted in the
metrics where it is a rejection (over budget, queue full), a 500 naming only the request id."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sdjax.server.batching import QueueFull, ShuttingDown
from sdjax.server.errors import APIError, ClientGone, error_body, internal_error
from sdjax.server.guard import request_id_of
from sdjax.server.metrics import Metrics

log = logging.getLogger("sdjax.server")


def answer(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, error), status_code=error.status, headers=error.headers)


def install_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Install on `app` the handlers of validation and HTTP errors, `APIError`, a full queue, shutdown, a client
    gone, and any other exception."""

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
        log.info(
            "422 %s (request id %s)", jsonable_encoder(errors, exclude={"input", "url"}), request_id_of(request.scope)
        )
        return answer(request, APIError(422, message, field, code=str(first.get("type", "invalid"))))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        messages = {
            400: "the request body could not be parsed (send UTF-8 JSON)",
            404: f"no such endpoint: {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        message = messages.get(exc.status_code, str(exc.detail))
        code = {400: "malformed_body", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        param = "body" if exc.status_code == 400 else None
        return answer(request, APIError(exc.status_code, message, param, code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        if exc.code == "over_budget":
            metrics.rejected.labels("over_budget").inc()
        return answer(request, exc)

    @app.exception_handler(QueueFull)
    async def on_queue_full(request: Request, exc: QueueFull):
        metrics.rejected.labels("queue_full").inc()
        return answer(
            request,
            APIError(429, str(exc), None, "queue_full", "rate_limit_error", {"Retry-After": str(exc.retry_after)}),
        )

    @app.exception_handler(ShuttingDown)
    async def on_shutting_down(request: Request, exc: ShuttingDown):
        return answer(request, APIError(503, str(exc), None, "shutting_down", "server_error", {"Retry-After": "5"}))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        request_id = request_id_of(request.scope)
        log.error("request failed (request id %s)", request_id, exc_info=exc)
        return answer(request, internal_error(request_id))

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it; counted in the metrics


def _field_of(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None
