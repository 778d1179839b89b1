"""Fixtures of the trial-journey email tests: clean tables, trials to seed, statements counted for real."""

from collections.abc import AsyncIterator

import asyncpg
import pytest
from redis.asyncio import Redis

from service.config import Settings
from service.trial_emails.queue import RedisStreamQueue
from tests.helpers import Statements


@pytest.fixture
async def trials_db(db: asyncpg.Pool) -> asyncpg.Pool:
    await db.execute("TRUNCATE trials_usertrial, emails_emaildispatch RESTART IDENTITY CASCADE")
    return db


@pytest.fixture
def queue(redis: Redis, settings: Settings) -> RedisStreamQueue:
    return RedisStreamQueue(redis, settings.email_queue_stream)


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
