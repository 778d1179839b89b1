"""The Redis connections' own packing (hiredis, in C) against redis-py's asyncio packing: the same bytes."""

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import DataError
from redis.utils import HIREDIS_AVAILABLE

from service.clients import connect_redis
from service.config import Settings


# every kind of connection the service makes (plain, TLS, unix socket) is made of the same packing class;
# packing needs no server
def connection_for(url: str) -> AbstractConnection:
    client = connect_redis(Settings(redis_url=url))
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
    for command in ("EVALSHA", b"MGET", "CLIENT SETNAME"):
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
