"""Probes, metrics and the lifespan, against real servers."""

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from service.api.routes import not_serving
from service.config import Settings
from service.dev import database, embedded
from tests.helpers import auth, running_app, wait_for


async def test_live_is_always_ok(client: httpx.AsyncClient) -> None:
    response = await client.get("/health/live")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_readiness_follows_redis_down_and_back(settings: Settings, tmp_path: Path) -> None:
    """An API-only pod with no database: Redis is its only way to keep a heartbeat."""
    server = embedded.EmbeddedRedis(tmp_path / "valkey", None)
    server.start()
    try:
        api_only = settings.model_copy(update={"redis_url": server.url, "database_url": ""})
        async with running_app(api_only) as (_, client):
            assert (await client.get("/health/ready")).status_code == 200

            server.stop()
            down = await client.get("/health/ready")
            assert down.status_code == 503
            assert down.json()["status"] == "unavailable"
            assert down.json()["checks"]["redis"].startswith("unreachable")

            server.start()  # same port, same data dir
            back = await client.get("/health/ready")
            assert back.status_code == 200
            assert back.json() == {"status": "ready", "mode": "normal", "checks": {"redis": "ok"}}
    finally:
        server.stop()


async def test_lifespan_opens_and_closes_the_redis_client(settings: Settings, redis: Redis) -> None:
    name = f"progress-service:{settings.pod_name}"

    async def named_clients() -> int:
        return sum(1 for c in await redis.client_list() if c.get("name") == name)

    assert await named_clients() == 0
    async with running_app(settings) as (app, _):
        await app.api.state.services.redis.ping()
        assert await named_clients() >= 1
    assert app.table["/audios/progress"] is not_serving  # the table stopped serving before the parts stopped
    assert await named_clients() == 0


async def test_metrics_count_requests_by_route_and_status(client: httpx.AsyncClient, token: str) -> None:
    def count(text: str, route: str, status: str) -> float:
        prefix = f'progress_http_requests_total{{route="{route}",status="{status}"}} '
        return next(float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix))

    before = (await client.get("/metrics")).text
    await client.post("/audios/progress", json={"audio_id": 1, "position": 1}, headers=auth(token))
    await client.post("/audios/progress", json={"audio_id": 1}, headers=auth(token))
    after = (await client.get("/metrics")).text
    assert count(after, "/audios/progress", "201") == count(before, "/audios/progress", "201") + 1
    assert count(after, "/audios/progress", "422") == count(before, "/audios/progress", "422") + 1
    assert "progress_redis_write_seconds_bucket" in after


@pytest.mark.slow  # a Postgres of its own, frozen
@pytest.mark.regression
async def test_a_hung_postgres_does_not_hold_readiness_past_its_probe(settings: Settings, tmp_path: Path) -> None:
    """Found by an outside attack: with Postgres frozen (SIGSTOP), /health/ready took 31 s, so the load
    balancer's 2 s probe would have pulled every pod while Redis still took every heartbeat."""
    pg = database.EmbeddedPostgres(tmp_path / "postgres", None, durable=False)
    pg.start()
    frozen: list[int] = []
    try:
        async with running_app(settings.model_copy(update={"database_url": pg.url()})) as (_, client):
            assert (await client.get("/health/ready")).json()["checks"]["postgres"] == "ok"
            postmaster = int((pg.pgdata / "postmaster.pid").read_text().split()[0])
            children = subprocess.run(
                ["ps", "-o", "pid=", "--ppid", str(postmaster)], capture_output=True, text=True, check=True
            ).stdout.split()
            frozen = [postmaster, *map(int, children)]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            for _ in range(3):  # the first probe, and those that find it still waiting
                started = time.monotonic()
                response = await client.get("/health/ready")
                assert time.monotonic() - started < 2.0
                body = response.json()
                assert (response.status_code, body["mode"]) == (200, "normal")  # Redis still keeps heartbeats
                assert body["checks"]["postgres"].startswith("unreachable")
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
            frozen = []
            await wait_for(lambda: _postgres_ok(client), timeout_s=40)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        pg.stop()


async def _postgres_ok(client: httpx.AsyncClient) -> bool:
    return bool((await client.get("/health/ready")).json()["checks"]["postgres"] == "ok")
