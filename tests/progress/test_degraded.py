"""Degraded mode: with Redis unreachable, a 201 still means the heartbeat is in Postgres."""

import asyncio
import logging

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.auth import make_token
from service.config import Settings
from service.dev import embedded
from service.progress.flush.flusher import Flusher
from tests.helpers import auth, degraded_settings, running_app, seed


async def test_redis_down_writes_straight_to_postgres_then_recovers(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, duration_s=600)
    async with running_app(degraded_settings(settings, own_redis)) as (_, client):
        own_redis.stop()
        response = await client.post(
            "/engagements/progress/lesson", json={"lesson_id": 1, "position": 595}, headers=auth(token)
        )
        assert (response.status_code, response.json()) == (201, {"data": True})
        row = await db.fetchrow("SELECT position, completed_at FROM engagements_lessonprogress WHERE user_id = 7")
        assert row is not None and row["position"] == 595 and row["completed_at"] is not None
        assert await db.fetchval("SELECT count(*) FROM progress_completion_event") == 1
        ready = await client.get("/health/ready")
        assert (ready.status_code, ready.json()["mode"]) == (200, "degraded")
        assert "progress_degraded_mode 1.0" in (await client.get("/metrics")).text

        own_redis.start()
        await asyncio.sleep(0.3)  # past the retry interval: the next heartbeat tries Redis again
        response = await client.post(
            "/engagements/progress/lesson", json={"lesson_id": 1, "position": 599}, headers=auth(token)
        )
        assert response.status_code == 201
        back = Redis.from_url(own_redis.url, decode_responses=True)
        assert await back.smembers("progress:pending_flush:lesson") == {"1:7"}
        await back.aclose()
        assert (await client.get("/health/ready")).json()["mode"] == "normal"
        assert "progress_degraded_mode 0.0" in (await client.get("/metrics")).text
    # the direct write and the later Redis write settle to the newest, with one event
    flusher_redis = Redis.from_url(own_redis.url)
    await Flusher(settings.flush, flusher_redis, db).flush_cycle()
    await flusher_redis.aclose()
    assert await db.fetchval("SELECT position FROM engagements_lessonprogress WHERE user_id = 7") == 599
    assert await db.fetchval("SELECT count(*) FROM progress_completion_event") == 1


async def test_an_older_heartbeat_left_in_redis_does_not_undo_a_direct_write(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    async with running_app(degraded_settings(settings, own_redis)) as (_, client):
        await client.post("/audios/progress", json={"audio_id": 1, "position": 10}, headers=auth(token))
        own_redis.stop()  # the 10 s heartbeat waits in Redis's append-only file
        await client.post("/audios/progress", json={"audio_id": 1, "position": 20}, headers=auth(token))
        own_redis.start()
    flusher_redis = Redis.from_url(own_redis.url)
    await Flusher(settings.flush, flusher_redis, db).flush_cycle()
    await flusher_redis.aclose()
    assert await db.fetchval("SELECT position FROM audios_audioprogress WHERE user_id = 7") == 20


async def test_both_down_is_503_and_writes_nothing(
    settings: Settings,
    own_redis: embedded.EmbeddedRedis,
    db: asyncpg.Pool,
    token: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead_db = f"postgresql://postgres@127.0.0.1:{embedded.free_port()}/nothing"
    async with running_app(degraded_settings(settings, own_redis, database_url=dead_db)) as (_, client):
        own_redis.stop()
        with caplog.at_level(logging.WARNING, logger="service.api.ingest"):
            for _ in range(20):
                response = await client.post("/lives/progress", json={"live_id": 1, "position": 3}, headers=auth(token))
                assert response.status_code == 503
        assert "unavailable" in response.json()["detail"]
        assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1  # not one line per heartbeat
        ready = await client.get("/health/ready")
        assert ready.status_code == 503
        assert set(ready.json()["checks"]) == {"redis", "postgres"}
    assert await db.fetchval("SELECT count(*) FROM lives_liveprogress") == 0


async def test_degraded_mode_is_bounded_and_every_201_is_persisted(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool
) -> None:
    await seed(db, users=300, contents=1)
    async with running_app(
        # the pod's share of the budget: 20 rows a second, and what does not fit in a request's half second is 503
        degraded_settings(
            settings,
            own_redis,
            progress_flush_max_rows_per_second=20,
            progress_fleet_max_pods=1,
            degraded_write_timeout_seconds=0.5,
        )
    ) as (_, client):
        own_redis.stop()

        async def one(user_id: int, client: httpx.AsyncClient = client) -> tuple[int, int]:
            response = await client.post(
                "/meditations/progress",
                json={"meditation_id": 1, "position": user_id},
                headers=auth(make_token(settings, user_id)),
            )
            return user_id, response.status_code

        answers = await asyncio.gather(*(one(user_id) for user_id in range(1, 301)))
    acknowledged = {user_id for user_id, status in answers if status == 201}
    refused = {user_id for user_id, status in answers if status == 503}
    assert acknowledged and refused, "the budget should both admit and refuse some of 300 simultaneous writes"
    assert acknowledged | refused == set(range(1, 301))
    rows = await db.fetch("SELECT user_id, position FROM audios_meditationprogress")
    assert {row["user_id"]: row["position"] for row in rows} == {user_id: user_id for user_id in acknowledged}
