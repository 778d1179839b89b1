"""The two connections every process of the service holds: Redis and the shared Postgres."""

import asyncpg
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from service.config import Settings


def connect_redis(settings: Settings) -> Redis:
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        # full pool: wait for a connection (a latency spike) rather than fail into degraded mode
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_socket_timeout_seconds,
        socket_timeout=settings.redis_socket_timeout_seconds,
        socket_connect_timeout=settings.redis_socket_timeout_seconds,
        # One quick retry covers a pooled connection that went stale (Redis restarted); more would
        # hold every request of an outage for seconds instead of answering it.
        retry=Retry(NoBackoff(), 1),
        health_check_interval=30,
        client_name=f"progress-service:{settings.pod_name}",  # visible in CLIENT LIST
    )
    return Redis.from_pool(pool)  # the client owns the pool and closes it


async def create_db_pool(settings: Settings) -> asyncpg.Pool:
    return await asyncpg.create_pool(
        settings.database_url,
        min_size=settings.database_pool_min_size,
        max_size=settings.database_pool_max_size,
        command_timeout=settings.database_command_timeout_seconds,
        timeout=settings.database_connect_timeout_seconds,
        statement_cache_size=settings.database_statement_cache_size,
    )
