"""The connections every process of the service holds: Redis (one server or a cluster) and Postgres.

Cluster awareness stays here and in service/progress/keys.py: callers get a client with the
commands both kinds share, and send a turn's commands with execute_by_node.
"""

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import asyncpg
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode, PipelineCommand
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import AskError, MovedError, RedisClusterException, RedisError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.utils import HIREDIS_AVAILABLE

from service.config import Settings
from service.stores import REDIS_UNAVAILABLE

RedisClient: TypeAlias = Redis | RedisCluster


def _closed(writer: asyncio.StreamWriter | None) -> bool:
    return writer is None or writer.transport is None or writer.transport.is_closing()


class _ClosedTransportIsConnectionError(AbstractConnection):
    """A call on a connection whose transport closed under it fails with redis's ConnectionError.

    redis-py reaches for the transport a connection had, and two ways that is gone raise errors that
    are not a RedisError (redis-py #4287, #3546): a disconnect from another task while a write is
    pending (the cluster client closes every connection of every node on CLUSTERDOWN, in a failover;
    the write then finds `None`: "'NoneType' object has no attribute 'writelines'"), and, on CPython
    3.12+, a transport the peer reset, whose own internals raise TypeError/AttributeError. Neither is
    retried by redis-py, and the request path would answer 500 instead of going to degraded mode.
    Only those are converted, after the connection is dropped: an AttributeError or TypeError while
    the transport is open is a bug, and goes up as it is.
    """

    async def _send_packed_command(self, command: Iterable[bytes]) -> None:
        # Every write comes here: redis-py writes through this method whenever a socket timeout is
        # set, and Settings always sets one (> 0). send_packed_command disconnects on any error.
        writer = self._writer
        if writer is None or _closed(writer):
            raise RedisConnectionError(f"connection to {self._host_error()} closed before the write")
        try:
            writer.writelines(command)
            await writer.drain()
        except (AttributeError, TypeError) as exc:
            if not _closed(writer):
                raise
            raise RedisConnectionError(f"connection to {self._host_error()} closed under the write: {exc!r}") from exc

    async def read_response(
        self,
        disable_decoding: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109 (redis-py's signature)
        *,
        disconnect_on_error: bool = True,
        push_request: bool | None = False,
    ) -> Any:
        writer = self._writer
        try:
            # redis-py would disconnect before we can tell whether the transport was closed: we do it after
            return await super().read_response(
                disable_decoding, timeout, disconnect_on_error=False, push_request=push_request
            )
        except ResponseError:
            raise  # the server's answer to the command: the connection is sound
        except BaseException as exc:
            closed = isinstance(exc, (AttributeError, TypeError)) and (writer is not self._writer or _closed(writer))
            if disconnect_on_error:
                await self.disconnect(nowait=True)
            if closed:
                raise RedisConnectionError(
                    f"connection to {self._host_error()} closed under the read: {exc!r}"
                ) from exc
            raise


_HIREDIS_PACKER = HiredisRespSerializer()


class _PackedByHiredis(AbstractConnection):
    """Commands packed in C by hiredis, as redis-py's own sync client packs them when hiredis is installed.

    The asyncio client packs in Python and joins its whole buffer again for every argument: a read's
    100-key MGET spent a tenth of its CPU there, a sync's script call of 500 items more. For the str,
    bytes, int and float arguments the service passes, the bytes are the same (tests/test_clients.py),
    text in UTF-8 (the default; hiredis knows no other); a bool or None is a DataError either way.
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        if not HIREDIS_AVAILABLE:  # no hiredis, or one older than redis-py supports: redis-py's own packing
            return super().pack_command(*args)
        packed: list[bytes] = _HIREDIS_PACKER.pack(*args)
        return packed


class _GuardedConnection(_ClosedTransportIsConnectionError, _PackedByHiredis, Connection):
    pass


class _GuardedSSLConnection(_ClosedTransportIsConnectionError, _PackedByHiredis, SSLConnection):
    pass


class _GuardedUnixDomainSocketConnection(
    _ClosedTransportIsConnectionError, _PackedByHiredis, UnixDomainSocketConnection
):
    pass


# the class redis-py picks for a URL's scheme (redis://, rediss://, unix://) -> ours
_GUARDED: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: _GuardedConnection,
    SSLConnection: _GuardedSSLConnection,
    UnixDomainSocketConnection: _GuardedUnixDomainSocketConnection,
}
_GUARDED_NODE: dict[type[Connection], type[Connection]] = {
    Connection: _GuardedConnection,
    SSLConnection: _GuardedSSLConnection,
}


def connect_redis(settings: Settings) -> RedisClient:
    common = dict(
        socket_timeout=settings.redis_socket_timeout_seconds,
        socket_connect_timeout=settings.redis_socket_timeout_seconds,
        health_check_interval=30,
        client_name=f"progress-service:{settings.pod_name}",  # visible in CLIENT LIST
    )
    if settings.redis_cluster:
        # REDIS_URL names any node; the client discovers the others. max_connections is per node.
        # No retry: redis-py retries a cluster pipeline by closing every connection of every node,
        # which fails the healthy nodes' writes in flight too. A failed node's writes go to degraded
        # mode instead, and the topology is re-read before the next command (execute_by_node).
        cluster = RedisCluster.from_url(
            settings.redis_url, max_connections=settings.redis_max_connections, retry=Retry(NoBackoff(), 0), **common
        )
        # RedisCluster takes no connection class: it passes its own (plain or SSL) to every node it
        # makes, from one dict of node arguments; the node the URL names exists already
        guarded = _GUARDED_NODE[cluster.connection_kwargs["connection_class"]]
        cluster.connection_kwargs["connection_class"] = guarded
        for node in cluster.nodes_manager.startup_nodes.values():
            node.connection_class = guarded
        return cluster
    # as BlockingConnectionPool.from_url, which would put redis-py's class back for rediss:// and unix://
    options: dict[str, Any] = dict(
        # full pool: wait for a connection (a latency spike) rather than fail into degraded mode
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_socket_timeout_seconds,
        # One quick retry covers a pooled connection that went stale (Redis restarted); more would
        # hold every request of an outage for seconds instead of answering it.
        retry=Retry(NoBackoff(), 1),
        **common,
    )
    options.update(parse_url(settings.redis_url))  # the URL's own options win, as in from_url
    options["connection_class"] = _GUARDED[options.get("connection_class", Connection)]
    pool = BlockingConnectionPool(**options)
    return Redis.from_pool(pool)  # the client owns the pool and closes it


class NotReplicated(RedisError):
    """WAIT heard from fewer replicas than asked: these writes could die with their master."""


async def execute_by_node(
    redis: RedisClient,
    commands: Sequence[tuple[object, ...]],
    *,
    key_index: int,
    wait_replicas: int = 0,
    wait_timeout_ms: int = 0,
) -> list[object]:
    """Send commands in one round trip per node; each result is its reply or its own exception.

    On a cluster, a pipeline per node rather than one cluster pipeline: redis-py fails a whole cluster
    pipeline when one node is unreachable, and only the commands of that node's slots should fail
    (they go to degraded mode; the others' heartbeats stay on Redis). `key_index` locates a key of
    each command; all its keys share that key's slot. With `wait_replicas`, each node's commands are
    followed by WAIT, and those not confirmed by that many replicas fail with NotReplicated.
    """
    groups: list[tuple[ClusterNode | None, list[int]]] = [(None, list(range(len(commands))))]
    if isinstance(redis, RedisCluster):
        try:
            await redis.initialize()  # a no-op once the topology is known; re-reads it after a failure
            by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
            for i, args in enumerate(commands):
                node = _node_of(redis, args[key_index])
                by_node.setdefault(node.name, (node, []))[1].append(i)
        except RedisClusterException as exc:
            # no node answers, or a slot has no master during a failover: the callers' "Redis is down"
            raise RedisConnectionError(f"Redis Cluster unavailable: {exc}") from exc
        groups = list(by_node.values())
    sent = await asyncio.gather(
        *(
            _pipeline(redis, [commands[i] for i in group], node, wait_replicas, wait_timeout_ms)
            for node, group in groups
        ),
        return_exceptions=True,
    )
    results: list[object] = [None] * len(commands)
    for (_, group), outcome in zip(groups, sent, strict=True):
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome  # cancelled: not a failure of that node
        if isinstance(outcome, RedisClusterException):
            # no node for a slot, a cluster that cannot be reached: not a RedisError, yet the same weather
            outcome = RedisConnectionError(f"Redis Cluster unavailable: {outcome}")
        for position, i in enumerate(group):
            results[i] = outcome if isinstance(outcome, Exception) else outcome[position]
    if isinstance(redis, RedisCluster) and any(isinstance(result, REDIS_UNAVAILABLE) for result in results):
        # as redis-py does after a failed single command: read the topology again before the next
        # one, which is how the replica promoted in a failover is found
        redis._initialize = True
    return results


async def get_many(redis: RedisClient, keys: Sequence[str]) -> list[bytes | str | None]:
    """The values of `keys`, in order: one MGET on a server; on a cluster, where a MGET must stay in
    one slot, a GET per key in one pipeline per node (still one round trip per node, all at once)."""
    if not isinstance(redis, RedisCluster):
        values: list[bytes | str | None] = await redis.mget(keys)
        return values
    results = await execute_by_node(redis, [("GET", key) for key in keys], key_index=1)
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results  # type: ignore[return-value]


async def ping(redis: RedisClient) -> None:
    """Raise unless Redis answers: on a cluster, every master (each holds a share of the heartbeats)."""
    if isinstance(redis, RedisCluster):
        await redis.ping(target_nodes=RedisCluster.PRIMARIES)  # redis-py would ask one node only
    else:
        await redis.ping()


def same_slot_prefix(key: str) -> str:
    """A prefix for keys that must share `key`'s hash slot (a script touching both runs on a cluster).

    A key without a hash tag is hashed whole, so `{key}` hashes like it; a key with a tag keeps it.
    """
    start = key.find("{")
    end = key.find("}", start + 1)
    if start != -1 and end > start + 1:
        return key
    return "{" + key + "}"


async def _node_pipeline(
    redis: RedisCluster, node: ClusterNode, commands: Sequence[tuple[object, ...]]
) -> list[object]:
    """Commands already grouped by node, as one pipeline on one of its connections.

    The node's own pipeline call rather than a cluster pipeline: that one works out every command's
    slot and node again, and costs the request path about half again as much client CPU.
    """
    stack = [PipelineCommand(i, *args) for i, args in enumerate(commands)]
    await node.execute_pipeline(stack)  # each command's reply, or its error, in .result
    results: list[object] = [command.result for command in stack]
    for i, result in enumerate(results):
        if isinstance(result, (MovedError, AskError, TryAgainError)):
            # its slot moved (resharding, failover): redis-py follows the redirection for this command
            try:
                results[i] = await redis.execute_command(*commands[i])  # type: ignore[arg-type]
            except RedisError as exc:
                results[i] = exc
            except RedisClusterException as exc:  # not a RedisError: callers know "Redis is down" by that
                results[i] = RedisConnectionError(f"Redis Cluster unavailable: {exc}")
    return results


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


async def _pipeline(
    redis: RedisClient,
    commands: Sequence[tuple[object, ...]],
    node: ClusterNode | None,
    wait_replicas: int,
    wait_timeout_ms: int,
) -> list[object]:
    # WAIT counts the replicas that have every write of its connection: it goes last, on the same one
    wait = [("WAIT", wait_replicas, wait_timeout_ms)] if wait_replicas else []
    results: list[object]
    if node is None:
        async with redis.pipeline(transaction=False) as pipe:
            for args in [*commands, *wait]:
                pipe.execute_command(*args)  # type: ignore[arg-type]
            results = await pipe.execute(raise_on_error=False)
    else:
        assert isinstance(redis, RedisCluster)
        results = await _node_pipeline(redis, node, [*commands, *wait])
    if wait_replicas:
        confirmed = results.pop()
        if not isinstance(confirmed, int) or confirmed < wait_replicas:
            error = NotReplicated(f"{confirmed!r} of {wait_replicas} replicas confirmed in {wait_timeout_ms} ms")
            results = [result if isinstance(result, Exception) else error for result in results]
    return results


def statement_timeouts(*, statement_timeout_s: float, lock_timeout_s: float) -> dict[str, str]:
    """statement_timeout and lock_timeout as Postgres settings (ms); a 0 is left to the server (or the role)."""
    wanted = {"statement_timeout": statement_timeout_s, "lock_timeout": lock_timeout_s}
    return {name: f"{max(1, round(seconds * 1000))}" for name, seconds in wanted.items() if seconds > 0}


def local_timeouts_sql(*, statement_timeout_s: float, lock_timeout_s: float) -> str:
    """SET LOCAL of both timeouts, for the transaction of one statement: it holds behind PgBouncer in
    transaction mode too, where startup parameters are refused and a session SET would stay behind."""
    timeouts = statement_timeouts(statement_timeout_s=statement_timeout_s, lock_timeout_s=lock_timeout_s)
    return "; ".join(f"SET LOCAL {name} = {ms}" for name, ms in timeouts.items())


class _PoolConnection(asyncpg.Connection):  # type: ignore[misc]  # asyncpg ships no types here
    """A pooled connection that can go back to the pool without the reset query, when told its use took no state."""

    __slots__ = ("_stateless_use",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stateless_use = False

    def took_no_session_state(self) -> None:
        self._stateless_use = True

    def reset_needed(self) -> bool:
        needed, self._stateless_use = not self._stateless_use, False
        return needed


async def _reset_session(conn: asyncpg.Connection) -> None:
    # asyncpg has rolled back an open transaction before this runs; the reset query (advisory locks,
    # LISTEN, cursors, SET) is a second round trip, skipped only after fetch_stateless
    if isinstance(conn, _PoolConnection) and not conn.reset_needed():
        return
    query = conn.get_reset_query()  # empty on a server without any of those (asyncpg's own check)
    if query:
        await conn.execute(query)


async def fetch_stateless(
    pool: asyncpg.Pool, statements: Sequence[tuple[str, Sequence[object]]], *, timeout_s: float | None = None
) -> list[list[asyncpg.Record]]:
    """pool.fetch of each statement in turn, on one connection, for statements that leave no session state
    behind (no SET, LISTEN, cursor or lock); the first that fails raises, and the rest do not run.

    The connection is waited for `timeout_s` at most (None: the pool's own deadline), then TimeoutError.
    It goes back without the reset query: one round trip per statement, not one more. Any other use of
    the pool, an error here included, still resets the session on release.
    """
    async with pool.acquire(timeout=timeout_s) as conn:
        answers: list[list[asyncpg.Record]] = [await conn.fetch(query, *args) for query, args in statements]
        mark = getattr(conn, "took_no_session_state", None)  # a pool not made by create_db_pool: reset as usual
        if mark is not None:
            mark()
    return answers


class _DeadlinePool(asyncpg.Pool):  # type: ignore[misc]  # asyncpg ships no types here
    """A pool whose every acquire has a deadline: the caller's, else the pool's.

    Without one, a caller waits in the pool's queue for as long as the connections ahead of it are held
    (by statements waiting on a migration's lock, say), and pool.fetch() and the like give none. Past
    it the acquire raises TimeoutError, which POSTGRES_UNAVAILABLE counts: the caller's work waits.
    """

    __slots__ = ("_acquire_timeout_s",)

    def __init__(self, *args: Any, acquire_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acquire_timeout_s = acquire_timeout_s

    def acquire(self, *, timeout: float | None = None) -> Any:
        return super().acquire(timeout=self._acquire_timeout_s if timeout is None else timeout)


async def create_db_pool(settings: Settings) -> asyncpg.Pool:
    # Startup parameters hold for every statement of every connection. PgBouncer in transaction mode
    # refuses them ("unsupported startup parameter"): there DATABASE_TIMEOUTS_AT_CONNECT=false and the
    # role carries them (ALTER ROLE ... SET statement_timeout ...); the flush sets its own per transaction.
    timeouts = statement_timeouts(
        statement_timeout_s=settings.database_statement_timeout_seconds,
        lock_timeout_s=settings.database_lock_timeout_seconds,
    )
    server_settings = timeouts if settings.database_timeouts_at_connect else None
    # what asyncpg.create_pool does (it takes no pool class), with asyncpg's defaults for what is not set here
    pool: asyncpg.Pool = await _DeadlinePool(
        settings.database_url,
        acquire_timeout_s=settings.database_pool_acquire_timeout_seconds,
        min_size=settings.database_pool_min_size,
        max_size=settings.database_pool_max_size,
        max_queries=50_000,
        max_inactive_connection_lifetime=300.0,
        setup=None,
        init=None,
        loop=None,
        record_class=asyncpg.Record,
        command_timeout=settings.database_command_timeout_seconds,
        timeout=settings.database_connect_timeout_seconds,
        statement_cache_size=settings.database_statement_cache_size,
        server_settings=server_settings,
        connection_class=_PoolConnection,
        reset=_reset_session,
    )
    return pool
