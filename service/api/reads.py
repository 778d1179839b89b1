"""Reading progress back and the offline sync, served as plain ASGI in front of FastAPI like the heartbeats.

A screen that reads through this service asks as often as the app sends heartbeats, and the read
must cost no more than the heartbeat it answers for: FastAPI's per-request machinery would cost
more than the work, so these three routes are answered here, with the same auth and error shapes
as `ingest.py`, and documented in the OpenAPI document by `service/api/openapi.py`.
"""

import json
import logging
from collections.abc import Callable
from urllib.parse import parse_qsl

from prometheus_client import Counter
from pydantic import ValidationError

from service import metrics
from service.api.ingest import (
    _Answer,
    _BodyTooLarge,
    _ClientGone,
    _error_body,
    _validation_detail,
    identify,
    read_body_within,
)
from service.api.ratelimit import RateLimiter, retry_after_header
from service.asgi import ASGIApp, Receive, Scope, Send
from service.auth import Authenticator, AuthError
from service.progress.buffer import now_ms
from service.progress.content import MAX_ID, ContentKind
from service.progress.reads import Progress, ProgressReader
from service.progress.sync import KIND_BY_NAME, OfflineSync, SyncRequest
from service.stores import POSTGRES_FAILED, REDIS_FAILED

log = logging.getLogger(__name__)

PREFIX = "/progress/"
ONE_ROUTE = "/progress/{content_type}/{content_id}"
MANY_ROUTE = "/progress/{content_type}"
SYNC_ROUTE = "/progress/sync"
MAX_IDS = 100

# The sync's items against their own per-user cap: called with (user id, number of items) once the
# body is parsed, before anything is written; None lets the request through, a number refuses it
# with 429 and that many seconds in Retry-After. (The request itself is one call against `limiter`,
# charged before its body is read.)
SyncLimit = Callable[[int, int], float | None]


def sync_items_limit(items: RateLimiter) -> SyncLimit:
    def check(user_id: int, item_count: int) -> float | None:
        return items.allow(user_id, cost=item_count)

    return check

_STORES_DOWN = (*REDIS_FAILED, *POSTGRES_FAILED)


class _Refused(Exception):
    def __init__(self, status: int, detail: object, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status = status
        self.detail = detail
        self.headers = headers or []


def _invalid(location: str, name: str, message: str, error_type: str) -> _Refused:
    return _Refused(422, [{"loc": [location, name], "msg": message, "type": error_type}])


def _route(path: str) -> tuple[str, list[str]] | None:
    if not path.startswith(PREFIX):
        return None
    parts = path[len(PREFIX) :].split("/")
    if parts == ["sync"]:
        return SYNC_ROUTE, parts
    if len(parts) == 1:
        return MANY_ROUTE, parts
    if len(parts) == 2:
        return ONE_ROUTE, parts
    return None


def _content_id(text: str, location: str, name: str) -> int:
    # digits only: no sign, no spaces, no "1.0"; bounded before int() (it refuses > 4300 digits)
    if text.isascii() and text.isdigit() and len(text) <= 20 and 1 <= int(text) <= MAX_ID:
        return int(text)
    raise _invalid(location, name, f"must be an integer from 1 to {MAX_ID}", "int_parsing")


def _kind(name: str) -> ContentKind:
    kind = KIND_BY_NAME.get(name)
    if kind is None:
        raise _invalid("path", "content_type", f"must be one of {', '.join(KIND_BY_NAME)}", "enum")
    return kind


def _ids(query_string: bytes) -> list[int]:
    values = [value for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
              if name == "ids"]  # fmt: skip
    if not values:
        raise _invalid("query", "ids", "Field required: ids=1,2,3", "missing")
    if len(values) > 1:
        raise _invalid("query", "ids", "give ids once, comma-separated: ids=1,2,3", "value_error")
    texts = values[0].split(",")
    if len(texts) > MAX_IDS:
        raise _invalid("query", "ids", f"at most {MAX_IDS} ids", "too_long")
    # a repeated id is one id
    return list(dict.fromkeys(_content_id(text, "query", "ids") for text in texts))


def _progress_json(kind: ContentKind, progress: Progress) -> dict[str, object]:
    return {
        "content_type": kind.name,
        "content_id": progress.content_id,
        "position": progress.position,
        "updated_at": progress.updated_at.isoformat(),
        "completed_at": progress.completed_at.isoformat() if progress.completed_at is not None else None,
    }


def _json(data: object) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


class ProgressReads:
    """ASGI middleware: the three /progress routes end here; anything else goes to `app`."""

    def __init__(self, app: ASGIApp, *, authenticator: Authenticator, max_body_bytes: int,
                 body_read_timeout_s: float = 10.0, limiter: RateLimiter | None = None) -> None:  # fmt: skip
        self.app = app
        self.authenticator = authenticator
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.limiter = limiter  # per user: a read or a sync is one call against it
        # set by the lifespan once its clients exist; None without a database
        self.reader: ProgressReader | None = None
        self.sync: OfflineSync | None = None
        self.sync_items_limit: SyncLimit | None = None  # the items' own per-user cap
        self._requests: dict[tuple[str, int], Counter] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = _route(scope["path"]) if scope["type"] == "http" else None
        if found is None:
            await self.app(scope, receive, send)
            return
        route, parts = found
        headers = [(b"content-type", b"application/json")]
        if route != SYNC_ROUTE:
            # another device may move it any second, and a 404 "no progress" is no more lasting
            headers.append((b"cache-control", b"no-store"))
        try:
            status, body = await self._handle(route, parts, scope, receive)
        except _Refused as refused:
            status, body = refused.status, _error_body(refused.detail)
            headers.extend(refused.headers)
        except _Answer as answer:  # the body read's deadline (408)
            status, body = answer.status, answer.body
            headers.extend(answer.headers)
        except _ClientGone:
            return
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._counter(route, status).inc()

    def _counter(self, route: str, status: int) -> Counter:
        counter = self._requests.get((route, status))
        if counter is None:
            counter = self._requests[(route, status)] = metrics.HTTP_REQUESTS.labels(route, str(status))
        return counter

    async def _handle(self, route: str, parts: list[str], scope: Scope, receive: Receive) -> tuple[int, bytes]:
        method = "POST" if route == SYNC_ROUTE else "GET"
        if scope["method"] != method:
            raise _Refused(405, f"method not allowed: use {method}", [(b"allow", method.encode())])
        try:
            user_id, declared_length = identify(self.authenticator, scope["headers"])
        except AuthError as exc:
            raise _Refused(401, str(exc)) from None
        if route == SYNC_ROUTE:
            return await self._sync(user_id, declared_length, receive)
        self._charge_call(user_id)
        kind = _kind(parts[0])
        if route == ONE_ROUTE:
            content_id = _content_id(parts[1], "path", "content_id")
            found = await self._read(kind, user_id, [content_id])
            if not found:
                raise _Refused(404, f"no progress for {kind.name} {content_id}")
            return 200, _json(_progress_json(kind, found[0]))
        found = await self._read(kind, user_id, _ids(scope["query_string"]))
        return 200, _json({"data": [_progress_json(kind, progress) for progress in found]})

    def _charge_call(self, user_id: int) -> None:
        """One call against the heartbeats' per-user limit; 429 with Retry-After past it."""
        if self.limiter is not None and (retry_after_s := self.limiter.allow(user_id)) is not None:
            metrics.REFUSED.labels("rate_limited").inc()
            raise _Refused(429, "too many requests from this user, retry later",
                           [(b"retry-after", retry_after_header(retry_after_s))])  # fmt: skip

    async def _read(self, kind: ContentKind, user_id: int, content_ids: list[int]) -> list[Progress]:
        if self.reader is None:
            raise _Refused(503, "progress reads need the database (DATABASE_URL), or the service is starting")
        try:
            return await self.reader.read(kind, user_id, content_ids)
        except _STORES_DOWN as exc:
            log.warning("progress read failed: %s: %s", type(exc).__name__, exc)
            raise _Refused(503, "progress store unavailable, retry later") from exc

    async def _sync(self, user_id: int, declared_length: int, receive: Receive) -> tuple[int, bytes]:
        # the call is charged before the body is read, as for a heartbeat: a flood of bodies, valid or
        # not, costs its sender the limit, not this process its parsing
        self._charge_call(user_id)
        too_large = _Refused(413, f"body larger than {self.max_body_bytes} bytes")
        if declared_length > self.max_body_bytes:
            raise too_large
        try:
            raw = await read_body_within(receive, limit=self.max_body_bytes, timeout_s=self.body_read_timeout_s)
        except _BodyTooLarge:
            raise too_large from None
        try:
            request = SyncRequest.model_validate_json(raw)
        except ValidationError as exc:
            detail = _validation_detail(exc)
            raise _Refused(400 if any(err["type"] == "json_invalid" for err in detail) else 422, detail) from None
        if self.sync is None:
            raise _Refused(503, "offline sync needs the database (DATABASE_URL), or the service is starting")
        if self.sync_items_limit is not None:
            retry_after_s = self.sync_items_limit(user_id, len(request.items))
            if retry_after_s is not None:
                metrics.REFUSED.labels("rate_limited").inc()
                raise _Refused(429, "too many requests from this user, retry later",
                               [(b"retry-after", retry_after_header(retry_after_s))])  # fmt: skip
        try:
            outcomes = await self.sync.apply(user_id, request.items, now_ms=now_ms())
        except _STORES_DOWN as exc:
            log.warning("offline sync failed: %s: %s", type(exc).__name__, exc)
            raise _Refused(503, "progress store unavailable, retry later") from exc
        return 200, _json({"items": [{"applied": o.applied, "reason": o.reason} for o in outcomes]})

