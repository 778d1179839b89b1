"""Every path the service answers, in one table, dispatched by path.

The heartbeats, the reads and the sync are plain ASGI handlers (`ingest.py`, `reads.py`, `sync.py`):
FastAPI's per-request machinery would cost more than their work. The probes, the metrics and the
OpenAPI document are FastAPI's routes (`health.py`, `openapi.py`). A path outside the table goes to
FastAPI too, which answers its 404 (and runs the ASGI lifespan). Each handler checks its own method
(405 with Allow). `openapi.yaml` documents exactly the table's paths (tests/api/test_openapi.py).
"""

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from fastapi import FastAPI

from service.api.http import HttpError, send_error
from service.api.ingest import ProgressIngest
from service.api.reads import ProgressReads, is_read
from service.api.sync import SYNC_ROUTE, ProgressSync
from service.asgi import ASGIApp, Receive, Scope, Send
from service.progress.content import CONTENT_KINDS, ContentKind

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

    def stop_serving(self) -> None:
        self.table = route_table(heartbeat=lambda _: not_serving, sync=not_serving, api=self.api)
        self.reads = not_serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            handler = self.table.get(path)
            if handler is None:
                handler = self.reads if is_read(path) else self.api
            await handler(scope, receive, send)
            return
        await self.api(scope, receive, send)  # the lifespan
