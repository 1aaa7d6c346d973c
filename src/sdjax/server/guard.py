"""The layers around the app that no request can get past: connection timeouts, body limits, auth, request ids.

`Guard` (an ASGI middleware, the outermost layer but CORS):
- gives every request an id (the client's `X-Request-ID` if it is short and plain, else a new one), returned in
  the `X-Request-ID` header of every response and named in the log and in 500 messages;
- checks credentials (`Auth`) before anything else is read: an OpenAI `Authorization: Bearer <key>` or an
  AUTOMATIC1111 `Authorization: Basic` user:password pair, compared in constant time (`hmac.compare_digest`);
- reads the whole body itself, before the app sees it, within a size limit (413 as soon as the declared
  Content-Length or the bytes received pass it) and a time limit (`body_timeout_s` for the whole body, however
  slowly it trickles): a body that stops short of its Content-Length is refused with 400, a chunked body that does
  not finish in time with 408, and a client that disconnects mid-body is dropped without reaching the app;
- counts requests and latency by endpoint and status for /metrics, and turns any exception that escaped the app
  into a 500 without internals.

`protocol_class` wraps uvicorn's HTTP protocol: a connection that has not sent a complete request head within
`header_timeout_s` (of being opened or of its last response) is closed (uvicorn itself has no such limit, so a
client that sends its headers slowly kept a connection and a descriptor open forever); and a malformed request
line or header gets a JSON 400 in the OpenAI error shape instead of uvicorn's plain text. End of stream from the
client still closes the connection (as in uvicorn): that is how a disconnect is noticed and its work cancelled, so
a client that half-closes after a truncated body gets no answer (and nothing of it reaches the app).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence

from sdjax.server.errors import APIError, error_bytes, internal_error, is_a1111, send_error
from sdjax.server.metrics import Metrics

log = logging.getLogger("sdjax.server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
REQUEST_ID_KEY = "sdjax.request_id"  # where the id lives in the ASGI scope

# Paths that answer without credentials: the page (static, no data), health probes, the API docs, and the files
# route, whose unguessable ids are the credential (as OpenAI's signed image URLs are).
PUBLIC_PATHS = frozenset({"/", "/health", "/health/live", "/health/ready", "/docs", "/openapi.json", "/favicon.ico"})
PUBLIC_PREFIXES = ("/docs/", "/v1/files/")


@dataclasses.dataclass(frozen=True)
class Auth:
    """Credentials the server accepts: an API key (OpenAI's `Authorization: Bearer <key>`) and/or user:password
    pairs (AUTOMATIC1111's `--api-auth`, HTTP basic auth). Either is accepted on every protected path."""

    api_key: str | None = None
    users: tuple[tuple[str, str], ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.api_key) or bool(self.users)

    def allows(self, authorization: str | None) -> bool:
        if not authorization:
            return False
        scheme, _, value = authorization.strip().partition(" ")
        scheme, value = scheme.lower(), value.strip()
        if scheme == "bearer" and self.api_key:
            return hmac.compare_digest(value.encode(), self.api_key.encode())
        if scheme == "basic" and self.users:
            try:
                user, sep, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            ok = False
            for u, p in self.users:  # no early exit: the time taken does not depend on which pair matched
                same_user = hmac.compare_digest(user.encode(), u.encode())
                same_password = hmac.compare_digest(password.encode(), p.encode())
                ok |= bool(sep) and same_user and same_password
            return ok
        return False

    def challenge(self) -> str:
        return 'Basic realm="sdjax"' if self.users else "Bearer"

    @staticmethod
    def parse_user(text: str) -> tuple[str, str]:
        """ "user:password" -> (user, password); ValueError naming what is wrong."""
        user, sep, password = text.partition(":")
        if not sep or not user or not password:
            raise ValueError(f"{text!r} is not user:password (both non-empty)")
        return user, password


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def request_id_of(scope) -> str:
    return scope.get(REQUEST_ID_KEY, "-")


class Guard:
    """ASGI middleware: request id, auth, bounded body reading, metrics, last-resort 500 (see module docstring)."""

    def __init__(
        self,
        app,
        *,
        metrics: Metrics,
        endpoints: Sequence[str],
        max_body_bytes: int,
        body_timeout_s: float,
        auth: Auth = Auth(),
        image_body_bytes: tuple[Sequence[str], int] = ((), 0),
    ):
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)
        self.max_body_bytes = max_body_bytes
        self.image_paths = frozenset(image_body_bytes[0])  # these may carry images: a larger limit
        self.image_body_bytes = max(image_body_bytes[1], max_body_bytes)
        self.body_timeout_s = body_timeout_s
        self.auth = auth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = _headers(scope)
        given = headers.get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex[:16]
        scope[REQUEST_ID_KEY] = request_id
        endpoint = path if path in self.endpoints else ("/v1/files" if path.startswith("/v1/files/") else "other")
        status = {"code": 500, "started": False}
        t0 = time.perf_counter()

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        self.metrics.in_flight.inc()
        try:
            if self.auth.enabled and not is_public(path) and not self.auth.allows(headers.get("authorization")):
                self.metrics.rejected.labels("unauthorized").inc()
                await send_error(send_tagged, path, _unauthorized(path, self.auth))
                return
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, headers, receive)
                if isinstance(body, APIError):
                    self.metrics.rejected.labels(body.code).inc()
                    await send_error(send_tagged, path, body)
                    return
                if body is None:  # the client went away mid-body: nothing reaches the app, nobody to answer
                    self.metrics.rejected.labels("disconnected").inc()
                    status["code"] = 499
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send_tagged)
        except Exception:  # the app's handlers answered already if they could; never let it reach uvicorn
            log.exception("unhandled error (request id %s)", request_id)
            if not status["started"]:
                await send_error(send_tagged, path, internal_error(request_id))
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)

    async def _read_body(self, scope, headers: dict[str, str], receive) -> bytes | APIError | None:
        """The whole body; an `APIError` (400, 408, 413) if it is malformed, late or too large; None if the client
        disconnected before it was complete."""
        limit = self.image_body_bytes if scope.get("path", "") in self.image_paths else self.max_body_bytes
        declared: int | None = None
        if "content-length" in headers:
            try:
                declared = int(headers["content-length"])
                if declared < 0:
                    raise ValueError
            except ValueError:
                return APIError(400, f"Content-Length {headers['content-length']!r} is not a byte count", "body")
            if declared > limit:
                return _too_large(limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                if declared is not None:
                    return APIError(
                        400,
                        f"truncated body: {size} of {declared} bytes (Content-Length) arrived within the body "
                        f"timeout of {self.body_timeout_s:g} s",
                        "body",
                        code="truncated_body",
                    )
                return APIError(
                    408,
                    f"the request body did not finish within the body timeout of {self.body_timeout_s:g} s "
                    f"({size} bytes arrived)",
                    "body",
                    code="body_timeout",
                )
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _too_large(limit)
            chunks.append(chunk)
            more = message.get("more_body", False)
        if declared is not None and size != declared:  # the server layer normally enforces this; be explicit
            return APIError(
                400, f"truncated body: {size} of {declared} bytes (Content-Length)", "body", "truncated_body"
            )
        return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", "body", code="request_too_large")


def _unauthorized(path: str, auth: Auth) -> APIError:
    if is_a1111(path):
        message = "Incorrect username or password"  # AUTOMATIC1111's words
    else:
        message = "authorization: missing or incorrect credentials; send the header Authorization: Bearer <API key>"
    if auth.users and not is_a1111(path):
        message += " or HTTP basic auth"
    return APIError(
        401, message, "authorization", code="invalid_api_key", headers={"WWW-Authenticate": auth.challenge()}
    )


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _replay(body: bytes, receive):
    """A `receive` that gives the body read by the guard once, then the connection's own messages (so the app
    still learns of a disconnect while it waits for a result)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# ---------------------------------------------------------------------------------------------- uvicorn protocol
def protocol_class(header_timeout_s: float, base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with a request-head deadline, kept
    half-closed connections and JSON 400s; pass it as `uvicorn.Config(http=...)`."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base

    class GuardedProtocol(base):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def handle_websocket_upgrade(self, *args):
            # The connection becomes a websocket (ComfyUI's /ws): no more request heads on it, so no deadline
            # (the timer used to close every websocket header_timeout_s after it opened).
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().handle_websocket_upgrade(*args)

        def send_400_response(self, msg: str) -> None:
            error = APIError(400, f"malformed HTTP request: {msg}", None, code="malformed_request")
            data = error_bytes("/", error)
            head = (
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                + f"content-length: {len(data)}\r\n\r\n".encode()
            )
            self.transport.write(head + data)
            self.transport.close()

        def _arm_head_timer(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_deadline)

        def _head_deadline(self):
            if self.transport.get_protocol() is not self:  # upgraded (a websocket): not this protocol's any more
                return
            cycle = getattr(self, "cycle", None)
            if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()  # no request head in time (or none since the last response)

    return GuardedProtocol


def call_when_exiting(server_cls: type, on_exit: Callable[[], None]) -> type:
    """A `uvicorn.Server` subclass that calls `on_exit()` when SIGINT/SIGTERM arrives (before draining)."""

    class Server(server_cls):
        def handle_exit(self, sig, frame):
            try:
                on_exit()
            finally:
                super().handle_exit(sig, frame)

    return Server
