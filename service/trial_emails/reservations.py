"""The SQL of the trial-journey emails: one query per batch to load, one statement per block to reserve.

Every function takes a connection to the primary: a reservation must never read a replica, or it
would miss a row another worker has just written and the pair would look free.
"""

from collections.abc import Iterable, Sequence
from datetime import datetime

import asyncpg

from service.outbox.outboxes import NOTIFY_CHANNEL
from service.trial_emails.journey import SOURCE, UserTrial, resolve_pending_emails

Pair = tuple[int, str]  # (user_id, email_key)

LOAD_TRIALS_SQL = """
SELECT id, user_id, started_at, ends_at
  FROM trials_usertrial
 WHERE id = ANY($1::bigint[])
 ORDER BY id
"""


async def load_trials(conn: asyncpg.Connection, user_trial_ids: Sequence[int]) -> list[UserTrial]:
    rows = await conn.fetch(LOAD_TRIALS_SQL, list(user_trial_ids))
    return [UserTrial(row["id"], row["user_id"], row["started_at"], row["ends_at"]) for row in rows]


# Soft-deleted rows are read too: UNIQUE (user_id, source, email_key) ignores deleted_at, so such a
# key can never be reserved again and proposing it would only cost a conflict in the INSERT.
LOAD_SENT_KEYS_SQL = """
SELECT user_id, email_key
  FROM emails_emaildispatch
 WHERE user_id = ANY($1::bigint[]) AND source = $2
"""


async def load_sent_keys(conn: asyncpg.Connection, user_ids: Iterable[int]) -> dict[int, set[str]]:
    sent: dict[int, set[str]] = {}
    for row in await conn.fetch(LOAD_SENT_KEYS_SQL, sorted(set(user_ids)), SOURCE):
        sent.setdefault(row["user_id"], set()).add(row["email_key"])
    return sent


def pending_reservations(
    trials: Iterable[UserTrial], sent_keys_by_user: dict[int, set[str]], now: datetime
) -> list[Pair]:
    """Every due (user_id, email_key) of a batch, built in memory, deduplicated, in a stable order.

    Keys belong to the user, not the trial: a user with two trials in the batch owes each key once.
    The sort gives concurrent runners the same insert order, so they queue on the unique index
    instead of deadlocking on it.
    """
    pairs = {
        (trial.user_id, key)
        for trial in trials
        for key in resolve_pending_emails(trial, sent_keys_by_user.get(trial.user_id, set()), now)
    }
    return sorted(pairs)


# ON CONFLICT DO NOTHING + RETURNING tells exactly which rows this statement inserted: a pair
# reserved earlier (a retry, a redelivery, another worker) is not returned and so not enqueued.
# Each won pair writes its outbox row (service.outbox) in the same statement, so no reservation can
# commit without the message it owes, and the relay, the only publisher, is woken by the NOTIFY,
# which Postgres delivers at commit only: nothing goes out before its reservation is durable.
RESERVE_BLOCK_SQL = f"""
WITH reserved AS (
    INSERT INTO emails_emaildispatch (user_id, source, email_key, sent_at, created_at)
    SELECT pair.user_id, $3::text, pair.email_key, $4::timestamptz, $4::timestamptz
      FROM unnest($1::bigint[], $2::text[]) AS pair (user_id, email_key)
        ON CONFLICT (user_id, source, email_key) DO NOTHING
    RETURNING id, user_id, source, email_key
), owed AS (
    INSERT INTO trial_email_outbox (dispatch_id, user_id, source, email_key, reserved_at)
    SELECT id, user_id, source, email_key, $4::timestamptz FROM reserved
    RETURNING user_id, email_key
)
SELECT user_id, email_key,
       (SELECT count(pg_notify('{NOTIFY_CHANNEL}', 'email')) FROM (SELECT 1 FROM owed LIMIT 1) one) AS notified
  FROM owed
"""


async def reserve_block(conn: asyncpg.Connection, pairs: Sequence[Pair], reserved_at: datetime) -> list[Pair]:
    """Reserve a block in one statement; return the pairs it inserted, each now owed by the outbox.

    Run outside a transaction: the statement commits on its own, so when this returns the
    reservations and their outbox rows are durable and the relay is woken, and when it raises
    (deferred foreign keys fail here too) none is.
    """
    rows = await conn.fetch(
        RESERVE_BLOCK_SQL, [user_id for user_id, _ in pairs], [key for _, key in pairs], SOURCE, reserved_at
    )
    return [(row["user_id"], row["email_key"]) for row in rows]
