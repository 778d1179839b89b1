"""Flush under a write budget: what a drain of the buffer costs the monolith's own traffic, with and without one.

Users x 10 lessons with their progress rows (the flush updates them), durable Postgres. A stand-in of the monolith
(80 % indexed reads, 20 % single-row updates, open loop, a pool of its own) measures its latency idle, while P `flush
--once` processes drain N pending keys with no budget, and while they drain them again sharing B rows/s. Rows written
per second counted by Postgres (statement triggers). Target: the budgeted drain's p99 within 1.5x the idle p99.

    .venv/bin/python bench/bench_flush_budget.py [--keys 200000] [--flushers 3] [--budget 20000]
        [--load-per-second 500] [--idle-seconds 10] [--no-fsync]
    smallest: --keys 2000 --budget 1000 --load-per-second 100 --idle-seconds 1 --no-fsync
"""

import asyncio
import random
import time
from functools import partial
from typing import Any

import asyncpg
import harness
from redis.asyncio import Redis

LESSONS, STAND_IN = 10, {"application_name": "monolith-stand-in"}  # the write log leaves the stand-in's writes out
# Every flush statement, logged by Postgres itself: when (clock_timestamp) and how many rows.
WRITE_LOG = """
CREATE TABLE bench_write_log (at timestamptz NOT NULL, rows bigint NOT NULL);
CREATE FUNCTION bench_log_writes() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
    IF current_setting('application_name') <> 'monolith-stand-in' THEN
        INSERT INTO bench_write_log SELECT clock_timestamp(), count(*) FROM changed;
    END IF; RETURN NULL; END $$;
""" + "".join(
    f"CREATE TRIGGER bench_log_{event} AFTER {event} ON engagements_lessonprogress REFERENCING NEW TABLE "
    "AS changed FOR EACH STATEMENT EXECUTE FUNCTION bench_log_writes();"
    for event in ("INSERT", "UPDATE")
)
QUERIES = (
    "SELECT position, completed_at FROM engagements_lessonprogress WHERE user_id = $1 AND lesson_id = $2",
    "UPDATE engagements_lessonprogress SET position = position + 1 WHERE user_id = $1 AND lesson_id = $2",
)


async def stand_in(pool: asyncpg.Pool, users: int, per_second: float, stop: asyncio.Event) -> list[tuple[float, float]]:
    """The monolith's queries until `stop`, open loop (a slow answer does not slow the arrivals): (sent at, ms)."""
    rng, samples = random.Random(7), []

    async def one(query: str, user_id: int, lesson_id: int) -> None:
        at, started = time.time(), time.perf_counter()
        await pool.execute(query, user_id, lesson_id)
        samples.append((at, (time.perf_counter() - started) * 1000))

    next_at = time.perf_counter()
    async with asyncio.TaskGroup() as queries:  # waits for the last ones
        while not stop.is_set():
            next_at += 1 / per_second
            queries.create_task(one(QUERIES[rng.random() < 0.2], rng.randrange(users) + 1, rng.randrange(LESSONS) + 1))
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    return samples


def peak_rows_per_s(log: list[tuple[float, int]]) -> int:
    """The most rows written in any one second: a window sliding over the statements."""
    peak, window, first = 0, 0, 0
    for at, rows in log:
        window += rows
        while log[first][0] <= at - 1.0:
            window, first = window - log[first][1], first + 1
        peak = max(peak, window)
    return peak


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def phase(s: harness.Servers, args: harness.Namespace, pool: asyncpg.Pool, budget: int | None) -> list[Any]:
    """[p50, p99, drain time (writing), peak rows/s] of the stand-in idle (budget None) or during a drain (the write
    log read on the stand-in's pool too, outside the measured window)."""
    await pool.execute("TRUNCATE bench_write_log")
    stop = asyncio.Event()
    load = asyncio.create_task(stand_in(pool, -(-args.keys // LESSONS), args.load_per_second, stop))
    started = time.perf_counter()
    if budget is None:
        await asyncio.sleep(args.idle_seconds)
    else:
        flush = partial(asyncio.to_thread, s.command, "flush", "--once", PROGRESS_FLUSH_MAX_ROWS_PER_SECOND=str(budget))
        done = await asyncio.gather(*(flush() for _ in range(args.flushers)))
    drain_s = time.perf_counter() - started
    stop.set()
    samples = await load
    if budget is None:
        return [quantile([ms for _, ms in samples], 0.5), quantile([ms for _, ms in samples], 0.99), "—", "—"]
    if (written := sum(d["written"] for d in done)) < args.keys:
        raise RuntimeError(f"{written} rows written of {args.keys}")
    rows = await pool.fetch("SELECT extract(epoch FROM at)::float8 AS at, rows FROM bench_write_log ORDER BY at")
    log = [(r["at"], r["rows"]) for r in rows]
    # the queries sent while the flush wrote (first to last statement, by Postgres' clock), not those of the
    # flushers' interpreters starting, which on a small machine would be most of the noise
    during = [ms for at, ms in samples if log[0][0] <= at <= log[-1][0]]
    writing_s = log[-1][0] - log[0][0]
    return [quantile(during, 0.5), quantile(during, 0.99), f"{drain_s:.1f} s ({writing_s:.1f} s)", peak_rows_per_s(log)]


async def run(s: harness.Servers, args: harness.Namespace) -> dict[str, list[Any]]:
    users = -(-args.keys // LESSONS)
    # the rows exist already (the monolith's listeners have listened before): the flush updates them
    await harness.seed(s.database_url, users=users, contents=LESSONS, duration_s=3600, rows=True)
    pool = await asyncpg.create_pool(s.database_url, min_size=4, max_size=4, server_settings=STAND_IN)
    redis = Redis.from_url(s.redis_url)
    try:
        await pool.execute(WRITE_LOG)
        harness.say(f"seeded {users} users x {LESSONS} lessons, their rows in place")
        phases = {"idle": await phase(s, args, pool, None)}
        for name, budget in (("unbudgeted drain", 0), (f"budgeted drain, {args.budget:,} rows/s", args.budget)):
            await harness.fill(redis, args.keys, lambda i: 100.0 + i % 400, lessons=LESSONS)
            await pool.execute("CHECKPOINT")
            phases[name] = await phase(s, args, pool, budget)
            harness.say(f"{name}: p50 {phases[name][0]:.2f} ms, p99 {phases[name][1]:.2f} ms, {phases[name][2:]}")
            if left := await harness.buffered(redis):
                raise RuntimeError(f"{name}: {left} keys left in the buffer")
        return phases
    finally:
        await redis.aclose()
        await pool.close()


@harness.main(keys=200_000, flushers=3, budget=20_000, load_per_second=500.0, idle_seconds=10.0, no_fsync=False)
def main(args: harness.Namespace) -> None:
    with harness.servers("flush-budget", postgres=True, durable=not args.no_fsync) as s:
        phases = asyncio.run(run(s, args))
    print(
        f"\n{args.keys:,} pending keys, {args.flushers} `flush --once` processes; stand-in: {args.load_per_second:g} "
        "queries/s (80 % reads, 20 % updates) from a pool of its own"
    )
    harness.table(
        "phase | stand-in p50 | stand-in p99 | drain time (writing) | peak rows/s, any 1 s (counted by Postgres)",
        [[name, f"{p50:.2f} ms", f"{p99:.2f} ms", *rest] for name, (p50, p99, *rest) in phases.items()],
    )
    ratio = list(phases.values())[-1][1] / phases["idle"][1]
    harness.target("stand-in p99, budgeted drain within 1.5x idle", f"{ratio:.2f}x", ratio <= 1.5)
