"""A per-user rate limit at the door, in process memory: no Redis call, bounded memory.

GCRA (a token bucket kept as one number): per user, the time at which the bucket will be full
again. A request is allowed while that time is at most `burst` intervals ahead of now; each allowed
request pushes it one interval further. A user whose time is in the past has a full bucket, the
same as no entry at all: such entries are what a sweep forgets when the table is full.
"""

import math
import time
from collections.abc import Callable

# 100k entries of int -> float: ~10 MB. Past it, idle users are forgotten first; if all are busy
# (a flood of distinct users), the oldest entries go: they start again with a full burst.
_MAX_USERS = 100_000


class RateLimiter:
    def __init__(
        self, *, per_second: float, burst: int, max_users: int = _MAX_USERS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = 1.0 / per_second
        self._window_s = burst * self._interval_s  # how far ahead the full-again time may be
        self._max_users = max_users
        self._clock = clock
        self._full_at: dict[int, float] = {}

    def allow(self, user_id: int, cost: float = 1.0) -> float | None:
        """None if allowed (and counted); else the seconds after which `cost` would be allowed."""
        now = self._clock()
        full_at = self._full_at.get(user_id, now)
        if full_at < now:
            full_at = now
        # how far ahead the bucket would be, from the difference first: `(now + x) - now` may round above
        # x, and refuse the burst's last request (the first one, with a burst of 1)
        ahead_s = (full_at - now) + cost * self._interval_s
        if ahead_s > self._window_s:
            return ahead_s - self._window_s
        if user_id not in self._full_at and len(self._full_at) >= self._max_users:
            self._forget(now)
        self._full_at[user_id] = now + ahead_s
        return None

    def tracked_users(self) -> int:
        return len(self._full_at)

    def _forget(self, now: float) -> None:
        active = {user: at for user, at in self._full_at.items() if at > now}
        if len(active) >= self._max_users * 0.9:
            # all busy: keep the newest half (dicts keep insertion order), so sweeps stay rare
            keep = list(active.items())[len(active) // 2 :]
            active = dict(keep)
        self._full_at = active


def retry_after_header(seconds: float) -> bytes:
    """Retry-After is whole seconds (RFC 9110); rounded up so a client that obeys is allowed."""
    return str(max(1, math.ceil(seconds))).encode()
