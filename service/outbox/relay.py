"""The relay: every committed outbox row reaches the broker, once unless a crash forces a republish.

Order per batch: claim (a lease, committed), publish, mark published. A relay killed between the
publish and the mark, or a database that refuses the mark for the whole lease, republishes that
batch with the same task ids once the lease runs out; at any other point nothing is sent twice.
Several relays (one per pod) take disjoint batches. It is the only publisher of both outboxes: the
writers (the flush, the email reservations) write rows and NOTIFY.

It wakes on NOTIFY from the writers, so a completion reaches the broker within about a second of
its flush, and polls every RELAY_POLL_INTERVAL_SECONDS in case a notification was missed (LISTEN
needs a real session: behind PgBouncer in transaction mode point RELAY_LISTEN_DATABASE_URL at
the primary, or poll only). Broker unreachable: rows wait, the relay backs off exponentially,
the age of the oldest owed row shows the lag; a temporary answer (BUSY, LOADING, throttling) is the same
outage. A row the broker refuses is retried with a doubling backoff, and parked after OUTBOX_MAX_ATTEMPTS.
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
from service.outbox.messages import Publisher
from service.outbox.outboxes import CLAIM_SQL, NOTIFY_CHANNEL, RELEASE_SQL, Outbox, outbox_counts
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


# what the final pass on shutdown leaves, logged when it is cut short: another pod sends it
_FINAL_PASS_LEFT = "final pass on shutdown: the rows wait in the outbox for another pod"


class Relay:
    def __init__(
        self,
        settings: RelaySettings,
        pool: asyncpg.Pool,
        routes: Sequence[Route],
        *,
        retry_backoff_s: float = RETRY_BACKOFF_S,
    ) -> None:
        self._pool = pool
        self._settler = Settler(pool, settings, retry_backoff_s)
        self._routes = list(routes)
        self._settings = settings
        self._wake = asyncio.Event()
        self._counted_at: dict[str, float] = {}  # by outbox: when its gauges were last counted

    async def relay_once(self, *, stop: asyncio.Event | None = None) -> RelayResult:
        """Publish everything owed now, batch by batch; stop early if the broker cannot be reached."""
        result = RelayResult()
        for route in self._routes:
            name = route.outbox.name
            for counts in (result.published, result.republished, result.parked, result.retried):
                counts.setdefault(name, 0)
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
        """Claim, publish, mark, batch after batch, until a batch comes back short, `stop`, or the broker is down."""
        outbox = route.outbox
        while True:
            leased_at = time.monotonic()  # the batch's lease runs from about now
            rows = await self._pool.fetch(outbox.sql(CLAIM_SQL), BATCH_SIZE, self._settings.lease_s)
            if not rows:
                return
            checkpoints.reached("relay.after_claim")
            with tracing.span("relay batch", outbox=outbox.name, rows=len(rows)):
                messages = [outbox.to_message(row, route.task_name, route.queue) for row in rows]
                sent = await route.publisher.publish(messages)
                await self._settler.record(outbox, rows, sent, result, lease_ends=leased_at + self._settings.lease_s)
            if sent.unavailable is not None:
                # unreachable, or slow: what was claimed and not sent goes back, to wait unleased
                done = set(sent.sent) | set(sent.refused)
                if unsent := [row["id"] for row in rows if row["id"] not in done]:
                    await self._pool.execute(outbox.sql(RELEASE_SQL), unsent)
                return
            if len(rows) < BATCH_SIZE or (stop is not None and stop.is_set()):
                return

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
                await self._pass(None)
        except TimeoutError:
            log.warning("outbox relay: cut at %gs; %s", timeout_s, _FINAL_PASS_LEFT)

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
                self._settings.poll_s,
                stop,
                step,
                name="outbox relay",
                backoff=Backoff(0.5, self._settings.max_backoff_s),
                wake=self._wake,
                errors=metrics.OUTBOX_RELAY_ERRORS,
                logger=log,
            )
        finally:
            if listener is not None:
                with contextlib.suppress(*POSTGRES_FAILED):
                    await listener.close(timeout=2)

    async def _pass(self, stop: asyncio.Event | None) -> bool:
        """One pass; `stop` None is the final pass on shutdown, which nothing retries."""
        then = (
            f"retrying with backoff (at most {self._settings.max_backoff_s:.0f}s)"
            if stop is not None
            else _FINAL_PASS_LEFT
        )
        try:
            result = await self.relay_once(stop=stop)
        except POSTGRES_FAILED as exc:
            log.warning("outbox relay: database error, %s: %r", then, exc, extra={"error": repr(exc)})
            return False
        if result.broker_unavailable is not None:
            log.warning("outbox relay: broker unavailable (%s); %s", result.broker_unavailable, then)
            return False
        if any(result.published.values()) or any(result.parked.values()) or any(result.retried.values()):
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
        dsn = self._settings.listen_dsn
        if not dsn:
            return None
        if listener is not None and not listener.is_closed():
            return listener
        try:
            listener = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_S, statement_cache_size=0)
            await listener.add_listener(NOTIFY_CHANNEL, lambda *_: self._wake.set())
        except POSTGRES_FAILED as exc:
            log.warning("outbox relay: cannot LISTEN (%r); polling every %.1fs", exc, self._settings.poll_s)
            return None
        return listener


def counts_text(by_outbox: dict[str, int]) -> str:
    """`completion 3, email 1`: counts by outbox for a log line or a command's summary."""
    return ", ".join(f"{name} {count}" for name, count in by_outbox.items())
