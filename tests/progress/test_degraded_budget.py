"""Degraded mode is one of the budget's writers, and only the stores' clocks date what it writes.

With Redis down, every pod keeps to its share of PROGRESS_FLUSH_MAX_ROWS_PER_SECOND (counted by a
statement trigger in Postgres), and what does not fit is a 503 that is never written. A replica that
stalls turns no heartbeat into a direct write (WAIT is gone), and a pod whose clock is ahead dates
nothing in the future.
"""

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg
import httpx
import pytest
from redis.asyncio import Redis

from service.config import Settings
from service.dev import embedded
from service.progress.flush.flusher import Flusher
from tests.helpers import InsertLog, degraded_settings, insert_log, metric, running_app, seed, wait_for

pytestmark = pytest.mark.regression

MEDITATIONS = "/meditations/progress"


async def _send(client: httpx.AsyncClient, user_id: int, position: float) -> int:
    response = await client.post(
        MEDITATIONS, json={"meditation_id": 1, "position": position}, headers={"X-User-Id": str(user_id)}
    )
    return response.status_code


@pytest.fixture
async def statement_log(db: asyncpg.Pool) -> AsyncIterator[InsertLog]:
    """Per statement on the meditations' progress table: when Postgres inserted its rows, and how many."""
    async with insert_log(db, "audios_meditationprogress") as log:
        yield log


@pytest.mark.slow
async def test_with_redis_down_the_pods_keep_the_fleets_budget_together(
    settings: Settings, own_redis: embedded.EmbeddedRedis, statement_log: InsertLog
) -> None:
    """Found by an attack: with Redis down, degraded mode ignored the fleet's budget (600 rows/s on 200)."""
    pods, per_pod = 3, 1500
    await seed(statement_log.db, users=pods * per_pod, contents=1)
    pod_settings = degraded_settings(
        settings,
        own_redis,
        auth_mode="gateway",
        progress_flush_max_rows_per_second=200,
        progress_flush_batch_size=50,
        progress_fleet_max_pods=pods,
        degraded_write_timeout_seconds=2.0,
    )
    own_redis.stop()
    answers: dict[int, int] = {}

    async def pod(first_user: int) -> None:
        async with running_app(pod_settings) as (_, client):
            users = range(first_user, first_user + per_pod)
            statuses = await asyncio.gather(*(_send(client, user_id, 7.0) for user_id in users))
            answers.update(zip(users, statuses, strict=True))

    await asyncio.gather(*(pod(1 + i * per_pod) for i in range(pods)))
    peak = await statement_log.peak_per_second()
    assert peak <= 200 + pods * 50, peak  # the budget, plus one batch per pod landing in the same second
    acknowledged = {user_id for user_id, status in answers.items() if status == 201}
    assert acknowledged and set(answers.values()) == {201, 503}
    rows = await statement_log.db.fetch("SELECT user_id FROM audios_meditationprogress")
    assert {row["user_id"] for row in rows} == acknowledged  # every 201 written, no 503


@pytest.mark.slow
async def test_a_stalled_replica_turns_no_heartbeat_into_a_direct_write_and_a_503_is_never_written(
    settings: Settings,
    own_redis: embedded.EmbeddedRedis,
    db: asyncpg.Pool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an attack: with REDIS_WAIT_REPLICAS=1, a replica that stalled turned heartbeats into direct
    writes (3.2x the budget), and a heartbeat answered 503 was written anyway by the next flush. The setting is
    gone: an environment that still sets it gets heartbeats answered through Redis."""
    await seed(db, users=40, contents=1)
    replica = embedded.EmbeddedRedis(tmp_path / "replica", None)
    replica.extra_args = ("--replicaof", "127.0.0.1", str(own_redis.port))
    replica.start()
    replica_client = Redis.from_url(replica.url, decode_responses=True)
    assert replica.process is not None
    try:

        async def linked() -> bool:
            return (await replica_client.info("replication"))["master_link_status"] == "up"

        await wait_for(linked, 10)
        monkeypatch.setenv("REDIS_WAIT_REPLICAS", "1")
        monkeypatch.setenv("REDIS_WAIT_TIMEOUT_MS", "50")
        base = degraded_settings(settings, own_redis, auth_mode="gateway")
        # built from the environment, as a pod is: whatever these tests' settings leave unset comes from it
        from_env = {name: value for name, value in base.model_dump().items() if not name.startswith("redis_wait")}
        live = Settings(**from_env)
        dead_db = Settings(**{**from_env, "database_url": f"postgresql://postgres@127.0.0.1:{embedded.free_port()}/x"})
        replica.process.send_signal(signal.SIGSTOP)  # the replica stalls
        direct_before = sum(
            metric("progress_degraded_writes_total", content_type=kind)
            for kind in ("lesson", "audio", "meditation", "live")
        )
        async with running_app(live) as (_, client):
            statuses = [await _send(client, user_id, 11.0) for user_id in range(1, 21)]
        assert statuses == [201] * 20
        direct_after = sum(
            metric("progress_degraded_writes_total", content_type=kind)
            for kind in ("lesson", "audio", "meditation", "live")
        )
        assert direct_after == direct_before  # every heartbeat went through Redis
        # no database for degraded mode: a heartbeat that Redis did not take would be a 503
        async with running_app(dead_db) as (_, client):
            answered = {user_id: await _send(client, user_id, 22.0) for user_id in range(21, 41)}
    finally:
        replica.process.send_signal(signal.SIGCONT)
        await replica_client.aclose()
        replica.stop()
    flusher_redis = Redis.from_url(own_redis.url)
    await Flusher(settings.flush, flusher_redis, db).flush_cycle()
    await flusher_redis.aclose()
    rows = await db.fetch("SELECT user_id, position FROM audios_meditationprogress WHERE user_id > 20")
    written = {row["user_id"]: row["position"] for row in rows}
    assert not [user_id for user_id, status in answered.items() if status == 503 and user_id in written]
    assert written == {user_id: 22.0 for user_id, status in answered.items() if status == 201}
    assert set(answered.values()) == {201}


async def test_a_pod_whose_clock_is_ahead_dates_no_degraded_write_in_the_future(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an attack: a pod an hour ahead, started while Redis was down, wrote rows (and completions) dated
    an hour ahead, and every later heartbeat of those keys was dropped by the monotonic upsert."""
    await seed(db, users=1, contents=1, duration_s=600)
    async with running_app(degraded_settings(settings, own_redis, auth_mode="gateway")) as (_, client):
        own_redis.stop()
        ahead_ns = 3600 * 10**9
        real_time_ns, real_time = time.time_ns, time.time
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + ahead_ns)
        monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
        assert await _send(client, 1, 595.0) == 201  # reaches the end: a completion
        monkeypatch.undo()
        row = await db.fetchrow(
            "SELECT updated_at <= clock_timestamp() AS dated_now, completed_at <= clock_timestamp() AS completed_now"
            " FROM audios_meditationprogress WHERE user_id = 1"
        )
        assert row is not None and row["dated_now"] and row["completed_now"]
        assert await db.fetchval("SELECT bool_and(completed_at <= clock_timestamp()) FROM progress_completion_event")
        assert await _send(client, 1, 120.0) == 201  # the user seeks back: the last one sent wins
    assert await db.fetchval("SELECT position FROM audios_meditationprogress WHERE user_id = 1") == 120.0


@asynccontextmanager
async def standby_missing(db: asyncpg.Pool) -> AsyncIterator[None]:
    """Every commit of a new connection waits for a synchronous standby that does not come (until reset)."""
    database = await db.fetchval("SELECT current_database()")
    await db.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
    await db.execute(f'ALTER DATABASE "{database}" SET synchronous_commit = on')
    await db.execute("SELECT pg_reload_conf()")
    try:
        yield
    finally:
        await db.execute("ALTER SYSTEM RESET synchronous_standby_names")
        await db.execute(f'ALTER DATABASE "{database}" RESET synchronous_commit')
        await db.execute("SELECT pg_reload_conf()")


@pytest.mark.slow
async def test_a_degraded_write_whose_commit_is_slow_is_answered_by_its_outcome_never_503_once_written(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool
) -> None:
    """Found by an attack: a commit waiting for a synchronous standby outlived the request's deadline; the client-side
    timeout answered 503 while the commit went through, completion event included (a 503 that was written)."""
    await seed(db, users=1, contents=1, duration_s=600)
    async with standby_missing(db):
        pod = degraded_settings(settings, own_redis, auth_mode="gateway", degraded_write_timeout_seconds=1.0)
        async with running_app(pod) as (_, client):  # its pool's connections are new: synchronous commits
            own_redis.stop()
            sent = asyncio.ensure_future(_send(client, 1, 595.0))
            # the commit waits past the request's deadline (1 s)
            await wait_for(lambda: db.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"))
            await asyncio.sleep(1.5)
            assert not sent.done()  # no answer while the commit's outcome is not known
            await db.execute("ALTER SYSTEM RESET synchronous_standby_names")
            await db.execute("SELECT pg_reload_conf()")
            status = await sent
    written = await db.fetchval("SELECT count(*) FROM audios_meditationprogress WHERE user_id = 1")
    events = await db.fetchval("SELECT count(*) FROM progress_completion_event WHERE user_id = 1")
    assert (status, written, events) == (201, 1, 1)


@pytest.mark.slow
async def test_a_degraded_commit_whose_connection_ends_is_answered_by_what_the_database_kept(
    settings: Settings, own_redis: embedded.EmbeddedRedis, db: asyncpg.Pool
) -> None:
    """Found by a second attack: the backend of a commit a synchronous standby held was terminated; Postgres kept the
    commit (committed locally) and the lost connection was answered 503 (a 503 that was written)."""
    await seed(db, users=1, contents=1, duration_s=600)
    async with standby_missing(db):
        pod = degraded_settings(settings, own_redis, auth_mode="gateway", degraded_write_timeout_seconds=1.0)
        async with running_app(pod) as (_, client):
            own_redis.stop()
            sent = asyncio.ensure_future(_send(client, 1, 595.0))
            await wait_for(lambda: db.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"))
            # the standby still missing: the commit's own connection is the one to go
            await db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
            status = await sent
    written = await db.fetchval("SELECT count(*) FROM audios_meditationprogress WHERE user_id = 1")
    assert (status, written) in ((201, 1), (503, 0))  # never a 503 that was written
    assert (status, written) == (201, 1)  # a commit kept locally is a write: Postgres says so (txid_status)
