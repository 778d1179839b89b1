"""The buffer's size summed over every shard: on a sharded server, on a cluster, through `status`."""

import time

import pytest
from redis.asyncio import Redis, RedisCluster

from service.config import Settings
from service.progress.flush.backlog import measure_backlog
from service.progress.keys import KeyLayout
from service.redis_client import connect_redis
from tests.helpers import Servers, run_status, write

MEMBERS = [(content_id, user_id) for content_id in range(1, 6) for user_id in range(1, 9)]  # 40 keys


async def test_backlog_sums_every_shard_and_the_shards_of_the_previous_count(settings: Settings, redis: Redis) -> None:
    layout = KeyLayout(shards=8, previous_shards=2)
    for content_id, user_id in MEMBERS:
        await write(redis, "audio", content_id, user_id, 1.0, layout=layout)
    old_shard = KeyLayout(shards=2).shards_of("audio")[1]  # left over from before the shard change
    await redis.sadd(old_shard.pending_key, "99:1", "99:2")
    now_ms = time.time_ns() // 1_000_000
    current = layout.shards_of("audio")
    await redis.zadd(current[0].in_flight_key, {"7:7": now_ms + 5_000})
    await redis.zadd(current[5].in_flight_key, {"8:8": now_ms - 1_000, "9:9": now_ms - 3_000})
    assert len({shard.pending_key for shard in current if await redis.scard(shard.pending_key)}) > 1

    client = connect_redis(settings.redis)
    try:
        backlog = await measure_backlog(client, layout, leases_at_ms=now_ms)
    finally:
        await client.aclose()

    audio = backlog.by_type["audio"]
    assert (audio.pending, audio.in_flight, audio.expired_leases, audio.unread) == (42, 3, 2, 0)
    assert audio.earliest_lease_ms == now_ms - 3_000
    assert backlog.pending == 42 and backlog.errors == []
    assert backlog.by_type["lesson"].pending == 0 and backlog.by_type["lesson"].earliest_lease_ms is None


@pytest.mark.slow  # the session's Valkey Cluster
async def test_status_on_a_cluster_sums_the_shards_and_the_masters(
    servers: Servers, cluster_redis: RedisCluster, cluster_layout: KeyLayout, cluster_settings: Settings
) -> None:
    for content_id, user_id in MEMBERS:
        await write(cluster_redis, "lesson", content_id, user_id, 1.0, layout=cluster_layout)
    await write(cluster_redis, "live", 1, 1, 1.0, layout=cluster_layout)
    now_ms = time.time_ns() // 1_000_000
    shards = cluster_layout.shards_of("lesson")
    for shard in (shards[0], shards[len(shards) // 2], shards[-1]):  # one on each master
        await cluster_redis.zadd(shard.in_flight_key, {"1:1": now_ms + 60_000})
    holding = {
        cluster_redis.get_node_from_key(shard.pending_key).name
        for shard in shards
        if await cluster_redis.scard(shard.pending_key)
    }
    assert len(holding) == 3  # the members are spread over every master

    run = await run_status(servers, REDIS_URL=cluster_settings.redis_url, REDIS_CLUSTER="true")

    assert run.code == 0, run.stderr
    assert run.report["buffer"]["pending"] == {"lesson": 40, "audio": 0, "meditation": 0, "live": 1}
    assert run.report["buffer"]["in_flight"]["lesson"] == 3
    assert run.report["buffer"]["shards_per_type"] == len(shards)
    memory = run.report["redis"]
    assert len(memory["nodes"]) == 3
    assert memory["used_memory_bytes"] == sum(node["used_memory_bytes"] for node in memory["nodes"].values())
    assert memory["maxmemory_bytes"] == sum(node["maxmemory_bytes"] for node in memory["nodes"].values())
