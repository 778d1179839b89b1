"""One step per batch, the flush's unit of work: claim, reserve, write, ack, settle.

A batch is claimed under a lease Redis scores, reserves exactly what was claimed from the fleet's write
budget (budget.py), is written in one statement on a connection taken for that statement alone (none is
held across a budget wait), acked, and gives back the rows not written. Whatever stops a batch before
its ack (a failure, SIGTERM, a cancellation) puts its claim back at once; a pod killed anywhere leaves
it under lease, for any flusher to requeue. The statement (store.py) runs with statement_timeout and
lock_timeout and skips the rows other sessions hold, so a lock holds back only the keys behind it.
"""

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import asyncpg

from service import checkpoints, metrics, tracing
from service.config import FlushSettings
from service.postgres import local_timeouts_sql
from service.progress.content import ContentKind
from service.progress.flush.budget import FlushBudget, Reservation
from service.progress.flush.leases import Claim, Leases
from service.progress.flush.store import Heartbeat, persist_batch, report_batch
from service.progress.ingest.buffer import decode_value
from service.progress.keys import Shard, parse_member
from service.stores import POSTGRES_BUSY, POSTGRES_FAILED, POSTGRES_UNAVAILABLE, pooled_connection

log = logging.getLogger(__name__)

OnBatch = Callable[[int], None]  # entries a batch took out of the buffer


@dataclass
class CycleResult:
    written: int = 0
    completions: int = 0
    dropped: int = 0
    expired: int = 0
    requeued: int = 0
    locked: int = 0  # entries left pending because another session held a row they need
    batches: int = 0
    failed_batches: int = 0


@dataclass
class Cycle:
    """What the drains of one cycle share: the work left, the nodes down, and the counts."""

    work: deque[tuple[ContentKind, Shard]]
    # what the cycle may still claim of each shard: what it held at the start (None: not known), so a backlog
    # that keeps growing cannot keep the cycle (and the types after it) going
    left: dict[Shard, int | None]
    stop: asyncio.Event  # no new batch starts once it is set
    on_batch: OnBatch | None
    result: CycleResult = field(default_factory=CycleResult)
    unreachable: set[str] = field(default_factory=set)  # Redis nodes that failed: their shards wait
    requeued: set[Shard] = field(default_factory=set)  # shards whose expired leases were requeued
    failed: set[str] = field(default_factory=set)  # types a batch of which failed: no more of them this cycle


class BatchStep:
    """The batches of one pod's flusher: each drain of a cycle runs them, a shard's batch in its turn."""

    def __init__(self, settings: FlushSettings, pool: asyncpg.Pool, leases: Leases, budget: FlushBudget) -> None:
        self._pool = pool
        self._leases = leases
        self.budget = budget
        self._settings = settings
        # the timeouts for each batch's transaction only (behind PgBouncer too)
        self._timeouts_sql = local_timeouts_sql(
            statement_timeout_s=settings.statement_timeout_s, lock_timeout_s=settings.lock_timeout_s
        )

    async def run(self, cycle: Cycle, kind: ContentKind, shard: Shard) -> bool:
        """Claim, reserve, write, ack, settle one batch; True when it was full (the shard may hold more)."""
        left = cycle.left[shard]
        rows = self.budget.batch_rows if left is None else min(self.budget.batch_rows, left)
        cycle.left[shard] = None if left is None else left - rows
        if not rows or kind.name in cycle.failed or cycle.stop.is_set():
            return False
        claim = await self._leases.claim_batch(shard, count=rows, lease_ms=int(self._settings.lease_s * 1000))
        if not claim.entries:
            return False
        checkpoints.reached("flush.after_claim")
        result = CycleResult(batches=1)
        unsettled: Claim | None = claim
        reservation: Reservation | None = None
        try:
            unsettled, heartbeats = await self._readable(claim, kind, result)
            if unsettled is not None:
                reservation = await self.budget.reserve(len(heartbeats), cycle.stop)
                if reservation is None:
                    return False  # stopping: the claim goes back below
                await self._write(unsettled, kind, heartbeats, result)
                unsettled = None
        except POSTGRES_FAILED as exc:
            metrics.FLUSH_REQUEUED.inc(len(claim.entries))
            metrics.FLUSH_FAILURES.labels(kind.name).inc()
            # an outage (or a lock, a timeout) is expected weather; any other database error is a bug or a schema drift
            outage = isinstance(exc, POSTGRES_UNAVAILABLE)
            why = ("database busy" if isinstance(exc, POSTGRES_BUSY) else "database unavailable") if outage else "error"
            log.log(
                logging.WARNING if outage else logging.ERROR,
                "batch of %d requeued: %s (%s: %s)",
                len(claim.entries),
                why,
                type(exc).__name__,
                exc,
                extra={"content_type": kind.name, "batch_size": len(claim.entries)},
            )
            result.requeued, result.failed_batches = len(claim.entries), 1
            cycle.failed.add(kind.name)  # the rest of this type waits for the next cycle; the loop backs off
        finally:
            # the one way back for what was not acked (a failure, a stop, a cancellation): now, not after
            # the lease; and the budget's rows that were not written go back to the fleet
            if unsettled is not None:
                await asyncio.shield(self._leases.ack(unsettled, requeue=True))
            if reservation is not None:
                await asyncio.shield(self.budget.refund(reservation, reservation.rows - result.written))
            for f in fields(CycleResult):
                setattr(cycle.result, f.name, getattr(cycle.result, f.name) + getattr(result, f.name))
        if result.failed_batches:
            return False
        if cycle.on_batch is not None:
            cycle.on_batch(len(claim.entries))
        return len(claim.entries) == rows

    async def _write(self, claim: Claim, kind: ContentKind, heartbeats: list[Heartbeat], result: CycleResult) -> None:
        """One statement, then the ack; the keys a lock held go back to pending."""
        started = time.perf_counter()
        # the pool's acquire deadline, then the transaction's own timeouts
        with tracing.span("flush batch", content_type=kind.name, rows=len(heartbeats)) as span:
            async with pooled_connection(self._pool) as conn, conn.transaction():
                if self._timeouts_sql:
                    await conn.execute(self._timeouts_sql)
                batch = await persist_batch(conn, kind, heartbeats, margin_s=self._settings.margin_s)
            span.set_attribute("completions", batch.completions)
        checkpoints.reached("flush.after_commit")
        held = set(batch.locked)
        if held:
            held_back = [entry for entry in claim.entries if entry[0] in held]
            await self._leases.ack(replace(claim, entries=held_back), requeue=True)
            claim = replace(claim, entries=[entry for entry in claim.entries if entry[0] not in held])
            metrics.FLUSH_LOCKED.labels(kind.name).inc(len(held))
        # the values of unknown users or content go in the same script, unless written again since the claim
        await self._leases.ack(claim, dropped=batch.dropped)
        # the batch's oldest heartbeat against this pod's clock (a metric only): what "two intervals" alerts on
        oldest_ms = min(hb.received_ms for hb in heartbeats if hb.received_ms is not None)
        metrics.FLUSH_LAG_SECONDS.observe(max(0.0, time.time() - oldest_ms / 1000))
        metrics.FLUSH_BATCH_SECONDS.labels(kind.name).observe(time.perf_counter() - started)
        metrics.FLUSH_ROWS.labels(kind.name).inc(batch.written)
        report_batch(kind, batch)
        result.written, result.completions, result.locked = batch.written, batch.completions, len(held)
        result.dropped += len(batch.dropped)

    async def _readable(
        self, claim: Claim, kind: ContentKind, result: CycleResult
    ) -> tuple[Claim | None, list[Heartbeat]]:
        """The claim's heartbeats and what is left of the claim: entries with nothing to persist are settled now
        (a failed batch cannot bring them back), logged and counted; an unreadable value goes with its entry."""
        heartbeats: list[Heartbeat] = []
        usable: list[tuple[str, bytes | None]] = []
        unusable: list[tuple[str, bytes | None]] = []
        for member, raw in claim.entries:
            if raw is None:  # the TTL passed before any flush: this position is lost, and that must show
                result.expired += 1
                metrics.FLUSH_EXPIRED.labels(kind.name).inc()
                log.error(
                    "value expired before it was flushed: position lost",
                    extra={"content_type": kind.name, "key": member},
                )
            else:
                try:
                    content_id, user_id = parse_member(member)
                    heartbeats.append(Heartbeat(content_id, user_id, *decode_value(raw)))
                    usable.append((member, raw))
                    continue
                except ValueError:  # not written by this service's script: retrying cannot help
                    result.dropped += 1
                    metrics.FLUSH_DROPPED.labels(kind.name).inc()
                    log.error(
                        "unreadable pending entry dropped",
                        extra={"content_type": kind.name, "key": member, "error": repr(raw)[:200]},
                    )
            unusable.append((member, raw))
        if unusable:
            unreadable = [member for member, raw in unusable if raw is not None]
            await self._leases.ack(replace(claim, entries=unusable), dropped=unreadable)
        return (replace(claim, entries=usable) if usable else None), heartbeats
