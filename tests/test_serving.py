"""`serve` leaving and keeping connections (service/serving.py): on SIGTERM it leaves its load balancer before it
stops, one worker or several; an idle keep-alive connection outlives the proxies' idle timeouts."""

import asyncio
import json
import signal
import time

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.auth import make_token
from service.config import ConfigError, Settings, load_settings
from service.dev.embedded import free_port
from tests.helpers import TEST_JWT_SECRET, Servers, auth, seed, service_env, start_service_command, wait_for

DRAIN_S = 3.0
UVICORN_KEEP_ALIVE_S = 5  # uvicorn's default timeout_keep_alive
LESSON = "/engagements/progress/lesson"


async def _readiness(base_url: str) -> int | None:
    """The status of /health/ready on a connection of its own, as a load balancer's health check opens it."""
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=2) as probe:
            return (await probe.get("/health/ready")).status_code
    except httpx.TransportError:
        return None


@pytest.mark.slow  # real `serve` processes
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
    assert process.stderr is not None
    stderr = process.stderr
    lines: list[dict[str, object]] = []

    async def read_logs() -> None:
        async for line in stderr:
            if line.startswith(b"{"):
                lines.append(json.loads(line))

    reader = asyncio.create_task(read_logs())

    async def every_worker_started() -> bool:
        # one ready worker answers readiness; a worker still starting at SIGTERM has nothing to drain, and stops
        started = [line for line in lines if line["message"] == "Application startup complete."]
        return len(started) == workers and await _readiness_is(base_url, 200)

    try:
        await wait_for(every_worker_started, timeout_s=60)
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
    await reader
    drained = [str(line["message"]) for line in lines if str(line["message"]).startswith("SIGTERM: draining")]
    assert len({message.rsplit("[", 1)[1] for message in drained}) == workers, "every worker drains"
    # the final flush wrote the position answered during the drain
    row = await db.fetchrow("SELECT position FROM engagements_lessonprogress WHERE user_id = 2 AND lesson_id = 3")
    assert row is not None and row["position"] == 20


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SHUTDOWN_DRAIN_SECONDS", "-1"), ("SHUTDOWN_DRAIN_SECONDS", "soon"), ("HTTP_KEEP_ALIVE_TIMEOUT_SECONDS", "0")],
)
def test_a_drain_or_keep_alive_out_of_range_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        load_settings()


@pytest.mark.slow
@pytest.mark.regression
async def test_an_idle_keep_alive_connection_outlasts_uvicorns_five_seconds(servers: Servers, db: asyncpg.Pool) -> None:
    """uvicorn's own keep-alive (5 s) is below every proxy's idle timeout: the proxy could send on a connection
    the service was closing. The service keeps an idle one HTTP_KEEP_ALIVE_TIMEOUT_SECONDS (75 s)."""
    await seed(db, users=3, contents=3)
    port = free_port()
    env = service_env(
        servers,
        JWT_SECRET=TEST_JWT_SECRET,
        RELAY_ENABLED="false",
        EMAIL_PUBLISHER="redis-stream",
        SHUTDOWN_DRAIN_SECONDS="0",
    )
    process = await start_service_command("serve", "--host", "127.0.0.1", "--port", str(port), env=env)
    try:
        base_url = f"http://127.0.0.1:{port}"
        await wait_for(lambda: _readiness_is(base_url, 200), timeout_s=60)
        headers = auth(make_token(Settings(jwt_secret=TEST_JWT_SECRET), 2))
        # httpx drops its own idle connections after 5 s by default: here the server's side is under test
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=60)
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=10) as client:
            first = await client.post(LESSON, headers=headers, json={"lesson_id": 1, "position": 1})
            await asyncio.sleep(UVICORN_KEEP_ALIVE_S + 1)  # the idle time is what is tested, not a wait for an event
            second = await client.post(LESSON, headers=headers, json={"lesson_id": 1, "position": 2})
        assert (first.status_code, second.status_code) == (201, 201)
        assert second.extensions["network_stream"] is first.extensions["network_stream"]
    finally:
        process.terminate()
        await process.wait()


async def _readiness_is(base_url: str, status: int) -> bool:
    return await _readiness(base_url) == status
