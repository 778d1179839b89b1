"""Probes, metrics and the lifespan, against real servers."""

from pathlib import Path

import httpx
from redis.asyncio import Redis

from service import embedded
from service.config import Settings
from tests.helpers import auth, running_app


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
        assert app.sink is not None
        await app.app.state.redis.ping()
        assert await named_clients() >= 1
    assert app.sink is None
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
