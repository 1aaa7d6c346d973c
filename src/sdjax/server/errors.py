"""One error shape per API, for every error the server answers (validation, parsing, limits, auth, 404, 500).

- OpenAI paths (`/v1/*`, and every path that is not AUTOMATIC1111's): `{"error": {"message", "type", "param",
  "code"}}`, the shape of the OpenAI API's errors (`type` is e.g. "invalid_request_error", "server_error").
- AUTOMATIC1111 paths (`/sdapi/*`): `{"error", "detail", "body", "errors"}`, the shape of the web UI's
  `api_middleware.handle_exception` (`error` is an exception kind, `detail` and `errors` the message; `body` is
  always "" here: the request body is never echoed back).

Every message names the offending field, header or limit. A 500 never carries the exception text: it names the
request id (also in the `X-Request-ID` header) under which the traceback was logged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

A1111_PREFIX = "/sdapi/"


@dataclasses.dataclass
class APIError(Exception):
    """An error answered with `status`; `param` names the offending field (OpenAI's `param`)."""

    status: int
    message: str
    param: str | None = None
    code: str = "invalid_request"
    kind: str = "invalid_request_error"  # OpenAI's error `type`
    headers: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class ClientGone(Exception):
    """The client disconnected while its request waited (answered 499, which nobody reads)."""


def is_a1111(path: str) -> bool:
    return path.startswith(A1111_PREFIX)


def _a1111_kind(error: APIError) -> str:
    """The exception class name AUTOMATIC1111 would report."""
    if error.status in (400, 422) and error.code not in ("request_too_large",):
        return "RequestValidationError"
    return "HTTPException"


def error_body(path: str, error: APIError) -> dict:
    """The JSON body of `error` in the shape of the API that `path` belongs to."""
    if is_a1111(path):
        return {"error": _a1111_kind(error), "detail": error.message, "body": "", "errors": error.message}
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


def error_bytes(path: str, error: APIError) -> bytes:
    return json.dumps(error_body(path, error)).encode()


async def send_error(send, path: str, error: APIError, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer `error` on a raw ASGI `send` (for the layers below FastAPI's handlers); closes the connection."""
    data = error_bytes(path, error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"connection", b"close"),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def internal_error(request_id: str) -> APIError:
    return APIError(
        500,
        f"internal server error; it was logged under request id {request_id} (X-Request-ID)",
        code="internal_error",
        kind="server_error",
    )
