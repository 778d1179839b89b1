"""The four progress POSTs, served as plain ASGI in front of FastAPI.

This is the hot path: ~12 requests per minute per active listener. FastAPI's per-request
dependency and serialisation machinery costs more than the work itself, so these routes are
answered here, with the same models, the same errors and the same OpenAPI description
(`service/api/openapi.py`), and everything else falls through to the FastAPI app.
"""

import asyncio
import json
import logging
import time

from pydantic import ValidationError

from service import metrics
from service.api.catalog import ContentCatalog, LookupsSaturated
from service.api.ratelimit import RateLimiter, retry_after_header
from service.asgi import ASGIApp, Receive, Scope, Send
from service.auth import Authenticator, AuthError
from service.progress.buffer import receive_ms
from service.progress.content import CONTENT_KINDS, KIND_BY_PATH, ContentKind
from service.progress.sink import HeartbeatSink, Unavailable

log = logging.getLogger(__name__)

CREATED_BODY = b'{"data":true}'
_CREATED_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(CREATED_BODY)).encode())]


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    """The client hung up mid-body: nothing to store and nobody to answer."""


class _Answer(Exception):
    """An early answer with extra headers (429 Retry-After, 408 Connection: close)."""

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.body, self.headers = status, body, headers


# at most one log line per interval while heartbeats are refused: an outage is thousands per second
_REFUSAL_LOG_INTERVAL_S = 10.0


def _error_body(detail: object) -> bytes:
    return json.dumps({"detail": detail}, separators=(",", ":")).encode()


def _validation_detail(exc: ValidationError) -> list[dict[str, object]]:
    return [
        {"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]}
        for err in exc.errors(include_url=False, include_context=False, include_input=False)
    ]


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def identify(authenticator: Authenticator, headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """(user id, declared content length) of a request; AuthError when it does not prove one user.

    The content type is not checked: the body is JSON by contract, whatever the app's builds
    declare, and refusing one would cost real heartbeats; the body is validated all the same.
    """
    # only the header of the configured mode names the user: a gateway that authenticates may still
    # forward Authorization, and a JWT deployment ignores a user header nobody vouches for
    identity_name = authenticator.gateway_header if authenticator.use_gateway else b"authorization"
    identity: bytes | None = None
    identity_headers = 0
    declared_length = 0
    for name, value in headers:
        if name == identity_name:
            identity = value
            identity_headers += 1
        elif name == b"content-length":
            declared_length = int(value) if value.isdigit() else 0
    if identity_headers > 1:
        # which of two would be the user is the proxy's guess, not ours
        raise AuthError(f"more than one {identity_name.decode('latin-1')} header")
    if authenticator.use_gateway:
        return authenticator.user_id(None, identity), declared_length
    return authenticator.user_id(identity, None), declared_length


async def read_body_within(receive: Receive, *, limit: int, timeout_s: float) -> bytes:
    """The whole body, or _BodyTooLarge, or _Answer 408 (closing the connection) past `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(receive, limit)
    except TimeoutError:
        # a client trickling its body holds a socket and a request: cut it off and close the connection
        metrics.REFUSED.labels("body_timeout").inc()
        raise _Answer(408, _error_body(f"body not received within {timeout_s:g} s"),
                      [(b"connection", b"close")]) from None  # fmt: skip


class ProgressIngest:
    """ASGI middleware: POSTs to the four progress routes end here; anything else goes on to `reads`, then `app`."""

    def __init__(self, app: ASGIApp, *, authenticator: Authenticator, max_body_bytes: int,
                 body_read_timeout_s: float = 10.0, limiter: RateLimiter | None = None,
                 reads: ASGIApp | None = None) -> None:  # fmt: skip
        self.app = app
        # the progress reads and sync (service/api/reads.py), in front of `app` for what they do not serve
        self._next = reads or app
        self.authenticator = authenticator
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.limiter = limiter
        self.sink: HeartbeatSink | None = None  # set by the lifespan once its clients exist
        self.catalog: ContentCatalog | None = None  # likewise; None: every id is accepted
        self._refused_since_log = 0
        self._refusal_logged_at = -_REFUSAL_LOG_INTERVAL_S
        self._requests = {
            (kind.path, status): metrics.HTTP_REQUESTS.labels(kind.path, str(status))
            for kind in CONTENT_KINDS
            for status in (201, 400, 401, 404, 405, 408, 413, 422, 429, 503)
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = KIND_BY_PATH.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None:
            await self._next(scope, receive, send)
            return
        extra_headers: list[tuple[bytes, bytes]] = []
        try:
            status, body = await self._handle(kind, scope, receive)
        except _ClientGone:
            return
        except _Answer as answer:
            status, body, extra_headers = answer.status, answer.body, answer.headers
        if status == 201:
            headers = _CREATED_HEADERS
        else:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       *extra_headers]  # fmt: skip
            if status == 405:
                headers.append((b"allow", b"POST"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._requests[(kind.path, status)].inc()

    async def _handle(self, kind: ContentKind, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        if scope["method"] != "POST":
            return 405, _error_body("method not allowed: use POST")
        try:
            user_id, declared_length = identify(self.authenticator, scope["headers"])
        except AuthError as exc:
            return 401, _error_body(str(exc))
        if self.limiter is not None:
            retry_after_s = self.limiter.allow(user_id)
            if retry_after_s is not None:
                metrics.REFUSED.labels("rate_limited").inc()
                raise _Answer(429, _error_body("too many heartbeats from this user, retry later"),
                              [(b"retry-after", retry_after_header(retry_after_s))])  # fmt: skip
        if declared_length > self.max_body_bytes:
            return 413, _error_body(f"body larger than {self.max_body_bytes} bytes")
        try:
            raw = await read_body_within(receive, limit=self.max_body_bytes, timeout_s=self.body_read_timeout_s)
        except _BodyTooLarge:
            return 413, _error_body(f"body larger than {self.max_body_bytes} bytes")
        try:
            heartbeat = kind.body.model_validate_json(raw)
        except ValidationError as exc:
            detail = _validation_detail(exc)
            # unparseable JSON is a malformed request; a parsed body with wrong fields is unprocessable
            status = 400 if any(err["type"] == "json_invalid" for err in detail) else 422
            return status, _error_body(detail)
        sink = self.sink  # once: the lifespan may take it away while the catalog lookup below waits
        if sink is None:
            return 503, _error_body("service starting or stopping, retry later")
        content_id: int = getattr(heartbeat, kind.id_column)
        if self.catalog is not None:
            known = self.catalog.is_known(kind, content_id)
            if not isinstance(known, bool):  # not in memory: one shared lookup
                try:
                    known = await known
                except LookupsSaturated as exc:
                    return 503, _error_body(f"cannot check {kind.id_column} now ({exc}), retry later")
            if not known:
                metrics.REFUSED.labels("unknown_content").inc()
                return 404, _error_body(f"unknown {kind.id_column} {content_id}")
        try:
            await sink.write(kind, content_id=content_id, user_id=user_id, position=heartbeat.position,
                             received_ms=receive_ms())  # fmt: skip
        except Unavailable as exc:
            self._log_refusal(kind, exc)
            return 503, _error_body(str(exc))
        return 201, CREATED_BODY

    def _log_refusal(self, kind: ContentKind, exc: Unavailable) -> None:
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= _REFUSAL_LOG_INTERVAL_S:
            log.warning("heartbeats refused with 503: %s", exc,
                        extra={"content_type": kind.name, "count": self._refused_since_log})  # fmt: skip
            self._refused_since_log = 0
            self._refusal_logged_at = now
