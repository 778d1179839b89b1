"""Flush budget benchmark: what a drain of the buffer costs the monolith's own traffic, with and without the budget.

In one run on one machine: starts an embedded Valkey and an embedded Postgres (durable, as production
runs) in a temporary folder unless REDIS_URL / DATABASE_URL are given, applies migrations_ref/, seeds
users x 10 lessons whose progress rows already exist (the flush updates them, as it does in steady
state), then runs a stand-in of the monolith's traffic on the progress table from a pool of its own
(indexed reads by (user_id, lesson_id) and single-row updates, at a steady rate, open loop) and

  * measures its latency idle, with nothing flushing;
  * fills N pending keys through the request path's own write, and drains them with P `flush --once`
    processes and no budget (PROGRESS_FLUSH_MAX_ROWS_PER_SECOND=0);
  * fills them again and drains them with the same processes sharing a budget of B rows/s;

and prints, per phase, the stand-in's p50/p99, the drain time, and the peak rows written in any one
second, counted by Postgres (statement triggers log clock_timestamp() and the rows of each flush
statement). Target: the stand-in's p99 during the budgeted drain within 1.5x its idle p99. Exit 0
when it holds and every key landed, 1 otherwise.

    .venv/bin/python bench/bench_flush_budget.py [--keys 200000] [--flushers 3] [--budget 20000]
        [--load-per-second 500] [--idle-seconds 10] [--no-fsync]
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from redis.asyncio import Redis

from service import embedded
from service.progress.buffer import WRITE_SCRIPT, now_ms, write_args

REPO_DIR = Path(__file__).resolve().parent.parent
LESSONS = 10  # key i is lesson i % 10 + 1 of user i // 10 + 1
FILL_CHUNK = 10_000
TARGET_P99_RATIO = 1.5
STAND_IN = "monolith-stand-in"  # its application_name: the write log leaves its own updates out

# Every flush statement, logged by Postgres itself: when (clock_timestamp) and how many rows.
_WRITE_LOG = """
CREATE TABLE IF NOT EXISTS bench_write_log (at timestamptz NOT NULL, rows bigint NOT NULL);
CREATE OR REPLACE FUNCTION bench_log_writes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('application_name') <> 'monolith-stand-in' THEN
        INSERT INTO bench_write_log SELECT clock_timestamp(), count(*) FROM changed;
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS bench_log_inserts ON engagements_lessonprogress;
DROP TRIGGER IF EXISTS bench_log_updates ON engagements_lessonprogress;
CREATE TRIGGER bench_log_inserts AFTER INSERT ON engagements_lessonprogress
    REFERENCING NEW TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION bench_log_writes();
CREATE TRIGGER bench_log_updates AFTER UPDATE ON engagements_lessonprogress
    REFERENCING NEW TABLE AS changed FOR EACH STATEMENT EXECUTE FUNCTION bench_log_writes();
"""


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@contextmanager
def servers(work_dir: Path, *, durable: bool) -> Iterator[tuple[str, str]]:
    redis_url, database_url = os.environ.get("REDIS_URL"), os.environ.get("DATABASE_URL")
    with ExitStack() as stack:
        if not redis_url:
            valkey = embedded.EmbeddedRedis(work_dir / "valkey", None)
            valkey.start()
            stack.callback(valkey.stop)
            redis_url = valkey.url
        if not database_url:
            pg = embedded.EmbeddedPostgres(work_dir / "postgres", None, durable=durable)
            pg.start()
            stack.callback(pg.stop)
            pg.create_database("progress_bench_budget")
            database_url = pg.url("progress_bench_budget")
        yield redis_url, database_url


@dataclass
class Phase:
    name: str
    latencies_ms: list[float]
    drain_s: float | None = None  # the processes, from exec to exit
    peak_rows_per_s: int | None = None
    writing_s: float | None = None  # first to last flush statement, on Postgres' clock

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class StandIn:
    """The monolith's own traffic on the progress table: 80 % indexed reads, 20 % single-row updates."""

    def __init__(self, pool: asyncpg.Pool, users: int, per_second: float) -> None:
        self._pool, self._users, self._per_second = pool, users, per_second
        self.samples: list[tuple[float, float]] = []  # (wall-clock start, latency ms)

    async def run(self, stop: asyncio.Event) -> None:
        rng = random.Random(7)
        period = 1 / self._per_second
        next_at = time.perf_counter()
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            next_at += period
            # open loop: a slow answer does not slow the arrivals, as the monolith's users do not wait
            task = asyncio.create_task(self._one(rng.randrange(self._users) + 1, rng.randrange(LESSONS) + 1,
                                                 rng.random() < 0.2))  # fmt: skip
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        await asyncio.gather(*tasks)

    async def _one(self, user_id: int, lesson_id: int, update: bool) -> None:
        at, started = time.time(), time.perf_counter()
        if update:
            await self._pool.execute("UPDATE engagements_lessonprogress SET position = position + 1 "
                                     "WHERE user_id = $1 AND lesson_id = $2", user_id, lesson_id)  # fmt: skip
        else:
            await self._pool.fetchrow("SELECT position, completed_at FROM engagements_lessonprogress "
                                      "WHERE user_id = $1 AND lesson_id = $2", user_id, lesson_id)  # fmt: skip
        self.samples.append((at, (time.perf_counter() - started) * 1000))


async def fill(redis: Redis, keys: int) -> None:
    for start in range(0, keys, FILL_CHUNK):
        received = now_ms()
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(start, min(keys, start + FILL_CHUNK)):
                pipe.execute_command(*write_args("lesson", i % LESSONS + 1, i // LESSONS + 1, 100.0 + i % 400,
                                                 received, 3600))  # fmt: skip
            await pipe.execute()


async def write_log(db: asyncpg.Pool) -> list[tuple[float, int]]:
    return [(r["at"], r["rows"]) for r in await db.fetch(
        "SELECT extract(epoch FROM at)::float8 AS at, rows FROM bench_write_log ORDER BY at")]  # fmt: skip


def peak_rows_per_s(entries: list[tuple[float, int]]) -> int:
    peak, window, first = 0, 0, 0
    for at, rows in entries:  # a sliding one-second window over the statements
        window += rows
        while entries[first][0] <= at - 1.0:
            window -= entries[first][1]
            first += 1
        peak = max(peak, window)
    return peak


async def drain(args: argparse.Namespace, redis_url: str, database_url: str, budget: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROGRESS_", "REDIS_", "DATABASE_"))}
    env.update(REDIS_URL=redis_url, DATABASE_URL=database_url, LOG_LEVEL="WARNING",
               PROGRESS_FLUSH_MAX_ROWS_PER_SECOND=str(budget))  # fmt: skip
    started = time.perf_counter()
    processes = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "flush", "--once", cwd=REPO_DIR, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE) for _ in range(args.flushers)]  # fmt: skip
    outputs = await asyncio.gather(*(process.communicate() for process in processes))
    seconds = time.perf_counter() - started
    written = 0
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"flush --once exited {process.returncode}: {stderr.decode()[-2000:]}")
        written += json.loads(stdout.decode().strip().splitlines()[-1])["written"]
    if written < args.keys:
        raise RuntimeError(f"{written} rows written of {args.keys}")
    return seconds


async def measured(name: str, db: asyncpg.Pool, stand_in_pool: asyncpg.Pool, users: int, args: argparse.Namespace,
                   work: asyncio.Future[float] | None) -> Phase:  # fmt: skip
    await db.execute("TRUNCATE bench_write_log")
    stand_in, stop = StandIn(stand_in_pool, users, args.load_per_second), asyncio.Event()
    load = asyncio.create_task(stand_in.run(stop))
    drain_s = None
    if work is None:
        await asyncio.sleep(args.idle_seconds)
    else:
        drain_s = await work
    stop.set()
    await load
    if work is None:
        phase = Phase(name, [latency for _, latency in stand_in.samples])
    else:
        # the queries sent while the flush wrote (first to last statement, on Postgres' clock): not those
        # of the flushers' interpreters starting, which on a small machine would be most of the noise
        entries = await write_log(db)
        first, last = entries[0][0], entries[-1][0]
        during = [latency for at, latency in stand_in.samples if first <= at <= last]
        phase = Phase(name, during, drain_s, peak_rows_per_s(entries), last - first)
    drained = "" if work is None else (f"; drain {drain_s:.1f} s (writing {phase.writing_s:.1f} s), "
                                       f"peak {phase.peak_rows_per_s:,} rows/s")  # fmt: skip
    say(f"{name}: p50 {phase.quantile(0.5):.2f} ms, p99 {phase.quantile(0.99):.2f} ms over "
        f"{len(phase.latencies_ms)} queries{drained}")
    return phase


async def run(args: argparse.Namespace, redis_url: str, database_url: str) -> list[Phase]:
    await embedded.prepare_database(database_url, seed=False)
    users = -(-args.keys // LESSONS)
    redis = Redis.from_url(redis_url)
    db = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    stand_in_pool = await asyncpg.create_pool(database_url, min_size=4, max_size=4,
                                              server_settings={"application_name": STAND_IN})  # fmt: skip
    try:
        await db.execute("TRUNCATE engagements_lessonprogress, progress_completion_event, users_user, courses_lesson "
                         "RESTART IDENTITY CASCADE")  # fmt: skip
        await db.execute("INSERT INTO users_user (id, email) SELECT i, 'u' || i || '@example.com' "
                         "FROM generate_series(1, $1) i", users)  # fmt: skip
        await db.execute("INSERT INTO courses_lesson (id, title, duration) SELECT i, 'lesson ' || i, 3600 "
                         "FROM generate_series(1, $1) i", LESSONS)  # fmt: skip
        # the rows exist already (the monolith's listeners have listened before): the flush updates them
        await db.execute("INSERT INTO engagements_lessonprogress (user_id, lesson_id, position, created_at, "
                         "updated_at) SELECT u, l, 1, now() - interval '1 day', now() - interval '1 day' "
                         "FROM generate_series(1, $1) u, generate_series(1, $2) l", users, LESSONS)  # fmt: skip
        await db.execute("VACUUM ANALYZE engagements_lessonprogress")
        await db.execute(_WRITE_LOG)
        await redis.flushdb()
        await redis.script_load(WRITE_SCRIPT)
        say(f"seeded {users} users x {LESSONS} lessons, their rows in place")
        phases = [await measured("idle", db, stand_in_pool, users, args, None)]
        for name, budget in (("unbudgeted drain", 0), (f"budgeted drain ({args.budget:,} rows/s)", args.budget)):
            await fill(redis, args.keys)
            await db.execute("CHECKPOINT")
            work = asyncio.ensure_future(drain(args, redis_url, database_url, budget))
            phases.append(await measured(name, db, stand_in_pool, users, args, work))
            left = await redis.scard("progress:pending_flush:lesson") + await redis.zcard("progress:in_flight:lesson")
            if left:
                raise RuntimeError(f"{name}: {left} keys left in the buffer")
        return phases
    finally:
        await db.execute("DROP TRIGGER IF EXISTS bench_log_inserts ON engagements_lessonprogress; "
                         "DROP TRIGGER IF EXISTS bench_log_updates ON engagements_lessonprogress")  # fmt: skip
        await stand_in_pool.close()
        await db.close()
        await redis.aclose()


def report(phases: list[Phase], args: argparse.Namespace) -> bool:
    print(f"\n{args.keys:,} pending keys, {args.flushers} `flush --once` processes; stand-in: "
          f"{args.load_per_second:g} queries/s (80 % reads, 20 % updates) from a pool of its own\n")
    print("| phase | stand-in p50 | stand-in p99 | drain time (writing) | peak rows/s (any 1 s, counted by Postgres) |")
    print("|---|---|---|---|---|")
    for phase in phases:
        drain_s = f"{phase.drain_s:.1f} s ({phase.writing_s:.1f} s)" if phase.drain_s is not None else "—"
        peak = f"{phase.peak_rows_per_s:,}" if phase.peak_rows_per_s is not None else "—"
        print(f"| {phase.name} | {phase.quantile(0.5):.2f} ms | {phase.quantile(0.99):.2f} ms | {drain_s} | {peak} |")
    idle, budgeted = phases[0], phases[-1]
    ratio = budgeted.quantile(0.99) / idle.quantile(0.99)
    held = ratio <= TARGET_P99_RATIO
    print(f"\nstand-in p99, budgeted drain / idle: {ratio:.2f}x (target <= {TARGET_P99_RATIO}x): "
          f"{'PASS' if held else 'FAIL'}")
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, default=200_000, help="pending keys per drain (200000)")
    parser.add_argument("--flushers", type=int, default=3, help="`flush --once` processes per drain (3)")
    parser.add_argument("--budget", type=int, default=20_000, help="PROGRESS_FLUSH_MAX_ROWS_PER_SECOND (20000)")
    parser.add_argument("--load-per-second", type=float, default=500.0, help="the stand-in's queries/s (500)")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="how long the idle phase lasts (10)")
    parser.add_argument("--no-fsync", action="store_true", help="embedded Postgres with fsync off (as the tests)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module="platformdirs.*")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the servers started here are stopped
    work_dir = Path(tempfile.mkdtemp(prefix="progress-bench-budget-"))
    try:
        with servers(work_dir, durable=not args.no_fsync) as (redis_url, database_url):
            phases = asyncio.run(run(args, redis_url, database_url))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0 if report(phases, args) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
