"""A pod whose clock is off from Redis's takes no heartbeats: its receive times would misorder a listener's."""

import time

import pytest
from redis.asyncio import Redis

from service.config import Settings
from tests.helpers import auth, metric, running_app

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


def test_a_skew_within_the_bound_is_fine_and_zero_turns_the_check_off() -> None:
    assert Settings(jwt_secret="x" * 32).progress_max_clock_skew_seconds == 1.0
    assert Settings(jwt_secret="x" * 32, progress_max_clock_skew_seconds=0).progress_max_clock_skew_seconds == 0
