"""The monolith's side of §7, as small as it can be: a Celery app with its two task names.

Run as a real worker process (`celery -A tests.monolith.worker worker ...`) on the broker of
MONOLITH_BROKER_URL. Every execution is one row of `monolith_task_execution` in the database of
MONOLITH_DATABASE_URL: task id, task name, queue, kwargs and the `traceparent` header, so tests count
deliveries by task id. It never dedupes: a republished message shows up as a second row with the same task id.
"""

import asyncio
import json
import os
import threading
from typing import Any

import asyncpg
from celery import Celery, Task

app = Celery("monolith", broker=os.environ.get("MONOLITH_BROKER_URL", "memory://"))
app.conf.update(
    accept_content=["json"],
    broker_transport_options=json.loads(os.environ.get("MONOLITH_BROKER_TRANSPORT_OPTIONS", "{}")),
    worker_prefetch_multiplier=64,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

CREATE_TABLE_SQL = """
CREATE TABLE IF NOT EXISTS monolith_task_execution (
    id          bigserial PRIMARY KEY,
    task_id     text        NOT NULL,
    task_name   text        NOT NULL,
    queue       text        NULL,
    kwargs      jsonb       NOT NULL,
    -- the W3C trace context the message carried in its headers (tracing on), read as Celery's instrumentation does
    traceparent text        NULL,
    executed_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
RECORD_SQL = """
INSERT INTO monolith_task_execution (task_id, task_name, queue, kwargs, traceparent) VALUES ($1, $2, $3, $4, $5)
"""

# one event loop and one connection per worker thread (the solo pool has one, the threads pool -c N)
_local = threading.local()


def _record(task: Task, kwargs: dict[str, Any]) -> None:
    if getattr(_local, "loop", None) is None:
        _local.loop = asyncio.new_event_loop()
        _local.conn = None
    loop: asyncio.AbstractEventLoop = _local.loop
    if _local.conn is None or _local.conn.is_closed():
        _local.conn = loop.run_until_complete(asyncpg.connect(os.environ["MONOLITH_DATABASE_URL"]))
    queue = (task.request.delivery_info or {}).get("routing_key")
    traceparent = task.request.get("traceparent")
    loop.run_until_complete(
        _local.conn.execute(RECORD_SQL, task.request.id, task.name, queue, json.dumps(kwargs), traceparent)
    )


@app.task(name="apps.engagements.tasks.advance_user_journey", bind=True)
def advance_user_journey(self: Task, **kwargs: Any) -> None:
    _record(self, kwargs)


@app.task(name="apps.emails.tasks.send_email", bind=True)
def send_email(self: Task, **kwargs: Any) -> None:
    _record(self, kwargs)
