"""How many flush statements may run at once: AIMD on their measured latency, as Netflix's concurrency-limits.

The signal is the database's own: a short average of statement latency against a long one (the recent
baseline). When the short one rises above `tolerance` times the baseline, or a statement is turned
away (lock_timeout, statement_timeout: POSTGRES_BUSY), the limit halves, down to 1; while latency is
normal it grows back by one slot every `limit` statements, up to the configured concurrency.
AIMD rather than a gradient limit: with 1-4 slots a proportional adjustment has nothing to be smooth
about, and a refusal by the database must halve at once, whatever latency said.
A statement started before the last decrease does not decrease again: its latency belongs to the old
limit, and a burst of slow statements in flight together halves once, not once each.
"""

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from service import metrics
from service.stores import POSTGRES_BUSY

_SHORT_ALPHA = 0.25  # about the last 7 statements
_LONG_ALPHA = 0.01  # about the last 200: the baseline follows a lasting change within minutes, not a spike


class AdaptiveLimit:
    def __init__(self, *, max_limit: int, tolerance: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_limit = max_limit
        self._clock = clock
        self._limit = float(max_limit)
        self._tolerance = tolerance
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._short_s: float | None = None
        self._baseline_s: float | None = None
        self._last_decrease = 0.0
        metrics.FLUSH_CONCURRENCY_LIMIT.set(self.limit)

    @property
    def limit(self) -> int:
        return max(1, int(self._limit))

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of `limit` slots around a statement; its latency (or its refusal) adjusts the limit."""
        while self._in_use >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._in_use += 1
        started = self._clock()
        try:
            yield
        except POSTGRES_BUSY:
            self._decrease(started)
            raise
        else:
            self._sample(started, self._clock() - started)
        finally:  # an outage or a cancellation is no latency sample; the slot is freed all the same
            self._in_use -= 1
            self._wake()

    def _sample(self, started: float, latency_s: float) -> None:
        if self._baseline_s is None or self._short_s is None:
            self._baseline_s = self._short_s = latency_s
            return
        self._short_s += _SHORT_ALPHA * (latency_s - self._short_s)
        self._baseline_s += _LONG_ALPHA * (latency_s - self._baseline_s)
        if self._short_s > self._tolerance * self._baseline_s:
            self._decrease(started)
        elif self._limit < self.max_limit:
            self._set(min(self.max_limit, self._limit + 1 / self._limit))

    def _decrease(self, started: float) -> None:
        if started < self._last_decrease:
            return
        self._last_decrease = self._clock()
        self._set(max(1.0, self._limit / 2))

    def _set(self, limit: float) -> None:
        self._limit = limit
        metrics.FLUSH_CONCURRENCY_LIMIT.set(self.limit)
        self._wake()

    def _wake(self) -> None:
        free = self.limit - self._in_use
        for waiter in list(self._waiters):
            if free <= 0:
                break
            if not waiter.done():
                waiter.set_result(None)
                free -= 1
