"""What the broker's answer does to a published batch's rows: the sent are marked published, the refused
are leased for their backoff, or parked after OUTBOX_MAX_ATTEMPTS refusals.

The broker already has these messages: a mark lost to a lock, a statement timeout or a blip of the database
would send them all again once their lease ran out, so each statement is tried again while the lease lasts.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from service import checkpoints, metrics
from service.config import RelaySettings
from service.outbox.messages import PublishResult
from service.outbox.outboxes import MARK_SQL, REFUSE_SQL, Outbox
from service.stores import POSTGRES_UNAVAILABLE

log = logging.getLogger(__name__)

# a published batch's mark that failed is tried again after these pauses (doubling), while its lease lasts
_SETTLE_FIRST_PAUSE_S = 0.2
_SETTLE_MAX_PAUSE_S = 2.0


@dataclass(slots=True)
class RelayResult:
    published: dict[str, int] = field(default_factory=dict)  # by outbox
    republished: dict[str, int] = field(default_factory=dict)
    parked: dict[str, int] = field(default_factory=dict)  # refused for the last time
    broker_unavailable: str | None = None
    retried: dict[str, int] = field(default_factory=dict)  # refused, retried after a backoff


class Settler:
    """Records a relay's published batches in their outbox, for that relay alone."""

    def __init__(self, pool: asyncpg.Pool, settings: RelaySettings, retry_backoff_s: float) -> None:
        self._pool = pool
        self._settings = settings
        self._retry_backoff_s = retry_backoff_s

    async def record(
        self, outbox: Outbox, rows: list[asyncpg.Record], sent: PublishResult, result: RelayResult, *, lease_ends: float
    ) -> None:
        if sent.sent:
            checkpoints.reached("relay.after_publish")
        # One statement for the batch's marks, one for its refusals. Shielded: once the broker has the
        # messages, a cancelled relay must still record it, or they would all go out again.
        parked = await asyncio.shield(self._settle(outbox, sent.sent, sent.refused, lease_ends))
        first_time = {row["id"] for row in rows if row["publish_attempts"] == 1 or row["refused_before"]}
        republished = sum(1 for row_id in sent.sent if row_id not in first_time)
        name = outbox.name
        for counts, metric, count in (
            (result.published, metrics.OUTBOX_PUBLISHED, len(sent.sent)),
            (result.republished, metrics.OUTBOX_REPUBLISHED, republished),
            (result.parked, metrics.OUTBOX_FAILED, len(parked)),
            (result.retried, metrics.OUTBOX_RETRIED, len(sent.refused) - len(parked)),
        ):
            counts[name] += count
            metric.labels(name).inc(count)
        attempts = {row["id"]: row["publish_attempts"] for row in rows}
        for row_id, error in sent.refused.items():
            fate = "parked (publish_failed_at set)" if row_id in parked else "retried later"
            log.log(
                logging.ERROR if row_id in parked else logging.WARNING,
                "%s outbox row %d refused by the broker (attempt %d of %d), %s: %s",
                name,
                row_id,
                attempts[row_id],
                self._settings.max_attempts,
                fate,
                error,
                extra={"outbox": name, "row_id": row_id},
            )
        if sent.unavailable is not None:
            result.broker_unavailable = sent.unavailable
            metrics.OUTBOX_BROKER_UNAVAILABLE.labels(name).inc()

    async def _settle(self, outbox: Outbox, sent: list[int], refused: dict[int, str], lease_ends: float) -> set[int]:
        """Mark what the broker took; lease the refused rows for their backoff, or park them. Returns the parked.

        Past the batch's lease another relay may have these rows: a statement still failing then goes up.
        """
        if sent:
            await self._while_leased(
                outbox, "mark", len(sent), lease_ends, self._pool.execute, outbox.sql(MARK_SQL), sent
            )
        if not refused:
            return set()
        args = (list(refused), list(refused.values()), self._settings.max_attempts, self._retry_backoff_s)
        rows = await self._while_leased(
            outbox, "refusals", len(refused), lease_ends, self._pool.fetch, outbox.sql(REFUSE_SQL), *args
        )
        return {row["id"] for row in rows if row["parked"]}

    async def _while_leased(
        self, outbox: Outbox, what: str, count: int, lease_ends: float, run: Callable[..., Awaitable[Any]], *args: Any
    ) -> Any:
        pause_s = _SETTLE_FIRST_PAUSE_S
        while True:
            try:
                return await run(*args)
            # "not now" (a lock, a timeout) or no answer; a bug or a schema drift goes up at once
            except POSTGRES_UNAVAILABLE as exc:
                # the next try ends before the lease does, or not at all: past it, another relay may publish them
                # a statement takes statement_timeout_s at most (0: unbounded, so no retry near the end)
                next_ends = time.monotonic() + pause_s + (self._settings.statement_timeout_s or self._settings.lease_s)
                if next_ends >= lease_ends or self._pool.is_closing():
                    raise
                log.warning(
                    "%s outbox: the %s of %d rows the broker has answered failed (%s: %s); again in %.1f s, "
                    "while their lease lasts",
                    outbox.name,
                    what,
                    count,
                    type(exc).__name__,
                    exc,
                    pause_s,
                    extra={"outbox": outbox.name, "count": count},
                )
                await asyncio.sleep(pause_s)
                pause_s = min(2 * pause_s, _SETTLE_MAX_PAUSE_S)
