"""A pod whose clock is off from Redis's takes no heartbeats: its receive times would misorder a listener's."""

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.config import Settings
from tests.helpers import auth, metric, running_app, seed, sync_item

pytestmark = pytest.mark.regression


async def test_a_pod_whose_clock_lags_refuses_heartbeats_and_is_not_ready_until_it_is_right(
    settings: Settings, redis: Redis, token: str
) -> None:
    """Found by an attack: a pod 30 s behind answered 201 to a listener's later heartbeats and the earlier one, from
    a pod with the right clock, stood: two acknowledged positions lost."""
    async with running_app(settings) as (app, client):
        clock = app.api.state.services.clock_check
        assert clock.ok
        clock._clock = lambda: time.time() - 30  # a host whose clock is 30 s behind
        await clock.sample()
        assert not clock.ok and metric("progress_clock_skew_seconds") == pytest.approx(-30, abs=1)
        refused = await client.post("/lives/progress", json={"live_id": 1, "position": 105}, headers=auth(token))
        assert refused.status_code == 503 and "clock" in refused.json()["detail"]
        ready = await client.get("/health/ready")
        assert ready.status_code == 503 and "clock" in ready.json()["checks"]
        assert await redis.keys("progress:*") == []
        clock._clock = time.time
        await clock.sample()
        assert clock.ok
        taken = await client.post("/lives/progress", json={"live_id": 1, "position": 110}, headers=auth(token))
        assert taken.status_code == 201
        assert (await client.get("/health/ready")).status_code == 200


@asynccontextmanager
async def _pod_an_hour_ahead(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(settings) as (app, client):
        clock = app.api.state.services.clock_check
        clock._clock = lambda: time.time() + 3600  # a host whose clock is 1 h ahead
        await clock.sample()
        assert not clock.ok
        yield client
    # shut down: the deferred writes' last round and the final flush have run


async def test_a_skewed_pod_keeps_no_heartbeat_it_refuses_with_429(
    settings: Settings, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    """Found by an attack: a pod 1 h ahead answered 503 to the heartbeats its rate limit let through, but kept the
    ones it refused with 429 and wrote them later, stamped 1 h ahead: the user's later positions lost to it."""
    await seed(db, users=3, contents=3)
    limited = settings.model_copy(update={"rate_limit_per_user_per_second": 0.01, "rate_limit_burst": 2})
    async with _pod_an_hour_ahead(limited) as client:
        statuses = [
            (await client.post("/lives/progress", json={"live_id": 1, "position": p}, headers=auth(token))).status_code
            for p in range(1, 7)
        ]
        assert statuses == [503] * 6  # not 429: a refused heartbeat would be written later with this clock's time
    assert await redis.keys("progress:*") == []
    assert await db.fetchval("SELECT count(*) FROM lives_liveprogress") == 0


async def test_a_skewed_pod_takes_no_offline_sync(
    settings: Settings, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    """Found by an attack: a pod 1 h ahead applied a sync item listened at 30 min from now (within 300 s of its
    clock), which a right clock refuses as "in the future": it stood against the user's later heartbeats."""
    await seed(db, users=3, contents=3)
    async with _pod_an_hour_ahead(settings) as client:
        ahead = datetime.now(UTC) + timedelta(minutes=30)
        synced = await client.post("/progress/sync", json={"items": [sync_item(1, 7.0, ahead)]}, headers=auth(token))
        assert synced.status_code == 503 and "clock" in synced.json()["detail"]
    assert await redis.keys("progress:*") == []
    assert await db.fetchval("SELECT count(*) FROM audios_audioprogress") == 0


def test_a_skew_within_the_bound_is_fine_and_zero_turns_the_check_off() -> None:
    assert Settings(jwt_secret="x" * 32).progress_max_clock_skew_seconds == 1.0
    assert Settings(jwt_secret="x" * 32, progress_max_clock_skew_seconds=0).progress_max_clock_skew_seconds == 0
