"""Persisting a batch of latest positions into the monolith's progress tables: one statement per batch."""

import logging
from dataclasses import dataclass, field, replace

import asyncpg

from service import metrics
from service.outbox.outboxes import NOTIFY_CHANNEL
from service.progress.completion import completes_sql
from service.progress.content import ContentKind
from service.progress.keys import parse_member

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    content_id: int
    user_id: int
    position: float
    # stamped by Redis (ms, microsecond fraction); None: by the database's clock_timestamp() (degraded mode)
    received_ms: float | None
    peak: float  # the furthest position heard since the value was first written: decides completion
    # an offline item's: its completion is dated no earlier (receipt - 6 h), see buffer.py
    completion_floor_ms: int | None = None


@dataclass(frozen=True, slots=True)
class BatchResult:
    written: int  # rows inserted or moved forward
    completions: int  # completion events created by this batch
    dropped: list[str]  # "content_id:user_id" of heartbeats for a user or content that does not exist
    # "content_id:user_id" left out because another session holds a row they need: neither written nor dropped
    locked: list[str] = field(default_factory=list)
    held_users: list[int] = field(default_factory=list)  # of those, the users whose row was held
    held_content: list[int] = field(default_factory=list)  # ... and the content whose row was held


# One statement, so the upsert and its completion events commit together or not at all.
# - A heartbeat stamped by Redis is dated by it; one written straight to Postgres (degraded mode, no
#   receive time) by clock_timestamp(): only the stores' clocks date a row, never a pod's.
# - `known` drops heartbeats whose user or content does not exist, instead of failing the batch
#   (the monolith's foreign keys are deferred: a bad row would only fail at COMMIT, for everyone).
# - No lock is waited for (SKIP LOCKED never waits, so it cannot deadlock; the rest of the batch is
#   written and the keys left out stay pending): the existing progress rows another session holds
#   (the monolith's select_for_update, an admin edit, an idle transaction), and the user and content
#   rows held FOR UPDATE. Those take FOR KEY SHARE here, the lock the foreign key's check takes at
#   commit: taken up front, a user held FOR UPDATE holds back that user's keys only, not the batch.
# - position/updated_at only move forward; completed_at is set by any heartbeat whose peak reached
#   the margin, even a late one, and never cleared. An offline item's updated_at is when it was heard
#   (so an older listen never replaces a newer position), its completed_at no earlier than its floor
#   ($8, NULL for a heartbeat; GREATEST ignores a NULL): the one date the monolith's journey acts on.
# - an event is written only where this statement set completed_at (a row the monolith completed
#   before gets none), and the UNIQUE key makes it one per (type, content, user), ever, whatever
#   retries, redeliveries or concurrent pods do.
_UPSERT_SQL = """
WITH incoming AS (
    SELECT content_id, user_id, position, peak,
           COALESCE(to_timestamp(received_ms / 1000.0), clock_timestamp()) AS received_at,
           to_timestamp(floor_ms / 1000.0) AS floor_at
    FROM unnest($1::bigint[], $2::bigint[], $3::float8[], $4::float8[], $7::float8[], $8::float8[])
        AS h(content_id, user_id, position, received_ms, peak, floor_ms)  -- $4: ms, microsecond fraction
), users AS (
    SELECT u.id FROM users_user u WHERE u.id = ANY($2::bigint[]) FOR KEY SHARE SKIP LOCKED
), contents AS (
    SELECT c.id, c.duration FROM {content_table} c WHERE c.id = ANY($1::bigint[]) FOR KEY SHARE SKIP LOCKED
), lockable AS (
    SELECT p.user_id, p.{id_column} AS content_id FROM {progress_table} p
    JOIN incoming h ON p.user_id = h.user_id AND p.{id_column} = h.content_id
    FOR UPDATE OF p SKIP LOCKED
), known AS (
    SELECT h.content_id, h.user_id, h.position, h.received_at,
           CASE WHEN {completes} THEN GREATEST(h.received_at, h.floor_at) END AS completed_at
    FROM incoming h
    JOIN contents c ON c.id = h.content_id
    JOIN users u ON u.id = h.user_id
    WHERE EXISTS (SELECT 1 FROM lockable l WHERE l.user_id = h.user_id AND l.content_id = h.content_id)
       OR NOT EXISTS (SELECT 1 FROM {progress_table} p WHERE p.user_id = h.user_id AND p.{id_column} = h.content_id)
), upserted AS (
    INSERT INTO {progress_table} AS p (user_id, {id_column}, position, completed_at, created_at, updated_at)
    SELECT user_id, content_id, position, completed_at, received_at, received_at FROM known
    ORDER BY user_id, content_id  -- one lock order for every batch: overlapping batches cannot deadlock
    ON CONFLICT (user_id, {id_column}) DO UPDATE SET
        position = CASE WHEN p.updated_at < EXCLUDED.updated_at THEN EXCLUDED.position ELSE p.position END,
        updated_at = GREATEST(p.updated_at, EXCLUDED.updated_at),
        completed_at = COALESCE(p.completed_at, EXCLUDED.completed_at)
    WHERE p.updated_at < EXCLUDED.updated_at
       OR (p.completed_at IS NULL AND EXCLUDED.completed_at IS NOT NULL)
    RETURNING p.{id_column} AS content_id, p.user_id, p.completed_at
), events AS (
    INSERT INTO progress_completion_event (content_type, content_id, user_id, completed_at, created_at)
    SELECT $6::text, u.content_id, u.user_id, u.completed_at, now()
    FROM upserted u JOIN known k USING (content_id, user_id)
    WHERE u.completed_at = k.completed_at  -- set by this heartbeat, not by an earlier writer
    ON CONFLICT (content_type, content_id, user_id) DO NOTHING
    RETURNING 1
), unknown AS (
    SELECT h.content_id, h.user_id FROM incoming h
    WHERE NOT EXISTS (SELECT 1 FROM users_user u WHERE u.id = h.user_id)
       OR NOT EXISTS (SELECT 1 FROM {content_table} c WHERE c.id = h.content_id)
)
SELECT
    (SELECT count(*) FROM upserted) AS written,
    -- wakes the outbox relay (service.outbox) when events were written; delivered at commit only
    (SELECT count(pg_notify('{notify_channel}', 'completion')) FROM (SELECT 1 FROM events LIMIT 1) e) AS notified,
    (SELECT count(*) FROM events) AS completions,
    ARRAY(SELECT x.content_id || ':' || x.user_id FROM unknown x) AS dropped,
    ARRAY(
        SELECT h.content_id || ':' || h.user_id FROM incoming h
        WHERE NOT EXISTS (SELECT 1 FROM known k WHERE k.content_id = h.content_id AND k.user_id = h.user_id)
          AND NOT EXISTS (SELECT 1 FROM unknown x WHERE x.content_id = h.content_id AND x.user_id = h.user_id)
    ) AS locked,
    ARRAY(
        SELECT DISTINCT h.user_id FROM incoming h JOIN users_user u ON u.id = h.user_id
        WHERE NOT EXISTS (SELECT 1 FROM users l WHERE l.id = h.user_id) ORDER BY 1
    ) AS held_users,
    ARRAY(
        SELECT DISTINCT h.content_id FROM incoming h JOIN {content_table} c ON c.id = h.content_id
        WHERE NOT EXISTS (SELECT 1 FROM contents l WHERE l.id = h.content_id) ORDER BY 1
    ) AS held_content
"""


def upsert_sql(kind: ContentKind) -> str:
    tables = {"content_table": kind.content_table, "progress_table": kind.progress_table, "id_column": kind.id_column}
    completes = completes_sql("h.peak", "c.duration", "$5::float8")
    return _UPSERT_SQL.format(notify_channel=NOTIFY_CHANNEL, completes=completes, **tables)


async def persist_batch(
    conn: asyncpg.Connection | asyncpg.Pool,
    kind: ContentKind,
    heartbeats: list[Heartbeat],
    *,
    margin_s: float,
    timeout_s: float | None = None,
) -> BatchResult:
    # a key may appear twice when a requeue races a claim: keep its newest heartbeat (on an exact
    # tie the first, as the upsert's strict `<` keeps the stored row and WRITE_SCRIPT the stored value);
    # unstamped ones (degraded mode) in the order they came: the later submitted wins
    latest: dict[tuple[int, int], Heartbeat] = {}
    for hb in heartbeats:
        key = (hb.user_id, hb.content_id)
        if (kept := latest.get(key)) is None:
            latest[key] = hb
        else:
            later = hb.received_ms is None or (kept.received_ms is not None and kept.received_ms < hb.received_ms)
            newest = hb if later else kept
            floors = [floor for floor in (kept.completion_floor_ms, hb.completion_floor_ms) if floor is not None]
            latest[key] = replace(newest, peak=max(kept.peak, hb.peak), completion_floor_ms=max(floors, default=None))
    # in the order of the unique index (user_id, content): neighbouring rows share its pages
    rows = [latest[key] for key in sorted(latest)]
    record = await conn.fetchrow(
        upsert_sql(kind),
        [hb.content_id for hb in rows],
        [hb.user_id for hb in rows],
        [hb.position for hb in rows],
        [hb.received_ms for hb in rows],
        margin_s,
        kind.name,
        [hb.peak for hb in rows],
        [hb.completion_floor_ms for hb in rows],
        timeout=timeout_s,
    )
    assert record is not None
    lists = (list(record[name]) for name in ("dropped", "locked", "held_users", "held_content"))
    return BatchResult(record["written"], record["completions"], *lists)


# keys named in a batch's log lines: enough to look into, not a line per key (a flood of made-up users
# behind a gateway is thousands of keys a second)
_SAMPLE = 10


def report_batch(kind: ContentKind, result: BatchResult) -> None:
    """What a persisted batch did, as metrics and a log line for its dropped keys and one naming the locks that
    held keys back: their user's row, their content's, or their own progress row (flusher and degraded mode)."""
    metrics.FLUSH_COMPLETIONS.labels(kind.name).inc(result.completions)
    metrics.FLUSH_DROPPED.labels(kind.name).inc(len(result.dropped))
    if result.dropped:
        log.warning(
            "%d heartbeats dropped: unknown user or content",
            len(result.dropped),
            extra={"content_type": kind.name, "count": len(result.dropped), "key": " ".join(result.dropped[:_SAMPLE])},
        )
    if result.locked:
        users, content = set(result.held_users), set(result.held_content)
        members = [(key, *parse_member(key)) for key in result.locked]
        # the keys held back by neither: their own progress row was held
        rows = [key for key, content_id, user_id in members if user_id not in users and content_id not in content]
        held = [
            f"{what} locked by another session: {name} {_sample(ids)}"
            for what, name, ids in (
                ("user rows", "user ids", result.held_users),
                (f"{kind.content_table} rows", "ids", result.held_content),
                ("progress rows", "keys", rows),
            )
            if ids
        ]
        log.warning(
            "%d heartbeats not written (the rest of the batch was): %s",
            len(result.locked),
            "; ".join(held),
            extra={"content_type": kind.name, "count": len(result.locked)},
        )


def _sample(items: list[int] | list[str]) -> str:
    return " ".join(str(item) for item in items[:_SAMPLE]) + (" ..." if len(items) > _SAMPLE else "")
