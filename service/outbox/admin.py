"""Parked outbox rows, for people on call: list them, and re-drive them (owed again, same task ids).

A row is parked when the broker refused it OUTBOX_MAX_ATTEMPTS times (publish_failed_at set,
publish_error the last refusal). A re-drive clears publish_failed_at and the lease, so the relay
claims the row again and publishes it with the task id it always had; its attempts are kept, so a
row refused again is parked again at once (Sidekiq's dead set behaves the same way). Every statement
here is short and commits on its own: the relay never claims a parked row, so it never waits on one
of these, and nothing here holds a transaction open. A row already published is never touched.
"""

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime

import asyncpg

from service.outbox.outboxes import Outbox

# rows per re-drive statement: each is a few milliseconds of row locks on rows no relay wants
REDRIVE_CHUNK = 500

# newest first, through the parked index (migrations_ref/006_outbox_counts.sql)
_LIST_SQL = """
SELECT {key} AS id, publish_error AS error, publish_failed_at AS failed_at, publish_attempts AS attempts
  FROM {table} WHERE {parked} AND ($2::bigint[] IS NULL OR {key} = ANY($2::bigint[]))
 ORDER BY publish_failed_at DESC, {key} DESC
 LIMIT $1
"""
_COUNT_SQL = """
SELECT count(*) FROM {table} WHERE {parked} AND ($1::bigint[] IS NULL OR {key} = ANY($1::bigint[]))
"""
# One chunk: the next parked rows after key $1 (at most $2; only ids $3 when given) made owed again, the relay woken.
# The chunk locks its rows itself (FOR UPDATE after its ORDER BY), in key order, so two re-drives cannot deadlock;
# an UPDATE ... FROM an unlocked chunk would lock in the join order the planner picks (heap or index order). A row
# another re-drive made owed while we waited is re-checked once locked and skipped (counted once); `last` moves past.
_REDRIVE_SQL = """
WITH chunk AS MATERIALIZED (
    SELECT {key} AS id FROM {table}
     WHERE {parked} AND {key} > $1 AND ($3::bigint[] IS NULL OR {key} = ANY($3::bigint[]))
     ORDER BY {key}
     LIMIT $2
       FOR UPDATE
), redriven AS (
    UPDATE {table} o SET publish_failed_at = NULL, claimed_until = NULL
      FROM chunk
     WHERE o.{key} = chunk.id AND o.publish_failed_at IS NOT NULL AND o.published_at IS NULL
    RETURNING o.{key}
)
SELECT (SELECT max(id) FROM chunk) AS last, count(*) AS redriven,
       (SELECT count(pg_notify('{channel}', 'redrive')) FROM (SELECT 1 FROM redriven LIMIT 1) r) AS notified
  FROM redriven
"""


@dataclass(frozen=True, slots=True)
class ParkedRow:
    outbox: str
    id: int
    error: str | None  # publish_error: the broker's last refusal
    failed_at: datetime
    attempts: int

    def as_json(self) -> dict[str, object]:
        return asdict(self) | {"failed_at": self.failed_at.isoformat()}


async def list_parked(
    conn: asyncpg.Connection | asyncpg.Pool, outboxes: Sequence[Outbox], *, limit: int, ids: Sequence[int] | None = None
) -> list[ParkedRow]:
    """The `limit` most recently parked rows of `outboxes` (only `ids`, when given), newest first."""
    found: list[ParkedRow] = []
    for outbox in outboxes:
        rows = await conn.fetch(outbox.sql(_LIST_SQL), limit, ids)
        found += [ParkedRow(outbox.name, row["id"], row["error"], row["failed_at"], row["attempts"]) for row in rows]
    found.sort(key=lambda row: (row.failed_at, row.id), reverse=True)
    return found[:limit]


async def count_parked(
    conn: asyncpg.Connection | asyncpg.Pool, outbox: Outbox, ids: Sequence[int] | None = None
) -> int:
    """What a re-drive of `outbox` (only `ids`, when given) would touch now."""
    return int(await conn.fetchval(outbox.sql(_COUNT_SQL), ids))


async def redrive_parked(
    conn: asyncpg.Connection | asyncpg.Pool,
    outbox: Outbox,
    *,
    ids: Sequence[int] | None = None,
    chunk: int = REDRIVE_CHUNK,
    on_chunk: Callable[[int], None] = lambda _: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Make the parked rows of `outbox` (only `ids`, when given) owed again, chunk by chunk; returns how many.

    `on_chunk(count)` after each chunk (a progress meter); `should_stop` is asked between chunks
    (SIGTERM): what is done is done, the rest stays parked for the next run.
    """
    after, total = 0, 0
    while not should_stop():
        row = await conn.fetchrow(outbox.sql(_REDRIVE_SQL), after, chunk, ids)
        if row is None or row["last"] is None:
            break
        after = row["last"]
        total += row["redriven"]
        on_chunk(row["redriven"])
    return total
