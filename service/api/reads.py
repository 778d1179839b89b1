"""Reading progress back, served as plain ASGI like the heartbeats (`routes.py` sends its prefix here).

A screen that reads through this service asks as often as the app sends heartbeats, and the read
must cost no more than the heartbeat it answers for: FastAPI's per-request machinery would cost
more than the work, so these two routes are answered here, with the same auth and error shapes
as `ingest.py`, as `openapi.yaml` describes them.
"""

import json
import logging
import math
import re
from collections.abc import Coroutine
from datetime import timedelta
from typing import Annotated, Any
from urllib.parse import parse_qsl

import msgspec

from service import tracing
from service.api.http import Answer, Headers, HttpError, answer_of, check_method, identify, respond, retry_soon
from service.asgi import Receive, Scope, Send
from service.auth import Authenticator
from service.progress.content import EPOCH, KIND_BY_NAME, MAX_ID, ContentKind
from service.progress.read.reads import Progress, ProgressReader, ReadsWaiting
from service.stores import POSTGRES_FAILED, REDIS_FAILED

log = logging.getLogger(__name__)

PREFIX = "/progress/"  # the route table sends /progress/{a} and /progress/{a}/{b} here (routes.py)
ONE_ROUTE = "/progress/{content_type}/{content_id}"
MANY_ROUTE = "/progress/{content_type}"
MAX_IDS = 100

# another device may move a position any second, and a 404 "no progress" is no more lasting
_NO_STORE = [(b"cache-control", b"no-store")]


def _invalid(location: str, name: str, message: str, error_type: str) -> HttpError:
    return HttpError(422, [{"loc": [location, name], "msg": message, "type": error_type}])


def is_read(path: str) -> bool:
    """/progress/{content_type} or /progress/{content_type}/{content_id}: one of the two read routes."""
    return path.startswith(PREFIX) and path.count("/", len(PREFIX)) <= 1


def _content_id(text: str, location: str, name: str) -> int:
    # digits only: no sign, no spaces, no "1.0"; bounded before int() (it refuses > 4300 digits)
    if text.isascii() and text.isdigit() and len(text) <= 20 and 1 <= int(text) <= MAX_ID:
        return int(text)
    raise _invalid(location, name, f"must be an integer from 1 to {MAX_ID}", "int_parsing")


# The app's form, ids=1,2,3 with at most MAX_IDS ids of ASCII digits: read in one typed decode of the same digits
# as a JSON array, its bounds checked there. Anything else (a %-escape, a leading zero JSON refuses, an id out of
# range, too many) goes the long way, which answers it or words its 422.
_APP_FORM = re.compile(rb"ids=\d{1,20}(?:,\d{1,20}){0,%d}" % (MAX_IDS - 1))
_ID_LIST = msgspec.json.Decoder(list[Annotated[int, msgspec.Meta(ge=1, le=MAX_ID)]])


def read_ids(query_string: bytes) -> list[int]:
    """The ids asked for, each once, in order; 422 unless they are ids=1,2,3 with at most MAX_IDS."""
    if _APP_FORM.fullmatch(query_string):
        try:
            return list(dict.fromkeys(_ID_LIST.decode(b"[" + query_string[4:] + b"]")))  # a repeated id is one id
        except msgspec.DecodeError:  # its ValidationError too: an id out of range
            pass
    return read_ids_the_long_way(query_string)


def read_ids_the_long_way(query_string: bytes) -> list[int]:
    """read_ids the long way, for any query string: what refuses one words the 422."""
    values = [
        value for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True) if name == "ids"
    ]
    if not values:
        raise _invalid("query", "ids", "Field required: ids=1,2,3", "missing")
    if len(values) > 1:
        raise _invalid("query", "ids", "give ids once, comma-separated: ids=1,2,3", "value_error")
    texts = values[0].split(",")
    if len(texts) > MAX_IDS:
        raise _invalid("query", "ids", f"at most {MAX_IDS} ids", "too_long")
    return list(dict.fromkeys(_content_id(text, "query", "ids") for text in texts))


_DAY_TEXT: dict[int, str] = {}  # days since the epoch -> "YYYY-MM-DD"; a few hundred at most in practice
# the rest of the text from tables: a format spec (:02d) costs as much as the lookup and its divmod together
_HOUR_MINUTE = [f"T{hour:02d}:{minute:02d}:" for hour in range(24) for minute in range(60)]
_TWO_DIGITS = [f"{n:02d}" for n in range(60)]
_THREE_DIGITS = [f"{n:03d}" for n in range(1000)]


def iso_utc(us: int) -> str:
    """datetime.isoformat() of the UTC time `us` µs after the epoch, byte for byte, in a third of its time."""
    seconds, micro = divmod(us, 1_000_000)
    days, seconds = divmod(seconds, 86_400)
    day = _DAY_TEXT.get(days)
    if day is None:
        day = (EPOCH + timedelta(days=days)).date().isoformat()
        if len(_DAY_TEXT) < 100_000:
            _DAY_TEXT[days] = day
    minutes, seconds = divmod(seconds, 60)
    if micro:
        milli, micro = divmod(micro, 1000)
        return f"{day}{_HOUR_MINUTE[minutes]}{_TWO_DIGITS[seconds]}.{_THREE_DIGITS[milli]}{_THREE_DIGITS[micro]}+00:00"
    return f"{day}{_HOUR_MINUTE[minutes]}{_TWO_DIGITS[seconds]}+00:00"


def progress_json(content_type: str, progress: Progress) -> str:
    """One entry of a read's answer: the text json_body would make of its dict, in a fraction of the time.

    A read of 100 ids answers 100 of these; the fields are numbers and ISO-8601 times (ASCII, nothing
    to escape), and a finite float's JSON is its repr, as json.dumps writes it.
    """
    content_id, position, updated_us, completed_us = progress
    position_text = repr(position) if math.isfinite(position) else json.dumps(position)
    # one f-string per entry, not pieces joined again: most entries have no completion
    if completed_us is None:
        return (
            f'{{"content_type":"{content_type}","content_id":{content_id},"position":{position_text},'
            f'"updated_at":"{iso_utc(updated_us)}","completed_at":null}}'
        )
    return (
        f'{{"content_type":"{content_type}","content_id":{content_id},"position":{position_text},'
        f'"updated_at":"{iso_utc(updated_us)}","completed_at":"{iso_utc(completed_us)}"}}'
    )


class ProgressReads:
    """The two GET /progress routes, one ASGI handler: the route table sends it only their paths (is_read)."""

    def __init__(self, reader: ProgressReader | None, *, authenticator: Authenticator) -> None:
        self.reader = reader  # None: no database (DATABASE_URL), every read is a 503
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI way in: the route table's handler (every read the server's own protocol does not answer)."""
        route, handled = self._route(scope["path"], scope["method"], scope["headers"], scope["query_string"])
        await respond(send, route, handled, headers=_NO_STORE)

    async def answer_received(self, path: str, query_string: bytes, headers: Headers, body: bytes) -> Answer | None:
        """The other way in: a GET of `path` (a read's, is_read), answered by the server's protocol without ASGI
        (service/api/protocol.py); a body is ignored, as over ASGI."""
        route, handled = self._route(path, "GET", headers, query_string)
        return await answer_of(route, handled, headers=_NO_STORE)

    def _route(
        self, path: str, method: str, headers: Headers, query_string: bytes
    ) -> tuple[str, Coroutine[Any, Any, bytes]]:
        parts = path[len(PREFIX) :].split("/")
        route = ONE_ROUTE if len(parts) == 2 else MANY_ROUTE
        return route, self._handle(route, parts, method, headers, query_string)

    async def _handle(self, route: str, parts: list[str], method: str, headers: Headers, query_string: bytes) -> bytes:
        check_method(method, "GET")
        user_id, _ = identify(self.authenticator, headers)
        kind = KIND_BY_NAME.get(parts[0])
        if kind is None:
            raise _invalid("path", "content_type", f"must be one of {', '.join(KIND_BY_NAME)}", "enum")
        if route == ONE_ROUTE:
            content_id = _content_id(parts[1], "path", "content_id")
            found = await self._read(kind, user_id, [content_id])
            if not found:
                raise HttpError(404, f"no progress for {kind.name} {content_id}")
            return progress_json(kind.name, found[0]).encode()
        found = await self._read(kind, user_id, read_ids(query_string))
        return ('{"data":[' + ",".join([progress_json(kind.name, progress) for progress in found]) + "]}").encode()

    async def _read(self, kind: ContentKind, user_id: int, content_ids: list[int]) -> list[Progress]:
        if self.reader is None:
            raise retry_soon("progress reads need the database (DATABASE_URL)")
        try:
            with tracing.span("progress read", content_type=kind.name, ids=len(content_ids)):
                return await self.reader.read(kind, user_id, content_ids)
        except ReadsWaiting as exc:  # a storm of reads, or a store that stalls: shed, not queued
            raise retry_soon("progress store too slow for the reads waiting, retry later") from exc
        except (*REDIS_FAILED, *POSTGRES_FAILED) as exc:
            log.warning("progress read failed: %s: %s", type(exc).__name__, exc)
            raise retry_soon("progress store unavailable, retry later") from exc
