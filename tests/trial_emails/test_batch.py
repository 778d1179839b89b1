"""send_trial_journey_emails_batch on real Postgres and Redis: statements, rows, stream entries, orphans."""

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from service.config import Settings
from service.outbox.outboxes import EMAILS
from service.trial_emails.batch import BatchOptions, reserve_and_enqueue, send_trial_journey_emails_batch
from service.trial_emails.journey import JOURNEY
from service.trial_emails.queue import QueuedEmail, RedisStreamQueue
from service.trial_emails.reservations import LOAD_SENT_KEYS_SQL, LOAD_TRIALS_SQL, RESERVE_BLOCK_SQL
from tests.helpers import Statements, Window, add_trials, enqueued, metric, reserved, stream_entries, wait_for

NOW = datetime(2025, 3, 10, 12, tzinfo=UTC)
# a 20-day trial at its midpoint owes welcome, tips and midpoint
MIDWAY = Window(started_at=NOW - timedelta(days=10), ends_at=NOW + timedelta(days=10))
# ended an hour ago, still in the day of grace: owes all six
ALL_DUE = Window(started_at=NOW - timedelta(days=10), ends_at=NOW - timedelta(hours=1))
ALL_KEYS = [step.email_key for step in JOURNEY]


def with_blocks(settings: Settings, block_size: int) -> Settings:
    return settings.model_copy(update={"reservation_block_size": block_size})


async def test_several_due_emails_per_trial_are_reserved_in_one_statement_and_all_enqueued(
    trials_db: asyncpg.Pool,
    counted: tuple[asyncpg.Pool, Statements],
    redis: Redis,
    queue: RedisStreamQueue,
    settings: Settings,
) -> None:
    pool, statements = counted
    ids = await add_trials(trials_db, 3, **MIDWAY)

    result = await send_trial_journey_emails_batch(
        ids, pool=pool, queue=queue, options=BatchOptions.from_settings(settings), now=NOW
    )

    assert result == {"status": "ok", "user_trials": 3, "sent": 9}
    # the reservation writes the outbox rows too; the mark records what the block published (one each)
    assert await statements.settled() == [LOAD_TRIALS_SQL, LOAD_SENT_KEYS_SQL, RESERVE_BLOCK_SQL, EMAILS.mark_sql]
    expected = {(user, key) for user in (1, 2, 3) for key in ("trial_welcome", "trial_tips", "trial_midpoint")}
    assert await reserved(pool) == expected
    assert await enqueued(redis, queue.stream) == dict.fromkeys(expected, 1)
    sent_at = await pool.fetchval("SELECT sent_at FROM emails_emaildispatch WHERE user_id = 1 LIMIT 1")
    entry = (await stream_entries(redis, queue.stream))[0]
    assert entry == {
        "user_id": "1",
        "email_key": "trial_midpoint",
        "source": "trial_journey",
        "reserved_at": sent_at.isoformat(),
    }


async def test_200_trials_owing_6_emails_take_6_reservation_statements(
    trials_db: asyncpg.Pool,
    counted: tuple[asyncpg.Pool, Statements],
    redis: Redis,
    queue: RedisStreamQueue,
    settings: Settings,
) -> None:
    pool, statements = counted
    ids = await add_trials(trials_db, 200, **ALL_DUE)

    result = await send_trial_journey_emails_batch(
        ids, pool=pool, queue=queue, options=BatchOptions.from_settings(settings), now=NOW
    )

    assert result == {"status": "ok", "user_trials": 200, "sent": 1200}
    # six reservation statements, each marking the previous block's published winners, and one closing mark
    expected = [LOAD_TRIALS_SQL, LOAD_SENT_KEYS_SQL] + [RESERVE_BLOCK_SQL] * 6 + [EMAILS.mark_sql]
    assert await statements.settled() == expected
    assert len(await reserved(pool)) == 1200
    # every block's winners marked published (by the next block's statement, the last by the closing mark):
    # nothing is left for the relay to send again
    assert await pool.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL") == 0
    assert await pool.fetchval("SELECT count(*) FROM trial_email_outbox") == 1200
    counts = await enqueued(redis, queue.stream)
    assert len(counts) == 1200 and set(counts.values()) == {1}


async def test_a_second_run_of_the_same_batch_enqueues_nothing(
    trials_db: asyncpg.Pool,
    counted: tuple[asyncpg.Pool, Statements],
    redis: Redis,
    queue: RedisStreamQueue,
    settings: Settings,
) -> None:
    pool, statements = counted
    ids = await add_trials(trials_db, 5, **ALL_DUE)
    first = await send_trial_journey_emails_batch(
        ids, pool=pool, queue=queue, options=BatchOptions.from_settings(settings), now=NOW
    )
    statements.sql.clear()

    second = await send_trial_journey_emails_batch(
        ids, pool=pool, queue=queue, options=BatchOptions.from_settings(settings), now=NOW
    )

    assert first["sent"] == 30
    assert second == {"status": "ok", "user_trials": 5, "sent": 0}
    assert await statements.settled() == [LOAD_TRIALS_SQL, LOAD_SENT_KEYS_SQL]  # nothing left to reserve
    assert len(await stream_entries(redis, queue.stream)) == 30


async def test_a_reservation_already_written_by_another_worker_is_not_enqueued(
    trials_db: asyncpg.Pool, redis: Redis, queue: RedisStreamQueue, settings: Settings
) -> None:
    ids = await add_trials(trials_db, 2, **MIDWAY)
    other_worker_at = NOW - timedelta(minutes=5)
    await trials_db.execute(
        "INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at) "
        "VALUES (1, 'trial_journey', 'trial_tips', $1, $1)",
        other_worker_at,
    )

    result = await send_trial_journey_emails_batch(
        ids, pool=trials_db, queue=queue, options=BatchOptions.from_settings(settings), now=NOW
    )

    assert result["sent"] == 5
    counts = await enqueued(redis, queue.stream)
    assert (1, "trial_tips") not in counts and len(counts) == 5


async def test_a_pair_reserved_between_load_and_reservation_loses_the_conflict_and_is_not_enqueued(
    trials_db: asyncpg.Pool, redis: Redis, queue: RedisStreamQueue
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

    sent = await reserve_and_enqueue(pairs, pool=trials_db, queue=queue, block_size=200)

    assert sent == 2
    assert await enqueued(redis, queue.stream) == {(1, "trial_welcome"): 1, (2, "trial_tips"): 1}
    kept = await trials_db.fetchval(
        "SELECT sent_at FROM emails_emaildispatch WHERE user_id = 2 AND email_key = 'trial_welcome'"
    )
    assert kept == other_worker_at  # DO NOTHING: the winner's row is left as it wrote it


async def test_three_concurrent_runners_enqueue_each_pair_exactly_once(
    trials_db: asyncpg.Pool, migrated: str, redis: Redis, queue: RedisStreamQueue, settings: Settings
) -> None:
    ids = await add_trials(trials_db, 60, **ALL_DUE)
    small_blocks = with_blocks(settings, 16)  # many blocks each, so the runners interleave
    pools = [await asyncpg.create_pool(migrated, min_size=1, max_size=1) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(
                send_trial_journey_emails_batch(
                    ids, pool=pool, queue=queue, options=BatchOptions.from_settings(small_blocks), now=NOW
                )
                for pool in pools
            )
        )
    finally:
        await asyncio.gather(*(pool.close() for pool in pools))

    assert sum(result["sent"] for result in results) == 360
    counts = await enqueued(redis, queue.stream)
    assert len(counts) == 360 and set(counts.values()) == {1}
    assert len(await reserved(trials_db)) == 360


async def test_send_email_false_reserves_and_enqueues_nothing(
    trials_db: asyncpg.Pool,
    counted: tuple[asyncpg.Pool, Statements],
    redis: Redis,
    queue: RedisStreamQueue,
    settings: Settings,
) -> None:
    pool, statements = counted
    ids = await add_trials(trials_db, 3, **ALL_DUE)
    disabled = settings.model_copy(update={"send_email": False})

    result = await send_trial_journey_emails_batch(
        ids, pool=pool, queue=queue, options=BatchOptions.from_settings(disabled), now=NOW
    )

    assert result == {"status": "disabled", "user_trials": 0, "sent": 0}
    assert await statements.settled() == []
    assert await reserved(pool) == set()
    assert await redis.exists(queue.stream) == 0


class BrokerDownAfter:
    """A broker that accepts `limit` emails, then fails as a lost connection would."""

    def __init__(self, inner: RedisStreamQueue, limit: int) -> None:
        self.inner = inner
        self.limit = limit

    async def publish(self, email: QueuedEmail) -> None:
        if self.limit == 0:
            raise RedisConnectionError(f"broker down, {email.user_id}:{email.email_key} not published")
        self.limit -= 1
        await self.inner.publish(email)


async def test_a_publish_failure_mid_block_leaves_the_rest_to_the_relay_and_stops_at_that_block(
    trials_db: asyncpg.Pool, redis: Redis, queue: RedisStreamQueue, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    ids = await add_trials(trials_db, 2, **ALL_DUE)
    orphans_before = metric("progress_trial_email_orphans_total")
    broker = BrokerDownAfter(queue, limit=3)

    with caplog.at_level(logging.WARNING), pytest.raises(RedisConnectionError):
        await send_trial_journey_emails_batch(
            ids, pool=trials_db, queue=broker, options=BatchOptions.from_settings(with_blocks(settings, 5)), now=NOW
        )

    # first block: 5 reserved, 3 published, 2 orphans; the second block was never reserved
    first_block = sorted((user, key) for user in (1, 2) for key in ALL_KEYS)[:5]
    assert await reserved(trials_db) == set(first_block)
    assert list(await enqueued(redis, queue.stream)) == first_block[:3]
    orphan_logs = [record for record in caplog.records if getattr(record, "pairs", None)]
    assert [record.pairs for record in orphan_logs] == [[f"{u}:{k}" for u, k in first_block[3:]]]  # type: ignore[attr-defined]
    assert metric("progress_trial_email_orphans_total") == orphans_before + 2
    # the three published are marked; the two left wait in the outbox for the relay (tests/outbox)
    outbox = await trials_db.fetch("SELECT user_id, email_key, published_at FROM trial_email_outbox")
    assert {(row["user_id"], row["email_key"]) for row in outbox if row["published_at"] is None} == set(first_block[3:])
    assert len(outbox) == 5

    # a rerun sends the rest and not the two: their rows exist, and their messages are the relay's
    rerun = await send_trial_journey_emails_batch(
        ids, pool=trials_db, queue=queue, options=BatchOptions.from_settings(settings), now=NOW
    )
    assert rerun["sent"] == 7
    counts = await enqueued(redis, queue.stream)
    assert len(counts) == 10 and not set(first_block[3:]) & set(counts)


async def test_a_failed_reservation_statement_reserves_nothing_and_a_rerun_does_the_block(
    trials_db: asyncpg.Pool, redis: Redis, queue: RedisStreamQueue
) -> None:
    await add_trials(trials_db, 2, **ALL_DUE)
    orphans_before = metric("progress_trial_email_orphans_total")
    # user 999 does not exist: the deferred foreign key fails the statement as it commits
    bad_block = [(1, "trial_welcome"), (2, "trial_welcome"), (999, "trial_welcome")]

    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await reserve_and_enqueue(bad_block, pool=trials_db, queue=queue, block_size=200)

    assert await reserved(trials_db) == set()
    assert await redis.exists(queue.stream) == 0
    assert metric("progress_trial_email_orphans_total") == orphans_before

    sent = await reserve_and_enqueue(bad_block[:2], pool=trials_db, queue=queue, block_size=200)
    assert sent == 2
    assert await reserved(trials_db) == set(bad_block[:2])
    assert await enqueued(redis, queue.stream) == dict.fromkeys(bad_block[:2], 1)


async def test_a_batch_cancelled_mid_reservation_reports_what_the_statement_reserved(
    trials_db: asyncpg.Pool, redis: Redis, queue: RedisStreamQueue, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    ids = await add_trials(trials_db, 1, started_at=NOW - timedelta(hours=1), ends_at=NOW + timedelta(days=7))
    orphans_before = metric("progress_trial_email_orphans_total")
    async with trials_db.acquire() as blocker:
        # an uncommitted insert of the same pair makes the batch's INSERT wait on the unique index
        transaction = blocker.transaction()
        await transaction.start()
        await blocker.execute(
            "INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at) "
            "VALUES (1, 'trial_journey', 'trial_welcome', now(), now())"
        )
        batch = asyncio.create_task(
            send_trial_journey_emails_batch(
                ids, pool=trials_db, queue=queue, options=BatchOptions.from_settings(settings), now=NOW
            )
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
        with caplog.at_level(logging.WARNING):
            await transaction.rollback()  # the batch's statement now wins the pair, with nobody to publish it
            await wait_for(lambda: orphan_count_above(orphans_before))

    assert await reserved(trials_db) == {(1, "trial_welcome")}
    assert await redis.exists(queue.stream) == 0
    assert [getattr(record, "pairs", None) for record in caplog.records] == [["1:trial_welcome"]]


async def orphan_count_above(before: float) -> bool:
    return metric("progress_trial_email_orphans_total") > before
