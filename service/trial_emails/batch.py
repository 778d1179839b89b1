"""One batch of trials: load, resolve every due email in memory, reserve in blocks, enqueue the winners.

The order inside a block is write-ahead: reserve (committed), then publish. A crash between the
two leaves orphans (reserved, never enqueued; a rerun skips them because the row exists), so a
block is also the most that can be lost at once; every orphan this process can see is logged with
its pair and counted in progress_trial_email_orphans_total.
"""

import asyncio
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Literal, TypedDict

import asyncpg

from service import metrics
from service.config import Settings
from service.trial_emails.journey import SOURCE
from service.trial_emails.queue import EmailQueue, QueuedEmail
from service.trial_emails.reservations import (
    Pair,
    load_sent_keys,
    load_trials,
    pending_reservations,
    reserve_block,
)

log = logging.getLogger(__name__)

# reservations whose caller was cancelled, kept referenced until they finish and are reported
_abandoned: set["asyncio.Task[set[Pair]]"] = set()


class BatchResult(TypedDict):
    status: Literal["ok", "disabled"]
    user_trials: int
    sent: int


async def send_trial_journey_emails_batch(
    user_trial_ids: Sequence[int],
    *,
    pool: asyncpg.Pool,
    queue: EmailQueue,
    settings: Settings,
    now: datetime | None = None,
) -> BatchResult:
    """Enqueue every email due at `now` to the trials' users, each at most once, ever.

    `pool` must reach the primary (the service's DATABASE_URL), never a replica. `user_trials`
    counts the trials found; `sent` the emails this call enqueued.
    """
    if not settings.send_email:
        return {"status": "disabled", "user_trials": 0, "sent": 0}
    if len(user_trial_ids) > settings.journey_batch_size:
        raise ValueError(
            f"{len(user_trial_ids)} trials in one batch; JOURNEY_BATCH_SIZE is {settings.journey_batch_size}"
        )
    now = now or datetime.now(UTC)
    async with pool.acquire() as conn:
        trials = await load_trials(conn, user_trial_ids)
        sent_keys = await load_sent_keys(conn, (trial.user_id for trial in trials)) if trials else {}
    pairs = pending_reservations(trials, sent_keys, now)
    block_size = settings.reservation_block_size
    sent = await reserve_and_enqueue(pairs, pool=pool, queue=queue, block_size=block_size)
    return {"status": "ok", "user_trials": len(trials), "sent": sent}


async def reserve_and_enqueue(pairs: Sequence[Pair], *, pool: asyncpg.Pool, queue: EmailQueue, block_size: int) -> int:
    """Reserve `pairs` block by block; publish what each block won before reserving the next."""
    sent = 0
    for start in range(0, len(pairs), block_size):
        block = pairs[start : start + block_size]
        reserved_at = datetime.now(UTC)
        won = await _reserve_shielded(pool, block, reserved_at)
        metrics.TRIAL_EMAILS_RESERVED.inc(len(won))
        emails = _winners(block, won, reserved_at)
        await publish_all(queue, emails)
        sent += len(emails)
    return sent


def _winners(block: Sequence[Pair], won: set[Pair], reserved_at: datetime) -> list[QueuedEmail]:
    return [QueuedEmail(user_id, key, SOURCE, reserved_at) for user_id, key in block if (user_id, key) in won]


async def _reserve(pool: asyncpg.Pool, block: Sequence[Pair], reserved_at: datetime) -> set[Pair]:
    # a connection per block, not per batch: none is held while a slow broker takes the publishes
    async with pool.acquire() as conn:
        return await reserve_block(conn, block, reserved_at)


async def _reserve_shielded(pool: asyncpg.Pool, block: Sequence[Pair], reserved_at: datetime) -> set[Pair]:
    # Shield: a caller cancelled mid-statement cannot know whether it committed. The statement
    # finishes on its own, and whatever it reserved is reported as orphans instead of vanishing.
    reservation = asyncio.create_task(_reserve(pool, block, reserved_at))
    try:
        return await asyncio.shield(reservation)
    except asyncio.CancelledError:
        _abandoned.add(reservation)
        reservation.add_done_callback(partial(_report_abandoned, block, reserved_at))
        raise


def _report_abandoned(block: Sequence[Pair], reserved_at: datetime, reservation: "asyncio.Task[set[Pair]]") -> None:
    _abandoned.discard(reservation)
    if reservation.cancelled():
        return
    if (error := reservation.exception()) is not None:
        # the statement failed whole: nothing was reserved, so nothing is orphaned
        log.warning(
            "abandoned trial-journey reservation failed, nothing reserved",
            extra={"error": repr(error)},
        )
        return
    won = reservation.result()
    metrics.TRIAL_EMAILS_RESERVED.inc(len(won))
    report_orphans(_winners(block, won, reserved_at), why="cancelled after reserving")


async def publish_all(queue: EmailQueue, emails: Sequence[QueuedEmail]) -> None:
    published = 0
    try:
        for email in emails:
            await queue.publish(email)
            published += 1
            metrics.TRIAL_EMAILS_ENQUEUED.inc()
    finally:
        # an error or a cancellation stopped the loop: the rest are reserved and will never be sent
        if published < len(emails):
            report_orphans(emails[published:], why="publishing stopped")


def report_orphans(emails: Sequence[QueuedEmail], *, why: str) -> None:
    if not emails:
        return
    pairs = [f"{email.user_id}:{email.email_key}" for email in emails]
    metrics.TRIAL_EMAIL_ORPHANS.inc(len(pairs))
    log.error(
        "%d trial-journey emails reserved at %s but not confirmed published (%s; one interrupted mid-publish "
        "may have gone out): check the stream before re-enqueuing: %s",
        len(pairs), emails[0].reserved_at.isoformat(), why, " ".join(pairs),
        extra={"pairs": pairs, "count": len(pairs)},
    )  # fmt: skip
