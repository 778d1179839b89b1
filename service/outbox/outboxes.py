"""The two outboxes and their SQL: which rows are owed, how a relay claims, marks and parks them.

A claim is one statement that leases a batch (claimed_until) under FOR UPDATE SKIP LOCKED, so
relays racing on the same table take disjoint rows, and commits at once: no transaction stays open
while the broker is slow. A relay killed after publishing and before marking leaves its lease to
expire: the rows are claimed again and republished with the same task id (publish_attempts > 1
says so). Marks and parks are one statement per batch.
"""

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from service.outbox.messages import Message

# the writers NOTIFY this channel in the statement that writes outbox rows (delivered at commit)
NOTIFY_CHANNEL = "progress_outbox"

# uuid5 namespace of every task id this service sends: a republish is recognisably the same message
TASK_ID_NAMESPACE = uuid.UUID("6f1d2c4e-8a57-4b0e-9d3a-2f6b1c9e7a41")


def completion_task_id(content_type: str, content_id: int, user_id: int) -> str:
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"completion:{content_type}:{content_id}:{user_id}"))


def email_task_id(dispatch_id: int) -> str:
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"email-dispatch:{dispatch_id}"))


@dataclass(frozen=True, slots=True)
class Outbox:
    name: str  # the metrics label: completion | email
    claim_sql: str  # $1 batch size, $2 lease (s); returns the rows with publish_attempts
    mark_sql: str  # $1 row ids
    release_sql: str  # $1 row ids: claimed, not published, no harm done (the broker was unreachable)
    park_sql: str  # $1 row ids, $2 errors
    oldest_sql: str  # age (s) of the oldest row still owed, or NULL
    counts_sql: str  # owed, parked, oldest_owed_age_s (status)
    to_message: Callable[[asyncpg.Record, str, str], Message]  # (row, task name, queue)


# The lease, not an open transaction, keeps other relays off a claimed batch: the claim commits at
# once, so a slow broker holds no row lock and no PgBouncer server connection. Rows the broker refused
# for good (publish_failed_at) are never claimed again: no hot retry loop.
_CLAIM_SQL = """
UPDATE {table} o
   SET claimed_until = now() + make_interval(secs => $2::float8), publish_attempts = o.publish_attempts + 1
 WHERE o.{key} IN (
        SELECT {key} FROM {table}
         WHERE published_at IS NULL AND publish_failed_at IS NULL
           AND (claimed_until IS NULL OR claimed_until < now())
         ORDER BY {key}
         LIMIT $1
           FOR UPDATE SKIP LOCKED)
RETURNING o.{key} AS id, {returning}, o.publish_attempts
"""
_MARK_SQL = """
UPDATE {table} SET published_at = now(), claimed_until = NULL WHERE {key} = ANY($1::bigint[])
"""
# the claim counted an attempt that never reached the broker: take it back so a later publish is not
# reported as a republish
_RELEASE_SQL = """
UPDATE {table} SET claimed_until = NULL, publish_attempts = publish_attempts - 1
 WHERE {key} = ANY($1::bigint[]) AND published_at IS NULL
"""
_PARK_SQL = """
UPDATE {table} o SET publish_failed_at = now(), publish_error = r.error, claimed_until = NULL
  FROM unnest($1::bigint[], $2::text[]) AS r (id, error)
 WHERE o.{key} = r.id
"""
_OLDEST_SQL = """
SELECT extract(epoch FROM now() - min(created_at))::float8 FROM {table}
 WHERE published_at IS NULL AND publish_failed_at IS NULL
"""
# For `status`: plain reads, no lock taken, each count over a partial index of the unpublished rows
# (progress_completion_event_unpublished_idx holds owed and parked rows alike; the email outbox's index
# holds the owed ones only, so its parked count scans the table until a partial index of parked rows exists).
_COUNTS_SQL = """
SELECT owed.n AS owed, owed.oldest_s AS oldest_owed_age_s,
       (SELECT count(*) FROM {table} WHERE published_at IS NULL AND publish_failed_at IS NOT NULL) AS parked
  FROM (SELECT count(*) AS n, extract(epoch FROM now() - min(created_at))::float8 AS oldest_s
          FROM {table} WHERE published_at IS NULL AND publish_failed_at IS NULL) AS owed
"""


def _outbox(name: str, *, table: str, key: str, returning: str,
            to_message: Callable[[asyncpg.Record, str, str], Message]) -> Outbox:  # fmt: skip
    """Both outboxes are one shape: a table with a bigint key, published_at, a lease and a park."""
    names = {"table": table, "key": key, "returning": returning}
    return Outbox(name, _CLAIM_SQL.format(**names), _MARK_SQL.format(**names), _RELEASE_SQL.format(**names),
                  _PARK_SQL.format(**names), _OLDEST_SQL.format(**names), _COUNTS_SQL.format(**names),
                  to_message)  # fmt: skip


def completion_message(row: asyncpg.Record, task_name: str, queue: str) -> Message:
    kwargs = {
        "user_id": row["user_id"],
        "content_type": row["content_type"],
        "content_id": row["content_id"],
        "completed_at": row["completed_at"].isoformat(),
    }
    task_id = completion_task_id(row["content_type"], row["content_id"], row["user_id"])
    return Message(row["id"], task_name, queue, task_id, kwargs)


def email_kwargs(dispatch_id: int, user_id: int, email_key: str, source: str) -> dict[str, object]:
    return {"dispatch_id": dispatch_id, "user_id": user_id, "email_key": email_key, "source": source}


def email_message(row: asyncpg.Record, task_name: str, queue: str) -> Message:
    kwargs = email_kwargs(row["id"], row["user_id"], row["email_key"], row["source"])
    return Message(row["id"], task_name, queue, email_task_id(row["id"]), kwargs,
                   extra={"reserved_at": row["reserved_at"]})  # fmt: skip


COMPLETIONS = _outbox("completion", table="progress_completion_event", key="id",
                      returning="o.content_type, o.content_id, o.user_id, o.completed_at",
                      to_message=completion_message)  # fmt: skip
# A row of the email outbox is written already claimed by the batch that reserved it (see
# service.trial_emails.reservations): the relay takes it only once that lease has run out, so it
# does not race the batch's own publish of its winners.
EMAILS = _outbox("email", table="trial_email_outbox", key="dispatch_id",
                 returning="o.user_id, o.source, o.email_key, o.reserved_at", to_message=email_message)  # fmt: skip


def publish_window_s(lease_s: float, publish_timeout_s: float) -> float:
    """How long after its lease began the holder of a batch may still start publishing it.

    A batch may take its publish deadline, the wait for the publishing thread beyond it and the mark
    statement (publish_budget_s) from the start of its publish to its mark; started later, it could
    still be going out when the lease ends and another relay claims and sends it again.
    """
    return max(lease_s - publish_budget_s(publish_timeout_s), lease_s / 2)


def publish_budget_s(publish_timeout_s: float) -> float:
    """From the start of one batch's publish to its mark: the deadline, the thread's second, the mark."""
    return publish_timeout_s + 2.0


async def mark_published(conn: asyncpg.Connection | asyncpg.Pool, outbox: Outbox, row_ids: list[int]) -> None:
    if row_ids:
        await conn.execute(outbox.mark_sql, row_ids)


@dataclass(frozen=True, slots=True)
class OutboxCounts:
    owed: int
    parked: int
    oldest_owed_age_s: float | None  # None: nothing owed


async def count_rows(conn: asyncpg.Connection | asyncpg.Pool, outbox: Outbox) -> OutboxCounts:
    row = await conn.fetchrow(outbox.counts_sql)
    assert row is not None
    return OutboxCounts(row["owed"], row["parked"], row["oldest_owed_age_s"])
