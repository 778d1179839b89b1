"""The relay: every committed outbox row reaches the broker, once unless a crash forces a republish.

Order per batch: claim (a lease, committed), publish, mark published. A relay killed between the
publish and the mark, or a database that refuses the mark for the whole lease, republishes that
batch with the same task ids once the lease runs out; at any other point nothing is sent twice.
Several relays (one per pod) take disjoint batches. The next batch is claimed while the broker
takes the current one, so the outbox's SQL costs little next to the publishing. It is the only
publisher of both outboxes: the writers (the flush, the email reservations) write rows and NOTIFY.

It wakes on NOTIFY from the writers, so a completion reaches the broker within about a second of
its flush, and polls every RELAY_POLL_INTERVAL_SECONDS in case a notification was missed (LISTEN
needs a real session: behind PgBouncer in transaction mode point RELAY_LISTEN_DATABASE_URL at
the primary, or poll only). Broker unreachable: rows wait, the relay backs off exponentially,
the age of the oldest owed row shows the lag; a temporary answer (BUSY, LOADING, throttling) is the
same outage. A row the broker refuses is retried with a doubling backoff (45 s
first) and parked only after OUTBOX_MAX_ATTEMPTS refusals, about a day with the defaults.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg

from service import checkpoints, metrics
from service.config import RelaySettings
from service.loops import Backoff, every
from service.outbox.messages import Publisher, PublishResult
from service.outbox.outboxes import NOTIFY_CHANNEL, Outbox, outbox_counts, publish_budget_s
from service.postgres import CONNECT_TIMEOUT_S
from service.stores import POSTGRES_FAILED, POSTGRES_UNAVAILABLE

log = logging.getLogger(__name__)

# how stale the owed/parked/oldest gauges may be while no row moves (the lag alert waits minutes)
COUNTS_INTERVAL_S = 5.0
# rows per claim, one publish call and one mark statement each: the broker takes a batch of 500 in one call
BATCH_SIZE = 500
# a refused message is claimed again after 45 s, 90 s, 3 min, ... (doubling): with OUTBOX_MAX_ATTEMPTS at
# 12, about 25 h from the first refusal to the last, as Sidekiq's retries
RETRY_BACKOFF_S = 45.0
# a published batch's mark that failed is tried again after these pauses (doubling), while its lease lasts
_SETTLE_FIRST_PAUSE_S = 0.2
_SETTLE_MAX_PAUSE_S = 2.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Route:
    """An outbox, the publisher its messages go to, and the Celery task and queue they name."""

    outbox: Outbox
    publisher: Publisher
    task_name: str
    queue: str


@dataclass(slots=True)
class RelayResult:
    published: dict[str, int] = field(default_factory=dict)  # by outbox
    republished: dict[str, int] = field(default_factory=dict)
    parked: dict[str, int] = field(default_factory=dict)  # refused for the last time
    broker_unavailable: str | None = None
    retried: dict[str, int] = field(default_factory=dict)  # refused, retried after a backoff

    def did_something(self) -> bool:
        return any(self.published.values()) or any(self.parked.values()) or any(self.retried.values())


class Relay:
    @classmethod
    def from_settings(
        cls,
        settings: RelaySettings,
        pool: asyncpg.Pool,
        routes: list[Route],
        *,
        retry_backoff_s: float = RETRY_BACKOFF_S,
    ) -> "Relay":
        return cls(
            pool=pool,
            routes=routes,
            lease_s=settings.lease_s,
            publish_timeout_s=settings.publish_timeout_s,
            poll_s=settings.poll_s,
            max_backoff_s=settings.max_backoff_s,
            listen_dsn=settings.listen_dsn,
            max_attempts=settings.max_attempts,
            retry_backoff_s=retry_backoff_s,
            statement_timeout_s=settings.statement_timeout_s,
        )

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        routes: Sequence[Route],
        batch_size: int = BATCH_SIZE,
        lease_s: float,
        publish_timeout_s: float,
        poll_s: float,
        max_backoff_s: float,
        listen_dsn: str = "",
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_attempts: int,
        retry_backoff_s: float = RETRY_BACKOFF_S,
        statement_timeout_s: float = 0.0,
    ) -> None:
        """`listen_dsn`: where to LISTEN for the writers' NOTIFY; empty, poll only.

        A refused row is claimed again `retry_backoff_s * 2 ** (attempts - 1)` later, and parked once it
        has had `max_attempts`.
        """
        self._pool = pool
        self._max_attempts = max_attempts
        self._retry_backoff_s = retry_backoff_s
        self._routes = list(routes)
        self._batch_size = batch_size
        self._lease_s = lease_s
        self._statement_s = statement_timeout_s  # how long a statement may take (0: unbounded, no retry near the end)
        # A batch claimed ahead is published only while enough of its lease is left to publish and mark it;
        # started later, it could still be going out when another relay claims and sends it again.
        self._fresh_for_s = max(lease_s - publish_budget_s(publish_timeout_s), lease_s / 2)
        self._poll_s = poll_s
        self._max_backoff_s = max_backoff_s
        self._listen_dsn = listen_dsn
        self._connect_timeout_s = connect_timeout_s
        self._wake = asyncio.Event()
        self._counted_at: dict[str, float] = {}  # by outbox: when its gauges were last counted

    async def relay_once(self, *, stop: asyncio.Event | None = None) -> RelayResult:
        """Publish everything owed now, batch by batch; stop early if the broker cannot be reached."""
        result = RelayResult()
        for route in self._routes:
            name = route.outbox.name
            result.published.setdefault(name, 0)
            result.republished.setdefault(name, 0)
            result.parked.setdefault(name, 0)
            result.retried.setdefault(name, 0)
            # once the broker is known down, the other outboxes only report their lag
            try:
                if result.broker_unavailable is None:
                    await self._drain(route, result, stop)
            finally:
                # the lag must show even when the pass failed: it is what the alert watches
                changed = bool(result.published[name] or result.retried[name] or result.parked[name])
                with contextlib.suppress(*POSTGRES_FAILED):
                    await self._report_counts(route.outbox, changed=changed)
        return result

    async def _drain(self, route: Route, result: RelayResult, stop: asyncio.Event | None) -> None:
        """Claim, publish, mark, batch after batch; the next claim runs while the broker takes a batch."""
        leased_at = time.monotonic()  # the batch's lease runs from about now
        rows = await self._claim(route.outbox)
        claimed_at: float | None = None  # set for a batch claimed while the broker took the one before
        while rows:
            if claimed_at is not None and time.monotonic() - claimed_at > self._fresh_for_s:
                # that took long: too little of this batch's lease is left to publish and mark it
                # before another relay may claim it again; give it back and claim afresh
                await self._pool.execute(route.outbox.release_sql, [row["id"] for row in rows])
                leased_at = time.monotonic()
                rows, claimed_at = await self._claim(route.outbox), None
                continue
            publishing = asyncio.ensure_future(
                route.publisher.publish([route.outbox.to_message(row, route.task_name, route.queue) for row in rows])
            )
            more = len(rows) == self._batch_size and (stop is None or not stop.is_set())
            claim_started = time.monotonic()  # the next batch's lease runs from about now
            claiming = asyncio.ensure_future(self._claim(route.outbox)) if more else None
            claim_error: BaseException | None = None
            try:
                sent = await publishing
            finally:
                # the next claim is awaited whatever happens: never left running unowned (a claim
                # cancelled after it committed only delays its rows until their lease runs out)
                try:
                    next_rows = await claiming if claiming is not None else []
                except POSTGRES_FAILED as exc:
                    # the broker has this batch: it is marked below before the claim's error goes up,
                    # or it would all go out again once its lease ran out
                    next_rows, claim_error = [], exc
            await self._record(route.outbox, rows, sent, result, lease_ends=leased_at + self._lease_s)
            if claim_error is not None:
                raise claim_error
            if sent.unavailable is not None:
                await self._release(route.outbox, rows, sent, next_rows)
                return
            rows, claimed_at = next_rows, claim_started
            leased_at = claim_started

    async def _claim(self, outbox: Outbox) -> list[asyncpg.Record]:
        rows: list[asyncpg.Record] = await self._pool.fetch(outbox.claim_sql, self._batch_size, self._lease_s)
        if rows:
            checkpoints.reached("relay.after_claim")
        return rows

    async def _record(
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
        retried = len(sent.refused) - len(parked)
        result.published[name] += len(sent.sent)
        result.republished[name] += republished
        result.parked[name] += len(parked)
        result.retried[name] += retried
        metrics.OUTBOX_PUBLISHED.labels(name).inc(len(sent.sent))
        metrics.OUTBOX_REPUBLISHED.labels(name).inc(republished)
        metrics.OUTBOX_FAILED.labels(name).inc(len(parked))
        metrics.OUTBOX_RETRIED.labels(name).inc(retried)
        attempts = {row["id"]: row["publish_attempts"] for row in rows}
        for row_id, error in sent.refused.items():
            if row_id in parked:
                log.error(
                    "%s outbox row %d refused by the broker %d times, parked (publish_failed_at set): %s",
                    name,
                    row_id,
                    attempts[row_id],
                    error,
                    extra={"outbox": name, "row_id": row_id},
                )
            else:
                log.warning(
                    "%s outbox row %d refused by the broker (attempt %d of %d), retried later: %s",
                    name,
                    row_id,
                    attempts[row_id],
                    self._max_attempts,
                    error,
                    extra={"outbox": name, "row_id": row_id},
                )
        if sent.unavailable is not None:
            result.broker_unavailable = sent.unavailable
            metrics.OUTBOX_BROKER_UNAVAILABLE.labels(name).inc()

    async def _release(
        self, outbox: Outbox, rows: list[asyncpg.Record], sent: PublishResult, next_rows: list[asyncpg.Record]
    ) -> None:
        """The broker is unreachable: give back what was claimed and not sent, so it waits unleased."""
        done = set(sent.sent) | set(sent.refused)
        # after a timeout the thread may still be sending this batch: leave it to its lease
        unsent = [] if sent.timed_out else [row["id"] for row in rows if row["id"] not in done]
        unsent += [row["id"] for row in next_rows]
        if unsent:
            await self._pool.execute(outbox.release_sql, unsent)

    async def _settle(self, outbox: Outbox, sent: list[int], refused: dict[int, str], lease_ends: float) -> set[int]:
        """Mark what the broker took; lease the refused rows for their backoff, or park them. Returns the parked.

        Each statement is tried again while the batch's lease lasts: the broker has these messages, and a mark
        lost to a lock, a statement timeout or a blip of the database would send them all again once the lease
        ran out, with every process up. Past the lease another relay may have them: the error goes up.
        """
        if sent:
            await self._while_leased(outbox, "mark", len(sent), lease_ends, self._pool.execute, outbox.mark_sql, sent)
        if not refused:
            return set()
        args = (list(refused), list(refused.values()), self._max_attempts, self._retry_backoff_s)
        rows = await self._while_leased(
            outbox, "refusals", len(refused), lease_ends, self._pool.fetch, outbox.refuse_sql, *args
        )
        return {row["id"] for row in rows if row["parked"]}

    async def _while_leased(
        self, outbox: Outbox, what: str, count: int, lease_ends: float, run: Callable[..., Awaitable[T]], *args: Any
    ) -> T:
        pause_s = _SETTLE_FIRST_PAUSE_S
        while True:
            try:
                return await run(*args)
            # "not now" (a lock, a timeout) or no answer; a bug or a schema drift goes up at once
            except POSTGRES_UNAVAILABLE as exc:
                # the next try ends before the lease does, or not at all: past it, another relay may publish them
                next_ends = time.monotonic() + pause_s + (self._statement_s or self._lease_s)
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

    async def _report_counts(self, outbox: Outbox, *, changed: bool) -> None:
        # two indexed counts after a pass that moved rows; otherwise (idle, or the broker down while the
        # backlog grows and every flush's NOTIFY wakes every pod's relay) at most every COUNTS_INTERVAL_S
        now = time.monotonic()
        if not changed and now - self._counted_at.get(outbox.name, -COUNTS_INTERVAL_S) < COUNTS_INTERVAL_S:
            return
        self._counted_at[outbox.name] = now
        counts = await outbox_counts(self._pool, outbox)
        metrics.OUTBOX_OLDEST_AGE.labels(outbox.name).set(counts.oldest_owed_age_s or 0.0)
        metrics.OUTBOX_OWED.labels(outbox.name).set(counts.owed)
        metrics.OUTBOX_PARKED.labels(outbox.name).set(counts.parked)

    async def final_pass(self, timeout_s: float) -> None:
        """On shutdown, after the last flush: one bounded pass; what it cannot send waits for another pod."""
        try:
            async with asyncio.timeout(timeout_s):
                result = await self.relay_once()
        except POSTGRES_FAILED as exc:
            log.warning("outbox relay: final pass on shutdown did not finish (%r); the rows wait in the outbox", exc)
            return
        if result.did_something():
            log.info(
                "outbox relay: final pass on shutdown published %s",
                counts_text(result.published),
                extra={"count": sum(result.published.values())},
            )

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until `stop`: on each NOTIFY, every poll interval, and after a backoff while the broker is down."""
        listener: asyncpg.Connection | None = None

        async def step() -> bool:
            nonlocal listener
            listener = await self._ensure_listener(listener)
            return await self._pass(stop)

        try:
            # The relay is the only way out of the outboxes: if it died, every completion and email
            # would wait for ever with no alert. An error nobody foresaw is logged, and it backs off.
            await every(
                self._poll_s,
                stop,
                step,
                name="outbox relay",
                backoff=Backoff(0.5, self._max_backoff_s),
                wake=self._wake,
                errors=metrics.OUTBOX_RELAY_ERRORS,
                logger=log,
            )
        finally:
            if listener is not None:
                with contextlib.suppress(*POSTGRES_FAILED):
                    await listener.close(timeout=2)

    async def _pass(self, stop: asyncio.Event) -> bool:
        try:
            result = await self.relay_once(stop=stop)
        except POSTGRES_FAILED as exc:
            log.warning("outbox relay: database error, retrying: %r", exc, extra={"error": repr(exc)})
            return False
        if result.broker_unavailable is not None:
            log.warning(
                "outbox relay: broker unavailable (%s); retrying with backoff (at most %.0fs)",
                result.broker_unavailable,
                self._max_backoff_s,
            )
            return False
        if result.did_something():
            log.info(
                "outbox relay: tasks published %s (republished %s, refused and retried later %s, "
                "refused and parked %s)",
                counts_text(result.published),
                counts_text(result.republished),
                counts_text(result.retried),
                counts_text(result.parked),
                extra={"count": sum(result.published.values())},
            )
        return True

    async def _ensure_listener(self, listener: asyncpg.Connection | None) -> asyncpg.Connection | None:
        """A connection LISTENing on the writers' channel, reopened when lost; None means poll only."""
        if not self._listen_dsn:
            return None
        if listener is not None and not listener.is_closed():
            return listener
        try:
            listener = await asyncpg.connect(self._listen_dsn, timeout=self._connect_timeout_s, statement_cache_size=0)
            await listener.add_listener(NOTIFY_CHANNEL, self._on_notify)
        except POSTGRES_FAILED as exc:
            log.warning("outbox relay: cannot LISTEN (%r); polling every %.1fs", exc, self._poll_s)
            return None
        return listener

    def _on_notify(self, *_: object) -> None:
        self._wake.set()


def counts_text(by_outbox: dict[str, int]) -> str:
    """`completion 3, email 1`: counts by outbox for a log line or a command's summary."""
    return ", ".join(f"{name} {count}" for name, count in by_outbox.items())
