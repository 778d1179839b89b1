"""One JSON object per log line, so a log pipeline can filter by level, logger or content type."""

import json
import logging
import sys
import uuid
from contextvars import ContextVar
from datetime import UTC, datetime

from service.asgi import ASGIApp, Message, Receive, Scope, Send

# Context a log call may pass with `extra=`; anything else on the record is logging's own.
CONTEXT_FIELDS = ("request_id", "content_type", "batch_size", "key", "pairs", "error", "pod", "count", "outbox",
                  "row_id")  # fmt: skip

# The request a log line was written for, set by RequestIdMiddleware. The heartbeat fast path
# (service.api.ingest) does not go through it: its lines carry the content type instead.
current_request_id: ContextVar[str | None] = ContextVar("current_request_id", default=None)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "message": record.getMessage(),
            "logger": record.name,
        }
        for field in CONTEXT_FIELDS:
            value = record.__dict__.get(field)
            if value is not None:
                entry[field] = value
        if "request_id" not in entry and (request_id := current_request_id.get()) is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # one line per request at INFO would be one line per heartbeat
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


_REQUEST_ID_HEADER = b"x-request-id"
_MAX_REQUEST_ID_CHARS = 128

log = logging.getLogger(__name__)


class RequestIdMiddleware:
    """Tags the log lines of a request with its X-Request-ID (the gateway's, or a new one) and echoes it.

    Meant for the FastAPI app (probes, metrics, anything slow enough to log), not for the heartbeat
    fast path: it costs a header scan and a context variable per request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == _REQUEST_ID_HEADER), b"")
        request_id = given.decode("latin-1")[:_MAX_REQUEST_ID_CHARS] or uuid.uuid4().hex
        header = (_REQUEST_ID_HEADER, request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # logged here, where the request id is still known; the server logs it again without it
            log.exception("request failed: %s %s", scope.get("method"), scope.get("path"))
            raise
        finally:
            current_request_id.reset(token)
