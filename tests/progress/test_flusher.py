"""The flush path against real Redis and Postgres: rows, events and keys, never mocks."""

import asyncio
import logging
import time

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from service.config import Settings
from service.progress.content import CONTENT_KINDS
from service.progress.flush import batch as batch_module
from service.progress.flush.flusher import Flusher
from service.progress.flush.leases import Leases
from service.progress.ingest.buffer import StoredPosition, decode_value
from service.progress.keys import STANDALONE
from tests.helpers import Servers, auth, events, flushed_since, lesson_rows, running_app, seed, wait_for, write


@pytest.fixture
async def flusher(settings: Settings, redis: Redis, db: asyncpg.Pool) -> Flusher:
    return Flusher(settings.flush, redis, db)


async def test_heartbeats_through_http_land_in_every_table(
    settings: Settings, redis: Redis, db: asyncpg.Pool, client: httpx.AsyncClient, token: str, flusher: Flusher
) -> None:
    await seed(db, users=7)
    for kind in CONTENT_KINDS:
        response = await client.post(kind.path, json={kind.id_column: 2, "position": 33.5}, headers=auth(token))
        assert response.status_code == 201
    result = await flusher.flush_cycle()
    assert (result.written, result.dropped, result.expired) == (4, 0, 0)
    for kind in CONTENT_KINDS:
        table, column = kind.progress_table, kind.id_column
        rows = await db.fetch(f"SELECT user_id, {column} AS content_id, position, completed_at FROM {table}")
        assert [tuple(r) for r in rows] == [(7, 2, 33.5, None)]
    assert await redis.keys("progress:pending_flush:*") == []
    assert await redis.keys("progress:in_flight:*") == []


async def test_the_pods_own_loop_persists_within_two_intervals(
    settings: Settings, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    async with running_app(
        settings.model_copy(update={"progress_flusher_enabled": True, "progress_flush_interval_seconds": 0.5})
    ) as (_, client):
        response = await client.post("/audios/progress", json={"audio_id": 3, "position": 12}, headers=auth(token))
        assert response.status_code == 201
        deadline = time.monotonic() + 2 * 0.5 * 1.1 + 0.5
        while time.monotonic() < deadline and not await db.fetchval("SELECT count(*) FROM audios_audioprogress"):
            await asyncio.sleep(0.05)
        assert await db.fetchval("SELECT position FROM audios_audioprogress WHERE user_id = 7") == 12


async def test_shutdown_flushes_what_was_acknowledged(
    settings: Settings, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    started = time.time()
    async with running_app(
        settings.model_copy(update={"progress_flusher_enabled": True, "progress_flush_interval_seconds": 3600})
    ) as (_, client):
        await wait_for(flushed_since(started))  # the loop's first cycle ran at start: only the last one is left
        response = await client.post("/lives/progress", json={"live_id": 1, "position": 99}, headers=auth(token))
        assert response.status_code == 201
    assert await db.fetchval("SELECT position FROM lives_liveprogress WHERE user_id = 7 AND live_id = 1") == 99
    assert await redis.scard("progress:pending_flush:live") == 0


async def test_last_heartbeat_wins(redis: Redis, db: asyncpg.Pool, flusher: Flusher) -> None:
    await seed(db)
    for position in (10, 20, 30, 25):
        await write(redis, "lesson", 1, 2, position)
    await flusher.flush_cycle()
    rows = await lesson_rows(db)
    assert rows[(1, 2)]["position"] == 25


async def test_an_older_heartbeat_arriving_late_does_not_overwrite(
    redis: Redis, db: asyncpg.Pool, flusher: Flusher
) -> None:
    await seed(db)
    newer_ms = await write(redis, "lesson", 1, 2, 300)
    await flusher.flush_cycle()
    # the key expired and a delayed, older heartbeat (another pod, a retry) is the only value left
    await redis.delete("progress:latest_position:lesson:1:2")
    await write(redis, "lesson", 1, 2, 100, received_ms=newer_ms - 5000)
    result = await flusher.flush_cycle()
    row = (await lesson_rows(db))[(1, 2)]
    assert row["position"] == 300
    assert row["updated_at"].timestamp() * 1000 == pytest.approx(newer_ms, abs=1)
    assert result.written == 0


async def test_completion_at_the_margin_and_not_before(redis: Redis, db: asyncpg.Pool, flusher: Flusher) -> None:
    await seed(db, users=3, duration_s=600)  # margin 10 s: complete from 590 s
    await write(redis, "lesson", 1, 1, 589.9)
    await write(redis, "lesson", 1, 2, 590.0)
    await write(redis, "lesson", 1, 3, 600.0)
    result = await flusher.flush_cycle()
    rows = await lesson_rows(db)
    assert rows[(1, 1)]["completed_at"] is None
    assert rows[(1, 2)]["completed_at"] is not None
    assert rows[(1, 3)]["completed_at"] is not None
    assert result.completions == 2
    assert sorted(await events(db)) == [("lesson", 1, 2), ("lesson", 1, 3)]


async def test_one_event_per_key_after_rewinds_and_repeated_near_end(
    redis: Redis, db: asyncpg.Pool, flusher: Flusher
) -> None:
    await seed(db, users=1, duration_s=600)
    await write(redis, "audio", 1, 1, 595)
    await flusher.flush_cycle()
    first_completed_at = await db.fetchval("SELECT completed_at FROM audios_audioprogress")
    for position in (0, 598, 120, 600, 599):  # rewind, near end again, rewind, end, near end
        await write(redis, "audio", 1, 1, position)
        await flusher.flush_cycle()
    row = await db.fetchrow("SELECT position, completed_at FROM audios_audioprogress")
    assert row is not None
    assert row["position"] == 599
    assert row["completed_at"] == first_completed_at  # never cleared, never moved
    assert await events(db) == [("audio", 1, 1)]


async def test_a_late_heartbeat_at_the_end_still_completes(redis: Redis, db: asyncpg.Pool, flusher: Flusher) -> None:
    await seed(db, users=1, duration_s=600)
    newer_ms = await write(redis, "lesson", 1, 1, 10)  # the user rewound...
    await flusher.flush_cycle()
    await redis.delete("progress:latest_position:lesson:1:1")
    await write(redis, "lesson", 1, 1, 600, received_ms=newer_ms - 1000)  # ...after reaching the end
    await flusher.flush_cycle()
    row = (await lesson_rows(db))[(1, 1)]
    assert row["position"] == 10
    assert row["completed_at"] is not None
    assert await events(db) == [("lesson", 1, 1)]


async def test_one_unknown_content_does_not_block_its_batch(
    redis: Redis, db: asyncpg.Pool, flusher: Flusher, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(db, users=500, contents=1)
    for user_id in range(1, 501):
        await write(redis, "lesson", 1, user_id, 42)
    await write(redis, "lesson", 999_999, 1, 42)  # no such lesson
    with caplog.at_level(logging.WARNING, logger="service.progress.flush.flusher"):
        result = await flusher.flush_cycle()
    assert (result.written, result.dropped) == (500, 1)
    assert len(await lesson_rows(db)) == 500
    assert any(getattr(r, "key", None) == "999999:1" for r in caplog.records)
    assert await redis.scard("progress:pending_flush:lesson") == 0
    assert await redis.zcard("progress:in_flight:lesson") == 0


async def test_unknown_user_is_dropped_and_counted(redis: Redis, db: asyncpg.Pool, flusher: Flusher) -> None:
    await seed(db, users=1)
    await write(redis, "live", 1, 1, 5)
    await write(redis, "live", 1, 404, 5)
    result = await flusher.flush_cycle()
    assert (result.written, result.dropped) == (1, 1)
    assert await db.fetchval("SELECT count(*) FROM lives_liveprogress") == 1


async def test_values_the_flush_drops_are_deleted_unless_written_since_the_claim(
    settings: Settings,
    redis: Redis,
    db: asyncpg.Pool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Made-up users behind a gateway get 201; their values go with the batch that drops them (not an hour
    later), except one written again between the claim and the settle; one log line per batch, not per key."""
    await seed(db, users=1, contents=1)
    async with running_app(settings.model_copy(update={"auth_mode": "gateway"})) as (_, client):
        for user_id in [1, *range(1000, 1200)]:
            response = await client.post(
                "/lives/progress", json={"live_id": 1, "position": 5}, headers={"X-User-Id": str(user_id)}
            )
            assert response.status_code == 201
    real_persist = batch_module.persist_batch
    # set once both batches are claimed; the newer write waits for the next cycle (the cycle's quota is taken)
    stop = asyncio.Event()

    async def all_claimed() -> bool:  # (or the other batch's persist has seen it so, and written again)
        return stop.is_set() or await redis.scard("progress:pending_flush:live") == 0

    async def persist_after_a_newer_write(*args: object, **kwargs: object) -> object:
        if not stop.is_set():  # user 1000 sends again while its claimed value is being persisted
            await wait_for(all_claimed)  # the other batch is claimed too
            await write(redis, "live", 1, 1000, 9)
            stop.set()
        return await real_persist(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(batch_module, "persist_batch", persist_after_a_newer_write)
    flusher = Flusher(settings.model_copy(update={"progress_flush_batch_size": 150}).flush, redis, db)
    with caplog.at_level(logging.WARNING):
        result = await flusher.flush_cycle()
    assert (result.written, result.dropped, result.batches) == (1, 200, 2)
    assert sorted(await redis.keys("progress:latest_position:*")) == [
        "progress:latest_position:live:1:1",
        "progress:latest_position:live:1:1000",
    ]
    assert decode_value(await redis.get("progress:latest_position:live:1:1000")).position == 9
    assert await redis.smembers("progress:pending_flush:live") == {"1:1000"}
    lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 2 and sum(getattr(r, "count", 0) for r in lines) == 200  # one per batch
    assert all(len(getattr(r, "key", "").split()) <= 10 for r in lines)  # a sample of the keys
    monkeypatch.undo()
    assert (await flusher.flush_cycle()).dropped == 1
    assert await redis.keys("progress:latest_position:*") == ["progress:latest_position:live:1:1"]


async def test_an_expired_value_is_counted_and_logged(
    redis: Redis, db: asyncpg.Pool, flusher: Flusher, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(db)
    await write(redis, "meditation", 1, 1, 5)
    await redis.sadd("progress:pending_flush:meditation", "2:1")  # its value's TTL already passed
    with caplog.at_level(logging.ERROR, logger="service.progress.flush.batch"):
        result = await flusher.flush_cycle()
    assert (result.written, result.expired) == (1, 1)
    assert any(getattr(r, "key", None) == "2:1" for r in caplog.records)
    assert await redis.scard("progress:pending_flush:meditation") == 0


async def test_a_late_ack_does_not_remove_another_flushers_lease(redis: Redis) -> None:
    leases = Leases(redis)
    await write(redis, "lesson", 1, 1, 5)
    (shard,) = STANDALONE.shards_of("lesson")
    stalled = await leases.claim_batch(shard, count=10, lease_ms=1000)
    assert await leases.requeue_expired(shard) == 0  # its lease holds, by Redis's clock
    assert await leases.requeue_expired(shard, ahead_ms=2000) == 1  # two seconds on: expired
    fresh = await leases.claim_batch(shard, count=10, lease_ms=60_000)
    assert [member for member, _ in fresh.entries] == ["1:1"]
    assert await leases.ack(stalled) == 0  # the stalled flusher finally acks: nothing of fresh's is touched
    assert await redis.zrange("progress:in_flight:lesson", 0, -1) == ["1:1"]
    assert await leases.ack(fresh) == 1
    assert await redis.zcard("progress:in_flight:lesson") == 0


async def test_database_outage_requeues_and_loses_nothing(
    servers: Servers, settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    assert servers.postgres is not None, "this test stops and starts the embedded Postgres"
    await seed(db, users=50)
    expected = {}
    for user_id in range(1, 51):
        expected[(1, user_id)] = float(user_id)
        await write(redis, "lesson", 1, user_id, user_id)
    pool = await asyncpg.create_pool(settings.database_url, min_size=0, max_size=2)
    flusher = Flusher(settings.flush, redis, pool)
    servers.postgres.stop()
    try:
        down = await flusher.flush_cycle()
        assert down.failed_batches >= 1 and down.written == 0
        assert await redis.scard("progress:pending_flush:lesson") == 50  # all back, none in flight
        assert await redis.zcard("progress:in_flight:lesson") == 0
    finally:
        servers.postgres.start()
    back = await flusher.flush_cycle()
    await pool.close()
    assert back.written == 50
    assert {key: row["position"] for key, row in (await lesson_rows(db)).items()} == expected


async def test_idle_connections_killed_between_cycles_lose_nothing(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=20)
    pool = await asyncpg.create_pool(settings.database_url, min_size=2, max_size=2)
    flusher = Flusher(settings.flush, redis, pool)
    await pool.fetchval("SELECT 1")
    # every pooled connection dies under the flusher (failover, server restart, idle kill)
    await db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    await db.fetchval("SELECT 1")
    for user_id in range(1, 21):
        await write(redis, "lesson", 1, user_id, 7)
    first = await flusher.flush_cycle()
    second = await flusher.flush_cycle()
    await pool.close()
    assert first.written + second.written == 20
    assert len(await lesson_rows(db)) == 20


async def test_a_database_error_on_one_type_does_not_block_the_others(
    redis: Redis, db: asyncpg.Pool, flusher: Flusher
) -> None:
    await seed(db, users=2)
    await write(redis, "lesson", 1, 1, 60)
    await write(redis, "audio", 1, 1, 60)
    await redis.sadd("progress:pending_flush:audio", "2:1")  # its value expired: settled, not retried
    # a schema the service does not expect (drift, a new constraint): every audio batch fails
    await db.execute("ALTER TABLE audios_audioprogress ADD CONSTRAINT test_cap CHECK (position < 50)")
    try:
        result = await flusher.flush_cycle()
        assert result.written == 1 and result.failed_batches >= 1
        assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 1
        assert await redis.smembers("progress:pending_flush:audio") == {"1:1"}  # kept, not lost
        assert result.expired == 1
    finally:
        await db.execute("ALTER TABLE audios_audioprogress DROP CONSTRAINT test_cap")
    retry = await flusher.flush_cycle()
    assert (retry.written, retry.expired) == (1, 0)  # the expired entry is not counted a second time
    assert await db.fetchval("SELECT position FROM audios_audioprogress") == 60


async def test_an_unreadable_value_is_dropped_and_logged_not_fatal(
    redis: Redis, db: asyncpg.Pool, flusher: Flusher, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(db)
    await write(redis, "live", 1, 1, 5)
    await redis.set("progress:latest_position:live:2:1", "garbage")
    await redis.set("progress:latest_position:live:3:1", "42.5")  # one field: written by someone else
    await redis.set("progress:latest_position:live:1:2", "1:2:3:4:5:6")
    await redis.sadd("progress:pending_flush:live", "2:1", "3:1", "1:2", "not-a-member")
    with caplog.at_level(logging.ERROR, logger="service.progress.flush.batch"):
        result = await flusher.flush_cycle()
    assert (result.written, result.dropped, result.expired) == (1, 3, 1)  # no value at all reads as expired
    assert {getattr(r, "key", None) for r in caplog.records} >= {"2:1", "3:1", "1:2", "not-a-member"}
    assert await redis.zcard("progress:in_flight:live") == 0
    assert await redis.scard("progress:pending_flush:live") == 0
    # the unreadable values go with their batch; the readable one stays for its TTL
    assert await redis.keys("progress:latest_position:live:*") == ["progress:latest_position:live:1:1"]


async def test_a_backend_terminated_during_the_upsert_requeues_its_batch(
    settings: Settings, redis: Redis, db: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    await seed(db, users=20)
    for user_id in range(1, 21):
        await write(redis, "lesson", 1, user_id, 7)
    flusher = Flusher(settings.model_copy(update={"progress_flush_concurrency": 1}).flush, redis, db)
    requeued_before = REGISTRY.get_sample_value("progress_flush_requeued_total") or 0
    async with db.acquire() as locker:
        lock = locker.transaction()
        await lock.start()
        # hold the table so the flusher's transaction is caught in flight, then kill its backend
        await locker.execute("LOCK TABLE engagements_lessonprogress IN EXCLUSIVE MODE")
        with caplog.at_level(logging.WARNING, logger="service.progress.flush.batch"):
            cycle = asyncio.create_task(flusher.flush_cycle())
            pid = None
            for _ in range(200):
                # asked on another connection: inside `lock`, pg_stat_activity is a frozen snapshot
                pid = await db.fetchval(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%WITH incoming%'"
                )
                if pid:
                    break
                await asyncio.sleep(0.02)
            assert pid, "the upsert never reached the lock"
            await db.fetchval("SELECT pg_terminate_backend($1)", pid)
            first = await cycle
        await lock.rollback()
    assert (first.written, first.failed_batches, first.requeued) == (0, 1, 20)
    assert REGISTRY.get_sample_value("progress_flush_requeued_total") == requeued_before + 20  # counted once
    assert any(getattr(r, "batch_size", None) == 20 for r in caplog.records)
    assert await redis.scard("progress:pending_flush:lesson") == 20  # handed back at once, not after the lease
    assert await redis.zcard("progress:in_flight:lesson") == 0
    assert (await flusher.flush_cycle()).written == 20
    assert len(await lesson_rows(db)) == 20


async def test_a_row_completed_before_this_service_gets_no_event(
    redis: Redis, db: asyncpg.Pool, flusher: Flusher
) -> None:
    await seed(db, users=1, duration_s=600)
    # completed by the monolith before the cutover: completed_at set, no event
    await db.execute(
        "INSERT INTO engagements_lessonprogress (user_id, lesson_id, position, completed_at, "
        "created_at, updated_at) VALUES (1, 1, 600, now() - interval '1 day', "
        "now() - interval '1 day', now() - interval '1 day')"
    )
    for position in (0, 599):  # a replay from the start, then the end again
        await write(redis, "lesson", 1, 1, position)
        await flusher.flush_cycle()
    assert (await lesson_rows(db))[(1, 1)]["position"] == 599
    assert await events(db) == []


async def test_reaching_the_end_then_restarting_within_one_interval_still_completes(
    redis: Redis, db: asyncpg.Pool, flusher: Flusher
) -> None:
    await seed(db, users=1, duration_s=600)
    for position in (300, 595, 0, 12):  # the end, then a restart, all before one flush
        await write(redis, "meditation", 1, 1, position)
    await flusher.flush_cycle()
    row = await db.fetchrow("SELECT position, completed_at FROM audios_meditationprogress")
    assert row is not None and row["position"] == 12 and row["completed_at"] is not None
    assert await events(db) == [("meditation", 1, 1)]


async def test_the_stored_value_keeps_the_peak_and_an_older_heartbeat_only_raises_it(redis: Redis) -> None:
    key = "progress:latest_position:audio:1:1"
    t = 1_796_034_957_972.63  # ms with 630 µs: stored as whole ms, then the microseconds last
    await write(redis, "audio", 1, 1, 100, received_ms=t)
    await write(redis, "audio", 1, 1, 40, received_ms=t + 1000)
    assert await redis.get(key) == "40:1796034958972:100:630"  # position moves back, the peak stays
    await write(redis, "audio", 1, 1, 250, received_ms=t + 500)  # late, older: not the position...
    assert await redis.get(key) == "40:1796034958972:250:630"  # ...but it did reach 250
    await write(redis, "audio", 1, 1, 10, received_ms=t)  # late and lower: nothing changes
    assert await redis.get(key) == "40:1796034958972:250:630"
    await write(redis, "audio", 1, 1, 30, received_ms=t + 999.999)  # 1 µs earlier than the stored: loses
    assert await redis.get(key) == "40:1796034958972:250:630"
    await write(redis, "audio", 1, 1, 30, received_ms=t + 1000.001)  # 1 µs later: wins
    assert await redis.get(key) == "30:1796034958972:250:631"


async def test_values_of_the_previous_formats_still_read_and_order(redis: Redis) -> None:
    """A rolling deploy: the previous release wrote "pos:ms:peak" (and before it "pos:ms"); both still
    decode, order against new writes by their whole ms, and the previous release's reader (int of the
    second field, float of the third) reads the new format too."""
    key = "progress:latest_position:audio:1:1"
    await redis.set(key, "50:1796034958972:90")
    await write(redis, "audio", 1, 1, 20, received_ms=1_796_034_958_971.9)  # older: only the peak could rise
    assert await redis.get(key) == "50:1796034958972:90"  # older and lower: untouched
    await write(redis, "audio", 1, 1, 60, received_ms=1_796_034_958_972.001)
    stored = await redis.get(key)
    assert stored == "60:1796034958972:90:1"
    fields = stored.split(":")
    assert (float(fields[0]), int(fields[1]), float(fields[2])) == (60.0, 1796034958972, 90.0)
    assert decode_value("5:1796034958972") == StoredPosition(5.0, 1796034958972, 5.0)
