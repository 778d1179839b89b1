"""The Postgres pool every process of the service holds, and the timeouts of its statements."""

from collections.abc import Sequence
from typing import Any

import asyncpg

from service.config import DatabaseSettings
from service.stores import give_back


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

    _stateless_use = False

    def took_no_session_state(self) -> None:
        self._stateless_use = True


async def _reset_session(conn: asyncpg.Connection) -> None:
    # asyncpg has rolled back an open transaction before this runs; the reset query (advisory locks,
    # LISTEN, cursors, SET) is a second round trip, skipped only after release_stateless
    if isinstance(conn, _PoolConnection) and conn._stateless_use:
        conn._stateless_use = False
        return
    if query := conn.get_reset_query():  # empty on a server without any of those (asyncpg's own check)
        await conn.execute(query)


async def fetch_stateless(
    pool: asyncpg.Pool, statements: Sequence[tuple[str, Sequence[object]]], *, timeout_s: float | None = None
) -> list[list[asyncpg.Record]]:
    """pool.fetch of each statement in turn, on one connection, for statements that leave no session state
    behind (no SET, LISTEN, cursor or lock); the first that fails raises, and the rest do not run.

    The connection is waited for `timeout_s` at most (None: the pool's own deadline), then TimeoutError.
    It goes back without the reset query (release_stateless): one round trip per statement, not one more.
    Any other use of the pool, an error here included, still resets the session on release.
    """
    conn = await pool.acquire(timeout=timeout_s)
    answers = await fetch_on(pool, conn, statements)
    await release_stateless(pool, conn)
    return answers


async def fetch_on(
    pool: asyncpg.Pool, conn: asyncpg.Connection, statements: Sequence[tuple[str, Sequence[object]]]
) -> list[list[asyncpg.Record]]:
    """Each statement in turn on `conn`, one of `pool`'s; the first that fails raises, once `conn` is back in the
    pool with the reset query (a failed statement may leave state behind). On success `conn` stays the caller's."""
    try:
        return [await conn.fetch(query, *args) for query, args in statements]
    except BaseException:
        await give_back(pool, conn)
        raise


async def release_stateless(pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
    """`conn` back to `pool` without the reset query, after statements that left no session state behind; a
    release that fails (the server ended the connection meanwhile) is logged, not the statements' (give_back)."""
    mark = getattr(conn, "took_no_session_state", None)  # a pool not made by create_db_pool: reset as usual
    if mark is not None:
        mark()
    await give_back(pool, conn)


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


# A wait for a pool connection (connecting one included) past which Postgres is unavailable to that caller; the
# reads and the syncs wait 1 s at most, degraded mode its request's deadline: only the loops wait this long
ACQUIRE_TIMEOUT_S = 5.0
# asyncpg waits 60 s for a new connection by default: a blackholed Postgres would stall a batch that long
CONNECT_TIMEOUT_S = 10.0
# the client's own bound on a statement; DATABASE_STATEMENT_TIMEOUT_SECONDS is the server's, and shorter
COMMAND_TIMEOUT_S = 30.0


async def create_db_pool(
    settings: DatabaseSettings,
    *,
    min_size: int = 0,  # 0: a pod starts (and serves heartbeats) while Postgres is still down
    acquire_timeout_s: float = ACQUIRE_TIMEOUT_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> asyncpg.Pool:
    # Startup parameters hold for every statement of every connection. PgBouncer in transaction mode
    # refuses them ("unsupported startup parameter"): there DATABASE_TIMEOUTS_AT_CONNECT=false and the
    # role carries them (ALTER ROLE ... SET statement_timeout ...); the flush sets its own per transaction.
    timeouts = statement_timeouts(
        statement_timeout_s=settings.statement_timeout_s, lock_timeout_s=settings.lock_timeout_s
    )
    server_settings = timeouts if settings.timeouts_at_connect else None
    # what asyncpg.create_pool does (it takes no pool class), with asyncpg's defaults for what is not set here
    pool: asyncpg.Pool = await _DeadlinePool(
        settings.url,
        acquire_timeout_s=acquire_timeout_s,
        min_size=min_size,
        max_size=settings.pool_max_size,
        max_queries=50_000,
        max_inactive_connection_lifetime=300.0,
        loop=None,
        record_class=asyncpg.Record,
        command_timeout=COMMAND_TIMEOUT_S,
        timeout=connect_timeout_s,
        statement_cache_size=settings.statement_cache_size,
        server_settings=server_settings,
        connection_class=_PoolConnection,
        reset=_reset_session,
    )
    return pool
