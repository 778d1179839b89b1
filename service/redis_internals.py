"""What the service reaches into redis-py for, each in one small place with the upstream issue it works around.

redis-py is pinned below its next major (pyproject.toml); tests/test_redis_internals.py fails if a release
moves what is touched here, before any behaviour test has to find out. Drop a piece once its upstream
fix is released and the pin allows it.

- the connection classes: a write or read on a transport that closed under it raises redis's
  ConnectionError, not AttributeError/TypeError (redis-py #4287, #3546); commands packed by hiredis
  in C, as the sync client does (redis-py #4176, fix proposed in #4191);
- RedisCluster takes no connection class: ours is set in its node arguments (redis-py #3558);
- a cluster pipeline per node, not one cluster pipeline that one dead node fails whole (redis-py
  #2224, #3130), and a topology re-read before the next command after a node failed, as redis-py does
  after a single command;
- a pipeline's round trip under one deadline, not one per reply (`round_trip`): redis-py's pipeline
  arms and cancels a timer for every reply it reads.
"""

import asyncio
import math
from collections.abc import Iterable, Sequence
from typing import Any

from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

if HIREDIS_AVAILABLE:
    import hiredis


def _closed(writer: asyncio.StreamWriter | None) -> bool:
    return writer is None or writer.transport is None or writer.transport.is_closing()


class _ClosedTransportIsConnectionError(AbstractConnection):
    """A call on a connection whose transport closed under it fails with redis's ConnectionError.

    Two ways the transport goes raise errors that are not a RedisError (redis-py #4287, #3546): a disconnect
    from another task while a write is pending (the cluster client closes every connection on CLUSTERDOWN,
    in a failover: "'NoneType' object has no attribute 'writelines'"), and, on CPython 3.12+, a transport
    the peer reset. redis-py retries neither, and the request path would answer 500 instead of going to
    degraded mode. Only those are converted, after the connection is dropped: an AttributeError or
    TypeError while the transport is open is a bug, and goes up as it is.
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
    bytes, int and float arguments the service passes, the bytes are the same (tests/test_redis_internals.py),
    text in UTF-8 (the default; hiredis knows no other); a bool or None is a DataError either way. A command
    whose name is letters alone (MGET, EVALSHA) goes to hiredis as it is: redis-py's serializer would only split its
    name and copy its arguments in a Python pass first.
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        if not HIREDIS_AVAILABLE:  # no hiredis, or one older than redis-py supports: redis-py's own packing
            return super().pack_command(*args)
        if type(args[0]) is str and args[0].isalpha():  # a name of letters alone: nothing for redis-py to split
            try:
                return [hiredis.pack_command(args)]
            except TypeError:  # a bytearray, which the serializer makes bytes; a bool or None, which it
                pass  # refuses as redis-py does (DataError)
        packed: list[bytes] = _HIREDIS_PACKER.pack(*args)
        return packed


# the class redis-py picks for a URL's scheme (redis://, rediss://, unix://) -> ours
GUARDED: dict[type[AbstractConnection], type[AbstractConnection]] = {
    base: type(f"_Guarded{base.__name__}", (_ClosedTransportIsConnectionError, _PackedByHiredis, base), {})
    for base in (Connection, SSLConnection, UnixDomainSocketConnection)
}


def guard_cluster_connections(cluster: RedisCluster) -> None:
    """Our connection class on every node `cluster` makes: it passes its own (plain or SSL) to each node
    from one dict of node arguments, and the node the URL names exists already (redis-py #3558)."""
    guarded = GUARDED[cluster.connection_kwargs["connection_class"]]  # plain or SSL: a cluster has no unix://
    cluster.connection_kwargs["connection_class"] = guarded
    for node in cluster.nodes_manager.startup_nodes.values():
        node.connection_class = guarded  # type: ignore[assignment]


def topology_is_stale(cluster: RedisCluster) -> None:
    """Read the topology again before the next command, as redis-py does after a failed single command:
    how the replica promoted in a failover is found when a pipeline, not a command, failed."""
    cluster._initialize = True


async def round_trip(connection: AbstractConnection, commands: Sequence[tuple[object, ...]]) -> list[object]:
    """`commands` in one write on `connection` and their raw replies, each its value or its own error reply (a
    ResponseError: NOSCRIPT, MOVED...); any other failure goes up, and drops the connection (redis-py's send and
    read do), since replies may still be on the way.

    What redis-py's pipeline does, but with one deadline, the socket timeout, for the whole round trip (the
    write, every reply, and on a cluster node the connect): its pipeline arms and cancels a timer for every
    reply, a third of a heartbeat's Redis client CPU. A lost connection is tried again as the connection's retry
    policy says (once on a server: a pooled connection gone stale); a deadline passed is not, so a stalled Redis
    sends the turn to degraded mode after one socket timeout, not two.
    """

    async def once() -> list[object]:
        async with asyncio.timeout(connection.socket_timeout):
            await connection.send_packed_command(connection.pack_commands(commands))  # type: ignore[arg-type]
            replies: list[object] = []
            for _ in commands:
                try:
                    reply = await connection.read_response(timeout=math.inf)  # the deadline is the one above
                except ResponseError as exc:
                    reply = exc
                if reply is None and _closed(connection._writer):
                    # read_response answers None, not an error, for a TimeoutError out of the socket (ETIMEDOUT)
                    await connection.disconnect(nowait=True)
                    raise RedisConnectionError(f"connection to {connection._host_error()} lost")
                replies.append(reply)
            return replies

    try:
        replies: list[object] = await connection.retry.call_with_retry(once, lambda _: connection.disconnect())
    except TimeoutError:
        raise RedisTimeoutError(
            f"{connection._host_error()} did not answer within {connection.socket_timeout} s"
        ) from None
    return replies


async def node_pipeline(node: ClusterNode, commands: Sequence[tuple[object, ...]]) -> list[object]:
    """Commands of one node's slots in one round trip on one of its connections; each reply or its error.

    The node's own connection rather than a cluster pipeline: that one works out every command's slot and
    node again (about half again the request path's client CPU), and one unreachable node fails all of it.
    """
    connection = node.acquire_connection()
    try:
        await node.disconnect_if_needed(connection)  # marked for a reconnect (a maintenance notification)
        return await round_trip(connection, commands)
    finally:
        node.release(connection)
