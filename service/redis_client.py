"""The Redis client every process of the service holds: one server or a cluster.

Cluster awareness stays here and in service/progress/keys.py: callers get a client with the
commands both kinds share, and send a turn's commands with execute_by_node. What this reaches into
redis-py for is in service/redis_internals.py.
"""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import Connection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, MovedError, RedisClusterException, TryAgainError

from service.config import RedisSettings
from service.redis_internals import GUARDED, guard_cluster_connections, node_pipeline, round_trip, topology_is_stale
from service.stores import REDIS_FAILED, REDIS_UNAVAILABLE

RedisClient: TypeAlias = Redis | RedisCluster
T = TypeVar("T")


# connections per process (per node on a cluster): far above what the request path and the loops hold at once
MAX_CONNECTIONS = 64


def connect_redis(settings: RedisSettings) -> RedisClient:
    common = dict(
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.socket_timeout_s,
        health_check_interval=30,
        client_name=settings.client_name,  # visible in CLIENT LIST
    )
    if settings.cluster:
        # REDIS_URL names any node; the client discovers the others. max_connections is per node.
        # No retry: redis-py retries a cluster pipeline by closing every connection of every node,
        # which fails the healthy nodes' writes in flight too. A failed node's writes go to degraded
        # mode instead, and the topology is re-read before the next command (execute_by_node).
        cluster = RedisCluster.from_url(
            settings.url, max_connections=MAX_CONNECTIONS, retry=Retry(NoBackoff(), 0), **common
        )
        guard_cluster_connections(cluster)
        return cluster
    # as BlockingConnectionPool.from_url, which would put redis-py's class back for rediss:// and unix://
    options: dict[str, Any] = dict(
        # full pool: wait for a connection (a latency spike) rather than fail into degraded mode
        max_connections=MAX_CONNECTIONS,
        timeout=settings.socket_timeout_s,
        # One quick retry covers a pooled connection that went stale (Redis restarted); more would
        # hold every request of an outage for seconds instead of answering it.
        retry=Retry(NoBackoff(), 1),
        **common,
    )
    options.update(parse_url(settings.url))  # the URL's own options win, as in from_url
    options["connection_class"] = GUARDED[options.get("connection_class", Connection)]
    pool = BlockingConnectionPool(**options)
    return Redis.from_pool(pool)  # the client owns the pool and closes it


async def execute_by_node(
    redis: RedisClient, commands: Sequence[tuple[object, ...]], *, key_index: int
) -> list[object]:
    """Send commands in one round trip per node; each result is its reply or its own exception.

    On a cluster, a pipeline per node rather than one cluster pipeline: redis-py fails a whole cluster
    pipeline when one node is unreachable, and only the commands of that node's slots should fail
    (they go to degraded mode; the others' heartbeats stay on Redis). `key_index` locates a key of
    each command; all its keys share that key's slot.
    """
    if not isinstance(redis, RedisCluster):  # one server: its one pipeline, awaited here (no task to gather)
        try:
            return await _on_server(redis, commands)
        except Exception as exc:  # as gather's return_exceptions below: each command's result
            return [exc] * len(commands)
    # no node answers, or a slot has no master during a failover: a RedisClusterException, which
    # REDIS_UNAVAILABLE counts (service.stores), so it goes up as it is
    await redis.initialize()  # a no-op once the topology is known; re-reads it after a failure
    by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
    for i, args in enumerate(commands):
        node = _node_of(redis, args[key_index])
        by_node.setdefault(node.name, (node, []))[1].append(i)
    groups = list(by_node.values())
    sent = await asyncio.gather(
        *(_on_node(redis, [commands[i] for i in group], node) for node, group in groups),
        return_exceptions=True,
    )
    results: list[object] = [None] * len(commands)
    for (_, group), outcome in zip(groups, sent, strict=True):
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome  # cancelled: not a failure of that node
        for position, i in enumerate(group):
            results[i] = outcome if isinstance(outcome, Exception) else outcome[position]
    if any(isinstance(result, REDIS_UNAVAILABLE) for result in results):
        topology_is_stale(redis)
    return results


async def get_many(redis: RedisClient, keys: Sequence[str]) -> list[bytes | str | None]:
    """The values of `keys`, in order: one MGET on a server; on a cluster, where a MGET must stay in
    one slot, a GET per key in one pipeline per node (still one round trip per node, all at once)."""
    if not isinstance(redis, RedisCluster):
        (values,) = await _on_server(redis, [("MGET", *keys)])
        if isinstance(values, Exception):  # an error reply (a wrong type, OOM...): the read's error
            raise values
        return values  # type: ignore[return-value]
    results = await execute_by_node(redis, [("GET", key) for key in keys], key_index=1)
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results  # type: ignore[return-value]


async def on_each_master(redis: RedisClient, command: Callable[[dict[str, Any]], Awaitable[T]]) -> dict[str, T]:
    """`command(target)` on the server, or on every master of a cluster one at a time, by node name ("" on a
    server). `target` goes into the command's keywords; one node each time, because redis-py answers a command
    sent to several nodes with a dict by node, but to one node with its reply alone."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()  # the client learns the masters at its first command; this may be it
        masters = redis.get_primaries()
        replies = await asyncio.gather(*(command({"target_nodes": node}) for node in masters))
        return {node.name: reply for node, reply in zip(masters, replies, strict=True)}
    return {"": await command({})}


async def ping(redis: RedisClient) -> None:
    """Raise unless Redis answers: on a cluster, every master (each holds a share of the heartbeats)."""
    await on_each_master(redis, lambda target: redis.ping(**target))


def same_slot_prefix(key: str) -> str:
    """A prefix for keys that must share `key`'s hash slot (a script touching both runs on a cluster).

    A key without a hash tag is hashed whole, so `{key}` hashes like it; a key with a tag keeps it.
    """
    start = key.find("{")
    end = key.find("}", start + 1)
    if start != -1 and end > start + 1:
        return key
    return "{" + key + "}"


def node_name(redis: RedisClient, key: object) -> str:
    """The cluster node that holds `key` ("host:port"); "" on a standalone server."""
    if not isinstance(redis, RedisCluster):
        return ""
    return str(_node_of(redis, key).name)


def _node_of(redis: RedisCluster, key: object) -> ClusterNode:
    node = redis.get_node_from_key(key)  # type: ignore[arg-type]
    if node is None:
        raise RedisClusterException(f"no node holds the slot of {key!r}")
    return node


async def _on_server(redis: Redis, commands: Sequence[tuple[object, ...]]) -> list[object]:
    pool = redis.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        return await round_trip(connection, commands)
    finally:
        await pool.release(connection)


async def _on_node(redis: RedisCluster, commands: Sequence[tuple[object, ...]], node: ClusterNode) -> list[object]:
    # a cluster's commands already grouped by node: one round trip, and a command whose slot moved follows the move
    results = await node_pipeline(node, commands)
    for i, result in enumerate(results):
        if isinstance(result, (MovedError, AskError, TryAgainError)):
            # its slot moved (resharding, failover): redis-py follows the redirection for this command
            try:
                results[i] = await redis.execute_command(*commands[i])  # type: ignore[arg-type]
            except REDIS_FAILED as exc:
                results[i] = exc
    return results
