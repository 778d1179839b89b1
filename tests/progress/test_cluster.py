"""The buffer on a real Valkey Cluster (3 masters, 3 replicas): slots, spread, and the guarantees of the
standalone tests, run again in cluster mode through the same helpers."""

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis, RedisCluster
from redis.crc import key_slot

from service.app import create_app
from service.auth import make_token
from service.config import ConfigError, Settings
from service.dev.embedded import EmbeddedCluster
from service.outbox.messages import Message
from service.outbox.stream_publisher import StreamPublisher, publish_guard_key
from service.progress.content import CONTENT_KINDS
from service.progress.flush.flusher import Flusher
from service.progress.ingest.buffer import decode_value
from service.progress.keys import STANDALONE, KeyLayout
from tests.helpers import (
    RowsWatch,
    Servers,
    auth,
    backlog,
    events,
    flusher_env,
    lesson_rows,
    race_three_flushers,
    running_app,
    seed,
    write,
)

pytestmark = pytest.mark.slow  # a 6-node Valkey Cluster, a failover, flusher processes

LESSON_PATH = "/engagements/progress/lesson"


def _degraded_writes() -> float:
    return REGISTRY.get_sample_value("progress_degraded_writes_total", {"content_type": "lesson"}) or 0.0


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


def test_a_cluster_url_with_a_database_number_refuses_to_start(settings: Settings) -> None:
    with pytest.raises(ConfigError, match="REDIS_CLUSTER"):
        create_app(settings.model_copy(update={"redis_cluster": True, "redis_url": "redis://127.0.0.1:7000/1"}))


def test_one_shard_on_a_standalone_server_keeps_the_monoliths_key_names() -> None:
    layout = KeyLayout.from_settings(Settings().redis)
    (shard,) = layout.shards_of("audio")
    assert (
        layout.value_key("audio", 5, 7) == "progress:latest_position:audio:5:7" == STANDALONE.value_key("audio", 5, 7)
    )
    assert (shard.pending_key, shard.in_flight_key) == ("progress:pending_flush:audio", "progress:in_flight:audio")
    # after a change of shard count, the flusher still drains the old layout
    changed = KeyLayout.from_settings(Settings(progress_buffer_shards=4, progress_buffer_previous_shards=1).redis)
    assert changed.shards_to_flush("audio")[-1] == shard and len(changed.shards_to_flush("audio")) == 5


async def test_members_pending_under_the_previous_shard_count_are_still_flushed(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=5)
    for user_id in range(1, 6):
        await write(redis, "lesson", 1, user_id, 42)  # the standalone default: one shard, the monolith's names
    changed = settings.model_copy(update={"progress_buffer_shards": 4, "progress_buffer_previous_shards": 1})
    await write(redis, "lesson", 2, 1, 43, layout=KeyLayout.from_settings(changed.redis))
    result = await Flusher(changed.flush, redis, db).flush_cycle()
    assert result.written == 6
    assert {key: row["position"] for key, row in (await lesson_rows(db)).items()} == {
        **{(1, user_id): 42 for user_id in range(1, 6)},
        (2, 1): 43,
    }
    assert await backlog(redis, KeyLayout.from_settings(changed.redis)) == (0, 0)


async def test_keys_of_one_shard_share_one_slot(cluster_redis: RedisCluster, cluster_layout: KeyLayout) -> None:
    assert cluster_layout.shards == 60
    for kind in CONTENT_KINDS:
        for content_id, user_id in [(1, 1), (2, 7), (99, 123456), (5, 5)]:
            shard = cluster_layout.shard(kind.name, content_id, user_id)
            keys = [cluster_layout.value_key(kind.name, content_id, user_id), shard.pending_key, shard.in_flight_key]
            slots = {await cluster_redis.cluster_keyslot(key) for key in keys}
            assert len(slots) == 1, keys
    stream = "emails:trial_journey"
    assert await cluster_redis.cluster_keyslot(publish_guard_key(stream, 7)) == await cluster_redis.cluster_keyslot(
        stream
    )


async def test_ten_thousand_members_spread_evenly_over_the_masters(
    cluster_redis: RedisCluster, cluster_layout: KeyLayout
) -> None:
    owners = await master_of_slot(cluster_redis)
    assert len(set(owners.values())) == 3
    slot_of_shard = {
        shard.name: await cluster_redis.cluster_keyslot(shard.pending_key)
        for shard in cluster_layout.shards_of("lesson")
    }
    members = Counter(
        owners[slot_of_shard[cluster_layout.shard("lesson", content_id, user_id).name]]
        for content_id in range(1, 11)
        for user_id in range(1, 1001)
    )
    even = 10_000 / 3
    assert all(abs(count - even) <= 0.2 * even for count in members.values()), members


async def test_the_trial_email_publish_script_runs_on_the_cluster(cluster_redis: RedisCluster) -> None:
    publisher = StreamPublisher(cluster_redis, "emails:trial_journey")
    kwargs = {"dispatch_id": 7, "user_id": 7, "email_key": "day_3", "source": "sweep"}
    email = Message(
        7, "send_email", "emails", "task-7", kwargs, extra={"reserved_at": datetime(2026, 1, 1, tzinfo=UTC)}
    )
    assert (await publisher.publish([email])).sent == [7]
    assert (await publisher.publish([email])).sent == [7]  # the client's retry after a timeout: a no-op
    assert await cluster_redis.xlen("emails:trial_journey") == 1


async def test_heartbeats_through_http_land_in_every_table(
    cluster_settings: Settings, cluster_redis: RedisCluster, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7)
    async with running_app(cluster_settings) as (app, client):
        for kind in CONTENT_KINDS:
            for content_id in (1, 2, 3):
                response = await client.post(
                    kind.path, json={kind.id_column: content_id, "position": 33.5}, headers=auth(token)
                )
                assert response.status_code == 201
        ready = await client.get("/health/ready")
        assert ready.json()["mode"] == "normal"
        pending = await all_keys(cluster_redis, "progress:pending_flush:*")
        assert len(pending) > 1  # spread over several shards
        result = await Flusher(cluster_settings.flush, app.api.state.services.redis, db).flush_cycle()
    assert (result.written, result.dropped, result.expired, result.failed_batches) == (12, 0, 0, 0)
    for kind in CONTENT_KINDS:
        rows = await db.fetch(f"SELECT user_id, {kind.id_column} AS content_id, position FROM {kind.progress_table}")
        assert sorted(tuple(r) for r in rows) == [(7, 1, 33.5), (7, 2, 33.5), (7, 3, 33.5)]
    assert await all_keys(cluster_redis, "progress:pending_flush:*") == []
    assert await all_keys(cluster_redis, "progress:in_flight:*") == []


async def test_reads_and_offline_sync_span_shards_on_the_cluster(
    cluster_settings: Settings, cluster_redis: RedisCluster, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, contents=40)
    async with running_app(cluster_settings) as (_, client):
        for content_id in range(1, 21):
            response = await client.post(
                LESSON_PATH, json={"lesson_id": content_id, "position": content_id + 0.5}, headers=auth(token)
            )
            assert response.status_code == 201
        now = datetime.now(UTC).isoformat()
        items = [
            {"content_type": "lesson", "content_id": c, "position": 7.0, "listened_at": now} for c in range(21, 41)
        ]
        synced = await client.post("/progress/sync", json={"items": items}, headers=auth(token))
        assert synced.status_code == 200
        assert [item["applied"] for item in synced.json()["items"]] == [True] * 20
        one = await client.get("/progress/lesson/3", headers=auth(token))
        assert one.status_code == 200 and one.json()["position"] == 3.5
        ids = ",".join(str(c) for c in range(1, 41))
        many = await client.get(f"/progress/lesson?ids={ids}", headers=auth(token))
        assert many.status_code == 200
    # the 40 values live in many shards (so many slots): the read gathered them all before any flush
    positions = {entry["content_id"]: entry["position"] for entry in many.json()["data"]}
    assert positions == {**{c: c + 0.5 for c in range(1, 21)}, **{c: 7.0 for c in range(21, 41)}}
    assert len(await all_keys(cluster_redis, "progress:pending_flush:*")) > 1
    assert await lesson_rows(db) == {}


async def test_last_heartbeat_wins_and_completion_is_recorded_once(
    cluster_settings: Settings, cluster_redis: RedisCluster, cluster_layout: KeyLayout, db: asyncpg.Pool
) -> None:
    await seed(db, users=20, contents=3, duration_s=100)
    flusher = Flusher(cluster_settings.flush, cluster_redis, db)
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


async def test_three_flushers_racing_keep_one_event_per_key_and_never_move_back(
    servers: Servers,
    valkey_cluster: EmbeddedCluster,
    cluster_redis: RedisCluster,
    cluster_layout: KeyLayout,
    db: asyncpg.Pool,
) -> None:
    """The one race of flusher processes (it ran on a standalone server too, with the same assertions: the cluster's
    layout is the harder case, many shards over three masters)."""
    await race_three_flushers(cluster_redis, db, cluster_env(servers, valkey_cluster), cluster_layout)


async def test_a_master_killed_under_load_fails_over_and_loses_only_unreplicated_writes(
    valkey_cluster: EmbeddedCluster,
    cluster_settings: Settings,
    cluster_redis: RedisCluster,
    cluster_layout: KeyLayout,
    db: asyncpg.Pool,
) -> None:
    """SIGKILL of a master while heartbeats flow and the flusher runs; its replica takes over.

    The documented trade-off: a write the master acknowledged but had not yet replicated is lost with
    it. Every 201 is in a ledger; a key whose last acknowledged position is not in Postgres counts as
    lost, and may only be one of the killed master's, acknowledged just before the kill.
    """
    lesson = next(kind for kind in CONTENT_KINDS if kind.name == "lesson")
    await seed(db, users=20, contents=3, duration_s=100)
    keys = [(content_id, user_id) for content_id in (1, 2, 3) for user_id in range(1, 21)]
    tokens = {user_id: make_token(cluster_settings, user_id) for user_id in range(1, 21)}
    owners = await master_of_slot(cluster_redis)
    victim = next(node for node in valkey_cluster.nodes[1:] if f"127.0.0.1:{node.port}" in owners.values())
    victim_name = f"127.0.0.1:{victim.port}"
    victim_keys = {
        key for key in keys if owners[key_slot(cluster_layout.value_key("lesson", *key).encode())] == victim_name
    }
    assert victim_keys and victim_keys != set(keys)
    settings = cluster_settings.model_copy(
        update={
            "progress_flusher_enabled": True,
            "progress_flush_interval_seconds": 0.2,
            "progress_flush_lease_seconds": 1.0,
            "degraded_redis_retry_seconds": 0.2,
        }
    )
    ledger: dict[tuple[int, int], tuple[float, float]] = {}  # key -> (last acknowledged position, its time)
    statuses: Counter[int] = Counter()
    refused: list[str] = []
    watch = RowsWatch(db)

    async def post(client: httpx.AsyncClient, key: tuple[int, int], position: float) -> None:
        response = await client.post(
            lesson.path, json={lesson.id_column: key[0], "position": position}, headers=auth(tokens[key[1]])
        )
        statuses[response.status_code] += 1
        if response.status_code == 201:
            ledger[key] = (position, time.monotonic())
        else:
            refused.append(f"{response.status_code} {response.json()['detail']}")

    witness = Redis(port=valkey_cluster.nodes[0].port, decode_responses=True)  # never the victim

    async def cluster_state() -> str:
        state: str = (await witness.cluster("INFO"))["cluster_state"]
        return state

    async def failed_over() -> bool:
        """The victim's slots have a master again: its replica was promoted, the cluster serves them."""
        nodes = await witness.cluster("NODES")
        masters = {
            address.split("@")[0]
            for address, node in nodes.items()
            if "master" in node["flags"] and "fail" not in node["flags"] and node["slots"]
        }
        return await cluster_state() == "ok" and len(masters) == 3 and victim_name not in masters

    degraded_before = _degraded_writes()
    killed_at = 0.0
    failed_over_at = 0  # the step after which the cluster was seen failed over
    try:
        async with running_app(settings) as (_, client):
            deadline = time.monotonic() + 60
            step = 0
            # the load runs through the failover, and on to 10 steps on the promoted replica (and at
            # least 100 steps): the kill and the promotion are both under load, however fast or slow
            while step < 100 or not failed_over_at or step < failed_over_at + 10:
                step += 1
                assert time.monotonic() < deadline, f"no failover seen by step {step}"
                if step == 20:
                    assert await cluster_state() == "ok"
                    victim.kill()  # SIGKILL, mid-stream and (interval 0.2 s) around a flush
                    killed_at = time.monotonic()
                # positions rise with each step; the keys cross the completion margin (90 of 100) at step 90
                await asyncio.gather(*(post(client, key, float(min(step, 99))) for key in keys))
                if step == 20:
                    # The cluster had not yet marked the victim failed (node timeout: 1 s), so it served
                    # the other masters' slots all along: only the dead master's heartbeats went to
                    # Postgres (degraded mode per node). The premise, checked rather than timed:
                    assert await cluster_state() == "ok", "step 20 outlived the node timeout"
                    assert 0 < _degraded_writes() - degraded_before <= len(victim_keys)
                    for key in set(keys) - victim_keys:
                        raw = await cluster_redis.get(cluster_layout.value_key("lesson", *key))
                        assert decode_value(raw).position == 20, key
                elif step > 20 and not failed_over_at and await failed_over():
                    failed_over_at = step
                await watch.sample()
                await asyncio.sleep(0.03)
        valkey_cluster.wait_until_healthy(timeout_s=30)  # every replica in sync with its master
        async with RedisCluster.from_url(valkey_cluster.url, decode_responses=True) as fresh:
            masters_now = set((await master_of_slot(fresh)).values())
            assert len(masters_now) == 3 and victim_name not in masters_now  # its replica took its slots
            flusher = Flusher(settings.flush, fresh, db)
            # until the backlog is flushed: leases of batches claimed on the dead master expire (1 s)
            deadline = time.monotonic() + 30
            await flusher.flush_cycle()
            while await backlog(fresh, cluster_layout) != (0, 0):
                assert time.monotonic() < deadline, await backlog(fresh, cluster_layout)
                await asyncio.sleep(0.2)
                await flusher.flush_cycle()
    finally:
        await witness.aclose()
        victim.start()  # it rejoins as a replica of the master that replaced it
        valkey_cluster.wait_until_healthy(timeout_s=30)
    await watch.sample()
    rows = await lesson_rows(db)
    lost = {key: acked for key, acked in ledger.items() if key not in rows or rows[key]["position"] != acked[0]}
    print(
        f"failover: seen after step {failed_over_at} of {step}, "
        f"{sum(statuses.values())} heartbeats {dict(statuses)}, "
        f"{_degraded_writes() - degraded_before:.0f} written directly while the master was down, "
        f"{len(lost)} keys lost their last acknowledged position"
    )
    # degraded mode answered for the dead master's slots; what it may refuse is a heartbeat whose row the flush
    # holds at that moment (SKIP LOCKED, the documented 503: retried by the app's next heartbeat, never acknowledged)
    assert all("locked by another session" in why for why in refused), refused
    assert statuses[201] >= 0.99 * sum(statuses.values()), dict(statuses)
    assert _degraded_writes() > degraded_before
    assert watch.moved_back == []
    for key, (position, acked_at) in lost.items():
        assert key in victim_keys, key  # only the killed master's writes can be lost
        assert killed_at - 1.0 < acked_at <= killed_at, key  # and only those not yet replicated
        assert key not in rows or rows[key]["position"] < position
    completed = {key for key, row in rows.items() if row["completed_at"] is not None}
    assert completed == set(keys)
    recorded = await events(db)
    assert sorted(recorded) == sorted(("lesson", *key) for key in completed)  # one event each, none doubled
