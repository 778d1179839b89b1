"""Round trips of the reads and the sync, counted on real connections: one to Redis, one query per type."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import Connection
from redis.exceptions import RedisError

from service.config import Settings
from service.postgres import _PoolConnection, _reset_session, create_db_pool, fetch_stateless, release_stateless
from service.progress.content import CONTENT_KINDS
from service.progress.ingest.buffer import WRITE_MANY_SCRIPT, WRITE_SCRIPT, PositionWriter
from service.progress.read.reads import (
    MAX_WAIT_S,
    MAX_WAITING_LOOKUPS,
    Progress,
    ProgressReader,
    ReadsWaiting,
    rows_sql,
)
from service.progress.read.sync import OfflineItem, OfflineSync, SyncItem
from service.redis_client import connect_redis
from tests.helpers import Servers, seed, wait_for

KINDS = {kind.name: kind for kind in CONTENT_KINDS}


class CountingConnection(Connection):
    """A real Redis connection that counts what it sends: one send per round trip (a pipeline is one)."""

    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        await super().send_packed_command(command, check_health)


@dataclass
class Counted:
    redis: Redis
    pool: asyncpg.Pool
    statements: list[str] = field(default_factory=list)

    async def reset(self) -> None:
        await asyncio.sleep(0)  # the query logger runs in a call_soon after each statement
        self.statements.clear()
        CountingConnection.sends = 0

    async def round_trips(self) -> tuple[int, list[str]]:
        await asyncio.sleep(0)
        return CountingConnection.sends, list(self.statements)


@pytest.fixture
async def counted(servers: Servers, migrated: str, db: asyncpg.Pool, redis: Redis) -> AsyncIterator[Counted]:
    statements: list[str] = []

    async def log_statements(conn: asyncpg.Connection) -> None:
        # asyncpg's one-off type introspection (of an array type, once per connection), not ours
        await conn.fetch("SELECT $1::bigint[], '{1}'::int4[], '{1}'::float8[]", [1])
        conn.add_query_logger(lambda record: statements.append(record.query))

    async def no_reset(conn: asyncpg.Connection) -> None:
        return None

    pool = await asyncpg.create_pool(migrated, min_size=1, max_size=2, init=log_statements, reset=no_reset)
    client = Redis(connection_pool=ConnectionPool.from_url(servers.redis_url, connection_class=CountingConnection))
    for script in (WRITE_SCRIPT, WRITE_MANY_SCRIPT):  # the connection is open and the scripts known before counting
        await client.script_load(script)
    try:
        yield Counted(client, pool, statements)
    finally:
        await client.aclose()
        await pool.close()


async def calls(redis: Redis, command: str) -> int:
    """How many times the server ran `command`, from its own statistics."""
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_batch_read_of_100_ids_is_one_redis_round_trip_and_one_query(
    counted: Counted, db: asyncpg.Pool, redis: Redis
) -> None:
    await seed(db, users=7, contents=100)
    writer = PositionWriter(counted.redis)
    for content_id in range(1, 51):
        await writer.write(content_type="audio", content_id=content_id, user_id=7, position=content_id)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=2)
    await counted.reset()
    mgets = await calls(redis, "mget")

    found = await reader.read(KINDS["audio"], 7, list(range(1, 101)))

    assert [content_id for content_id, *_ in found] == list(range(1, 51))
    sends, statements = await counted.round_trips()
    assert (sends, await calls(redis, "mget") - mgets) == (1, 1)
    assert statements == [rows_sql(KINDS["audio"])]


async def test_concurrent_reads_of_one_turn_share_the_mget_and_the_query(counted: Counted, db: asyncpg.Pool) -> None:
    await seed(db, users=20, contents=3)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=2)
    await counted.reset()
    await asyncio.gather(*(reader.read(KINDS["lesson"], user_id, [1, 2, 3]) for user_id in range(1, 21)))
    sends, statements = await counted.round_trips()
    assert (sends, statements) == (1, [rows_sql(KINDS["lesson"])])


async def test_each_read_of_a_shared_batch_answers_what_it_answers_alone(counted: Counted, db: asyncpg.Pool) -> None:
    """The batch's rows and values come back in the order asked and are read in that order: a user asked twice,
    an unknown user or content between them, shift no read's answer onto another's ids."""
    await seed(db, users=3, contents=4)
    await db.execute(
        "INSERT INTO engagements_lessonprogress (user_id, lesson_id, position, completed_at, created_at, updated_at)"
        " VALUES (1, 2, 590, now(), now(), now()), (2, 4, 12.5, NULL, now(), now())"
    )
    writer = PositionWriter(counted.redis)
    for content_id, user_id, position in ((3, 1, 30.0), (1, 2, 10.0), (2, 1, 595.0)):
        await writer.write(content_type="lesson", content_id=content_id, user_id=user_id, position=position)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=2)
    asked = [(1, [1, 2, 3, 9]), (99, [1, 2]), (1, [3, 2]), (2, [4, 1, 2]), (3, [9, 2])]
    alone = [await reader.read(KINDS["lesson"], user_id, ids) for user_id, ids in asked]
    assert [[entry[0] for entry in found] for found in alone] == [[2, 3], [], [3, 2], [4, 1], []]
    await counted.reset()

    together = await asyncio.gather(*(reader.read(KINDS["lesson"], user_id, ids) for user_id, ids in asked))

    assert together == alone
    assert await counted.round_trips() == (1, [rows_sql(KINDS["lesson"])])


@contextlib.asynccontextmanager
async def lessons_locked(db: asyncpg.Pool) -> AsyncIterator[None]:
    """The lessons' progress table locked: a read's query of it waits until the block ends, its batch out (a
    read waiting behind it is refused after MAX_WAIT_S: a test that does not mean that ends the block sooner)."""
    async with db.acquire() as conn, conn.transaction():
        await conn.execute("LOCK TABLE engagements_lessonprogress IN ACCESS EXCLUSIVE MODE")
        yield


async def submitted(
    reader: ProgressReader, user_ids: range, kind: str = "lesson"
) -> list[asyncio.Task[list[Progress]]]:
    reads = []
    for user_id in user_ids:
        reads.append(asyncio.create_task(reader.read(KINDS[kind], user_id, [1, 2])))
        await asyncio.sleep(0.002)  # a turn of its own: without the limit, a batch of its own
    return reads


async def test_reads_that_come_while_two_batches_are_out_go_together_in_the_next(
    counted: Counted, db: asyncpg.Pool, redis: Redis
) -> None:
    """Two batches held out, then 27 reads in turns of their own: they wait and go in the next batches, 20
    and 7, not one each; each read gets its own user's position."""
    await seed(db, users=30, contents=3)
    writer = PositionWriter(counted.redis)
    for user_id in range(1, 30):
        await writer.write(content_type="lesson", content_id=1, user_id=user_id, position=user_id)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=2)
    await counted.reset()
    mgets = await calls(redis, "mget")

    async with lessons_locked(db):
        reads = await submitted(reader, range(1, 30))
        held = await calls(redis, "mget") - mgets
    found = await asyncio.gather(*reads)

    assert [[position for _, position, *_ in one] for one in found] == [[float(u)] for u in range(1, 30)]
    _, statements = await counted.round_trips()  # (a second connection's handshake counts as sends: not those)
    assert (held, await calls(redis, "mget") - mgets, len(statements)) == (2, 4, 4)  # 1, 1, then 20 and 7


class CountingPool(asyncpg.Pool):  # type: ignore[misc]  # asyncpg ships no types here
    """A real pool that counts its acquires."""

    __slots__ = ("acquired",)

    def acquire(self, *, timeout: float | None = None) -> Any:
        self.acquired += 1
        return super().acquire(timeout=timeout)


@contextlib.asynccontextmanager
async def counting_pool(
    database_url: str, queries: list[str], pids: list[int] | None = None, lock_timeout_ms: int | None = None
) -> AsyncIterator[CountingPool]:
    """What create_db_pool makes (its connection class and reset), two connections, counting acquires and logging
    every statement (the reset query included) into `queries`, each connection's backend into `pids`."""

    async def log_queries(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(lambda record: queries.append(record.query))
        if pids is not None:
            pids.append(conn.get_server_pid())

    timeouts = {} if lock_timeout_ms is None else {"lock_timeout": str(lock_timeout_ms)}

    pool = await CountingPool(
        database_url, min_size=1, max_size=2, max_queries=50_000, max_inactive_connection_lifetime=300.0, setup=None,
        init=log_queries, reset=_reset_session, loop=None, connection_class=_PoolConnection,
        record_class=asyncpg.Record, server_settings=timeouts,
    )  # fmt: skip
    pool.acquired = 0
    try:
        yield pool
    finally:
        await pool.close()


def all_back(pool: asyncpg.Pool) -> Callable[[], Awaitable[bool]]:
    async def condition() -> bool:
        return bool(pool.get_idle_size() == pool.get_size())

    return condition


def resets(queries: list[str]) -> int:
    return sum("RESET ALL" in query for query in queries)


async def test_the_batches_of_a_busy_type_keep_their_connection_and_give_it_back_when_none_waits(
    counted: Counted, migrated: str, db: asyncpg.Pool
) -> None:
    """A batch out and 29 reads behind it: the next two batches run on the first one's connection (one acquire,
    not three); once no read waits, it is back in the pool, without the reset query (the reads leave no state)."""
    await seed(db, users=30, contents=3)
    queries: list[str] = []
    async with counting_pool(migrated, queries) as pool:
        reader = ProgressReader(counted.redis, pool, margin_s=10, batches_in_flight=1)
        try:
            async with lessons_locked(db):
                reads = await submitted(reader, range(1, 31))
            assert [await read for read in reads] == [[]] * 30
            await wait_for(all_back(pool))
            assert (pool.acquired, queries.count(rows_sql(KINDS["lesson"])), resets(queries)) == (1, 3, 0)
            await reader.read(KINDS["lesson"], 1, [1])  # idle, then a read: a connection of the pool's again
            assert pool.acquired == 2
        finally:
            await reader.aclose()


async def test_a_failed_query_gives_its_connection_back_reset(
    counted: Counted, migrated: str, db: asyncpg.Pool
) -> None:
    """The query gives up at the lock timeout: its connection goes back to the pool at once, with the reset query
    (a failed statement may leave state behind)."""
    await seed(db, users=3, contents=3)
    queries: list[str] = []
    async with counting_pool(migrated, queries, lock_timeout_ms=300) as pool:
        reader = ProgressReader(counted.redis, pool, margin_s=10, batches_in_flight=1)
        try:
            async with lessons_locked(db):
                with pytest.raises(asyncpg.LockNotAvailableError):
                    await reader.read(KINDS["lesson"], 1, [1])
            await wait_for(all_back(pool))
            assert resets(queries) == 1
        finally:
            await reader.aclose()


async def test_a_failed_redis_read_gives_its_connection_back_without_reset_once_none_waits(
    migrated: str, db: asyncpg.Pool
) -> None:
    """Redis down, Postgres up: the query answered and the batch failed; the connection goes back as the query left
    it, without the reset query."""
    await seed(db, users=3, contents=3)
    queries: list[str] = []
    unreachable = connect_redis(Settings(redis_url="redis://127.0.0.1:1").redis)
    async with counting_pool(migrated, queries) as pool:
        reader = ProgressReader(unreachable, pool, margin_s=10, batches_in_flight=1)
        try:
            with pytest.raises(RedisError):
                await reader.read(KINDS["lesson"], 1, [1])
            await wait_for(all_back(pool))
            assert (queries.count(rows_sql(KINDS["lesson"])), resets(queries)) == (1, 0)
        finally:
            await reader.aclose()
            await unreachable.aclose()


async def test_a_kept_connection_that_postgres_ended_is_not_used_again(
    counted: Counted, migrated: str, db: asyncpg.Pool, redis: Redis
) -> None:
    """A batch's query done and its MGET held (Redis paused); meanwhile Postgres ends the pool's backends, the one
    the type keeps among them, and a read waits for the next batch: that batch runs on a new connection."""
    await seed(db, users=3, contents=3)
    pids: list[int] = []
    async with counting_pool(migrated, [], pids) as pool:
        reader = ProgressReader(counted.redis, pool, margin_s=10, batches_in_flight=1)
        try:
            await reader.read(KINDS["lesson"], 1, [1])
            since = await db.fetchval("SELECT clock_timestamp()")
            # 0.8 s: long enough for what follows, short enough for the second read's 1 s wait for its batch
            await redis.execute_command("CLIENT", "PAUSE", "800", "ALL")
            first = asyncio.create_task(reader.read(KINDS["lesson"], 1, [1]))

            async def first_query_answered() -> bool:  # its connection kept, its MGET held by the pause
                return bool(
                    await db.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND state = 'idle'"
                        " AND state_change > $2 AND query LIKE '%unnest(string_to_array%'",
                        pids,
                        since,
                    )
                )

            await wait_for(first_query_answered)
            await db.execute("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", pids)
            second = asyncio.create_task(reader.read(KINDS["lesson"], 2, [1]))  # waits for the next batch
            await asyncio.sleep(0.05)
            assert not first.done()  # still held: `second` goes in the batch after it, on the kept connection
            assert (await first, await second) == ([], [])
            assert pool.acquired == 3  # the first read's, the ended one's, then a new one
        finally:
            await reader.aclose()


async def test_a_connection_the_server_ends_while_it_goes_back_is_not_a_failure(settings: Settings) -> None:
    """The server's end is read in the turn between the release's first step and asyncpg's own, which takes the
    connection back itself: the release raises nothing (the statements it follows answered), and none is lost."""
    pool = await create_db_pool(settings.database, min_size=1)
    try:
        conn = await pool.acquire()
        await conn.fetch("SELECT 1")
        release = asyncio.ensure_future(release_stateless(pool, conn))
        await asyncio.sleep(0)  # its first step: asyncpg's release, shielded in a task of its own, not run yet
        conn._con._protocol.connection_lost(ConnectionResetError("the server's end"))
        await release
        assert await pool.fetchval("SELECT 1") == 1
        assert pool.get_idle_size() == pool.get_size()
    finally:
        await pool.close()


async def test_a_read_whose_client_left_while_it_waited_takes_no_place_in_a_batch(
    counted: Counted, db: asyncpg.Pool, redis: Redis
) -> None:
    await seed(db, users=30, contents=3)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=1)
    mgets = await calls(redis, "mget")
    async with lessons_locked(db):
        reads = await submitted(reader, range(1, 27))
        for read in reads[1:21]:
            read.cancel()
    assert [await read for read in (reads[0], *reads[21:])] == [[]] * 6
    assert await calls(redis, "mget") - mgets == 2  # the first, then the 5 still waiting: not 20 and 5


async def test_past_1000_waiting_a_read_is_refused_at_once_and_the_others_answer(
    counted: Counted, db: asyncpg.Pool
) -> None:
    await seed(db, users=7, contents=3)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=1)
    async with lessons_locked(db):
        first = await submitted(reader, range(7, 8))
        waiting = [asyncio.create_task(reader.read(KINDS["lesson"], 7, [1])) for _ in range(MAX_WAITING_LOOKUPS)]
        await asyncio.sleep(0.01)
        with pytest.raises(ReadsWaiting):
            await asyncio.wait_for(reader.read(KINDS["lesson"], 7, [1]), 0.1)  # at once: not queued
    assert await asyncio.gather(*first, *waiting) == [[]] * (1 + MAX_WAITING_LOOKUPS)


async def test_a_read_that_waits_its_limit_behind_a_stalled_store_is_refused_not_left_waiting(
    counted: Counted, db: asyncpg.Pool
) -> None:
    """The one batch allowed out stalls (a lock): the reads behind it get ReadsWaiting after MAX_WAIT_S, not
    when the store comes back; the stalled batch still answers its own read."""
    await seed(db, users=7, contents=3)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=1)
    loop = asyncio.get_running_loop()
    async with lessons_locked(db):
        started = loop.time()
        reads = await submitted(reader, range(1, 6))
        refused = await asyncio.wait_for(asyncio.gather(*reads[1:], return_exceptions=True), MAX_WAIT_S + 2)
        waited = loop.time() - started
        assert not reads[0].done()  # the stalled batch: its read waits for the store
    assert all(isinstance(error, ReadsWaiting) for error in refused)
    assert MAX_WAIT_S <= waited < MAX_WAIT_S + 1
    assert await reads[0] == []


async def test_each_waiting_read_is_refused_at_its_own_deadline(counted: Counted, db: asyncpg.Pool) -> None:
    """Two reads wait behind a stalled batch, half a second apart: the first is refused at its deadline while the
    second still waits, then the second at its own."""
    await seed(db, users=7, contents=3)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=1)
    loop = asyncio.get_running_loop()
    async with lessons_locked(db):
        stalled = await submitted(reader, range(1, 2))
        started = loop.time()
        [first] = await submitted(reader, range(2, 3))
        await asyncio.sleep(MAX_WAIT_S / 2)
        [second] = await submitted(reader, range(3, 4))
        with pytest.raises(ReadsWaiting):
            await first
        assert not second.done() and loop.time() - started >= MAX_WAIT_S
        with pytest.raises(ReadsWaiting):
            await second
        assert loop.time() - started >= 1.5 * MAX_WAIT_S
    assert await stalled[0] == []


async def test_a_type_whose_table_is_locked_holds_and_fails_its_own_reads_only(
    settings: Settings, db: asyncpg.Pool
) -> None:
    """A lock on one progress table (a migration's, say): the audio read answers while the lesson read waits
    behind the lock, and the lesson read fails at lock_timeout."""
    await seed(db, users=7, contents=3)
    await db.execute(
        "INSERT INTO audios_audioprogress (user_id, audio_id, position, created_at, updated_at)"
        " VALUES (7, 1, 30, now(), now())"
    )
    pool = await create_db_pool(settings.model_copy(update={"database_lock_timeout_seconds": 2}).database)
    redis = connect_redis(settings.redis)
    reader = ProgressReader(redis, pool, margin_s=10, batches_in_flight=1)
    try:
        async with lessons_locked(db):
            lesson = asyncio.create_task(reader.read(KINDS["lesson"], 7, [1]))
            await asyncio.sleep(0.05)
            audio = await asyncio.wait_for(reader.read(KINDS["audio"], 7, [1]), 1)  # not behind the lesson's batch
            assert not lesson.done()
            [failed] = await asyncio.gather(lesson, return_exceptions=True)
        await wait_for(all_back(pool))  # the failed batch's connection too: none stays out
    finally:
        await reader.aclose()
        await redis.aclose()
        await pool.close()
    assert [position for _, position, *_ in audio] == [30.0]
    assert isinstance(failed, asyncpg.LockNotAvailableError)


async def test_closing_the_reader_answers_the_reads_still_waiting(counted: Counted, db: asyncpg.Pool) -> None:
    await seed(db, users=10, contents=1)
    reader = ProgressReader(counted.redis, counted.pool, margin_s=10, batches_in_flight=1)
    async with lessons_locked(db):
        reads = await submitted(reader, range(1, 11))
    await reader.aclose()
    assert all(read.done() and read.result() == [] for read in reads)


async def test_500_items_in_one_sync_are_one_redis_round_trip(counted: Counted, db: asyncpg.Pool, redis: Redis) -> None:
    await seed(db, users=7, contents=125)
    sync = OfflineSync(PositionWriter(counted.redis), counted.pool)
    listened_at = datetime.now(UTC) - timedelta(minutes=5)
    items = [
        OfflineItem.of(SyncItem(content_type=kind.name, content_id=cid, position=float(cid), listened_at=listened_at))
        for kind in CONTENT_KINDS
        for cid in range(1, 126)
    ]
    assert len(items) == 500
    await counted.reset()
    scripts = await calls(redis, "evalsha")

    outcomes = await sync.apply(7, items)

    assert all(outcome.applied for outcome in outcomes) and len(outcomes) == 500
    sends, statements = await counted.round_trips()
    # one script call per type's shard (its 125 writes in order), one round trip
    assert (sends, await calls(redis, "evalsha") - scripts) == (1, len(CONTENT_KINDS))
    assert sorted(statements) == sorted(rows_sql(kind) for kind in CONTENT_KINDS)  # one query per type present
    for kind in CONTENT_KINDS:
        assert await redis.scard(f"progress:pending_flush:{kind.name}") == 125


async def test_a_stateless_fetch_skips_the_reset_on_release_and_every_other_use_keeps_it(settings: Settings) -> None:
    """The reads' query goes back to the pool without the reset's round trip; the pool's other users
    (the sweep's advisory lock among them) still get a clean session. Session state left on purpose
    shows which release reset the connection: one connection, so every call gets the same one."""
    pool = await create_db_pool(settings.model_copy(update={"database_pool_max_size": 1}).database, min_size=1)
    try:
        left_behind = ("SELECT set_config('application_name', 'left-behind', false)", ())
        await fetch_stateless(pool, [left_behind, ("SELECT 1", ())])
        assert await pool.fetchval("SHOW application_name") == "left-behind"  # not reset after the stateless fetch
        assert await pool.fetchval("SHOW application_name") != "left-behind"  # reset after an ordinary use
        with pytest.raises(asyncpg.DivisionByZeroError):
            await fetch_stateless(pool, [left_behind, ("SELECT 1 / 0", ())])
        assert await pool.fetchval("SHOW application_name") != "left-behind"  # one failed: reset on release
        async with pool.acquire() as conn:
            await conn.execute("SELECT pg_advisory_lock(7431999)")
        await fetch_stateless(pool, [("SELECT 1", ())])
        assert await pool.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 7431999") == 0
    finally:
        await pool.close()
