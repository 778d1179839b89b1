"""The two shapes of everything that runs on its own here, each written once: `every` (a step every interval until a
stop event; `sample_every` for the samplers) and `run_until_stopped` (a long-running command until SIGTERM or Ctrl-C).
"""

import asyncio
import logging
import random
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import Counter

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Backoff:
    """After the n-th failed step in a row, the next one comes `first_s * 2 ** (n - 1)` later, at most `max_s`."""

    first_s: float
    max_s: float

    def delay_s(self, failures: int) -> float:
        return min(self.max_s, self.first_s * 2.0 ** (failures - 1))


async def every(
    interval_s: float,
    stop: asyncio.Event,
    step: Callable[[], Awaitable[bool]],
    *,
    name: str,
    jitter: float = 0.0,
    backoff: Backoff | None = None,
    wake: asyncio.Event | None = None,
    wait_first: bool = False,
    from_start: bool = False,
    errors: Counter | None = None,
    logger: logging.Logger = log,
) -> None:
    """Run `step` every `interval_s` until `stop` is set; a step in hand finishes, then this returns.

    `step` returns False when it failed in a way it has logged itself (a store is down): with
    `backoff`, the next step follows the backoff instead of the interval. An exception it lets out is
    a bug: logged with its traceback, counted in `errors`, taken as a failure, and the loop goes on,
    because for the flusher or the relay a dead loop would be a silent loss.
    `jitter` (0.1: ±10 %) spreads the pods' steps apart; `wake` (the relay's NOTIFY) cuts short the
    wait after a successful step, not a backoff. With `from_start`, the wait (interval or backoff) counts from
    the step's start, and at least a tenth of it follows the step (the flusher: a cycle that one locked type
    held for lock_timeout must not push every other type's next cycle back).
    """
    if wait_first and await sleep_unless_stopped(stop, interval_s):
        return
    failures = 0
    while not stop.is_set():
        if wake is not None:
            wake.clear()  # what woke it is the step's to handle now
        started = asyncio.get_running_loop().time()
        try:
            succeeded = await step()
        except Exception:
            succeeded = False
            if errors is not None:
                errors.inc()
            logger.exception("%s failed unexpectedly; retrying", name)
        failures = 0 if succeeded else failures + 1
        took_s = asyncio.get_running_loop().time() - started if from_start else 0.0
        if failures and backoff is not None:
            await sleep_unless_stopped(stop, _left_of(backoff.delay_s(failures), took_s))
        else:
            delay_s = interval_s * random.uniform(1 - jitter, 1 + jitter)
            await sleep_unless_stopped(stop, _left_of(delay_s, took_s), wake)


def _left_of(delay_s: float, took_s: float) -> float:
    return max(delay_s / 10, delay_s - took_s)


async def sample_every(
    interval_s: float,
    stop: asyncio.Event,
    sample: Callable[[], Awaitable[object]],
    *,
    name: str,
    unavailable: tuple[type[BaseException], ...],
    logger: logging.Logger = log,
) -> None:
    """`every` for a sampler off the request path (a gauge, a check): a store that does not answer (`unavailable`)
    is a debug line and the sample waits for the next interval; readiness and the write metrics report the outage,
    and what the sample set keeps its last value."""

    async def step() -> bool:
        try:
            await sample()
        except unavailable as exc:
            logger.debug("%s skipped: %s", name, exc)
            return False
        return True

    await every(interval_s, stop, step, name=name, logger=logger)


async def sleep_unless_stopped(stop: asyncio.Event, timeout_s: float, wake: asyncio.Event | None = None) -> bool:
    """Until `stop`, `wake` or the timeout, whichever comes first; True when stopped.

    Every wait of a loop or of a brake goes through here, so that SIGTERM ends it (the budget's too).
    """
    waits = [asyncio.ensure_future(event.wait()) for event in (stop, wake) if event is not None]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waits:
            waiter.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    return stop.is_set()


def run_until_stopped(main: Callable[[asyncio.Event], Coroutine[Any, Any, T]]) -> T:
    """Run `main(stop)` to its end; SIGTERM or Ctrl-C sets `stop`: the work in hand finishes, then it returns.

    A command stopped this way returns normally (and its process exits 0): for an orchestrator, a
    pod told to stop that stops is a success.
    """

    async def until_stopped() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    return asyncio.run(until_stopped())
