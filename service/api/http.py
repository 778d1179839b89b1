"""The door's HTTP plumbing, shared by the routes served as plain ASGI (`ingest.py`, `reads.py`, `sync.py`).

A route's handler returns its success's body and raises `HttpError` for anything else, from wherever
the refusal is found; `respond` sends either. The answers keep the shapes of
FastAPI's (`{"detail": ...}`, validation errors with `loc`/`msg`/`type`), so the OpenAPI document
describes one API whichever part serves a route.
"""

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from prometheus_client import Counter
from pydantic import BaseModel, ValidationError

from service import metrics
from service.asgi import Receive, Send
from service.auth import Authenticator, AuthError

Headers = list[tuple[bytes, bytes]]
Body = TypeVar("Body", bound=BaseModel)

log = logging.getLogger(__name__)


class HttpError(Exception):
    """An answer other than the route's success: a status, a `detail` and any headers it needs."""

    def __init__(self, status: int, detail: object, headers: Headers | None = None) -> None:
        super().__init__(status, detail)
        self.status = status
        self.detail = detail
        self.headers = headers or []


def as_http_error(exc: Exception, route: str) -> HttpError:
    """The answer to an exception out of a route: its own HttpError, or a bug's JSON 500, logged with the
    traceback (never the server's bare 500, and always counted in progress_http_requests_total)."""
    if isinstance(exc, HttpError):
        return exc
    log.error("unexpected error answering %s", route, exc_info=exc)
    return HttpError(500, "internal error, retry later")


class ClientGone(Exception):
    """The client hung up mid-body: nothing to store and nobody to answer."""


def json_body(data: object) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def json_fields(body: bytes, headers: Sequence[tuple[bytes, bytes]]) -> Headers:
    """The fields of a JSON answer, whichever way it is written: content-type, then `headers`, then content-length."""
    return [(b"content-type", b"application/json"), *headers, (b"content-length", b"%d" % len(body))]


async def send_json(send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": json_fields(body, headers)})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: HttpError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """`error` as JSON, after the route's own `headers` (cache-control on the reads)."""
    await send_json(send, error.status, json_body({"detail": error.detail}), [*headers, *error.headers])


@functools.cache  # a counter per route and status, looked up once
def requests_total(route: str, status: int) -> Counter:
    return metrics.HTTP_REQUESTS.labels(route, str(status))


Answer = tuple[int, bytes, Sequence[tuple[bytes, bytes]]]  # status, body, the headers after content-type


async def answer_of(
    route: str, handled: Awaitable[bytes], *, status: int = 200, headers: Sequence[tuple[bytes, bytes]] = ()
) -> Answer | None:
    """`status` with the body `handled` gives, or the error it raises, counted in progress_http_requests_total;
    None (nothing to send, nothing counted) when the client hung up mid-body (ClientGone)."""
    try:
        body = await handled
    except ClientGone:
        return None
    except Exception as exc:
        error = as_http_error(exc, route)
        requests_total(route, error.status).inc()
        return error.status, json_body({"detail": error.detail}), [*headers, *error.headers]
    requests_total(route, status).inc()
    return status, body, headers


async def respond(
    send: Send, route: str, handled: Awaitable[bytes], *, status: int = 200, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """The answer `answer_of` gives, sent over ASGI."""
    answer = await answer_of(route, handled, status=status, headers=headers)
    if answer is not None:
        await send_json(send, *answer)


def check_method(method: str, allowed: str) -> None:
    if method != allowed:
        raise HttpError(405, f"method not allowed: use {allowed}", [(b"allow", allowed.encode())])


def identify(authenticator: Authenticator, headers: Headers) -> tuple[int, int]:
    """(user id, declared content length) of a request; HttpError 401 when it does not prove one user.

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
        raise HttpError(401, f"more than one {identity_name.decode('latin-1')} header")
    try:
        if authenticator.use_gateway:
            return authenticator.user_id(None, identity), declared_length
        return authenticator.user_id(identity, None), declared_length
    except AuthError as exc:
        raise HttpError(401, str(exc)) from None


def retry_soon(detail: str) -> HttpError:
    """A 503 to retry in a second: a store down, or too slow for the requests waiting; nothing was written."""
    return HttpError(503, detail, [(b"retry-after", b"1")])


def parse_json(model: type[Body], body: bytes) -> Body:
    """`body` as `model`; HttpError 400/422 when invalid."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise invalid_body(exc) from None


async def read_body(receive: Receive, declared_length: int, *, limit: int, timeout_s: float) -> bytes:
    """The whole body; HttpError 413 past `limit` bytes, 408 past `timeout_s`; ClientGone on a hang-up."""
    if declared_length > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        # a client trickling its body holds a socket and a request: cut it off and close the connection
        metrics.REFUSED.labels("body_timeout").inc()
        raise HttpError(408, f"body not received within {timeout_s:g} s", [(b"connection", b"close")]) from None
    return b"".join(chunks)


def too_large(limit: int) -> HttpError:
    return HttpError(413, f"body larger than {limit} bytes")


def invalid_body(exc: ValidationError) -> HttpError:
    """FastAPI's shape: unparseable JSON is a malformed request (400), wrong fields are unprocessable (422)."""
    detail = [
        {"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]}
        for err in exc.errors(include_url=False, include_context=False, include_input=False)
    ]
    return HttpError(400 if any(err["type"] == "json_invalid" for err in detail) else 422, detail)
