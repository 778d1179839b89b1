"""The four progress POSTs, served as plain ASGI (the route table, `routes.py`, sends them here).

This is the hot path: ~12 requests per minute per active listener. FastAPI's per-request
dependency and serialisation machinery costs more than the work itself, so these routes are
answered here, with the same models and the same errors, as `openapi.yaml` describes them.
"""

import logging
import time

from service import metrics
from service.api.catalog import ContentCatalog, LookupsSaturated
from service.api.http import (
    Answer,
    Headers,
    HttpError,
    answer_of,
    check_method,
    identify,
    parse_json,
    read_body,
    requests_total,
    respond,
    too_large,
)
from service.asgi import Receive, Scope, Send
from service.auth import Authenticator
from service.progress.content import CONTENT_KINDS, ContentKind
from service.progress.ingest.sink import HeartbeatSink, Unavailable

log = logging.getLogger(__name__)

_CREATED_BODY = b'{"data":true}'

# at most one log line per interval while heartbeats are refused: an outage is thousands per second
_REFUSAL_LOG_INTERVAL_S = 10.0


class ProgressIngest:
    """The four heartbeat routes: `answer(kind, ...)` is each one's ASGI handler.

    No per-user limit: every heartbeat of real content overwrites its own key, so a flood grows nothing,
    and a limit here could refuse a burst's last position, the one that completes the content. Request
    rates are the API gateway's to limit (docs/deploy.md).
    """

    max_body_bytes = 4096  # larger: 413 (a heartbeat is under 200 bytes)
    body_read_timeout_s = 10.0  # not all received by then: 408, connection closed (a byte a second)

    def __init__(self, sink: HeartbeatSink, *, authenticator: Authenticator, catalog: ContentCatalog | None) -> None:
        self.sink = sink
        self.authenticator = authenticator
        self.catalog = catalog  # None: the door is off, every id is accepted
        self._refused_since_log = 0
        self._refusal_logged_at = -_REFUSAL_LOG_INTERVAL_S
        for kind in CONTENT_KINDS:  # every answer's series exported from the start, at 0
            for status in (201, 400, 401, 404, 405, 408, 413, 422, 500, 503):
                requests_total(kind.path, status)

    async def answer(self, kind: ContentKind, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI way in: the route table's handler (every request the server's own protocol does not answer)."""
        await respond(send, kind.path, self._asgi(kind, scope, receive), status=201)

    async def answer_received(self, kind: ContentKind, headers: Headers, body: bytes) -> Answer | None:
        """The other way in: a POST whose whole body has arrived, answered by the server's protocol without ASGI
        (service/api/protocol.py)."""
        return await answer_of(kind.path, self._handle(kind, headers, body), status=201)

    async def _asgi(self, kind: ContentKind, scope: Scope, receive: Receive) -> bytes:
        check_method(scope["method"], "POST")
        user_id, declared_length = identify(self.authenticator, scope["headers"])
        body = await read_body(receive, declared_length, limit=self.max_body_bytes, timeout_s=self.body_read_timeout_s)
        return await self._store(kind, user_id, body)

    async def _handle(self, kind: ContentKind, headers: Headers, body: bytes) -> bytes:
        user_id, declared_length = identify(self.authenticator, headers)
        if max(declared_length, len(body)) > self.max_body_bytes:
            raise too_large(self.max_body_bytes)
        return await self._store(kind, user_id, body)

    async def _store(self, kind: ContentKind, user_id: int, body: bytes) -> bytes:
        """The 201's body once the heartbeat `body` of `user_id` is stored; raises HttpError for any other answer."""
        heartbeat = parse_json(kind.body, body)
        content_id: int = getattr(heartbeat, kind.id_column)
        if self.catalog is not None:
            known = self.catalog.is_known(kind, content_id)
            if not isinstance(known, bool):  # not in memory: one shared lookup
                try:
                    known = await known
                except LookupsSaturated as exc:
                    raise HttpError(503, f"cannot check {kind.id_column} now ({exc}), retry later") from None
            if not known:
                metrics.REFUSED.labels("unknown_content").inc()
                raise HttpError(404, f"unknown {kind.id_column} {content_id}")
        try:
            await self.sink.write(kind, content_id=content_id, user_id=user_id, position=heartbeat.position)
        except Unavailable as exc:
            self._log_refusal(kind, exc)
            raise HttpError(503, str(exc)) from None
        return _CREATED_BODY

    def _log_refusal(self, kind: ContentKind, exc: Unavailable) -> None:
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= _REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "heartbeats refused with 503: %s",
                exc,
                extra={"content_type": kind.name, "count": self._refused_since_log},
            )
            self._refused_since_log = 0
            self._refusal_logged_at = now
