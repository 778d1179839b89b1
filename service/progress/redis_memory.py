"""Redis memory use as a metric: the buffer runs with maxmemory and noeviction, so a full Redis
refuses writes (degraded mode takes them) instead of silently dropping positions; the alert fires
well before that (deploy/prometheus/alerts.yml, 80 %)."""

import asyncio
import logging

from redis.asyncio import RedisCluster

from service import metrics
from service.clients import RedisClient
from service.loops import every
from service.stores import REDIS_FAILED

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 15.0


def _fill(info: dict[str, object]) -> float:
    maxmemory = int(str(info.get("maxmemory", 0)))
    return int(str(info["used_memory"])) / maxmemory if maxmemory else 0.0


async def sample_redis_memory(redis: RedisClient) -> None:
    if isinstance(redis, RedisCluster):
        # the master nearest to full is the one whose writes are refused first
        by_node = await redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
        info = max(by_node.values(), key=_fill)
    else:
        info = await redis.info("memory")
    metrics.REDIS_USED_MEMORY.set(int(info["used_memory"]))
    metrics.REDIS_MAX_MEMORY.set(int(info.get("maxmemory", 0)))


async def run_redis_memory_sampler(
    redis: RedisClient, stop: asyncio.Event, interval_s: float = SAMPLE_INTERVAL_S
) -> None:
    """Off the request path: one INFO per interval until `stop`."""

    async def sample() -> bool:
        try:
            await sample_redis_memory(redis)
        except REDIS_FAILED as exc:
            # Redis down is reported by readiness and the write metrics; the gauge keeps its last value
            log.debug("Redis memory not sampled: %s", exc)
            return False
        return True

    await every(interval_s, stop, sample, name="Redis memory sample", logger=log)
