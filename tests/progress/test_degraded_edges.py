"""Degraded mode's hard edges: the later of two same-millisecond heartbeats wins; a 503 writes
nothing, ever; a Redis that is full (OOM) sends heartbeats to Postgres instead of failing them."""

import asyncio
import time

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service import metrics
from service.auth import make_token
from service.config import Settings
from service.dev import embedded
from service.progress.ingest.redis_memory import sample_redis_memory
from tests.helpers import auth, degraded_settings, running_app, seed, wait_for


async def test_the_later_of_two_same_millisecond_heartbeats_wins_in_degraded_mode(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    await seed(db, users=100, contents=1)
    tokens = {user_id: make_token(settings, user_id) for user_id in range(1, 101)}
    async with running_app(degraded_settings(settings, own_redis)) as (_, client):
        own_redis.stop()
        # The wall clock stands still: every heartbeat of the test arrives in the same millisecond,
        # which a fast Postgres and one keep-alive connection make happen now and then for real.
        frozen_ns = time.time_ns()
        monkeypatch.setattr(time, "time_ns", lambda: frozen_ns)
        for run in range(5):

            async def two(user_id: int, run: int = run, client: httpx.AsyncClient = client) -> None:
                # one connection's pair: the second sent once the first was answered, often in the same ms
                for position in (run * 10 + 1, run * 10 + 2):
                    response = await client.post(
                        "/engagements/progress/lesson",
                        headers=auth(tokens[user_id]),
                        json={"lesson_id": 1, "position": position},
                    )
                    assert response.status_code == 201

            await asyncio.gather(*(two(user_id) for user_id in tokens))
            rows = await db.fetch("SELECT user_id, position FROM engagements_lessonprogress")
            assert {row["user_id"]: row["position"] for row in rows} == dict.fromkeys(tokens, run * 10 + 2), run


async def test_a_503_from_degraded_mode_writes_nothing_even_after_postgres_recovers(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool
) -> None:
    await seed(db, users=6, contents=1)
    slow = degraded_settings(settings, own_redis, degraded_write_timeout_seconds=0.5)
    async with running_app(slow) as (app, client):
        own_redis.stop()
        async with db.acquire() as blocker:
            # a slow Postgres: the table is locked, so every degraded statement waits
            transaction = blocker.transaction()
            await transaction.start()
            await blocker.execute("LOCK TABLE audios_audioprogress IN ACCESS EXCLUSIVE MODE")
            answers = await asyncio.gather(
                *(
                    client.post(
                        "/audios/progress",
                        json={"audio_id": 1, "position": user_id},
                        headers=auth(make_token(settings, user_id)),
                    )
                    for user_id in range(1, 7)
                )
            )
            assert [a.status_code for a in answers] == [503] * 6
            await transaction.rollback()  # Postgres is fast again
        direct = app.api.state.services.sink._direct
        assert direct is not None

        async def settled() -> bool:  # nothing queued in degraded mode, no statement of it left running
            running = await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE state = 'active' AND query LIKE '%audios_audioprogress%' AND pid <> pg_backend_pid()"
            )
            return not any(batcher._sending for batcher in direct._batchers.values()) and running == 0

        await wait_for(settled)
        assert await db.fetchval("SELECT count(*) FROM audios_audioprogress") == 0
        recovered = await client.post(
            "/audios/progress", json={"audio_id": 1, "position": 99}, headers=auth(make_token(settings, 6))
        )
        assert recovered.status_code == 201
    rows = await db.fetch("SELECT user_id, position FROM audios_audioprogress")
    assert [(row["user_id"], row["position"]) for row in rows] == [(6, 99)]


async def test_a_full_redis_sends_heartbeats_to_postgres_not_to_a_500(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, contents=1)
    # a retry interval longer than the test: readiness looks within the interval that follows the failure
    full = Redis.from_url(own_redis.url)
    try:
        async with running_app(degraded_settings(settings, own_redis, degraded_redis_retry_seconds=30.0)) as (
            _,
            client,
        ):
            await full.config_set("maxmemory-policy", "noeviction")
            await full.config_set("maxmemory", 1)  # used memory is over it at once: every write gets OOM
            await sample_redis_memory(full)
            assert metrics.REDIS_MAX_MEMORY._value.get() == 1 < metrics.REDIS_USED_MEMORY._value.get()
            response = await client.post(
                "/meditations/progress", json={"meditation_id": 1, "position": 42}, headers=auth(token)
            )
            assert response.status_code == 201
            # PING still answers, but a heartbeat cannot go to Redis: readiness says so
            ready = await client.get("/health/ready")
            assert (ready.status_code, ready.json()["mode"]) == (200, "degraded")
            await full.config_set("maxmemory", 0)
        assert await full.keys("progress:*") == []
    finally:
        await full.aclose()
    assert await db.fetchval("SELECT position FROM audios_meditationprogress WHERE user_id = 7") == 42


@pytest.mark.regression
async def test_in_degraded_mode_a_locked_row_refuses_its_own_heartbeat_only(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool
) -> None:
    """Found by an attack: Redis full, one user's row held FOR UPDATE, and every heartbeat of that type batched
    with it waited out lock_timeout and was refused."""
    await seed(db, users=6, contents=1)
    await db.execute(
        "INSERT INTO audios_audioprogress (user_id, audio_id, position, created_at, updated_at)"
        " VALUES (3, 1, 1, now() - interval '1 hour', now() - interval '1 hour')"
    )
    async with running_app(degraded_settings(settings, own_redis)) as (_, client):
        own_redis.stop()
        async with db.acquire() as locker, locker.transaction():
            await locker.execute("SELECT 1 FROM audios_audioprogress WHERE user_id = 3 FOR UPDATE")
            answers = await asyncio.gather(
                *(
                    client.post(
                        "/audios/progress",
                        json={"audio_id": 1, "position": 50 + user_id},
                        headers=auth(make_token(settings, user_id)),
                    )
                    for user_id in range(1, 7)
                )
            )
        assert [a.status_code for a in answers] == [201, 201, 503, 201, 201, 201]
        assert "locked" in answers[2].json()["detail"]
    rows = await db.fetch("SELECT user_id, position FROM audios_audioprogress ORDER BY user_id")
    assert [(row["user_id"], row["position"]) for row in rows] == [(1, 51), (2, 52), (3, 1), (4, 54), (5, 55), (6, 56)]
