"""What service/redis_internals.py touches in redis-py is still there, and does what the service expects.

Each test fails on a redis-py release that moved a private piece the service relies on, naming it;
the packing tests hold hiredis's bytes (in C) to redis-py's asyncio packing.
"""

import asyncio
import dataclasses
import inspect
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import DataError, NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

from service.config import Settings
from service.redis_client import connect_redis
from service.redis_internals import round_trip


# every kind of connection the service makes (plain, TLS, unix socket) is made of the same packing class;
# packing needs no server
def connection_for(url: str) -> AbstractConnection:
    client = connect_redis(Settings(redis_url=url).redis)
    assert isinstance(client, Redis)
    connection: AbstractConnection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    return connection


CONNECTIONS = [connection_for(url) for url in ("redis://127.0.0.1:1", "rediss://127.0.0.1:1", "unix:///nowhere.sock")]
ARGUMENTS = st.one_of(st.text(), st.binary(), st.integers(min_value=-(2**70), max_value=2**70), st.floats())


def packed(connection: AbstractConnection, args: tuple[Any, ...], *, by_redis_py: bool = False) -> bytes | str:
    pack = AbstractConnection.pack_command if by_redis_py else type(connection).pack_command
    try:
        return b"".join(bytes(chunk) for chunk in pack(connection, *args))
    except DataError:
        return "DataError"


def test_the_service_packs_commands_its_own_way() -> None:
    assert HIREDIS_AVAILABLE  # the hiredis redis[hiredis] brings; else the tests below compare redis-py with itself
    for connection in CONNECTIONS:
        assert type(connection).pack_command is not AbstractConnection.pack_command, type(connection)


@given(st.lists(ARGUMENTS, max_size=8))
def test_any_command_is_packed_as_redis_py_packs_it(args: list[Any]) -> None:
    for command in ("EVALSHA", b"MGET", "CLIENT SETNAME", "CLIENT\tSETNAME"):
        for connection in CONNECTIONS:
            assert packed(connection, (command, *args)) == packed(connection, (command, *args), by_redis_py=True)


@pytest.mark.parametrize(
    "args",
    [("MGET", *(f"progress:latest_position:lesson:{i}:7" for i in range(100))), ("SET", "k", b"x" * 10_000),
     ("SET", "k", memoryview(b"abc")), ("SET", "k", bytearray(b"abc")), ("SET", "k", True), ("SET", "k", None),
     ("SET", "k", 1e22), ("SET", "k", -0.0), ("SET", "k", float("inf")), ("SET", "k", 2**64), ("SET", "é", "é")],
)  # fmt: skip
def test_edge_commands_are_packed_as_redis_py_packs_them(args: tuple[Any, ...]) -> None:
    assert packed(CONNECTIONS[0], args) == packed(CONNECTIONS[0], args, by_redis_py=True)


def test_the_connection_methods_overridden_keep_their_shape() -> None:
    # _ClosedTransportIsConnectionError: every write goes through _send_packed_command when a socket
    # timeout is set, on the StreamWriter in _writer; read_response takes disconnect_on_error
    assert list(inspect.signature(AbstractConnection._send_packed_command).parameters) == ["self", "command"]
    read = inspect.signature(AbstractConnection.read_response).parameters
    assert {"disable_decoding", "timeout", "disconnect_on_error", "push_request"} <= read.keys()
    connection = CONNECTIONS[0]
    assert hasattr(connection, "_writer") and callable(connection._host_error)  # type: ignore[attr-defined]
    source = inspect.getsource(AbstractConnection.send_packed_command)
    assert "_send_packed_command" in source, "redis-py no longer writes through _send_packed_command"


def test_a_cluster_client_still_takes_its_nodes_connection_class_and_topology_flag_where_it_did() -> None:
    cluster = RedisCluster(host="127.0.0.1", port=1)
    assert "connection_class" in cluster.connection_kwargs  # guard_cluster_connections rewrites it
    assert all(hasattr(node, "connection_class") for node in cluster.nodes_manager.startup_nodes.values())
    assert cluster._initialize is True  # topology_is_stale sets it again after a failed node
    assert "self._initialize" in inspect.getsource(RedisCluster.execute_command)


def test_a_read_with_an_infinite_timeout_still_arms_no_timer_and_a_node_still_lends_its_connections() -> None:
    # round_trip: one deadline around the replies, each read with timeout=math.inf (no timer of its own)
    # and answers None, not an error, for a TimeoutError out of the socket: round_trip checks the transport then
    assert "math.inf" in inspect.getsource(AbstractConnection.read_response)
    assert "return None" in inspect.getsource(AbstractConnection.read_response)
    for method in ("acquire_connection", "disconnect_if_needed", "release"):  # node_pipeline's
        assert callable(getattr(ClusterNode, method, None)), method


async def test_a_round_trip_answers_each_command_in_order_its_error_reply_included(settings: Settings) -> None:
    client = connect_redis(settings.redis)
    assert isinstance(client, Redis)
    connection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    try:
        commands = [("SET", "rt:a", "1"), ("EVALSHA", "0" * 40, 0), ("GET", "rt:a"), ("INCR", "rt:n")]
        set_ok, no_script, value, count = await round_trip(connection, commands)
        assert (set_ok, value, count) == (b"OK", b"1", 1)
        assert isinstance(no_script, NoScriptError)  # that command's own answer; the others still ran
        assert await client.get("rt:n") == b"1"
    finally:
        await connection.disconnect()
        await client.delete("rt:a", "rt:n")
        await client.aclose()


async def test_a_stalled_server_fails_the_round_trip_at_its_one_deadline_and_drops_the_connection(
    settings: Settings,
) -> None:
    client = connect_redis(dataclasses.replace(settings.redis, socket_timeout_s=0.3))
    assert isinstance(client, Redis)
    connection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    await connection.connect()
    pauser = connect_redis(settings.redis)
    await pauser.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    try:
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await round_trip(connection, [("GET", "rt:x")] * 50)
        waited = time.monotonic() - started
        # the reads arm no timer of their own: without the round trip's deadline they would wait out the pause
        assert 0.3 <= waited < 1.2, waited
        assert not connection.is_connected  # replies may still come: nobody reads them on that connection
    finally:
        await asyncio.sleep(max(0.0, 1.6 - (time.monotonic() - started)))
        await connection.disconnect()
        await pauser.aclose()
        await client.aclose()
