"""The background loop of every pod: pending Redis entries into Postgres, acked only after commit.

PROGRESS_FLUSH_CONCURRENCY drains per pod run the batches (batch.py), so a lock holds back only the keys behind it,
and a table a migration locks only its type. Types and shards take turns, a batch each, from a random
first shard; a cycle claims at most what each shard held when it began, and a shard whose Redis node is
down waits for the next cycle.
"""

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from functools import partial

import asyncpg

from service import metrics
from service.config import FlushSettings
from service.loops import Backoff, every
from service.progress.content import CONTENT_KINDS, ContentKind
from service.progress.flush.backlog import Backlog, measure_backlog
from service.progress.flush.batch import BatchStep, Cycle, CycleResult, OnBatch
from service.progress.flush.budget import FlushBudget
from service.progress.flush.leases import Leases
from service.progress.keys import KeyLayout, Shard
from service.redis_client import RedisClient, node_name
from service.stores import REDIS_FAILED, REDIS_UNAVAILABLE

log = logging.getLogger(__name__)


class Flusher:
    def __init__(
        self, settings: FlushSettings, redis: RedisClient, pool: asyncpg.Pool, budget: FlushBudget | None = None
    ) -> None:
        """`budget`: the pod's one budget, shared with degraded mode (a `flush --once` makes its own)."""
        self._redis = redis
        self._leases = Leases(redis, value_ttl_s=settings.value_ttl_s)
        self._layout = KeyLayout.from_settings(settings.buffer)
        self.budget = budget or FlushBudget.from_settings(settings, redis)
        self._settings = settings
        self._measured_rows_per_s = 0.0  # this pod's own rate in its last cycle that wrote
        self._step = BatchStep(settings, pool, self._leases, self.budget)

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every interval until `stop`; then one last cycle within the shutdown timeout."""
        # The loop is the only way out of the buffer. Jitter spreads the pods' cycles; a failed cycle is retried
        # sooner, with backoff. A cycle begins an interval after the last one began: one that a locked type held
        # for lock_timeout delays no type's next turn.
        metrics.FLUSH_INTERVAL.set(self._settings.interval_s)
        await every(
            self._settings.interval_s,
            stop,
            partial(self._cycle, stop),
            name="flush cycle",
            jitter=0.1,
            from_start=True,
            backoff=Backoff(1.0, min(30.0, self._settings.interval_s)),
            errors=metrics.FLUSH_CYCLE_ERRORS,
            logger=log,
        )
        try:
            async with asyncio.timeout(self._settings.shutdown_timeout_s):
                result = await self.flush_cycle()
            log.info("final flush on shutdown: %d rows", result.written, extra={"count": result.written})
        except TimeoutError:
            log.warning(
                "final flush did not finish in %.0fs; unfinished batches were released to the pending "
                "set for another pod",
                self._settings.shutdown_timeout_s,
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
        """Drain every shard's pending set once (see _work); with `stop`, no new batch starts once it is set.
        `on_batch` is told how many entries each batch took out of the buffer (a progress display)."""
        started = time.monotonic()
        # what each shard holds now: the cycle claims no more than that (see Cycle.left)
        at_start = await measure_backlog(self._redis, self._layout)
        cycle = Cycle(self._work(at_start), at_start.by_shard, stop or asyncio.Event(), on_batch)
        # every drain is awaited to its end before an error goes up: none is left running unowned
        drains = min(self._settings.concurrency, len(cycle.work))
        for outcome in await asyncio.gather(*(self._drain(cycle) for _ in range(drains)), return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        result = cycle.result
        if result.written:
            self._measured_rows_per_s = result.written / max(time.monotonic() - started, 1e-3)
        await self._record_backlog()
        if result.failed_batches == 0:
            metrics.FLUSH_LAST_SUCCESS.set_to_current_time()
        return result

    def _work(self, at_start: Backlog) -> deque[tuple[ContentKind, Shard]]:
        """Every shard of every type that holds something, interleaved: one of each type in turn, so under the
        budget a type with a few entries waits about one batch per other type, not for their whole backlogs."""
        drains = self._settings.concurrency
        per_type = []
        for kind in CONTENT_KINDS:
            # a node that did not answer: None, not 0 (the drains find out which node, and skip its shards)
            shards = [shard for shard in self._layout.shards_to_flush(kind.name) if at_start.by_shard[shard] != 0]
            if not shards:
                continue
            first = random.randrange(len(shards))  # pods start at different shards
            shards = shards[first:] + shards[:first]
            # fewer shards than drains (one on a standalone server): several drains share a shard
            shards = (shards * -(-drains // len(shards)))[: max(drains, len(shards))]
            per_type.append([(kind, shard) for shard in shards])
        return deque(item for items in itertools.zip_longest(*per_type) for item in items if item is not None)

    async def _drain(self, cycle: Cycle) -> None:
        """Batches of the cycle's work until none is left: a batch of a shard, then it goes to the back, unless its
        node is down this cycle or it holds no more."""
        while cycle.work and not cycle.stop.is_set():
            kind, shard = cycle.work.popleft()
            try:
                node = node_name(self._redis, shard.pending_key)
            except REDIS_UNAVAILABLE:
                node = "?"  # no master known for its slot yet: try it, and skip it if it fails
            if node in cycle.unreachable:
                cycle.result.failed_batches += 1
                continue
            try:
                if shard not in cycle.requeued:
                    cycle.requeued.add(shard)
                    if moved := await self._leases.requeue_expired(shard):
                        cycle.result.requeued += moved
                        metrics.FLUSH_REQUEUED.inc(moved)
                        log.warning(
                            "requeued %d entries whose lease expired (a flusher died)", moved, extra={"count": moved}
                        )
                if await self._step.run(cycle, kind, shard):
                    cycle.work.append((kind, shard))
            except REDIS_UNAVAILABLE as exc:
                # that shard's node is down (or failing over): its members wait there, under lease if
                # claimed; the shards of the other nodes are still flushed
                cycle.unreachable.add(node)
                cycle.result.failed_batches += 1
                metrics.FLUSH_FAILURES.labels(kind.name).inc()
                log.warning(
                    "flush of %s skipped: Redis unavailable (%s: %s)", shard.pending_key, type(exc).__name__, exc
                )

    async def _record_backlog(self) -> None:
        # a node that does not answer counts as empty here; its shards' flush failures show it
        backlog = await measure_backlog(self._redis, self._layout)
        total = 0
        for content_type, sizes in backlog.by_type.items():
            metrics.PENDING_ENTRIES.labels(content_type).set(sizes.pending)
            metrics.IN_FLIGHT_ENTRIES.labels(content_type).set(sizes.in_flight)
            total += sizes.pending + sizes.in_flight
        # the backlog's estimated drain time: at the budget when there is one, else at the rate measured
        rate = self.budget.rows_per_second if self.budget.limited else self._measured_rows_per_s
        metrics.FLUSH_DRAIN_SECONDS.set(total / rate if rate > 0 else float("inf") if total else 0.0)
