"""Flush benchmark: the service's batched drain of the Redis buffer against a per-entry baseline.

In one run on one machine: starts an embedded Valkey and an embedded Postgres (durable: the server's
default fsync/synchronous_commit/full_page_writes, as production runs) in a temporary folder unless
REDIS_URL / DATABASE_URL are given, applies migrations_ref/, seeds users x 10 lessons, then

  * fills Redis with N pending keys through the request path's own write (buffer.WRITE_SCRIPT via
    buffer.write_args, pipelined), with several heartbeats per key;
  * drains them with `python -m service flush --once` (a subprocess, timed end to end including
    process start), and again in-process with Flusher.flush_cycle (the flush alone);
  * drains the same set with a baseline that persists one entry per statement, as the monolith's
    save_progress did: SPOP a page of members, then for each member one GET and one single-row
    upsert (with its completion event in the same statement), each committed on its own;
  * repeats the service's drain at 10k, 30k and N keys, and at 1 and 5 heartbeats per key, to show
    that the cost grows with pending keys, not with heartbeats;
  * checks after every drain that every key is a row with its last position, that each completed key
    has exactly one completion event, and that the pending and in-flight sets are empty;

and prints rows/s, the service/baseline ratio, the transactions and statements each issued, the WAL
written, the CPU time the flusher, Postgres and Redis used during each drain, and PASS/FAIL against
the targets. The service's drains of N keys run --repeat times (3) and the median is reported. Each
drain starts after a CHECKPOINT and with no rewrite of Redis's append-only file under way, so neither
lands in one drain and not another. Exit status 0 when every target passes, 1 when one does not.

    .venv/bin/python bench/bench_flush.py [--keys 100000] [--baseline-keys N] [--heartbeats-per-key 3]
        [--batch-size 500] [--concurrency 4] [--repeat 3] [--no-fsync] [--no-checkpoint] [--keep]

Everything listens on and talks to 127.0.0.1 only. REDIS_URL / DATABASE_URL, if given, must be scratch
servers on loopback: the Redis database is flushed and the tables are truncated before each drain.
"""

import argparse
import asyncio
import json
import math
import os
import platform
import resource
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from redis.asyncio import Redis

from service import embedded
from service.app import build_flusher
from service.clients import connect_redis
from service.config import Settings
from service.progress.buffer import WRITE_SCRIPT, decode_value, now_ms, write_args
from service.progress.content import CONTENT_KINDS
from service.progress.keys import in_flight_key, latest_position_key, parse_member, pending_flush_key

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
DATABASE_NAME = "progress_bench"

LESSONS = 10  # key i is lesson i % 10 + 1 of user i // 10 + 1
DURATION_S = 600  # every lesson; positions at or past duration - margin complete it
TTL_S = 3600
FILL_CHUNK = 10_000  # heartbeats per pipeline while filling
BASELINE_SPOP = 500  # members the baseline pops per SPOP (it then handles them one by one)
DRAIN_TIMEOUT_S = 900.0  # one drain, service or baseline

# targets of the issue
TARGET_ROWS_PER_S = 50_000.0
TARGET_RATIO = 20.0
# "linear in keys": the flush time per key at N keys is at most this multiple of the one at 10k keys
LINEAR_TOLERANCE = 1.5
# "not in heartbeats": 5 heartbeats per key cost at most this multiple of 1 heartbeat per key
HEARTBEAT_TOLERANCE = 1.25

_PROGRESS_TABLES = ("engagements_lessonprogress, audios_audioprogress, audios_meditationprogress, lives_liveprogress, "
                    "progress_completion_event")  # fmt: skip
_TRUNCATE = f"TRUNCATE {_PROGRESS_TABLES} RESTART IDENTITY"
# the users and content, and whatever refers to them (the trial tables): a scratch database only
_TRUNCATE_ALL = (f"TRUNCATE {_PROGRESS_TABLES}, users_user, courses_lesson, audios_audio, audios_meditation, "
                 "lives_live RESTART IDENTITY CASCADE")  # fmt: skip

# The baseline: one prepared statement per entry, committed on its own. It does what the service's
# batch does for one row (known content only, monotonic upsert, completion event exactly once), so
# both leave the same rows; it is one statement where the monolith's save_progress needed several
# (read the content, update_or_create, then the completion), which makes the comparison generous.
BASELINE_SQL = """
WITH upserted AS (
    INSERT INTO engagements_lessonprogress AS p (user_id, lesson_id, position, completed_at, created_at, updated_at)
    SELECT $1::bigint, c.id, $3::float8, CASE WHEN $3::float8 >= c.duration - $5::float8 THEN $4::timestamptz END,
           $4::timestamptz, $4::timestamptz
    FROM courses_lesson c WHERE c.id = $2::bigint
    ON CONFLICT (user_id, lesson_id) DO UPDATE SET
        position = CASE WHEN p.updated_at < EXCLUDED.updated_at THEN EXCLUDED.position ELSE p.position END,
        updated_at = GREATEST(p.updated_at, EXCLUDED.updated_at),
        completed_at = COALESCE(p.completed_at, EXCLUDED.completed_at)
    WHERE p.updated_at < EXCLUDED.updated_at
       OR (p.completed_at IS NULL AND EXCLUDED.completed_at IS NOT NULL)
    RETURNING p.lesson_id, p.user_id, p.completed_at
)
INSERT INTO progress_completion_event (content_type, content_id, user_id, completed_at, created_at)
SELECT 'lesson', lesson_id, user_id, completed_at, now() FROM upserted WHERE completed_at IS NOT NULL
ON CONFLICT (content_type, content_id, user_id) DO NOTHING
"""


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def check_loopback(name: str, url: str) -> None:
    if urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"{name} must be on loopback (this benchmark talks to 127.0.0.1 only): {url}")


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


def filesystem_of(path: Path) -> str:
    """The type of the file system holding `path`, from /proc/mounts (the longest mount point above it)."""
    best, fs_type = "", "?"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return fs_type
    resolved = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) >= 3 and (resolved == fields[1] or resolved.startswith(fields[1].rstrip("/") + "/")):
            if len(fields[1]) > len(best):
                best, fs_type = fields[1], fields[2]
    return fs_type


def as_text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def database_of(dsn: str) -> str:
    return urlsplit(dsn).path.strip("/") or "postgres"


# ---------------------------------------------------------------------------------------------
# the pending set: deterministic positions, so every refill of the same keys is identical


def key_of(i: int) -> tuple[int, int]:
    """(lesson_id, user_id) of key number i."""
    return i % LESSONS + 1, i // LESSONS + 1


def last_position(i: int, epoch: int) -> float:
    """The last heartbeat's position of key i; about 1 key in 60 lands within the completion margin."""
    return float((i * 7919 + epoch * 104_729) % DURATION_S) + 0.25


def position_at(i: int, epoch: int, round_: int, rounds: int) -> float:
    """Heartbeat `round_` of `rounds`: 10 s apart, ending at last_position."""
    return max(0.0, last_position(i, epoch) - 10.0 * (rounds - 1 - round_))


@dataclass
class Expected:
    """What the tables must hold after the drains since the last truncation."""

    positions: dict[tuple[int, int], float] = field(default_factory=dict)
    completed: set[tuple[int, int]] = field(default_factory=set)

    def add(self, keys: int, epoch: int, margin_s: float) -> None:
        for i in range(keys):
            position = last_position(i, epoch)
            self.positions[key_of(i)] = position
            if position >= DURATION_S - margin_s:
                self.completed.add(key_of(i))


# ---------------------------------------------------------------------------------------------
# servers


@dataclass
class Env:
    redis_url: str
    database_url: str
    stats_url: str  # a connection in another database, so reading the statistics is not counted
    work_dir: Path
    embedded_postgres: bool
    postgres_pid: int | None  # the embedded postmaster, whose CPU time (and its children's) is measured


@contextmanager
def servers(work_dir: Path, *, durable: bool = True) -> Iterator[Env]:
    redis_url = os.environ.get("REDIS_URL")
    database_url = os.environ.get("DATABASE_URL")
    with ExitStack() as stack:
        if redis_url:
            check_loopback("REDIS_URL", redis_url)
        else:
            valkey = embedded.EmbeddedRedis(work_dir / "valkey", None)
            say(f"starting embedded Valkey on 127.0.0.1:{valkey.port} (data in {valkey.data_dir})")
            valkey.start()
            stack.callback(valkey.stop)
            redis_url = valkey.url
        postgres_pid: int | None = None
        if database_url:
            check_loopback("DATABASE_URL", database_url)
            stats_url = with_database(database_url, "postgres")
        else:
            pg = embedded.EmbeddedPostgres(work_dir / "postgres", None, durable=durable)
            state = "durable" if durable else "NOT durable: fsync=off"
            say(f"starting embedded Postgres on 127.0.0.1:{pg.port} ({state}; data in {pg.data_dir})")
            pg.start()
            stack.callback(pg.stop)
            pg.create_database(DATABASE_NAME)
            postgres_pid = pg.process.pid if pg.process else None
            database_url, stats_url = pg.url(DATABASE_NAME), pg.url("postgres")
        yield Env(redis_url, database_url, stats_url, work_dir, embedded_postgres=postgres_pid is not None,
                  postgres_pid=postgres_pid)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# measuring


class StatementCounter:
    """Counts, client side, what an asyncpg pool sends: the upserts, the pool's reset on release, the rest."""

    def __init__(self) -> None:
        self.upserts = 0
        self.resets = 0
        self.other: Counter[str] = Counter()

    def __call__(self, record: Any) -> None:
        query = str(record.query).lstrip()
        if query.startswith("WITH incoming"):
            self.upserts += 1
        elif query.startswith("SELECT pg_advisory_unlock_all()"):
            self.resets += 1
        else:
            self.other[" ".join(query.split())[:60]] += 1

    async def attach(self, conn: asyncpg.Connection) -> None:
        conn.add_query_logger(self)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process, of its children that it reaped (exited backends) and of its live children."""
    total = 0

    def stat_fields(path: Path) -> list[str]:
        text = path.read_text()
        return text[text.rindex(")") + 2 :].split()

    try:
        fields = stat_fields(Path(f"/proc/{pid}/stat"))
        total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                total += sum(int(v) for v in stat_fields(Path(f"/proc/{child}/stat"))[11:13])
            except (OSError, ValueError):
                continue  # exited meanwhile: its time moves to the parent's cutime
    except (OSError, ValueError):
        return math.nan
    return total / CLOCK_TICKS


def own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (a finished `flush --once`)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@dataclass(frozen=True)
class Counters:
    commits: int  # pg_stat_database.xact_commit of the benchmark's database
    wal_bytes: int  # pg_stat_wal, the whole cluster
    wal_fpi: int  # full-page images written to the WAL
    flusher_cpu_s: float = 0.0  # this process + reaped children: the flusher, in-process or `flush --once`
    postgres_cpu_s: float = math.nan  # the embedded server's processes; nan for an external one
    redis_cpu_s: float = 0.0  # INFO cpu: main and background threads (and reaped fork children)
    redis_script_s: float = 0.0  # INFO commandstats: time Redis spent running EVAL/EVALSHA

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(Counters)))

    def __str__(self) -> str:
        return (f"{self.commits} transactions, {self.wal_bytes / 1e6:.1f} MB WAL ({self.wal_fpi} full-page images); "
                f"CPU s: flusher {self.flusher_cpu_s:.2f}, Postgres {self.postgres_cpu_s:.2f}, "
                f"Redis {self.redis_cpu_s:.2f} (scripts {self.redis_script_s:.2f})")  # fmt: skip


@dataclass
class Drain:
    label: str
    keys: int
    heartbeats: int
    seconds: float
    pg: Counters  # over the drain
    statements: int | None = None  # counted by the client: upserts (service) or per-entry statements (baseline)
    resets: int | None = None  # asyncpg pool resets on release (one simple query each)
    batches: int | None = None
    summary: dict[str, Any] | None = None

    @property
    def transactions(self) -> int:
        return self.pg.commits

    @property
    def wal_mb(self) -> float:
        return self.pg.wal_bytes / 1e6

    @property
    def rows_per_s(self) -> float:
        return self.keys / self.seconds if self.seconds > 0 else math.inf

    @property
    def us_per_key(self) -> float:
        return self.seconds / self.keys * 1e6 if self.keys else 0.0


class Bench:
    def __init__(self, env: Env, args: argparse.Namespace) -> None:
        self.env = env
        self.args = args
        self.settings = Settings(
            redis_url=env.redis_url, database_url=env.database_url,
            progress_flush_batch_size=args.batch_size, progress_flush_concurrency=args.concurrency,
            progress_flush_max_rows_per_second=0,  # the flush's own speed (bench_flush_budget.py: with a budget)
            log_level="WARNING",
        )  # fmt: skip
        self.redis: Redis = Redis.from_url(env.redis_url)
        self.stats: asyncpg.Connection | None = None
        self.stats_in_same_database = False
        self.expected = Expected()
        self.epoch = 0

    # --- setup ---------------------------------------------------------------------------------

    async def setup(self) -> None:
        applied = await embedded.prepare_database(self.env.database_url, seed=False)
        say(f"applied {', '.join(applied)}")
        try:
            self.stats = await asyncpg.connect(self.env.stats_url)
        except (OSError, asyncpg.PostgresError) as exc:
            say(f"cannot open {self.env.stats_url} ({exc}); statistics read from the benchmark's own database")
            self.stats = await asyncpg.connect(self.env.database_url)
            self.stats_in_same_database = True
        users = math.ceil(max(self.args.keys, self.args.baseline_keys) / LESSONS)
        conn = await asyncpg.connect(self.env.database_url)
        try:
            await conn.execute(_TRUNCATE_ALL)
            await conn.execute(
                "INSERT INTO users_user (id, email) SELECT i, 'user' || i || '@example.com' "
                "FROM generate_series(1, $1) i",
                users,
            )
            await conn.execute(
                "INSERT INTO courses_lesson (id, title, duration) SELECT i, 'lesson ' || i, $2 "
                "FROM generate_series(1, $1) i",
                LESSONS, DURATION_S,
            )  # fmt: skip
            await conn.execute("ANALYZE users_user, courses_lesson")
        finally:
            await conn.close()
        say(f"seeded {users} users x {LESSONS} lessons ({users * LESSONS} possible keys)")
        await self.redis.script_load(WRITE_SCRIPT)

    async def describe(self) -> list[str]:
        assert self.stats is not None
        conn = await asyncpg.connect(self.env.database_url)
        try:
            version = await conn.fetchval("SHOW server_version")
            pg = {name: await conn.fetchval(f"SHOW {name}") for name in (
                "fsync", "synchronous_commit", "full_page_writes", "wal_sync_method", "shared_buffers")}  # fmt: skip
        finally:
            await conn.close()
        redis_info = await self.redis.info("server")
        persistence = await self.redis.info("persistence")
        appendfsync = next(iter((await self.redis.config_get("appendfsync")).values()), "?")
        data_fs = f"{filesystem_of(self.env.work_dir)} ({self.env.work_dir})" if self.env.embedded_postgres \
            else "external server"  # fmt: skip
        return [
            f"machine: {os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}; "
            "servers, flusher and this script share them",
            f"Postgres {version}{' (embedded)' if self.env.embedded_postgres else ''}: "
            + ", ".join(f"{k}={v}" for k, v in pg.items())
            + f"; data on {data_fs}",
            f"Valkey/Redis {redis_info.get('valkey_version') or redis_info.get('redis_version')}: "
            f"appendonly={'yes' if persistence.get('aof_enabled') else 'no'}, appendfsync={as_text(appendfsync)}",
            f"flusher: PROGRESS_FLUSH_BATCH_SIZE={self.settings.progress_flush_batch_size}, "
            f"PROGRESS_FLUSH_CONCURRENCY={self.settings.progress_flush_concurrency} (the service's defaults "
            "unless given), margin "
            f"{self.settings.progress_completion_margin_seconds:g} s; keys are lessons of {DURATION_S} s",
        ]

    # --- state ---------------------------------------------------------------------------------

    async def reset(self) -> None:
        """An empty buffer and empty progress tables."""
        await self.redis.flushdb()
        await self.redis.script_load(WRITE_SCRIPT)
        if (await self.redis.info("persistence")).get("aof_enabled"):
            # shrink the append-only file now, so that no rewrite of it is due during the next drain
            await self.wait_for_aof_rewrite()
            await self.redis.bgrewriteaof()
            await self.wait_for_aof_rewrite()
        conn = await asyncpg.connect(self.env.database_url)
        try:
            await conn.execute(_TRUNCATE)
        finally:
            await conn.close()
        self.expected = Expected()

    async def fill(self, keys: int, heartbeats: int) -> None:
        """`keys` pending keys, `heartbeats` request-path writes each, through buffer.write_args."""
        self.epoch += 1
        started = time.perf_counter()
        written = 0
        for round_ in range(heartbeats):
            for start in range(0, keys, FILL_CHUNK):
                received = now_ms()
                async with self.redis.pipeline(transaction=False) as pipe:
                    for i in range(start, min(keys, start + FILL_CHUNK)):
                        lesson_id, user_id = key_of(i)
                        position = position_at(i, self.epoch, round_, heartbeats)
                        pipe.execute_command(*write_args("lesson", lesson_id, user_id, position, received, TTL_S))
                    results = await pipe.execute()
                written += sum(1 for result in results if result == 1)
        pending = await self.redis.scard(pending_flush_key("lesson"))
        if pending != keys or written != keys * heartbeats:
            raise RuntimeError(f"fill: {pending} pending members and {written} values written, "
                               f"expected {keys} and {keys * heartbeats}")  # fmt: skip
        self.expected.add(keys, self.epoch, self.settings.progress_completion_margin_seconds)
        say(f"filled {keys} keys x {heartbeats} heartbeats in {time.perf_counter() - started:.1f}s")

    async def prepare_drain(self) -> Counters:
        """A checkpoint first (unless --no-checkpoint), so none lands in a drain by chance; then the counters.

        After a checkpoint the first change of every page writes a full-page image to the WAL: each drain
        starts in that state, as a flush after any production checkpoint does.
        """
        await self.wait_for_aof_rewrite()
        if self.args.checkpoint:
            conn = await asyncpg.connect(self.env.database_url)
            try:
                await conn.execute("CHECKPOINT")
            except asyncpg.InsufficientPrivilegeError:
                pass
            finally:
                await conn.close()
        return await self.settled_counters()

    async def wait_for_aof_rewrite(self) -> None:
        """A rewrite of the append-only file forks Redis and competes for the CPUs: none during a drain."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = await self.redis.info("persistence")
            if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("Redis is still rewriting its append-only file after 120s")

    async def settled_counters(self) -> Counters:
        """The counters once the backends that just closed have reported theirs.

        A backend reports its counts when it exits (and at most once a second while it lives), so this
        polls until they have not moved for a few polls.
        """
        assert self.stats is not None
        query = (
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = $1) AS commits, "
            "wal_bytes, wal_fpi FROM pg_stat_wal"
        )
        database = database_of(self.env.database_url)

        async def read() -> tuple[int, int, int]:
            assert self.stats is not None
            record = await self.stats.fetchrow(query, database)
            assert record is not None
            return int(record["commits"]), int(record["wal_bytes"]), int(record["wal_fpi"])

        last = await read()
        steady = 0
        deadline = time.monotonic() + 5
        while steady < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            now = await read()
            steady = steady + 1 if now == last else 0
            last = now
        cpu = await self.redis.info("cpu")
        scripts = await self.redis.info("commandstats")
        return Counters(
            *last,
            flusher_cpu_s=own_cpu_s(),
            postgres_cpu_s=process_tree_cpu_s(self.env.postgres_pid) if self.env.postgres_pid else math.nan,
            redis_cpu_s=sum(float(cpu.get(name, 0)) for name in (
                "used_cpu_sys", "used_cpu_user", "used_cpu_sys_children", "used_cpu_user_children")),
            redis_script_s=sum(float(scripts.get(name, {}).get("usec", 0)) for name in (
                "cmdstat_evalsha", "cmdstat_eval")) / 1e6,
        )  # fmt: skip

    async def verify(self, label: str, keys: int) -> None:
        """Every key is a row with its last position, one event per completed key, nothing left in Redis."""
        for kind in CONTENT_KINDS:
            pending = await self.redis.scard(pending_flush_key(kind.name))
            in_flight = await self.redis.zcard(in_flight_key(kind.name))
            if pending or in_flight:
                raise RuntimeError(f"{label}: {kind.name} has {pending} pending and {in_flight} in flight")
        conn = await asyncpg.connect(self.env.database_url)
        try:
            rows = await conn.fetch("SELECT lesson_id, user_id, position, completed_at FROM engagements_lessonprogress")
            events = await conn.fetch("SELECT content_type, content_id, user_id FROM progress_completion_event")
        finally:
            await conn.close()
        found = {(r["lesson_id"], r["user_id"]): r["position"] for r in rows}
        expected = self.expected.positions
        missing = [key for key in expected if key not in found]
        wrong = [key for key, position in expected.items() if key in found and found[key] != position]
        extra = [key for key in found if key not in expected]
        completed = {(r["lesson_id"], r["user_id"]) for r in rows if r["completed_at"] is not None}
        event_keys = [(r["content_id"], r["user_id"]) for r in events if r["content_type"] == "lesson"]
        problems = []
        if missing or wrong or extra:
            problems.append(f"{len(missing)} keys missing, {len(wrong)} with a wrong position, {len(extra)} extra rows")
        if completed != self.expected.completed:
            problems.append(f"{len(completed)} rows completed, expected {len(self.expected.completed)}")
        if sorted(event_keys) != sorted(self.expected.completed) or len(events) != len(event_keys):
            problems.append(f"{len(events)} completion events, expected {len(self.expected.completed)}")
        if problems:
            raise RuntimeError(f"{label}: " + "; ".join(problems))
        if len(found) != len(expected):
            raise RuntimeError(f"{label}: {len(found)} rows, expected {len(expected)}")
        say(f"{label}: verified {len(found)} rows ({keys} keys drained), {len(events)} completion events, "
            "pending and in-flight sets empty")  # fmt: skip

    # --- drains --------------------------------------------------------------------------------

    def flusher_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PROGRESS_", "REDIS_", "DATABASE_"))}
        env.update(REDIS_URL=self.env.redis_url, DATABASE_URL=self.env.database_url, LOG_LEVEL="WARNING",
                   PROGRESS_FLUSH_BATCH_SIZE=str(self.args.batch_size),
                   PROGRESS_FLUSH_CONCURRENCY=str(self.args.concurrency),
                   PROGRESS_FLUSH_MAX_ROWS_PER_SECOND="0")  # fmt: skip
        return env

    async def drain_process(self, label: str, keys: int, heartbeats: int) -> Drain:
        """`python -m service flush --once`, timed from exec to exit."""
        before = await self.prepare_drain()
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "flush", "--once", cwd=REPO_DIR, env=self.flusher_env(),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), DRAIN_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError(f"{label}: flush --once did not finish in {DRAIN_TIMEOUT_S:.0f}s") from None
        seconds = time.perf_counter() - started
        counters = await self.settled_counters() - before
        if process.returncode != 0:
            raise RuntimeError(f"{label}: flush --once exited {process.returncode}:\n{stderr.decode()[-3000:]}")
        summary = json.loads(stdout.decode().strip().splitlines()[-1])
        if summary["written"] != keys or summary["failed_batches"] or summary["dropped"] or summary["expired"]:
            raise RuntimeError(f"{label}: flush --once summary {summary}, expected {keys} written")
        drain = Drain(label, keys, heartbeats, seconds, counters, batches=summary["batches"], summary=summary)
        say(f"{label}: {seconds:.2f}s, {drain.rows_per_s:,.0f} rows/s, {counters}; {summary}")
        await self.verify(label, keys)
        return drain

    async def drain_in_process(self, label: str, keys: int, heartbeats: int) -> Drain:
        """Flusher.flush_cycle in this process: the flush alone, without interpreter start and imports."""
        before = await self.prepare_drain()
        counter = StatementCounter()
        settings = self.settings
        redis = connect_redis(settings)
        # the service's pool (service.clients.create_db_pool) plus a query logger on each connection
        pool = await asyncpg.create_pool(
            settings.database_url, min_size=settings.database_pool_min_size,
            max_size=settings.database_pool_max_size, command_timeout=settings.database_command_timeout_seconds,
            statement_cache_size=settings.database_statement_cache_size, init=counter.attach,
        )  # fmt: skip
        try:
            flusher = build_flusher(settings, redis, pool)
            started = time.perf_counter()
            result = await asyncio.wait_for(flusher.flush_cycle(), DRAIN_TIMEOUT_S)
            seconds = time.perf_counter() - started
        finally:
            await pool.close()
            await redis.aclose()
        counters = await self.settled_counters() - before
        if result.written != keys or result.failed_batches or result.dropped or result.expired:
            raise RuntimeError(f"{label}: flush_cycle returned {result}, expected {keys} written")
        drain = Drain(label, keys, heartbeats, seconds, counters, statements=counter.upserts,
                      resets=counter.resets, batches=result.batches)  # fmt: skip
        say(f"{label}: {seconds:.2f}s, {drain.rows_per_s:,.0f} rows/s, {counter.upserts} upserts, "
            f"{counter.resets} pool resets, other queries {dict(counter.other)}, {counters}")  # fmt: skip
        await self.verify(label, keys)
        return drain

    async def drain_baseline(self, label: str, keys: int, heartbeats: int) -> Drain:
        """One entry, one statement, one commit: SPOP a page, then GET and upsert each member in turn."""
        before = await self.prepare_drain()
        margin = self.settings.progress_completion_margin_seconds
        conn = await asyncpg.connect(self.env.database_url)
        statements = spops = 0
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        try:
            started = time.perf_counter()
            while True:
                members = await self.redis.spop(pending_flush_key("lesson"), BASELINE_SPOP)
                spops += 1
                if not members:
                    break
                for raw_member in members:
                    lesson_id, user_id = parse_member(as_text(raw_member))
                    raw = await self.redis.get(latest_position_key("lesson", lesson_id, user_id))
                    if raw is None:
                        continue
                    stored = decode_value(raw)
                    received_at = datetime.fromtimestamp(stored.received_ms / 1000, UTC)
                    await conn.execute(BASELINE_SQL, user_id, lesson_id, stored.position, received_at, margin)
                    statements += 1
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: not finished in {DRAIN_TIMEOUT_S:.0f}s")
            seconds = time.perf_counter() - started
        finally:
            await conn.close()
        counters = await self.settled_counters() - before
        drain = Drain(label, keys, heartbeats, seconds, counters, statements=statements, batches=spops)
        say(f"{label}: {seconds:.2f}s, {drain.rows_per_s:,.0f} rows/s, {statements} statements, {counters}")
        await self.verify(label, keys)
        return drain


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Results:
    describe: list[str]
    startup: Drain
    process: Drain
    in_process: Drain
    baseline: Drain
    scaling: list[tuple[Drain, Drain]]  # (process, in-process) per key count, heartbeats as --heartbeats-per-key
    by_heartbeats: list[tuple[Drain, Drain]]  # (process, in-process) at N keys x 1 and x 5 heartbeats
    updates: tuple[Drain, Drain]  # (process, in-process) onto existing rows: the ON CONFLICT UPDATE path


async def run(env: Env, args: argparse.Namespace) -> Results:
    bench = Bench(env, args)
    try:
        await bench.setup()
        describe = await bench.describe()
        keys, hb = args.keys, args.heartbeats_per_key

        # the fixed cost of the command: interpreter, imports, connections, an empty cycle
        await bench.reset()
        await bench.drain_process("flush --once, nothing pending (warm-up: file cache, bytecode)", 0, 0)
        startup = await bench.drain_process("flush --once, nothing pending", 0, 0)

        scaling: list[tuple[Drain, Drain]] = []
        for size in [s for s in (10_000, 30_000) if s < keys] + [keys]:
            processes, in_processes = [], []
            for _ in range(args.repeat if size == keys else 1):
                await bench.reset()
                await bench.fill(size, hb)
                processes.append(await bench.drain_process(f"service process, {size} keys x {hb}", size, hb))
                await bench.reset()
                await bench.fill(size, hb)
                in_processes.append(await bench.drain_in_process(f"service in-process, {size} keys x {hb}", size, hb))
            scaling.append((median(processes), median(in_processes)))
        main_process, main_in_process = scaling[-1]

        # the same keys again with newer heartbeats, onto the rows just written: the UPDATE path
        await bench.fill(keys, hb)
        update_process = await bench.drain_process(f"service process, {keys} keys x {hb}, updates", keys, hb)
        await bench.fill(keys, hb)
        update_in_process = await bench.drain_in_process(f"service in-process, {keys} keys x {hb}, updates", keys, hb)

        by_heartbeats: list[tuple[Drain, Drain]] = []
        for beats in (1, 5):
            pair = []
            for mode in ("process", "in-process"):
                await bench.reset()
                await bench.fill(keys, beats)
                label = f"service {mode}, {keys} keys x {beats}"
                pair.append(await (bench.drain_process(label, keys, beats) if mode == "process"
                                   else bench.drain_in_process(label, keys, beats)))  # fmt: skip
            by_heartbeats.append((pair[0], pair[1]))

        await bench.reset()
        await bench.fill(args.baseline_keys, hb)
        baseline = await bench.drain_baseline(f"baseline, {args.baseline_keys} keys x {hb}", args.baseline_keys, hb)
        return Results(describe, startup, main_process, main_in_process, baseline, scaling, by_heartbeats,
                       (update_process, update_in_process))  # fmt: skip
    finally:
        if bench.stats is not None:
            await bench.stats.close()
        await bench.redis.aclose()


def median(drains: list[Drain]) -> Drain:
    """The run of median time (the upper one of an even count)."""
    return sorted(drains, key=lambda d: d.seconds)[len(drains) // 2]


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}"


def report(results: Results, args: argparse.Namespace) -> bool:
    r = results
    keys, hb = args.keys, args.heartbeats_per_key
    print()
    for line in r.describe:
        print(line)
    print()
    print(f"Drain of {keys} pending keys ({hb} heartbeats each, {keys * hb} request-path writes), "
          "verified after each drain: one row per key with its last position, one event per completed key, "
          "pending and in-flight sets empty."
          + (f" Service rows: median of {args.repeat} runs." if args.repeat > 1 else ""))  # fmt: skip
    header = f"{'drain':<58}{'keys':>8}{'seconds':>9}{'rows/s':>10}{'pg xacts':>10}{'client stmts':>14}{'WAL MB':>8}"
    print(header)
    print("-" * len(header))

    def row(name: str, d: Drain, statements: str) -> None:
        print(f"{name:<58}{d.keys:>8}{d.seconds:>9.3f}{fmt_rate(d.rows_per_s) if d.keys else '-':>10}"
              f"{d.transactions:>10}{statements:>14}{d.wal_mb:>8.1f}")  # fmt: skip

    row("service: `python -m service flush --once`, end to end", r.process, "-")
    row("service: Flusher.flush_cycle in-process (flush only)", r.in_process,
        f"{r.in_process.statements}+{r.in_process.resets}r")  # fmt: skip
    row("service: `flush --once` with nothing pending (fixed cost)", r.startup, "-")
    row("baseline: one upsert statement per entry, own commit", r.baseline, f"{r.baseline.statements}")
    e2e_ratio = r.process.rows_per_s / r.baseline.rows_per_s
    flush_ratio = r.in_process.rows_per_s / r.baseline.rows_per_s
    print(f"{'ratio service / baseline (rows/s)':<58}{'':>8}{'':>9}{e2e_ratio:>9.1f}x   end to end; "
          f"{flush_ratio:.1f}x flush only")  # fmt: skip
    print("pg xacts: pg_stat_database.xact_commit delta of the benchmark's database over the drain, read from "
          "a connection to another database (autovacuum/analyze may add a few); for the service: one per upsert, "
          "one per pool reset, and a few per new connection (asyncpg's type introspection and the statement's "
          "preparation). client stmts: upserts sent + 'r' asyncpg pool resets (one 'SELECT "
          "pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL' round trip per release, a transaction of "
          "its own); for the baseline, one statement per entry plus "
          f"{r.baseline.batches} SPOPs of {BASELINE_SPOP} on Redis and one GET per entry. WAL MB: pg_stat_wal "
          f"wal_bytes delta{' (each drain starts right after a CHECKPOINT)' if args.checkpoint else ''}.")  # fmt: skip
    print()
    cpus = os.cpu_count() or 1
    print(f"Where the time goes: CPU used during each drain, in seconds and per key ({cpus} CPUs, so "
          f"{cpus} x wall seconds are available)")  # fmt: skip
    header = (f"{'drain':<58}{'wall s':>8}{'flusher':>9}{'Postgres':>10}{'Redis':>8}{'(scripts)':>11}{'busy':>7}"
              f"{'us/key: flusher':>17}{'Postgres':>10}{'Redis':>8}")  # fmt: skip
    print(header)
    print("-" * len(header))
    drains = (("service: `flush --once`, end to end", r.process), ("service: flush_cycle in-process", r.in_process),
              ("service: `flush --once` with nothing pending", r.startup),
              ("baseline: one statement per entry", r.baseline))  # fmt: skip
    for name, d in drains:
        c = d.pg
        used = c.flusher_cpu_s + (0.0 if math.isnan(c.postgres_cpu_s) else c.postgres_cpu_s) + c.redis_cpu_s
        per_key = [f"{v / d.keys * 1e6:.1f}" if d.keys else "-" for v in
                   (c.flusher_cpu_s, c.postgres_cpu_s, c.redis_cpu_s)]  # fmt: skip
        print(f"{name:<58}{d.seconds:>8.2f}{c.flusher_cpu_s:>9.2f}{c.postgres_cpu_s:>10.2f}{c.redis_cpu_s:>8.2f}"
              f"{c.redis_script_s:>11.2f}{used / (cpus * d.seconds):>7.0%}{per_key[0]:>17}{per_key[1]:>10}"
              f"{per_key[2]:>8}")  # fmt: skip
    print("flusher: this process and its finished children (the `flush --once` process, or this process running "
          "flush_cycle); Postgres: the embedded server's processes; Redis: INFO cpu, (scripts) the part inside "
          "EVALSHA by INFO commandstats. busy: their sum over the CPU time available.")  # fmt: skip
    if args.baseline_keys != keys:
        print(
            f"note: the baseline drained {args.baseline_keys} keys (--baseline-keys), not {keys}; rows/s is what "
            f"is compared; at its rate {keys} keys would take about {keys / r.baseline.rows_per_s:.1f} s."
        )
    print()

    print(f"Growth with pending keys ({hb} heartbeats per key; tables empty before each drain but the last row)")
    header = (f"{'keys':>8}{'e2e s':>9}{'e2e rows/s':>12}{'flush s':>9}{'flush rows/s':>14}{'us/key':>8}"
              f"{'batches':>9}{'pg xacts':>10}{'upserts':>9}{'WAL MB':>8}")  # fmt: skip
    print(header)
    print("-" * len(header))
    rows = [(process, flush, "") for process, flush in r.scaling]
    rows.append((*r.updates, "   <- the same keys again onto their rows: the UPDATE path"))
    for process, flush, note in rows:
        print(f"{process.keys:>8}{process.seconds:>9.3f}{fmt_rate(process.rows_per_s):>12}{flush.seconds:>9.3f}"
              f"{fmt_rate(flush.rows_per_s):>14}{flush.us_per_key:>8.1f}{flush.batches:>9}{flush.transactions:>10}"
              f"{flush.statements:>9}{flush.wal_mb:>8.1f}{note}")  # fmt: skip
    print()
    print(f"Cost follows keys, not heartbeats ({keys} keys)")
    header = f"{'heartbeats/key':>15}{'writes':>10}{'e2e s':>9}{'e2e rows/s':>12}{'flush s':>9}{'flush rows/s':>14}" \
             f"{'pg xacts':>10}{'upserts':>9}{'WAL MB':>8}"  # fmt: skip
    print(header)
    print("-" * len(header))
    for process, flush in r.by_heartbeats:
        print(f"{process.heartbeats:>15}{process.keys * process.heartbeats:>10}{process.seconds:>9.3f}"
              f"{fmt_rate(process.rows_per_s):>12}{flush.seconds:>9.3f}{fmt_rate(flush.rows_per_s):>14}"
              f"{flush.transactions:>10}{flush.statements:>9}{flush.wal_mb:>8.1f}")  # fmt: skip
    print()

    smallest, largest = r.scaling[0][1], r.scaling[-1][1]
    growth = largest.us_per_key / smallest.us_per_key if len(r.scaling) > 1 else 1.0
    (_, one), (_, five) = r.by_heartbeats
    beats_ratio = five.seconds / one.seconds
    checks = [
        (f"end to end >= {TARGET_ROWS_PER_S:,.0f} rows/s ({keys} keys, `flush --once`)",
         f"{fmt_rate(r.process.rows_per_s)} rows/s", r.process.rows_per_s >= TARGET_ROWS_PER_S),
        (f">= {TARGET_RATIO:.0f}x the per-entry baseline (end to end rows/s)", f"{e2e_ratio:.1f}x",
         e2e_ratio >= TARGET_RATIO),
        (f"linear in keys: flush us/key at {largest.keys} <= {LINEAR_TOLERANCE}x that at {smallest.keys}",
         f"{largest.us_per_key:.1f} vs {smallest.us_per_key:.1f} us/key ({growth:.2f}x); upserts "
         f"{smallest.statements} -> {largest.statements}",
         growth <= LINEAR_TOLERANCE),
        (f"not in heartbeats: flush time at 5 heartbeats/key <= {HEARTBEAT_TOLERANCE}x at 1",
         f"{five.seconds:.3f} vs {one.seconds:.3f} s ({beats_ratio:.2f}x); upserts {one.statements} vs "
         f"{five.statements}",
         beats_ratio <= HEARTBEAT_TOLERANCE and one.statements == five.statements),
    ]  # fmt: skip
    print("Targets")
    width = max(len(name) for name, _, _ in checks) + 2
    for name, value, ok in checks:
        print(f"  {name:<{width}}{value:<48}{'PASS' if ok else 'FAIL'}")
    return all(ok for _, _, ok in checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000, help="pending keys of the main drain (100000)")
    parser.add_argument("--baseline-keys", type=int, default=None,
                        help="keys the per-entry baseline drains (default: --keys); rows/s is compared")  # fmt: skip
    parser.add_argument("--heartbeats-per-key", type=int, default=3, help="request-path writes per key (3)")
    parser.add_argument("--batch-size", type=int, default=int(os.environ.get("PROGRESS_FLUSH_BATCH_SIZE", "500")),
                        help="PROGRESS_FLUSH_BATCH_SIZE of the flusher (500, the service's default)")  # fmt: skip
    parser.add_argument("--concurrency", type=int,
                        default=int(os.environ.get("PROGRESS_FLUSH_CONCURRENCY", "4")),
                        help="PROGRESS_FLUSH_CONCURRENCY of the flusher (4, the service's default)")  # fmt: skip
    parser.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                        help="no CHECKPOINT before each drain (one may then land in a drain)")  # fmt: skip
    parser.add_argument("--no-fsync", action="store_true",
                        help="embedded Postgres with fsync, synchronous_commit and full_page_writes off, as the tests "
                        "run it (not what production does; the settings are printed)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3,
                        help="run the service's drains of --keys this many times; report the median (3)")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the work directory (server data and logs)")
    args = parser.parse_args(argv)
    if args.baseline_keys is None:
        args.baseline_keys = args.keys
    if min(args.keys, args.baseline_keys, args.heartbeats_per_key, args.repeat, args.batch_size, args.concurrency) < 1:
        parser.error(
            "--keys, --baseline-keys, --heartbeats-per-key, --repeat, --batch-size and --concurrency must be positive"
        )

    # embedded-postgres asks for a runtime dir at import; irrelevant here
    warnings.filterwarnings("ignore", category=UserWarning, module="platformdirs.*")
    # a SIGTERM unwinds like Ctrl-C, so the servers started here are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work_dir = Path(tempfile.mkdtemp(prefix="progress-bench-flush-"))
    with ExitStack() as stack:
        if args.keep:
            say(f"work directory: {work_dir}")
        else:
            stack.callback(shutil.rmtree, work_dir, True)
        env = stack.enter_context(servers(work_dir, durable=not args.no_fsync))
        started = time.monotonic()
        results = asyncio.run(run(env, args))
        say(f"all drains done in {time.monotonic() - started:.0f}s")
    return 0 if report(results, args) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
