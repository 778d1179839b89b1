"""The flusher behind PgBouncer in transaction pooling mode, over TLS, as ops run it in front of the
monolith's Postgres: DATABASE_STATEMENT_CACHE_SIZE=0 and a verify-full DATABASE_URL."""

import asyncio
import json

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.auth import make_token
from service.compose import completion_route
from service.config import Settings
from service.outbox.celery_publisher import CeleryPublisher
from service.outbox.relay import Relay
from service.postgres import create_db_pool, local_timeouts_sql
from service.progress.content import CONTENT_KINDS
from service.progress.flush.flusher import Flusher
from service.redis_client import connect_redis
from tests.helpers import PgBouncer, Tls, auth, seed
from tests.monolith.fixtures import Broker, Executions

pytestmark = pytest.mark.slow  # a real PgBouncer, installed on first use

USERS = CONTENTS = 3


async def _send_heartbeats(client: httpx.AsyncClient, settings: Settings, position: float) -> int:
    sent = 0
    for user_id in range(1, USERS + 1):
        token = make_token(settings, user_id)
        for kind in CONTENT_KINDS:
            for content_id in range(1, CONTENTS + 1):
                response = await client.post(
                    kind.path, json={kind.id_column: content_id, "position": position}, headers=auth(token)
                )
                assert response.status_code == 201
                sent += 1
    return sent


async def test_flusher_writes_through_pgbouncer_in_transaction_mode_over_tls(
    settings: Settings, client: httpx.AsyncClient, db: asyncpg.Pool, redis: Redis, pgbouncer: PgBouncer, tls: Tls
) -> None:
    await seed(db, users=USERS, contents=CONTENTS, duration_s=600)
    through_pgbouncer = settings.model_copy(
        update={
            "database_url": pgbouncer.url(sslmode="verify-full", sslrootcert=str(tls.ca)),
            "database_statement_cache_size": 0,
            "database_timeouts_at_connect": False,  # PgBouncer refuses them as startup parameters
            "database_pool_max_size": 6,  # more clients than PgBouncer's 2 server connections
            "progress_flush_batch_size": 5,  # many transactions, interleaved by the flusher's concurrency
        }
    )
    pool = await create_db_pool(through_pgbouncer.database)
    flusher_redis = connect_redis(through_pgbouncer.redis)
    try:
        flusher = Flusher(through_pgbouncer.flush, flusher_redis, pool)
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


async def test_pgbouncer_refuses_the_timeouts_at_connect_and_the_flush_sets_them_per_transaction(
    settings: Settings, pgbouncer: PgBouncer, tls: Tls
) -> None:
    """Why DATABASE_TIMEOUTS_AT_CONNECT=false behind PgBouncer, and what still holds there."""
    through_pgbouncer = settings.model_copy(
        update={
            "database_url": pgbouncer.url(sslmode="verify-full", sslrootcert=str(tls.ca)),
            "database_statement_cache_size": 0,
            "database_statement_timeout_seconds": 7,
            "database_lock_timeout_seconds": 0.5,
        }
    )
    refused = await create_db_pool(through_pgbouncer.database)
    try:
        with pytest.raises(asyncpg.ProtocolViolationError, match="unsupported startup parameter"):
            await refused.fetchval("SELECT 1")
    finally:
        await refused.close()
    pool = await create_db_pool(through_pgbouncer.model_copy(update={"database_timeouts_at_connect": False}).database)
    try:
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(local_timeouts_sql(statement_timeout_s=7, lock_timeout_s=0.5))
            timeouts = (await conn.fetchval("SHOW statement_timeout"), await conn.fetchval("SHOW lock_timeout"))
            assert timeouts == ("7s", "500ms")
        # LOCAL: the server connection PgBouncer hands to the next transaction is as it was
        assert await pool.fetchval("SHOW lock_timeout") == "0"
    finally:
        await pool.close()


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


async def test_the_relay_behind_pgbouncer_listens_on_its_direct_url_and_otherwise_polls(
    settings: Settings,
    db: asyncpg.Pool,
    redis: Redis,
    pgbouncer: PgBouncer,
    tls: Tls,
    broker: Broker,
    executions: Executions,
) -> None:
    await seed(db, users=2, contents=1, duration_s=600)
    through_pgbouncer = settings.model_copy(
        update={
            "database_url": pgbouncer.url(sslmode="verify-full", sslrootcert=str(tls.ca)),
            "database_statement_cache_size": 0,
            "database_timeouts_at_connect": False,
            "celery_broker_url": broker.url,
            "relay_enabled": True,
            # a poll a minute: only a notification can bring the event out within seconds
            "relay_poll_interval_seconds": 60,
            "relay_listen_database_url": settings.database_url,
        }
    )
    polling = through_pgbouncer.model_copy(update={"relay_listen": False, "relay_poll_interval_seconds": 0.3})
    for user_id, relay_settings in ((1, through_pgbouncer), (2, polling)):
        pool = await create_db_pool(relay_settings.database)
        publisher = CeleryPublisher(relay_settings.relay)
        stop = asyncio.Event()
        relay = asyncio.create_task(
            Relay(relay_settings.relay, pool, [completion_route(relay_settings, publisher)]).run(stop)
        )
        try:
            await asyncio.sleep(0.5)  # past the relay's first pass
            # as the flush writes it, through PgBouncer: the NOTIFY goes out at its commit
            await pool.execute(
                "WITH e AS (INSERT INTO progress_completion_event (content_type, content_id, user_id, completed_at) "
                "VALUES ('lesson', 1, $1, now()) RETURNING 1) SELECT pg_notify('progress_outbox', 'completion')",
                user_id,
            )
            rows = await executions.wait_for(user_id, timeout_s=5, settle_s=0)
            assert [json.loads(row["kwargs"])["user_id"] for row in rows] == list(range(1, user_id + 1))
        finally:
            stop.set()
            await relay
            await pool.close()
            await asyncio.to_thread(publisher.close)
