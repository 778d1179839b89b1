"""The monolith's Celery worker for bench_relay.py (its `monolith_worker` starts it, bench/ on PYTHONPATH):
its completion task, each execution one row of monolith_task_execution in MONOLITH_DATABASE_URL."""

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
    worker_prefetch_multiplier=64,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
CREATE_TABLE_SQL = """CREATE TABLE IF NOT EXISTS monolith_task_execution (id bigserial PRIMARY KEY,
    task_id text NOT NULL, task_name text NOT NULL, kwargs jsonb NOT NULL,
    executed_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
RECORD_SQL = "INSERT INTO monolith_task_execution (task_id, task_name, kwargs) VALUES ($1, $2, $3)"
_local = threading.local()  # one event loop and one connection per worker thread


@app.task(name="apps.engagements.tasks.advance_user_journey", bind=True)
def advance_user_journey(self: Task, **kwargs: Any) -> None:
    if getattr(_local, "loop", None) is None:
        _local.loop = asyncio.new_event_loop()
        _local.conn = _local.loop.run_until_complete(asyncpg.connect(os.environ["MONOLITH_DATABASE_URL"]))
    _local.loop.run_until_complete(_local.conn.execute(RECORD_SQL, self.request.id, self.name, json.dumps(kwargs)))
