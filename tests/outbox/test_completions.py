"""Completions reach the monolith's advance_user_journey: HTTP -> flush -> outbox -> broker -> real worker."""

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime

import asyncpg
import pytest
from redis.asyncio import Redis

from service.config import Settings
from service.progress.flush.flusher import Flusher
from tests.helpers import flushed_since, post_near_end, running_app, seed, wait_for
from tests.monolith.fixtures import Executions, kwargs_of

pytestmark = pytest.mark.slow  # a real Celery worker

USERS, LESSONS = 20, 10  # 200 keys, post_near_end's default


async def test_200_completions_in_one_flush_run_advance_user_journey_once_each_with_the_contract_kwargs(
    relay_settings: Settings, redis: Redis, db: asyncpg.Pool, executions: Executions
) -> None:
    await seed(db, users=USERS, contents=LESSONS, duration_s=600)
    async with running_app(relay_settings) as (_, client):
        await post_near_end(client, relay_settings)
        result = await Flusher(relay_settings.flush, redis, db).flush_cycle()
        assert result.failed_batches == 0
        assert await db.fetchval("SELECT count(*) FROM progress_completion_event") == 200
        rows = await executions.wait_for(200)

    assert len(rows) == 200
    assert {row["task_name"] for row in rows} == {"apps.engagements.tasks.advance_user_journey"}
    assert {row["queue"] for row in rows} == {"onion-progress"}
    assert set((await executions.by_task_id()).values()) == {1}
    events = {(e["content_id"], e["user_id"]): e for e in await db.fetch("SELECT * FROM progress_completion_event")}
    for row in rows:
        kwargs = kwargs_of(row)
        assert set(kwargs) == {"user_id", "content_type", "content_id", "completed_at"}
        event = events[(kwargs["content_id"], kwargs["user_id"])]
        assert kwargs["content_type"] == "lesson"
        assert datetime.fromisoformat(kwargs["completed_at"]) == event["completed_at"]
        expected_id = uuid.uuid5(
            uuid.UUID("6f1d2c4e-8a57-4b0e-9d3a-2f6b1c9e7a41"),
            f"completion:lesson:{kwargs['content_id']}:{kwargs['user_id']}",
        )
        assert row["task_id"] == str(expected_id)
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0
    assert await db.fetchval("SELECT max(publish_attempts) FROM progress_completion_event") == 1


@pytest.fixture
async def relay_claims(db: asyncpg.Pool) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """How many claim statements the relay ran on the completion outbox (a statement trigger fires for 0 rows)."""
    await db.execute("""
        CREATE TABLE test_claims (at timestamptz NOT NULL DEFAULT clock_timestamp());
        CREATE FUNCTION test_log_claim() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN INSERT INTO test_claims DEFAULT VALUES; RETURN NULL; END $$;
        CREATE TRIGGER test_log_claim AFTER UPDATE ON progress_completion_event
            FOR EACH STATEMENT EXECUTE FUNCTION test_log_claim();
    """)
    try:
        yield lambda: db.fetchval("SELECT count(*) FROM test_claims")
    finally:
        await db.execute("""
            DROP TRIGGER test_log_claim ON progress_completion_event;
            DROP FUNCTION test_log_claim();
            DROP TABLE test_claims;
        """)


async def test_the_flush_notifies_the_relay_so_it_does_not_wait_for_a_poll(
    relay_settings: Settings,
    redis: Redis,
    db: asyncpg.Pool,
    executions: Executions,
    relay_claims: Callable[[], Awaitable[int]],
) -> None:
    await seed(db, users=2, contents=2, duration_s=600)
    # a poll every minute: only the NOTIFY of the flush statement can bring the event out in time
    async with running_app(relay_settings.model_copy(update={"relay_poll_interval_seconds": 60})) as (_, client):
        await wait_for(relay_claims)  # the relay's first pass (at start) has claimed, found nothing, and waits
        await post_near_end(client, relay_settings, users=1, lessons=1)
        await Flusher(relay_settings.flush, redis, db).flush_cycle()
        rows = await executions.wait_for(1, timeout_s=5)
    assert [kwargs_of(row)["user_id"] for row in rows] == [1]


async def test_completions_of_the_final_flush_on_shutdown_go_out_before_the_pod_stops(
    relay_settings: Settings, redis: Redis, db: asyncpg.Pool, executions: Executions
) -> None:
    await seed(db, users=2, contents=2, duration_s=600)
    # the flusher's interval is a minute: only the final flush on shutdown writes the event, after the
    # relay's loop has stopped; the relay's final pass must still publish it
    settings = relay_settings.model_copy(
        update={"progress_flusher_enabled": True, "progress_flush_interval_seconds": 60}
    )
    started = time.time()
    async with running_app(settings) as (_, client):
        await wait_for(flushed_since(started))  # the flusher's first cycle (at start) has run
        await post_near_end(client, settings, users=1, lessons=1)
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0
    rows = await executions.wait_for(1, timeout_s=10)
    assert [kwargs_of(row)["user_id"] for row in rows] == [1]
