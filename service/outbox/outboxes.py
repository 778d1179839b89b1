"""The two outboxes and their SQL: which rows are owed, how a relay claims, marks and parks them.

A claim leases a batch (claimed_until) under FOR UPDATE SKIP LOCKED, so racing relays take disjoint
rows. A relay killed after publishing and before marking leaves its lease to expire: the rows are
claimed again and republished with the same task id (publish_attempts > 1 says so).
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
    """Both outboxes are one shape: a table with a bigint key, published_at, a lease, attempts and a park."""

    name: str  # the metrics label: completion | email
    table: str
    key: str  # its bigint primary key: the `id` the relay, the log and `outbox list` name
    returning: str  # what a claim returns besides the id and the attempts: what to_message reads
    to_message: Callable[[asyncpg.Record, str, str], Message]  # (row, task name, queue)

    def sql(self, template: str) -> str:
        """A statement of this module's (or service.outbox.admin's) for this outbox's table."""
        names = {"table": self.table, "key": self.key, "returning": self.returning, "channel": NOTIFY_CHANNEL}
        return template.format(owed=OWED, parked=PARKED, **names)


# The two states of an unpublished row, as the partial indexes of migrations_ref/006_outbox_counts.sql
# say them: owed (the relay will publish it, perhaps after a lease or a refusal's backoff), and parked
# (refused OUTBOX_MAX_ATTEMPTS times: waits for `progress-service outbox redrive`).
OWED = "published_at IS NULL AND publish_failed_at IS NULL"
PARKED = "publish_failed_at IS NOT NULL AND published_at IS NULL"

# The lease, not an open transaction, keeps other relays off a claimed batch: the claim commits at
# once, so a slow broker holds no row lock and no PgBouncer server connection. Rows parked
# (publish_failed_at) are never claimed again; a refused row waits out its backoff in claimed_until.
# `refused_before`: a row the broker refused earlier cannot have gone out, so its publish is no republish.
# $1 batch size, $2 lease (s)
CLAIM_SQL = """
UPDATE {table} o
   SET claimed_until = now() + make_interval(secs => $2::float8), publish_attempts = o.publish_attempts + 1
 WHERE o.{key} IN (
        SELECT {key} FROM {table}
         WHERE {owed}
           AND (claimed_until IS NULL OR claimed_until < now())
         ORDER BY {key}
         LIMIT $1
           FOR UPDATE SKIP LOCKED)
RETURNING o.{key} AS id, {returning}, o.publish_attempts, o.publish_error IS NOT NULL AS refused_before
"""
# $1 row ids
MARK_SQL = """
UPDATE {table} SET published_at = now(), claimed_until = NULL WHERE {key} = ANY($1::bigint[])
"""
# $1 row ids: claimed, not published, no harm done (the broker was unreachable). The claim counted an attempt
# that never reached the broker: take it back so a later publish is not reported as a republish
RELEASE_SQL = """
UPDATE {table} SET claimed_until = NULL, publish_attempts = publish_attempts - 1
 WHERE {key} = ANY($1::bigint[]) AND published_at IS NULL
"""
# Sidekiq's retry-then-dead: a refusal is retried after first_s * 2^(attempts - 1) (the lease set into
# the future), and parked for a human once the row has had its max attempts; the error is kept either way.
# $1 row ids, $2 errors, $3 max attempts, $4 first backoff (s)
REFUSE_SQL = """
UPDATE {table} o
   SET publish_error = r.error,
       publish_failed_at = CASE WHEN o.publish_attempts >= $3 THEN now() END,
       claimed_until = CASE WHEN o.publish_attempts >= $3 THEN NULL
                            ELSE now() + make_interval(secs => $4::float8 * 2 ^ least(o.publish_attempts - 1, 40)) END
  FROM unnest($1::bigint[], $2::text[]) AS r (id, error)
 WHERE o.{key} = r.id AND o.published_at IS NULL
RETURNING o.{key} AS id, o.publish_failed_at IS NOT NULL AS parked
"""
# Plain reads, no lock taken (`status` and the relay's gauges): two counts, each over a partial index
# (migrations_ref/006_outbox_counts.sql): the owed rows by created_at, the parked ones
COUNTS_SQL = """
SELECT owed.count AS owed, owed.oldest_owed_age_s, (
        SELECT count(*) FROM {table} WHERE {parked}) AS parked
  FROM (SELECT count(*) AS count, extract(epoch FROM now() - min(created_at))::float8 AS oldest_owed_age_s
          FROM {table} WHERE {owed}) AS owed
"""


@dataclass(frozen=True, slots=True)
class OutboxCounts:
    owed: int  # committed, not yet published, not parked (waiting, leased, or in a refusal's backoff)
    parked: int  # refused OUTBOX_MAX_ATTEMPTS times: waits for `progress-service outbox redrive`
    oldest_owed_age_s: float | None  # None when nothing is owed


async def outbox_counts(conn: asyncpg.Connection | asyncpg.Pool, outbox: Outbox) -> OutboxCounts:
    """Messages owed and parked in `outbox`, and the age of the oldest owed: one short indexed statement."""
    row = await conn.fetchrow(outbox.sql(COUNTS_SQL))  # one row: an aggregate's
    return OutboxCounts(int(row["owed"]), int(row["parked"]), row["oldest_owed_age_s"])


def completion_message(row: asyncpg.Record, task_name: str, queue: str) -> Message:
    kwargs = {
        "user_id": row["user_id"],
        "content_type": row["content_type"],
        "content_id": row["content_id"],
        "completed_at": row["completed_at"].isoformat(),
    }
    task_id = completion_task_id(row["content_type"], row["content_id"], row["user_id"])
    return Message(row["id"], task_name, queue, task_id, kwargs)


def email_message(row: asyncpg.Record, task_name: str, queue: str) -> Message:
    kwargs = {
        "dispatch_id": row["id"],
        "user_id": row["user_id"],
        "email_key": row["email_key"],
        "source": row["source"],
    }
    extra = {"reserved_at": row["reserved_at"]}
    return Message(row["id"], task_name, queue, email_task_id(row["id"]), kwargs, extra)


COMPLETIONS = Outbox(
    "completion",
    table="progress_completion_event",
    key="id",
    returning="o.content_type, o.content_id, o.user_id, o.completed_at",
    to_message=completion_message,
)
# A row of the email outbox is written by the statement that reserves its email
# (service.trial_emails.reservations), which wakes the relay: the batch publishes nothing itself.
EMAILS = Outbox(
    "email",
    table="trial_email_outbox",
    key="dispatch_id",
    returning="o.user_id, o.source, o.email_key, o.reserved_at",
    to_message=email_message,
)
# by the name the metrics, the logs and `progress-service outbox --outbox` use
OUTBOXES = {outbox.name: outbox for outbox in (COMPLETIONS, EMAILS)}


def publish_budget_s(publish_timeout_s: float) -> float:
    """From the start of one batch's publish to its mark: the deadline, the message in hand, the mark."""
    return publish_timeout_s + 2.0
