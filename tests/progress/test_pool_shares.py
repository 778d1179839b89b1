"""The pool's shares (issue 23, finding 5): every wait for a connection has a deadline, syncs are bounded per
process, and syncs stalled on a locked table leave the reads, the flush and degraded mode their connections."""

import asyncio
import time

import asyncpg
import pytest
from redis.asyncio import Redis

from service.app import create_app
from service.auth import make_token
from service.config import READ_LANES, ConfigError, Settings
from service.postgres import create_db_pool
from service.progress.content import CONTENT_KINDS, KIND_BY_NAME
from service.progress.flush.flusher import Flusher
from service.progress.flush.store import Heartbeat
from tests.helpers import ago, auth, running_app, seed, sync_item, table_locked, wait_for, waiting_on_lock

SYNC_SHARE = 2  # SYNC_CONNECTIONS
LIVE_SYNCS = 60


def under_a_migration(settings: Settings, **update: object) -> Settings:
    """The app's statements wait on a lock as long as a migration holds it (not the 2 s of the defaults):
    whatever holds a connection behind the lock holds it for the whole test."""
    return settings.model_copy(
        update={"database_lock_timeout_seconds": 60, "database_statement_timeout_seconds": 120, **update}
    )


def live_sync(content_id: int) -> dict[str, object]:
    return {"items": [sync_item(content_id, 5.0, ago(60), "live")]}


@pytest.mark.regression
async def test_60_live_syncs_behind_a_locked_table_leave_the_reads_the_flush_and_degraded_mode_their_connections(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    """The finding's reproduction: a migration holds lives_live; one user sends 60 one-item live syncs at
    once. Another user's lesson read answers at once, a lesson flush and a degraded-mode write get their
    connections, the syncs past their share get a 503 to retry and write nothing."""
    await seed(db, users=3, contents=LIVE_SYNCS)
    siege = under_a_migration(settings)
    loop = asyncio.get_running_loop()
    async with running_app(siege) as (app, client):
        reader = auth(make_token(siege, 2))
        heartbeat = await client.post(
            "/engagements/progress/lesson", headers=reader, json={"lesson_id": 1, "position": 42}
        )
        assert heartbeat.status_code == 201
        pool = app.api.state.services.pool
        syncer = auth(make_token(siege, 1))
        async with table_locked(db, "lives_live"):
            syncs = [
                asyncio.create_task(client.post("/progress/sync", headers=syncer, json=live_sync(content_id)))
                for content_id in range(1, LIVE_SYNCS + 1)
            ]

            async def share_held() -> bool:
                return await waiting_on_lock(db, "lives_live") >= SYNC_SHARE

            await wait_for(share_held)
            started = loop.time()
            async with asyncio.timeout(2):  # a read waits at most 1 s: 11.8 s before the fix
                read = await client.get("/progress/lesson/1", headers=reader)
            read_s = loop.time() - started
            async with asyncio.timeout(5):
                flushed = await Flusher(siege.flush, redis, pool).flush_cycle()
            meditation = KIND_BY_NAME["meditation"]
            direct = app.api.state.services.sink._direct  # degraded mode's writer, on the app's pool
            async with asyncio.timeout(5):
                await direct.write(
                    meditation, Heartbeat(1, 3, 30.0, time.time_ns() / 1e6, peak=30.0), deadline=loop.time() + 3
                )
            assert await waiting_on_lock(db, "lives_live") == SYNC_SHARE  # the syncs hold their share, no more

            async def the_rest_refused() -> bool:
                return sum(sync.done() for sync in syncs) == LIVE_SYNCS - SYNC_SHARE

            await wait_for(the_rest_refused)
        answers = await asyncio.gather(*syncs)  # the lock gone, the two held come back

    assert (read.status_code, read.json()["position"]) == (200, 42.0) and read_s < 2
    assert (flushed.written, flushed.failed_batches) == (1, 0)
    assert (
        await db.fetchval("SELECT position FROM engagements_lessonprogress WHERE user_id = 2 AND lesson_id = 1") == 42
    )
    written = "SELECT position FROM audios_meditationprogress WHERE user_id = 3 AND meditation_id = 1"
    assert await db.fetchval(written) == 30.0
    applied = {i + 1 for i, answer in enumerate(answers) if answer.status_code == 200}
    refused = [answer for answer in answers if answer.status_code != 200]
    assert len(applied) == SYNC_SHARE and all(
        answer.json()["items"][0]["applied"] for answer in answers if answer.status_code == 200
    )
    assert {(answer.status_code, answer.headers.get("retry-after")) for answer in refused} == {(503, "1")}
    assert all("syncs waiting" in answer.json()["detail"] for answer in refused)
    # a refused sync wrote nothing: only the two applied are in the buffer
    assert await redis.smembers("progress:pending_flush:live") == {f"{content_id}:1" for content_id in applied}
    assert len(await redis.keys("progress:latest_position:live:*")) == SYNC_SHARE


@pytest.mark.regression
async def test_a_pool_connection_not_had_in_time_is_the_store_unavailable_never_a_hang(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    """Every connection of the app's pool held (a leak, a stall): each caller gives up at its deadline and
    takes its unavailable path (503 to retry, the flush's batch left pending), and nothing is lost."""
    await seed(db, users=3, contents=1)
    loop = asyncio.get_running_loop()
    # the flush's and the pool's own callers wait ACQUIRE_TIMEOUT_S: a pool of the test's with a shorter one
    async with (
        running_app(settings) as (app, client),
        await create_db_pool(settings.database, acquire_timeout_s=0.5) as own,
    ):
        token = auth(make_token(settings, 2))
        heartbeat = await client.post(
            "/engagements/progress/lesson", headers=token, json={"lesson_id": 1, "position": 42}
        )
        assert heartbeat.status_code == 201
        pool = app.api.state.services.pool
        flusher = Flusher(settings.flush, redis, own)
        held = [(p, await p.acquire()) for p in (pool, own) for _ in range(p.get_max_size())]
        waited: dict[str, float] = {}
        try:
            started = loop.time()
            async with asyncio.timeout(
                3
            ):  # without a deadline, each of these waits as long as the connections are held
                read = await client.get("/progress/lesson/1", headers=token)
            waited["read"] = loop.time() - started
            started = loop.time()
            async with asyncio.timeout(3):
                sync = await client.post("/progress/sync", headers=token, json={"items": [sync_item(1, 9.0, ago(30))]})
            waited["sync"] = loop.time() - started
            started = loop.time()
            async with asyncio.timeout(5):
                flushed = await flusher.flush_cycle()
            waited["flush"] = loop.time() - started
            started = loop.time()
            # the relay, the sweep and the catalog use pool.fetch() and the like: the pool's own deadline
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(3):
                    await own.fetchval("SELECT 1")
            waited["pool.fetchval"] = loop.time() - started
        finally:
            for owner, conn in held:
                await owner.release(conn)
        assert (read.status_code, read.headers.get("retry-after")) == (503, "1"), read.text
        assert (sync.status_code, sync.headers.get("retry-after")) == (503, "1"), sync.text
        assert "unavailable" in read.json()["detail"] and "unavailable" in sync.json()["detail"]
        assert (flushed.written, flushed.failed_batches > 0) == (0, True)
        # about one deadline each; the flush's drains wait one per content type, the types in turn
        bounds = {"read": 2, "sync": 2, "flush": len(CONTENT_KINDS) * 0.5 + 1, "pool.fetchval": 1.5}
        assert all(waited[name] < bounds[name] for name in bounds), waited
        # nothing lost: the sync wrote nothing, the heartbeat waited in the buffer and is written now
        assert await redis.keys("progress:latest_position:audio:*") == []
        assert await redis.smembers("progress:pending_flush:lesson") == {"1:2"}
        assert (await flusher.flush_cycle()).written == 1
    assert (
        await db.fetchval("SELECT position FROM engagements_lessonprogress WHERE user_id = 2 AND lesson_id = 1") == 42
    )


@pytest.mark.regression
async def test_past_the_sync_bound_a_sync_waits_a_second_then_gets_a_503_with_retry_after_and_writes_nothing(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    """Two syncs hold the process's sync share behind a locked table; a third, of another user and another
    type, is refused after its second of waiting, before anything is written."""
    await seed(db, users=3, contents=2)
    siege = under_a_migration(settings)
    loop = asyncio.get_running_loop()
    async with running_app(siege) as (_, client):
        syncer = auth(make_token(siege, 1))
        async with table_locked(db, "lives_live"):
            held = [
                asyncio.create_task(client.post("/progress/sync", headers=syncer, json=live_sync(content_id)))
                for content_id in (1, 2)
            ]

            async def share_held() -> bool:
                return await waiting_on_lock(db, "lives_live") == SYNC_SHARE

            await wait_for(share_held)
            started = loop.time()
            async with asyncio.timeout(3):
                refused = await client.post(
                    "/progress/sync",
                    headers=auth(make_token(siege, 2)),
                    json={"items": [sync_item(1, 9.0, ago(30), "lesson")]},
                )
            waited_s = loop.time() - started
            assert not any(sync.done() for sync in held)
        answers = await asyncio.gather(*held)

    assert (refused.status_code, refused.headers.get("retry-after")) == (503, "1"), refused.text
    assert "syncs waiting" in refused.json()["detail"] and 0.9 < waited_s < 2
    assert await redis.keys("progress:*:lesson*") == []  # neither a value nor a pending member
    assert [(answer.status_code, answer.json()["items"][0]["applied"]) for answer in answers] == [(200, True)] * 2


@pytest.mark.regression
def test_serve_refuses_a_pool_too_small_to_hold_every_part_at_once(settings: Settings) -> None:
    serving = settings.model_copy(update={"progress_flusher_enabled": True, "content_catalog_enabled": True})
    # the defaults: 4 drains + 4 degraded + 4 read lanes + 2 syncs + 4 lookups (one per content type) + 1 <= 20
    serving.check_can_serve()
    small = serving.model_copy(update={"database_pool_max_size": 18})
    names = "PROGRESS_FLUSH_CONCURRENCY.*degraded mode.*the reads.*the syncs.*catalog"
    with pytest.raises(ConfigError, match=f"DATABASE_POOL_MAX_SIZE=18 is too small: {names}.* to 19 or more"):
        create_app(small)
    # an API-only pod keeps no share for a flusher it does not run, nor one without a catalog for its lookups
    settings.model_copy(update={"database_pool_max_size": 11}).check_can_serve()
    assert READ_LANES == len(CONTENT_KINDS)


async def test_a_sync_refused_for_want_of_a_database_says_when_to_retry(settings: Settings, redis: Redis) -> None:
    async with running_app(settings.model_copy(update={"database_url": ""})) as (_, client):
        token = auth(make_token(settings, 1))
        response = await client.post("/progress/sync", headers=token, json={"items": [sync_item(1, 9.0, ago(30))]})
    assert (response.status_code, response.headers.get("retry-after")) == (503, "1")
    assert "DATABASE_URL" in response.json()["detail"]
