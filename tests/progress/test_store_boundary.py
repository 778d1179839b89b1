"""The stores' typed boundary: whatever a client library raises for a store that is not there, the
request path sees that store's outage (service/stores.py), so a heartbeat is answered 201 (on Redis,
or in degraded mode on Postgres) or 503, never 500."""

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection

from service.auth import make_token
from service.config import Settings
from service.dev import database, embedded
from service.progress.ingest.buffer import WRITE_SCRIPT, decode_value, write_args
from service.progress.keys import STANDALONE, KeyLayout
from service.redis_client import RedisClient, connect_redis, execute_by_node
from service.stores import REDIS_UNAVAILABLE
from tests.helpers import auth, running_app, seed

LESSON_PATH = "/engagements/progress/lesson"
T = TypeVar("T")


async def heartbeat(client: httpx.AsyncClient, token: str, position: float) -> int:
    response = await client.post(LESSON_PATH, json={"lesson_id": 1, "position": position}, headers=auth(token))
    return response.status_code


def in_use(redis: RedisClient) -> list[AbstractConnection]:
    """The connections of a client that a call holds now."""
    if isinstance(redis, RedisCluster):
        return [conn for node in redis.get_nodes() for conn in node._connections if conn not in node._free]
    return list(redis.connection_pool._in_use_connections)


async def closed_under_its_write(redis: RedisClient, call: Awaitable[T]) -> T:
    """`call`, with every connection it takes dropped between taking it and writing to it.

    That is what redis-py's cluster client does to the calls in flight when one command meets
    CLUSTERDOWN in a failover: it disconnects every connection of every node. A call takes its
    connection and schedules its write in one step, so the loop turn that first sees the connection
    taken runs before the write.
    """
    task = asyncio.ensure_future(call)
    for _ in range(10_000):
        taken = in_use(redis)
        if taken or task.done():
            break
        await asyncio.sleep(0)
    assert taken, "the call never took a connection"
    for conn in taken:
        await conn.disconnect(nowait=True)
    return await task


async def stored_position(redis: Redis, user_id: int) -> float:
    raw = await redis.get(STANDALONE.value_key("lesson", 1, user_id))  # one shard on one server
    assert raw is not None
    return decode_value(raw).position


@pytest.mark.regression
async def test_a_connection_closed_under_a_heartbeat_write_is_retried_not_a_500(
    settings: Settings, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    """Before the boundary: AttributeError: 'NoneType' object has no attribute 'writelines', a 500."""
    await seed(db, users=7, contents=1)
    async with running_app(settings, raise_app_exceptions=False) as (app, client):
        assert await heartbeat(client, token, 10) == 201
        redis_client: Redis = app.api.state.services.redis
        assert await closed_under_its_write(redis_client, heartbeat(client, token, 20)) == 201
        # the pool's one retry took it to Redis on a new connection: not even degraded mode
        assert await stored_position(redis, 7) == 20
        assert not app.api.state.services.sink.degraded
        assert await heartbeat(client, token, 30) == 201
    assert await stored_position(redis, 7) == 30
    assert await db.fetchval("SELECT count(*) FROM engagements_lessonprogress") == 0  # all on Redis


@pytest.mark.slow  # the session's Valkey Cluster
@pytest.mark.regression
async def test_a_cluster_connection_closed_under_script_load_or_a_write_is_a_redis_outage(
    cluster_settings: Settings, cluster_redis: RedisCluster, cluster_layout: KeyLayout
) -> None:
    """The failover of tests/progress/test_cluster.py, in one step: the request path's script_load (and
    its writes) on connections the cluster client closed under them raise ConnectionError, which the
    request path takes to degraded mode, instead of AttributeError, which was a 500."""
    client = connect_redis(cluster_settings.redis)
    commands = [
        write_args("lesson", content_id, user_id, 5.0, 1000.0, cluster_layout)
        for content_id in (1, 2, 3)
        for user_id in range(1, 21)
    ]
    try:
        assert await execute_by_node(client, commands, key_index=3) == [1] * len(commands)
        # the boundary's connection class on every node the client discovered, not only on the URL's
        assert {type(conn).__module__ for node in client.get_nodes() for conn in node._connections} == {
            "service.redis_internals"
        }
        results = await closed_under_its_write(client, execute_by_node(client, commands, key_index=3))
        # each node's pipeline is its own task: those that took a connection before it was dropped failed
        assert all(result == 2 or isinstance(result, REDIS_UNAVAILABLE) for result in results), results
        assert any(isinstance(result, REDIS_UNAVAILABLE) for result in results), results
        await client.script_load(WRITE_SCRIPT)
        with pytest.raises(REDIS_UNAVAILABLE):
            await closed_under_its_write(client, client.script_load(WRITE_SCRIPT))
        # nothing stays broken: the next calls take new connections
        assert await client.script_load(WRITE_SCRIPT)
        assert await execute_by_node(client, commands, key_index=3) == [2] * len(commands)
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("url", "redis_py_class"),
    [
        ("redis://127.0.0.1:6379/0", Connection),
        ("rediss://127.0.0.1:6379/0", SSLConnection),
        ("unix:///tmp/valkey.sock?db=0", UnixDomainSocketConnection),
    ],
)
def test_every_url_scheme_keeps_its_kind_of_connection_behind_the_boundary(
    settings: Settings, url: str, redis_py_class: type[AbstractConnection]
) -> None:
    client = connect_redis(settings.model_copy(update={"redis_url": url}).redis)
    connection_class = client.connection_pool.connection_class
    assert issubclass(connection_class, redis_py_class) and connection_class.__module__ == "service.redis_internals"


async def test_idle_connections_killed_by_the_server_between_two_heartbeats_cost_no_500(
    settings: Settings, redis: Redis, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, contents=1)
    async with running_app(settings, raise_app_exceptions=False) as (_, client):
        assert await heartbeat(client, token, 10) == 201
        killed = await redis.execute_command("CLIENT KILL", "TYPE", "normal", "SKIPME", "yes")
        assert killed >= 1  # the app's pooled connection, idle
        assert await heartbeat(client, token, 20) == 201
    assert await stored_position(redis, 7) == 20


@pytest.mark.slow  # the session's Valkey Cluster
async def test_idle_cluster_connections_killed_by_the_servers_between_two_heartbeats_cost_no_500(
    cluster_settings: Settings, cluster_redis: RedisCluster, cluster_layout: KeyLayout, db: asyncpg.Pool, token: str
) -> None:
    await seed(db, users=7, contents=1)
    quick_retry = cluster_settings.model_copy(update={"degraded_redis_retry_seconds": 0.2})
    async with running_app(quick_retry, raise_app_exceptions=False) as (_, client):
        assert await heartbeat(client, token, 10) == 201
        await cluster_redis.execute_command(
            "CLIENT KILL", "TYPE", "normal", "SKIPME", "yes", target_nodes=RedisCluster.ALL_NODES
        )
        # no retry on a cluster: the heartbeat whose connection was killed goes to Postgres
        assert await heartbeat(client, token, 20) == 201
        await asyncio.sleep(0.25)  # past degraded_redis_retry_seconds: the next one tries Redis again
        assert await heartbeat(client, token, 30) == 201
    raw = await cluster_redis.get(cluster_layout.value_key("lesson", 1, 7))
    row = await db.fetchval("SELECT position FROM engagements_lessonprogress WHERE user_id = 7")
    assert (raw is not None and decode_value(raw).position == 30) or row == 30


@pytest.fixture
async def own_stores(tmp_path: Path) -> AsyncIterator[tuple[embedded.EmbeddedRedis, database.EmbeddedPostgres]]:
    """A Redis and a Postgres of this test's own, to stop without disturbing the session's."""
    valkey = embedded.EmbeddedRedis(tmp_path / "valkey", None)
    postgres = database.EmbeddedPostgres(tmp_path / "postgres", None, durable=False)
    try:
        valkey.start()
        postgres.start()
        await database.prepare_database(postgres.url(), seed=False)
        yield valkey, postgres
    finally:
        postgres.stop()
        valkey.stop()


@pytest.mark.slow  # servers of its own, stopped under load
@pytest.mark.regression
async def test_redis_and_postgres_stopped_together_under_load_answer_201_or_503_never_500(
    settings: Settings, own_stores: tuple[embedded.EmbeddedRedis, database.EmbeddedPostgres]
) -> None:
    """The outside attack: two pods, 48 connections, both stores stopped. A stopping Postgres sends
    its FATAL to every connection, idle ones in the pool too, which asyncpg's protocol takes for an
    operation in progress: the next statement on one raised InternalClientError ("cannot switch to
    state 12; another operation (2) is in progress"), a 500; and the pool's reset of one as it came
    back after a committed statement failed the same way, answering 503 for heartbeats that were
    written. Each failed about 3 runs in 4 here before the fix (a race with the shutdown)."""
    valkey, postgres = own_stores
    pool = await asyncpg.create_pool(postgres.url(), min_size=1, max_size=2)
    try:
        await seed(pool, users=48, contents=1)
    finally:
        await pool.close()
    pod = settings.model_copy(
        update={
            "redis_url": valkey.url,
            "database_url": postgres.url(),
            "degraded_redis_retry_seconds": 0.2,
            "degraded_write_timeout_seconds": 1.0,
        }
    )
    statuses: Counter[int] = Counter()
    after_stop: Counter[int] = Counter()
    refused: dict[int, set[float]] = {user_id: set() for user_id in range(1, 49)}  # answered 503
    stopped = asyncio.Event()
    done = asyncio.Event()

    async def listener(client: httpx.AsyncClient, user_id: int) -> None:
        token = make_token(pod, user_id)
        position = 0.0
        while not done.is_set():
            position += 1
            status = await heartbeat(client, token, position)
            (after_stop if stopped.is_set() else statuses)[status] += 1
            if status == 503:
                refused[user_id].add(position)

    async with (
        running_app(pod, raise_app_exceptions=False) as (_, one),
        running_app(pod, raise_app_exceptions=False) as (_, two),
    ):
        load = [asyncio.create_task(listener(one if user_id % 2 else two, user_id)) for user_id in range(1, 49)]
        try:
            deadline = time.monotonic() + 10
            while statuses[201] < 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert statuses[201] >= 200, statuses  # the load runs on both stores
            # both at once; Postgres's fast shutdown ends the pools' connections while degraded mode uses them
            stopped.set()  # the answers from here on may be 503s
            # Redis a moment first: degraded mode is then writing to Postgres when its shutdown ends
            # the pools' connections, some of them idle in the pool between two statements
            await asyncio.to_thread(valkey.stop)
            await asyncio.sleep(0.3)
            await asyncio.to_thread(postgres.stop)
            deadline = time.monotonic() + 10
            while after_stop[503] < 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            done.set()
            await asyncio.gather(*load)
    print(f"before the stop {dict(statuses)}, after it {dict(after_stop)}")
    assert set(statuses) == {201}, statuses
    assert set(after_stop) <= {201, 503}, after_stop  # 201s: heartbeats that were in Postgres before it went
    assert after_stop[503] >= 200, after_stop
    # and a 503 wrote nothing (no flusher runs here: the rows are degraded mode's own writes)
    postgres.start()
    conn = await asyncpg.connect(postgres.url())
    try:
        rows = await conn.fetch("SELECT user_id, position FROM engagements_lessonprogress")
    finally:
        await conn.close()
    assert rows, "degraded mode wrote some heartbeats before Postgres stopped"
    assert [(row["user_id"], row["position"]) for row in rows if row["position"] in refused[row["user_id"]]] == []
