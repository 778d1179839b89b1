"""Flush: the batched drain of the Redis buffer against a per-entry baseline, on durable Postgres.

N pending keys (the request path's own script) drained by `flush --once`, by one flush cycle in process, and by one
upsert per entry as save_progress did; at 10k, 30k and N keys, 1 and 5 heartbeats per key; verified row by row.

    .venv/bin/python bench/bench_flush.py [--keys 100000] [--baseline-keys N] [--heartbeats-per-key 3] [--repeat 3]
    smallest: --keys 2000 --baseline-keys 500 --repeat 1
"""

import asyncio
import itertools
import math
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

import asyncpg
import harness
from redis.asyncio import Redis

from service.config import Settings
from service.postgres import create_db_pool
from service.progress.completion import completes, completes_sql
from service.progress.content import CONTENT_KINDS
from service.progress.flush.flusher import Flusher
from service.progress.ingest.buffer import decode_value
from service.progress.keys import STANDALONE, parse_member
from service.redis_client import connect_redis

EPOCHS = itertools.count(1)  # each fill's positions differ from the last's
PENDING = STANDALONE.shards_of("lesson")[0].pending_key
# the flush's own speed, with no write budget (bench_flush_budget.py measures it with one)
NO_BUDGET = {"PROGRESS_FLUSH_MAX_ROWS_PER_SECOND": "0"}
LESSONS, DURATION_S = 10, 600  # harness.fill: key i is lesson i % 10 + 1 of user i // 10 + 1
MARGIN_S = Settings.model_fields["progress_completion_margin_seconds"].default  # the flusher's (default)
# One statement per entry, committed on its own, doing what the service's batch does for one row (known
# content only, monotonic upsert, completion event once): one statement where save_progress needed several.
BASELINE_SQL = f"""
WITH upserted AS (
    INSERT INTO engagements_lessonprogress AS p (user_id, lesson_id, position, completed_at, created_at, updated_at)
    SELECT $1::bigint, c.id, $3::float8,
           CASE WHEN {completes_sql("$3::float8", "c.duration", "$5::float8")} THEN $4::timestamptz END,
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


def last_position(i: int, epoch: int) -> float:
    """The last heartbeat's position of key i; about 1 key in 60 lands within the completion margin."""
    return float((i * 7919 + epoch * 104_729) % DURATION_S) + 0.25


@dataclass
class Drain:
    keys: int
    seconds: float
    statements: int
    cpu: dict[int, float]  # CPU seconds by pid

    @property
    def rows_per_s(self) -> float:
        return self.keys / self.seconds

    def us_per_key(self, pid: int | None = None) -> float:
        return (self.cpu.get(pid, 0.0) if pid else self.seconds) / max(1, self.keys) * 1e6


async def drain(s: harness.Servers, db: asyncpg.Connection, redis: Redis, how: str, keys: int, beats: int) -> Drain:
    """Empty tables and buffer, `keys` pending keys of `beats` request-path writes each, drained by `how`, verified."""
    await redis.flushdb()
    tables = ", ".join(kind.progress_table for kind in CONTENT_KINDS)
    await db.execute(f"TRUNCATE {tables}, progress_completion_event RESTART IDENTITY")
    epoch = next(EPOCHS)
    for back in range(beats - 1, -1, -1):  # 10 s apart, ending at last_position
        await harness.fill(redis, keys, lambda i, b=back: max(0.0, last_position(i, epoch) - 10.0 * b))
    if await redis.scard(PENDING) != keys:
        raise RuntimeError(f"fill: not {keys} pending members")
    await db.execute("CHECKPOINT")  # none lands in a drain by chance
    for _ in range(1200):  # a rewrite of the append-only file forks Redis: none during a drain
        if not (await redis.info("persistence")).get("aof_rewrite_in_progress"):
            break
        await asyncio.sleep(0.1)
    stop = harness.cpu_meter(os.getpid(), s.postgres_pid, s.redis_pid)
    started = time.perf_counter()
    if how == "baseline":
        statements = await baseline(db, redis)
    else:
        if how == "process":
            result = await asyncio.to_thread(s.command, "flush", "--once", **NO_BUDGET)
        else:  # one cycle of the service's flusher in this process, on its own connections
            config = harness.settings(s, **NO_BUDGET)
            async with await create_db_pool(config.database) as pool, connect_redis(config.redis) as own:
                result = vars(await Flusher(config.flush, own, pool).flush_cycle())
        if result["written"] != keys or result["failed_batches"] or result["dropped"] or result["expired"]:
            raise RuntimeError(f"{how}: {result}, expected {keys} written")
        statements = result["batches"]  # one upsert statement per batch
    done = Drain(keys, time.perf_counter() - started, statements, stop())
    harness.say(f"{how}, {keys} keys x {beats}: {done.seconds:.2f}s, {done.rows_per_s:,.0f} rows/s")
    await verify(how, db, redis, {(i % LESSONS + 1, i // LESSONS + 1): last_position(i, epoch) for i in range(keys)})
    return done


async def baseline(db: asyncpg.Connection, redis: Redis) -> int:
    statements = 0
    while members := await redis.spop(PENDING, 500):
        for member in members:
            lesson_id, user_id = parse_member(member.decode())
            if (raw := await redis.get(STANDALONE.value_key("lesson", lesson_id, user_id))) is not None:
                stored = decode_value(raw)
                received_at = datetime.fromtimestamp(stored.received_ms / 1000, UTC)
                await db.execute(BASELINE_SQL, user_id, lesson_id, stored.position, received_at, MARGIN_S)
                statements += 1
    return statements


async def verify(how: str, db: asyncpg.Connection, redis: Redis, expected: dict[tuple[int, int], float]) -> None:
    """Every key a row with its last position, one event per completed key, nothing left in Redis."""
    left = await harness.buffered(redis)
    rows = await db.fetch("SELECT lesson_id, user_id, position, completed_at FROM engagements_lessonprogress")
    events = await db.fetch("SELECT content_id, user_id FROM progress_completion_event")
    found = {(r["lesson_id"], r["user_id"]): r["position"] for r in rows}
    completed = {key for key, position in expected.items() if completes(position, DURATION_S, MARGIN_S)}
    event_keys = sorted((r["content_id"], r["user_id"]) for r in events)
    completed_rows = {(r["lesson_id"], r["user_id"]) for r in rows if r["completed_at"]}
    if left or found != expected or event_keys != sorted(completed) or completed_rows != completed:
        positions = "right" if found == expected else "WRONG"
        counts = f"{len(found)} rows ({len(expected)} expected, positions {positions}), {len(events)} events"
        raise RuntimeError(f"{how}: {counts} ({len(completed)} expected), {left} members left in Redis")


async def run(s: harness.Servers, args: harness.Namespace) -> None:
    db, redis = await asyncpg.connect(s.database_url), Redis.from_url(s.redis_url)  # the checks' and the baseline's
    bench = partial(drain, s, db, redis)
    keys, hb = args.keys, args.heartbeats_per_key
    users = math.ceil(max(keys, args.baseline_keys) / LESSONS)
    await harness.seed(s.database_url, users=users, contents=LESSONS, duration_s=DURATION_S)
    await bench("process", 0, 0)  # warm-up: file cache, bytecode
    startup = await bench("process", 0, 0)
    scaling: list[dict[str, Drain]] = []
    for size, repeat in [(n, 1) for n in (10_000, 30_000) if n < keys] + [(keys, args.repeat)]:
        runs = {how: [await bench(how, size, hb) for _ in range(repeat)] for how in ("process", "in-process")}
        scaling.append({how: sorted(ds, key=lambda d: d.seconds)[len(ds) // 2] for how, ds in runs.items()})
    by_beats = [{how: await bench(how, keys, beats) for how in ("process", "in-process")} for beats in (1, 5)]
    baseline = await bench("baseline", args.baseline_keys, hb)
    await redis.aclose()
    await db.close()

    main, flush = scaling[-1]["process"], scaling[-1]["in-process"]
    ratio = main.rows_per_s / baseline.rows_per_s
    print(f"\n{keys:,} pending keys x {hb} heartbeats, verified row by row; median of {args.repeat} drains")
    named = [  # the drains' names in the first table and in the CPU one, their statements
        ("`flush --once`, end to end (process start included)", "`flush --once`", main, f"{main.statements} upserts"),
        ("the same drain in-process (`Flusher.flush_cycle`)", "in-process", flush, f"{flush.statements} upserts"),
        ("baseline, one statement per entry", "baseline", baseline, baseline.statements),
    ]
    rows = [[name, d.keys, d.seconds, d.rows_per_s, statements] for name, _, d, statements in named]
    harness.table(" | keys | seconds | rows/s | statements", [*rows, ["ratio", "", "", f"**{ratio:.1f}x**", ""]])
    print(f"`flush --once` with nothing pending (the process's fixed cost): {startup.seconds:.2f} s")
    pids = (os.getpid(), s.postgres_pid, s.redis_pid, None)  # the flusher, Postgres, Redis, then the wall time
    busy = {short: f"{sum(d.cpu.values()) / d.seconds / (os.cpu_count() or 1):.0%}" for _, short, d, _ in named}
    cpu = [[short, *(d.us_per_key(pid) for pid in pids), busy[short]] for _, short, d, _ in named]
    harness.table("CPU µs per key | flusher | Postgres | Redis | wall | cores busy", cpu)
    grown = [d["in-process"] for d in scaling]
    growth_text = ", ".join(f"{d.keys:,} keys {d.seconds:.2f} s ({d.us_per_key():.1f} µs/key)" for d in grown)
    one, five = by_beats
    beats_text = "; ".join(f"{how} {one[how].seconds:.2f} vs {five[how].seconds:.2f} s" for how in one)
    print(f"\ngrowth, in-process: {growth_text}\nheartbeats per key, 1 vs 5: {beats_text}")
    growth = flush.us_per_key() / grown[0].us_per_key()
    beats = five["in-process"].seconds / one["in-process"].seconds
    harness.target("end to end >= 50,000 rows/s", f"{main.rows_per_s:,.0f}", main.rows_per_s >= 50_000)
    harness.target(">= 20x the per-entry baseline", f"{ratio:.1f}x", ratio >= 20)
    harness.target("linear in keys: µs/key at N <= 1.5x that at the smallest", f"{growth:.2f}x", growth <= 1.5)
    harness.target("not in heartbeats: 5 heartbeats/key <= 1.25x the time of 1", f"{beats:.2f}x", beats <= 1.25)


@harness.main(keys=100_000, baseline_keys=0, heartbeats_per_key=3, repeat=3)
def main(args: harness.Namespace) -> None:
    args.baseline_keys = args.baseline_keys or args.keys
    with harness.servers("flush", postgres=True, durable=True) as s:
        asyncio.run(run(s, args))
