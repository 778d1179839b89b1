"""Reservation of one worst-case batch (200 trials x 6 due emails = 1200 pairs): blocks vs get_or_create.

In one run, on the same database and the same connection, reserves the same 1200 pairs twice:

  blocks         the service's design: reserve_block(), one INSERT ... ON CONFLICT DO NOTHING
                 RETURNING per RESERVATION_BLOCK_SIZE (200) pairs, 6 statements in all;
  get_or_create  the monolith's baseline: per email, a SELECT of the row, then an INSERT when it
                 is missing (what Django's get_or_create does, minus its transaction and savepoint,
                 so the baseline is if anything flattered).

It counts the statements each issues (asyncpg's query logger, in an untimed pass that also checks
both reserve all 1200), then times the reservation step alone over --repeats runs and prints the
median wall time of each and the ratios. Publishing to the queue is not part of it.

    .venv/bin/python bench/bench_trial_emails.py [--repeats 7] [--no-fsync]

Without DATABASE_URL it starts an embedded Postgres in a temporary folder, durable like production
(fsync on) unless --no-fsync. With DATABASE_URL it uses that database, migrated with
migrations_ref/, and touches only the rows of its own users (ids from 2_000_000_001).
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg

from service import embedded
from service.trial_emails.journey import SOURCE
from service.trial_emails.reservations import (
    Pair,
    load_sent_keys,
    load_trials,
    pending_reservations,
    reserve_block,
)

TRIALS = 200
BLOCK_SIZE = 200
FIRST_USER = 2_000_000_001
LAST_USER = FIRST_USER + TRIALS - 1

# targets of the issue
TARGET_BLOCK_STATEMENTS = 6
TARGET_SPEEDUP = 10.0

GET_SQL = "SELECT id FROM emails_emaildispatch WHERE user_id = $1 AND source = $2 AND email_key = $3"
CREATE_SQL = """
INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at)
VALUES ($1, $2, $3, $4, $4)
RETURNING id
"""

Reserve = Callable[[asyncpg.Connection, Sequence[Pair]], Awaitable[int]]


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def reserve_in_blocks(conn: asyncpg.Connection, pairs: Sequence[Pair]) -> int:
    reserved = 0
    for start in range(0, len(pairs), BLOCK_SIZE):
        reserved += len(await reserve_block(conn, pairs[start : start + BLOCK_SIZE], datetime.now(UTC)))
    return reserved


async def get_or_create_each(conn: asyncpg.Connection, pairs: Sequence[Pair]) -> int:
    reserved = 0
    for user_id, email_key in pairs:
        if await conn.fetchval(GET_SQL, user_id, SOURCE, email_key) is None:
            await conn.fetchval(CREATE_SQL, user_id, SOURCE, email_key, datetime.now(UTC))
            reserved += 1
    return reserved


async def seed(conn: asyncpg.Connection) -> list[Pair]:
    """The bench's users, each with a trial that owes all six emails; returns the 1200 pairs."""
    await clear(conn, trials_too=True)
    now = datetime.now(UTC)
    await conn.execute(
        "INSERT INTO users_user (id, email) SELECT i, 'bench' || i || '@example.com' "
        "FROM generate_series($1::bigint, $2::bigint) i",
        FIRST_USER, LAST_USER,
    )  # fmt: skip
    ids = await conn.fetch(
        "INSERT INTO trials_usertrial (user_id, started_at, ends_at) "
        "SELECT i, $3, $4 FROM generate_series($1::bigint, $2::bigint) i RETURNING id",
        FIRST_USER, LAST_USER, now - timedelta(days=7), now - timedelta(hours=1),
    )  # fmt: skip
    trials = await load_trials(conn, [row["id"] for row in ids])
    return pending_reservations(trials, await load_sent_keys(conn, (t.user_id for t in trials)), now)


async def clear(conn: asyncpg.Connection, *, trials_too: bool = False) -> None:
    await conn.execute("DELETE FROM emails_emaildispatch WHERE user_id BETWEEN $1 AND $2", FIRST_USER, LAST_USER)
    if trials_too:
        await conn.execute("DELETE FROM trials_usertrial WHERE user_id BETWEEN $1 AND $2", FIRST_USER, LAST_USER)
        await conn.execute("DELETE FROM users_user WHERE id BETWEEN $1 AND $2", FIRST_USER, LAST_USER)
    # both designs start from a table without the previous run's dead rows
    await conn.execute("VACUUM emails_emaildispatch")


async def count_statements(conn: asyncpg.Connection, reserve: Reserve, pairs: Sequence[Pair]) -> int:
    await clear(conn)
    statements: list[str] = []

    def record(query: asyncpg.connection.LoggedQuery) -> None:
        statements.append(query.query)

    conn.add_query_logger(record)
    try:
        reserved = await reserve(conn, pairs)
    finally:
        conn.remove_query_logger(record)
    await asyncio.sleep(0)  # the logger runs in a call_soon after each statement
    if reserved != len(pairs):
        raise SystemExit(f"{reserve.__name__} reserved {reserved} of {len(pairs)} pairs")
    return len(statements)


async def time_once(conn: asyncpg.Connection, reserve: Reserve, pairs: Sequence[Pair]) -> float:
    await clear(conn)
    started = time.perf_counter()
    await reserve(conn, pairs)
    return (time.perf_counter() - started) * 1000


@dataclass
class Figures:
    name: str
    statements: int
    runs_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.runs_ms)


async def measure(dsn: str, repeats: int) -> tuple[Figures, Figures]:
    conn = await asyncpg.connect(dsn)
    try:
        pairs = await seed(conn)
        say(f"{len(pairs)} pairs to reserve ({TRIALS} trials x 6 emails)")
        designs: list[tuple[str, Reserve]] = [("blocks", reserve_in_blocks), ("get_or_create", get_or_create_each)]
        figures = {name: Figures(name, await count_statements(conn, reserve, pairs), []) for name, reserve in designs}
        for run in range(repeats):
            # alternate the order, so neither design always runs on a warmer cache
            for name, reserve in designs if run % 2 == 0 else designs[::-1]:
                figures[name].runs_ms.append(await time_once(conn, reserve, pairs))
            say(f"run {run + 1}/{repeats}: " + ", ".join(f"{f.name} {f.runs_ms[-1]:.1f} ms" for f in figures.values()))
        await clear(conn, trials_too=True)
        return figures["blocks"], figures["get_or_create"]
    finally:
        await conn.close()


def report(blocks: Figures, baseline: Figures, *, durable: bool) -> bool:
    statement_ratio = baseline.statements / blocks.statements
    speedup = baseline.median_ms / blocks.median_ms
    fsync = "on" if durable else "off"
    print(f"\nreservation of {TRIALS * 6} pairs, median of {len(blocks.runs_ms)} runs, fsync {fsync}")
    print(f"{'design':<15} {'statements':>10} {'wall ms':>10} {'min ms':>10}")
    for figures in (blocks, baseline):
        print(f"{figures.name:<15} {figures.statements:>10} {figures.median_ms:>10.1f} {min(figures.runs_ms):>10.1f}")
    print(f"{'ratio':<15} {statement_ratio:>9.0f}x {speedup:>9.1f}x")
    met = blocks.statements == TARGET_BLOCK_STATEMENTS and speedup >= TARGET_SPEEDUP
    print(
        f"targets: {TARGET_BLOCK_STATEMENTS} statements (got {blocks.statements}), "
        f">= {TARGET_SPEEDUP:.0f}x wall time (got {speedup:.1f}x): {'met' if met else 'NOT MET'}"
    )
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-fsync", action="store_true", help="embedded Postgres without fsync (as the tests)")
    args = parser.parse_args()
    dsn = os.environ.get("DATABASE_URL")
    durable = not args.no_fsync
    with tempfile.TemporaryDirectory(prefix="bench-trial-emails-") as tmp:
        pg = None
        if not dsn:
            pg = embedded.EmbeddedPostgres(Path(tmp) / "postgres", None, durable=durable)
            say(f"starting embedded Postgres on 127.0.0.1:{pg.port} (fsync {'on' if durable else 'off'})")
            pg.start()
            pg.create_database("trial_emails_bench")
            dsn = pg.url("trial_emails_bench")
        try:
            asyncio.run(embedded.prepare_database(dsn, seed=False))
            blocks, baseline = asyncio.run(measure(dsn, args.repeats))
        finally:
            if pg is not None:
                pg.stop()
    return 0 if report(blocks, baseline, durable=durable) else 1


if __name__ == "__main__":
    sys.exit(main())
