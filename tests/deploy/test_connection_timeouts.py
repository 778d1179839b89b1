"""A dependency that accepts connections and never answers (a dead node behind a load balancer, a
blackholed route) costs each call its configured timeout, not the client library's default."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.config import Settings
from service.postgres import create_db_pool
from service.redis_client import connect_redis


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[int]:
    connections: list[asyncio.StreamWriter] = []

    async def accept_and_say_nothing(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in connections:
            writer.close()


async def test_database_connect_timeout_bounds_a_silent_postgres() -> None:
    async with silent_server() as port:
        settings = Settings(database_url=f"postgresql://postgres@127.0.0.1:{port}/progress")
        pool = await create_db_pool(settings.database, connect_timeout_s=0.5)  # min size 0: no connection yet
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await pool.fetchval("SELECT 1")
        assert time.monotonic() - started < 5
        pool.terminate()


async def test_redis_socket_timeout_bounds_a_silent_redis() -> None:
    async with silent_server() as port:
        settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", redis_socket_timeout_seconds=0.3)
        redis = connect_redis(settings.redis)
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await redis.ping()
        # one retry of a timed-out command at most (service/redis_client.py)
        assert time.monotonic() - started < 2
        await redis.aclose()
