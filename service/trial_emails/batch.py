"""One batch of trials: load, resolve every due email in memory, reserve in blocks; the relay publishes.

Each block is one statement that reserves its pairs, writes an outbox row per winner and wakes the
outbox relay, the only publisher. So nothing is published before its reservation commits, and a crash,
a cancellation or a broker outage at any point leaves nothing reserved unpublished: what a statement
won is in the outbox, or the statement did not commit. Each block takes its rows from the pod's write
budget (the flush's) first, so a sweep of a thousand trials is paced like a flush backlog, never a burst.
"""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, TypedDict

import asyncpg

from service import checkpoints, metrics
from service.progress.flush.budget import FlushBudget
from service.trial_emails.reservations import Pair, load_sent_keys, load_trials, pending_reservations, reserve_block


@dataclass(frozen=True, slots=True)
class BatchOptions:
    send_email: bool  # SEND_EMAIL: false, nothing is reserved or sent
    batch_size: int = 200  # trials per call of a sweep (one page)
    block_size: int = 200  # pairs reserved per statement (one INSERT ... RETURNING)


class BatchResult(TypedDict):
    status: Literal["ok", "disabled", "stopped"]  # stopped: run-once got SIGTERM and left the rest
    user_trials: int
    sent: int


async def send_trial_journey_emails_batch(
    user_trial_ids: Sequence[int],
    *,
    pool: asyncpg.Pool,
    options: BatchOptions,
    now: datetime | None = None,
    budget: FlushBudget | None = None,
) -> BatchResult:
    """Enqueue every email due at `now` to the trials' users, each at most once, ever.

    `pool` must reach the primary (the service's DATABASE_URL), never a replica. `user_trials`
    counts the trials found; `sent` the emails this call won and handed to the relay. `budget`: the
    pod's write budget (None: unbudgeted).
    """
    if not options.send_email:
        return {"status": "disabled", "user_trials": 0, "sent": 0}
    now = now or datetime.now(UTC)
    async with pool.acquire() as conn:
        trials = await load_trials(conn, user_trial_ids)
        sent_keys = await load_sent_keys(conn, (trial.user_id for trial in trials)) if trials else {}
        pairs = pending_reservations(trials, sent_keys, now)
        sent = await reserve_in_blocks(conn, pairs, block_size=options.block_size, budget=budget)
    return {"status": "ok", "user_trials": len(trials), "sent": sent}


async def reserve_in_blocks(
    conn: asyncpg.Connection, pairs: Sequence[Pair], *, block_size: int, budget: FlushBudget | None = None
) -> int:
    """Reserve `pairs`, one statement per block; return how many this call won (each owed by the outbox).

    Each block reserves its size from `budget` before its statement; the pairs it did not win (reserved
    before: a retry, another worker) were not written, and go back to the budget after, as the flush's do.
    """
    if budget is not None and budget.limited:
        # a block is at most a second of the budget, like the flush's batches: a longer reservation would
        # end past the horizon the budget's key is trusted to, and the next one would not wait for it
        block_size = min(block_size, budget.rows_per_second)
    won = 0
    for start in range(0, len(pairs), block_size):
        block = pairs[start : start + block_size]
        reservation = await budget.reserve(len(block)) if budget is not None else None
        block_won = 0
        try:
            block_won = len(await reserve_block(conn, block, datetime.now(UTC)))
        finally:
            if budget is not None and reservation is not None:
                await asyncio.shield(budget.refund(reservation, len(block) - block_won))
        metrics.TRIAL_EMAILS_RESERVED.inc(block_won)
        checkpoints.reached("trial_emails.after_reserve")
        won += block_won
    return won
