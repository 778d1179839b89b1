"""The four progress POSTs, served as plain ASGI in front of FastAPI.

This is the hot path: ~12 requests per minute per active listener. FastAPI's per-request
dependency and serialisation machinery costs more than the work itself, so these routes are
answered here, with the same models, the same errors and the same OpenAPI description
(`service/api/openapi.py`), and everything else falls through to the FastAPI app.
"""

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from pydantic import GetCoreSchemaHandler, ValidationError, create_model
from pydantic_core import PydanticCustomError, core_schema

from service import metrics
from service.auth import Authenticator, AuthError
from service.progress.buffer import now_ms
from service.progress.content import CONTENT_KINDS, MAX_ID, ContentKind
from service.progress.sink import HeartbeatSink, Unavailable

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

CREATED_BODY = b'{"data":true}'
_JSON_HEADERS = [(b"content-type", b"application/json")]


class _BodyTooLarge(Exception):
    pass


# Below 2**53 a float is exactly the integer its JSON literal spells; above, `9007199254740993.0`
# would arrive as ...992, a different id.
_EXACT_FLOAT_INT = 2**53


def _whole_float(value: float) -> int:
    if value.is_integer() and abs(value) < _EXACT_FLOAT_INT:
        return int(value)
    raise PydanticCustomError("int_type", "Input should be a valid integer")


class _WireContentId:
    """A content id as JSON Schema's `integer` reads it: `42` or `42.0`, never `"42"`, `true` or `42.5`.

    The models are strict (strings and booleans are not ids), and strict pydantic also refuses
    `42.0`, which openapi.yaml's `type: integer` admits and some JSON encoders write for a whole
    number. Plain integers take the first branch of the union, so the usual request pays nothing.
    """

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        whole = core_schema.union_schema(
            [core_schema.int_schema(strict=True),
             core_schema.no_info_after_validator_function(_whole_float, core_schema.float_schema(strict=True))],
            mode="left_to_right", custom_error_type="int_type",
        )  # fmt: skip
        return core_schema.chain_schema([whole, core_schema.int_schema(strict=True, ge=1, le=MAX_ID)])


class _Heartbeat(Protocol):
    @property
    def position(self) -> float: ...


BodyParser = Callable[[bytes], _Heartbeat]


def _body_parser(kind: ContentKind) -> BodyParser:
    """`kind.body` as read from the wire: the same model, its id field read by `_WireContentId`."""
    fields: dict[str, Any] = {kind.id_column: (_WireContentId, ...)}
    return create_model(f"{kind.body.__name__}Wire", __base__=kind.body, **fields).model_validate_json


_ROUTES: dict[str, tuple[ContentKind, BodyParser]] = {kind.path: (kind, _body_parser(kind)) for kind in CONTENT_KINDS}


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
            raise ConnectionResetError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class ProgressIngest:
    """ASGI middleware: POSTs to the four progress routes end here; anything else goes to `app`."""

    def __init__(self, app: ASGIApp, *, authenticator: Authenticator, max_body_bytes: int) -> None:
        self.app = app
        self.authenticator = authenticator
        self.max_body_bytes = max_body_bytes
        self.sink: HeartbeatSink | None = None  # set by the lifespan once its clients exist
        self._requests = {
            (kind.path, status): metrics.HTTP_REQUESTS.labels(kind.path, str(status))
            for kind in CONTENT_KINDS
            for status in (201, 400, 401, 405, 413, 422, 503)
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        kind, parse_body = route
        status, body = await self._handle(kind, parse_body, scope, receive)
        headers = _JSON_HEADERS if status != 405 else [*_JSON_HEADERS, (b"allow", b"POST")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._requests[(kind.path, status)].inc()

    async def _handle(
        self, kind: ContentKind, parse_body: BodyParser, scope: Scope, receive: Receive
    ) -> tuple[int, bytes]:
        if scope["method"] != "POST":
            return 405, _error_body("method not allowed: use POST")
        authorization = gateway_value = None
        declared_length = 0
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                declared_length = int(value) if value.isdigit() else 0
            elif name == self.authenticator.gateway_header:
                gateway_value = value
        try:
            user_id = self.authenticator.user_id(authorization, gateway_value)
        except AuthError as exc:
            return 401, _error_body(str(exc))
        if declared_length > self.max_body_bytes:
            return 413, _error_body(f"body larger than {self.max_body_bytes} bytes")
        try:
            raw = await _read_body(receive, self.max_body_bytes)
        except _BodyTooLarge:
            return 413, _error_body(f"body larger than {self.max_body_bytes} bytes")
        try:
            heartbeat = parse_body(raw)
        except ValidationError as exc:
            detail = _validation_detail(exc)
            # unparseable JSON is a malformed request; a parsed body with wrong fields is unprocessable
            status = 400 if any(err["type"] == "json_invalid" for err in detail) else 422
            return status, _error_body(detail)
        if self.sink is None:
            return 503, _error_body("service starting or stopping, retry later")
        try:
            await self.sink.write(kind, content_id=getattr(heartbeat, kind.id_column), user_id=user_id,
                                  position=heartbeat.position, received_ms=now_ms())  # fmt: skip
        except Unavailable as exc:
            log.warning("heartbeat refused: %s", exc, extra={"content_type": kind.name})
            return 503, _error_body(str(exc))
        return 201, CREATED_BODY
