"""The flush never stops: each brake holds what it protects and nothing more, and every wait is bounded.

One locked row holds its own key, a full Redis or a budget key pushed into the future costs seconds,
one type's backlog does not hold the others, nothing pending expires however slow the drain, a
SIGTERM ends every wait, and the counts summed over concurrent drains are exact.
"""

import asyncio
import itertools
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import asyncpg
import pytest
from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError

from service.config import Settings
from service.progress.flush.budget import FlushBudget
from service.progress.flush.flusher import Flusher
from service.progress.flush.leases import Leases
from service.progress.ingest.buffer import WRITE_SCRIPT, decode_value
from service.progress.keys import FLUSH_BUDGET_KEY, STANDALONE, KeyLayout
from tests.helpers import (
    Servers,
    assert_all_persisted,
    backlog,
    budget_ahead_s,
    fill,
    flusher_env,
    flusher_with,
    lesson_rows,
    metric,
    push_budget_key,
    seed,
    start_service_command,
    wait_for,
    write,
)

pytestmark = pytest.mark.regression


@pytest.fixture(autouse=True)
async def write_script(redis: Redis) -> None:
    await redis.script_load(WRITE_SCRIPT)


@pytest.fixture
async def locker(migrated: str) -> AsyncIterator[asyncpg.Connection]:
    """Another session of the monolith's: an admin edit, a select_for_update, an idle transaction."""
    conn = await asyncpg.connect(migrated)
    try:
        yield conn
    finally:
        await conn.close()


async def test_one_locked_row_holds_its_key_only(
    settings: Settings, redis: Redis, db: asyncpg.Pool, locker: asyncpg.Connection
) -> None:
    last = await fill(redis, db, 2000)
    await db.execute(
        "INSERT INTO engagements_lessonprogress (user_id, lesson_id, position, created_at, updated_at)"
        " VALUES (1, 1, 1, now() - interval '1 hour', now() - interval '1 hour')"
    )
    flusher = flusher_with(settings, redis, db, database_lock_timeout_seconds=0.5, progress_flush_max_rows_per_second=0)
    locked_before = metric("progress_flush_locked_total", content_type="lesson")
    async with locker.transaction():
        await locker.execute("SELECT 1 FROM engagements_lessonprogress WHERE user_id = 1 AND lesson_id = 1 FOR UPDATE")
        result = await flusher.flush_cycle()
        rows = await lesson_rows(db)
        # every other key of the batch (and of the type) is written; the locked one waits, pending
        assert len(rows) == 2000 and rows[(1, 1)]["position"] == 1
        assert sum(row["position"] == last[key] for key, row in rows.items()) == 1999
        assert await redis.sismember("progress:pending_flush:lesson", "1:1")
        assert await redis.zcard("progress:in_flight:lesson") == 0
        assert result.failed_batches == 0 and result.locked >= 1
        assert metric("progress_flush_locked_total", content_type="lesson") > locked_before
    await flusher.flush_cycle()
    await assert_all_persisted(redis, db, last)


async def test_what_a_lock_keeps_from_the_database_costs_the_fleet_no_budget(
    settings: Settings, redis: Redis, db: asyncpg.Pool, locker: asyncpg.Connection
) -> None:
    """Found by the nemesis: a content table under a migration's lock failed its type's batch every cycle, and
    every pod spent that batch's budget on nothing, so the other types drained slower than their fair turn."""
    last = await fill(redis, db, 50)
    flusher = flusher_with(
        settings, redis, db, database_lock_timeout_seconds=0.2, progress_flush_max_rows_per_second=50
    )
    assert flusher.budget.batch_rows == 50  # a batch is one second of the budget
    async with locker.transaction():
        await locker.execute("LOCK TABLE engagements_lessonprogress IN ACCESS EXCLUSIVE MODE")
        result = await flusher.flush_cycle()
        assert result.failed_batches == 1 and result.written == 0
        assert not await _ahead_s(redis, 0.3)  # the failed batch's second went back
    await flusher.flush_cycle()
    await assert_all_persisted(redis, db, last)


async def test_a_user_row_held_against_the_foreign_key_holds_that_users_keys_only(
    settings: Settings, redis: Redis, db: asyncpg.Pool, locker: asyncpg.Connection
) -> None:
    """New rows of a user whose row is held FOR UPDATE would wait at the foreign key's check (at commit): the
    upsert takes that check's lock up front, skipping the held user's row, and writes the rest."""
    await seed(db, users=40, contents=1)
    for user_id in range(1, 41):
        await write(redis, "lesson", 1, user_id, 30)
    flusher = flusher_with(settings, redis, db, database_lock_timeout_seconds=0.2, progress_flush_max_rows_per_second=0)
    async with locker.transaction():
        await locker.execute("SELECT 1 FROM users_user WHERE id = 17 FOR UPDATE")
        result = await flusher.flush_cycle()
        assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 39
        assert await redis.smembers("progress:pending_flush:lesson") == {"1:17"}
        assert result.failed_batches == 0 and result.locked == 1
    await flusher.flush_cycle()
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 40


@asynccontextmanager
async def full(redis: Redis) -> AsyncIterator[None]:
    """Redis at maxmemory with noeviction, the documented production setting; restored after."""
    before = await redis.config_get("maxmemory", "maxmemory-policy")
    try:
        await redis.config_set("maxmemory-policy", "noeviction")
        used = int((await redis.info("memory"))["used_memory"])
        await redis.config_set("maxmemory", str(max(1, used // 2)))  # well under, whatever is freed meanwhile
        with pytest.raises(OutOfMemoryError):
            await redis.set("probe", "x")
        yield
    finally:
        await redis.config_set("maxmemory", before["maxmemory"])
        await redis.config_set("maxmemory-policy", before["maxmemory-policy"])


async def test_a_full_redis_does_not_stop_the_budgeted_flush(
    settings: Settings, redis: Redis, db: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    last = await fill(redis, db, 2000)
    flusher = flusher_with(settings, redis, db, progress_flush_max_rows_per_second=20_000)
    fallback_before = metric("progress_flush_budget_fallback_total")
    async with full(redis):
        with caplog.at_level(logging.WARNING, logger="service.progress.flush.budget"):
            result = await asyncio.wait_for(flusher.flush_cycle(), 30)
    assert result.written == 2000 and result.failed_batches == 0
    await assert_all_persisted(redis, db, last)
    assert metric("progress_flush_budget_fallback_total") > fallback_before
    assert sum("keeps to its share" in record.getMessage() for record in caplog.records) == 1  # once, not per batch


async def test_a_budget_key_in_the_future_costs_seconds_not_hours(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    """A Redis clock stepped back, or a failover to a replica whose clock lags, leaves the key ahead."""
    last = await fill(redis, db, 1000)
    await push_budget_key(redis, 3600)
    flusher = flusher_with(settings, redis, db, progress_flush_max_rows_per_second=2000)
    started = time.monotonic()
    result = await asyncio.wait_for(flusher.flush_cycle(), 30)
    assert result.written == 1000
    # about half a second of budget, and at most one capped wait for the key's stale time
    assert time.monotonic() - started < flusher.budget.max_wait_s + 1000 / 2000 + 2
    await assert_all_persisted(redis, db, last)


async def test_a_pod_with_a_smaller_budget_does_not_hold_the_others(redis: Redis) -> None:
    misconfigured = FlushBudget(redis, rows_per_second=10, batch_size=500)
    assert await misconfigured.reserve(misconfigured.batch_rows) is not None  # 10 rows: a second of its pace
    await misconfigured._script(keys=[FLUSH_BUDGET_KEY], args=[10, 500, 0, 10**12])  # 500 rows at 10/s: 50 s
    correct = FlushBudget(redis, rows_per_second=2000, batch_size=500)
    started = time.monotonic()
    assert await asyncio.wait_for(correct.reserve(500), 10) is not None
    assert time.monotonic() - started < correct.max_wait_s + 0.5


async def test_a_budget_wait_ends_on_stop_and_gives_its_rows_back(redis: Redis) -> None:
    budget = FlushBudget(redis, rows_per_second=100, batch_size=100)
    assert await budget.reserve(100) is not None  # the next 100 rows wait a second
    stop = asyncio.Event()
    waiting = asyncio.create_task(budget.reserve(100, stop))
    await wait_for(lambda: _ahead_s(redis, 1.5))  # reserved: the key now ends two seconds ahead
    stop.set()
    assert await asyncio.wait_for(waiting, 0.5) is None
    assert not await _ahead_s(redis, 1.1)  # given back: one second of budget left, not two
    cancelled = asyncio.create_task(budget.reserve(100))
    await wait_for(lambda: _ahead_s(redis, 1.5))
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not await _ahead_s(redis, 1.1)


async def _ahead_s(redis: Redis, seconds: float) -> bool:
    """Whether the budget's reservations end more than `seconds` after the server's time."""
    return await budget_ahead_s(redis) > seconds


async def test_a_type_its_lock_holds_delays_no_other_types_next_cycle(
    settings: Settings, redis: Redis, db: asyncpg.Pool, locker: asyncpg.Connection
) -> None:
    """Found by the nemesis: the loop waited an interval after each cycle ended, and a cycle lasted as long as
    the drain that waited lock_timeout on the locked type: every other type's turn came one lock_timeout later."""
    await fill(redis, db, 20)
    flusher = flusher_with(
        settings,
        redis,
        db,
        database_lock_timeout_seconds=1.0,
        progress_flush_interval_seconds=1.0,
        progress_flush_max_rows_per_second=0,
    )
    began: list[float] = []
    cycle = flusher.flush_cycle

    async def recorded(*args: object, **kwargs: object) -> object:
        began.append(time.monotonic())
        await write(redis, "lesson", 1, 1, 100 + len(began))  # the locked type has a batch every cycle
        return await cycle(*args, **kwargs)  # type: ignore[arg-type]

    flusher.flush_cycle = recorded  # type: ignore[method-assign]
    stop = asyncio.Event()
    async with locker.transaction():
        await locker.execute("LOCK TABLE engagements_lessonprogress IN ACCESS EXCLUSIVE MODE")
        running = asyncio.create_task(flusher.run(stop))
        await wait_for(lambda: _began_at_least(began, 5), timeout_s=15)
        stop.set()
    await running
    gaps = [later - earlier for earlier, later in itertools.pairwise(began)]
    # a cycle begins an interval (1 s, ±10 %) after the last one began, not lock_timeout + an interval (2 s)
    assert len(gaps) >= 3 and max(gaps[:-1]) < 1.5, gaps


async def _began_at_least(began: list[float], cycles: int) -> bool:
    return len(began) >= cycles


async def test_one_types_backlog_does_not_hold_another(
    settings: Settings, redis: Redis, db: asyncpg.Pool, locker: asyncpg.Connection
) -> None:
    await fill(redis, db, 6000)  # 3 s of lessons at the budget
    await write(redis, "live", 1, 1, 595)  # a completion, behind them
    flusher = flusher_with(settings, redis, db, progress_flush_max_rows_per_second=2000)
    cycle = asyncio.create_task(flusher.flush_cycle())
    try:
        # asked on a connection of its own: the flush's drains hold the pool's
        completed = "SELECT completed_at FROM lives_liveprogress WHERE user_id = 1"
        await wait_for(lambda: locker.fetchval(completed), 1.0)
        assert await redis.scard("progress:pending_flush:lesson") > 2000  # the lessons are far from done
    finally:
        result = await cycle
    assert result.written == 6001 and result.completions == 1


async def test_nothing_pending_expires_however_slow_the_drain(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=30, contents=1)
    for user_id in range(1, 31):
        await write(redis, "lesson", 1, user_id, 40)
    assert {await redis.ttl(f"progress:latest_position:lesson:1:{u}") for u in range(1, 31)} == {-1}
    # 30 rows at 10 a second: the drain takes three times the TTL the flushed values get
    flush = replace(settings.flush, lease_s=5, margin_s=10, interval_s=1, concurrency=2, value_ttl_s=1)
    flusher = Flusher(flush, redis, db, FlushBudget(redis, rows_per_second=10, batch_size=500))
    result = await flusher.flush_cycle()
    assert (result.written, result.expired) == (30, 0)
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress WHERE position = 40") == 30
    # flushed: now the TTL cleans them up
    assert {await redis.pttl(f"progress:latest_position:lesson:1:{u}") for u in range(1, 31)} <= {-2, *range(1001)}


async def test_a_value_written_again_after_its_claim_keeps_no_ttl(redis: Redis, db: asyncpg.Pool) -> None:
    await seed(db, users=1, contents=1)
    await write(redis, "lesson", 1, 1, 10)
    leases = Leases(redis, value_ttl_s=60)
    (shard,) = STANDALONE.shards_of("lesson")
    claim = await leases.claim_batch(shard, count=10, lease_ms=5000)
    await write(redis, "lesson", 1, 1, 20)  # pending again, while the first is being persisted
    assert await leases.ack(claim) == 1
    assert await redis.ttl("progress:latest_position:lesson:1:1") == -1
    assert decode_value(await redis.get("progress:latest_position:lesson:1:1")).position == 20


async def test_a_shutdown_during_a_paced_backlog_runs_the_final_flush_in_time(
    settings: Settings, redis: Redis, db: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    await fill(redis, db, 4000)  # 8 s at the budget
    flusher = flusher_with(
        settings, redis, db, progress_flush_max_rows_per_second=500, progress_shutdown_timeout_seconds=1.5
    )
    stop = asyncio.Event()
    with caplog.at_level(logging.INFO, logger="service.progress.flush.flusher"):
        running = asyncio.create_task(flusher.run(stop))
        await wait_for(lambda: db.fetchval("SELECT count(*) FROM engagements_lessonprogress"))
        stop.set()
        stopped = time.monotonic()
        await asyncio.wait_for(running, 1.5 + 1.0)  # the wait in hand ends now, then the final flush's deadline
    assert time.monotonic() - stopped < 1.5 + 1.0
    assert any("final flush did not finish" in r.getMessage() for r in caplog.records)
    # what the final flush did not write is pending, nothing under a lease; its reservations were given back
    assert await redis.zcard("progress:in_flight:lesson") == 0
    assert not await _ahead_s(redis, 1.1)
    # the rest is flushed whole by the next cycle (unpaced: at the budget it would take the backlog's 7 s)
    await flusher_with(settings, redis, db, progress_flush_max_rows_per_second=0).flush_cycle()
    assert await redis.scard("progress:pending_flush:lesson") == 0


async def test_expired_leases_are_counted_whatever_the_drains(
    settings: Settings, redis: Redis, db: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """A flusher died holding 500 entries: the next one requeues them, and the count says so."""
    last = await fill(redis, db, 500)
    (shard,) = STANDALONE.shards_of("lesson")
    await Leases(redis).claim_batch(shard, count=500, lease_ms=-60_000)  # long expired
    flusher = flusher_with(settings, redis, db, progress_flush_concurrency=4, progress_flush_max_rows_per_second=0)
    requeued_before = metric("progress_flush_requeued_total")
    # the pool's four connections open already: the drains start together, as in a pod that has run a while
    held = [await db.acquire() for _ in range(4)]
    for conn in held:
        await db.release(conn)
    with caplog.at_level(logging.WARNING, logger="service.progress.flush.flusher"):
        result = await flusher.flush_cycle()
    assert (result.requeued, result.written) == (500, 500)
    assert metric("progress_flush_requeued_total") - requeued_before == 500
    assert [getattr(r, "count", None) for r in caplog.records if "lease expired" in r.getMessage()] == [500]
    await assert_all_persisted(redis, db, last)


def test_a_ttl_within_the_lease_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"PROGRESS_POSITION_TTL_SECONDS .* PROGRESS_FLUSH_LEASE_SECONDS"):
        Settings(jwt_secret="x" * 32, progress_position_ttl_seconds=60, progress_flush_lease_seconds=120)
    with pytest.raises(ValueError, match="and PROGRESS_FLUSH_INTERVAL_SECONDS"):
        Settings(jwt_secret="x" * 32, progress_position_ttl_seconds=200, progress_flush_interval_seconds=300)
    assert Settings(jwt_secret="x" * 32, progress_position_ttl_seconds=120, progress_flush_lease_seconds=120)


@pytest.mark.slow
async def test_flush_once_stops_on_sigterm_whatever_the_budget_key_says(
    servers: Servers, redis: Redis, db: asyncpg.Pool
) -> None:
    await fill(redis, db, 2000)  # 20 s at the budget below
    await push_budget_key(redis, 3600)
    env = flusher_env(servers, PROGRESS_FLUSH_MAX_ROWS_PER_SECOND="100", PROGRESS_FLUSH_LEASE_SECONDS="30")
    process = await start_service_command("flush", "--once", env=env)
    try:
        await wait_for(lambda: db.fetchval("SELECT count(*) FROM engagements_lessonprogress"), 15)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 5)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, stderr
    written = json.loads(stdout.decode().strip().splitlines()[-1])["written"]
    assert 0 < written < 2000
    # what it did not write waits in the pending set, none of it under a lease
    assert await backlog(redis) == (2000 - written, 0)


async def test_one_cycle_drains_every_shard_of_a_type_under_the_budget(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    """A drain's batch takes the quota of its own shard, not of its whole type: the other drains still
    claim the other shards while it waits for the budget."""
    layout = KeyLayout(shards=4)
    last = await fill(redis, db, 400, layout)
    flusher = flusher_with(
        settings,
        redis,
        db,
        progress_buffer_shards=4,
        progress_flush_concurrency=4,
        progress_flush_max_rows_per_second=2000,
    )
    result = await flusher.flush_cycle()
    assert result.written == 400
    await assert_all_persisted(redis, db, last, layout)


async def test_a_batch_split_on_row_locks_settles_within_its_lease(
    settings: Settings, redis: Redis, db: asyncpg.Pool, locker: asyncpg.Connection
) -> None:
    """Found by an attack: with many locked user rows the batch was split past its lease (another pod could take
    its entries over) and held the cycle; the locked users' keys alone wait now, found in the one statement."""
    await seed(db, users=40, contents=1)
    for user_id in range(1, 41):
        await write(redis, "lesson", 1, user_id, 30)
    flusher = flusher_with(
        settings,
        redis,
        db,
        database_lock_timeout_seconds=0.2,
        progress_flush_lease_seconds=2,
        progress_flush_concurrency=1,
        progress_flush_max_rows_per_second=0,
    )
    async with locker.transaction():
        await locker.execute("SELECT 1 FROM users_user WHERE id % 4 = 0 FOR UPDATE")  # 10 of the 40
        started = time.monotonic()
        result = await flusher.flush_cycle()
        assert time.monotonic() - started < 2.0  # settled before its lease ran out
        assert result.failed_batches == 0 and await redis.zcard("progress:in_flight:lesson") == 0
        pending = await redis.smembers("progress:pending_flush:lesson")
        assert {f"1:{u}" for u in range(4, 41, 4)} <= pending  # the locked users' keys wait
        assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") + len(pending) == 40
    await flusher.flush_cycle()
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 40


@pytest.mark.slow
async def test_twenty_users_held_for_update_hold_back_only_their_own_keys(
    settings: Settings, redis: Redis, db: asyncpg.Pool, locker: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by an attack: 20 users' rows held FOR UPDATE split batches until half the lease (1,251 of 4,000 keys
    written in 60 s), and the log blamed 'locked by another session' on ~190 unlocked entries per batch. The
    foreign key's check waited on the held user rows; the upsert now takes that lock itself and skips them."""
    last = await fill(redis, db, 4000)  # 400 users x 10 lessons
    held = set(range(1, 400, 20))  # 20 users, spread over every batch
    flusher = flusher_with(settings, redis, db, database_lock_timeout_seconds=0.5, progress_flush_max_rows_per_second=0)
    async with locker.transaction():
        await locker.execute("SELECT 1 FROM users_user WHERE id = ANY($1::bigint[]) FOR UPDATE", sorted(held))
        with caplog.at_level(logging.WARNING, logger="service.progress.flush.store"):
            for _ in range(2):
                await asyncio.wait_for(flusher.flush_cycle(), 30)
        rows = await lesson_rows(db)
        assert {user_id for _, user_id in rows} == set(range(1, 401)) - held  # every other user's keys, all
        assert len(rows) == 4000 - 10 * len(held)
        pending = await redis.smembers("progress:pending_flush:lesson")
        assert pending == {f"{lesson}:{user}" for user in held for lesson in range(1, 11)}
        assert await redis.zcard("progress:in_flight:lesson") == 0
        lines = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
        assert lines and all("user rows locked by another session: user ids" in line for line in lines)
        assert not any("progress rows locked" in line for line in lines)  # no other lock is blamed
    await flusher.flush_cycle()  # released: their keys go too
    await assert_all_persisted(redis, db, last)
