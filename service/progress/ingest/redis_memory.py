"""Redis memory use as a metric: the buffer runs with maxmemory and noeviction, so a full Redis
refuses writes (degraded mode takes them) instead of silently dropping positions; the alert fires
well before that (deploy/prometheus/alerts.yml, 80 %)."""

import asyncio
import logging
from functools import partial

from service import metrics
from service.loops import sample_every
from service.redis_client import RedisClient, on_each_master
from service.stores import REDIS_FAILED

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 15.0


def used_and_max(info: dict[str, object]) -> tuple[int, int]:
    """(used_memory, maxmemory) in bytes from an INFO memory reply; maxmemory 0: no limit."""
    return int(str(info["used_memory"])), int(str(info.get("maxmemory", 0)))


async def memory_by_node(redis: RedisClient) -> dict[str, dict[str, object]]:
    """INFO memory of the server, or of every master of a cluster, by node name ("" on a server)."""
    return await on_each_master(redis, lambda target: redis.info("memory", **target))


async def sample_redis_memory(redis: RedisClient) -> None:
    # the master nearest to full is the one whose writes are refused first (maxmemory 0: never full)
    sizes = [used_and_max(info) for info in (await memory_by_node(redis)).values()]
    used, maxmemory = max(sizes, key=lambda size: size[0] / size[1] if size[1] else 0.0)
    metrics.REDIS_USED_MEMORY.set(used)
    metrics.REDIS_MAX_MEMORY.set(maxmemory)


async def run_redis_memory_sampler(redis: RedisClient, stop: asyncio.Event) -> None:
    """Off the request path: one INFO per interval until `stop`."""
    await sample_every(
        SAMPLE_INTERVAL_S,
        stop,
        partial(sample_redis_memory, redis),
        name="Redis memory sample",
        unavailable=REDIS_FAILED,
        logger=log,
    )
