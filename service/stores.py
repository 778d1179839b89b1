"""What "Redis is unavailable" and "Postgres is unavailable" mean, said once for the whole service.

Callers catch these tuples, never a client library's exceptions of their own choosing:
- `*_UNAVAILABLE`: the store is not there now (down, unreachable, failing over, a connection that
  died under a call). Expected weather: the work waits, degraded mode takes the heartbeat, the
  answer is 503 and nothing is lost.
- `POSTGRES_BUSY`: Postgres answered "not now": a statement cancelled past `statement_timeout`, or
  one that waited `lock_timeout` for a lock (a migration's). Among the unavailable: the work waits
  and is retried after backoff; the flush also halves its concurrency on it.
- `*_FAILED`: any failure of a call to the store, the above included (a full Redis, a refused
  statement). Whoever catches it must still give the work back; it may log a non-outage louder.

A closed transport does not always raise a library's own error: redis-py's `AttributeError`/`TypeError`
(redis-py #4287, #3546) becomes `ConnectionError` where it enters (`service.redis_internals`); asyncpg's
`InternalClientError` ("cannot switch to state ...") is counted as unavailable below.
"""

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from redis.exceptions import ClusterError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# A failover shows as ClusterDownError/TryAgain (ClusterError), an uncovered slot or a cluster that
# cannot be reached at all as RedisClusterException, which redis-py does not derive from RedisError.
REDIS_UNAVAILABLE: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    RedisClusterException,
    OSError,
)
REDIS_FAILED: tuple[type[Exception], ...] = (RedisError, *REDIS_UNAVAILABLE)

POSTGRES_BUSY: tuple[type[Exception], ...] = (
    asyncpg.LockNotAvailableError,  # lock_timeout (55P03)
    asyncpg.QueryCanceledError,  # statement_timeout, or an operator's pg_cancel_backend (57014)
)
POSTGRES_UNAVAILABLE: tuple[type[Exception], ...] = (
    *POSTGRES_BUSY,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.InterfaceError,  # the connection was closed or lost under the call
    asyncpg.exceptions.InternalClientError,  # a connection an outage left mid-operation
    OSError,
    TimeoutError,  # a pool that cannot connect, a statement past its deadline
)
POSTGRES_FAILED: tuple[type[Exception], ...] = (asyncpg.PostgresError, *POSTGRES_UNAVAILABLE)

log = logging.getLogger(__name__)


@asynccontextmanager
async def pooled_connection(pool: asyncpg.Pool, *, timeout_s: float | None = None) -> AsyncIterator[asyncpg.Connection]:
    """A connection of `pool` for one operation, whose outcome giving it back cannot change.

    asyncpg resets a connection as it takes it back, and a reset on a connection the server ended
    meanwhile (a shutdown's FATAL arrived after the statement's answer) fails; asyncpg then
    terminates the connection, so it is never handed out again. That failure is not the operation's:
    a statement that committed stays committed, and one that failed keeps its own error.
    """
    conn: asyncpg.Connection = await pool.acquire(timeout=timeout_s)
    try:
        yield conn
    finally:
        await give_back(pool, conn)


async def give_back(pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
    """`conn` back to `pool`; a failure there is not the operation's (pooled_connection): asyncpg has taken the
    connection back or closes it, and the failure is logged, not raised."""
    try:
        await pool.release(conn)
    except POSTGRES_FAILED as exc:
        log.info("a Postgres connection failed to go back to the pool and was closed (%s: %s)", type(exc).__name__, exc)
