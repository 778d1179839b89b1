"""send_trial_journey_emails_batch on real Postgres and Redis: statements, rows, and what the relay puts on the stream.

The batch publishes nothing itself: the relay (the `stream` fixture, woken by each block's NOTIFY) does.
"""

import asyncio
import json
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from redis.asyncio import Redis

from service.config import Settings
from service.outbox.outboxes import NOTIFY_CHANNEL
from service.trial_emails.batch import BatchOptions, reserve_in_blocks, send_trial_journey_emails_batch
from service.trial_emails.reservations import LOAD_SENT_KEYS_SQL, LOAD_TRIALS_SQL, RESERVE_BLOCK_SQL, Pair
from tests.helpers import (
    Statements,
    Window,
    add_trials,
    enqueued,
    relayed,
    reserved,
    start_service_command,
    stream_entries,
    wait_for,
)

NOW = datetime(2025, 3, 10, 12, tzinfo=UTC)
# a 20-day trial at its midpoint owes welcome, tips and midpoint
MIDWAY = Window(started_at=NOW - timedelta(days=10), ends_at=NOW + timedelta(days=10))
# ended an hour ago, still in the day of grace: owes all six
ALL_DUE = Window(started_at=NOW - timedelta(days=10), ends_at=NOW - timedelta(hours=1))


def with_blocks(settings: Settings, block_size: int) -> BatchOptions:
    return BatchOptions(settings.send_email, block_size=block_size)


async def reserve(pool: asyncpg.Pool, pairs: Sequence[Pair]) -> int:
    async with pool.acquire() as conn:
        return await reserve_in_blocks(conn, pairs, block_size=200)


async def test_several_due_emails_per_trial_are_reserved_in_one_statement_and_all_enqueued(
    trials_db: asyncpg.Pool, counted: tuple[asyncpg.Pool, Statements], redis: Redis, stream: str, settings: Settings
) -> None:
    pool, statements = counted
    ids = await add_trials(trials_db, 3, **MIDWAY)

    result = await send_trial_journey_emails_batch(ids, pool=pool, options=BatchOptions(settings.send_email), now=NOW)

    assert result == {"status": "ok", "user_trials": 3, "sent": 9}
    # the reservation writes the outbox rows and wakes the relay; the batch publishes nothing itself
    assert await statements.settled() == [LOAD_TRIALS_SQL, LOAD_SENT_KEYS_SQL, RESERVE_BLOCK_SQL]
    expected = {(user, key) for user in (1, 2, 3) for key in ("trial_welcome", "trial_tips", "trial_midpoint")}
    assert await reserved(pool) == expected
    await relayed(trials_db)
    assert await enqueued(redis, stream) == dict.fromkeys(expected, 1)
    sent_at = await pool.fetchval("SELECT sent_at FROM emails_emaildispatch WHERE user_id = 1 LIMIT 1")
    entries = await stream_entries(redis, stream)
    entry = next(entry for entry in entries if (entry["user_id"], entry["email_key"]) == ("1", "trial_midpoint"))
    assert entry == {
        "user_id": "1",
        "email_key": "trial_midpoint",
        "source": "trial_journey",
        "reserved_at": sent_at.isoformat(),
    }


async def test_200_trials_owing_6_emails_take_6_reservation_statements(
    trials_db: asyncpg.Pool, counted: tuple[asyncpg.Pool, Statements], redis: Redis, stream: str, settings: Settings
) -> None:
    pool, statements = counted
    ids = await add_trials(trials_db, 200, **ALL_DUE)

    result = await send_trial_journey_emails_batch(ids, pool=pool, options=BatchOptions(settings.send_email), now=NOW)

    assert result == {"status": "ok", "user_trials": 200, "sent": 1200}
    assert await statements.settled() == [LOAD_TRIALS_SQL, LOAD_SENT_KEYS_SQL] + [RESERVE_BLOCK_SQL] * 6
    assert len(await reserved(pool)) == 1200
    assert await pool.fetchval("SELECT count(*) FROM trial_email_outbox") == 1200
    await relayed(trials_db)
    counts = await enqueued(redis, stream)
    assert len(counts) == 1200 and set(counts.values()) == {1}


async def test_a_second_run_of_the_same_batch_enqueues_nothing(
    trials_db: asyncpg.Pool, counted: tuple[asyncpg.Pool, Statements], redis: Redis, stream: str, settings: Settings
) -> None:
    pool, statements = counted
    ids = await add_trials(trials_db, 5, **ALL_DUE)
    first = await send_trial_journey_emails_batch(ids, pool=pool, options=BatchOptions(settings.send_email), now=NOW)
    statements.sql.clear()

    second = await send_trial_journey_emails_batch(ids, pool=pool, options=BatchOptions(settings.send_email), now=NOW)

    assert first["sent"] == 30
    assert second == {"status": "ok", "user_trials": 5, "sent": 0}
    assert await statements.settled() == [LOAD_TRIALS_SQL, LOAD_SENT_KEYS_SQL]  # nothing left to reserve
    await relayed(trials_db)
    assert len(await stream_entries(redis, stream)) == 30


async def test_a_reservation_already_written_by_another_worker_is_not_enqueued(
    trials_db: asyncpg.Pool, redis: Redis, stream: str, settings: Settings
) -> None:
    ids = await add_trials(trials_db, 2, **MIDWAY)
    other_worker_at = NOW - timedelta(minutes=5)
    await trials_db.execute(
        "INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at) "
        "VALUES (1, 'trial_journey', 'trial_tips', $1, $1)",
        other_worker_at,
    )

    result = await send_trial_journey_emails_batch(
        ids, pool=trials_db, options=BatchOptions(settings.send_email), now=NOW
    )

    assert result["sent"] == 5
    await relayed(trials_db)
    counts = await enqueued(redis, stream)
    assert (1, "trial_tips") not in counts and len(counts) == 5


async def test_a_pair_reserved_between_load_and_reservation_loses_the_conflict_and_is_not_enqueued(
    trials_db: asyncpg.Pool, redis: Redis, stream: str
) -> None:
    # the race ON CONFLICT DO NOTHING closes: the pair looked free when the batch loaded its keys
    await add_trials(trials_db, 2, **MIDWAY)
    other_worker_at = NOW - timedelta(minutes=5)
    await trials_db.execute(
        "INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at) "
        "VALUES (2, 'trial_journey', 'trial_welcome', $1, $1)",
        other_worker_at,
    )
    pairs = [(1, "trial_welcome"), (2, "trial_tips"), (2, "trial_welcome")]

    sent = await reserve(trials_db, pairs)

    assert sent == 2
    await relayed(trials_db)
    assert await enqueued(redis, stream) == {(1, "trial_welcome"): 1, (2, "trial_tips"): 1}
    kept = await trials_db.fetchval(
        "SELECT sent_at FROM emails_emaildispatch WHERE user_id = 2 AND email_key = 'trial_welcome'"
    )
    assert kept == other_worker_at  # DO NOTHING: the winner's row is left as it wrote it


async def test_three_concurrent_runners_enqueue_each_pair_exactly_once(
    trials_db: asyncpg.Pool, migrated: str, redis: Redis, stream: str, settings: Settings
) -> None:
    ids = await add_trials(trials_db, 60, **ALL_DUE)
    small_blocks = with_blocks(settings, 16)  # many blocks each, so the runners interleave
    pools = [await asyncpg.create_pool(migrated, min_size=1, max_size=1) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(send_trial_journey_emails_batch(ids, pool=pool, options=small_blocks, now=NOW) for pool in pools)
        )
    finally:
        await asyncio.gather(*(pool.close() for pool in pools))

    assert sum(result["sent"] for result in results) == 360
    await relayed(trials_db)
    counts = await enqueued(redis, stream)
    assert len(counts) == 360 and set(counts.values()) == {1}
    assert len(await reserved(trials_db)) == 360


async def test_send_email_false_reserves_and_enqueues_nothing(
    trials_db: asyncpg.Pool, counted: tuple[asyncpg.Pool, Statements], redis: Redis, stream: str, settings: Settings
) -> None:
    pool, statements = counted
    ids = await add_trials(trials_db, 3, **ALL_DUE)
    disabled = settings.model_copy(update={"send_email": False})

    result = await send_trial_journey_emails_batch(ids, pool=pool, options=BatchOptions(disabled.send_email), now=NOW)

    assert result == {"status": "disabled", "user_trials": 0, "sent": 0}
    assert await statements.settled() == []
    assert await reserved(pool) == set()
    assert await pool.fetchval("SELECT count(*) FROM trial_email_outbox") == 0
    assert await redis.exists(stream) == 0


@pytest.mark.regression
@pytest.mark.slow  # a `trial-emails run-once` process
async def test_run_once_publishes_nothing_itself_every_winner_waits_unleased_for_the_woken_relay(
    trials_db: asyncpg.Pool, redis: Redis, settings: Settings
) -> None:
    # issue 29: emails had two publishers (the batch, then the relay once the batch's lease on its
    # winners ran out); now the reservation statement writes the outbox rows and NOTIFYs the relay
    now = datetime.now(UTC)  # the command's clock
    await add_trials(
        trials_db, 250, started_at=now - timedelta(days=10), ends_at=now + timedelta(days=10)
    )  # 750: 4 blocks
    woken: list[str] = []
    listener = await asyncpg.connect(settings.database_url)
    await listener.add_listener(NOTIFY_CHANNEL, lambda *args: woken.append(str(args[3])))
    try:
        env = {**os.environ, "DATABASE_URL": settings.database_url, "REDIS_URL": settings.redis_url}
        process = await start_service_command(
            "trial-emails", "run-once", env={**env, "EMAIL_PUBLISHER": "redis-stream"}
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
        assert process.returncode == 0, stderr.decode()[-2000:]

        async def four_wake_ups() -> bool:
            return len(woken) >= 4

        await wait_for(four_wake_ups)
    finally:
        await listener.close()

    assert json.loads(stdout.decode().splitlines()[-1])["sent"] == 750
    assert woken == ["email"] * 4  # one per block's statement, delivered at its commit
    assert await redis.exists(settings.email_queue_stream) == 0
    owed = await trials_db.fetch(
        "SELECT user_id, email_key, claimed_until, publish_attempts FROM trial_email_outbox WHERE published_at IS NULL"
    )
    assert {(row["user_id"], row["email_key"]) for row in owed} == await reserved(trials_db)
    # nothing holds them back from the relay: no lease, no attempt counted
    assert {(row["claimed_until"], row["publish_attempts"]) for row in owed} == {(None, 0)}


async def test_a_failed_reservation_statement_reserves_nothing_and_a_rerun_does_the_block(
    trials_db: asyncpg.Pool, redis: Redis, stream: str
) -> None:
    await add_trials(trials_db, 2, **ALL_DUE)
    # user 999 does not exist: the deferred foreign key fails the statement as it commits
    bad_block = [(1, "trial_welcome"), (2, "trial_welcome"), (999, "trial_welcome")]

    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await reserve(trials_db, bad_block)

    assert await reserved(trials_db) == set()
    assert await trials_db.fetchval("SELECT count(*) FROM trial_email_outbox") == 0

    sent = await reserve(trials_db, bad_block[:2])
    assert sent == 2
    assert await reserved(trials_db) == set(bad_block[:2])
    await relayed(trials_db)
    assert await enqueued(redis, stream) == dict.fromkeys(bad_block[:2], 1)


async def test_a_batch_cancelled_mid_reservation_leaves_no_reservation_without_its_message(
    trials_db: asyncpg.Pool, redis: Redis, stream: str, settings: Settings
) -> None:
    ids = await add_trials(trials_db, 1, started_at=NOW - timedelta(hours=1), ends_at=NOW + timedelta(days=7))
    async with trials_db.acquire() as blocker:
        # an uncommitted insert of the same pair makes the batch's INSERT wait on the unique index
        transaction = blocker.transaction()
        await transaction.start()
        await blocker.execute(
            "INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at) "
            "VALUES (1, 'trial_journey', 'trial_welcome', now(), now())"
        )
        batch = asyncio.create_task(
            send_trial_journey_emails_batch(ids, pool=trials_db, options=BatchOptions(settings.send_email), now=NOW)
        )
        await wait_for(
            lambda: trials_db.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%INSERT INTO emails_emaildispatch%' AND pid <> pg_backend_pid()"
            )
        )
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        await transaction.rollback()  # the statement, cancelled or not, now does all or nothing

    # whatever the cancelled statement did it did whole, its outbox row included; a rerun does the rest
    await send_trial_journey_emails_batch(ids, pool=trials_db, options=BatchOptions(settings.send_email), now=NOW)
    await relayed(trials_db)
    assert await reserved(trials_db) == {(1, "trial_welcome")}
    assert await trials_db.fetchval("SELECT count(*) FROM trial_email_outbox") == 1
    assert await enqueued(redis, stream) == {(1, "trial_welcome"): 1}
