"""Fixtures of the trial-journey email tests: clean tables, trials to seed, statements counted for real."""

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypedDict

import asyncpg
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from service.config import Settings
from service.trial_emails.queue import RedisStreamQueue


@pytest.fixture
async def trials_db(db: asyncpg.Pool) -> asyncpg.Pool:
    await db.execute("TRUNCATE trials_usertrial, emails_emaildispatch RESTART IDENTITY CASCADE")
    return db


@pytest.fixture
def queue(redis: Redis, settings: Settings) -> RedisStreamQueue:
    return RedisStreamQueue(redis, settings.email_queue_stream)


@dataclass
class Statements:
    """Every statement the pool's connections sent, as asyncpg's query logger saw it."""

    sql: list[str] = field(default_factory=list)

    async def settled(self) -> list[str]:
        await asyncio.sleep(0)  # the logger runs in a call_soon after each statement
        return self.sql


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


class Window(TypedDict):
    started_at: datetime
    ends_at: datetime


async def add_trials(
    db: asyncpg.Pool, count: int, *, started_at: datetime, ends_at: datetime, first_user: int = 1
) -> list[int]:
    """Users first_user.. with one trial each; returns the trial ids."""
    last_user = first_user + count - 1
    await db.execute(
        "INSERT INTO users_user (id, email) SELECT i, 'user' || i || '@example.com' "
        "FROM generate_series($1::bigint, $2::bigint) i",
        first_user, last_user,
    )  # fmt: skip
    rows = await db.fetch(
        "INSERT INTO trials_usertrial (user_id, started_at, ends_at) "
        "SELECT i, $3, $4 FROM generate_series($1::bigint, $2::bigint) i ORDER BY i RETURNING id",
        first_user, last_user, started_at, ends_at,
    )  # fmt: skip
    return sorted(row["id"] for row in rows)


async def stream_entries(redis: Redis, stream: str) -> list[dict[str, str]]:
    entries = await redis.xrange(stream) or []
    return [{str(name): str(value) for name, value in (fields or {}).items()} for _, fields in entries]


async def enqueued(redis: Redis, stream: str) -> Counter[tuple[int, str]]:
    """How many times each (user_id, email_key) was XADDed."""
    return Counter((int(entry["user_id"]), entry["email_key"]) for entry in await stream_entries(redis, stream))


async def reserved(db: asyncpg.Pool) -> set[tuple[int, str]]:
    rows = await db.fetch("SELECT user_id, email_key FROM emails_emaildispatch WHERE source = 'trial_journey'")
    return {(row["user_id"], row["email_key"]) for row in rows}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0
