"""`flush --once` over a backlog shows its progress: off a terminal, a log line per interval and a summary."""

import asyncio
import json
import logging

import asyncpg
import pytest
from redis.asyncio import Redis

from service import commands, console
from service.config import Settings
from service.progress.ingest.buffer import WRITE_SCRIPT
from service.redis_client import connect_redis
from tests.helpers import assert_all_persisted, fill


async def test_flush_once_logs_its_progress_against_the_pending_count_and_a_summary(
    settings: Settings,
    redis: Redis,
    db: asyncpg.Pool,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(console, "LOG_INTERVAL_S", 0.01)
    await redis.script_load(WRITE_SCRIPT)
    last = await fill(redis, db, 3000)
    settings = settings.model_copy(update={"progress_flush_batch_size": 50, "progress_flush_concurrency": 2})
    client = connect_redis(settings.redis)
    try:
        with caplog.at_level(logging.INFO, logger="service.console"):
            code = await commands._run_flusher(commands._Parts(settings, client, db, None, asyncio.Event()), once=True)
    finally:
        await client.aclose()

    assert code == 0
    assert json.loads(capsys.readouterr().out)["written"] == 3000
    lines = [record.getMessage() for record in caplog.records if record.name == "service.console"]
    during = [line for line in lines if line.startswith("flush --once: ")]
    assert during and all("/3000 (" in line and "entries/s" in line for line in during), lines
    assert lines[-1].startswith("flush --once done: 3000 of 3000 entries in ")
    await assert_all_persisted(redis, db, last)
