"""The offline sync, POST /progress/sync, served as plain ASGI like the heartbeats (`routes.py`).

One request carries up to SYNC_MAX_ITEMS positions heard offline (`service/progress/read/sync.py` settles
them). Request rates are the API gateway's to limit, as for the heartbeats (docs/deploy.md); what a
sync costs the database is bounded here by SYNC_CONNECTIONS (2).
"""

import functools
import logging

from pydantic import ValidationError

from service import tracing
from service.api.http import check_method, identify, invalid_body, json_body, read_body, respond, retry_soon
from service.asgi import Receive, Scope, Send
from service.auth import Authenticator
from service.progress.read.sync import OfflineSync, SyncOutcome, SyncsWaiting, parse_request
from service.stores import POSTGRES_FAILED, REDIS_FAILED

log = logging.getLogger(__name__)

SYNC_ROUTE = "/progress/sync"


@functools.lru_cache(maxsize=64)  # a handful of distinct outcomes: each item's answer is encoded once per process
def _outcome_json(outcome: SyncOutcome) -> bytes:
    return json_body({"applied": outcome.applied, "reason": outcome.reason})


class ProgressSync:
    """The ASGI handler of /progress/sync, whatever the method."""

    max_body_bytes = 262_144  # larger: 413 (500 items, the most a sync takes, are about 60 KiB)
    body_read_timeout_s = 10.0

    def __init__(self, offline: OfflineSync | None, *, authenticator: Authenticator) -> None:
        self.offline = offline  # None: no database (DATABASE_URL), every sync is a 503
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, SYNC_ROUTE, self._handle(scope, receive))

    async def _handle(self, scope: Scope, receive: Receive) -> bytes:
        check_method(scope["method"], "POST")
        user_id, declared_length = identify(self.authenticator, scope["headers"])
        body = await read_body(receive, declared_length, limit=self.max_body_bytes, timeout_s=self.body_read_timeout_s)
        try:
            items = parse_request(body)
        except ValidationError as exc:
            raise invalid_body(exc) from None
        if self.offline is None:
            raise retry_soon("offline sync needs the database (DATABASE_URL)")
        try:
            with tracing.span("progress sync", items=len(items)):
                outcomes = await self.offline.apply(user_id, items)
        except SyncsWaiting as exc:  # the syncs' connections are held (a table locked, a slow database): shed
            raise retry_soon("progress store too slow for the syncs waiting, retry later") from exc
        except (*REDIS_FAILED, *POSTGRES_FAILED) as exc:
            log.warning("offline sync failed: %s: %s", type(exc).__name__, exc)
            raise retry_soon("progress store unavailable, retry later") from exc
        return b'{"items":[' + b",".join(map(_outcome_json, outcomes)) + b"]}"
