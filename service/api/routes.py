"""Every path the service answers, in one table, dispatched by path.

The heartbeats, the reads and the sync are plain ASGI handlers (`ingest.py`, `reads.py`, `sync.py`):
FastAPI's per-request machinery would cost more than their work. The probes, the metrics and the
OpenAPI document are FastAPI's routes (`health.py`, `openapi.py`). A path outside the table goes to
FastAPI too, which answers its 404 (and runs the ASGI lifespan). Each handler checks its own method
(405 with Allow). `openapi.yaml` documents exactly the table's paths (tests/api/test_openapi.py).
Under `serve`, `received_by` gives the heartbeats' and the reads' handlers a second way in, below
ASGI (protocol.py), with the same code from the head on.
"""

from collections.abc import Awaitable, Callable
from functools import partial
from typing import NamedTuple

from fastapi import FastAPI

from service.api.http import Answer, Headers, HttpError, send_error
from service.api.ingest import ProgressIngest
from service.api.reads import PREFIX, ProgressReads, is_read
from service.api.sync import SYNC_ROUTE, ProgressSync
from service.asgi import ASGIApp, Receive, Scope, Send
from service.progress.content import CONTENT_KINDS, ContentKind

# a request whose whole body has arrived, answered by the server's protocol without ASGI (protocol.py): its headers
# and body; a read's also takes its path and query string first
Received = Callable[[Headers, bytes], Awaitable[Answer | None]]
ReadReceived = Callable[[str, bytes, Headers, bytes], Awaitable[Answer | None]]
READS_PREFIX = PREFIX.encode()

OPENAPI_ROUTE = "/openapi.json"
FASTAPI_ROUTES = ("/health/live", "/health/ready", "/metrics", OPENAPI_ROUTE)


class Handlers(NamedTuple):
    """The plain ASGI handlers, built by the lifespan over the parts it started (service/app.py)."""

    ingest: ProgressIngest
    reads: ProgressReads
    sync: ProgressSync


def route_table(*, heartbeat: Callable[[ContentKind], ASGIApp], sync: ASGIApp, api: FastAPI) -> dict[str, ASGIApp]:
    """The exact paths; the reads are the one prefix, /progress/{content_type}[/{content_id}], after them."""
    return {
        **{kind.path: heartbeat(kind) for kind in CONTENT_KINDS},  # POST: the heartbeats
        SYNC_ROUTE: sync,  # POST /progress/sync
        **dict.fromkeys(FASTAPI_ROUTES, api),  # GET: the probes, the metrics, the OpenAPI document
    }


async def not_serving(scope: Scope, receive: Receive, send: Send) -> None:
    """Before the lifespan has started the parts, and once it stops them (uvicorn serves neither moment)."""
    await send_error(send, HttpError(503, "service starting or stopping, retry later"))


class Routes:
    """The ASGI application: a request's path picks its handler; `api` (FastAPI) gets everything else."""

    def __init__(self, api: FastAPI) -> None:
        self.api = api
        self.stop_serving()

    def serve(self, handlers: Handlers) -> None:
        ingest = handlers.ingest
        self.table = route_table(heartbeat=lambda kind: partial(ingest.answer, kind), sync=handlers.sync, api=self.api)
        self.reads: ASGIApp = handlers.reads
        # the same handlers' other way in (received_by)
        self.received: dict[bytes, Received] = {
            kind.path.encode(): partial(ingest.answer_received, kind) for kind in CONTENT_KINDS
        }
        self.reads_received: ReadReceived | None = handlers.reads.answer_received

    def stop_serving(self) -> None:
        self.table = route_table(heartbeat=lambda _: not_serving, sync=not_serving, api=self.api)
        self.reads = not_serving
        self.received = {}
        self.reads_received = None

    def received_by(self, method: bytes, target: bytes) -> Received | None:
        """The handler that answers a request of `method` and raw `target` once its body has arrived, without ASGI
        (the server's protocol, protocol.py): a heartbeat's POST, a read's GET; None: the ASGI app's request."""
        if method == b"POST":
            return self.received.get(target)  # the exact path: with a query string, ASGI's
        if method != b"GET" or self.reads_received is None or not target.startswith(READS_PREFIX):
            return None
        raw_path, _, query_string = target.partition(b"?")
        if b"%" in raw_path or b"#" in target or not raw_path.isascii():
            return None  # escaped, or a fragment: as uvicorn's scope has it, through ASGI
        path = raw_path.decode("ascii")
        if path in self.table or not is_read(path):
            return None
        return partial(self.reads_received, path, query_string)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            handler = self.table.get(path)
            if handler is None:
                handler = self.reads if is_read(path) else self.api
            await handler(scope, receive, send)
            return
        await self.api(scope, receive, send)  # the lifespan
