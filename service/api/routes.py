"""Every path the service answers, in one table, dispatched by path.

The heartbeats, the reads and the sync are plain ASGI handlers (`ingest.py`, `reads.py`, `sync.py`):
FastAPI's per-request machinery would cost more than their work. The probes, the metrics and the
OpenAPI document are FastAPI's routes (`health.py`, `openapi.py`). A path outside the table goes to
FastAPI too, which answers its 404 (and runs the ASGI lifespan). Each handler checks its own method
(405 with Allow). `openapi.yaml` documents exactly the table's paths (tests/api/test_openapi.py).
"""

from functools import partial

from fastapi import FastAPI

from service.api.ingest import ProgressIngest
from service.api.reads import ProgressReads, is_read
from service.api.sync import SYNC_ROUTE, ProgressSync
from service.asgi import ASGIApp, Receive, Scope, Send
from service.progress.content import CONTENT_KINDS

OPENAPI_ROUTE = "/openapi.json"
FASTAPI_ROUTES = ("/health/live", "/health/ready", "/metrics", OPENAPI_ROUTE)


def route_table(*, ingest: ProgressIngest, sync: ProgressSync, api: FastAPI) -> dict[str, ASGIApp]:
    """The exact paths; the reads are the one prefix, /progress/{content_type}[/{content_id}], after them."""
    return {
        **{kind.path: partial(ingest.answer, kind) for kind in CONTENT_KINDS},  # POST: the heartbeats
        SYNC_ROUTE: sync,  # POST /progress/sync
        **dict.fromkeys(FASTAPI_ROUTES, api),  # GET: the probes, the metrics, the OpenAPI document
    }


class Routes:
    """The ASGI application: a request's path picks its handler; `api` (FastAPI) gets everything else."""

    def __init__(self, api: FastAPI, table: dict[str, ASGIApp], reads: ProgressReads) -> None:
        self.api = api
        self.table = table
        self.reads = reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            handler = self.table.get(path)
            if handler is None:
                handler = self.reads if is_read(path) else self.api
            await handler(scope, receive, send)
            return
        await self.api(scope, receive, send)  # the lifespan
