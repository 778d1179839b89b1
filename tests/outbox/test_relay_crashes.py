"""The relay as its own process (`relay --once`): killed at named points, and three of them racing."""

import asyncio
import signal
from collections.abc import Sequence

import asyncpg
import pytest

from service.compose import completion_route
from service.config import Settings
from service.dev.embedded import free_port
from service.outbox.celery_publisher import CeleryPublisher
from service.outbox.messages import Message, Publisher, PublishResult
from service.outbox.relay import Relay
from service.postgres import create_db_pool
from tests.helpers import Servers, add_events, limited_broker_user, relay_env, relay_once, start_service_command
from tests.monolith.fixtures import Broker, Executions

pytestmark = pytest.mark.slow  # relay processes and a real Celery worker


async def lease_runs_out(db: asyncpg.Pool) -> None:
    """Time moved rather than waited: every claimed event's lease (RELAY_LEASE_S) ended a moment ago."""
    claimed = await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE claimed_until > now()")
    assert claimed > 0, "the dead relay held no lease"
    await db.execute(
        "UPDATE progress_completion_event SET claimed_until = now() - interval '1 ms' WHERE claimed_until > now()"
    )


async def test_killed_after_publish_before_the_mark_republishes_with_the_same_task_ids(
    servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    await add_events(db, 50)

    code, _ = await relay_once(servers, broker, die_at="relay.after_publish")

    assert code == -9
    first = await executions.wait_for(50)
    assert len(first) == 50
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 50
    await lease_runs_out(db)  # the dead relay's
    code, summary = await relay_once(servers, broker)
    assert code == 0 and summary is not None
    assert summary["published"]["completion"] == 50 and summary["republished"]["completion"] == 50
    await executions.wait_for(100)
    counts = await executions.by_task_id()
    assert len(counts) == 50 and set(counts.values()) == {2}  # each republished once, same task id
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0


async def test_killed_after_the_claim_publishes_each_once_after_the_lease(
    servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    await add_events(db, 30)

    code, _ = await relay_once(servers, broker, die_at="relay.after_claim")
    assert code == -9
    await lease_runs_out(db)
    code, summary = await relay_once(servers, broker)

    assert code == 0 and summary is not None and summary["published"]["completion"] == 30
    await executions.wait_for(30)
    counts = await executions.by_task_id()
    assert len(counts) == 30 and set(counts.values()) == {1}


async def test_three_relays_racing_publish_each_event_exactly_once(
    servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    await add_events(db, 600)

    results = await asyncio.gather(*(relay_once(servers, broker) for _ in range(3)))

    assert [code for code, _ in results] == [0, 0, 0]
    assert sum(summary["published"]["completion"] for _, summary in results if summary) == 600
    await executions.wait_for(600, timeout_s=60)
    counts = await executions.by_task_id()
    assert len(counts) == 600 and set(counts.values()) == {1}
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0


async def test_relay_once_with_the_broker_down_exits_1_and_leaves_every_row_owed(
    servers: Servers, broker: Broker, db: asyncpg.Pool
) -> None:
    await add_events(db, 5)

    code, summary = await relay_once(servers, broker, CELERY_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0")

    assert code == 1 and summary is not None and summary["broker_unavailable"]
    assert summary["published"]["completion"] == 0
    # released, not left leased: the next relay takes them at once, and not as a republish
    rows = await db.fetch("SELECT claimed_until, publish_attempts, published_at FROM progress_completion_event")
    assert [tuple(row) for row in rows] == [(None, 0, None)] * 5


async def test_a_message_the_broker_refuses_for_good_is_parked_and_counted_once_not_retried(
    servers: Servers, broker: Broker, db: asyncpg.Pool
) -> None:
    await add_events(db, 3)
    limited_url = await limited_broker_user(broker)
    # one attempt: parked at the first refusal (tests/outbox/test_refusals.py has the retries before it)
    refused = {"CELERY_BROKER_URL": limited_url, "COMPLETION_TASK_QUEUE": "forbidden", "OUTBOX_MAX_ATTEMPTS": "1"}

    first = await relay_once(servers, broker, **refused)
    again = await relay_once(servers, broker, **refused)

    assert first[0] == 0 and first[1] is not None and first[1]["parked"]["completion"] == 3, first
    assert again[0] == 0 and again[1] is not None and again[1]["parked"]["completion"] == 0
    rows = await db.fetch("SELECT published_at, publish_failed_at, publish_error FROM progress_completion_event")
    assert all(row["published_at"] is None and row["publish_failed_at"] is not None for row in rows)
    assert all("NOPERM" in row["publish_error"] or "permission" in row["publish_error"].lower() for row in rows)


async def test_the_long_running_relay_publishes_then_stops_on_sigterm_with_exit_0(
    servers: Servers, broker: Broker, db: asyncpg.Pool, executions: Executions
) -> None:
    await add_events(db, 5)
    process = await start_service_command("relay", env=relay_env(servers, broker, RELAY_POLL_INTERVAL_SECONDS="0.2"))
    try:
        assert len(await executions.wait_for(5)) == 5
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, stderr.decode()[-2000:]
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0


class _LockedAfterPublish:
    """The broker takes the batch; then, before the relay marks it, a migration locks the outbox for `hold_s`."""

    def __init__(self, publisher: Publisher, locker: asyncpg.Connection, hold_s: float) -> None:
        self._publisher, self._locker, self._hold_s = publisher, locker, hold_s
        self.released = asyncio.Event()

    async def publish(self, messages: Sequence[Message]) -> PublishResult:
        sent = await self._publisher.publish(messages)
        locked = self._locker.transaction()
        await locked.start()
        await self._locker.execute("LOCK TABLE progress_completion_event IN ACCESS EXCLUSIVE MODE")

        async def release() -> None:
            await asyncio.sleep(self._hold_s)
            await locked.rollback()
            self.released.set()

        self._release = asyncio.ensure_future(release())
        return sent


@pytest.mark.regression
async def test_a_mark_the_database_refuses_for_a_moment_sends_nothing_twice(
    relay_settings: Settings, db: asyncpg.Pool, migrated: str
) -> None:
    """Found by an attack: with every process up, a lock held on the outbox between the publish and the mark failed
    the mark in lock_timeout, and the whole batch the broker had went out again once its lease ran out."""
    await add_events(db, 5)
    # a lease long enough to wait out the lock: a retry starts only while it can end within the lease
    settings = relay_settings.model_copy(
        update={
            "database_lock_timeout_seconds": 0.3,
            "database_statement_timeout_seconds": 1.0,
            "relay_lease_seconds": 6.0,
        }
    )
    pool = await create_db_pool(settings.database)
    locker = await asyncpg.connect(migrated)
    publisher = CeleryPublisher(settings.relay)
    try:
        locking = _LockedAfterPublish(publisher, locker, hold_s=1.0)
        relay = Relay(settings.relay, pool, [completion_route(settings, locking)])
        result = await relay.relay_once()
        assert locking.released.is_set()  # the mark waited out the lock, within the batch's lease
        assert result.published == {"completion": 5}
        assert await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE published_at IS NULL") == 0
        assert await db.fetchval("SELECT array_agg(DISTINCT publish_attempts) FROM progress_completion_event") == [1]
        # the batch's lease over: nothing is owed, nothing goes out again
        await db.execute("UPDATE progress_completion_event SET claimed_until = now() - interval '1 second'")
        assert (await relay.relay_once()).published == {"completion": 0}
    finally:
        await asyncio.to_thread(publisher.close)
        await locker.close()
        await pool.close()
