"""`progress-service status`: the numbers it prints are those the stores hold, and a store down says so."""

import asyncio
import json
import time

import asyncpg
import pytest
from redis.asyncio import Redis

from service.config import Settings
from service.dev.embedded import free_port
from service.status import gather_status
from tests.helpers import FLUSH_LEASE_S, Servers, flusher_env, run_status, seed, start_service_command, write

TYPES = ("lesson", "audio", "meditation", "live")


async def _seed_outboxes(db: asyncpg.Pool) -> None:
    """Completions: 3 owed (the oldest 120 s old), 2 parked, 1 published; emails: 1 owed (10 s), 1 parked,
    2 published."""
    await db.execute("""
        INSERT INTO progress_completion_event (content_type, content_id, user_id, completed_at, created_at,
                                               published_at, publish_failed_at, publish_error)
        VALUES ('lesson', 1, 1, now(), now() - interval '120 s', NULL, NULL, NULL),
               ('lesson', 2, 1, now(), now() - interval '5 s', NULL, NULL, NULL),
               ('audio', 1, 1, now(), now(), NULL, NULL, NULL),
               ('audio', 2, 1, now(), now() - interval '900 s', NULL, now(), 'refused'),
               ('live', 1, 1, now(), now() - interval '900 s', NULL, now(), 'refused'),
               ('live', 2, 1, now(), now() - interval '9000 s', now(), NULL, NULL)
    """)
    await db.execute("INSERT INTO users_user (id, email) VALUES (1, 'user1@example.com') ON CONFLICT DO NOTHING")
    await db.execute("""
        INSERT INTO emails_emaildispatch (id, user_id, source, email_key, sent_at, created_at)
        SELECT i, 1, 'trial_journey', 'day_' || i, now(), now() FROM generate_series(1, 4) i
    """)
    await db.execute("""
        INSERT INTO trial_email_outbox (dispatch_id, user_id, source, email_key, reserved_at, created_at,
                                        published_at, publish_failed_at, publish_error)
        VALUES (1, 1, 'trial_journey', 'day_1', now(), now() - interval '10 s', NULL, NULL, NULL),
               (2, 1, 'trial_journey', 'day_2', now(), now() - interval '600 s', NULL, now(), 'refused'),
               (3, 1, 'trial_journey', 'day_3', now(), now() - interval '600 s', now(), NULL, NULL),
               (4, 1, 'trial_journey', 'day_4', now(), now() - interval '600 s', now(), NULL, NULL)
    """)


async def test_status_json_counts_what_the_buffer_and_the_outboxes_hold(
    servers: Servers, redis: Redis, db: asyncpg.Pool
) -> None:
    await seed(db, users=3, contents=3)
    await db.execute("INSERT INTO audios_audio (id, title, duration) VALUES (4, 'a', 60), (5, 'b', 60)")
    for user_id in (1, 2, 3):
        await write(redis, "lesson", 1, user_id, 10.0)
    for user_id in (1, 2):
        await write(redis, "audio", 2, user_id, 10.0)
    now_ms = time.time_ns() // 1_000_000
    # claimed by a flusher: one lease still running, one 30 s past its deadline (that flusher died)
    await redis.zadd("progress:in_flight:lesson", {"2:1": now_ms + 60_000, "3:1": now_ms - 30_000})
    await redis.zadd("progress:in_flight:meditation", {"1:1": now_ms + 60_000})
    await _seed_outboxes(db)

    run = await run_status(servers)

    assert run.code == 0, run.stderr
    buffer = run.report["buffer"]
    assert buffer["pending"] == {"lesson": 3, "audio": 2, "meditation": 0, "live": 0}
    assert buffer["in_flight"] == {"lesson": 2, "audio": 0, "meditation": 1, "live": 0}
    assert buffer["in_flight_expired"] == {"lesson": 1, "audio": 0, "meditation": 0, "live": 0}
    oldest = buffer["oldest_claim_age_seconds"]
    assert 30 + FLUSH_LEASE_S <= oldest["lesson"] < 40 and oldest["audio"] is None
    completion, email = run.report["outbox"]["completion"], run.report["outbox"]["email"]
    assert (completion["owed"], completion["parked"], email["owed"], email["parked"]) == (3, 2, 1, 1)
    assert 120 <= completion["oldest_owed_age_seconds"] < 130 and 10 <= email["oldest_owed_age_seconds"] < 20
    info = await redis.info("memory")
    assert run.report["redis"]["ok"] is True and run.report["redis"]["used_memory_bytes"] > 0
    assert run.report["redis"]["maxmemory_bytes"] == info["maxmemory"]
    assert run.report["postgres"] == {"ok": True}
    assert run.report["catalog"] == {"lesson": 3, "audio": 5, "meditation": 3, "live": 3}
    assert all(type(count) is int for section in ("pending", "in_flight") for count in buffer[section].values())


async def test_status_of_an_empty_service_says_nothing_is_owed(
    servers: Servers, redis: Redis, db: asyncpg.Pool
) -> None:
    run = await run_status(servers)

    assert run.code == 0, run.stderr
    assert run.report["buffer"]["pending"] == dict.fromkeys(TYPES, 0)
    assert run.report["outbox"] == {
        name: {"owed": 0, "parked": 0, "oldest_owed_age_seconds": None} for name in ("completion", "email")
    }


async def test_postgres_down_exits_non_zero_naming_it_and_still_shows_the_buffer(
    servers: Servers, redis: Redis, db: asyncpg.Pool
) -> None:
    await write(redis, "live", 4, 2, 1.0)
    port = free_port()

    run = await run_status(
        servers,
        DATABASE_URL=f"postgresql://postgres:secret@127.0.0.1:{port}/progress",
    )

    assert run.code == 1
    assert f"progress-service status: Postgres at 127.0.0.1:{port}/progress unavailable" in run.stderr
    assert "secret" not in run.stderr
    assert run.report["postgres"] == {"ok": False}
    assert run.report["outbox"]["completion"]["owed"] is None and run.report["catalog"]["lesson"] is None
    assert run.report["buffer"]["pending"]["live"] == 1 and run.report["redis"]["ok"] is True


async def test_redis_down_exits_non_zero_naming_it_and_still_shows_the_outboxes(
    servers: Servers, db: asyncpg.Pool
) -> None:
    await _seed_outboxes(db)
    port = free_port()

    run = await run_status(servers, REDIS_URL=f"redis://127.0.0.1:{port}/0", REDIS_SOCKET_TIMEOUT_SECONDS="1")

    assert run.code == 1
    assert f"progress-service status: Redis at 127.0.0.1:{port}/0 unavailable" in run.stderr
    assert run.report["redis"]["ok"] is False and run.report["buffer"]["pending"]["lesson"] is None
    assert run.report["outbox"]["completion"]["owed"] == 3 and run.report["postgres"] == {"ok": True}


@pytest.mark.parametrize("extra", [{}, {"DATABASE_URL": "postgresql://postgres@127.0.0.1:1/x"}])
async def test_the_screen_is_plain_text_with_every_section(
    servers: Servers, redis: Redis, db: asyncpg.Pool, extra: dict[str, str]
) -> None:
    await write(redis, "lesson", 1, 1, 1.0)
    process = await start_service_command("status", env=flusher_env(servers, **extra))
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    screen = stdout.decode()

    for heading in ("Buffer", "Outbox", "Redis", "Postgres", "Catalog", "completion", "email", *TYPES):
        assert heading in screen, screen
    assert "not known cheaply" in screen
    if extra:
        assert "NOT REACHABLE" in screen and process.returncode == 1
        assert stderr.decode().startswith("progress-service status: Postgres at 127.0.0.1:1/x unavailable")
    else:
        assert "reachable" in screen and process.returncode == 0
    with pytest.raises(json.JSONDecodeError):
        json.loads(screen)


@pytest.mark.regression
async def test_a_table_locked_by_another_session_is_reported_as_the_lock_timeout(
    settings: Settings, redis: Redis, db: asyncpg.Pool
) -> None:
    """Found by an outside attack: status said "not read within 5 s" when it had waited its 1 s lock_timeout."""
    await _seed_outboxes(db)
    async with db.acquire() as conn, conn.transaction():
        await conn.execute("LOCK TABLE progress_completion_event IN ACCESS EXCLUSIVE MODE")  # a migration's
        status = await asyncio.wait_for(gather_status(settings), timeout=30)
    [failure] = status.failures
    assert failure.startswith("Postgres: the completion outbox's counts not read: waited 1 s for a lock")
    assert "LockNotAvailableError" in failure and "within 5 s" not in failure
    assert status.report["outbox"]["completion"]["owed"] is None and status.report["outbox"]["email"]["owed"] == 1
