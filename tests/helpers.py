"""What several test modules share: the running app, seeding, tokens, waiting, and each area's helpers.

Test modules and conftest.py files import from here (and from the helper modules tests/monolith/fixtures.py,
tests/faults/, tests/deploy/files.py, tests/debian.py), never from one another; conftest.py files keep only fixtures.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from service.api.routes import Routes
from service.app import create_app
from service.auth import make_token
from service.config import Settings
from service.dev import database, embedded
from service.progress.content import CONTENT_KINDS, ContentKind
from service.progress.flush.flusher import Flusher
from service.progress.ingest.buffer import WRITE_SCRIPT, decode_value, write_args
from service.progress.keys import FLUSH_BUDGET_KEY, STANDALONE, KeyLayout
from service.redis_client import RedisClient

TEST_JWT_SECRET = "test-secret-0123456789abcdef-0123456789"


if TYPE_CHECKING:  # the broker is a pytest plugin's (tests/conftest.py): imported there first, for its asserts
    from tests.monolith.fixtures import Broker

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Servers:
    redis_url: str
    database_url: str
    redis: embedded.EmbeddedRedis | None
    postgres: database.EmbeddedPostgres | None


# --- the app, as uvicorn runs it --------------------------------------------------------------------------


class RunningApp(NamedTuple):
    app: Routes
    client: httpx.AsyncClient


class MovedClock:
    """A clock a test moves forward: `base` (time.monotonic, time.time) plus what `advance` added."""

    def __init__(self, base: Callable[[], float]) -> None:
        self._base = base
        self.offset_s = 0.0

    def __call__(self) -> float:
        return self._base() + self.offset_s

    def advance(self, seconds: float) -> None:
        self.offset_s += seconds


@asynccontextmanager
async def running_app(
    settings: Settings,
    *,
    raise_app_exceptions: bool = True,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> AsyncIterator[RunningApp]:
    """The app built from `settings`, its lifespan running, and a client that talks to it in-process.

    `raise_app_exceptions=False`: an exception escaping a request is its 500, as uvicorn would answer.
    `clock`, `wall_clock`: the catalog's and the token cache's (a MovedClock, for a test that moves time).
    """
    app = create_app(settings, clock=clock, wall_clock=wall_clock)
    async with app.api.router.lifespan_context(app.api):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield RunningApp(app, client)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def seed(db: asyncpg.Pool, *, users: int = 3, contents: int = 3, duration_s: int = 600) -> None:
    """Users 1..users and content 1..contents of every kind, each `duration_s` long."""
    await db.execute(
        "INSERT INTO users_user (id, email) SELECT i, 'user' || i || '@example.com' FROM generate_series(1, $1) i",
        users,
    )
    for table in ("courses_lesson", "audios_audio", "audios_meditation", "lives_live"):
        await db.execute(
            f"INSERT INTO {table} (id, title, duration) SELECT i, 'content ' || i, $2 FROM generate_series(1, $1) i",
            contents,
            duration_s,
        )


async def wait_for(condition: Callable[[], Awaitable[object]], timeout_s: float = 5.0) -> None:
    """Poll `condition` until it is true; fail once `timeout_s` has passed."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def wait_ready(
    base_url: str, process: "subprocess.Popen[bytes] | None" = None, timeout_s: float = 30, log: Path | None = None
) -> None:
    """Until `base_url`'s /health/ready answers 200; fails at once if `process` exits, and names its log's tail."""
    tail = "" if log is None else f"; its log ends:\n{log.read_text()[-3000:] if log.exists() else '(none)'}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the service exited with {process.returncode} before it was ready{tail}")
        try:
            if httpx.get(f"{base_url}/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{base_url} was not ready within {timeout_s:.0f} s{tail}")


@asynccontextmanager
async def table_locked(db: asyncpg.Pool, table: str) -> AsyncIterator[None]:
    """`table` under ACCESS EXCLUSIVE (a migration's lock) from a connection of `db`, until the block ends."""
    async with db.acquire() as conn, conn.transaction():
        await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        held = (
            "SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND mode = 'AccessExclusiveLock' AND granted"
        )
        assert await db.fetchval(held, table) == 1
        yield


async def waiting_on_lock(db: asyncpg.Pool, table: str) -> int:
    """Statements waiting for a lock on `table` now, as pg_locks shows them."""
    count: int = await db.fetchval("SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND NOT granted", table)
    return count


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def flushed_since(started_s: float) -> Callable[[], Awaitable[bool]]:
    """For wait_for: a flush cycle of this process finished cleanly after `started_s` (time.time())."""

    async def done() -> bool:
        return metric("progress_flush_last_success_timestamp_seconds") >= started_s

    return done


# --- the progress buffer and the flusher ------------------------------------------------------------------

FLUSH_LEASE_S = 1.0  # the lease of the flusher processes the crash tests start


async def leases_ended(redis: RedisClient, layout: KeyLayout = STANDALONE) -> bool:
    """For wait_for: every lesson lease in flight has ended by Redis's clock (a dead flusher's batches are free)."""
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000  # whole ms, as the requeue script compares
    for shard in layout.shards_to_flush("lesson"):
        last = await redis.zrange(shard.in_flight_key, -1, -1, withscores=True)
        if last and last[0][1] > now_ms:
            return False
    return True


async def write(
    redis: RedisClient,
    content_type: str,
    content_id: int,
    user_id: int,
    position: float,
    received_ms: float | None = None,
    layout: KeyLayout = STANDALONE,
) -> float:
    """What the request path writes, through the same script (stamped by Redis, as there; `received_ms`: a write
    of that time instead); returns the value's receive time."""
    await redis.script_load(WRITE_SCRIPT)
    await redis.execute_command(*write_args(content_type, content_id, user_id, position, received_ms, layout))  # type: ignore[arg-type]
    return decode_value(await redis.get(layout.value_key(content_type, content_id, user_id))).received_ms


async def lesson_rows(db: asyncpg.Pool) -> dict[tuple[int, int], asyncpg.Record]:
    rows = await db.fetch("SELECT * FROM engagements_lessonprogress")
    return {(row["lesson_id"], row["user_id"]): row for row in rows}


async def events(db: asyncpg.Pool) -> list[tuple[str, int, int]]:
    rows = await db.fetch("SELECT content_type, content_id, user_id FROM progress_completion_event ORDER BY id")
    return [tuple(row) for row in rows]  # type: ignore[misc]


def degraded_settings(settings: Settings, server: embedded.EmbeddedRedis, **update: object) -> Settings:
    return settings.model_copy(update={"redis_url": server.url, "degraded_redis_retry_seconds": 0.2, **update})


def clean_environment() -> dict[str, str]:
    """This process's environment less every variable the service reads: a service subprocess of a test
    gets only the settings the test gives it, whatever the developer's shell exports."""
    names = {name.upper() for name in Settings.model_fields}
    return {k: v for k, v in os.environ.items() if k.upper() not in names and k != "PROMETHEUS_MULTIPROC_DIR"}


def service_env(servers: Servers, **settings: str) -> dict[str, str]:
    """The environment of a service subprocess on the session's servers: clean_environment(), quiet logs, `settings`."""
    return {
        **clean_environment(),
        "REDIS_URL": servers.redis_url,
        "DATABASE_URL": servers.database_url,
        "LOG_LEVEL": "WARNING",
        **settings,
    }


def service_command(*args: str, die_at: str = "") -> list[str]:
    """`python -m service <args>`; with `die_at`, one that SIGKILLs itself at that checkpoint (tests/crash.py)."""
    if die_at:
        return [sys.executable, "-m", "tests.crash", die_at, *args]
    return [sys.executable, "-m", "service", *args]


async def start_service_command(*args: str, env: dict[str, str], die_at: str = "") -> asyncio.subprocess.Process:
    """`python -m service <args>` in its own process (from the repository: tests.crash is importable), piped."""
    return await asyncio.create_subprocess_exec(
        *service_command(*args, die_at=die_at),
        env=env,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def flusher_with(settings: Settings, redis: RedisClient, db: asyncpg.Pool, **update: object) -> Flusher:
    """A flusher of the test settings with `update` applied (the settings' own names)."""
    return Flusher(settings.model_copy(update=update).flush, redis, db)


async def push_budget_key(redis: RedisClient, ahead_s: float) -> None:
    """The budget's key set `ahead_s` past the Redis server's time, in service/progress/flush/budget.py's format (the
    server's µs when the reservations end): a Redis clock stepped back, or a failover to a lagging replica."""
    seconds, micros = await redis.time()
    ends_us = seconds * 1_000_000 + micros + int(ahead_s * 1_000_000)
    await redis.set(FLUSH_BUDGET_KEY, str(ends_us), px=int(ahead_s * 1000) + 1000)


async def budget_ahead_s(redis: RedisClient) -> float:
    """How far past the Redis server's time the budget's reservations end (0: none pending)."""
    ends = await redis.get(FLUSH_BUDGET_KEY)
    seconds, micros = await redis.time()
    return 0.0 if ends is None else max(0.0, (int(ends) - (seconds * 1_000_000 + micros)) / 1_000_000)


def flusher_env(servers: Servers, **extra: str) -> dict[str, str]:
    defaults = {
        "PROGRESS_FLUSH_LEASE_SECONDS": str(FLUSH_LEASE_S),
        "PROGRESS_FLUSH_BATCH_SIZE": "100",
        "PROGRESS_FLUSH_CONCURRENCY": "2",
    }
    return service_env(servers, **{**defaults, **extra})


def flush_once(servers: Servers, *, die_at: str = "", **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        service_command("flush", "--once", die_at=die_at),
        env=flusher_env(servers, **extra),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def fill(
    redis: RedisClient, db: asyncpg.Pool, keys: int, layout: KeyLayout = STANDALONE
) -> dict[tuple[int, int], float]:
    """`keys` lessons-by-user, each with a few heartbeats; returns the last position of each."""
    await seed(db, users=keys // 10, contents=10)
    last = {}
    for round_ in range(3):
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(keys):
                content_id, user_id = i % 10 + 1, i // 10 + 1
                position = float(round_ * 100 + i % 97)
                pipe.execute_command(*_args(content_id, user_id, position, layout))
                last[(content_id, user_id)] = position
            await pipe.execute()
    return last


def _args(content_id: int, user_id: int, position: float, layout: KeyLayout = STANDALONE) -> tuple[object, ...]:
    return write_args("lesson", content_id, user_id, position, layout=layout)


async def backlog(redis: RedisClient, layout: KeyLayout = STANDALONE) -> tuple[int, int]:
    """Lesson members pending and in flight, over every shard."""
    pending = in_flight = 0
    for shard in layout.shards_to_flush("lesson"):
        pending += await redis.scard(shard.pending_key)
        in_flight += await redis.zcard(shard.in_flight_key)
    return pending, in_flight


async def assert_all_persisted(
    redis: RedisClient, db: asyncpg.Pool, last: dict[tuple[int, int], float], layout: KeyLayout = STANDALONE
) -> None:
    rows = await lesson_rows(db)
    missing = [key for key in last if key not in rows]
    wrong = [key for key, position in last.items() if key in rows and rows[key]["position"] != position]
    assert (missing, wrong) == ([], []), f"{len(missing)} missing, {len(wrong)} with an old position"
    assert await backlog(redis, layout) == (0, 0)


class RowsWatch:
    """Samples the progress rows of one content type (lessons unless told); a row whose (updated_at, position) ever
    went back is recorded, and so is every change, with the wall-clock time of the sample that first saw it."""

    def __init__(self, db: asyncpg.Pool | asyncpg.Connection, kind: ContentKind = CONTENT_KINDS[0]) -> None:
        self.db = db
        self.kind = kind
        self.seen: dict[tuple[int, int], tuple[float, float]] = {}  # key -> (updated_at, position) last sampled
        self.moved_back: list[tuple[tuple[int, int], tuple[float, float], tuple[float, float]]] = []
        # key -> (sampled at, updated_at, position) of each change seen: the time is taken before the query, whose
        # snapshot already held the change
        self.changes: dict[tuple[int, int], list[tuple[float, float, float]]] = {}

    async def sample(self) -> None:
        query = f"SELECT {self.kind.id_column}, user_id, position, updated_at FROM {self.kind.progress_table}"
        sampled_at = time.time()
        for row in await self.db.fetch(query):
            key, now = (row[0], row["user_id"]), (row["updated_at"].timestamp(), row["position"])
            before = self.seen.get(key)
            if before is not None and now < before:
                self.moved_back.append((key, before, now))
            if now != before:
                self.changes.setdefault(key, []).append((sampled_at, *now))
            self.seen[key] = now


async def race_three_flushers(
    redis: RedisClient, db: asyncpg.Pool, env: dict[str, str], layout: KeyLayout = STANDALONE
) -> None:
    """Three `flush` processes on the same 2,000 keys: one event per key, and no position ever moves back."""
    await redis.script_load(WRITE_SCRIPT)
    await seed(db, users=200, contents=10, duration_s=1000)  # 2000 keys
    keys = [(c, u) for c in range(1, 11) for u in range(1, 201)]
    crossing = set(keys[:500])
    env = env | {"PROGRESS_FLUSH_INTERVAL_SECONDS": "0.1", "PROGRESS_FLUSH_LEASE_SECONDS": "10"}
    flushers = [
        subprocess.Popen(
            [sys.executable, "-m", "service", "flush"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    watch = RowsWatch(db)

    last: dict[tuple[int, int], float] = {}
    try:
        for round_ in range(12):
            async with redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    if round_ == 6 and key in crossing:
                        position = 995.0  # 500 keys cross the margin in the same instant
                    elif round_ > 6 and key in crossing:
                        position = rng_position(round_, key, near_end=True)
                    else:
                        position = float(round_ * 10)
                    pipe.execute_command(*_args(*key, position, layout))
                    last[key] = position
                await pipe.execute()
            await watch.sample()
            await asyncio.sleep(0.15)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if sum(await backlog(redis, layout)) == 0:
                break
            await watch.sample()
            await asyncio.sleep(0.1)
    finally:
        for process in flushers:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=30) for process in flushers]
    assert codes == [0, 0, 0], [p.stderr.read() if p.stderr else "" for p in flushers]
    await watch.sample()
    assert watch.moved_back == []
    await assert_all_persisted(redis, db, last, layout)
    assert sorted(await events(db)) == sorted(("lesson", c, u) for c, u in crossing)


def rng_position(round_: int, key: tuple[int, int], *, near_end: bool) -> float:
    """After crossing: rewinds and near-end heartbeats again, which must not add events."""
    return 999.0 if (round_ + key[1]) % 2 else float(round_)


# --- the outbox: a real broker, the relay, the monolith's worker ------------------------------------------

RELAY_LEASE_S = 10.0  # the relay's lease in the outbox tests (in-process and `relay --once`)


def with_broker(settings: Settings, broker_url: str, **update: object) -> Settings:
    return settings.model_copy(
        update={
            "celery_broker_url": broker_url,
            "relay_enabled": True,
            "email_publisher": "celery",
            "relay_poll_interval_seconds": 0.5,
            "relay_lease_seconds": RELAY_LEASE_S,
            "celery_publish_timeout_seconds": 5.0,
            "relay_max_backoff_seconds": 1.0,
            **update,
        }
    )


async def post_near_end(client: httpx.AsyncClient, settings: Settings, users: int = 20, lessons: int = 10) -> None:
    """Users 1..users each post a heartbeat near the end of lessons 1..lessons (600 s long): all complete."""
    for user_id in range(1, users + 1):
        headers = auth(make_token(settings, user_id))
        for lesson_id in range(1, lessons + 1):
            response = await client.post(
                "/engagements/progress/lesson", headers=headers, json={"lesson_id": lesson_id, "position": 595}
            )
            assert response.status_code == 201


async def add_events(db: asyncpg.Pool, count: int) -> None:
    """`count` completion events as the flush writes them (users 1..count, lesson 1), none published."""
    await seed(db, users=count, contents=1)
    await db.execute(
        "INSERT INTO progress_completion_event (content_type, content_id, user_id, completed_at) "
        "SELECT 'lesson', 1, i, now() FROM generate_series(1, $1) i",
        count,
    )


def relay_env(servers: Servers, broker: "Broker", **extra: str) -> dict[str, str]:
    defaults = {
        "CELERY_BROKER_URL": broker.url,
        "RELAY_LEASE_SECONDS": str(RELAY_LEASE_S),
        "CELERY_PUBLISH_TIMEOUT_SECONDS": "5",
    }
    return service_env(servers, **{**defaults, **extra})


async def relay_once(
    servers: Servers, broker: "Broker", *, die_at: str = "", **extra: str
) -> tuple[int, dict[str, Any] | None]:
    process = await start_service_command("relay", "--once", env=relay_env(servers, broker, **extra), die_at=die_at)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    summary = json.loads(stdout.decode().splitlines()[-1]) if stdout.strip() else None
    if process.returncode not in (0, 1, -9):
        raise AssertionError(f"relay exited {process.returncode}: {stderr.decode()[-2000:]}")
    return process.returncode, summary


async def limited_broker_user(broker: "Broker") -> str:
    """The URL of a broker user that may not write the queue "forbidden": a publish there gets NOPERM."""
    admin = Redis.from_url(broker.url)
    await admin.execute_command(
        "ACL",
        "SETUSER",
        "relay-limited",
        "on",
        ">limited-password",
        "resetkeys",
        "~onion-progress",
        "~emails",
        "~_kombu.*",
        "+@all",
    )
    await admin.aclose()
    return broker.url.replace("redis://", "redis://relay-limited:limited-password@")


# --- trial-journey emails ---------------------------------------------------------------------------------


@dataclass
class Statements:
    """Every statement the pool's connections sent, as asyncpg's query logger saw it."""

    sql: list[str] = field(default_factory=list)

    async def settled(self) -> list[str]:
        await asyncio.sleep(0)  # the logger runs in a call_soon after each statement
        return self.sql


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
        first_user,
        last_user,
    )
    rows = await db.fetch(
        "INSERT INTO trials_usertrial (user_id, started_at, ends_at) "
        "SELECT i, $3, $4 FROM generate_series($1::bigint, $2::bigint) i ORDER BY i RETURNING id",
        first_user,
        last_user,
        started_at,
        ends_at,
    )
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


async def relayed(db: asyncpg.Pool, timeout_s: float = 10.0) -> None:
    """Until the outbox relay has published every trial email reserved so far (each outbox row marked)."""

    async def nothing_owed() -> bool:
        return not await db.fetchval("SELECT count(*) FROM trial_email_outbox WHERE published_at IS NULL")

    await wait_for(nothing_owed, timeout_s)


# --- status ------------------------------------------------------------------------------------------------


class StatusRun(NamedTuple):
    code: int
    report: dict[str, Any]  # what `status --json` printed
    stderr: str


async def run_status(servers: Servers, **extra: str) -> StatusRun:
    """`progress-service status --json` in its own process, configured from the environment as `serve` is."""
    process = await start_service_command("status", "--json", env=flusher_env(servers, **extra))
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    lines = stdout.decode().splitlines()
    assert len(lines) == 1, stdout.decode() + stderr.decode()  # exactly one JSON object
    return StatusRun(process.returncode, json.loads(lines[0]), stderr.decode())


# --- deployment: what the session servers of tests/deploy hand out ----------------------------------------


@dataclass
class Tls:
    ca: Path
    cert: Path
    key: Path


@dataclass
class PgBouncer:
    port: int
    database: str

    def url(self, **params: str) -> str:
        query = "&".join(f"{key}={value}" for key, value in params.items())
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}" + (f"?{query}" if query else "")


# --- offline sync -------------------------------------------------------------------------------


def ago(seconds: float) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)


def sync_item(
    content_id: int, position: float, listened_at: datetime, content_type: str = "audio"
) -> dict[str, object]:
    return {
        "content_type": content_type,
        "content_id": content_id,
        "position": position,
        "listened_at": listened_at.isoformat(),
    }


def sync_body(items: int) -> bytes:
    return json.dumps({"items": [sync_item(1, 1.0, ago(5)) for _ in range(items)]}).encode()


BAD_SYNCS = [
    pytest.param(json.dumps({"items": [{**sync_item(1, 1.0, ago(5)), "content_type": "podcast"}]}).encode(), 422,
                 "content_type", id="unknown-type"),
    pytest.param(sync_body(501), 422, "500", id="501-items"),
    pytest.param(b'{"items": []}', 422, "items", id="no-items"),
    pytest.param(b"{}", 422, "items", id="no-items-field"),
    pytest.param(json.dumps({"items": [{**sync_item(1, 1.0, ago(5)), "content_id": "1"}]}).encode(), 422,
                 "content_id", id="id-as-string"),
    pytest.param(json.dumps({"items": [{**sync_item(1, 1.0, ago(5)), "content_id": 1.5}]}).encode(), 422,
                 "content_id", id="id-float"),
    pytest.param(json.dumps({"items": [{**sync_item(1, 1.0, ago(5)), "position": -1}]}).encode(), 422,
                 "position", id="position-negative"),
    pytest.param(json.dumps({"items": [{**sync_item(1, 1.0, ago(5)), "listened_at": "2026-01-01T10:00:00"}]}).encode(),
                 422, "listened_at", id="listened-at-without-zone"),
    pytest.param(json.dumps({"items": [{**sync_item(1, 1.0, ago(5)), "listened_at": 1700000000}]}).encode(), 422,
                 "listened_at", id="listened-at-number"),
    pytest.param(json.dumps({"items": [{**sync_item(1, 1.0, ago(5)), "listened_at": "yesterday"}]}).encode(), 422,
                 "listened_at", id="listened-at-text"),
    pytest.param(json.dumps({"items": [{**sync_item(1, 1.0, ago(5)), "listened_at": "1796034445"}]}).encode(), 422,
                 "listened_at", id="listened-at-unix-time-in-a-string"),
    pytest.param(b'{"items": [', 400, "JSON", id="malformed-json"),
]  # fmt: skip


class InsertLog:
    """When Postgres inserted rows into one table: (clock_timestamp of each statement, its rows)."""

    def __init__(self, db: asyncpg.Pool) -> None:
        self.db = db

    async def entries(self) -> list[tuple[float, int]]:
        rows = await self.db.fetch("SELECT extract(epoch FROM at)::float8 AS at, rows FROM test_insert_log ORDER BY at")
        return [(row["at"], row["rows"]) for row in rows]

    async def peak_per_second(self) -> int:
        """The most rows inserted within any one-second window."""
        entries = await self.entries()
        return max(
            (sum(rows for at, rows in entries[i:] if at < start + 1.0) for i, (start, _) in enumerate(entries)),
            default=0,
        )


@asynccontextmanager
async def insert_log(db: asyncpg.Pool, table: str) -> AsyncIterator[InsertLog]:
    """A statement-level trigger on `table` logging the rows each statement inserts, as Postgres counts them."""
    await db.execute(f"""
        CREATE TABLE test_insert_log (at timestamptz NOT NULL, rows bigint NOT NULL);
        CREATE FUNCTION test_log_inserts() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO test_insert_log SELECT clock_timestamp(), count(*) FROM inserted;
            RETURN NULL;
        END $$;
        CREATE TRIGGER test_log_inserts AFTER INSERT ON {table}
            REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION test_log_inserts();
    """)
    try:
        yield InsertLog(db)
    finally:
        await db.execute(f"""
            DROP TRIGGER test_log_inserts ON {table};
            DROP FUNCTION test_log_inserts();
            DROP TABLE test_insert_log;
        """)
