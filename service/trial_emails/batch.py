"""One batch of trials: load, resolve every due email in memory, reserve in blocks, enqueue the winners.

The order inside a block is write-ahead: reserve (committed, with an outbox row per winner in the
same statement), then publish. What the broker took is marked published by the next block's
reservation statement, and the last block's by one closing statement. A crash, a
cancellation or a broker outage between the reservation and the mark leaves the rest in the
outbox: the relay (service.outbox.relay) publishes them once the batch's lease on them runs out.
Nothing reserved is lost; what the batch could not publish itself is logged and counted in
progress_trial_email_orphans_total (now "left to the relay", no longer lost).
"""

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Literal, TypedDict

import asyncpg

from service import checkpoints, metrics
from service.config import Settings
from service.outbox.outboxes import EMAILS, mark_published, publish_window_s
from service.trial_emails.journey import SOURCE
from service.trial_emails.queue import EmailQueue, MessageRefusedError, QueuedEmail
from service.trial_emails.reservations import (
    DEFAULT_LEASE_S,
    Pair,
    load_sent_keys,
    load_trials,
    pending_reservations,
    reserve_block,
)

log = logging.getLogger(__name__)

# reservations whose caller was cancelled, kept referenced until they finish and are reported
_abandoned: set["asyncio.Task[dict[Pair, int]]"] = set()


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """The numbers of a batch, from the settings named in the comments."""

    send_email: bool  # SEND_EMAIL: false, nothing is reserved or sent
    batch_size: int  # JOURNEY_BATCH_SIZE: the most trials one call may be given
    block_size: int  # RESERVATION_BLOCK_SIZE: pairs reserved per statement
    lease_s: float  # RELAY_LEASE_SECONDS: how long the batch keeps its winners from the relay
    publish_timeout_s: float  # CELERY_PUBLISH_TIMEOUT_SECONDS

    @classmethod
    def from_settings(cls, settings: Settings) -> "BatchOptions":
        return cls(
            send_email=settings.send_email,
            batch_size=settings.journey_batch_size,
            block_size=settings.reservation_block_size,
            lease_s=settings.relay_lease_seconds,
            publish_timeout_s=settings.celery_publish_timeout_seconds,
        )


class BatchResult(TypedDict):
    status: Literal["ok", "disabled", "stopped"]  # stopped: run-once got SIGTERM and left the rest
    user_trials: int
    sent: int


async def send_trial_journey_emails_batch(
    user_trial_ids: Sequence[int],
    *,
    pool: asyncpg.Pool,
    queue: EmailQueue,
    options: BatchOptions,
    now: datetime | None = None,
) -> BatchResult:
    """Enqueue every email due at `now` to the trials' users, each at most once, ever.

    `pool` must reach the primary (the service's DATABASE_URL), never a replica. `user_trials`
    counts the trials found; `sent` the emails this call enqueued.
    """
    if not options.send_email:
        return {"status": "disabled", "user_trials": 0, "sent": 0}
    if len(user_trial_ids) > options.batch_size:
        raise ValueError(f"{len(user_trial_ids)} trials in one batch; JOURNEY_BATCH_SIZE is {options.batch_size}")
    now = now or datetime.now(UTC)
    async with pool.acquire() as conn:
        trials = await load_trials(conn, user_trial_ids)
        sent_keys = await load_sent_keys(conn, (trial.user_id for trial in trials)) if trials else {}
    pairs = pending_reservations(trials, sent_keys, now)
    sent = await reserve_and_enqueue(
        pairs,
        pool=pool,
        queue=queue,
        block_size=options.block_size,
        lease_s=options.lease_s,
        publish_timeout_s=options.publish_timeout_s,
    )
    return {"status": "ok", "user_trials": len(trials), "sent": sent}


async def reserve_and_enqueue(
    pairs: Sequence[Pair],
    *,
    pool: asyncpg.Pool,
    queue: EmailQueue,
    block_size: int,
    lease_s: float = DEFAULT_LEASE_S,
    publish_timeout_s: float = 10.0,
) -> int:
    """Reserve `pairs` block by block; publish what each block won before reserving the next.

    A block's winners are leased to this batch for `lease_s` from their reservation; the batch stops
    publishing them while one publish and the mark still fit in the lease (publish_window_s), so the
    relay, which takes them over when the lease ends, never sends one the batch is still sending.
    """
    sent = 0
    published: list[int] = []  # dispatch ids the broker has and the outbox does not know yet
    fresh_for_s = publish_window_s(lease_s, publish_timeout_s)
    try:
        for start in range(0, len(pairs), block_size):
            block = pairs[start : start + block_size]
            reserved_at = datetime.now(UTC)
            publish_until = time.monotonic() + fresh_for_s  # the lease starts in the statement, after this
            won = await _reserve_shielded(pool, block, reserved_at, lease_s, published)
            published = []  # marked by that statement
            metrics.TRIAL_EMAILS_RESERVED.inc(len(won))
            checkpoints.reached("trial_emails.after_reserve")
            await publish_all(queue, _winners(block, won, reserved_at), published, until=publish_until)
            sent += len(published)
    finally:
        if published:
            # Shielded: the broker has these; unmarked, the relay would send them again after the lease.
            # If the mark itself fails they are republished with the same task id: a duplicate the
            # monolith recognises, never a loss. (Idempotent if an abandoned reservation marked them.)
            await asyncio.shield(mark_published(pool, EMAILS, published))
    return sent


def _winners(block: Sequence[Pair], won: dict[Pair, int], reserved_at: datetime) -> list[QueuedEmail]:
    return [
        QueuedEmail(user_id, key, SOURCE, reserved_at, won[(user_id, key)])
        for user_id, key in block
        if (user_id, key) in won
    ]


async def _reserve(
    pool: asyncpg.Pool, block: Sequence[Pair], reserved_at: datetime, lease_s: float, published: Sequence[int]
) -> dict[Pair, int]:
    # a connection per block, not per batch: none is held while a slow broker takes the publishes
    async with pool.acquire() as conn:
        return await reserve_block(conn, block, reserved_at, lease_s=lease_s, published=published)


async def _reserve_shielded(
    pool: asyncpg.Pool, block: Sequence[Pair], reserved_at: datetime, lease_s: float, published: Sequence[int]
) -> dict[Pair, int]:
    # Shield: a caller cancelled mid-statement cannot know whether it committed. The statement
    # finishes on its own, and whatever it reserved is reported as left to the relay.
    reservation = asyncio.create_task(_reserve(pool, block, reserved_at, lease_s, list(published)))
    try:
        return await asyncio.shield(reservation)
    except asyncio.CancelledError:
        _abandoned.add(reservation)
        reservation.add_done_callback(partial(_report_abandoned, block, reserved_at))
        raise


def _report_abandoned(
    block: Sequence[Pair], reserved_at: datetime, reservation: "asyncio.Task[dict[Pair, int]]"
) -> None:
    _abandoned.discard(reservation)
    if reservation.cancelled():
        return
    if (error := reservation.exception()) is not None:
        # the statement failed whole: nothing was reserved, so nothing is orphaned
        log.warning("abandoned trial-journey reservation failed, nothing reserved", extra={"error": repr(error)})
        return
    won = reservation.result()
    metrics.TRIAL_EMAILS_RESERVED.inc(len(won))
    report_orphans(_winners(block, won, reserved_at), why="cancelled after reserving")


async def publish_all(
    queue: EmailQueue, emails: Sequence[QueuedEmail], published: list[int], *, until: float | None = None
) -> None:
    """Publish a block's winners, appending each one the broker took to `published` (dispatch ids).

    `published` is the caller's, so what went out before an error or a cancellation still gets marked.
    Past `until` (monotonic) the rest is left to the relay, whose lease on them is about to begin.
    """
    done = 0
    refused: list[QueuedEmail] = []
    try:
        for email in emails:
            if until is not None and time.monotonic() > until:
                break
            try:
                await queue.publish(email)
            except MessageRefusedError as exc:
                # this message only: the relay parks it once the lease runs out; the others go on
                log.error(
                    "trial-journey email %d:%s refused by the broker: %s",
                    email.user_id,
                    email.email_key,
                    exc,
                    extra={"pairs": [f"{email.user_id}:{email.email_key}"]},
                )
                refused.append(email)
                continue
            published.append(email.dispatch_id)
            done += 1
            metrics.TRIAL_EMAILS_ENQUEUED.inc()
    finally:
        # an error, a cancellation or the lease's end stopped the loop: the rest wait in the outbox for the relay
        done += len(refused)
        if done < len(emails):
            report_orphans(emails[done:], why="publishing stopped")


def report_orphans(emails: Sequence[QueuedEmail], *, why: str) -> None:
    if not emails:
        return
    pairs = [f"{email.user_id}:{email.email_key}" for email in emails]
    metrics.TRIAL_EMAIL_ORPHANS.inc(len(pairs))
    log.warning(
        "%d trial-journey emails reserved at %s not published by their batch (%s; one interrupted mid-publish "
        "may have gone out): left to the outbox relay: %s",
        len(pairs),
        emails[0].reserved_at.isoformat(),
        why,
        " ".join(pairs),
        extra={"pairs": pairs, "count": len(pairs)},
    )
