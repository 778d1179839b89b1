"""The fleet's write budget: rows per second for every flusher of every pod together, shared through Redis.

A GCRA (a token bucket kept as one "theoretical arrival time"): each batch reserves its rows with one
script call before it is claimed, and waits until its reservation starts. Reservations follow one
another on the server's clock (TIME), not the pods' clocks, so a backlog drains at the budget's pace,
evenly, whatever the number of pods; a pod never needs to know how many others there are.
The key lives on one hash slot (keys.FLUSH_BUDGET_KEY): on a cluster, every pod asks the same master.
"""

import asyncio
import time

from redis.commands.core import AsyncScript

from service import metrics
from service.clients import RedisClient
from service.progress.keys import FLUSH_BUDGET_KEY

# KEYS: the budget key. ARGV: rows per second, rows wanted (negative: rows given back).
# Returns how long to wait (µs) before the rows may be written. The stored value is the end of the
# last reservation (µs of the server's clock). An idle budget lends no past time: a fleet that slept
# does not get a burst of everything it did not write, the first batch goes at once and the next
# one after it, at the budget's pace.
_RESERVE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local per_row = 1000000 / tonumber(ARGV[1])
local rows = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local start = math.max(tat, now)
local ends = start + rows * per_row
if rows < 0 then
  -- rows reserved and not written (the claim found fewer): later reservations may start sooner
  ends = math.max(tat + rows * per_row, now)
  start = now
end
redis.call('SET', KEYS[1], string.format('%.0f', ends), 'PX', math.max(1, math.ceil((ends - now) / 1000)) + 1000)
return math.floor(math.max(0, start - now))
"""


class FlushBudget:
    """`reserve(rows)` waits for the fleet's budget; `refund(rows)` gives back rows reserved and not written."""

    def __init__(self, redis: RedisClient, *, rows_per_second: int) -> None:
        self._script: AsyncScript = redis.register_script(_RESERVE)
        self.rows_per_second = rows_per_second

    @property
    def limited(self) -> bool:
        return self.rows_per_second > 0

    async def reserve(self, rows: int) -> float:
        """Take `rows` from the budget and sleep until they may be written; returns the seconds waited."""
        if not self.limited or rows <= 0:
            return 0.0
        wait_us: int = await self._script(keys=[FLUSH_BUDGET_KEY], args=[self.rows_per_second, rows])
        wait_s = wait_us / 1_000_000
        if wait_s > 0:
            started = time.monotonic()
            try:
                await asyncio.sleep(wait_s)
            finally:  # a cancelled wait (shutdown) counts for what it lasted
                metrics.FLUSH_BUDGET_WAIT_SECONDS.inc(time.monotonic() - started)
        return wait_s

    async def refund(self, rows: int) -> None:
        if self.limited and rows > 0:
            await self._script(keys=[FLUSH_BUDGET_KEY], args=[self.rows_per_second, -rows])

    def drain_s(self, backlog: int, measured_rows_per_s: float) -> float:
        """The backlog's estimated drain time: at the budget when there is one, else at the rate measured."""
        if backlog <= 0:
            return 0.0
        rate = self.rows_per_second if self.limited else measured_rows_per_s
        return backlog / rate if rate > 0 else float("inf")
