"""The buffer on a real Valkey Cluster (3 masters, 3 replicas): slots, spread, and the guarantees of the
standalone tests, run again in cluster mode through the same helpers."""

import signal
from collections import Counter
from datetime import UTC, datetime

import asyncpg
import httpx
from redis.asyncio import RedisCluster

from service.app import create_app
from service.config import Settings
from service.embedded import EmbeddedCluster
from service.progress.content import CONTENT_KINDS
from service.progress.flusher import Flusher
from service.progress.keys import KeyLayout
from service.trial_emails.queue import QueuedEmail, RedisStreamQueue, publish_guard_key
from tests.conftest import Servers, auth, seed
from tests.progress.test_crash_and_concurrency import (
    LEASE_S,
    assert_all_persisted,
    backlog,
    fill,
    flush_once,
    flusher_env,
    race_three_flushers,
)
from tests.progress.test_flusher import events, lesson_rows, write


def cluster_env(servers: Servers, cluster: EmbeddedCluster, **extra: str) -> dict[str, str]:
    return flusher_env(servers, REDIS_URL=cluster.url, REDIS_CLUSTER="true", **extra)


async def all_keys(redis: RedisCluster, pattern: str) -> list[str]:
    keys: list[str] = await redis.keys(pattern, target_nodes=RedisCluster.PRIMARIES)
    return keys


async def master_of_slot(redis: RedisCluster) -> dict[int, str]:
    """slot -> "host:port" of its master, as the cluster itself reports it."""
    owners = {}
    for (start, end), node in (await redis.cluster_slots()).items():
        for slot in range(start, end + 1):
            owners[slot] = f"{node['primary'][0]}:{node['primary'][1]}"
    return owners


async def test_keys_of_one_shard_share_one_slot(cluster_redis: RedisCluster, cluster_layout: KeyLayout) -> None:
    assert cluster_layout.shards == 60
    for kind in CONTENT_KINDS:
        for content_id, user_id in [(1, 1), (2, 7), (99, 123456), (5, 5)]:
            shard = cluster_layout.shard(kind.name, content_id, user_id)
            keys = [cluster_layout.value_key(kind.name, content_id, user_id), shard.pending_key, shard.in_flight_key]
            slots = {await cluster_redis.cluster_keyslot(key) for key in keys}
            assert len(slots) == 1, keys
    stream = "emails:trial_journey"
    email = QueuedEmail(7, "day_3", "sweep", datetime(2026, 1, 1, tzinfo=UTC))
    assert await cluster_redis.cluster_keyslot(publish_guard_key(stream, email)) == await cluster_redis.cluster_keyslot(
        stream
    )


async def test_ten_thousand_members_spread_evenly_over_the_masters(
    cluster_redis: RedisCluster, cluster_layout: KeyLayout
) -> None:
    owners = await master_of_slot(cluster_redis)
    assert len(set(owners.values())) == 3
    slot_of_shard = {shard.name: await cluster_redis.cluster_keyslot(shard.pending_key)
                     for shard in cluster_layout.shards_of("lesson")}  # fmt: skip
    members = Counter(
        owners[slot_of_shard[cluster_layout.shard("lesson", content_id, user_id).name]]
        for content_id in range(1, 11)
        for user_id in range(1, 1001)
    )
    even = 10_000 / 3
    assert all(abs(count - even) <= 0.2 * even for count in members.values()), members


async def test_the_trial_email_publish_script_runs_on_the_cluster(cluster_redis: RedisCluster) -> None:
    queue = RedisStreamQueue(cluster_redis, "emails:trial_journey")
    email = QueuedEmail(7, "day_3", "sweep", datetime(2026, 1, 1, tzinfo=UTC))
    await queue.publish(email)
    await queue.publish(email)  # the client's retry after a timeout: a no-op
    assert await cluster_redis.xlen("emails:trial_journey") == 1


async def test_heartbeats_through_http_land_in_every_table(
    cluster_settings: Settings, cluster_redis: RedisCluster, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    app = create_app(cluster_settings)
    async with app.app.router.lifespan_context(app.app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            for kind in CONTENT_KINDS:
                for content_id in (1, 2, 3):
                    response = await client.post(kind.path, json={kind.id_column: content_id, "position": 33.5},
                                                 headers=auth(token))  # fmt: skip
                    assert response.status_code == 201
            ready = await client.get("/health/ready")
            assert ready.json()["mode"] == "normal"
        pending = await all_keys(cluster_redis, "progress:pending_flush:*")
        assert len(pending) > 1  # spread over several shards
        result = await Flusher(redis=app.app.state.redis, pool=db, settings=cluster_settings).flush_cycle()
    assert (result.written, result.dropped, result.expired, result.failed_batches) == (12, 0, 0, 0)
    for kind in CONTENT_KINDS:
        rows = await db.fetch(f"SELECT user_id, {kind.id_column} AS content_id, position FROM {kind.progress_table}")
        assert sorted(tuple(r) for r in rows) == [(7, 1, 33.5), (7, 2, 33.5), (7, 3, 33.5)]
    assert await all_keys(cluster_redis, "progress:pending_flush:*") == []
    assert await all_keys(cluster_redis, "progress:in_flight:*") == []


async def test_last_heartbeat_wins_and_completion_is_recorded_once(
    cluster_settings: Settings, cluster_redis: RedisCluster, cluster_layout: KeyLayout, db: asyncpg.Pool
) -> None:
    await seed(db, users=20, contents=3, duration_s=100)
    flusher = Flusher(redis=cluster_redis, pool=db, settings=cluster_settings)
    for user_id in range(1, 21):
        for position in (10, 20, 30, 25):
            await write(cluster_redis, "lesson", 1, user_id, position, layout=cluster_layout)
        await write(cluster_redis, "lesson", 2, user_id, 95, layout=cluster_layout)  # completes (margin 10)
    await flusher.flush_cycle()
    for user_id in range(1, 21):
        await write(cluster_redis, "lesson", 2, user_id, 97, layout=cluster_layout)  # near the end again
    await flusher.flush_cycle()
    rows = await lesson_rows(db)
    assert {rows[(1, u)]["position"] for u in range(1, 21)} == {25}
    assert {rows[(2, u)]["position"] for u in range(1, 21)} == {97}
    assert sorted(await events(db)) == sorted(("lesson", 2, u) for u in range(1, 21))
    assert await backlog(cluster_redis, cluster_layout) == (0, 0)


async def test_sigkill_of_a_flusher_mid_batch_loses_nothing(
    servers: Servers, valkey_cluster: EmbeddedCluster, cluster_redis: RedisCluster, cluster_layout: KeyLayout,
    db: asyncpg.Pool,
) -> None:  # fmt: skip
    import asyncio
    import json

    last = await fill(cluster_redis, db, 1000, cluster_layout)
    killed = flush_once(servers, **cluster_env(servers, valkey_cluster, PROGRESS_FLUSH_FAILPOINT="after_claim"))
    assert killed.returncode == -signal.SIGKILL
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 0
    assert (await backlog(cluster_redis, cluster_layout))[1] > 0  # the claimed batches, under lease

    await asyncio.sleep(LEASE_S + 0.1)
    survivor = flush_once(servers, **cluster_env(servers, valkey_cluster))
    assert survivor.returncode == 0, survivor.stderr
    assert json.loads(survivor.stdout)["written"] == 1000
    await assert_all_persisted(cluster_redis, db, last, cluster_layout)


async def test_three_flushers_racing_keep_one_event_per_key_and_never_move_back(
    servers: Servers, valkey_cluster: EmbeddedCluster, cluster_redis: RedisCluster, cluster_layout: KeyLayout,
    db: asyncpg.Pool,
) -> None:  # fmt: skip
    await race_three_flushers(cluster_redis, db, cluster_env(servers, valkey_cluster), cluster_layout)
