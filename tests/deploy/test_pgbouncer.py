"""The flusher behind PgBouncer in transaction pooling mode, over TLS, as ops run it in front of the
monolith's Postgres: DATABASE_STATEMENT_CACHE_SIZE=0 and a verify-full DATABASE_URL."""

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.auth import make_token
from service.clients import connect_redis, create_db_pool
from service.config import Settings
from service.progress.content import CONTENT_KINDS
from service.progress.flusher import Flusher
from tests.conftest import auth, seed
from tests.deploy.conftest import PgBouncer, Tls

USERS = CONTENTS = 3


async def _send_heartbeats(client: httpx.AsyncClient, settings: Settings, position: float) -> int:
    sent = 0
    for user_id in range(1, USERS + 1):
        token = make_token(settings, user_id)
        for kind in CONTENT_KINDS:
            for content_id in range(1, CONTENTS + 1):
                response = await client.post(kind.path, json={kind.id_column: content_id, "position": position},
                                             headers=auth(token))  # fmt: skip
                assert response.status_code == 201
                sent += 1
    return sent


async def test_flusher_writes_through_pgbouncer_in_transaction_mode_over_tls(
    settings: Settings, client: httpx.AsyncClient, db: asyncpg.Pool, redis: Redis, pgbouncer: PgBouncer, tls: Tls
) -> None:
    await seed(db, users=USERS, contents=CONTENTS, duration_s=600)
    through_pgbouncer = settings.model_copy(update={
        "database_url": pgbouncer.url(sslmode="verify-full", sslrootcert=str(tls.ca)),
        "database_statement_cache_size": 0,
        "database_pool_max_size": 6,  # more clients than PgBouncer's 2 server connections
        "progress_flush_batch_size": 5,  # many transactions, interleaved by the flusher's concurrency
    })  # fmt: skip
    pool = await create_db_pool(through_pgbouncer)
    flusher_redis = connect_redis(through_pgbouncer)
    try:
        flusher = Flusher(redis=flusher_redis, pool=pool, settings=through_pgbouncer)
        for position in (100.0, 595.0):  # the second round completes every content (duration 600, margin 10)
            sent = await _send_heartbeats(client, settings, position)
            result = await flusher.flush_cycle()
            assert (result.written, result.failed_batches, result.dropped) == (sent, 0, 0)
    finally:
        await pool.close()
        await flusher_redis.aclose()

    for kind in CONTENT_KINDS:
        rows = await db.fetch(f"SELECT position, completed_at FROM {kind.progress_table}")
        assert len(rows) == USERS * CONTENTS
        assert all(row["position"] == 595.0 and row["completed_at"] is not None for row in rows)
    events = await db.fetchval("SELECT count(*) FROM progress_completion_event")
    assert events == USERS * CONTENTS * len(CONTENT_KINDS)


async def test_pgbouncer_refuses_clients_without_tls(pgbouncer: PgBouncer) -> None:
    with pytest.raises((asyncpg.PostgresError, ConnectionError)):
        await asyncpg.connect(pgbouncer.url(sslmode="disable"))


@pytest.mark.parametrize("statement_cache_size", [100, 0])
async def test_statement_cache_is_what_breaks_transaction_pooling(
    pgbouncer: PgBouncer, tls: Tls, statement_cache_size: int
) -> None:
    """A cached prepared statement lives on the server connection that prepared it; in transaction
    mode the client's next transaction may get another one."""
    url = pgbouncer.url(sslmode="verify-full", sslrootcert=str(tls.ca))
    client = await asyncpg.connect(url, statement_cache_size=statement_cache_size)
    other = await asyncpg.connect(url, statement_cache_size=0)
    try:
        assert await client.fetchval("SELECT $1::int + 1", 1) == 2
        # PgBouncer hands out the most recently used server connection: the one holding the statement
        async with other.transaction():
            await other.execute("SELECT 1")
            if statement_cache_size:
                with pytest.raises(asyncpg.InvalidSQLStatementNameError):
                    await client.fetchval("SELECT $1::int + 1", 2)
            else:
                assert await client.fetchval("SELECT $1::int + 1", 2) == 3
    finally:
        await client.close()
        await other.close()
