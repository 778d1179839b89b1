"""Paging every trial in its journey, the run-once command, and the periodic sweep of `serve`.

The sweeps reserve; the relay (the `stream` fixture) publishes, woken by each reservation.
"""

import asyncio
import json
import os
from datetime import UTC, datetime, timedelta

import asyncpg
from redis.asyncio import Redis

from service.compose import periodic_sweep
from service.config import Settings
from service.progress.flush.budget import FlushBudget
from service.trial_emails.batch import BatchOptions, BatchResult
from service.trial_emails.sweep import SWEEP_LOCK_KEY, sweep_journeys
from tests.helpers import add_trials, enqueued, metric, relayed, reserved, start_service_command, wait_for

NOW = datetime(2025, 3, 10, 12, tzinfo=UTC)


async def add_journeys_and_strays(db: asyncpg.Pool, now: datetime, *, in_journey: int) -> None:
    """`in_journey` trials owing all six emails (users 1..), and two that are out of it (users 101, 102)."""
    await add_trials(db, in_journey, started_at=now - timedelta(days=7), ends_at=now - timedelta(hours=23))
    await add_trials(db, 1, started_at=now + timedelta(minutes=1), ends_at=now + timedelta(days=7), first_user=101)
    await add_trials(db, 1, started_at=now - timedelta(days=8), ends_at=now - timedelta(days=1), first_user=102)


async def test_a_sweep_pages_only_the_trials_in_their_journey_in_batches(
    trials_db: asyncpg.Pool, redis: Redis, stream: str, settings: Settings
) -> None:
    await add_journeys_and_strays(trials_db, NOW, in_journey=7)
    progress: list[tuple[int, int, BatchResult]] = []

    result = await sweep_journeys(
        pool=trials_db,
        options=BatchOptions(settings.send_email, batch_size=3),
        now=NOW,
        on_batch=lambda done, total, batch: progress.append((done, total, batch)),
    )

    assert result == {"status": "ok", "user_trials": 7, "sent": 42}
    assert [(done, total, batch["user_trials"]) for done, total, batch in progress] == [(3, 7, 3), (6, 7, 3), (7, 7, 1)]
    await relayed(trials_db)
    assert {user for user, _ in await enqueued(redis, stream)} == set(range(1, 8))


async def test_run_once_prints_progress_on_stderr_and_the_summed_result_last_on_stdout(
    trials_db: asyncpg.Pool, redis: Redis, stream: str, settings: Settings
) -> None:
    await add_journeys_and_strays(trials_db, datetime.now(UTC), in_journey=5)
    env = {
        **os.environ,
        "DATABASE_URL": settings.database_url,
        "REDIS_URL": settings.redis_url,
        "LOG_LEVEL": "INFO",
        "EMAIL_PUBLISHER": "redis-stream",
    }
    process = await start_service_command("trial-emails", "run-once", env=env)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)

    assert process.returncode == 0, stderr.decode()
    assert stdout.decode().splitlines() == [json.dumps({"status": "ok", "user_trials": 5, "sent": 30})]
    # off a terminal: a log line per interval (none in so short a run) and the summary
    progress = [json.loads(line) for line in stderr.decode().splitlines() if '"service.console"' in line]
    assert progress[-1]["message"].startswith("trial-emails run-once done: 5 of 5 trials in ")
    assert progress[-1]["count"] == 5
    await relayed(trials_db)  # the relay of this process, woken by the command's reservations
    assert len(await enqueued(redis, stream)) == 30


def every(settings: Settings, interval_s: float) -> Settings:
    return settings.model_copy(update={"trial_journey_interval_seconds": interval_s})


async def test_the_periodic_sweep_enqueues_once_however_often_it_runs(
    trials_db: asyncpg.Pool, redis: Redis, stream: str, settings: Settings
) -> None:
    await add_journeys_and_strays(trials_db, datetime.now(UTC), in_journey=4)
    done_before = metric("progress_trial_journey_sweeps_total", outcome="done")
    stop = asyncio.Event()
    sweeper = asyncio.create_task(
        periodic_sweep(every(settings, 0.05), trials_db, stop, FlushBudget.from_settings(settings.flush, redis))
    )
    try:
        await wait_for(lambda: done_above(done_before + 3))
    finally:
        stop.set()
        await asyncio.wait_for(sweeper, timeout=5)

    await relayed(trials_db)
    counts = await enqueued(redis, stream)
    assert len(counts) == 24 and set(counts.values()) == {1}


async def test_the_periodic_sweep_waits_while_another_pod_holds_the_lock(
    trials_db: asyncpg.Pool, redis: Redis, stream: str, settings: Settings
) -> None:
    await add_journeys_and_strays(trials_db, datetime.now(UTC), in_journey=2)
    locked_before = metric("progress_trial_journey_sweeps_total", outcome="locked")
    stop = asyncio.Event()
    async with trials_db.acquire() as other_pod:
        await other_pod.execute("SELECT pg_advisory_lock($1)", SWEEP_LOCK_KEY)
        sweeper = asyncio.create_task(
            periodic_sweep(every(settings, 0.05), trials_db, stop, FlushBudget.from_settings(settings.flush, redis))
        )
        try:
            await wait_for(lambda: locked_above(locked_before + 1))
            assert await reserved(trials_db) == set()
            await other_pod.execute("SELECT pg_advisory_unlock($1)", SWEEP_LOCK_KEY)
            await wait_for(lambda: stream_length_is(redis, stream, 12))
        finally:
            stop.set()
            await asyncio.wait_for(sweeper, timeout=5)


async def test_the_periodic_sweep_survives_a_failed_sweep_and_stops_on_request(
    trials_db: asyncpg.Pool, migrated: str, redis: Redis, stream: str, settings: Settings
) -> None:
    await add_journeys_and_strays(trials_db, datetime.now(UTC), in_journey=1)
    failed_before = metric("progress_trial_journey_sweeps_total", outcome="failed")
    done_before = metric("progress_trial_journey_sweeps_total", outcome="done")
    impatient = await asyncpg.create_pool(migrated, min_size=1, max_size=2, server_settings={"lock_timeout": "100"})
    stop = asyncio.Event()
    try:
        async with trials_db.acquire() as migration:
            # a migration holds the reservations' table: the first sweep gives up on its lock
            transaction = migration.transaction()
            await transaction.start()
            await migration.execute("LOCK TABLE emails_emaildispatch IN ACCESS EXCLUSIVE MODE")
            sweeper = asyncio.create_task(
                periodic_sweep(every(settings, 0.5), impatient, stop, FlushBudget.from_settings(settings.flush, redis))
            )
            await wait_for(lambda: failed_above(failed_before))
            await transaction.rollback()
        await wait_for(lambda: done_above(done_before))  # the loop went on after the failure
    finally:
        stop.set()
        await asyncio.wait_for(sweeper, timeout=5)
        await impatient.close()

    assert metric("progress_trial_journey_sweeps_total", outcome="failed") == failed_before + 1
    assert len(await reserved(trials_db)) == 6
    await relayed(trials_db)
    counts = await enqueued(redis, stream)
    assert len(counts) == 6 and set(counts.values()) == {1}


async def test_an_interval_of_zero_disables_the_periodic_sweep(
    trials_db: asyncpg.Pool, redis: Redis, settings: Settings
) -> None:
    await add_journeys_and_strays(trials_db, datetime.now(UTC), in_journey=1)
    await asyncio.wait_for(
        periodic_sweep(
            every(settings, 0), trials_db, asyncio.Event(), FlushBudget.from_settings(settings.flush, redis)
        ),
        timeout=1,
    )
    assert await reserved(trials_db) == set()


async def done_above(value: float) -> bool:
    return metric("progress_trial_journey_sweeps_total", outcome="done") > value


async def locked_above(value: float) -> bool:
    return metric("progress_trial_journey_sweeps_total", outcome="locked") > value


async def failed_above(value: float) -> bool:
    return metric("progress_trial_journey_sweeps_total", outcome="failed") > value


async def stream_length_is(redis: Redis, stream: str, length: int) -> bool:
    return bool(await redis.xlen(stream) == length)
