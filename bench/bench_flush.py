"""Flush: the batched drain of the Redis buffer against a per-entry baseline, on durable Postgres.

N pending keys (the request path's own script) drained by `flush --once`, by one flush cycle in process, and by one
upsert per entry as save_progress did; at 10k, 30k and N keys, 1 and 5 heartbeats per key; verified row by row.

    .venv/bin/python bench/bench_flush.py [--keys 100000] [--baseline-keys N] [--heartbeats-per-key 3] [--repeat 3]
    smallest: --keys 2000 --baseline-keys 500 --repeat 1
"""

import argparse
import asyncio
import math
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
import harness
from redis.asyncio import Redis

from service.progress.buffer import decode_value
from service.progress.keys import in_flight_key, latest_position_key, parse_member, pending_flush_key

CORES = os.cpu_count() or 1
LESSONS, DURATION_S, MARGIN_S = 10, 600, 10.0  # harness.fill: key i is lesson i % 10 + 1 of user i // 10 + 1
TABLES = "engagements_lessonprogress, audios_audioprogress, audios_meditationprogress, lives_liveprogress"
# One statement per entry, committed on its own, doing what the service's batch does for one row (known
# content only, monotonic upsert, completion event once): one statement where save_progress needed several.
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


def last_position(i: int, epoch: int) -> float:
    """The last heartbeat's position of key i; about 1 key in 60 lands within the completion margin."""
    return float((i * 7919 + epoch * 104_729) % DURATION_S) + 0.25


@dataclass
class Drain:
    keys: int
    seconds: float
    statements: int
    cpu: harness.CpuMeter

    @property
    def rows_per_s(self) -> float:
        return self.keys / self.seconds

    def us_per_key(self, pid: int | None = None) -> float:
        return (self.cpu.of(pid) if pid else self.seconds) / max(1, self.keys) * 1e6


class Bench:
    def __init__(self, s: harness.Servers, db: asyncpg.Connection) -> None:
        self.s, self.db, self.epoch = s, db, 0
        # the flush's own speed, with no write budget (bench_flush_budget.py measures it with one)
        self.env = {"PROGRESS_FLUSH_MAX_ROWS_PER_SECOND": "0"}
        self.redis = Redis.from_url(s.redis_url)
        self.expected: dict[tuple[int, int], float] = {}

    async def fill(self, keys: int, heartbeats: int) -> None:
        """An empty buffer and tables, then `keys` pending keys of `heartbeats` request-path writes each."""
        await self.redis.flushdb()
        await self.db.execute(f"TRUNCATE {TABLES}, progress_completion_event RESTART IDENTITY")
        self.epoch += 1
        for back in range(heartbeats - 1, -1, -1):  # 10 s apart, ending at last_position
            await harness.fill(self.redis, keys, lambda i, b=back: max(0.0, last_position(i, self.epoch) - 10.0 * b))
        self.expected = {(i % LESSONS + 1, i // LESSONS + 1): last_position(i, self.epoch) for i in range(keys)}
        if await self.redis.scard(pending_flush_key("lesson")) != keys:
            raise RuntimeError(f"fill: not {keys} pending members")

    async def drain(self, how: str, keys: int, heartbeats: int) -> Drain:
        await self.fill(keys, heartbeats)
        await self.db.execute("CHECKPOINT")  # none lands in a drain by chance
        for _ in range(1200):  # a rewrite of the append-only file forks Redis: none during a drain
            if not (await self.redis.info("persistence")).get("aof_rewrite_in_progress"):
                break
            await asyncio.sleep(0.1)
        meter = harness.CpuMeter(os.getpid(), self.s.postgres_pid, self.s.redis_pid)
        started = time.perf_counter()
        if how == "baseline":
            statements = await self.baseline()
        else:
            result = (
                await asyncio.to_thread(self.s.command, "flush", "--once", **self.env)
                if how == "process"
                else vars(await harness.flush_cycle(harness.settings(self.s, **self.env)))
            )
            if result["written"] != keys or result["failed_batches"] or result["dropped"] or result["expired"]:
                raise RuntimeError(f"{how}: {result}, expected {keys} written")
            statements = result["batches"]  # one upsert statement per batch
        drain = Drain(keys, time.perf_counter() - started, statements, meter.stop())
        harness.say(f"{how}, {keys} keys x {heartbeats}: {drain.seconds:.2f}s, {drain.rows_per_s:,.0f} rows/s")
        await self.verify(how)
        return drain

    async def baseline(self) -> int:
        statements = 0
        while members := await self.redis.spop(pending_flush_key("lesson"), 500):
            for member in members:
                lesson_id, user_id = parse_member(member.decode())
                if (raw := await self.redis.get(latest_position_key("lesson", lesson_id, user_id))) is not None:
                    stored = decode_value(raw)
                    received_at = datetime.fromtimestamp(stored.received_ms / 1000, UTC)
                    await self.db.execute(BASELINE_SQL, user_id, lesson_id, stored.position, received_at, MARGIN_S)
                    statements += 1
        return statements

    async def verify(self, how: str) -> None:
        """Every key a row with its last position, one event per completed key, nothing left in Redis."""
        left = [
            await self.redis.scard(pending_flush_key(t)) + await self.redis.zcard(in_flight_key(t))
            for t in ("lesson", "audio", "meditation", "live")
        ]
        rows = await self.db.fetch("SELECT lesson_id, user_id, position, completed_at FROM engagements_lessonprogress")
        events = await self.db.fetch("SELECT content_id, user_id FROM progress_completion_event")
        found = {(r["lesson_id"], r["user_id"]): r["position"] for r in rows}
        completed = {key for key, position in self.expected.items() if position >= DURATION_S - MARGIN_S}
        event_keys = sorted((r["content_id"], r["user_id"]) for r in events)
        completed_rows = {(r["lesson_id"], r["user_id"]) for r in rows if r["completed_at"]}
        if any(left) or found != self.expected or event_keys != sorted(completed) or completed_rows != completed:
            positions = "right" if found == self.expected else "WRONG"
            counts = f"{len(found)} rows ({len(self.expected)} expected, positions {positions}), {len(events)} events"
            raise RuntimeError(f"{how}: {counts} ({len(completed)} expected), {sum(left)} members left in Redis")


async def run(s: harness.Servers, args: argparse.Namespace) -> None:
    bench = Bench(s, await asyncpg.connect(s.database_url))  # the checks' and the baseline's connection
    keys, hb = args.keys, args.heartbeats_per_key
    users = math.ceil(max(keys, args.baseline_keys) / LESSONS)
    await harness.seed(s.database_url, users=users, contents=LESSONS, duration_s=DURATION_S)
    await bench.drain("process", 0, 0)  # warm-up: file cache, bytecode
    startup = await bench.drain("process", 0, 0)
    scaling: list[dict[str, Drain]] = []
    for size in [n for n in (10_000, 30_000) if n < keys] + [keys]:
        runs = {
            how: [await bench.drain(how, size, hb) for _ in range(args.repeat if size == keys else 1)]
            for how in ("process", "in-process")
        }
        scaling.append({how: sorted(drains, key=lambda d: d.seconds)[len(drains) // 2] for how, drains in runs.items()})
    by_beats = [{how: await bench.drain(how, keys, beats) for how in ("process", "in-process")} for beats in (1, 5)]
    baseline = await bench.drain("baseline", args.baseline_keys, hb)
    await bench.redis.aclose()
    await bench.db.close()

    main, flush = scaling[-1]["process"], scaling[-1]["in-process"]
    ratio = main.rows_per_s / baseline.rows_per_s
    print(f"\n{keys:,} pending keys x {hb} heartbeats, verified row by row; median of {args.repeat} drains")
    named = {
        "`flush --once`, end to end (process start included)": main,
        "the same drain in-process (`Flusher.flush_cycle`)": flush,
        "baseline, one statement per entry": baseline,
    }
    rows = [[name, d.keys, d.seconds, d.rows_per_s, f"{d.statements} upserts"] for name, d in named.items()]
    rows[-1][-1] = baseline.statements
    harness.table(" | keys | seconds | rows/s | statements", [*rows, ["ratio", "", "", f"**{ratio:.1f}x**", ""]])
    print(f"`flush --once` with nothing pending (the process's fixed cost): {startup.seconds:.2f} s")
    pids = (os.getpid(), s.postgres_pid, s.redis_pid, None)  # the flusher, Postgres, Redis, then the wall time
    harness.table(
        "CPU µs per key | flusher | Postgres | Redis | wall | cores busy",
        [
            [name, *(d.us_per_key(pid) for pid in pids), f"{sum(d.cpu.seconds.values()) / d.seconds / CORES:.0%}"]
            for name, d in (("`flush --once`", main), ("in-process", flush), ("baseline", baseline))
        ],
    )
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


def main() -> None:
    args = harness.arguments(__doc__, keys=100_000, baseline_keys=0, heartbeats_per_key=3, repeat=3)
    args.baseline_keys = args.baseline_keys or args.keys
    with harness.servers("flush", postgres=True, durable=True) as s:
        asyncio.run(run(s, args))


if __name__ == "__main__":
    harness.main(main)
