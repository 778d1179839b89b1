"""The background loop of every pod: pending Redis entries into Postgres, acked only after commit.

A batch is one step: claim (under a lease Redis scores), reserve exactly what was claimed from the
fleet's write budget (budget.py), write it in one statement on a connection taken for that statement
alone (none is held across a budget wait), ack, and give back the rows not written. Whatever stops a
batch before its ack (a failure, SIGTERM, a cancellation) puts its claim back at once; a pod killed
anywhere leaves it under lease, for any flusher to requeue. PROGRESS_FLUSH_CONCURRENCY drains per pod
run the batches; the statement (store.py) runs with statement_timeout and lock_timeout and skips the
rows other sessions hold, so a lock holds back only the keys behind it, and a table a migration locks
only its type. Types and shards take turns, a batch each, from a random first shard; a cycle claims at
most what each shard held when it began, and a shard whose Redis node is down waits for the next cycle.
"""

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import partial

import asyncpg

from service import checkpoints, metrics
from service.config import FlushSettings
from service.loops import Backoff, every
from service.postgres import local_timeouts_sql
from service.progress.backlog import Backlog, measure_backlog
from service.progress.budget import FlushBudget, Reservation
from service.progress.buffer import decode_value
from service.progress.content import CONTENT_KINDS, ContentKind
from service.progress.keys import KeyLayout, Shard, parse_member
from service.progress.leases import Claim, Leases
from service.progress.store import Heartbeat, persist_batch, report_batch
from service.redis_client import RedisClient, node_name
from service.stores import (
    POSTGRES_BUSY,
    POSTGRES_FAILED,
    POSTGRES_UNAVAILABLE,
    REDIS_FAILED,
    REDIS_UNAVAILABLE,
    pooled_connection,
)

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0

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
class _Quota:
    """What a cycle may still claim of one shard: what it held at the start (None: not known). A backlog that
    keeps growing cannot keep the cycle (and the types after it) going."""

    left: int | None

    def take(self, rows: int) -> int:
        if self.left is None:
            return rows
        taken = min(rows, self.left)
        self.left -= taken
        return taken


@dataclass
class _Cycle:
    """What the drains of one cycle share: the work left, the nodes down, and the counts."""

    work: deque[tuple[ContentKind, Shard, _Quota]]
    stop: asyncio.Event | None
    on_batch: OnBatch | None
    result: CycleResult = field(default_factory=CycleResult)
    unreachable: set[str] = field(default_factory=set)  # Redis nodes that failed: their shards wait
    requeued: set[Shard] = field(default_factory=set)  # shards whose expired leases were requeued
    failed: set[str] = field(default_factory=set)  # types a batch of which failed: no more of them this cycle

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()


class Flusher:
    @classmethod
    def from_settings(
        cls, settings: FlushSettings, redis: RedisClient, pool: asyncpg.Pool, budget: FlushBudget | None = None
    ) -> "Flusher":
        """`budget`: the pod's one budget, shared with degraded mode (a `flush --once` makes its own)."""
        return cls(
            redis=redis,
            pool=pool,
            layout=KeyLayout.from_settings(settings.buffer),
            budget=budget or FlushBudget.from_settings(settings, redis),
            lease_s=settings.lease_s,
            margin_s=settings.margin_s,
            interval_s=settings.interval_s,
            concurrency=settings.concurrency,
            shutdown_timeout_s=settings.shutdown_timeout_s,
            statement_timeout_s=settings.statement_timeout_s,
            lock_timeout_s=settings.lock_timeout_s,
            value_ttl_s=settings.value_ttl_s,
        )

    def __init__(
        self,
        *,
        redis: RedisClient,
        pool: asyncpg.Pool,
        layout: KeyLayout,
        budget: FlushBudget,
        lease_s: float,
        margin_s: float,
        interval_s: float,
        concurrency: int,
        shutdown_timeout_s: float,
        statement_timeout_s: float = 0.0,
        lock_timeout_s: float = 0.0,
        value_ttl_s: int = 3600,
    ) -> None:
        self._redis = redis
        self._pool = pool
        self._leases = Leases(redis, value_ttl_s=value_ttl_s)
        self._layout = layout
        self.budget = budget
        self._lease_ms = int(lease_s * 1000)
        self._margin_s = margin_s
        self._interval_s = interval_s
        self._concurrency = concurrency
        self._shutdown_timeout_s = shutdown_timeout_s
        self._timeouts_sql = local_timeouts_sql(statement_timeout_s=statement_timeout_s, lock_timeout_s=lock_timeout_s)
        self._measured_rows_per_s = 0.0  # this pod's own rate in its last cycle that wrote

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every interval until `stop`; then one last cycle within the shutdown timeout."""
        # The loop is the only way out of the buffer: if it died, every pending value would expire.
        # Jitter spreads the pods' cycles; a failed cycle is retried sooner, with exponential backoff. A cycle
        # begins an interval after the last one began: one that a locked type held for lock_timeout (its
        # drain waits, the others went on) delays no type's next turn.
        await every(
            self._interval_s,
            stop,
            partial(self._cycle, stop),
            name="flush cycle",
            jitter=0.1,
            from_start=True,
            backoff=Backoff(1.0, min(_MAX_BACKOFF_S, self._interval_s)),
            errors=metrics.FLUSH_CYCLE_ERRORS,
            logger=log,
        )
        try:
            async with asyncio.timeout(self._shutdown_timeout_s):
                result = await self.flush_cycle()
            log.info("final flush on shutdown: %d rows", result.written, extra={"count": result.written})
        except TimeoutError:
            log.warning(
                "final flush did not finish in %.0fs; unfinished batches were released to the pending "
                "set for another pod",
                self._shutdown_timeout_s,
            )
        except REDIS_FAILED as exc:
            log.warning("final flush failed: Redis unavailable (%s); the pending set keeps everything", exc)

    async def _cycle(self, stop: asyncio.Event) -> bool:
        try:
            result = await self.flush_cycle(stop=stop)
        except REDIS_FAILED as exc:
            log.warning("flush cycle failed: Redis unavailable (%s); retrying", exc)
            return False
        if result.batches:  # one line per cycle that did something: a heartbeat can be followed
            log.info(
                "flush cycle: %d rows written, %d completion events",
                result.written,
                result.completions,
                extra={"count": result.written},
            )
        return not result.failed_batches

    async def flush_cycle(self, stop: asyncio.Event | None = None, on_batch: OnBatch | None = None) -> CycleResult:
        """Drain every shard's pending set once. With `stop`, no new batch starts once it is set.

        The content types and their shards take turns, a batch each (see _work): under the budget a
        type with a few entries waits about one batch per other type, not for their whole backlogs.
        `on_batch` is told how many entries each batch took out of the buffer (a progress display).
        """
        started = time.monotonic()
        # what each shard holds now: the cycle claims no more than that (see _Quota)
        cycle = _Cycle(self._work(await measure_backlog(self._redis, self._layout)), stop, on_batch)
        # every drain is awaited to its end before an error goes up: none is left running unowned
        drains = min(self._concurrency, len(cycle.work))
        results = await asyncio.gather(*(self._drain(cycle) for _ in range(drains)), return_exceptions=True)
        for outcome in results:
            if isinstance(outcome, BaseException):
                raise outcome
        result = cycle.result
        if result.written:
            self._measured_rows_per_s = result.written / max(time.monotonic() - started, 1e-3)
        await self._record_backlog()
        if result.failed_batches == 0:
            metrics.FLUSH_LAST_SUCCESS.set_to_current_time()
        return result

    def _work(self, at_start: Backlog) -> deque[tuple[ContentKind, Shard, _Quota]]:
        """Every shard of every type that holds something, interleaved: one of each type in turn."""
        per_type = []
        for kind in CONTENT_KINDS:
            # a node that did not answer: no quota (the drains find out which node, and skip its shards)
            quotas = {shard: _Quota(at_start.by_shard.get(shard)) for shard in self._layout.shards_to_flush(kind.name)}
            shards = [shard for shard, quota in quotas.items() if quota.left != 0]
            if not shards:
                continue
            first = random.randrange(len(shards))  # pods start at different shards
            shards = shards[first:] + shards[:first]
            # fewer shards than drains (one on a standalone server): several drains share a shard
            shards = (shards * -(-self._concurrency // len(shards)))[: max(self._concurrency, len(shards))]
            per_type.append([(kind, shard, quotas[shard]) for shard in shards])
        return deque(item for items in itertools.zip_longest(*per_type) for item in items if item is not None)

    async def _drain(self, cycle: _Cycle) -> None:
        """Batches of the cycle's work until none is left: a batch of a shard, then it goes to the back."""
        while cycle.work and not cycle.stopped:
            kind, shard, quota = cycle.work.popleft()
            if await self._turn(cycle, kind, shard, quota):
                cycle.work.append((kind, shard, quota))

    async def _turn(self, cycle: _Cycle, kind: ContentKind, shard: Shard, quota: _Quota) -> bool:
        """One batch of `shard`, unless its node is down this cycle; True when the shard may hold more."""
        try:
            node = node_name(self._redis, shard.pending_key)
        except REDIS_UNAVAILABLE:
            node = "?"  # no master known for its slot yet: try it, and skip it if it fails
        if node in cycle.unreachable:
            cycle.result.failed_batches += 1
            return False
        try:
            if shard not in cycle.requeued:
                cycle.requeued.add(shard)
                if moved := await self._leases.requeue_expired(shard):
                    cycle.result.requeued += moved
                    metrics.FLUSH_REQUEUED.inc(moved)
                    log.warning(
                        "requeued %d entries whose lease expired (a flusher died)", moved, extra={"count": moved}
                    )
            return await self._batch(cycle, kind, shard, quota)
        except REDIS_UNAVAILABLE as exc:
            # that shard's node is down (or failing over): its members wait there, under lease if
            # claimed; the shards of the other nodes are still flushed
            cycle.unreachable.add(node)
            cycle.result.failed_batches += 1
            metrics.FLUSH_FAILURES.labels(kind.name).inc()
            log.warning("flush of %s skipped: Redis unavailable (%s: %s)", shard.pending_key, type(exc).__name__, exc)
            return False

    async def _batch(self, cycle: _Cycle, kind: ContentKind, shard: Shard, quota: _Quota) -> bool:
        """Claim, reserve, write, ack, settle one batch; True when it was full (the shard may hold more)."""
        rows = quota.take(self.budget.batch_rows)
        if not rows or kind.name in cycle.failed or cycle.stopped:
            return False
        claim = await self._leases.claim_batch(shard, count=rows, lease_ms=self._lease_ms)
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
                unsettled = await self._write(unsettled, kind, heartbeats, result)
        except POSTGRES_FAILED as exc:
            self._failed(claim, kind, exc, result)
            cycle.failed.add(kind.name)  # the rest of this type waits for the next cycle; the loop backs off
        finally:
            # the one way back for what was not acked (a failure, a stop, a cancellation): now, not after
            # the lease; and the budget's rows that were not written go back to the fleet
            if unsettled is not None:
                await asyncio.shield(self._leases.release(unsettled))
            if reservation is not None:
                await asyncio.shield(self.budget.refund(reservation, reservation.rows - result.written))
            for name in (f.name for f in fields(CycleResult)):
                setattr(cycle.result, name, getattr(cycle.result, name) + getattr(result, name))
        if result.failed_batches:
            return False
        if cycle.on_batch is not None:
            cycle.on_batch(len(claim.entries))
        return len(claim.entries) == rows

    async def _write(
        self, claim: Claim, kind: ContentKind, heartbeats: list[Heartbeat], result: CycleResult
    ) -> Claim | None:
        """One statement, then the ack; the keys a lock held go back to pending. None: all settled."""
        started = time.perf_counter()
        # the pool's acquire deadline; the timeouts for this transaction only (behind PgBouncer too)
        async with pooled_connection(self._pool) as conn, conn.transaction():
            if self._timeouts_sql:
                await conn.execute(self._timeouts_sql)
            batch = await persist_batch(conn, kind, heartbeats, margin_s=self._margin_s)
        checkpoints.reached("flush.after_commit")
        held = set(batch.locked)
        if held:
            await self._leases.release(replace(claim, entries=[entry for entry in claim.entries if entry[0] in held]))
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
        return None

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
                unusable.append((member, raw))
                continue
            try:
                content_id, user_id = parse_member(member)
                stored = decode_value(raw)
            except ValueError:  # not written by this service's script: retrying cannot help
                result.dropped += 1
                metrics.FLUSH_DROPPED.labels(kind.name).inc()
                log.error(
                    "unreadable pending entry dropped",
                    extra={"content_type": kind.name, "key": member, "error": repr(raw)[:200]},
                )
                unusable.append((member, raw))
                continue
            usable.append((member, raw))
            heartbeats.append(
                Heartbeat(
                    content_id, user_id, stored.position, stored.received_ms, stored.peak, stored.completion_floor_ms
                )
            )
        if unusable:
            unreadable = [member for member, raw in unusable if raw is not None]
            await self._leases.ack(replace(claim, entries=unusable), dropped=unreadable)
        return (replace(claim, entries=usable) if usable else None), heartbeats

    @staticmethod
    def _failed(claim: Claim, kind: ContentKind, exc: Exception, result: CycleResult) -> None:
        metrics.FLUSH_REQUEUED.inc(len(claim.entries))
        metrics.FLUSH_FAILURES.labels(kind.name).inc()
        # an outage (or a lock, a timeout) is expected weather; any other database error is a bug or a schema drift
        outage = isinstance(exc, POSTGRES_UNAVAILABLE)
        reason = ("database busy" if isinstance(exc, POSTGRES_BUSY) else "database unavailable") if outage else "error"
        log.log(
            logging.WARNING if outage else logging.ERROR,
            "batch of %d requeued: %s (%s: %s)",
            len(claim.entries),
            reason,
            type(exc).__name__,
            exc,
            extra={"content_type": kind.name, "batch_size": len(claim.entries)},
        )
        result.requeued, result.failed_batches = len(claim.entries), 1

    async def _record_backlog(self) -> None:
        # a node that does not answer counts as empty here; its shards' flush failures show it
        backlog = await measure_backlog(self._redis, self._layout)
        total = 0
        for content_type, sizes in backlog.by_type.items():
            metrics.PENDING_ENTRIES.labels(content_type).set(sizes.pending)
            metrics.IN_FLIGHT_ENTRIES.labels(content_type).set(sizes.in_flight)
            total += sizes.pending + sizes.in_flight
        metrics.FLUSH_DRAIN_SECONDS.set(self.budget.drain_s(total, self._measured_rows_per_s))
