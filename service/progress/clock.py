"""This pod's clock against Redis's: the buffer orders a key's heartbeats by the receive time each pod stamps.

Two heartbeats of one listener can land on two pods; if one pod's clock lags the other's by more than the
time between them, the later heartbeat looks older and the stored one stands: an acknowledged position
lost. Every pod measures its offset from the Redis server's clock (TIME, the one clock all pods share, half
the round trip allowed for) and, past PROGRESS_MAX_CLOCK_SKEW_SECONDS, stops taking heartbeats: readiness
answers 503 naming the offset and each heartbeat gets 503 (the app sends it again, to a pod whose clock is
right), until the clock is back within the bound.
"""

import asyncio
import logging
import time
from collections.abc import Callable

from redis.asyncio import RedisCluster

from service import metrics
from service.loops import sample_every
from service.redis_client import RedisClient
from service.stores import REDIS_FAILED

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 10.0


class ClockCheck:
    def __init__(self, redis: RedisClient, *, max_skew_s: float, clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._clock = clock
        self.max_skew_s = max_skew_s
        self.skew_s = 0.0  # this pod's clock minus Redis's, at the last sample
        self.ok = True  # within the bound (or not measured yet: a Redis that does not answer is readiness' business)

    async def sample(self) -> None:
        sent = self._clock()
        if isinstance(self._redis, RedisCluster):
            seconds, micros = await self._redis.time(target_nodes=RedisCluster.RANDOM)
        else:
            seconds, micros = await self._redis.time()
        received = self._clock()
        self.skew_s = (sent + received) / 2 - (seconds + micros / 1e6)
        metrics.CLOCK_SKEW_SECONDS.set(self.skew_s)
        ok = not self.max_skew_s or abs(self.skew_s) <= self.max_skew_s
        if ok != self.ok:
            log.log(
                logging.INFO if ok else logging.ERROR,
                "pod clock %s: %+.3f s from Redis's (bound %g s)",
                "back within its bound, heartbeats taken again" if ok else "off, heartbeats refused (503)",
                self.skew_s,
                self.max_skew_s,
            )
        self.ok = ok

    def why(self) -> str:
        return f"this pod's clock is {self.skew_s:+.1f} s from Redis's (more than {self.max_skew_s:g} s)"

    async def run(self, stop: asyncio.Event, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        await sample_every(interval_s, stop, self.sample, name="clock check", unavailable=REDIS_FAILED, logger=log)
