"""The fleet's write budget: rows per second for every row every pod writes to the monolith's tables.

The flush, degraded mode and the emails draw from it alike. A GCRA (a token bucket kept as one "theoretical
arrival time"): each batch reserves its rows with one script call and waits until its reservation starts.
Reservations follow one another on Redis's clock (TIME), not the pods', so a backlog drains at the budget's
pace, evenly, whatever the number of pods. The key lives on one hash slot (keys.FLUSH_BUDGET_KEY).

While the fleet's budget cannot be reached (Redis down, or refusing the script at `maxmemory`), each pod keeps
to its local share, the budget / PROGRESS_FLEET_MAX_PODS, so a fleet of at most that many pods stays within
the budget with Redis gone. It asks Redis again a second later.

The budget is a brake, and a brake must not become a stall:
- a wait is capped at a few batches' worth (`max_wait_s`), or at the caller's own deadline: past it nothing is
  reserved, and a stored time further ahead than any reservation of this budget can end (a Redis clock stepped
  back, a failover to a replica whose clock lags, a pod configured with a smaller budget) is not waited for;
- every wait ends on the stop event, and a reservation not used (stopped, cancelled) is given back.
"""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from redis.commands.core import AsyncScript

from service import metrics
from service.config import FlushSettings
from service.loops import sleep_unless_stopped
from service.progress.keys import FLUSH_BUDGET_KEY
from service.redis_client import RedisClient
from service.stores import REDIS_FAILED

log = logging.getLogger(__name__)

# KEYS: the budget key. ARGV: rows per second, rows wanted (negative: rows given back), the longest wait
# granted (µs), the horizon (µs): no reservation of this budget ends further ahead than that.
# Returns {1, wait µs} when reserved, {0, retry in µs} when the wait would pass the longest one granted
# (nothing is reserved then). The stored value is the end of the last reservation (µs of the server's
# clock). An idle budget lends no past time: a fleet that slept does not get a burst of everything it
# did not write, the first batch goes at once and the next one after it, at the budget's pace.
_RESERVE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local per_row = 1000000 / tonumber(ARGV[1])
local rows = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat > now + tonumber(ARGV[4]) then
  tat = now
end
local start, ends = math.max(tat, now), 0
if rows < 0 then
  -- rows reserved and not written (the claim found fewer): later reservations may start sooner
  start, ends = now, math.max(tat + rows * per_row, now)
elseif start - now > max_wait then
  return {0, math.floor(start - now - max_wait)}
else
  ends = start + rows * per_row
end
redis.call('SET', KEYS[1], string.format('%.0f', ends), 'PX', math.max(1, math.ceil((ends - now) / 1000)) + 1000)
return {1, math.floor(start - now)}
"""

# after a refusal, the pod keeps to its local share this long before it asks Redis again: a Redis that does not
# answer (blackholed: a socket timeout per ask) costs degraded mode's requests no wait
_REDIS_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Reservation:
    rows: int
    local: bool  # taken from the pod's local share: the fleet's budget could not be reached


class FlushBudget:
    """`reserve(rows)` waits for the budget; `refund(reservation, rows)` gives back rows not written."""

    @classmethod
    def from_settings(cls, settings: FlushSettings, redis: RedisClient) -> "FlushBudget":
        return cls(
            redis,
            rows_per_second=settings.max_rows_per_second,
            batch_size=settings.batch_size,
            fleet_max_pods=settings.fleet_max_pods,
        )

    def __init__(
        self, redis: RedisClient, *, rows_per_second: int, batch_size: int = 500, fleet_max_pods: int = 1
    ) -> None:
        self._script: AsyncScript = redis.register_script(_RESERVE)
        self.rows_per_second = rows_per_second
        self.local_rows_per_second = rows_per_second / fleet_max_pods
        # a batch is at most one second of the budget: a small budget is paced within the second too
        self.batch_rows = min(batch_size, max(1, rows_per_second)) if rows_per_second > 0 else batch_size
        batch_s = self.batch_rows / rows_per_second if rows_per_second > 0 else 0.0
        self.max_wait_s = max(1.0, 4 * batch_s)  # the longest a reservation waits: four batches, at least a second
        # twice what a reservation of this budget can reach: pods of one fleet share these settings
        self._horizon_s = 2 * (self.max_wait_s + batch_s)
        self._local_until = 0.0  # the local share's own GCRA (time.monotonic())
        self._redis_retry_at: float | None = None  # while the fleet's budget cannot be reached: when to ask again

    @property
    def limited(self) -> bool:
        return self.rows_per_second > 0

    async def reserve(
        self, rows: int, stop: asyncio.Event | None = None, *, max_wait_s: float | None = None
    ) -> Reservation | None:
        """Take `rows` and sleep until they may be written; None when `stop` came first, or when they do not
        fit within `max_wait_s` (one ask, for a request's deadline). Nothing stays reserved when this returns
        None or is cancelled."""
        if not self.limited or rows <= 0:
            return Reservation(rows, local=False)
        waited = time.monotonic()
        longest_s = self.max_wait_s if max_wait_s is None else min(self.max_wait_s, max_wait_s)
        try:
            while True:
                reservation, wait_s = await self._ask(rows, longest_s, bounded=max_wait_s is not None)
                if reservation is None and max_wait_s is not None:
                    return None
                stopped = True  # unless the wait ends: cancelled (the final flush's deadline, a request gone) too
                try:
                    stopped = wait_s > 0 and await sleep_unless_stopped(stop or asyncio.Event(), wait_s)
                finally:
                    if stopped and reservation is not None:  # its rows go back
                        await asyncio.shield(self.refund(reservation, rows))
                if stopped:
                    return None
                if reservation is not None:
                    return reservation
        finally:  # a cancelled or stopped wait counts for what it lasted
            metrics.FLUSH_BUDGET_WAIT_SECONDS.inc(time.monotonic() - waited)

    async def refund(self, reservation: Reservation, rows: int) -> None:
        """Give back `rows` of `reservation` that were not written; a refund that fails only slows the fleet."""
        if not self.limited or rows <= 0:
            return
        if reservation.local:
            self._local_until = max(time.monotonic(), self._local_until - rows / self.local_rows_per_second)
            return
        with contextlib.suppress(*REDIS_FAILED):
            await self._script(keys=[FLUSH_BUDGET_KEY], args=self._args(-rows, self.max_wait_s))

    async def _ask(self, rows: int, longest_s: float, *, bounded: bool) -> tuple[Reservation | None, float]:
        """(the reservation or None, seconds to wait: for it, or before asking again). `bounded`: a request's ask,
        whose Redis call gets `longest_s` at most (a stalled Redis would take the request's deadline with it)."""
        if self._redis_retry_at is None or time.monotonic() >= self._redis_retry_at:
            try:
                async with asyncio.timeout(longest_s if bounded else None):
                    granted, wait_us = await self._script(keys=[FLUSH_BUDGET_KEY], args=self._args(rows, longest_s))
            except REDIS_FAILED as exc:  # TimeoutError (the bound above) among them: an OSError
                if self._redis_retry_at is None:
                    log.warning(
                        "write budget: the fleet's budget cannot be reached (%s: %s); this pod keeps to its share, "
                        "%g rows/s",
                        type(exc).__name__,
                        exc,
                        self.local_rows_per_second,
                    )
                self._redis_retry_at = time.monotonic() + _REDIS_RETRY_S
            else:
                if self._redis_retry_at is not None:
                    self._redis_retry_at = None
                    log.info("write budget: Redis takes the fleet's budget again")
                return (Reservation(rows, local=False) if granted else None), wait_us / 1_000_000
        metrics.FLUSH_BUDGET_FALLBACK.inc()
        now = time.monotonic()
        start = max(self._local_until, now)
        if start - now > longest_s:
            return None, start - now - longest_s
        self._local_until = start + rows / self.local_rows_per_second
        return Reservation(rows, local=True), start - now

    def _args(self, rows: int, longest_s: float) -> list[float]:
        return [self.rows_per_second, rows, round(longest_s * 1e6), round(self._horizon_s * 1e6)]
