"""Fixtures of the trial-journey email tests: clean tables, statements counted for real, the relay on a stream."""

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from redis.asyncio import Redis

from service.compose import email_route
from service.config import Settings
from service.outbox.relay import Relay
from service.outbox.stream_publisher import StreamPublisher
from tests.helpers import Statements


@pytest.fixture
async def trials_db(db: asyncpg.Pool) -> asyncpg.Pool:
    await db.execute("TRUNCATE trials_usertrial, emails_emaildispatch RESTART IDENTITY CASCADE")
    return db


@pytest.fixture
async def stream(trials_db: asyncpg.Pool, redis: Redis, settings: Settings) -> AsyncIterator[str]:
    """The relay, the only publisher, sending the email outbox to the stream named here, in the background.

    It polls once an hour: what it sends within seconds, it was woken for by a reservation's NOTIFY.
    """
    woken_only = settings.model_copy(update={"relay_poll_interval_seconds": 3600, "relay_listen": True})
    route = email_route(woken_only, StreamPublisher(redis, settings.email_queue_stream))
    stop = asyncio.Event()
    relay = asyncio.create_task(Relay(woken_only.relay, trials_db, [route]).run(stop))
    try:
        yield settings.email_queue_stream
    finally:
        stop.set()
        await asyncio.wait_for(relay, timeout=10)


@pytest.fixture
async def counted(migrated: str, trials_db: asyncpg.Pool) -> AsyncIterator[tuple[asyncpg.Pool, Statements]]:
    """A pool on the real database whose every statement is recorded.

    What is not the code's own is left out: asyncpg introspects the array types once per connection
    (done here before logging starts), and the pool's default reset on release (RESET ALL, ...) is
    replaced by a no-op.
    """
    statements = Statements()

    async def log_statements(conn: asyncpg.Connection) -> None:
        await conn.fetch("SELECT $1::bigint[], $2::text[]", [1], ["warm-up"])
        conn.add_query_logger(lambda record: statements.sql.append(record.query))

    async def no_reset(conn: asyncpg.Connection) -> None:
        return None

    pool = await asyncpg.create_pool(migrated, min_size=1, max_size=2, init=log_statements, reset=no_reset)
    try:
        yield pool, statements
    finally:
        await pool.close()
