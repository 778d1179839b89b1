"""The background loop of every pod: pending Redis entries into Postgres, acked only after commit.

Each cycle walks every shard of every content type (service/progress/keys.py), from a random
first shard so that pods do not all contend for the same one; a shard whose Redis node cannot be
reached is skipped for the cycle and the others are flushed.

The flush yields to the monolith's database: every batch first takes its rows from the fleet's write
budget (service/progress/budget.py), before it is claimed so that its lease does not tick while it
waits; its statement runs in a slot of an adaptive limit (service/progress/concurrency.py) and with
statement_timeout and lock_timeout. A content type's cycle takes at most what was pending when it
began, so a backlog of one type that keeps growing cannot keep the next types waiting.
"""

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import asyncpg

from service import checkpoints, metrics
from service.config import Settings
from service.loops import Backoff, every
from service.postgres import local_timeouts_sql
from service.progress.backlog import Backlog, measure_backlog
from service.progress.budget import FlushBudget, Reservation
from service.progress.buffer import decode_value, now_ms
from service.progress.concurrency import AdaptiveLimit
from service.progress.content import CONTENT_KINDS, ContentKind
from service.progress.keys import KeyLayout, Shard, parse_member, pending_member
from service.progress.leases import Claim, Leases
from service.progress.store import BatchResult, Heartbeat, persist_batch, report_batch, table_locks_sql
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

_LOCKED_SAMPLE = 10  # keys named in the line of a batch's locked rows


class _RowLocked(Exception):
    """A batch met a row's lock past the tables' (not a busy database): split it, and only its keys wait."""


@dataclass
class CycleResult:
    written: int = 0
    completions: int = 0
    dropped: int = 0
    expired: int = 0
    requeued: int = 0
    locked: int = 0  # entries left pending because another session held their rows
    batches: int = 0
    failed_batches: int = 0
    by_type: dict[str, int] = field(default_factory=dict)

    def add(self, other: "CycleResult") -> None:
        names = ("written", "completions", "dropped", "expired", "requeued", "locked", "batches", "failed_batches")
        for name in names:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for content_type, written in other.by_type.items():
            self.by_type[content_type] = self.by_type.get(content_type, 0) + written


@dataclass
class _Quota:
    """What a cycle may still claim of one shard: what it held at the cycle's start (None: not known).

    Per shard, not per type: a drain that takes a type's whole quota for its batch of one shard would
    leave the type's other shards nothing to claim while it waits for the budget.
    """

    left: int | None

    def take(self, rows: int) -> int:
        if self.left is None:
            return rows
        taken = min(rows, self.left)
        self.left -= taken
        return taken

    def give_back(self, rows: int) -> None:
        if self.left is not None:
            self.left += rows


@dataclass
class _Turn:
    """One content type in a cycle: whether a batch of it failed."""

    kind: ContentKind
    failed: bool = False  # its siblings claim no more this cycle: no point retrying at once


@dataclass
class _Cycle:
    """What the drains of one cycle share: the work left, the nodes down, and the counts."""

    work: deque[tuple[_Turn, Shard, _Quota]]
    stop: asyncio.Event | None
    on_batch: OnBatch | None
    result: CycleResult = field(default_factory=CycleResult)
    unreachable: set[str] = field(default_factory=set)  # Redis nodes that failed: their shards wait
    requeued: set[Shard] = field(default_factory=set)  # shards whose expired leases were requeued
    lease_expired: int = 0

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()


class Flusher:
    @classmethod
    def from_settings(cls, settings: Settings, redis: RedisClient, pool: asyncpg.Pool) -> "Flusher":
        return cls(
            redis=redis,
            pool=pool,
            layout=KeyLayout.from_settings(settings),
            batch_size=settings.progress_flush_batch_size,
            lease_s=settings.progress_flush_lease_seconds,
            margin_s=settings.progress_completion_margin_seconds,
            interval_s=settings.progress_flush_interval_seconds,
            concurrency=settings.progress_flush_concurrency,
            shutdown_timeout_s=settings.progress_shutdown_timeout_seconds,
            max_rows_per_second=settings.progress_flush_max_rows_per_second,
            statement_timeout_s=settings.database_statement_timeout_seconds,
            lock_timeout_s=settings.database_lock_timeout_seconds,
            value_ttl_s=settings.progress_position_ttl_seconds,
        )

    def __init__(
        self,
        *,
        redis: RedisClient,
        pool: asyncpg.Pool,
        layout: KeyLayout,
        batch_size: int,
        lease_s: float,
        margin_s: float,
        interval_s: float,
        concurrency: int,
        shutdown_timeout_s: float,
        max_rows_per_second: int = 0,
        statement_timeout_s: float = 0.0,
        lock_timeout_s: float = 0.0,
        value_ttl_s: int = 3600,
    ) -> None:
        self._redis = redis
        self._pool = pool
        self._leases = Leases(redis, value_ttl_s=value_ttl_s)
        self._layout = layout
        self._lease_ms = int(lease_s * 1000)
        self._margin_s = margin_s
        self._interval_s = interval_s
        self._concurrency = concurrency
        self._shutdown_timeout_s = shutdown_timeout_s
        self.budget = FlushBudget(redis, rows_per_second=max_rows_per_second, batch_size=batch_size)
        self.limit = AdaptiveLimit(max_limit=concurrency)
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
        at_start = await measure_backlog(self._redis, self._layout)
        cycle = _Cycle(self._work(at_start), stop, on_batch)
        # a drain per shard at most (no connection taken for nothing); every drain is awaited to its end
        # before an error goes up: none is left running unowned
        drains = min(self._concurrency, len(cycle.work))
        results = await asyncio.gather(*(self._drain(cycle) for _ in range(drains)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        total = cycle.result
        if cycle.lease_expired:
            total.requeued += cycle.lease_expired
            metrics.FLUSH_REQUEUED.inc(cycle.lease_expired)
            log.warning(
                "requeued %d entries whose lease expired (a flusher died or stalled)",
                cycle.lease_expired,
                extra={"count": cycle.lease_expired},
            )
        if total.written:
            self._measured_rows_per_s = total.written / max(time.monotonic() - started, 1e-3)
        await self._record_backlog()
        if total.failed_batches == 0:
            metrics.FLUSH_LAST_SUCCESS.set_to_current_time()
        return total

    def _work(self, at_start: Backlog) -> deque[tuple[_Turn, Shard, _Quota]]:
        """Every shard of every type that holds something, interleaved: one of each type in turn."""
        per_type = []
        for kind in CONTENT_KINDS:
            turn = _Turn(kind)
            # a node that did not answer: no quota (the drains find out which node, and skip its shards)
            quotas = {shard: _Quota(at_start.by_shard.get(shard)) for shard in self._layout.shards_to_flush(kind.name)}
            shards = [shard for shard, quota in quotas.items() if quota.left != 0]
            if not shards:
                continue
            first = random.randrange(len(shards))  # pods start at different shards
            shards = shards[first:] + shards[:first]
            # fewer shards than drains (one on a standalone server): several drains share a shard
            shards = (shards * -(-self._concurrency // len(shards)))[: max(self._concurrency, len(shards))]
            per_type.append([(turn, shard, quotas[shard]) for shard in shards])
        return deque(item for items in itertools.zip_longest(*per_type) for item in items if item is not None)

    async def _drain(self, cycle: "_Cycle") -> None:
        """Batches of the cycle's work until none is left: a batch of a shard, then it goes to the back."""
        try:
            # one connection for the whole drain: no pool round trip (and reset) per batch; giving it
            # back to the pool cannot fail the batches it persisted
            async with pooled_connection(self._pool) as conn:
                while cycle.work and not cycle.stopped:
                    turn, shard, quota = cycle.work.popleft()
                    if not turn.failed and await self._turn(conn, cycle, turn, shard, quota):
                        cycle.work.append((turn, shard, quota))
        except POSTGRES_FAILED as exc:
            # no connection to be had (down, full, refused our password): nothing was claimed, and the
            # types still to do wait for the next cycle
            waiting = sorted({turn.kind.name for turn, _, _ in cycle.work})
            for content_type in waiting:
                metrics.FLUSH_FAILURES.labels(content_type).inc()
            log.warning(
                "flush of %s skipped: database unavailable (%s: %s)",
                ", ".join(waiting),
                type(exc).__name__,
                exc,
                extra={"content_type": ",".join(waiting)},
            )
            cycle.result.failed_batches += 1

    async def _turn(
        self, conn: asyncpg.Connection, cycle: "_Cycle", turn: "_Turn", shard: Shard, quota: _Quota
    ) -> bool:
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
                moved = await self._leases.requeue_expired(shard)
                cycle.lease_expired += moved  # counted after the await: the drains add up, none overwrites
            return await self._batch(conn, cycle, turn, shard, quota)
        except REDIS_UNAVAILABLE as exc:
            # that shard's node is down (or failing over): its members wait there, under lease if
            # claimed; the shards of the other nodes are still flushed
            cycle.unreachable.add(node)
            cycle.result.failed_batches += 1
            metrics.FLUSH_FAILURES.labels(turn.kind.name).inc()
            log.warning(
                "flush of %s skipped: Redis unavailable (%s: %s)",
                shard.pending_key,
                type(exc).__name__,
                exc,
                extra={"content_type": turn.kind.name},
            )
            return False

    async def _batch(
        self, conn: asyncpg.Connection, cycle: "_Cycle", turn: "_Turn", shard: Shard, quota: _Quota
    ) -> bool:
        """Reserve, claim and persist one batch; True when it was full (the shard may hold more)."""
        rows = quota.take(self.budget.batch_rows)
        if not rows:
            return False
        # the budget first, the claim after: the lease starts when the batch may be written
        reservation: Reservation | None = None
        claimed = 0
        try:
            reservation = await self.budget.reserve(rows, cycle.stop)
            if reservation is not None and not turn.failed and not cycle.stopped:
                claim = await self._leases.claim_batch(shard, count=rows, lease_ms=self._lease_ms)
                claimed = len(claim.entries)
        finally:
            if claimed < rows:  # the shard had fewer, or the drain stops: later batches may go sooner
                quota.give_back(rows - claimed)
                if reservation is not None:
                    await asyncio.shield(self.budget.refund(reservation, rows - claimed))
        if not claimed:
            return False
        checkpoints.reached("flush.after_claim")
        try:
            batch = await self._persist(conn, claim, turn.kind)
        except BaseException:
            # whatever stopped it (a bug, a cancellation): the batch goes back now, not after its
            # lease, and not with a lease that only comes back to fail again with the same entry
            await asyncio.shield(self._leases.release(claim))
            if reservation is not None:
                await asyncio.shield(self.budget.refund(reservation, claimed))
            raise
        # what a lock (or a refusal) kept from the database is not the fleet's: a type that one lock holds
        # would otherwise spend a batch of the budget every cycle, and every other type would go slower
        unwritten = claimed if batch.failed_batches else batch.locked
        if reservation is not None and unwritten:
            await asyncio.shield(self.budget.refund(reservation, unwritten))
        cycle.result.add(batch)
        if batch.failed_batches:
            turn.failed = True  # its siblings leave the rest of this type pending; the loop backs off
            return False
        if cycle.on_batch is not None:
            cycle.on_batch(len(claim.entries))
        return claimed == rows

    async def _persist(self, conn: asyncpg.Connection, claim: Claim, kind: ContentKind) -> CycleResult:
        result = CycleResult(batches=1)
        heartbeats, usable, unusable = [], [], []
        for member, raw in claim.entries:
            heartbeat = self._read(kind, member, raw, result)
            if heartbeat is None:
                unusable.append((member, raw))
            else:
                heartbeats.append(heartbeat)
                usable.append((member, raw))
        if unusable:
            # nothing in them to persist or retry: settled now, so a failed batch cannot bring them back;
            # the unreadable values go with them (an expired one has none)
            unreadable = [member for member, raw in unusable if raw is not None]
            await self._leases.ack(replace(claim, entries=unusable), dropped=unreadable)
            claim = replace(claim, entries=usable)
        if not heartbeats:
            return result
        started = time.perf_counter()
        try:
            # a split on row locks stops at half the lease: settled before another pod may take the claim over
            batch = await self._persist_with_retry(
                conn, kind, heartbeats, until=time.monotonic() + self._lease_ms / 2000
            )
        except POSTGRES_FAILED as exc:
            await asyncio.shield(self._leases.release(claim))
            metrics.FLUSH_REQUEUED.inc(len(claim.entries))
            metrics.FLUSH_FAILURES.labels(kind.name).inc()
            outage = isinstance(exc, POSTGRES_UNAVAILABLE)
            # an outage (or a lock, a timeout) is expected weather; any other database error is a bug or a schema drift
            reason = "database busy" if isinstance(exc, POSTGRES_BUSY) else "database unavailable"
            log.log(
                logging.WARNING if outage else logging.ERROR,
                "batch of %d requeued: %s (%s: %s)",
                len(claim.entries),
                reason if outage else "database error",
                type(exc).__name__,
                exc,
                extra={"content_type": kind.name, "batch_size": len(claim.entries)},
            )
            result.requeued, result.failed_batches = len(claim.entries), 1
            return result
        except BaseException:
            # cancelled (shutdown timeout) or a bug: hand the batch back now rather than after the lease
            await asyncio.shield(self._leases.release(claim))
            raise
        checkpoints.reached("flush.after_commit")
        if batch.locked:
            claim = await self._leave_locked(claim, kind, batch.locked)
        # the values of unknown users or content go in the same script, unless written again since the claim
        await self._leases.ack(claim, dropped=batch.dropped)
        # the batch's oldest heartbeat: the lag an alert on "two flush intervals" cares about
        metrics.FLUSH_LAG_SECONDS.observe((now_ms() - min(hb.received_ms for hb in heartbeats)) / 1000)
        metrics.FLUSH_BATCH_SECONDS.labels(kind.name).observe(time.perf_counter() - started)
        metrics.FLUSH_ROWS.labels(kind.name).inc(batch.written)
        report_batch(kind, batch)
        result.written, result.completions, result.locked = batch.written, batch.completions, len(batch.locked)
        result.dropped += len(batch.dropped)
        result.by_type = {kind.name: batch.written}
        return result

    async def _leave_locked(self, claim: Claim, kind: ContentKind, locked: list[str]) -> Claim:
        """The entries whose rows another session holds go back to pending; the rest of the claim, to be acked."""
        held = set(locked)
        await self._leases.release(replace(claim, entries=[entry for entry in claim.entries if entry[0] in held]))
        metrics.FLUSH_LOCKED.labels(kind.name).inc(len(held))
        log.warning(
            "%d entries left pending: their rows are locked by another session (the rest of the batch was written)",
            len(held),
            extra={"content_type": kind.name, "count": len(held), "key": " ".join(locked[:_LOCKED_SAMPLE])},
        )
        return replace(claim, entries=[entry for entry in claim.entries if entry[0] not in held])

    @staticmethod
    def _read(kind: ContentKind, member: str, raw: bytes | None, result: CycleResult) -> Heartbeat | None:
        """The claimed entry as a heartbeat; None (logged and counted) when there is nothing to persist."""
        if raw is None:
            # the TTL passed before any flush: this position is lost, and that must show
            result.expired += 1
            metrics.FLUSH_EXPIRED.labels(kind.name).inc()
            log.error(
                "value expired before it was flushed: position lost", extra={"content_type": kind.name, "key": member}
            )
            return None
        try:
            content_id, user_id = parse_member(member)
            stored = decode_value(raw)
        except ValueError:
            # not written by this service's script: retrying cannot help
            result.dropped += 1
            metrics.FLUSH_DROPPED.labels(kind.name).inc()
            log.error(
                "unreadable pending entry dropped",
                extra={"content_type": kind.name, "key": member, "error": repr(raw)[:200]},
            )
            return None
        return Heartbeat(
            content_id, user_id, stored.position, stored.received_ms, stored.peak, stored.completion_floor_ms
        )

    async def _persist_with_retry(
        self, conn: asyncpg.Connection, kind: ContentKind, heartbeats: list[Heartbeat], *, until: float
    ) -> BatchResult:
        try:
            # a slot of the adaptive limit: its latency (or a table's lock, a timeout) says how many may run at once
            async with self.limit.slot():
                try:
                    return await self._persist_once(conn, kind, heartbeats)
                except asyncpg.ForeignKeyViolationError:
                    # a user or content was deleted between our check and the commit: the retry drops it
                    return await self._persist_once(conn, kind, heartbeats)
        except _RowLocked:
            # outside the slot: one row's lock says nothing of the database's latency
            if len(heartbeats) == 1 or time.monotonic() > until:
                return BatchResult(0, 0, [], [pending_member(hb.content_id, hb.user_id) for hb in heartbeats])
            half = len(heartbeats) // 2
            first = await self._persist_with_retry(conn, kind, heartbeats[:half], until=until)
            return first + await self._persist_with_retry(conn, kind, heartbeats[half:], until=until)

    async def _persist_once(
        self, conn: asyncpg.Connection, kind: ContentKind, heartbeats: list[Heartbeat]
    ) -> BatchResult:
        if not self._timeouts_sql:
            return await persist_batch(conn, kind, heartbeats, margin_s=self._margin_s, skip_locked=True)
        # The timeouts for this transaction only: a table held by a migration sends the batch back in
        # lock_timeout instead of queueing it, and the monolith's statements behind it. The upsert skips
        # the existing rows another session holds; a lock it still meets past the tables' (a row being
        # inserted by another session, a user row held FOR UPDATE against the foreign key's check at
        # commit) is a row's: the batch is split until the keys behind it are found, and they alone wait.
        tables_locked = False
        try:
            async with conn.transaction():
                await conn.execute(f"{self._timeouts_sql}; {table_locks_sql(kind)}")
                tables_locked = True
                return await persist_batch(conn, kind, heartbeats, margin_s=self._margin_s, skip_locked=True)
        except asyncpg.LockNotAvailableError as exc:
            if not tables_locked:
                raise
            raise _RowLocked(str(exc)) from exc

    async def _record_backlog(self) -> None:
        # a node that does not answer counts as empty here; its shards' flush failures show it
        backlog = await measure_backlog(self._redis, self._layout)
        total = 0
        for content_type, sizes in backlog.by_type.items():
            metrics.PENDING_ENTRIES.labels(content_type).set(sizes.pending)
            metrics.IN_FLIGHT_ENTRIES.labels(content_type).set(sizes.in_flight)
            total += sizes.pending + sizes.in_flight
        metrics.FLUSH_DRAIN_SECONDS.set(self.budget.drain_s(total, self._measured_rows_per_s))
