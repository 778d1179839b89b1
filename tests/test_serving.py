"""`serve` on SIGTERM: it leaves its load balancer before it stops (service/serving.py), one worker or several."""

import asyncio
import json
import signal
import time

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.auth import make_token
from service.config import Settings
from service.embedded import free_port
from tests.helpers import TEST_JWT_SECRET, Servers, auth, seed, service_env, start_service_command, wait_for

pytestmark = pytest.mark.slow  # real `serve` processes

DRAIN_S = 3.0
LESSON = "/engagements/progress/lesson"


async def _readiness(base_url: str) -> int | None:
    """The status of /health/ready on a connection of its own, as a load balancer's health check opens it."""
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=2) as probe:
            return (await probe.get("/health/ready")).status_code
    except httpx.TransportError:
        return None


@pytest.mark.regression
@pytest.mark.parametrize("workers", [1, 2])
async def test_after_sigterm_a_keep_alive_client_is_answered_and_told_to_close(
    servers: Servers, db: asyncpg.Pool, redis: Redis, workers: int
) -> None:
    """Found by a fleet test: with readiness 200 until the socket closed and idle keep-alive connections closed at
    once, a client reusing its connection right after SIGTERM saw an EOF, and HAProxy answered 503s."""
    await seed(db, users=3, contents=3)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = service_env(
        servers,
        JWT_SECRET=TEST_JWT_SECRET,
        LOG_LEVEL="INFO",
        SHUTDOWN_DRAIN_SECONDS=str(DRAIN_S),
        PROGRESS_FLUSH_INTERVAL_SECONDS="3600",  # only the final flush can write the row
        RELAY_ENABLED="false",
        EMAIL_PUBLISHER="redis-stream",
        TRIAL_JOURNEY_INTERVAL_SECONDS="0",
    )
    process = await start_service_command(
        "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers), env=env
    )
    try:
        await wait_for(lambda: _readiness_is(base_url, 200), timeout_s=60)
        headers = auth(make_token(Settings(jwt_secret=TEST_JWT_SECRET), 2))
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=10) as client:
            before = await client.post(LESSON, headers=headers, json={"lesson_id": 3, "position": 10})
            assert before.status_code == 201 and "connection" not in before.headers

            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await wait_for(lambda: _readiness_is(base_url, 503), timeout_s=DRAIN_S / 2)
            async with httpx.AsyncClient(base_url=base_url, timeout=2) as probe:
                readiness = (await probe.get("/health/ready")).json()
            assert readiness["status"] == "draining" and readiness["mode"] == "normal", readiness
            assert "shutdown" in readiness["checks"]

            after = await client.post(LESSON, headers=headers, json={"lesson_id": 3, "position": 20})
            assert (after.status_code, after.json()) == (201, {"data": True})
            assert after.headers["connection"] == "close"
            # the same connection as before SIGTERM: the one a load balancer would have kept in its pool
            assert after.extensions["network_stream"] is before.extensions["network_stream"]

        code = await asyncio.wait_for(process.wait(), timeout=60)
        assert code == 0
        assert time.monotonic() - signalled >= DRAIN_S
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stderr is not None
    lines = [json.loads(line) for line in (await process.stderr.read()).decode().splitlines() if line.startswith("{")]
    drained = [str(line["message"]) for line in lines if str(line["message"]).startswith("SIGTERM: draining")]
    assert len({message.rsplit("[", 1)[1] for message in drained}) == workers, "every worker drains"
    # the final flush wrote the position answered during the drain
    row = await db.fetchrow("SELECT position FROM engagements_lessonprogress WHERE user_id = 2 AND lesson_id = 3")
    assert row is not None and row["position"] == 20


async def _readiness_is(base_url: str, status: int) -> bool:
    return await _readiness(base_url) == status
