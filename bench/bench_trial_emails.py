"""Reservation of a worst-case batch (200 trials x 6 emails = 1,200 pairs): blocks against get_or_create.

reserve_block() (one INSERT ... ON CONFLICT DO NOTHING RETURNING per 200 pairs) against a SELECT then INSERT per
email, on one connection, for users from id 2,000,000,001: statements counted, then alternating timed runs.

    .venv/bin/python bench/bench_trial_emails.py [--repeats 7] [--no-fsync]
    smallest: --repeats 1 --no-fsync
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from datetime import UTC, datetime, timedelta

import asyncpg
import harness

from service.trial_emails.batch import reserve_in_blocks
from service.trial_emails.journey import SOURCE
from service.trial_emails.reservations import Pair, load_sent_keys, load_trials, pending_reservations

TRIALS, BLOCK_SIZE, FIRST_USER = 200, 200, 2_000_000_001
LAST_USER = FIRST_USER + TRIALS - 1
# users FIRST_USER..LAST_USER, each with a trial started at $3 and ended at $4: the trials' ids
TRIALS_SQL = """WITH users AS (
    INSERT INTO users_user (id, email) SELECT i, 'bench' || i || '@example.com'
    FROM generate_series($1::bigint, $2::bigint) i RETURNING id
)
INSERT INTO trials_usertrial (user_id, started_at, ends_at) SELECT id, $3, $4 FROM users RETURNING id"""
Reserve = Callable[[asyncpg.Connection, Sequence[Pair]], Awaitable[int]]


async def blocks(conn: asyncpg.Connection, pairs: Sequence[Pair]) -> int:
    return await reserve_in_blocks(conn, pairs, block_size=BLOCK_SIZE)


GET = "SELECT id FROM emails_emaildispatch WHERE user_id = $1 AND source = $2 AND email_key = $3"
CREATE = """INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at)
    VALUES ($1, $2, $3, $4, $4) RETURNING id"""


async def get_or_create(conn: asyncpg.Connection, pairs: Sequence[Pair]) -> int:
    reserved = 0
    for user_id, email_key in pairs:
        if await conn.fetchval(GET, user_id, SOURCE, email_key) is None:
            await conn.fetchval(CREATE, user_id, SOURCE, email_key, datetime.now(UTC))
            reserved += 1
    return reserved


async def measure(dsn: str, repeats: int) -> dict[str, tuple[int, list[float]]]:
    """(statements, run ms) of each design, on a database of its own (harness.servers): no user nor trial before."""
    conn = await asyncpg.connect(dsn)
    try:
        now = datetime.now(UTC)
        ids = await conn.fetch(TRIALS_SQL, FIRST_USER, LAST_USER, now - timedelta(days=7), now - timedelta(hours=1))
        trials = await load_trials(conn, [row["id"] for row in ids])
        pairs = pending_reservations(trials, await load_sent_keys(conn, (t.user_id for t in trials)), now)
        harness.say(f"{len(pairs)} pairs to reserve ({TRIALS} trials x 6 emails)")

        async def run(reserve: Reserve, count: bool = False) -> float:
            await conn.execute("DELETE FROM emails_emaildispatch")  # the last run's reservations: the database is ours
            await conn.execute("VACUUM emails_emaildispatch")  # both start without the last run's dead rows
            statements: list[object] = []
            with conn.query_logger(statements.append) if count else nullcontext():
                started = time.perf_counter()
                reserved = await reserve(conn, pairs)
                elapsed = (time.perf_counter() - started) * 1000
            await asyncio.sleep(0)  # the logger runs in a call_soon after each statement
            if reserved != len(pairs):
                raise RuntimeError(f"{reserve.__name__} reserved {reserved} of {len(pairs)} pairs")
            return len(statements) if count else elapsed

        designs: dict[str, Reserve] = {"blocks": blocks, "get_or_create": get_or_create}
        counted = {name: int(await run(reserve, count=True)) for name, reserve in designs.items()}
        times: dict[str, list[float]] = {name: [] for name in designs}
        for order in harness.orders(list(designs), repeats):  # alternating: neither always on a warmer cache
            for name in order:
                times[name].append(await run(designs[name]))
        return {name: (counted[name], times[name]) for name in designs}
    finally:
        await conn.close()


@harness.main(repeats=7, no_fsync=False)
def main(args: harness.Namespace) -> None:
    with harness.servers("trial-emails", redis=False, postgres=True, durable=not args.no_fsync) as s:
        figures = asyncio.run(measure(s.database_url, args.repeats))
    (block_statements, block_ms), (baseline_statements, baseline_ms) = figures.values()
    speedup = harness.median(baseline_ms) / harness.median(block_ms)
    fsync = "off" if args.no_fsync else "on"
    print(f"\nreservation of {TRIALS * 6:,} pairs, median of {args.repeats} runs, fsync {fsync}")
    harness.table(
        "design | statements | median ms | min ms",
        [[name, n, harness.median(ms), min(ms)] for name, (n, ms) in figures.items()]
        + [["ratio", f"{baseline_statements / block_statements:.0f}x", f"**{speedup:.1f}x**", ""]],
    )
    harness.target("6 statements", str(block_statements), block_statements == 6)
    harness.target(">= 10x wall time", f"{speedup:.1f}x", speedup >= 10)
