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
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from service import checkpoints, metrics, tracing
from service.config import RelaySettings
from service.loops import Backoff, every
from service.outbox.messages import Publisher, PublishResult
from service.outbox.outboxes import NOTIFY_CHANNEL, Outbox, outbox_counts, publish_budget_s
from service.outbox.settle import RelayResult, Settler
from service.postgres import CONNECT_TIMEOUT_S
from service.stores import POSTGRES_FAILED

log = logging.getLogger(__name__)

# how stale the owed/parked/oldest gauges may be while no row moves (the lag alert waits minutes)
COUNTS_INTERVAL_S = 5.0
# rows per claim, one publish call and one mark statement each: the broker takes a batch of 500 in one call
BATCH_SIZE = 500
# a refused message is claimed again after 45 s, 90 s, 3 min, ... (doubling): with OUTBOX_MAX_ATTEMPTS at
# 12, about 25 h from the first refusal to the last, as Sidekiq's retries
RETRY_BACKOFF_S = 45.0


@dataclass(frozen=True, slots=True)
class Route:
    """An outbox, the publisher its messages go to, and the Celery task and queue they name."""

    outbox: Outbox
    publisher: Publisher
    task_name: str
    queue: str


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
        self._settler = Settler(
            pool=pool,
            lease_s=lease_s,
            statement_timeout_s=statement_timeout_s,
            max_attempts=max_attempts,
            retry_backoff_s=retry_backoff_s,
        )
        self._routes = list(routes)
        self._batch_size = batch_size
        self._lease_s = lease_s
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
            # open before the publish task is made (it copies the context): its publish spans are this one's children
            with tracing.span("relay batch", outbox=route.outbox.name, rows=len(rows)):
                publishing = asyncio.ensure_future(
                    route.publisher.publish(
                        [route.outbox.to_message(row, route.task_name, route.queue) for row in rows]
                    )
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
                await self._settler.record(route.outbox, rows, sent, result, lease_ends=leased_at + self._lease_s)
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

    async def _release(
        self, outbox: Outbox, rows: list[asyncpg.Record], sent: PublishResult, next_rows: list[asyncpg.Record]
    ) -> None:
        """The broker is unreachable, or slow: give back what was claimed and not sent, so it waits unleased."""
        done = set(sent.sent) | set(sent.refused)
        unsent = [row["id"] for row in rows if row["id"] not in done] + [row["id"] for row in next_rows]
        if unsent:
            await self._pool.execute(outbox.release_sql, unsent)

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
