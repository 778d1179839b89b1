"""The flush yields to the monolith's database: the fleet's write budget, lock_timeout, a fixed concurrency.

Rows are counted from Postgres itself: a statement trigger of the test's own records, per statement,
the clock_timestamp() and the number of rows it inserted.
"""

import asyncio
import itertools
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable

import asyncpg
import pytest
from redis.asyncio import Redis

from service.config import Settings
from service.progress.flush.budget import FlushBudget, Reservation
from service.progress.ingest.buffer import WRITE_SCRIPT
from service.progress.keys import FLUSH_BUDGET_KEY
from service.redis_client import connect_redis
from tests.helpers import (
    InsertLog,
    Servers,
    assert_all_persisted,
    backlog,
    fill,
    flusher_env,
    flusher_with,
    insert_log,
    metric,
)


@pytest.fixture
async def write_log(db: asyncpg.Pool) -> AsyncIterator[InsertLog]:
    async with insert_log(db, "engagements_lessonprogress") as log:
        yield log


@pytest.fixture(autouse=True)
async def write_script(redis: Redis) -> None:
    await redis.script_load(WRITE_SCRIPT)  # fill() sends it by its digest


async def test_reservations_follow_one_another_at_the_budgets_pace(redis: Redis) -> None:
    budget = FlushBudget(redis, rows_per_second=1000)
    waits = [await _reserve_without_sleeping(redis, budget, 100) for _ in range(5)]
    # 100 rows at 1000/s: each reservation starts 0.1 s after the one before it, on the server's clock
    assert waits[0] == pytest.approx(0, abs=0.01)
    for before, after in itertools.pairwise(waits):
        assert after - before == pytest.approx(0.1, abs=0.01)
    # three batches' rows were not written: the next reservation starts sooner
    await budget.refund(Reservation(300, local=False), 300)
    assert await _reserve_without_sleeping(redis, budget, 100) == pytest.approx(waits[-1] - 0.2, abs=0.01)
    assert 0 < await redis.pttl(FLUSH_BUDGET_KEY) <= 2000  # gone once idle


async def _reserve_without_sleeping(redis: Redis, budget: FlushBudget, rows: int) -> float:
    reservation, wait_s = await budget._ask(rows, budget.max_wait_s, bounded=False)
    assert reservation is not None and not reservation.local
    return wait_s


async def test_no_budget_asks_nothing_of_redis(redis: Redis) -> None:
    budget = FlushBudget(redis, rows_per_second=0)
    assert await budget.reserve(10_000) == Reservation(10_000, local=False)
    assert await redis.exists(FLUSH_BUDGET_KEY) == 0


@pytest.mark.slow
async def test_a_backlog_drains_at_the_budget_never_in_a_burst(
    settings: Settings, redis: Redis, db: asyncpg.Pool, write_log: InsertLog
) -> None:
    # six seconds of budget: the first is free, the other five are waited for
    rows, budget = 24_000, 4_000
    last = await fill(redis, db, rows)
    flusher = flusher_with(settings, redis, db, progress_flush_max_rows_per_second=budget)
    waited = metric("progress_flush_budget_wait_seconds_total")
    started = time.monotonic()
    result = await flusher.flush_cycle()
    elapsed = time.monotonic() - started
    assert result.written == rows
    await assert_all_persisted(redis, db, last)
    peak = await write_log.peak_per_second()
    # a second's worth of reservations, plus what was reserved before the window and lands in it late: at most one
    # batch per drain, each in flight (CI, on 2 busy cores: 12,000, every drain's batch late at once)
    in_flight = settings.progress_flush_concurrency * flusher.budget.batch_rows
    assert peak <= budget + in_flight, (peak, in_flight)
    assert sum(rows for _, rows in await write_log.entries()) == rows
    assert elapsed > rows / budget * 0.9  # paced: unbudgeted, this takes about a second
    assert metric("progress_flush_budget_wait_seconds_total") - waited > 4


@pytest.mark.slow
async def test_two_flusher_processes_share_one_budget(
    servers: Servers, redis: Redis, db: asyncpg.Pool, write_log: InsertLog
) -> None:
    last = await fill(redis, db, 20_000)
    env = flusher_env(
        servers,
        PROGRESS_FLUSH_MAX_ROWS_PER_SECOND="4000",
        PROGRESS_FLUSH_BATCH_SIZE="200",
        PROGRESS_FLUSH_LEASE_SECONDS="30",
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "service", "flush", "--once"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=60) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    written = [json.loads(stdout.strip().splitlines()[-1])["written"] for stdout, _ in outputs]
    assert sum(written) == 20_000 and min(written) > 0, written  # both flushed, the backlog once
    await assert_all_persisted(redis, db, last)
    peak = await write_log.peak_per_second()
    assert peak < 1.2 * 4000, peak
    entries = await write_log.entries()
    assert entries[-1][0] - entries[0][0] > 20_000 / 4000 * 0.8  # together at one budget, not at two


@pytest.mark.slow
async def test_a_migrations_lock_sends_the_batches_back_within_lock_timeout_and_the_flush_resumes(
    settings: Settings, redis: Redis, db: asyncpg.Pool, migrated: str
) -> None:
    last = await fill(redis, db, 2000)
    # no budget here: every drain claims at once, so the batches are all in flight at the same moment
    flusher = flusher_with(
        settings,
        redis,
        db,
        database_lock_timeout_seconds=0.5,
        progress_flush_interval_seconds=0.2,
        progress_flush_max_rows_per_second=0,
    )
    migration = await asyncpg.connect(migrated)
    stop = asyncio.Event()
    running = None
    try:
        async with migration.transaction():
            await migration.execute("LOCK TABLE engagements_lessonprogress IN ACCESS EXCLUSIVE MODE")
            locked_at = time.monotonic()
            running = asyncio.create_task(flusher.run(stop))
            claimed_at = await _when(redis, lambda pending, in_flight: in_flight == 2000)
            released_at = await _when(redis, lambda pending, in_flight: (pending, in_flight) == (2000, 0))
            # every batch given back in lock_timeout (and a round trip), none left waiting under its lease
            assert released_at - claimed_at < 0.5 + 0.3, (claimed_at - locked_at, released_at - claimed_at)
            waiting = await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> $1",
                migration.get_server_pid(),
            )
            assert waiting <= settings.progress_flush_concurrency  # nothing piles up behind the lock
            await asyncio.sleep(max(0.0, 2.5 - (time.monotonic() - locked_at)))  # the migration goes on a while
        # the lock is gone: the flush comes back by itself, after its backoff
        deadline = time.monotonic() + 20
        while sum(await backlog(redis)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await assert_all_persisted(redis, db, last)
    finally:
        stop.set()
        if running is not None:
            await running
        await migration.close()


async def _when(redis: Redis, condition: Callable[[int, int], bool], timeout_s: float = 5.0) -> float:
    """When (time.monotonic()) the lesson backlog, (pending, in flight), first meets `condition`."""
    deadline = time.monotonic() + timeout_s
    while not condition(*await backlog(redis)):
        assert time.monotonic() < deadline, await backlog(redis)
        await asyncio.sleep(0.01)
    return time.monotonic()


async def test_a_requests_ask_of_a_stalled_redis_takes_no_longer_than_its_deadline(
    settings: Settings, redis: Redis
) -> None:
    # degraded mode's ask (a heartbeat whose Redis write just failed): a stalled Redis must not take the request's
    # whole deadline before its statement starts; the pod's own share answers instead
    client = connect_redis(settings.redis)
    budget = FlushBudget(client, rows_per_second=1000)
    await budget.reserve(1)  # the script loaded, a connection made
    await redis.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    started = time.monotonic()
    reservation = await budget.reserve(10, max_wait_s=0.3)
    waited = time.monotonic() - started
    await asyncio.sleep(max(0.0, 1.6 - waited))  # the pause's end
    await client.aclose()
    assert reservation is not None and reservation.local, reservation
    assert waited < 1.0, waited  # unbounded, the ask waits out the pause (1.5 s), and longer for a longer stall
